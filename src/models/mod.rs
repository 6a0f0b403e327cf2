//! Model families and their registry: the one place shared code finds a family (by a config's
//! [`Family`], a descriptor, a config.json's architecture or an llm.c file's magic). A family is
//! one file implementing [`family::Arch`] (GPT-2), or, for a Llama-style model, a
//! [`decoder::DecoderFamily`] on the decoder written once in [`decoder`] (Llama, Qwen2, Qwen3).
//! Adding a family means adding its file and one line to [`FAMILIES`]. The activations a
//! family's block keeps are described by [`acts`].

pub mod acts;
pub mod decoder;
pub mod family;
pub mod gpt2;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use crate::core::config::{Family, ModelConfig};
use crate::core::params::{ParamLayout, Weights};
use crate::core::rng::Mt19937;
use anyhow::{bail, Context, Result};
use decoder::Decoder;
use family::Arch;
use std::path::Path;

/// Every family llmrs has.
pub static FAMILIES: &[&dyn Arch] =
    &[&gpt2::Gpt2, &Decoder(llama::Llama), &Decoder(qwen2::Qwen2), &Decoder(qwen3::Qwen3)];

/// The family named `name`.
pub fn by_name(name: &str) -> Option<&'static dyn Arch> {
    FAMILIES.iter().copied().find(|f| f.name() == name)
}

/// The family of a (validated) config.
pub fn arch(cfg: &ModelConfig) -> &'static dyn Arch {
    by_name(cfg.family.0).unwrap_or_else(|| panic!("no model family named {}", cfg.family))
}

/// Check a config: the dimensions every kernel relies on, then the family's own rules.
pub fn validate(cfg: &ModelConfig) -> Result<()> {
    cfg.validate_dims()?;
    let Some(a) = by_name(cfg.family.0) else { bail!("unknown model family '{}'", cfg.family) };
    a.validate(cfg)
}

/// Where every parameter of a model of `cfg` lives.
pub fn layout(cfg: &ModelConfig) -> ParamLayout {
    ParamLayout::new(arch(cfg).tensors(cfg), cfg.num_layers)
}

/// The config a descriptor names, from whichever family takes it.
pub fn from_descriptor(desc: &str) -> Result<ModelConfig> {
    for f in FAMILIES {
        if let Some(cfg) = f.descriptor(desc) {
            let cfg = cfg?;
            validate(&cfg).with_context(|| format!("model descriptor '{desc}'"))?;
            return Ok(cfg);
        }
    }
    bail!("unknown model '{desc}': give a model file (.bin), a Hugging Face directory or hf:owner/name, or a descriptor: {}", descriptor_help())
}

/// Every family's descriptors, for messages.
pub fn descriptor_help() -> String {
    FAMILIES.iter().map(|f| f.descriptor_help()).collect::<Vec<_>>().join("; ")
}

/// The family a config.json describes, from its `architectures` (or `model_type`).
pub fn by_hf_config(v: &serde_json::Value, path: &Path) -> Result<&'static dyn Arch> {
    let arch = v["architectures"].get(0).and_then(|a| a.as_str()).unwrap_or("");
    let kind = v["model_type"].as_str().unwrap_or("");
    let found = FAMILIES.iter().copied().find(|f| {
        let (a, k) = f.hf_names();
        if arch.is_empty() {
            k == kind
        } else {
            a == arch
        }
    });
    found.with_context(|| {
        let known: Vec<_> = FAMILIES.iter().map(|f| f.hf_names().0).collect();
        format!(
            "{}: architecture '{}' is not supported: llmrs runs {}",
            path.display(),
            if arch.is_empty() { kind } else { arch },
            known.join(", ")
        )
    })
}

/// Parse `config.json` into the model's shape, checking that llmrs computes exactly this model.
pub fn parse_config(text: &str, path: &Path) -> Result<ModelConfig> {
    let v: serde_json::Value =
        serde_json::from_str(text).with_context(|| format!("{}: not a model config.json", path.display()))?;
    if !v.is_object() {
        bail!("{}: not a model config.json (not a JSON object)", path.display());
    }
    let cfg = by_hf_config(&v, path)?.parse_hf_config(&v, path)?;
    validate(&cfg).with_context(|| format!("{}: bad model shape", path.display()))?;
    Ok(cfg)
}

/// The family whose llm.c model file has this magic.
pub fn by_llmc_magic(magic: i32) -> Option<&'static dyn Arch> {
    FAMILIES.iter().copied().find(|f| f.llmc_magic() == Some(magic))
}

impl ModelConfig {
    /// The config a descriptor names ([`from_descriptor`]).
    pub fn from_descriptor(desc: &str) -> Result<Self> {
        from_descriptor(desc)
    }

    /// [`validate`].
    pub fn validate(&self) -> Result<()> {
        validate(self)
    }

    /// Number of parameters (llm.c's count for GPT-2, padded vocab included).
    pub fn num_parameters(&self) -> usize {
        layout(self).num_parameters
    }

    /// This config's family.
    pub fn arch(&self) -> &'static dyn Arch {
        arch(self)
    }
}

impl Weights {
    /// All parameters zero (to be filled from a file), after the config is checked and the
    /// machine found big enough.
    pub fn zeros(config: ModelConfig) -> Result<Self> {
        validate(&config)?;
        Weights::zeros_in(config, layout(&config))
    }

    /// The family's random init (llm.c's for GPT-2), drawn from the PyTorch-compatible Mersenne
    /// Twister seeded with `seed`.
    pub fn random(config: ModelConfig, seed: u32) -> Result<Self> {
        let mut w = Self::zeros(config)?;
        arch(&config).init(&mut w, &mut Mt19937::new(seed));
        Ok(w)
    }
}

/// The family of `family`'s name, for configs made by name.
pub fn family(name: &str) -> Option<Family> {
    by_name(name).map(|f| Family(f.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_and_counts() {
        let s = ModelConfig::from_descriptor("llama:smollm2-135m").unwrap();
        assert_eq!((s.num_layers, s.channels, s.num_heads, s.num_kv_heads, s.hidden), (30, 576, 9, 3, 1536));
        assert_eq!((s.head_size(), s.kv_dim(), s.qkv_dim()), (64, 192, 960));
        // SmolLM2-135M has 134,515,008 parameters (tied head; its vocabulary is a multiple of 128).
        assert_eq!(s.num_parameters(), 134_515_008);
        let e = ModelConfig::from_descriptor("llama:4x256:8:2").unwrap();
        assert_eq!((e.num_layers, e.channels, e.num_heads, e.num_kv_heads, e.hidden), (4, 256, 8, 2, 704));
        assert_eq!(ModelConfig::from_descriptor("llama:2x64:4:4:96:32").unwrap().max_seq_len, 32);
        for bad in ["llama:2x64:3:2", "llama:2x64:4:3", "llama:nope", "llama:2x64:4", "llama:2x60:4:4", "nonsense"] {
            assert!(ModelConfig::from_descriptor(bad).is_err(), "{bad}");
        }
        let g = ModelConfig::from_descriptor("d12").unwrap();
        assert_eq!((g.qkv_dim(), g.kv_dim()), (3 * 768, 768));
        // llm.c prints num_parameters: 124475904 for GPT-2 124M with the padded vocab.
        assert_eq!(g.num_parameters(), 124_475_904);
        let lay = layout(&g);
        assert_eq!(lay.ids().filter(|&t| lay.spec(t).decay).count(), 6);
        assert_eq!(lay.block_ids().len(), 12);
    }

    #[test]
    fn what_backward_writes_whole() {
        let whole = |cfg: &ModelConfig| -> Vec<&str> {
            let lay = layout(cfg);
            lay.ids().filter(|&t| lay.spec(t).whole).map(|t| lay.spec(t).name).collect()
        };
        let g = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        assert_eq!(whole(&g), ["wte", "qkvw", "qkvb", "attprojw", "attprojb", "fcw", "fcb", "fcprojw", "fcprojb"]);
        let l = ModelConfig { tied_head: false, ..ModelConfig::from_descriptor("llama:2x16:2:1").unwrap() };
        assert_eq!(
            whole(&l),
            ["lmhead", "qkvw", "attprojw", "fcw", "fcprojw"],
            "no biases; wte is only scattered into"
        );
    }
}

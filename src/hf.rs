//! Hugging Face GPT-2 checkpoints: `model.safetensors` + `config.json` in transformers' layout.
//!
//! transformers stores GPT-2's linear layers as `Conv1D`, whose weight is (in, out): the
//! transpose of llm.c's (out, in). Names are `transformer.h.N.attn.c_attn.weight` and so on (the
//! `transformer.` prefix is absent in some Hub checkpoints); the LM head is tied to `wte` and
//! usually not stored. Buffers such as `attn.bias` (the causal mask) are ignored.

use crate::checkpoint::{bf16s_from_le, f32s_from_le, f32s_to_bf16_le, f32s_to_le, write_atomic, Dtype};
use crate::config::{pad_vocab, GPT2Config};
use crate::params::{Tensor, Weights};
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The fields of transformers' `GPT2Config` that matter to llmrs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct HfConfig {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "default_act")]
    pub activation_function: String,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_act() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

impl HfConfig {
    /// Parse and check that llmrs computes exactly this model.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let c: HfConfig =
            serde_json::from_str(text).with_context(|| format!("{}: not a GPT-2 config.json", path.display()))?;
        if let Some(inner) = c.n_inner {
            if inner != 4 * c.n_embd {
                bail!("{}: n_inner {inner} is not 4*n_embd; llmrs's GPT-2 has a 4C MLP", path.display());
            }
        }
        if !matches!(c.activation_function.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
            bail!("{}: activation '{}' is not GPT-2's tanh GELU (gelu_new)", path.display(), c.activation_function);
        }
        if (c.layer_norm_epsilon - 1e-5).abs() > 1e-12 {
            bail!("{}: layer_norm_epsilon {} is not 1e-5", path.display(), c.layer_norm_epsilon);
        }
        if !c.tie_word_embeddings {
            bail!("{}: untied word embeddings are not supported (GPT-2 ties the LM head to wte)", path.display());
        }
        Ok(c)
    }

    pub fn to_llmc(&self) -> Result<GPT2Config> {
        let cfg = GPT2Config {
            max_seq_len: self.n_positions,
            vocab_size: self.vocab_size,
            padded_vocab_size: pad_vocab(self.vocab_size),
            num_layers: self.n_layer,
            num_heads: self.n_head,
            channels: self.n_embd,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `config.json` as transformers writes it for a GPT2LMHeadModel of this shape.
pub fn config_json(cfg: &GPT2Config, dtype: Dtype) -> String {
    let v = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": match dtype { Dtype::F32 => "float32", Dtype::BF16 => "bfloat16" },
    });
    serde_json::to_string_pretty(&v).unwrap() + "\n"
}

/// Locate `config.json` and `model.safetensors` for a directory or a `.safetensors` file.
pub fn resolve_paths(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let (dir, st) = if path.is_dir() {
        (path.to_path_buf(), path.join("model.safetensors"))
    } else {
        (path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf), path.to_path_buf())
    };
    let cfg = dir.join("config.json");
    if !st.is_file() {
        bail!("{} not found: a Hugging Face model directory holds model.safetensors and config.json", st.display());
    }
    if !cfg.is_file() {
        bail!("{} not found next to {}: it gives the model's shape", cfg.display(), st.display());
    }
    Ok((cfg, st))
}

/// One tensor of transformers' GPT2LMHeadModel and where it lives in llm.c's layout: the one
/// table that both import and export follow.
struct HfTensor {
    /// Name without the `transformer.` prefix, e.g. `h.3.attn.c_attn.weight`.
    name: String,
    /// Its elements in the flat parameter buffer.
    range: std::ops::Range<usize>,
    /// Its shape as transformers stores it.
    shape: Vec<usize>,
    /// Conv1D weights are (in, out), the transpose of llm.c's (out, in).
    transposed: bool,
}

fn hf_tensors(w: &Weights) -> Vec<HfTensor> {
    let (cfg, lay) = (&w.config, &w.layout);
    let wte = lay.range(Tensor::Wte);
    let mut out = vec![
        // Only the V real rows of the padded embedding.
        HfTensor {
            name: "wte.weight".into(),
            range: wte.start..wte.start + cfg.vocab_size * cfg.channels,
            shape: vec![cfg.vocab_size, cfg.channels],
            transposed: false,
        },
        HfTensor {
            name: "wpe.weight".into(),
            range: lay.range(Tensor::Wpe),
            shape: Tensor::Wpe.shape(cfg),
            transposed: false,
        },
    ];
    let per_layer = [
        ("ln_1.weight", Tensor::Ln1W),
        ("ln_1.bias", Tensor::Ln1B),
        ("attn.c_attn.weight", Tensor::QkvW),
        ("attn.c_attn.bias", Tensor::QkvB),
        ("attn.c_proj.weight", Tensor::AttProjW),
        ("attn.c_proj.bias", Tensor::AttProjB),
        ("ln_2.weight", Tensor::Ln2W),
        ("ln_2.bias", Tensor::Ln2B),
        ("mlp.c_fc.weight", Tensor::FcW),
        ("mlp.c_fc.bias", Tensor::FcB),
        ("mlp.c_proj.weight", Tensor::FcProjW),
        ("mlp.c_proj.bias", Tensor::FcProjB),
    ];
    for l in 0..cfg.num_layers {
        for (suffix, t) in per_layer {
            let mut shape = t.shape(cfg);
            let transposed = shape.len() == 2;
            shape.reverse();
            out.push(HfTensor { name: format!("h.{l}.{suffix}"), range: lay.layer(t, l), shape, transposed });
        }
    }
    for (name, t) in [("ln_f.weight", Tensor::LnfW), ("ln_f.bias", Tensor::LnfB)] {
        out.push(HfTensor { name: name.into(), range: lay.range(t), shape: t.shape(cfg), transposed: false });
    }
    out
}

/// Convert one stored tensor to f32 (F32, BF16 and F16 are accepted).
fn to_f32(t: &TensorView, name: &str) -> Result<Vec<f32>> {
    let d = t.data();
    let n = t.shape().iter().product();
    let mut out = vec![0f32; n];
    match t.dtype() {
        StDtype::F32 => f32s_from_le(d, &mut out),
        StDtype::BF16 => bf16s_from_le(d, &mut out),
        StDtype::F16 => out
            .iter_mut()
            .zip(d.chunks_exact(2))
            .for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        other => bail!("tensor {name} has dtype {other:?}; expected F32, BF16 or F16"),
    }
    Ok(out)
}

/// The (cols, rows) transpose of a row-major (rows, cols) matrix: between llm.c's (out, in)
/// weights and transformers' Conv1D (in, out).
fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            y[j * rows + i] = x[i * cols + j];
        }
    }
    y
}

/// Load a Hugging Face GPT-2 (directory or `.safetensors` path) as llm.c-layout weights.
pub fn load_hf(path: &Path) -> Result<Weights> {
    let (cfg_path, st_path) = resolve_paths(path)?;
    let cfg_text = String::from_utf8(crate::checkpoint::read_file(&cfg_path)?)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", cfg_path.display()))?;
    let hf = HfConfig::parse(&cfg_text, &cfg_path)?;
    let cfg = hf.to_llmc().with_context(|| format!("{}: bad model shape", cfg_path.display()))?;
    let bytes = crate::checkpoint::read_file(&st_path)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", st_path.display()))?;
    let prefix = if st.names().iter().any(|n| n.starts_with("transformer.")) { "transformer." } else { "" };
    // The file must hold every tensor config.json implies (checked before allocating for it).
    let stored: usize = st.tensors().iter().map(|(_, t)| t.shape().iter().product::<usize>()).sum();
    if stored < cfg.num_parameters() - (cfg.padded_vocab_size - cfg.vocab_size) * cfg.channels {
        bail!(
            "{}: holds {stored} values, fewer than the {} parameters config.json describes",
            st_path.display(),
            cfg.num_parameters()
        );
    }
    let mut w = Weights::zeros(cfg)?;
    for e in hf_tensors(&w) {
        let full = format!("{prefix}{}", e.name);
        let t = st.tensor(&full).map_err(|_| anyhow::anyhow!("{}: tensor {full} is missing", st_path.display()))?;
        if t.shape() != e.shape {
            bail!("{}: tensor {full} has shape {:?}, config.json implies {:?}", st_path.display(), t.shape(), e.shape);
        }
        let x = to_f32(&t, &full)?;
        let x = if e.transposed { transposed(&x, e.shape[0], e.shape[1]) } else { x };
        w.data[e.range].copy_from_slice(&x);
    }
    if let Ok(head) = st.tensor("lm_head.weight") {
        // A stored head must be the tied embedding.
        let (v, c) = (cfg.vocab_size, cfg.channels);
        if head.shape() != [v, c] || to_f32(&head, "lm_head.weight")? != w.tensor(Tensor::Wte)[..v * c] {
            bail!("{}: lm_head.weight differs from wte: untied heads are not supported", st_path.display());
        }
    }
    Ok(w)
}

/// Export to a directory with `model.safetensors` and `config.json` that transformers'
/// `GPT2LMHeadModel.from_pretrained` loads. The padded vocab rows are dropped.
pub fn save_hf(w: &Weights, dir: &Path, dtype: Dtype) -> Result<()> {
    let table = hf_tensors(w);
    let st_dtype = match dtype {
        Dtype::F32 => StDtype::F32,
        Dtype::BF16 => StDtype::BF16,
    };
    let bytes: Vec<Vec<u8>> = table
        .iter()
        .map(|e| {
            let x = &w.data[e.range.clone()];
            // Conv1D (in, out) from llm.c's (out, in) = (shape[1], shape[0]).
            let x = if e.transposed { transposed(x, e.shape[1], e.shape[0]) } else { x.to_vec() };
            let mut b = vec![];
            match dtype {
                Dtype::F32 => f32s_to_le(&x, &mut b),
                Dtype::BF16 => f32s_to_bf16_le(&x, &mut b),
            }
            b
        })
        .collect();
    let views = table
        .iter()
        .zip(&bytes)
        .map(|(e, b)| Ok((format!("transformer.{}", e.name), TensorView::new(st_dtype, e.shape.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let out = safetensors::serialize(views, Some(meta))?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join("model.safetensors"), &[&out])?;
    write_atomic(&dir.join("config.json"), &[config_json(&w.config, dtype).as_bytes()])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_import_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let model = Weights::random(GPT2Config::from_descriptor("2x16:2:8").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let back = load_hf(dir.path()).unwrap();
        assert_eq!(back, model);
        save_hf(&model, dir.path(), Dtype::BF16).unwrap();
        let back = load_hf(&dir.path().join("model.safetensors")).unwrap();
        for (a, b) in back.data.iter().zip(&model.data) {
            assert!((a - b).abs() <= b.abs() / 128.0);
        }
    }

    #[test]
    fn bad_checkpoints_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let model = Weights::random(GPT2Config::from_descriptor("1x8:2:8").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let cfg_path = dir.path().join("config.json");
        let good_cfg = std::fs::read_to_string(&cfg_path).unwrap();
        let err = || format!("{:#}", load_hf(dir.path()).map(|_| ()).expect_err("must fail"));
        std::fs::write(&cfg_path, good_cfg.replace("\"n_embd\": 8", "\"n_embd\": 16")).unwrap();
        assert!(err().contains("fewer than"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("\"n_positions\": 8", "\"n_positions\": 4")).unwrap();
        assert!(err().contains("has shape"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("gelu_new", "relu")).unwrap();
        assert!(err().contains("activation"));
        std::fs::write(&cfg_path, "{not json").unwrap();
        assert!(err().contains("not a GPT-2 config.json"));
        std::fs::write(&cfg_path, &good_cfg).unwrap();
        let st = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&st).unwrap();
        std::fs::write(&st, &bytes[..bytes.len() - 10]).unwrap();
        assert!(err().contains("not a valid safetensors"));
        std::fs::remove_file(&st).unwrap();
        assert!(err().contains("not found"));
    }
}

//! Qwen2 (transformers' `Qwen2ForCausalLM`: Qwen2 and Qwen2.5): the decoder of
//! [`super::decoder`] with biases on the q, k and v projections only (none on the output
//! projection), HS = C / NH, eps 1e-6, rope_theta 1e6, the head tied on the small sizes, and
//! Qwen's sliding-window fields in config.json (off). Its checkpoints are llmrs's own model
//! file (llm.c has none for it).

use super::decoder::{self, DecoderFamily, HfFields};
use crate::core::config::{Family, ModelConfig, Rope, GPT2_VOCAB};
use anyhow::{bail, Result};
use std::path::Path;

pub struct Qwen2;

pub const QWEN2: Family = Family("qwen2");

/// A Qwen2 shape: q, k, v biases, a tied head, eps 1e-6, rope_theta 1e6 (Qwen2.5's).
fn config(layers: usize, c: usize, heads: usize, kv: usize, f: usize, vocab: usize, max_t: usize) -> ModelConfig {
    let rope = Rope { theta: 1e6, scaling: None };
    ModelConfig {
        norm_eps: 1e-6,
        qkv_bias: true,
        ..decoder::config(QWEN2, layers, c, heads, kv, f, vocab, max_t, rope)
    }
}

impl DecoderFamily for Qwen2 {
    const NAME: &'static str = QWEN2.0;
    const HF_NAMES: (&'static str, &'static str) = ("Qwen2ForCausalLM", "qwen2");
    const DESCRIPTOR_HELP: &'static str = "Qwen2: qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, qwen2:LxC:NH:KV[:F[:maxT]]";
    const SLIDING_WINDOW_FIELDS: bool = true;

    /// `qwen2:NAME` presets (the released configs' shapes) and `qwen2:LxC:NH:KV[:F[:maxT]]` (F
    /// defaults to 16C/3 rounded up to 64, GPT-2's vocabulary).
    fn descriptor(&self, rest: &str, desc: &str) -> Result<ModelConfig> {
        match rest {
            "qwen2.5-0.5b" => return Ok(config(24, 896, 14, 2, 4864, 151936, 32768)),
            "qwen2.5-1.5b" => return Ok(config(28, 1536, 12, 2, 8960, 151936, 32768)),
            _ => {}
        }
        if let Some(n) = decoder::descriptor_numbers(rest, 2, 4, desc) {
            let n = n?;
            let (l, c, nh, kv) = (n[0], n[1], n[2], n[3]);
            let f = n.get(4).copied().unwrap_or((16 * c / 3).div_ceil(64) * 64);
            if nh == 0 || !c.is_multiple_of(nh) {
                bail!("model descriptor '{desc}': channels {c} is not a multiple of the number of heads {nh}");
            }
            return Ok(config(l, c, nh, kv, f, GPT2_VOCAB, n.get(5).copied().unwrap_or(1024)));
        }
        bail!(
            "unknown Qwen2 model '{desc}': use qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, or qwen2:LxC:NH:KV[:F[:maxT]] \
             such as qwen2:2x64:4:2"
        )
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        if cfg.head_dim * cfg.num_heads != cfg.channels || !cfg.qkv_bias || cfg.out_bias {
            bail!("a Qwen2 model has HS = C / NH, biases on q, k and v and none on the output projection: {cfg}");
        }
        Ok(())
    }

    /// A `Qwen2ForCausalLM` config.json: the decoder's fields (transformers' Qwen2 has no
    /// head_dim: HS = C / NH), the q, k, v biases always.
    fn config_from_hf(&self, f: &HfFields, path: &Path) -> Result<ModelConfig> {
        if f.head_dim * f.heads != f.c {
            bail!(
                "{}: head_dim {} is not hidden_size / num_attention_heads, as Qwen2 has it",
                path.display(),
                f.head_dim
            );
        }
        Ok(ModelConfig { qkv_bias: true, out_bias: false, ..f.config(QWEN2, f.flag("tie_word_embeddings", false)?) })
    }
}

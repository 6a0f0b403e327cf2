//! Qwen3 (transformers' `Qwen3ForCausalLM`): the decoder of [`super::decoder`] with an RMSNorm
//! on each query and key head before the rotary embedding (weights `q_norm`, `k_norm` of HS
//! each per layer, after Llama's tensors), a head size set on its own (`head_dim`: 128 with 16
//! heads of a 1024-wide model, so QD = 2048 != C), no biases unless `attention_bias`, eps
//! 1e-6, rope_theta 1e6, the head tied on the small sizes, and Qwen's sliding-window fields in
//! config.json (off). Its checkpoints are llmrs's own model file.

use super::decoder::{self, DecoderFamily, HfFields};
use crate::core::config::{Family, ModelConfig, Rope, GPT2_VOCAB};
use anyhow::{bail, Result};
use std::path::Path;

pub struct Qwen3;

pub const QWEN3: Family = Family("qwen3");

/// A Qwen3 shape: head size `hs` of its own, no biases, a tied head, eps 1e-6, rope_theta 1e6.
#[allow(clippy::too_many_arguments)]
fn config(l: usize, c: usize, heads: usize, kv: usize, hs: usize, f: usize, vocab: usize, max_t: usize) -> ModelConfig {
    let rope = Rope { theta: 1e6, scaling: None };
    ModelConfig { head_dim: hs, norm_eps: 1e-6, ..decoder::config(QWEN3, l, c, heads, kv, f, vocab, max_t, rope) }
}

impl DecoderFamily for Qwen3 {
    const NAME: &'static str = QWEN3.0;
    const HF_NAMES: (&'static str, &'static str) = ("Qwen3ForCausalLM", "qwen3");
    const DESCRIPTOR_HELP: &'static str = "Qwen3: qwen3:qwen3-0.6b, qwen3:qwen3-1.7b, qwen3:LxC:NH:KV:HS[:F[:maxT]]";
    const HEAD_NORM: bool = true;
    const SLIDING_WINDOW_FIELDS: bool = true;

    /// `qwen3:NAME` presets (the released configs' shapes) and `qwen3:LxC:NH:KV:HS[:F[:maxT]]`
    /// (F defaults to 3C, GPT-2's vocabulary).
    fn descriptor(&self, rest: &str, desc: &str) -> Result<ModelConfig> {
        match rest {
            "qwen3-0.6b" => return Ok(config(28, 1024, 16, 8, 128, 3072, 151936, 40960)),
            "qwen3-1.7b" => return Ok(config(28, 2048, 16, 8, 128, 6144, 151936, 40960)),
            _ => {}
        }
        if let Some(n) = decoder::descriptor_numbers(rest, 3, 5, desc) {
            let n = n?;
            let (l, c, nh, kv, hs) = (n[0], n[1], n[2], n[3], n[4]);
            let (f, max_t) = (n.get(5).copied().unwrap_or(3 * c), n.get(6).copied().unwrap_or(1024));
            return Ok(config(l, c, nh, kv, hs, f, GPT2_VOCAB, max_t));
        }
        bail!(
            "unknown Qwen3 model '{desc}': use qwen3:qwen3-0.6b, qwen3:qwen3-1.7b, or qwen3:LxC:NH:KV:HS[:F[:maxT]] \
             such as qwen3:2x64:4:2:32"
        )
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        if cfg.qkv_bias != cfg.out_bias {
            bail!("a Qwen3 model's attention_bias puts biases on q, k, v and the output projection alike");
        }
        Ok(())
    }

    /// A `Qwen3ForCausalLM` config.json: the decoder's fields with `head_dim` of its own, and
    /// `attention_bias`.
    fn config_from_hf(&self, f: &HfFields, _path: &Path) -> Result<ModelConfig> {
        let bias = f.flag("attention_bias", false)?;
        Ok(ModelConfig { qkv_bias: bias, out_bias: bias, ..f.config(QWEN3, f.flag("tie_word_embeddings", false)?) })
    }

    fn hf_config_extra(&self, cfg: &ModelConfig, v: &mut serde_json::Value) {
        v["attention_bias"] = cfg.qkv_bias.into();
    }
}

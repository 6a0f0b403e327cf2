//! Qwen2 (transformers' `Qwen2ForCausalLM`: Qwen2 and Qwen2.5): Llama's block with biases on
//! the q, k and v projections only (none on the output projection), the head tied on the
//! small sizes. Its tensors, activations and block are Llama's ([`super::llama`]); its
//! checkpoints are llmrs's own model file (llm.c has none for it).

use super::family::{Arch, Attn, Consts};
use super::llama::{self, BlockW, HfFields, T};
use crate::acts::{ActPlan, BackActs, BlockActs, NormActs};
use crate::backend::ops::{Ops, Seq};
use crate::backend::Buf;
use crate::config::{Family, ModelConfig, Rope, GPT2_VOCAB};
use crate::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View};
use crate::rng::Mt19937;
use anyhow::{bail, Result};
use std::path::Path;

pub struct Qwen2;

pub const QWEN2: Family = Family("qwen2");

/// A Qwen2 shape: q, k, v biases, a tied head, eps 1e-6, rope_theta 1e6 (Qwen2.5's).
#[allow(clippy::too_many_arguments)]
pub fn config(layers: usize, c: usize, heads: usize, kv: usize, f: usize, vocab: usize, max_t: usize) -> ModelConfig {
    ModelConfig {
        family: QWEN2,
        norm_eps: 1e-6,
        qkv_bias: true,
        out_bias: false,
        ..llama::config(layers, c, heads, kv, f, vocab, max_t, Rope { theta: 1e6, scaling: None })
    }
}

/// `qwen2:NAME` presets (the released configs' shapes) and `qwen2:LxC:NH:KV[:F[:maxT]]` (F
/// defaults to 16C/3 rounded up to 64, GPT-2's vocabulary).
fn descriptor(rest: &str, desc: &str) -> Result<ModelConfig> {
    match rest {
        "qwen2.5-0.5b" => return Ok(config(24, 896, 14, 2, 4864, 151936, 32768)),
        "qwen2.5-1.5b" => return Ok(config(28, 1536, 12, 2, 8960, 151936, 32768)),
        _ => {}
    }
    let parts: Vec<&str> = rest.split(':').collect();
    let lc = parts.first().and_then(|lc| lc.split_once('x'));
    let num = |i: usize| parts.get(i).map(|s| s.parse::<usize>().ok());
    if let (Some((l, c)), Some(Some(nh)), Some(Some(kv)), true) = (lc, num(1), num(2), parts.len() <= 5) {
        if let (Ok(l), Ok(c)) = (l.parse::<usize>(), c.parse::<usize>()) {
            let f = match num(3) {
                None => (16 * c / 3).div_ceil(64) * 64,
                Some(Some(f)) => f,
                Some(None) => bail!("bad F in model descriptor '{desc}'"),
            };
            let max_t = match num(4) {
                None => 1024,
                Some(Some(t)) => t,
                Some(None) => bail!("bad maxT in model descriptor '{desc}'"),
            };
            if nh == 0 || !c.is_multiple_of(nh) {
                bail!("model descriptor '{desc}': channels {c} is not a multiple of the number of heads {nh}");
            }
            return Ok(config(l, c, nh, kv, f, GPT2_VOCAB, max_t));
        }
    }
    bail!(
        "unknown Qwen2 model '{desc}': use qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, or qwen2:LxC:NH:KV[:F[:maxT]] such as \
         qwen2:2x64:4:2"
    )
}

/// Llama's config.json fields and the Qwen family's (no sliding window), for Qwen2 and Qwen3.
pub fn hf_config_qwen(cfg: &ModelConfig, torch_dtype: &str, names: (&str, &str)) -> serde_json::Value {
    let mut v = llama::hf_config_common(cfg, torch_dtype, names);
    v["use_sliding_window"] = false.into();
    v["sliding_window"] = serde_json::Value::Null;
    v["max_window_layers"] = cfg.num_layers.into();
    v["attention_dropout"] = 0.0.into();
    v
}

/// `use_sliding_window` true computes another model (attention over a window): refused.
pub fn refuse_sliding_window(f: &HfFields, path: &Path) -> Result<()> {
    if f.flag("use_sliding_window", false)? {
        bail!("{}: use_sliding_window true is not supported (llmrs attends to every earlier position)", path.display());
    }
    Ok(())
}

impl Arch for Qwen2 {
    fn name(&self) -> &'static str {
        QWEN2.0
    }

    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>> {
        desc.trim().strip_prefix("qwen2:").map(|rest| descriptor(rest, desc))
    }

    fn descriptor_help(&self) -> &'static str {
        "Qwen2: qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, qwen2:LxC:NH:KV[:F[:maxT]]"
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        llama::validate_common(cfg)?;
        if cfg.head_dim * cfg.num_heads != cfg.channels || !cfg.qkv_bias || cfg.out_bias {
            bail!("a Qwen2 model has HS = C / NH, biases on q, k and v and none on the output projection: {cfg}");
        }
        Ok(())
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        llama::tensors_of(cfg)
    }

    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937) {
        llama::init_common(w, rng)
    }

    fn head(&self, cfg: &ModelConfig) -> TensorId {
        if cfg.tied_head {
            T::Wte.into()
        } else {
            T::LmHead.into()
        }
    }

    fn acts(&self, cfg: &ModelConfig) -> ActPlan {
        llama::plan(cfg)
    }

    fn host_consts(&self, cfg: &ModelConfig) -> Option<Vec<f32>> {
        Some(llama::rope_table(cfg))
    }

    fn embed(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, out: Buf, ids: Buf, s: Seq, _pos: usize) {
        llama::embed(ops, cfg, w[T::Wte], out, ids, s)
    }

    fn embed_backward(&self, ops: &mut Ops, cfg: &ModelConfig, dw: &View<Buf>, dout: Buf, ids: Buf, s: Seq) {
        ops.encoder_backward(dw[T::Wte], None, dout, ids, s, cfg.channels);
    }

    fn block_forward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        k: &Consts,
        w: &View<Buf>,
        x: &BlockActs,
        n: usize,
        attn: Attn,
    ) {
        llama::block_forward(ops, cfg, k, &BlockW::of(cfg, w), x, n, attn)
    }

    fn block_backward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        k: &Consts,
        w: &View<Buf>,
        dw: &View<Buf>,
        x: &BlockActs,
        d: &BackActs,
        s: Seq,
        acc: bool,
    ) {
        llama::block_backward(ops, cfg, k, &BlockW::of(cfg, w), &BlockW::of(cfg, dw), x, d, s, acc)
    }

    fn final_norm(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, a: &NormActs, x: Buf, n: usize) {
        llama::final_norm(ops, cfg, w[T::LnfW], a, x, n)
    }

    fn final_norm_backward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        w: &View<Buf>,
        dw: &View<Buf>,
        a: &NormActs,
        dx: Buf,
        dout: Buf,
        x: Buf,
        n: usize,
    ) {
        llama::final_norm_backward(ops, cfg, w[T::LnfW], dw[T::LnfW], a, dx, dout, x, n)
    }

    fn hf_names(&self) -> (&'static str, &'static str) {
        ("Qwen2ForCausalLM", "qwen2")
    }

    /// A `Qwen2ForCausalLM` config.json: Llama's fields (transformers' Qwen2 has no head_dim:
    /// HS = C / NH), the q, k, v biases always, `use_sliding_window` refused.
    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let f = HfFields::read(v, path)?;
        refuse_sliding_window(&f, path)?;
        if f.head_dim * f.heads != f.c {
            bail!(
                "{}: head_dim {} is not hidden_size / num_attention_heads, as Qwen2 has it",
                path.display(),
                f.head_dim
            );
        }
        Ok(ModelConfig { qkv_bias: true, out_bias: false, ..f.config(QWEN2, f.flag("tie_word_embeddings", false)?) })
    }

    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
        hf_config_qwen(cfg, torch_dtype, self.hf_names())
    }

    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
        llama::hf_tensors_of(cfg, lay, |_, _| vec![])
    }
}

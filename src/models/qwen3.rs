//! Qwen3 (transformers' `Qwen3ForCausalLM`): Llama's block with an RMSNorm on each query and
//! key head before the rotary embedding (weights `q_norm`, `k_norm` of HS each), a head size
//! set on its own (`head_dim`: 128 with 16 heads of a 1024-wide model, so QD = 2048 != C), no
//! biases (unless `attention_bias`), the head tied on the small sizes. Its tensors are Llama's
//! followed by the two head norms; its checkpoints are llmrs's own model file.

use super::family::{Arch, Attn, Consts};
use super::llama::{self, BlockW, HfFields};
use crate::acts::{ActPlan, BackActs, BlockActs, NormActs};
use crate::backend::ops::{Ops, Seq};
use crate::backend::Buf;
use crate::config::{Family, ModelConfig, Rope, GPT2_VOCAB};
use crate::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View};
use crate::rng::Mt19937;
use anyhow::{bail, Result};
use std::path::Path;

pub struct Qwen3;

pub const QWEN3: Family = Family("qwen3");

/// Qwen3's tensors: Llama's ([`llama::T`], in its order), then the heads' norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T {
    Wte,      // (Vp, C)
    LmHead,   // (Vp, C) or empty (tied)
    Ln1W,     // (L, C)
    QkvW,     // (L, QKV, C)
    QkvB,     // (L, QKV) or empty
    AttProjW, // (L, C, QD)
    AttProjB, // (L, C) or empty
    Ln2W,     // (L, C)
    FcW,      // (L, 2F, C)
    FcProjW,  // (L, C, F)
    LnfW,     // (C)
    QNormW,   // (L, HS) q_norm
    KNormW,   // (L, HS) k_norm
}
crate::ids!(T);

/// A Qwen3 shape: head size `hs` of its own, no biases, a tied head, eps 1e-6, rope_theta 1e6.
#[allow(clippy::too_many_arguments)]
pub fn config(
    layers: usize,
    c: usize,
    heads: usize,
    kv: usize,
    hs: usize,
    f: usize,
    vocab: usize,
    max_t: usize,
) -> ModelConfig {
    ModelConfig {
        family: QWEN3,
        head_dim: hs,
        norm_eps: 1e-6,
        ..llama::config(layers, c, heads, kv, f, vocab, max_t, Rope { theta: 1e6, scaling: None })
    }
}

/// `qwen3:NAME` presets (the released configs' shapes) and `qwen3:LxC:NH:KV:HS[:F[:maxT]]` (F
/// defaults to 3C, GPT-2's vocabulary).
fn descriptor(rest: &str, desc: &str) -> Result<ModelConfig> {
    match rest {
        "qwen3-0.6b" => return Ok(config(28, 1024, 16, 8, 128, 3072, 151936, 40960)),
        "qwen3-1.7b" => return Ok(config(28, 2048, 16, 8, 128, 6144, 151936, 40960)),
        _ => {}
    }
    let parts: Vec<&str> = rest.split(':').collect();
    let lc = parts.first().and_then(|lc| lc.split_once('x'));
    let num = |i: usize| parts.get(i).map(|s| s.parse::<usize>().ok());
    if let (Some((l, c)), Some(Some(nh)), Some(Some(kv)), Some(Some(hs)), true) =
        (lc, num(1), num(2), num(3), parts.len() <= 6)
    {
        if let (Ok(l), Ok(c)) = (l.parse::<usize>(), c.parse::<usize>()) {
            let f = match num(4) {
                None => 3 * c,
                Some(Some(f)) => f,
                Some(None) => bail!("bad F in model descriptor '{desc}'"),
            };
            let max_t = match num(5) {
                None => 1024,
                Some(Some(t)) => t,
                Some(None) => bail!("bad maxT in model descriptor '{desc}'"),
            };
            return Ok(config(l, c, nh, kv, hs, f, GPT2_VOCAB, max_t));
        }
    }
    bail!(
        "unknown Qwen3 model '{desc}': use qwen3:qwen3-0.6b, qwen3:qwen3-1.7b, or qwen3:LxC:NH:KV:HS[:F[:maxT]] such as \
         qwen3:2x64:4:2:32"
    )
}

fn block_w(cfg: &ModelConfig, w: &View<Buf>) -> BlockW {
    BlockW { head_norm: Some((w[T::QNormW], w[T::KNormW])), ..BlockW::of(cfg, w) }
}

impl Arch for Qwen3 {
    fn name(&self) -> &'static str {
        QWEN3.0
    }

    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>> {
        desc.trim().strip_prefix("qwen3:").map(|rest| descriptor(rest, desc))
    }

    fn descriptor_help(&self) -> &'static str {
        "Qwen3: qwen3:qwen3-0.6b, qwen3:qwen3-1.7b, qwen3:LxC:NH:KV:HS[:F[:maxT]]"
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        llama::validate_common(cfg)?;
        if cfg.qkv_bias != cfg.out_bias {
            bail!("a Qwen3 model's attention_bias puts biases on q, k, v and the output projection alike");
        }
        Ok(())
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        let hs = cfg.head_dim;
        let mut t = llama::tensors_of(cfg);
        t.push(TensorSpec::new("qnormw", &[hs], true, false));
        t.push(TensorSpec::new("knormw", &[hs], true, false));
        t
    }

    /// Llama's init; the heads' norm weights 1.
    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937) {
        llama::init_common(w, rng);
        let lay = w.layout().clone();
        w.fill(lay.range(T::QNormW), 1.0);
        w.fill(lay.range(T::KNormW), 1.0);
    }

    fn head(&self, cfg: &ModelConfig) -> TensorId {
        if cfg.tied_head {
            T::Wte.into()
        } else {
            T::LmHead.into()
        }
    }

    fn acts(&self, cfg: &ModelConfig) -> ActPlan {
        llama::plan_of(cfg, true)
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
        llama::block_forward(ops, cfg, k, &block_w(cfg, w), x, n, attn)
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
        llama::block_backward(ops, cfg, k, &block_w(cfg, w), &block_w(cfg, dw), x, d, s, acc)
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
        ("Qwen3ForCausalLM", "qwen3")
    }

    /// A `Qwen3ForCausalLM` config.json: Llama's fields with `head_dim` of its own,
    /// `attention_bias`, `use_sliding_window` refused.
    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let f = HfFields::read(v, path)?;
        super::qwen2::refuse_sliding_window(&f, path)?;
        let bias = f.flag("attention_bias", false)?;
        Ok(ModelConfig { qkv_bias: bias, out_bias: bias, ..f.config(QWEN3, f.flag("tie_word_embeddings", false)?) })
    }

    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
        let mut v = super::qwen2::hf_config_qwen(cfg, torch_dtype, self.hf_names());
        v["attention_bias"] = cfg.qkv_bias.into();
        v
    }

    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
        let hs = cfg.head_dim;
        llama::hf_tensors_of(cfg, lay, |l, name| {
            [("self_attn.q_norm.weight", T::QNormW), ("self_attn.k_norm.weight", T::KNormW)]
                .into_iter()
                .map(|(n, t)| HfTensor { name: name(n), range: lay.layer(t, l), shape: vec![hs], transposed: false })
                .collect()
        })
    }
}

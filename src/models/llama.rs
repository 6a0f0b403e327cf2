//! Llama (transformers' `LlamaForCausalLM`: Llama 3, SmolLM2, TinyLlama): rotary positions,
//! pre-RMSNorm blocks, grouped-query attention, a SwiGLU MLP, no biases (unless the config sets
//! `attention_bias`: q, k, v and the output projection), the LM head tied or not. Its files:
//! llm.c's `llama3`-branch model file (magic 20240803) and transformers' directories.
//!
//! The block's calls, its activations and the config.json fields it shares with its kin are
//! `pub` here for the families built on it ([`super::qwen2`], [`super::qwen3`]), which pass
//! their weights as a [`BlockW`].

use super::family::{Arch, Attn, Consts};
use crate::acts::{ActPlan, ActSpec, BackActs, BlockActs, NormActs, Width};
use crate::backend::ops::{Heads, Mat, Ops, Rows, Seq};
use crate::backend::Buf;
use crate::config::{Family, Llama3Scaling, ModelConfig, Rope, GPT2_VOCAB};
use crate::files::{Dtype, ModelFile, HEADER_BYTES};
use crate::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View, Weights};
use crate::rng::Mt19937;
use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;

pub struct Llama;

pub const LLAMA: Family = Family("llama");

/// Magic of llm.c's llama3 model file (its `llama3` branch, train_llama3.py's write_model).
pub const LLMC_MAGIC: i32 = 20240803;

/// Llama's tensors, in file order (llm.c's for the llama3 file's slots it uses); the per-layer
/// ones are stacked over the L blocks. Those the config leaves out (an untied head, biases)
/// take no space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T {
    Wte,      // (Vp, C) token embedding (and the tied LM head)
    LmHead,   // (Vp, C) an untied LM head, else empty
    Ln1W,     // (L, C) input_layernorm
    QkvW,     // (L, QKV, C) q_proj, k_proj, v_proj stacked (transformers' row layout)
    QkvB,     // (L, QKV) their biases, or empty
    AttProjW, // (L, C, QD) o_proj
    AttProjB, // (L, C) its bias, or empty
    Ln2W,     // (L, C) post_attention_layernorm
    FcW,      // (L, 2F, C) up_proj then gate_proj (llm.c's llama3 c_fc then c_fc2)
    FcProjW,  // (L, C, F) down_proj
    LnfW,     // (C) model.norm
}
crate::ids!(T);

/// The activations a Llama-style block keeps per layer, and its workspace.
#[derive(Clone, Copy, Debug)]
pub enum A {
    Ln1,       // (N, C)
    Ln1Rstd,   // (N)
    Qkv,       // (N, QKV) q, k (rotated in place), v
    Atty,      // (N, QD)
    AttStats,  // (B, NH, T, 2) each query row's softmax statistics (flash attention's)
    Residual2, // (N, C)
    Ln2,       // (N, C)
    Ln2Rstd,   // (N)
    Fch,       // (N, 2F) up and gate
    FchAct,    // (N, F) after SwiGLU
    Scratch,   // (N, max(C, QD)) shared: attention's workspace, projections' outputs; d(ln), d(atty)
    QkvRaw,    // (N, QKV) the projection before the heads' norm (Qwen3; else empty)
    QkRstd,    // (N, NH + KV) the heads' norm's rstd (Qwen3; else empty)
}
crate::ids!(A);

/// The backward's buffers.
#[derive(Clone, Copy, Debug)]
pub enum D {
    DAct,    // (N, F) d(fch_act)
    DFch,    // (N, max(2F, 3 QD)) d(fch); attention backward's workspace
    DQkv,    // (N, QKV)
    DQkvRaw, // (N, QKV) d(qkv_raw) (Qwen3; else empty)
}
crate::ids!(D);

/// A Llama shape: no biases, a tied head, eps 1e-5, HS = C / NH, the vocabulary and context given.
#[allow(clippy::too_many_arguments)]
pub fn config(
    layers: usize,
    c: usize,
    heads: usize,
    kv: usize,
    f: usize,
    vocab: usize,
    max_t: usize,
    rope: Rope,
) -> ModelConfig {
    ModelConfig {
        family: LLAMA,
        max_seq_len: max_t,
        vocab_size: vocab,
        padded_vocab_size: crate::config::pad_vocab(vocab),
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        channels: c,
        head_dim: c / heads.max(1),
        hidden: f,
        norm_eps: 1e-5,
        rope,
        tied_head: true,
        qkv_bias: false,
        out_bias: false,
    }
}

/// `NAME` presets and the explicit `LxC:NH:KV[:F[:maxT]]` form of `llama:...` descriptors (F
/// defaults to SwiGLU's 8C/3 rounded up to a multiple of 64; GPT-2's vocabulary, so that
/// GPT-2-tokenized data trains it).
fn descriptor(rest: &str, desc: &str) -> Result<ModelConfig> {
    // The configs of the models on the Hub (config.json), without their weights.
    let llama3_scaling = |factor: f32| Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let rope = |theta: f32, scaling: Option<Llama3Scaling>| Rope { theta, scaling };
    let preset = match rest {
        "smollm2-135m" => Some(config(30, 576, 9, 3, 1536, 49152, 8192, rope(100000.0, None))),
        "smollm2-360m" => Some(config(32, 960, 15, 5, 2560, 49152, 8192, rope(100000.0, None))),
        "smollm2-1.7b" => Some(config(24, 2048, 32, 32, 8192, 49152, 8192, rope(130000.0, None))),
        "tinyllama-1.1b" => {
            Some(ModelConfig { tied_head: false, ..config(22, 2048, 32, 4, 5632, 32000, 2048, Rope::BASE) })
        }
        "llama3.2-1b" => {
            Some(config(16, 2048, 32, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
        }
        "llama3.2-3b" => {
            Some(config(28, 3072, 24, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
        }
        _ => None,
    };
    if let Some(cfg) = preset {
        return Ok(cfg);
    }
    let parts: Vec<&str> = rest.split(':').collect();
    let lc = parts.first().and_then(|lc| lc.split_once('x'));
    let num = |i: usize| parts.get(i).map(|s| s.parse::<usize>().ok());
    if let (Some((l, c)), Some(Some(nh)), Some(Some(kv))) = (lc, num(1), num(2)) {
        if let (Ok(l), Ok(c)) = (l.parse::<usize>(), c.parse::<usize>()) {
            let f = match num(3) {
                None => (8 * c / 3).div_ceil(64) * 64,
                Some(Some(f)) => f,
                Some(None) => bail!("bad F in model descriptor '{desc}'"),
            };
            let max_t = match num(4) {
                None => 1024,
                Some(Some(t)) => t,
                Some(None) => bail!("bad maxT in model descriptor '{desc}'"),
            };
            if parts.len() <= 5 {
                if nh == 0 || !c.is_multiple_of(nh) {
                    bail!("model descriptor '{desc}': channels {c} is not a multiple of the number of heads {nh}");
                }
                return Ok(config(l, c, nh, kv, f, GPT2_VOCAB, max_t, Rope::BASE));
            }
        }
    }
    bail!(
        "unknown Llama model '{desc}': use llama:smollm2-135m, llama:smollm2-360m, llama:smollm2-1.7b, \
         llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b, or llama:LxC:NH:KV[:F[:maxT]] such as \
         llama:4x256:8:2"
    )
}

/// The checks every Llama-style family shares: rotary positions, grouped-query heads.
pub fn validate_common(cfg: &ModelConfig) -> Result<()> {
    cfg.validate_rope()
}

/// A Llama-style family's tensors, in Llama's file order ([`T`]), with the ones the config
/// leaves out empty.
pub fn tensors_of(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let (c, vp, f, qkv, qd) = (cfg.channels, cfg.padded_vocab_size, cfg.hidden, cfg.qkv_dim(), cfg.q_dim());
    let s = TensorSpec::new;
    let maybe = |on: bool, t: TensorSpec| if on { t } else { t.absent() };
    // GEMM gradients are written whole by backward; wte only when it is the head too.
    vec![
        s("wte", &[vp, c], false, cfg.tied_head),
        maybe(!cfg.tied_head, s("lmhead", &[vp, c], false, true)),
        s("ln1w", &[c], true, false),
        s("qkvw", &[qkv, c], true, true),
        maybe(cfg.qkv_bias, s("qkvb", &[qkv], true, true)),
        s("attprojw", &[c, qd], true, true),
        maybe(cfg.out_bias, s("attprojb", &[c], true, true)),
        s("ln2w", &[c], true, false),
        s("fcw", &[2 * f, c], true, true),
        s("fcprojw", &[c, f], true, true),
        s("lnfw", &[c], false, false),
    ]
}

/// transformers' `_init_weights` for Llama: N(0, 0.02) for the embedding (its V real rows),
/// the untied head and every projection; biases 0; RMSNorm weights 1. `extra` runs after,
/// for a family's own tensors.
pub fn init_common(w: &mut dyn InitSink, rng: &mut Mt19937) {
    let (cfg, lay) = (*w.config(), w.layout().clone());
    let (l_n, c, v) = (cfg.num_layers, cfg.channels, cfg.vocab_size);
    for t in [T::Ln1W, T::Ln2W, T::LnfW] {
        w.fill(lay.range(t), 1.0);
    }
    let rows = |t: T| lay.range(t).start..lay.range(t).start + v * c; // the V real rows
    w.normal(rows(T::Wte), rng, 0.0, 0.02);
    if !cfg.tied_head {
        w.normal(rows(T::LmHead), rng, 0.0, 0.02);
    }
    for l in 0..l_n {
        for t in [T::QkvW, T::AttProjW, T::FcW, T::FcProjW] {
            w.normal(lay.layer(t, l), rng, 0.0, 0.02);
        }
    }
}

/// The activations of a Llama-style block ([`A`], [`D`]); with `head_norm` also those of the
/// query and key heads' RMSNorm (Qwen3).
pub fn plan_of(cfg: &ModelConfig, head_norm: bool) -> ActPlan {
    let (c, f, qkv, qd) = (cfg.channels, cfg.hidden, cfg.qkv_dim(), cfg.q_dim());
    let hn = |w: usize| if head_norm { w } else { 0 };
    let k = ActSpec::kept;
    let r = ActSpec::recomputed;
    let st = ActSpec::stat;
    let p = Width::Pos;
    ActPlan {
        fwd: vec![
            r("ln1", p(c), 2),
            st("ln1_rstd", p(1)),
            k("qkv", p(qkv)),
            k("atty", p(qd)),
            st("att_stats", Width::Heads(2)),
            k("residual2", p(c)),
            r("ln2", p(c), 2),
            st("ln2_rstd", p(1)),
            k("fch", p(2 * f)),
            r("fch_act", p(f), 1),
            ActSpec::shared("scratch", p(c.max(qd))),
            k("qkv_raw", p(hn(qkv))),
            st("qk_rstd", p(hn(cfg.num_heads + cfg.num_kv_heads))),
        ],
        back: vec![
            ActSpec::shared("dact", p(f)),
            ActSpec::shared("dfch", p((2 * f).max(3 * qd))),
            ActSpec::shared("dqkv", p(qkv)),
            ActSpec::shared("dqkv_raw", p(hn(qkv))),
        ],
        recompute: 0,
    }
}

/// Llama's activations ([`plan_of`] without the heads' norm).
pub fn plan(cfg: &ModelConfig) -> ActPlan {
    plan_of(cfg, false)
}

/// What a Llama-style block's calls read: its weights (or, for backward, their gradients).
#[derive(Clone, Copy, Debug)]
pub struct BlockW {
    pub ln1: Buf,
    pub qkv: Buf,
    pub qkv_b: Option<Buf>,
    pub o: Buf,
    pub o_b: Option<Buf>,
    pub ln2: Buf,
    pub up_gate: Buf,
    pub down: Buf,
    /// Qwen3's RMSNorm weights of the query and of the key heads (HS each).
    pub head_norm: Option<(Buf, Buf)>,
}

impl BlockW {
    /// Llama's tensors ([`T`]) of a block's view, the biases where the config has them.
    pub fn of(cfg: &ModelConfig, w: &View<Buf>) -> BlockW {
        BlockW {
            ln1: w[T::Ln1W],
            qkv: w[T::QkvW],
            qkv_b: cfg.qkv_bias.then_some(w[T::QkvB]),
            o: w[T::AttProjW],
            o_b: cfg.out_bias.then_some(w[T::AttProjB]),
            ln2: w[T::Ln2W],
            up_gate: w[T::FcW],
            down: w[T::FcProjW],
            head_norm: None,
        }
    }
}

pub fn heads(cfg: &ModelConfig) -> Heads {
    Heads { nh: cfg.num_heads, nkv: cfg.num_kv_heads, hs: cfg.head_dim }
}

/// residual2 = res_in + o_proj(attention(rope(qkv(rmsnorm1(res_in))))),
/// res_out = residual2 + down(swiglu(up_gate(rmsnorm2(residual2)))).
pub fn block_forward(ops: &mut Ops, cfg: &ModelConfig, k: &Consts, w: &BlockW, x: &BlockActs, n: usize, attn: Attn) {
    let (c, f, h, eps, qkv) = (cfg.channels, cfg.hidden, heads(cfg), cfg.norm_eps, cfg.qkv_dim());
    let rope = k.table.expect("a Llama-style model has its rotary table");
    let a = &x.a;
    ops.rmsnorm_forward(a[A::Ln1], a[A::Ln1Rstd], x.res_in, w.ln1, Rows { n, c }, eps);
    match w.head_norm {
        None => ops.matmul_forward(a[A::Qkv], a[A::Ln1], w.qkv, w.qkv_b, Mat { n, c, oc: qkv }),
        Some((wq, wk)) => {
            ops.matmul_forward(a[A::QkvRaw], a[A::Ln1], w.qkv, w.qkv_b, Mat { n, c, oc: qkv });
            ops.head_norm_forward(a[A::Qkv], a[A::QkRstd], a[A::QkvRaw], wq, wk, n, h, eps);
        }
    }
    let ws = a[A::Scratch].prefix(n * h.q());
    match attn {
        Attn::Causal(s) => {
            ops.rope_forward(a[A::Qkv], rope, n, s.t, 0, h);
            ops.attention_forward(a[A::Atty], a[A::AttStats], ws, a[A::Qkv], s, h)
        }
        Attn::Cached { k, v, pos, cap, .. } => {
            ops.rope_forward(a[A::Qkv], rope, n, n, pos, h);
            ops.attention_forward_cached(a[A::Atty], ws, a[A::Qkv], k, v, pos, n, cap, h)
        }
    }
    // Attention has filled the cache for all n positions; only the outputs read go on.
    let (x, n) = (&x.last_rows(&plan_of(cfg, w.head_norm.is_some()), c, n, attn.keep(n)), attn.keep(n));
    let a = &x.a;
    let out = a[A::Scratch].prefix(n * c);
    ops.matmul_forward(out, a[A::Atty], w.o, w.o_b, Mat { n, c: h.q(), oc: c });
    ops.residual_forward(a[A::Residual2], x.res_in, out);
    ops.rmsnorm_forward(a[A::Ln2], a[A::Ln2Rstd], a[A::Residual2], w.ln2, Rows { n, c }, eps);
    ops.matmul_forward(a[A::Fch], a[A::Ln2], w.up_gate, None, Mat { n, c, oc: 2 * f });
    ops.swiglu_forward(a[A::FchAct], a[A::Fch], Rows { n, c: f });
    ops.matmul_forward(out, a[A::FchAct], w.down, None, Mat { n, c: f, oc: c });
    ops.residual_forward(x.res_out, a[A::Residual2], out);
}

/// Backward of [`block_forward`], in reverse. The rotation was applied to qkv in place, so
/// attention's backward sees the rotated q and k it used, and its dq, dk are rotated back
/// before the projection's backward. Under recompute (`x.recompute`) the SwiGLU's output (1)
/// and the norms' outputs (2) are recomputed from the kept activations just before they are
/// read, by the forward's own calls, so every value is the same bits. (Attention's
/// probabilities are never kept: its backward rebuilds them at every level.)
#[allow(clippy::too_many_arguments)]
pub fn block_backward(
    ops: &mut Ops,
    cfg: &ModelConfig,
    k: &Consts,
    w: &BlockW,
    dw: &BlockW,
    x: &BlockActs,
    d: &BackActs,
    s: Seq,
    acc: bool,
) {
    let (c, f, h, qkv, n) = (cfg.channels, cfg.hidden, heads(cfg), cfg.qkv_dim(), s.n());
    let rope = k.table.expect("a Llama-style model has its rotary table");
    let (a, dres) = (&x.a, d.dres);
    let (dact, dfch) = (d.d[D::DAct].prefix(n * f), d.d[D::DFch].prefix(n * 2 * f));
    let (dln, datty) = (a[A::Scratch].prefix(n * c), a[A::Scratch].prefix(n * h.q()));
    // MLP branch.
    if x.recompute >= 1 {
        ops.swiglu_forward(a[A::FchAct], a[A::Fch], Rows { n, c: f });
    }
    ops.matmul_backward(Some(dact), dw.down, None, dres, a[A::FchAct], w.down, Mat { n, c: f, oc: c }, acc);
    ops.swiglu_backward(dfch, dact, a[A::Fch], Rows { n, c: f });
    if x.recompute >= 2 {
        ops.rmsnorm_forward(a[A::Ln2], a[A::Ln2Rstd], a[A::Residual2], w.ln2, Rows { n, c }, cfg.norm_eps);
    }
    ops.matmul_backward(Some(dln), dw.up_gate, None, dfch, a[A::Ln2], w.up_gate, Mat { n, c, oc: 2 * f }, acc);
    ops.rmsnorm_backward(dres, dw.ln2, dln, a[A::Residual2], w.ln2, a[A::Ln2Rstd], Rows { n, c });
    // Attention branch; dfch is free again and serves as the attention workspace.
    ops.matmul_backward(Some(datty), dw.o, dw.o_b, dres, a[A::Atty], w.o, Mat { n, c: h.q(), oc: c }, acc);
    let ws = d.d[D::DFch].prefix(n * 3 * h.q());
    ops.attention_backward(d.d[D::DQkv], ws, datty, a[A::Qkv], a[A::AttStats], s, h);
    ops.rope_backward(d.d[D::DQkv], rope, n, s.t, 0, h);
    let dqkv = match (w.head_norm, dw.head_norm) {
        (Some((wq, wk)), Some((dwq, dwk))) => {
            let (draw, rstd) = (d.d[D::DQkvRaw], a[A::QkRstd]);
            ops.head_norm_backward(draw, dwq, dwk, d.d[D::DQkv], a[A::QkvRaw], wq, wk, rstd, n, h);
            draw
        }
        _ => d.d[D::DQkv],
    };
    if x.recompute >= 2 {
        ops.rmsnorm_forward(a[A::Ln1], a[A::Ln1Rstd], x.res_in, w.ln1, Rows { n, c }, cfg.norm_eps);
    }
    let dln = d.input_grad.then_some(dln);
    ops.matmul_backward(dln, dw.qkv, dw.qkv_b, dqkv, a[A::Ln1], w.qkv, Mat { n, c, oc: qkv }, acc);
    if let Some(dln) = dln {
        ops.rmsnorm_backward(dres, dw.ln1, dln, x.res_in, w.ln1, a[A::Ln1Rstd], Rows { n, c });
    }
}

/// The embedding (no learned positions).
pub fn embed(ops: &mut Ops, cfg: &ModelConfig, wte: Buf, out: Buf, ids: Buf, s: Seq) {
    ops.encoder_forward(out, ids, wte, None, s, cfg.channels);
}

/// The final RMSNorm.
pub fn final_norm(ops: &mut Ops, cfg: &ModelConfig, w: Buf, a: &NormActs, x: Buf, n: usize) {
    ops.rmsnorm_forward(a.out, a.rstd, x, w, Rows { n, c: cfg.channels }, cfg.norm_eps);
}

#[allow(clippy::too_many_arguments)]
pub fn final_norm_backward(
    ops: &mut Ops,
    cfg: &ModelConfig,
    w: Buf,
    dw: Buf,
    a: &NormActs,
    dx: Buf,
    dout: Buf,
    x: Buf,
    n: usize,
) {
    ops.rmsnorm_backward(dx, dw, dout, x, w, a.rstd, Rows { n, c: cfg.channels });
}

impl Arch for Llama {
    fn name(&self) -> &'static str {
        LLAMA.0
    }

    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>> {
        desc.trim().strip_prefix("llama:").map(|rest| descriptor(rest, desc))
    }

    fn descriptor_help(&self) -> &'static str {
        "Llama: llama:smollm2-135m, llama:smollm2-360m, llama:smollm2-1.7b, llama:tinyllama-1.1b, llama:llama3.2-1b, \
         llama:llama3.2-3b, llama:LxC:NH:KV[:F[:maxT]] such as llama:4x256:8:2"
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        validate_common(cfg)?;
        if cfg.head_dim * cfg.num_heads != cfg.channels {
            bail!(
                "a Llama model has HS = C / NH (head_dim {} with {} heads of C={})",
                cfg.head_dim,
                cfg.num_heads,
                cfg.channels
            );
        }
        if cfg.qkv_bias != cfg.out_bias {
            bail!("a Llama model's attention_bias puts biases on q, k, v and the output projection alike");
        }
        Ok(())
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        tensors_of(cfg)
    }

    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937) {
        init_common(w, rng)
    }

    fn head(&self, cfg: &ModelConfig) -> TensorId {
        if cfg.tied_head {
            T::Wte.into()
        } else {
            T::LmHead.into()
        }
    }

    fn acts(&self, cfg: &ModelConfig) -> ActPlan {
        plan(cfg)
    }

    fn host_consts(&self, cfg: &ModelConfig) -> Option<Vec<f32>> {
        Some(rope_table(cfg))
    }

    fn embed(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, out: Buf, ids: Buf, s: Seq, _pos: usize) {
        embed(ops, cfg, w[T::Wte], out, ids, s)
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
        block_forward(ops, cfg, k, &BlockW::of(cfg, w), x, n, attn)
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
        block_backward(ops, cfg, k, &BlockW::of(cfg, w), &BlockW::of(cfg, dw), x, d, s, acc)
    }

    fn final_norm(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, a: &NormActs, x: Buf, n: usize) {
        final_norm(ops, cfg, w[T::LnfW], a, x, n)
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
        final_norm_backward(ops, cfg, w[T::LnfW], dw[T::LnfW], a, dx, dout, x, n)
    }

    fn hf_names(&self) -> (&'static str, &'static str) {
        ("LlamaForCausalLM", "llama")
    }

    /// A `LlamaForCausalLM` config.json, checked to be a model llmrs computes exactly: every
    /// field that changes the computation is read, and one that llmrs does not implement is an
    /// error that names it.
    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let f = HfFields::read(v, path)?;
        if f.head_dim * f.heads != f.c {
            bail!(
                "{}: head_dim {} is not hidden_size / num_attention_heads; a Llama model has HS = C / NH",
                path.display(),
                f.head_dim
            );
        }
        if f.flag("mlp_bias", false)? {
            bail!("{}: mlp_bias true is not supported (llmrs's Llama MLP has no biases)", path.display());
        }
        let bias = f.flag("attention_bias", false)?;
        Ok(ModelConfig { qkv_bias: bias, out_bias: bias, ..f.config(LLAMA, f.flag("tie_word_embeddings", false)?) })
    }

    /// `config.json` as transformers writes it for a LlamaForCausalLM of this shape.
    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
        let mut v = hf_config_common(cfg, torch_dtype, ("LlamaForCausalLM", "llama"));
        v["attention_bias"] = cfg.qkv_bias.into();
        v["mlp_bias"] = false.into();
        v
    }

    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
        hf_tensors_of(cfg, lay, |_, _| vec![])
    }

    fn llmc_magic(&self) -> Option<i32> {
        Some(LLMC_MAGIC)
    }

    fn llmc_header(&self, cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
        llmc_header(cfg, dtype)
    }

    fn llmc_write<'a>(&self, w: &'a Weights, dtype: Dtype) -> Result<(Vec<u8>, std::borrow::Cow<'a, [f32]>)> {
        llmc_write(w, dtype).map(|(h, v)| (h, std::borrow::Cow::Owned(v)))
    }

    fn llmc_read(&self, f: &mut ModelFile) -> Result<Weights> {
        llmc_read(f)
    }

    fn llmc_config(&self, bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        read_header(bytes, path)
    }
}

// ---- Hugging Face (transformers' LlamaForCausalLM and its kin) ----------------------------------

/// The config.json fields every Llama-style family reads alike.
pub struct HfFields<'a> {
    v: &'a serde_json::Value,
    path: &'a Path,
    pub c: usize,
    pub heads: usize,
    pub kv: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub f: usize,
    pub vocab: usize,
    pub max_t: usize,
    pub rope: Rope,
    pub eps: f32,
}

impl<'a> HfFields<'a> {
    pub fn read(v: &'a serde_json::Value, path: &'a Path) -> Result<Self> {
        let p = path.display();
        let int = |k: &str| -> Result<usize> {
            v[k].as_u64().map(|x| x as usize).with_context(|| format!("{p}: {k} is missing or not a whole number"))
        };
        let opt_int = |k: &str| -> Result<Option<usize>> {
            match v.get(k).filter(|x| !x.is_null()) {
                None => Ok(None),
                Some(x) => {
                    x.as_u64().map(|x| Some(x as usize)).with_context(|| format!("{p}: {k} is not a whole number"))
                }
            }
        };
        let num = |x: &serde_json::Value, k: &str| -> Result<f32> {
            x.as_f64().map(|x| x as f32).with_context(|| format!("{p}: {k} is not a number"))
        };
        let (c, heads, layers) = (int("hidden_size")?, int("num_attention_heads")?, int("num_hidden_layers")?);
        if heads == 0 {
            bail!("{p}: num_attention_heads is 0");
        }
        let kv = opt_int("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = opt_int("head_dim")?.unwrap_or(c / heads);
        let act = v["hidden_act"].as_str().unwrap_or("silu");
        if act != "silu" {
            bail!("{p}: hidden_act '{act}' is not supported (the SwiGLU MLP uses silu)");
        }
        let max_t = opt_int("max_position_embeddings")?.unwrap_or(2048);
        // transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters.
        for k in ["rope_parameters", "rope_scaling"] {
            if !(v[k].is_null() || v[k].is_object()) {
                bail!("{p}: {k} is not a JSON object (of rope_type, rope_theta and the scaling's fields)");
            }
        }
        // Where both are written they must agree: transformers 5 reads rope_parameters,
        // transformers 4 the top-level fields, so a file where they differ means two models.
        let params = &v["rope_parameters"];
        let theta = match (&v["rope_theta"], &params["rope_theta"]) {
            (t, p5) if !t.is_null() && !p5.is_null() => {
                let (t4, t5) = (num(t, "rope_theta")?, num(p5, "rope_parameters.rope_theta")?);
                if t4 != t5 {
                    bail!(
                        "{p}: rope_theta {t4} and rope_parameters.rope_theta {t5} disagree (transformers 4 reads the \
                         first, 5 the second): keep the one the model was trained with"
                    );
                }
                t5
            }
            (t, _) if !t.is_null() => num(t, "rope_theta")?,
            (_, t) if !t.is_null() => num(t, "rope_parameters.rope_theta")?,
            _ => 10000.0,
        };
        let scaling_of = |field: &str, s: &serde_json::Value| -> Result<Option<Llama3Scaling>> {
            let kind = s["rope_type"].as_str().or(s["type"].as_str()).unwrap_or("default");
            Ok(match kind {
                "default" => None,
                "llama3" => {
                    let f = |k: &str| num(&s[k], &format!("{field}.{k}"));
                    let old = s["original_max_position_embeddings"].as_u64().with_context(|| {
                        format!("{p}: {field}.original_max_position_embeddings is missing or not a whole number")
                    })?;
                    Some(Llama3Scaling {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: old as usize,
                    })
                }
                other => {
                    bail!("{p}: {field}.rope_type '{other}' is not supported (llmrs implements 'default' and 'llama3')")
                }
            })
        };
        let scaling = match (v["rope_scaling"].is_null(), params.is_null()) {
            (false, false) => {
                let (s4, s5) =
                    (scaling_of("rope_scaling", &v["rope_scaling"])?, scaling_of("rope_parameters", params)?);
                if s4 != s5 {
                    bail!(
                        "{p}: rope_scaling and rope_parameters describe different rotary scalings (transformers 4 \
                         reads the first, 5 the second): keep the one the model was trained with"
                    );
                }
                s5
            }
            (false, true) => scaling_of("rope_scaling", &v["rope_scaling"])?,
            (true, _) => scaling_of("rope_parameters", params)?,
        };
        let eps = match &v["rms_norm_eps"] {
            serde_json::Value::Null => 1e-6,
            x => num(x, "rms_norm_eps")?,
        };
        Ok(HfFields {
            v,
            path,
            c,
            heads,
            kv,
            head_dim,
            layers,
            f: int("intermediate_size")?,
            vocab: int("vocab_size")?,
            max_t,
            rope: Rope { theta, scaling },
            eps,
        })
    }

    /// A boolean field, `default` when absent.
    pub fn flag(&self, k: &str, default: bool) -> Result<bool> {
        match self.v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(x) => x.as_bool().with_context(|| format!("{}: {k} is not true or false", self.path.display())),
        }
    }

    /// The config of `family` these fields give, with no biases.
    pub fn config(&self, family: Family, tied: bool) -> ModelConfig {
        ModelConfig {
            family,
            head_dim: self.head_dim,
            norm_eps: self.eps,
            tied_head: tied,
            ..config(self.layers, self.c, self.heads, self.kv, self.f, self.vocab, self.max_t, self.rope)
        }
    }
}

/// config.json's fields as transformers writes them for any Llama-style model of this shape.
pub fn hf_config_common(cfg: &ModelConfig, torch_dtype: &str, (arch, kind): (&str, &str)) -> serde_json::Value {
    let scaling = cfg.rope.scaling.map(|s| {
        serde_json::json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        })
    });
    serde_json::json!({
        "architectures": [arch],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.channels,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size(),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tied_head,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": torch_dtype,
    })
}

/// transformers' tensors of a Llama-style model (Llama's [`T`] layout): `nn.Linear` (out, in)
/// as llmrs's; q, k and v are rows of QkvW, up and gate rows of FcW. `extra(l, name)` adds a
/// family's own per-layer tensors (Qwen3's q_norm, k_norm).
pub fn hf_tensors_of(
    cfg: &ModelConfig,
    lay: &ParamLayout,
    extra: impl Fn(usize, &dyn Fn(&str) -> String) -> Vec<HfTensor>,
) -> Vec<HfTensor> {
    let (c, v, f, kv, qd) = (cfg.channels, cfg.vocab_size, cfg.hidden, cfg.kv_dim(), cfg.q_dim());
    let t = |name: String, range: std::ops::Range<usize>, shape: Vec<usize>| HfTensor {
        name,
        range,
        shape,
        transposed: false,
    };
    // Rows r0..r0+n of a tensor laid out as rows of `width`.
    let rows = |whole: std::ops::Range<usize>, r0: usize, n: usize, width: usize| {
        whole.start + r0 * width..whole.start + (r0 + n) * width
    };
    let wte = lay.range(T::Wte);
    let mut out = vec![t("model.embed_tokens.weight".into(), wte.start..wte.start + v * c, vec![v, c])];
    for l in 0..cfg.num_layers {
        let b = lay.block(l);
        let name = |s: &str| format!("model.layers.{l}.{s}");
        out.push(t(name("input_layernorm.weight"), b[T::Ln1W].clone(), vec![c]));
        for (proj, r0, n) in [("q_proj", 0, qd), ("k_proj", qd, kv), ("v_proj", qd + kv, kv)] {
            out.push(t(name(&format!("self_attn.{proj}.weight")), rows(b[T::QkvW].clone(), r0, n, c), vec![n, c]));
            if cfg.qkv_bias {
                out.push(t(name(&format!("self_attn.{proj}.bias")), rows(b[T::QkvB].clone(), r0, n, 1), vec![n]));
            }
        }
        out.push(t(name("self_attn.o_proj.weight"), b[T::AttProjW].clone(), vec![c, qd]));
        if cfg.out_bias {
            out.push(t(name("self_attn.o_proj.bias"), b[T::AttProjB].clone(), vec![c]));
        }
        out.extend(extra(l, &name));
        out.push(t(name("post_attention_layernorm.weight"), b[T::Ln2W].clone(), vec![c]));
        out.push(t(name("mlp.up_proj.weight"), rows(b[T::FcW].clone(), 0, f, c), vec![f, c]));
        out.push(t(name("mlp.gate_proj.weight"), rows(b[T::FcW].clone(), f, f, c), vec![f, c]));
        out.push(t(name("mlp.down_proj.weight"), b[T::FcProjW].clone(), vec![c, f]));
    }
    out.push(t("model.norm.weight".into(), lay.range(T::LnfW), vec![c]));
    if !cfg.tied_head {
        let h = lay.range(T::LmHead);
        out.push(t("lm_head.weight".into(), h.start..h.start + v * c, vec![v, c]));
    }
    out
}

// ---- llm.c's llama3 model file ----------------------------------------------------------------

/// The 12 block slots of llm.c's file (GPT-2's), with Llama's widths: the tensor that fills each
/// (None: a bias Llama lacks, written as zeros) and its values per layer.
fn slots(cfg: &ModelConfig) -> [(&'static str, Option<T>, usize); 12] {
    let (c, f, qkv) = (cfg.channels, cfg.hidden, cfg.qkv_dim());
    [
        ("ln1w", Some(T::Ln1W), c),
        ("ln1b", None, c),
        ("qkvw", Some(T::QkvW), qkv * c),
        ("qkvb", Some(T::QkvB), qkv),
        ("attprojw", Some(T::AttProjW), c * c),
        ("attprojb", Some(T::AttProjB), c),
        ("ln2w", Some(T::Ln2W), c),
        ("ln2b", None, c),
        ("fcw", Some(T::FcW), 2 * f * c),
        ("fcb", None, 2 * f),
        ("fcprojw", Some(T::FcProjW), c * f),
        ("fcprojb", None, c),
    ]
}

/// The bytes of an llm.c llama3 model file: [`llmc_header`], then GPT-2's 16 tensor slots:
/// wte (V, C), the LM head in wpe's slot (V, C; wte again when tied), zero biases where Llama
/// has none, fc = [up; gate], q and k rows in Meta's interleaved-pair layout.
pub fn llmc_write(w: &Weights, dtype: Dtype) -> Result<(Vec<u8>, Vec<f32>)> {
    let cfg = &w.config;
    let (c, v, l) = (cfg.channels, cfg.vocab_size, cfg.num_layers);
    let header = llmc_header(cfg, dtype)?;
    let mut out = Vec::with_capacity(w.data.len() + 2 * v * c);
    out.extend_from_slice(&w.tensor(T::Wte)[..v * c]);
    let head = if cfg.tied_head { T::Wte } else { T::LmHead };
    out.extend_from_slice(&w.tensor(head)[..v * c]);
    for (_, t, len) in slots(cfg) {
        for layer in 0..l {
            match t.map(|t| w.layer(t, layer)).filter(|x| !x.is_empty()) {
                None => out.extend(std::iter::repeat_n(0f32, len)),
                Some(x) if matches!(t, Some(T::QkvW | T::QkvB)) => {
                    out.extend(interleave_qk(cfg, x, t == Some(T::QkvW), false))
                }
                Some(x) => out.extend_from_slice(x),
            }
        }
    }
    out.extend_from_slice(w.tensor(T::LnfW));
    out.extend(std::iter::repeat_n(0f32, c));
    Ok((header, out))
}

/// Read an llm.c llama3 model file ([`llmc_write`]'s layout) into weights in transformers'
/// layout: the untied head and the biases are kept only when non-zero and distinct.
pub fn llmc_read(f: &mut ModelFile) -> Result<Weights> {
    let path = f.path;
    let (mut cfg, dtype) = read_header(&f.head, path)?;
    let (v, l, c) = (cfg.vocab_size, cfg.num_layers, cfg.channels);
    let slots = slots(&cfg);
    // The file's values: wte, head, then the 12 block slots and lnf w, b.
    let n = 2 * v * c + slots.iter().map(|s| l * s.2).sum::<usize>() + 2 * c;
    let want = 2 * HEADER_BYTES + n * dtype.bytes();
    if f.len != want as u64 {
        bail!(
            "{}: file is {} bytes but a {dtype} llama3 model of this shape needs {want}: truncated or corrupt",
            path.display(),
            f.len
        );
    }
    let mut vals = crate::mem::zeroed::<f32>(n);
    f.values(2 * HEADER_BYTES as u64, dtype, &mut vals)?;
    let mut at = 0;
    let mut take = |k: usize| {
        at += k;
        &vals[at - k..at]
    };
    // Views into the values (no copies: the file's values and the weights are the peak).
    let (wte, head) = (take(v * c), take(v * c));
    let blocks: Vec<(&str, Option<T>, usize, &[f32])> =
        slots.iter().map(|&(name, t, len)| (name, t, len, take(l * len))).collect();
    let (lnf_w, lnf_b) = (take(c), take(c));
    let zero = |x: &[f32]| x.iter().all(|&y| y == 0.0);
    for (name, t, _, x) in &blocks {
        if t.is_none() && !zero(x) {
            bail!("{}: the {name} slot holds non-zero values, but a Llama model has no such bias", path.display());
        }
    }
    if !zero(lnf_b) {
        bail!("{}: the lnfb slot holds non-zero values, but a Llama model has no such bias", path.display());
    }
    let slot = |t: T| blocks.iter().find(|b| b.1 == Some(t)).unwrap().3;
    let bias = !(zero(slot(T::QkvB)) && zero(slot(T::AttProjB)));
    (cfg.qkv_bias, cfg.out_bias) = (bias, bias);
    cfg.tied_head = head == wte;
    let mut w = Weights::zeros(cfg)?;
    w.tensor_mut(T::Wte)[..v * c].copy_from_slice(wte);
    if !cfg.tied_head {
        w.tensor_mut(T::LmHead)[..v * c].copy_from_slice(head);
    }
    w.tensor_mut(T::LnfW).copy_from_slice(lnf_w);
    for (_, t, len, x) in blocks {
        let Some(t) = t.filter(|&t| w.layout.spec(t).numel_per_layer() > 0) else { continue };
        for (layer, xl) in x.chunks_exact(len).enumerate() {
            if matches!(t, T::QkvW | T::QkvB) {
                w.layer_mut(t, layer).copy_from_slice(&interleave_qk(&cfg, xl, t == T::QkvW, true));
            } else {
                w.layer_mut(t, layer).copy_from_slice(xl);
            }
        }
    }
    Ok(w)
}

/// The rotary frequencies, as transformers computes them in f32: inv_freq_i =
/// 1 / theta^(2i/HS), then Llama 3.1's rescaling when the config has it (low frequencies
/// divided by `factor`, high ones kept, a smooth blend between).
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let hs = cfg.head_size();
    let base = cfg.rope.theta;
    let f: Vec<f32> =
        (0..hs / 2).map(|i| 1.0 / ((base as f64).powf(((2 * i) as f32 / hs as f32) as f64) as f32)).collect();
    let Some(s) = cfg.rope.scaling else { return f };
    let old = s.original_max_position_embeddings as f32;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    f.into_iter()
        .map(|x| {
            let wavelen = 2.0 * std::f32::consts::PI / x;
            let scaled = if wavelen > low_wavelen { x / s.factor } else { x };
            let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            // Neither high nor low frequency (wavelengths are finite and positive: no NaN).
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            } else {
                scaled
            }
        })
        .collect()
}

/// The rotary table (maxT, HS): each position's HS/2 cosines then HS/2 sines of
/// position * inv_freq_i (the angle rounded to f32 as transformers does, then its cosine
/// and sine rounded once).
pub fn rope_table(cfg: &ModelConfig) -> Vec<f32> {
    let (hs, half) = (cfg.head_size(), cfg.head_size() / 2);
    let f = inv_freq(cfg);
    let mut out = vec![0f32; cfg.max_seq_len * hs];
    for (p, row) in out.chunks_exact_mut(hs).enumerate() {
        for (i, &fi) in f.iter().enumerate() {
            let angle = (fi * p as f32) as f64;
            row[i] = angle.cos() as f32;
            row[half + i] = angle.sin() as f32;
        }
    }
    out
}

/// The rescaling llm.c's file means by `use_scaled_rope` for Llama 3.`minor` (3.1: factor 8,
/// as train_llama3.py; 3.2: factor 32, as Meta's Llama 3.2 configs).
fn llmc_scaling(minor: i32) -> Option<Llama3Scaling> {
    let factor = match minor {
        1 => 8.0,
        2 => 32.0,
        _ => return None,
    };
    Some(Llama3Scaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 })
}

/// Meta's hidden size of the SwiGLU MLP: 2/3 of 4C, times ffn_dim_multiplier, rounded up to
/// a multiple of multiple_of (train_llama3.py's MLP).
fn llmc_hidden(c: usize, multiple_of: usize, multiplier: f32) -> usize {
    let h = ((2 * 4 * c) as f64 / 3.0) as usize;
    let h = (multiplier as f64 * h as f64) as usize;
    multiple_of * h.div_ceil(multiple_of)
}

/// (multiple_of, ffn_dim_multiplier) that give hidden size F: multiplier 1 with the largest
/// power-of-two multiple_of that works (the form train_llama3.py's configs take), else F's
/// own ratio to 8C/3 with multiple_of = F.
fn llmc_ffn(c: usize, f: usize) -> Option<(usize, f32)> {
    let pow2 = (0..=10).rev().map(|k| 1usize << k);
    if let Some(m) = pow2.into_iter().find(|&m| llmc_hidden(c, m, 1.0) == f) {
        return Some((m, 1.0));
    }
    let h = ((2 * 4 * c) as f64 / 3.0) as usize;
    let ratio = (f as f64 / h.max(1) as f64) as f32;
    (llmc_hidden(c, f, ratio) == f).then_some((f, ratio))
}

/// The header of an llm.c llama3 model file (magic 20240803) for `cfg`: an int header of 256
/// (magic, version 3 fp32 / 5 bf16, maxT, V, L, NH, KV, C, multiple_of, use_scaled_rope, major,
/// minor), then a float header of 256 (ffn_dim_multiplier, norm_eps, rope_theta). A rope
/// scaling other than Llama 3.1's and 3.2's is written as llmrs's extension: minor 0, with
/// original_max_position_embeddings in int slot 12 and factor, low_freq_factor and
/// high_freq_factor in float slots 3-5 (llm.c reads neither; it knows only 3.1's scaling).
/// An error says what cannot be written, before anything is: a checkpoint's model file is
/// checked with this at the start of a run.
pub fn llmc_header(cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
    let (c, v, l, f) = (cfg.channels, cfg.vocab_size, cfg.num_layers, cfg.hidden);
    if cfg.head_dim * cfg.num_heads != c {
        bail!(
            "llm.c's llama3 header has no head size: it needs HS = C / NH (here {} x {} != {c})",
            cfg.num_heads,
            cfg.head_dim
        );
    }
    let (multiple_of, multiplier) = llmc_ffn(c, f)
        .ok_or_else(|| anyhow!("the MLP's hidden size {f} cannot be written in llm.c's llama3 header (C={c})"))?;
    let mut h = [0i32; 256];
    let mut hf = [0f32; 256];
    let minor = match cfg.rope.scaling {
        None => 1,
        Some(s) if Some(s) == llmc_scaling(1) => 1,
        Some(s) if Some(s) == llmc_scaling(2) => 2,
        Some(s) => {
            h[12] = i32::try_from(s.original_max_position_embeddings).map_err(|_| {
                anyhow!(
                    "rope scaling's original_max_position_embeddings {} does not fit llm.c's llama3 header",
                    s.original_max_position_embeddings
                )
            })?;
            hf[3..6].copy_from_slice(&[s.factor, s.low_freq_factor, s.high_freq_factor]);
            0
        }
    };
    let vals = [LLMC_MAGIC, dtype.version(), cfg.max_seq_len as i32, v as i32, l as i32, cfg.num_heads as i32];
    h[..6].copy_from_slice(&vals);
    h[6..12].copy_from_slice(&[
        cfg.num_kv_heads as i32,
        c as i32,
        multiple_of as i32,
        cfg.rope.scaling.is_some() as i32,
        3,
        minor,
    ]);
    hf[..3].copy_from_slice(&[multiplier, cfg.norm_eps, cfg.rope.theta]);
    let mut header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    header.extend(hf.iter().flat_map(|x| x.to_le_bytes()));
    Ok(header)
}

/// The q and k rows of a layer's qkv weight (`rows` true; its bias when false) moved between
/// transformers' layout (per head: the first halves of the rotated pairs, then the second
/// halves) and Meta's (pairs interleaved): `to_hf` reads Meta's. v is unchanged.
fn interleave_qk(cfg: &ModelConfig, x: &[f32], rows: bool, to_hf: bool) -> Vec<f32> {
    let (hs, heads) = (cfg.head_size(), cfg.num_heads + cfg.num_kv_heads);
    let width = if rows { cfg.channels } else { 1 };
    let mut out = x.to_vec();
    for h in 0..heads {
        for j in 0..hs / 2 {
            for p in 0..2 {
                let (hf, meta) = (h * hs + p * hs / 2 + j, h * hs + 2 * j + p);
                let (dst, src) = if to_hf { (hf, meta) } else { (meta, hf) };
                out[dst * width..(dst + 1) * width].copy_from_slice(&x[src * width..(src + 1) * width]);
            }
        }
    }
    out
}

/// The shape and dtype in the headers of an llm.c llama3 model file (its first 2 KiB). Tied
/// head and biases are told by the values ([`read_llmc`]): here every slot counts (untied,
/// biased).
fn read_header(bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
    let at = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    if bytes.len() < 2 * HEADER_BYTES {
        bail!(
            "{} is too short to be an llm.c llama3 model file ({} bytes): it is truncated",
            path.display(),
            bytes.len()
        );
    }
    let atf = |i: usize| f32::from_le_bytes(bytes[HEADER_BYTES + 4 * i..HEADER_BYTES + 4 * i + 4].try_into().unwrap());
    let dtype = match at(1) {
        3 => Dtype::F32,
        5 => Dtype::BF16,
        v => bail!("{}: llama3 model file version {v} is not supported (3 = fp32, 5 = bf16)", path.display()),
    };
    let dim = |i: usize, name: &str| -> Result<usize> {
        usize::try_from(at(i))
            .ok()
            .filter(|&x| x > 0)
            .with_context(|| format!("{}: header field {name} = {} is invalid", path.display(), at(i)))
    };
    let (max_t, v, l, nh, kv, c) = (
        dim(2, "max_seq_len")?,
        dim(3, "vocab_size")?,
        dim(4, "num_layers")?,
        dim(5, "num_heads")?,
        dim(6, "num_kv_heads")?,
        dim(7, "channels")?,
    );
    let multiple_of = dim(8, "multiple_of")?;
    let (multiplier, eps, theta) = (atf(0), atf(1), atf(2));
    if !(multiplier.is_finite() && multiplier > 0.0 && multiplier < 1e3) {
        bail!("{}: header field ffn_dim_multiplier = {multiplier} is invalid", path.display());
    }
    if c > 1 << 16 || multiple_of > 1 << 18 {
        bail!("{}: model shape is implausibly large (C={c}, multiple_of={multiple_of})", path.display());
    }
    let scaling = match (at(9), at(10), at(11)) {
        (0, 3, _) => None,
        (1, 3, 0) => {
            // llmrs's extension: the scaling written out (see llmc_header).
            let old = usize::try_from(at(12)).ok().filter(|&x| x > 0).with_context(|| {
                format!("{}: header field original_max_position_embeddings = {} is invalid", path.display(), at(12))
            })?;
            Some(Llama3Scaling {
                factor: atf(3),
                low_freq_factor: atf(4),
                high_freq_factor: atf(5),
                original_max_position_embeddings: old,
            })
        }
        (1, 3, minor) => Some(
            llmc_scaling(minor)
                .with_context(|| format!("{}: Llama 3.{minor}'s rope scaling is unknown", path.display()))?,
        ),
        (s, major, minor) => {
            bail!("{}: use_scaled_rope {s} for Llama {major}.{minor} is not supported", path.display())
        }
    };
    let f = llmc_hidden(c, multiple_of, multiplier);
    let mut cfg = config(l, c, nh, kv, f, v, max_t, Rope { theta, scaling });
    cfg.norm_eps = eps;
    cfg.tied_head = false;
    (cfg.qkv_bias, cfg.out_bias) = (true, true); // read every slot first; dropped when the biases are zero
    if nh == 0 || !c.is_multiple_of(nh) {
        bail!("{}: bad model header: channels {c} is not a multiple of the number of heads {nh}", path.display());
    }
    super::validate(&cfg).with_context(|| format!("{}: bad model header", path.display()))?;
    Ok((cfg, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rope;

    /// [`llmc_read`] of a file's bytes in memory.
    fn read_bytes(bytes: &[u8]) -> Result<Weights> {
        llmc_read(&mut ModelFile::from_bytes(bytes, std::path::Path::new("x.bin"))?)
    }

    #[test]
    fn llmc_file_round_trip() {
        use crate::files::Dtype;
        for desc in ["llama:2x64:4:2", "llama:1x32:2:1:40:16"] {
            for (tied, bias) in [(true, false), (false, true)] {
                let cfg = ModelConfig {
                    tied_head: tied,
                    qkv_bias: bias,
                    out_bias: bias,
                    ..ModelConfig::from_descriptor(desc).unwrap()
                };
                let mut w = Weights::random(cfg, 5).unwrap();
                if bias {
                    let n = w.tensor(T::QkvB).len();
                    w.tensor_mut(T::QkvB).copy_from_slice(&(0..n).map(|i| i as f32 * 0.01).collect::<Vec<_>>());
                }
                let (h, vals) = llmc_write(&w, Dtype::F32).unwrap();
                let mut bytes = h.clone();
                crate::files::f32s_to_le(&vals, &mut bytes);
                let back = read_bytes(&bytes).unwrap();
                assert_eq!(back, w, "{desc} tied={tied}");
                let (h2, vals2) = llmc_write(&back, Dtype::F32).unwrap();
                assert!(h2 == h && vals2 == vals, "byte-exact");
                assert!(read_bytes(&bytes[..bytes.len() - 4]).is_err());
            }
        }
        // A rope scaling llm.c's file cannot name (neither 3.1's nor 3.2's) is written out in
        // llmrs's extension and read back exactly; one that no file can hold is refused before
        // anything is written.
        let custom = Llama3Scaling {
            factor: 16.0,
            low_freq_factor: 2.0,
            high_freq_factor: 8.0,
            original_max_position_embeddings: 4096,
        };
        let base = ModelConfig::from_descriptor("llama:2x64:4:2").unwrap();
        let cfg = ModelConfig { rope: Rope { theta: 500000.0, scaling: Some(custom) }, ..base };
        let w = Weights::random(cfg, 3).unwrap();
        let (h, vals) = llmc_write(&w, Dtype::F32).unwrap();
        let mut bytes = h.clone();
        crate::files::f32s_to_le(&vals, &mut bytes);
        assert_eq!(read_bytes(&bytes).unwrap(), w);
        let huge = Llama3Scaling { original_max_position_embeddings: 1 << 40, ..custom };
        let e = llmc_header(&ModelConfig { rope: Rope { theta: 1e4, scaling: Some(huge) }, ..base }, Dtype::F32);
        assert!(e.unwrap_err().to_string().contains("original_max_position_embeddings"));
        // Meta's layout interleaves the pairs of each q and k head.
        let cfg = ModelConfig::from_descriptor("llama:1x8:2:1").unwrap(); // HS 4, 3 rotated heads
        let x: Vec<f32> = (0..cfg.qkv_dim()).map(|i| i as f32).collect();
        let meta = interleave_qk(&cfg, &x, false, false);
        assert_eq!(&meta[..4], &[0.0, 2.0, 1.0, 3.0]);
        assert_eq!(&meta[12..], &x[12..], "v is not permuted");
        assert_eq!(interleave_qk(&cfg, &meta, false, true), x);
    }

    #[test]
    fn rotary_frequencies() {
        let cfg = ModelConfig::from_descriptor("llama:1x64:2:1").unwrap(); // HS 32
        let f = inv_freq(&cfg);
        assert_eq!(f.len(), 16);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 10000f32.powf(-2.0 / 32.0)).abs() < 1e-7);
        // Llama 3.1 scaling: the highest frequencies are kept, the lowest divided by the factor.
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        };
        let scaled = inv_freq(&ModelConfig { rope: Rope { theta: 10000.0, scaling: Some(s) }, ..cfg });
        assert_eq!(scaled[0], f[0]);
        assert_eq!(scaled[15], f[15] / 8.0);
        assert!(scaled.iter().zip(&f).all(|(a, b)| a <= b && *a >= b / 8.0));
        let table = rope_table(&cfg);
        assert_eq!(table.len(), cfg.max_seq_len * 32);
        let p = 7;
        assert!((table[p * 32 + 1] - (7.0 * f[1]).cos()).abs() < 1e-6);
        assert!((table[p * 32 + 16 + 1] - (7.0 * f[1]).sin()).abs() < 1e-6);
    }
}

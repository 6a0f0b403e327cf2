//! The Llama-style decoder, written once: rotary positions, pre-RMSNorm blocks, grouped-query
//! attention, a SwiGLU MLP, and the options its kin turn on: biases on q, k, v (and the output
//! projection), an RMSNorm of each query and key head (Qwen3), a head size of its own, a tied
//! head, Llama 3's rotary scaling. A family of this kind is a [`DecoderFamily`] (its presets,
//! its config.json's rules, its deltas), made an [`Arch`] by [`Decoder`]; its file reads top to
//! bottom as the model ([`super::llama`], [`super::qwen2`], [`super::qwen3`]). Its tensors keep
//! transformers' names ([`hf_tensors`]), the same for every family of this kind.

use super::acts::{ActPlan, ActSpec, BackActs, BlockActs, NormActs, Width};
use super::family::{Arch, Attn, Consts};
use crate::backend::ops::{Heads, Mat, Ops, Rows, Seq};
use crate::backend::Buf;
use crate::core::config::{Family, Llama3Scaling, ModelConfig, Rope};
use crate::core::files::{Dtype, ModelFile};
use crate::core::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View, Weights};
use crate::core::rng::Mt19937;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The decoder's tensors, in file order (llm.c's llama3 file's slots for those it has); the
/// per-layer ones are stacked over the L blocks. Those the config or the family leaves out (an
/// untied head, biases, the heads' norms) take no space.
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
    QNormW,   // (L, HS) q_norm (the heads' norm), or empty
    KNormW,   // (L, HS) k_norm, or empty
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

/// A family of this kind: what sets it apart from the decoder it shares. Its file implements
/// this; [`Decoder`] makes it an [`Arch`].
pub trait DecoderFamily: Sync {
    /// Its name in configs and messages (`llama`, `qwen2`).
    const NAME: &'static str;
    /// transformers' `architectures[0]` and `model_type`.
    const HF_NAMES: (&'static str, &'static str);
    /// The descriptors it takes, for messages and `--help`.
    const DESCRIPTOR_HELP: &'static str;
    /// An RMSNorm of each query and key head before the rotary embedding (Qwen3's q_norm,
    /// k_norm: HS weights each per layer).
    const HEAD_NORM: bool = false;
    /// Its config.json carries Qwen's sliding-window fields (written off; on is refused for
    /// every family of this kind, as llmrs attends to every earlier position).
    const SLIDING_WINDOW_FIELDS: bool = false;

    /// The config a descriptor after `NAME:` names (its presets, then its explicit form).
    fn descriptor(&self, rest: &str, desc: &str) -> Result<ModelConfig>;
    /// Its rules on a config, past the decoder's own (rotary positions).
    fn validate(&self, cfg: &ModelConfig) -> Result<()>;
    /// Its config.json's fields read into a config ([`HfFields`] holds those every family of
    /// this kind reads alike); a field it does not compute is an error naming it.
    fn config_from_hf(&self, f: &HfFields, path: &Path) -> Result<ModelConfig>;
    /// Its own fields of config.json, past [`hf_config_common`]'s.
    fn hf_config_extra(&self, _cfg: &ModelConfig, _v: &mut serde_json::Value) {}

    /// llm.c's model file for this family, where llm.c has one (see [`Arch::llmc_magic`]).
    fn llmc_magic(&self) -> Option<i32> {
        None
    }
    fn llmc_header(&self, _cfg: &ModelConfig, _dtype: Dtype) -> Result<Vec<u8>> {
        bail!("llm.c has no model file for the {} family", Self::NAME)
    }
    fn llmc_write(&self, _w: &Weights, _dtype: Dtype) -> Result<(Vec<u8>, Vec<f32>)> {
        bail!("llm.c has no model file for the {} family", Self::NAME)
    }
    fn llmc_read(&self, f: &mut ModelFile) -> Result<Weights> {
        bail!("{}: llm.c has no model file for the {} family", f.path.display(), Self::NAME)
    }
    fn llmc_config(&self, _bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        bail!("{}: llm.c has no model file for the {} family", path.display(), Self::NAME)
    }
}

/// A [`DecoderFamily`] as a model family.
pub struct Decoder<F>(pub F);

/// A decoder's shape: no biases, a tied head, eps 1e-5, HS = C / NH, the vocabulary and
/// context given; a family's presets change what differs.
#[allow(clippy::too_many_arguments)]
pub fn config(
    family: Family,
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
        family,
        max_seq_len: max_t,
        vocab_size: vocab,
        padded_vocab_size: crate::core::config::pad_vocab(vocab),
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

/// The numbers of a descriptor's explicit form `LxC:N1:N2...` (`2x64:4:2:96`): [L, C, N1,
/// N2, ...], or None when `rest` is not of that form or has fewer than `least` or more than
/// `most` numbers after LxC. `what` names the optional ones (F, maxT...) for the errors.
pub fn descriptor_numbers(rest: &str, least: usize, most: usize, desc: &str) -> Option<Result<Vec<usize>>> {
    let parts: Vec<&str> = rest.split(':').collect();
    let (l, c) = parts.first()?.split_once('x')?;
    if parts.len() - 1 < least || parts.len() - 1 > most {
        return None;
    }
    let mut out = vec![l.parse().ok()?, c.parse().ok()?];
    for (i, p) in parts[1..].iter().enumerate() {
        match p.parse::<usize>() {
            Ok(x) => out.push(x),
            Err(_) if i < least => return None,
            Err(_) => return Some(Err(anyhow::anyhow!("bad number '{p}' in model descriptor '{desc}'"))),
        }
    }
    Some(Ok(out))
}

/// The decoder's tensors ([`T`]), the ones the config or family leaves out empty.
fn tensors(cfg: &ModelConfig, head_norm: bool) -> Vec<TensorSpec> {
    let (c, vp, f, qkv, qd, hs) =
        (cfg.channels, cfg.padded_vocab_size, cfg.hidden, cfg.qkv_dim(), cfg.q_dim(), cfg.head_dim);
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
        maybe(head_norm, s("qnormw", &[hs], true, false)),
        maybe(head_norm, s("knormw", &[hs], true, false)),
    ]
}

/// transformers' `_init_weights`: N(0, 0.02) for the embedding (its V real rows), the untied
/// head and every projection; biases 0; RMSNorm weights (the heads' too) 1.
fn init(w: &mut dyn InitSink, rng: &mut Mt19937) {
    let (cfg, lay) = (*w.config(), w.layout().clone());
    let (l_n, c, v) = (cfg.num_layers, cfg.channels, cfg.vocab_size);
    for t in [T::Ln1W, T::Ln2W, T::LnfW, T::QNormW, T::KNormW] {
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
    /// The tensors ([`T`]) of a block's view, the biases and heads' norm where the config and
    /// family have them.
    pub fn of(cfg: &ModelConfig, w: &View<Buf>, head_norm: bool) -> BlockW {
        BlockW {
            ln1: w[T::Ln1W],
            qkv: w[T::QkvW],
            qkv_b: cfg.qkv_bias.then_some(w[T::QkvB]),
            o: w[T::AttProjW],
            o_b: cfg.out_bias.then_some(w[T::AttProjB]),
            ln2: w[T::Ln2W],
            up_gate: w[T::FcW],
            down: w[T::FcProjW],
            head_norm: head_norm.then(|| (w[T::QNormW], w[T::KNormW])),
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

impl<F: DecoderFamily> Arch for Decoder<F> {
    fn name(&self) -> &'static str {
        F::NAME
    }

    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>> {
        let rest = desc.trim().strip_prefix(F::NAME)?.strip_prefix(':')?;
        Some(self.0.descriptor(rest, desc))
    }

    fn descriptor_help(&self) -> &'static str {
        F::DESCRIPTOR_HELP
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        cfg.validate_rope()?;
        self.0.validate(cfg)
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        tensors(cfg, F::HEAD_NORM)
    }

    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937) {
        init(w, rng)
    }

    fn head(&self, cfg: &ModelConfig) -> TensorId {
        if cfg.tied_head {
            T::Wte.into()
        } else {
            T::LmHead.into()
        }
    }

    fn acts(&self, cfg: &ModelConfig) -> ActPlan {
        plan_of(cfg, F::HEAD_NORM)
    }

    fn host_consts(&self, cfg: &ModelConfig) -> Option<Vec<f32>> {
        Some(rope_table(cfg))
    }

    /// The embedding (no learned positions).
    fn embed(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, out: Buf, ids: Buf, s: Seq, _pos: usize) {
        ops.encoder_forward(out, ids, w[T::Wte], None, s, cfg.channels);
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
        block_forward(ops, cfg, k, &BlockW::of(cfg, w, F::HEAD_NORM), x, n, attn)
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
        let (w, dw) = (BlockW::of(cfg, w, F::HEAD_NORM), BlockW::of(cfg, dw, F::HEAD_NORM));
        block_backward(ops, cfg, k, &w, &dw, x, d, s, acc)
    }

    /// The final RMSNorm.
    fn final_norm(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, a: &NormActs, x: Buf, n: usize) {
        ops.rmsnorm_forward(a.out, a.rstd, x, w[T::LnfW], Rows { n, c: cfg.channels }, cfg.norm_eps);
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
        ops.rmsnorm_backward(dx, dw[T::LnfW], dout, x, w[T::LnfW], a.rstd, Rows { n, c: cfg.channels });
    }

    fn hf_names(&self) -> (&'static str, &'static str) {
        F::HF_NAMES
    }

    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let f = HfFields::read(v, path)?;
        if f.flag("use_sliding_window", false)? {
            bail!(
                "{}: use_sliding_window true is not supported (llmrs attends to every earlier position)",
                path.display()
            );
        }
        self.0.config_from_hf(&f, path)
    }

    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
        let mut v = hf_config_common(cfg, torch_dtype, F::HF_NAMES);
        if F::SLIDING_WINDOW_FIELDS {
            v["use_sliding_window"] = false.into();
            v["sliding_window"] = serde_json::Value::Null;
            v["max_window_layers"] = cfg.num_layers.into();
            v["attention_dropout"] = 0.0.into();
        }
        self.0.hf_config_extra(cfg, &mut v);
        v
    }

    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
        hf_tensors(cfg, lay, F::HEAD_NORM)
    }

    fn llmc_magic(&self) -> Option<i32> {
        self.0.llmc_magic()
    }

    fn llmc_header(&self, cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
        self.0.llmc_header(cfg, dtype)
    }

    fn llmc_write<'a>(&self, w: &'a Weights, dtype: Dtype) -> Result<(Vec<u8>, std::borrow::Cow<'a, [f32]>)> {
        self.0.llmc_write(w, dtype).map(|(h, v)| (h, std::borrow::Cow::Owned(v)))
    }

    fn llmc_read(&self, f: &mut ModelFile) -> Result<Weights> {
        self.0.llmc_read(f)
    }

    fn llmc_config(&self, bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        self.0.llmc_config(bytes, path)
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
            ..config(family, self.layers, self.c, self.heads, self.kv, self.f, self.vocab, self.max_t, self.rope)
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

/// transformers' tensors of a decoder ([`T`] layout): `nn.Linear` (out, in) as llmrs's; q, k
/// and v are rows of QkvW, up and gate rows of FcW; with `head_norm` each layer's q_norm and
/// k_norm.
pub fn hf_tensors(cfg: &ModelConfig, lay: &ParamLayout, head_norm: bool) -> Vec<HfTensor> {
    let (c, v, f, kv, qd, hs) = (cfg.channels, cfg.vocab_size, cfg.hidden, cfg.kv_dim(), cfg.q_dim(), cfg.head_dim);
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
        if head_norm {
            out.push(t(name("self_attn.q_norm.weight"), b[T::QNormW].clone(), vec![hs]));
            out.push(t(name("self_attn.k_norm.weight"), b[T::KNormW].clone(), vec![hs]));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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

//! Where the activations live: named views into one backend allocation per plan.
//!
//! A family says which activations its block keeps ([`ActPlan`]: their names and widths);
//! [`Acts`] holds them for a training (or evaluation) pass, one per layer where backward needs
//! each layer's, sized for a capacity (B, T), plus the residual stream, the head's buffers and
//! the backward pass's buffers. A pass over a smaller (b, t) uses a prefix of each buffer, laid
//! out for (b, t). [`KvCache`] holds one sequence's keys and values and one layer's worth of
//! the same activations for the KV-cached inference pass. Both hand the family a [`BlockActs`]
//! per layer, so one block function serves training and inference.

use crate::backend::{Backend, Buf, DType};
use crate::core::config::ModelConfig;
use crate::core::params::View;
use anyhow::Result;

/// How wide an activation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// This many values per position.
    Pos(usize),
    /// This many values per position and head, head-major: (B, NH, T, k) (attention's
    /// per-row softmax statistics).
    Heads(usize),
}

/// One activation of a family's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActSpec {
    pub name: &'static str,
    pub width: Width,
    /// One per layer (kept from forward for backward); else one buffer all layers share (a
    /// workspace).
    pub per_layer: bool,
    /// The recompute level (llm.c's `-r`) from which this activation is no longer kept per
    /// layer but recomputed by the block's backward from what is kept (0: always kept).
    pub recompute_from: u8,
    /// Statistics (a norm's mean and rstd, attention's row statistics): f32 at every
    /// precision, as llm.c keeps them; the others take the run's activation dtype.
    pub stat: bool,
}

impl ActSpec {
    /// Kept per layer.
    pub const fn kept(name: &'static str, width: Width) -> Self {
        ActSpec { name, width, per_layer: true, recompute_from: 0, stat: false }
    }
    /// Kept per layer, f32 at every precision (see [`ActSpec::stat`]).
    pub const fn stat(name: &'static str, width: Width) -> Self {
        ActSpec { name, width, per_layer: true, recompute_from: 0, stat: true }
    }
    /// Shared by all layers.
    pub const fn shared(name: &'static str, width: Width) -> Self {
        ActSpec { name, width, per_layer: false, recompute_from: 0, stat: false }
    }
    /// Kept per layer below recompute level `level`; from it on one shared buffer, which the
    /// family's backward refills (see [`BlockActs::recompute`]) before reading it.
    pub const fn recomputed(name: &'static str, width: Width, level: u8) -> Self {
        ActSpec { name, width, per_layer: true, recompute_from: level, stat: false }
    }
}

/// The highest recompute level: 1 recomputes the MLP's activation (GELU, SwiGLU), 2 the
/// norms' outputs too (llm.c's `-r`). Attention's probabilities are never kept at any level:
/// its backward rebuilds them from per-row statistics, as llm.c's CUDA attention does.
pub const MAX_RECOMPUTE: u8 = 2;

/// What a family's block needs besides the residual stream: the forward pass's activations
/// and the backward pass's buffers, in the family's order (its enums name them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActPlan {
    pub fwd: Vec<ActSpec>,
    pub back: Vec<ActSpec>,
    /// The recompute level the plan was made for (0 as a family writes it).
    pub recompute: u8,
}

impl ActPlan {
    /// This plan at recompute level `level` (at most [`MAX_RECOMPUTE`]): the activations
    /// recomputed from that level become buffers all layers share.
    pub fn with_recompute(mut self, level: u8) -> ActPlan {
        for s in self.fwd.iter_mut().chain(&mut self.back) {
            if s.recompute_from > 0 && s.recompute_from <= level {
                s.per_layer = false;
            }
        }
        self.recompute = level;
        self
    }
}

/// Values of `w` for `positions` positions with `nh` heads.
fn len_of(w: Width, positions: usize, nh: usize) -> usize {
    match w {
        Width::Pos(x) => positions * x,
        Width::Heads(x) => positions * nh * x,
    }
}

/// One view to carve: `count` tensors of `len` elements of `dtype` (a tensor per layer for the
/// stacked ones).
type ViewSpec = (usize, usize, DType);

/// The views of [`Acts::new`] for `n` = B*T positions, in its order: the encoded input and the
/// residual stream, the plan's forward activations, the final norm's, the logits
/// (`logit_rows`, between 1 and n), the losses and log-sum-exps, scratch, then the backward's.
fn views(
    cfg: &ModelConfig,
    plan: &ActPlan,
    n: usize,
    backward: bool,
    logit_rows: usize,
    dtype: DType,
) -> Vec<ViewSpec> {
    let (c, l, nh, vp) = (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size);
    let f32 = DType::F32;
    let dt = |s: &ActSpec| if s.stat { f32 } else { dtype };
    let one = |len: usize| (1, len, dtype);
    let stat = |len: usize| (1, len, f32);
    let mut views = vec![one(n * c), (l, n * c, dtype)];
    views.extend(plan.fwd.iter().map(|s| (if s.per_layer { l } else { 1 }, len_of(s.width, n, nh), dt(s))));
    views.extend([one(n * c), stat(n), stat(n), one(logit_rows * vp), stat(n), stat(n), one(n * c)]);
    let bw = |len: usize, dtype| (1, if backward { len } else { 0 }, dtype);
    views.push(bw(n * c, dtype));
    views.extend(plan.back.iter().map(|s| bw(len_of(s.width, n, nh), dt(s))));
    views
}

/// The bytes [`Acts::new`] would allocate for a pass over `b` x `t` (the same views, and the
/// tokens), computed before anything is: None past 2^32 positions, which no machine holds.
pub fn planned_bytes(
    cfg: &ModelConfig,
    plan: &ActPlan,
    b: usize,
    t: usize,
    backward: bool,
    logit_rows: usize,
    dtype: DType,
) -> Option<u128> {
    let n = b.checked_mul(t).filter(|&n| n > 0 && n <= 1 << 32)?;
    let vs = views(cfg, plan, n, backward, logit_rows.clamp(1, n), dtype);
    let bytes = vs.iter().map(|&(count, len, dt)| count as u128 * len as u128 * dt.bytes() as u128).sum::<u128>();
    Some(bytes + 2 * n as u128 * 4)
}

/// Cut consecutive views out of new allocations, one per dtype: the backend is told each
/// tensor, so that none straddles two of a device's memory chunks. Returns the allocations
/// and the views in the order asked.
fn carve(be: &mut dyn Backend, views: &[ViewSpec]) -> Result<(Vec<Buf>, Vec<Buf>)> {
    let mut out = vec![None; views.len()];
    let mut wholes = vec![];
    for dtype in [DType::F32, DType::BF16] {
        let mine: Vec<usize> = (0..views.len()).filter(|&i| views[i].2 == dtype).collect();
        if mine.is_empty() {
            continue;
        }
        let parts: Vec<usize> = mine.iter().flat_map(|&i| std::iter::repeat_n(views[i].1, views[i].0)).collect();
        let whole = be.alloc_parts(&parts, dtype)?;
        let mut off = 0;
        for &i in &mine {
            let (count, len, _) = views[i];
            off += count * len;
            out[i] = Some(whole.slice(off - count * len..off));
        }
        wholes.push(whole);
    }
    Ok((wholes, out.into_iter().map(|v| v.expect("every dtype carved")).collect()))
}

/// One block's buffers for a pass over N positions: the residual stream entering and leaving
/// it, and the family's activations (shapes without the L dimension).
#[derive(Clone, Debug)]
pub struct BlockActs {
    pub res_in: Buf,  // (N, C)
    pub res_out: Buf, // (N, C)
    /// The family's forward activations ([`ActPlan::fwd`]), indexed by its names.
    pub a: View<Buf>,
    /// The plan's recompute level: the block's backward first recomputes every activation
    /// whose [`ActSpec::recompute_from`] is at most this, for another layer has overwritten it.
    pub recompute: u8,
}

impl BlockActs {
    /// The views of the last `keep` of `n` positions (the same elements, not a copy): what a
    /// block runs on past attention when only those positions' outputs are read. Head-major
    /// buffers ([`Width::Heads`]: attention's row statistics) stay whole: they cannot be cut by
    /// rows, and nothing past attention reads them.
    pub fn last_rows(&self, plan: &ActPlan, c: usize, n: usize, keep: usize) -> BlockActs {
        let keep = keep.min(n);
        let rows = |x: Buf, width: usize| x.slice((n - keep) * width..n * width);
        BlockActs {
            res_in: rows(self.res_in, c),
            res_out: rows(self.res_out, c),
            a: View(
                plan.fwd
                    .iter()
                    .zip(&self.a.0)
                    .map(|(s, &x)| match s.width {
                        Width::Pos(w) => rows(x, w),
                        Width::Heads(_) => x,
                    })
                    .collect(),
            ),
            recompute: self.recompute,
        }
    }
}

/// The backward pass's buffers (shared by all layers).
#[derive(Clone, Debug)]
pub struct BackActs {
    pub dres: Buf, // (N, C) the gradient of the residual stream
    /// The family's backward buffers ([`ActPlan::back`]), indexed by its names.
    pub d: View<Buf>,
    /// Whether the block's backward must leave d(res_in) in `dres`. False only for the first
    /// block of a LoRA run: its embedding is frozen, so nothing reads that gradient, and its
    /// norms are frozen, so the block skips its first norm's backward and the input gradient
    /// of the projection that norm feeds (PyTorch's autograd skips them too).
    pub input_grad: bool,
}

/// The final norm's buffers for N positions (LayerNorm's mean is unused by RMSNorm).
#[derive(Clone, Copy, Debug)]
pub struct NormActs {
    pub out: Buf,  // (N, C)
    pub mean: Buf, // (N)
    pub rstd: Buf, // (N)
}

/// A training (or evaluation) pass's activations, for capacity (B, T).
#[derive(Clone, Debug)]
pub struct Acts {
    pub cap_b: usize,
    pub cap_t: usize,
    /// Whether the backward buffers exist.
    pub backward: bool,
    plan: ActPlan,
    c: usize,
    nh: usize,
    /// The allocations (one per dtype).
    pub wholes: Vec<Buf>,
    pub tokens: Buf,   // u32 (2, B, T): inputs then targets
    encoded: Buf,      // (B, T, C)
    residual: Buf,     // (L, B, T, C) each block's output
    fwd: Vec<Buf>,     // each (L, B, T, width) when kept, else (B, T, width)
    pub lnf: Buf,      // (B, T, C)
    pub lnf_mean: Buf, // (B, T)
    pub lnf_rstd: Buf, // (B, T)
    /// Rows of logits held at once: B*T, or fewer when the classifier runs in chunks.
    pub logit_rows: usize,
    pub logits: Buf,  // (R, Vp) for R = logit_rows; after backward, d(loss)/d(logits)
    pub losses: Buf,  // (B, T)
    pub lse: Buf,     // (B, T) log-sum-exp of each row of logits
    pub scratch: Buf, // (B, T, C) the head's d(lnf)
    dres: Buf,        // (B, T, C)  backward only (else empty)
    back: Vec<Buf>,   // each (B, T, width), backward only
}

impl Acts {
    /// The activations for capacity (B, T) in `dtype` (f32, or bf16 with the statistics and
    /// losses still f32: [`ActSpec::stat`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &mut dyn Backend,
        cfg: &ModelConfig,
        plan: &ActPlan,
        b: usize,
        t: usize,
        backward: bool,
        logit_rows: usize,
        dtype: DType,
    ) -> Result<Self> {
        let (c, nh, n) = (cfg.channels, cfg.num_heads, b * t);
        let logit_rows = logit_rows.clamp(1, n);
        let views = views(cfg, plan, n, backward, logit_rows, dtype);
        let (wholes, v) = carve(be, &views)?;
        let tokens = be.alloc(2 * n, DType::U32)?;
        let k = plan.fwd.len();
        Ok(Acts {
            cap_b: b,
            cap_t: t,
            backward,
            plan: plan.clone(),
            c,
            nh,
            wholes,
            tokens,
            encoded: v[0],
            residual: v[1],
            fwd: v[2..2 + k].to_vec(),
            lnf: v[2 + k],
            lnf_mean: v[3 + k],
            lnf_rstd: v[4 + k],
            logit_rows,
            logits: v[5 + k],
            losses: v[6 + k],
            lse: v[7 + k],
            scratch: v[8 + k],
            dres: v[9 + k],
            back: v[10 + k..].to_vec(),
        })
    }

    /// Bytes of the activations kept per layer (the residual stream and the plan's per-layer
    /// ones) and of the logits.
    pub fn bytes_by_part(&self) -> (usize, usize) {
        let bytes = |x: &Buf| x.len * x.dtype.bytes();
        let kept = self.plan.fwd.iter().zip(&self.fwd).filter(|(s, _)| s.per_layer).map(|(_, x)| bytes(x));
        (bytes(&self.residual) + kept.sum::<usize>(), bytes(&self.logits))
    }

    /// Bytes of all the activations.
    pub fn bytes(&self) -> usize {
        self.wholes.iter().chain([&self.tokens]).map(|x| x.len * x.dtype.bytes()).sum()
    }

    /// Whether a pass over (b, t) fits (and, when `backward`, the backward buffers exist).
    pub fn fits(&self, b: usize, t: usize, backward: bool) -> bool {
        b <= self.cap_b && t <= self.cap_t && (self.backward || !backward)
    }

    pub fn free(&self, be: &mut dyn Backend) {
        self.wholes.iter().for_each(|&w| be.free(w));
        be.free(self.tokens);
    }

    /// Token ids of a pass over N positions: (inputs (N), targets (N)).
    pub fn tokens(&self, n: usize) -> (Buf, Buf) {
        let cap = self.tokens.len / 2;
        (self.tokens.prefix(n), self.tokens.slice(cap..cap + n))
    }

    /// The embedding's output, the first block's input: (B, T, C).
    pub fn encoded(&self, n: usize) -> Buf {
        self.encoded.prefix(n * self.c)
    }

    /// The last block's output: (B, T, C).
    pub fn last_residual(&self, cfg: &ModelConfig, n: usize) -> Buf {
        self.residual.part(cfg.num_layers - 1, self.cap_b * self.cap_t * self.c).prefix(n * self.c)
    }

    /// The final norm's buffers for N positions.
    pub fn norm(&self, n: usize) -> NormActs {
        NormActs { out: self.lnf.prefix(n * self.c), mean: self.lnf_mean.prefix(n), rstd: self.lnf_rstd.prefix(n) }
    }

    /// Layer `l`'s views for a pass over (b, t): the start of layer l's tensor of each stacked
    /// activation (each layer's tensor is sized for the capacity and is one allocation part).
    pub fn layer(&self, l: usize, b: usize, t: usize) -> BlockActs {
        let (c, n, cap) = (self.c, b * t, self.cap_b * self.cap_t);
        let stream = |l: usize| self.residual.part(l, cap * c).prefix(n * c);
        let a = self
            .plan
            .fwd
            .iter()
            .zip(&self.fwd)
            .map(|(s, &x)| {
                let len = len_of(s.width, n, self.nh);
                if s.per_layer {
                    x.part(l, len_of(s.width, cap, self.nh)).prefix(len)
                } else {
                    x.prefix(len)
                }
            })
            .collect();
        let res_in = if l == 0 { self.encoded(n) } else { stream(l - 1) };
        BlockActs { res_in, res_out: stream(l), a: View(a), recompute: self.plan.recompute }
    }

    /// The backward buffers for a pass over (b, t).
    pub fn back(&self, b: usize, t: usize) -> BackActs {
        let n = b * t;
        let d = self.plan.back.iter().zip(&self.back).map(|(s, &x)| x.prefix(len_of(s.width, n, self.nh))).collect();
        BackActs { dres: self.dres.prefix(n * self.c), d: View(d), input_grad: true }
    }
}

/// One sequence's keys and values for every layer, and the workspace of the KV-cached
/// inference pass for up to `chunk` new positions at a time. Made by
/// [`crate::model::Model::kv_cache`] on the model's backend.
#[derive(Debug)]
pub struct KvCache {
    /// Positions the cache can hold (at most the model's maxT).
    pub capacity: usize,
    /// Most positions fed in one pass.
    pub chunk: usize,
    /// Positions already in the cache.
    pub pos: usize,
    pub(crate) wholes: Vec<Buf>,
    pub(crate) tokens: Buf, // u32 (CH)
    k: Buf,                 // (L, cap, KV*HS)
    v: Buf,                 // (L, cap, KV*HS)
    /// (CH, C): the block's input and output (each op reads it before the block's last one
    /// writes it).
    pub(crate) stream: Buf,
    plan: ActPlan,
    acts: Vec<Buf>,           // each (CH, width) for one layer
    pub(crate) lnf: Buf,      // (1, C) the last position only
    pub(crate) lnf_mean: Buf, // (1)
    pub(crate) lnf_rstd: Buf, // (1)
    pub(crate) logits: Buf,   // (Vp)
    /// The first V logits of the last position fed, on the host.
    pub(crate) host_logits: Vec<f32>,
    c: usize,
    nh: usize,
    kv: usize,
}

impl KvCache {
    pub(crate) fn new(
        be: &mut dyn Backend,
        cfg: &ModelConfig,
        plan: &ActPlan,
        capacity: usize,
        chunk: usize,
        dtype: DType,
    ) -> Result<Self> {
        let (c, l, nh, vp, ch, kv) =
            (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size, chunk, cfg.kv_dim());
        let f32 = DType::F32;
        let mut views = vec![(l, capacity * kv, dtype), (l, capacity * kv, dtype), (1, ch * c, dtype)];
        views.extend(plan.fwd.iter().map(|s| (1, len_of(s.width, ch, nh), if s.stat { f32 } else { dtype })));
        views.extend([(1, c, dtype), (1, 1, f32), (1, 1, f32), (1, vp, dtype)]);
        let (wholes, v) = carve(be, &views)?;
        let tokens = be.alloc(ch, DType::U32)?;
        let k = plan.fwd.len();
        Ok(KvCache {
            capacity,
            chunk,
            pos: 0,
            wholes,
            tokens,
            k: v[0],
            v: v[1],
            stream: v[2],
            plan: plan.clone(),
            acts: v[3..3 + k].to_vec(),
            lnf: v[3 + k],
            lnf_mean: v[4 + k],
            lnf_rstd: v[5 + k],
            logits: v[6 + k],
            host_logits: vec![0.0; cfg.vocab_size],
            c,
            nh,
            kv,
        })
    }

    /// Start a new sequence (the memory is kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Layer `l`'s views for `tn` new positions, and its key and value rows (cap, KV*HS).
    pub(crate) fn layer(&self, l: usize, tn: usize) -> (BlockActs, Buf, Buf) {
        let cap = self.capacity;
        let a = self.plan.fwd.iter().zip(&self.acts).map(|(s, &x)| x.prefix(len_of(s.width, tn, self.nh)));
        let stream = self.stream.prefix(tn * self.c);
        // No backward reads this pass: nothing to recompute.
        let x = BlockActs { res_in: stream, res_out: stream, a: View(a.collect()), recompute: 0 };
        (x, self.k.part(l, cap * self.kv), self.v.part(l, cap * self.kv))
    }
}

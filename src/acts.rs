//! Where the activations live: named views into one backend allocation per plan.
//!
//! [`Acts`] holds everything a training forward pass keeps for backward, plus the backward
//! pass's per-layer scratch, sized for a capacity (B, T); a pass over a smaller (b, t) uses a
//! prefix of each buffer, laid out for (b, t). [`KvCache`] holds one sequence's keys and values
//! and the workspace of the KV-cached inference pass. Both hand the model a [`BlockActs`] per
//! layer, so one block function serves training and inference.

use crate::backend::{Backend, Buf, DType};
use crate::config::{Family, ModelConfig};
use anyhow::Result;

/// Cut consecutive views out of one new allocation: view i is `count` tensors of `len`
/// elements each (a tensor per layer for the stacked ones), and the backend is told each
/// tensor, so that none straddles two of a device's memory chunks.
fn carve<const K: usize>(be: &mut dyn Backend, views: [(usize, usize); K]) -> Result<(Buf, [Buf; K])> {
    let parts: Vec<usize> = views.iter().flat_map(|&(count, len)| std::iter::repeat_n(len, count)).collect();
    let whole = be.alloc_parts(&parts, DType::F32)?;
    let mut off = 0;
    let views = views.map(|(count, len)| {
        off += count * len;
        whole.slice(off - count * len..off)
    });
    Ok((whole, views))
}

/// Per-position widths of the block's wide activations: (QKV, FC, F, d(fch), d(fch_act)).
fn widths(cfg: &ModelConfig) -> (usize, usize, usize, usize, usize) {
    let (fc, f) = (cfg.fc_dim(), cfg.hidden);
    let dact = if cfg.family == Family::Llama { f } else { 0 };
    (cfg.qkv_dim(), fc, f, fc.max(3 * cfg.channels), dact)
}

/// One block's activations for a pass over N = B*T positions (shapes without the L dimension).
#[derive(Clone, Copy, Debug)]
pub struct BlockActs {
    pub res_in: Buf,    // (N, C) the residual stream entering the block
    pub ln1: Buf,       // (N, C)
    pub ln1_mean: Buf,  // (N) LayerNorm only
    pub ln1_rstd: Buf,  // (N)
    pub qkv: Buf,       // (N, QKV) q, k (rotated in place for Llama), v
    pub atty: Buf,      // (N, C)
    pub att: Buf,       // (B, NH, T, T) probabilities; KV-cached: scores (NH, TN, maxT)
    pub residual2: Buf, // (N, C)
    pub ln2: Buf,       // (N, C)
    pub ln2_mean: Buf,  // (N)
    pub ln2_rstd: Buf,  // (N)
    pub fch: Buf,       // (N, FC) the MLP's first projection (FC: F, or 2F for SwiGLU)
    pub fch_act: Buf,   // (N, F) after its nonlinearity
    pub residual3: Buf, // (N, C) the residual stream leaving the block
    pub scratch: Buf,   // (N, C) attention workspace, then projection outputs; d(ln), d(atty) in backward
}

impl BlockActs {
    /// The views of the last `keep` of `n` positions (the same elements, not a copy): what a
    /// block runs on past attention when only those positions' outputs are read. `att` stays
    /// whole (attention has run by then).
    pub fn last_rows(&self, cfg: &ModelConfig, n: usize, keep: usize) -> BlockActs {
        let keep = keep.min(n);
        let (qkv, fc, f, _, _) = widths(cfg);
        let c = cfg.channels;
        let rows = |x: Buf, width: usize| x.slice((n - keep) * width..n * width);
        BlockActs {
            res_in: rows(self.res_in, c),
            ln1: rows(self.ln1, c),
            ln1_mean: rows(self.ln1_mean, 1),
            ln1_rstd: rows(self.ln1_rstd, 1),
            qkv: rows(self.qkv, qkv),
            atty: rows(self.atty, c),
            att: self.att,
            residual2: rows(self.residual2, c),
            ln2: rows(self.ln2, c),
            ln2_mean: rows(self.ln2_mean, 1),
            ln2_rstd: rows(self.ln2_rstd, 1),
            fch: rows(self.fch, fc),
            fch_act: rows(self.fch_act, f),
            residual3: rows(self.residual3, c),
            scratch: rows(self.scratch, c),
        }
    }
}

/// The backward pass's per-layer buffers (shared by all layers).
#[derive(Clone, Copy, Debug)]
pub struct BackActs {
    pub dresidual: Buf, // (N, C) gradient of the residual stream
    pub dfch: Buf,      // (N, max(FC, 3*C)) d(fch); the attention backward's workspace
    pub dact: Buf,      // (N, F) d(fch_act) (SwiGLU, whose backward is not in place; else empty)
    pub dqkv: Buf,      // (N, QKV)
    pub datt: Buf,      // (B, NH, T, T)
}

/// A training (or evaluation) pass's activations, for capacity (B, T).
#[derive(Clone, Copy, Debug)]
pub struct Acts {
    pub cap_b: usize,
    pub cap_t: usize,
    /// Whether the backward buffers exist.
    pub backward: bool,
    pub whole: Buf,
    pub tokens: Buf,    // u32 (2, B, T): inputs then targets
    pub encoded: Buf,   // (B, T, C)
    pub ln1: Buf,       // (L, B, T, C)
    pub ln1_mean: Buf,  // (L, B, T)
    pub ln1_rstd: Buf,  // (L, B, T)
    pub qkv: Buf,       // (L, B, T, QKV)
    pub atty: Buf,      // (L, B, T, C)
    pub att: Buf,       // (L, B, NH, T, T)
    pub residual2: Buf, // (L, B, T, C)
    pub ln2: Buf,       // (L, B, T, C)
    pub ln2_mean: Buf,  // (L, B, T)
    pub ln2_rstd: Buf,  // (L, B, T)
    pub fch: Buf,       // (L, B, T, FC)
    pub fch_act: Buf,   // (L, B, T, F)
    pub residual3: Buf, // (L, B, T, C)
    pub lnf: Buf,       // (B, T, C)
    pub lnf_mean: Buf,  // (B, T)
    pub lnf_rstd: Buf,  // (B, T)
    pub logits: Buf,    // (B, T, Vp); after backward, d(loss)/d(logits)
    pub losses: Buf,    // (B, T)
    pub lse: Buf,       // (B, T) log-sum-exp of each row of logits
    pub scratch: Buf,   // (B, T, C)
    pub dresidual: Buf, // (B, T, C)     backward only (else empty)
    pub dfch: Buf,      // (B, T, max(FC, 3*C)) backward only
    pub dact: Buf,      // (B, T, F)     backward only, SwiGLU only
    pub dqkv: Buf,      // (B, T, QKV)   backward only
    pub datt: Buf,      // (B, NH, T, T) backward only
}

impl Acts {
    pub fn new(be: &mut dyn Backend, cfg: &ModelConfig, b: usize, t: usize, backward: bool) -> Result<Self> {
        let (c, l, nh, vp) = (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size);
        let (qkv, fc, f, dfc, dact) = widths(cfg);
        let n = b * t;
        let bw = |len: usize| (1, if backward { len } else { 0 });
        let (one, per_layer) = (|len: usize| (1, len), |len: usize| (l, len));
        #[rustfmt::skip]
        let views = [
            one(n * c), per_layer(n * c), per_layer(n), per_layer(n), per_layer(n * qkv), per_layer(n * c),
            per_layer(b * nh * t * t), per_layer(n * c), per_layer(n * c), per_layer(n), per_layer(n),
            per_layer(n * fc), per_layer(n * f), per_layer(n * c),
            one(n * c), one(n), one(n), one(n * vp), one(n), one(n), one(n * c),
            bw(n * c), bw(n * dfc), bw(n * dact), bw(n * qkv), bw(b * nh * t * t),
        ];
        let (whole, v) = carve(be, views)?;
        let tokens = be.alloc(2 * n, DType::U32)?;
        Ok(Acts {
            cap_b: b,
            cap_t: t,
            backward,
            whole,
            tokens,
            encoded: v[0],
            ln1: v[1],
            ln1_mean: v[2],
            ln1_rstd: v[3],
            qkv: v[4],
            atty: v[5],
            att: v[6],
            residual2: v[7],
            ln2: v[8],
            ln2_mean: v[9],
            ln2_rstd: v[10],
            fch: v[11],
            fch_act: v[12],
            residual3: v[13],
            lnf: v[14],
            lnf_mean: v[15],
            lnf_rstd: v[16],
            logits: v[17],
            losses: v[18],
            lse: v[19],
            scratch: v[20],
            dresidual: v[21],
            dfch: v[22],
            dact: v[23],
            dqkv: v[24],
            datt: v[25],
        })
    }

    /// Whether a pass over (b, t) fits (and, when `backward`, the backward buffers exist).
    pub fn fits(&self, b: usize, t: usize, backward: bool) -> bool {
        b <= self.cap_b && t <= self.cap_t && (self.backward || !backward)
    }

    pub fn free(&self, be: &mut dyn Backend) {
        be.free(self.whole);
        be.free(self.tokens);
    }

    /// Token ids of a pass over N positions: (inputs (N), targets (N)).
    pub fn tokens(&self, n: usize) -> (Buf, Buf) {
        let cap = self.tokens.len / 2;
        (self.tokens.prefix(n), self.tokens.slice(cap..cap + n))
    }

    /// Layer `l`'s views for a pass over (b, t): the start of layer l's tensor of each stacked
    /// activation (each layer's tensor is sized for the capacity and is one allocation part).
    pub fn layer(&self, cfg: &ModelConfig, l: usize, b: usize, t: usize) -> BlockActs {
        let (c, nh, n, cap) = (cfg.channels, cfg.num_heads, b * t, self.cap_b * self.cap_t);
        let (qkv, fc, f, _, _) = widths(cfg);
        let at = |x: Buf, per_position: usize, len: usize| x.part(l, cap * per_position).prefix(len);
        let att_cap = self.cap_b * nh * self.cap_t * self.cap_t;
        BlockActs {
            res_in: if l == 0 { self.encoded.prefix(n * c) } else { self.residual3.part(l - 1, cap * c).prefix(n * c) },
            ln1: at(self.ln1, c, n * c),
            ln1_mean: at(self.ln1_mean, 1, n),
            ln1_rstd: at(self.ln1_rstd, 1, n),
            qkv: at(self.qkv, qkv, n * qkv),
            atty: at(self.atty, c, n * c),
            att: self.att.part(l, att_cap).prefix(b * nh * t * t),
            residual2: at(self.residual2, c, n * c),
            ln2: at(self.ln2, c, n * c),
            ln2_mean: at(self.ln2_mean, 1, n),
            ln2_rstd: at(self.ln2_rstd, 1, n),
            fch: at(self.fch, fc, n * fc),
            fch_act: at(self.fch_act, f, n * f),
            residual3: at(self.residual3, c, n * c),
            scratch: self.scratch.prefix(n * c),
        }
    }

    /// The backward buffers for a pass over (b, t).
    pub fn back(&self, cfg: &ModelConfig, b: usize, t: usize) -> BackActs {
        let (c, nh, n) = (cfg.channels, cfg.num_heads, b * t);
        let (qkv, _, _, dfc, dact) = widths(cfg);
        BackActs {
            dresidual: self.dresidual.prefix(n * c),
            dfch: self.dfch.prefix(n * dfc),
            dact: self.dact.prefix(n * dact),
            dqkv: self.dqkv.prefix(n * qkv),
            datt: self.datt.prefix(b * nh * t * t),
        }
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
    pub(crate) whole: Buf,
    pub(crate) tokens: Buf,   // u32 (CH)
    pub(crate) k: Buf,        // (L, cap, KV*HS)
    pub(crate) v: Buf,        // (L, cap, KV*HS)
    pub(crate) x: BlockActs,  // for CH positions; res_in and residual3 are the same stream buffer
    pub(crate) lnf: Buf,      // (1, C) the last position only
    pub(crate) lnf_mean: Buf, // (1)
    pub(crate) lnf_rstd: Buf, // (1)
    pub(crate) logits: Buf,   // (Vp)
    /// The first V logits of the last position fed, on the host.
    pub(crate) host_logits: Vec<f32>,
}

impl KvCache {
    pub(crate) fn new(be: &mut dyn Backend, cfg: &ModelConfig, capacity: usize, chunk: usize) -> Result<Self> {
        let (c, l, nh, vp, ch) = (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size, chunk);
        let (qkv, fc, f, _, _) = widths(cfg);
        let kv = cfg.kv_dim();
        // k, v, then the block's buffers in BlockActs order (one stream buffer for res_in and
        // residual3: each op reads it before the block's last one writes it), then the head.
        let (one, per_layer) = (|len: usize| (1, len), |len: usize| (l, len));
        #[rustfmt::skip]
        let views = [
            per_layer(capacity * kv), per_layer(capacity * kv),
            one(ch * c), one(ch * c), one(ch), one(ch), one(ch * qkv), one(ch * c), one(nh * ch * capacity),
            one(ch * c), one(ch * c), one(ch), one(ch), one(ch * fc), one(ch * f), one(ch * c),
            one(c), one(1), one(1), one(vp),
        ];
        let (whole, v) = carve(be, views)?;
        let tokens = be.alloc(ch, DType::U32)?;
        let x = BlockActs {
            res_in: v[2],
            ln1: v[3],
            ln1_mean: v[4],
            ln1_rstd: v[5],
            qkv: v[6],
            atty: v[7],
            att: v[8],
            residual2: v[9],
            ln2: v[10],
            ln2_mean: v[11],
            ln2_rstd: v[12],
            fch: v[13],
            fch_act: v[14],
            residual3: v[2],
            scratch: v[15],
        };
        Ok(KvCache {
            capacity,
            chunk,
            pos: 0,
            whole,
            tokens,
            k: v[0],
            v: v[1],
            x,
            lnf: v[16],
            lnf_mean: v[17],
            lnf_rstd: v[18],
            logits: v[19],
            host_logits: vec![0.0; cfg.vocab_size],
        })
    }

    /// Start a new sequence (the memory is kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Layer `l`'s views for `tn` new positions, and its key and value rows (cap, KV*HS).
    pub(crate) fn layer(&self, cfg: &ModelConfig, l: usize, tn: usize) -> (BlockActs, Buf, Buf) {
        let (c, nh, cap) = (cfg.channels, cfg.num_heads, self.capacity);
        let (qkv, fc, f, _, _) = widths(cfg);
        let x = &self.x;
        let acts = BlockActs {
            res_in: x.res_in.prefix(tn * c),
            ln1: x.ln1.prefix(tn * c),
            ln1_mean: x.ln1_mean.prefix(tn),
            ln1_rstd: x.ln1_rstd.prefix(tn),
            qkv: x.qkv.prefix(tn * qkv),
            atty: x.atty.prefix(tn * c),
            att: x.att.prefix(nh * tn * cap),
            residual2: x.residual2.prefix(tn * c),
            ln2: x.ln2.prefix(tn * c),
            ln2_mean: x.ln2_mean.prefix(tn),
            ln2_rstd: x.ln2_rstd.prefix(tn),
            fch: x.fch.prefix(tn * fc),
            fch_act: x.fch_act.prefix(tn * f),
            residual3: x.residual3.prefix(tn * c),
            scratch: x.scratch.prefix(tn * c),
        };
        let kv = cfg.kv_dim();
        (acts, self.k.part(l, cap * kv), self.v.part(l, cap * kv))
    }
}

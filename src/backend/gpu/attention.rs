//! Causal self-attention on the GPU as GEMMs (kernels/matmul.wgsl) around a row softmax
//! (kernels/attention.wgsl): scores = Q K^T, P = softmax, out = P V per (batch, head) plane,
//! each GEMM skipping the tiles that the causal mask makes zero. The heads are read from and
//! written to the packed (B, T, QKV) and (B, T, C) layouts through strides, with no copies.
//!
//! No (B, NH, T, T) matrix is kept (flash attention's scheme, a group of planes at a time):
//! the planes go through a workspace tile of at most [`TILE`] scores per group, the forward
//! keeps each query row's softmax statistics (B, NH, T, 2), and the backward computes the
//! scores of a group again and rebuilds its probabilities from those statistics.

use super::bf16::Role::Out;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, Module, K};
use super::matmul::{Batches, Operand, ACCUMULATE, K_LOWER, K_UPPER, SKIP_UPPER};
use super::{all_bf16, all_f32};
use super::{u, GpuBackend, Groups};
use crate::backend::ops::Call;
use crate::backend::ops::{AttentionBackward, AttentionCached, AttentionForward, AttentionOps, Seq};
use crate::backend::{Buf, DType};
use std::ops::Range;

/// Most scores a tile holds (64 MiB) unless a single group of planes (the heads that share a
/// key/value head) is larger: enough planes per dispatch to fill a GPU, a bounded workspace.
const TILE: usize = 1 << 24;

/// The row softmax's variants (kernels/attention.wgsl).
enum Softmax {
    /// x becomes softmax(scale * x); with stats, each row's (max, 1/sum) goes there.
    Forward(Option<Buf>),
    /// x (scores) becomes the probabilities again from the forward's stats.
    Rebuild(Buf),
    /// x (dP) becomes dS, given the probabilities P.
    Backward(Buf),
}

impl GpuBackend {
    /// The row softmax over `planes` x `rows` rows of x (rows rs apart, planes ps apart), row i
    /// seeing keys 0..=pos+i of `len`. Statistics are (planes, rows, 2), contiguous.
    #[allow(clippy::too_many_arguments)]
    fn softmax(
        &mut self,
        x: Buf,
        op: Softmax,
        planes: usize,
        rows: usize,
        rs: usize,
        ps: usize,
        pos: usize,
        len: usize,
        scale: f32,
    ) {
        let wx = self.win(x);
        let (k, y, flag) = match op {
            Softmax::Forward(stats) => (SOFTMAX_FORWARD, stats, u32::from(stats.is_some())),
            Softmax::Rebuild(stats) => (SOFTMAX_PROBS, Some(stats), 1),
            Softmax::Backward(p) => (SOFTMAX_BACKWARD, Some(p), 1),
        };
        let wy = y.map_or_else(|| self.mem.dummy.clone(), |y| self.win(y));
        let imm = [wx.off, wy.off, u(planes), u(rows), u(rs), u(ps), u(pos), u(len), scale.to_bits(), flag];
        self.dispatch(k, &[wx, wy], &imm, Groups(planes * rows));
    }

    /// The pieces of the b * nkv (batch, key/value head) planes of `plane` scores each (the
    /// REP query heads of a key/value head), at most [`TILE`] scores and a grid's worth per
    /// piece, such that the per-plane and per-batch tensors of a piece fit one binding each;
    /// and `count` tiles from the attention workspace for the largest piece. None, and the
    /// error reported at the next host read, when a single plane does not fit.
    fn tiles(
        &mut self,
        b: usize,
        nkv: usize,
        plane: usize,
        count: usize,
        per_plane: &[(Buf, usize)],
        per_batch: &[(Buf, usize)],
    ) -> Option<(Vec<Range<usize>>, Vec<Buf>)> {
        // A tile is bound whole: at most a binding's worth, whatever TILE says.
        let room = TILE.min((self.mem.sizes.max_binding / 4) as usize);
        let most = (room / plane.max(1)).clamp(1, self.cuts.max_groups);
        let fits = |me: &mut Self, ok: bool| {
            if !ok {
                me.fault.get_or_insert(format!(
                    "attention needs {:.1} MB for the scores of a head (of the heads that share a key/value \
                     head), more than {} binds at once: lower the sequence length (-t), or run on the CPU \
                     with --device cpu",
                    (plane * 4) as f64 / 1e6,
                    me.ctx.name()
                ));
            }
            ok
        };
        let pieces = self.mem.plane_pieces(b * nkv, nkv, most, per_plane, per_batch);
        if !fits(self, pieces.is_some()) {
            return None;
        }
        let pieces = pieces?;
        let len = plane * pieces.iter().map(|z| z.len()).max().unwrap_or(0);
        // Each tile its own allocation, so that each starts a binding window.
        let slots: [fn(&mut Self) -> &mut Option<Buf>; 2] = [|s| &mut s.att_tiles[0], |s| &mut s.att_tiles[1]];
        let mut tiles = vec![];
        for slot in &slots[..count] {
            tiles.push(self.workspace(*slot, len, DType::F32)?);
        }
        let bound = tiles.iter().all(|&t| t.len == 0 || self.mem.fit(t, 0) == t.len);
        fits(self, bound).then_some((pieces, tiles))
    }

    /// out (B, T, C) and stats (B, NH, T, 2) from qkv (B, T, QKV). With grouped-query
    /// attention (REP = NH / KV query heads per key/value head), query head h = g*REP + r: the
    /// GEMMs run once per r over the (batch, g) planes, whose operands are then evenly strided.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_(
        &mut self,
        out: Buf,
        stats: Buf,
        workspace: Buf,
        qkv: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    ) {
        let ((hs, qd, kv, rep), tt) = (shapes(c, nh, nkv), t * t);
        let scale = 1.0 / (hs as f32).sqrt();
        Self::disjoint("attention_forward", &[out, stats, workspace], &[qkv]);
        if b * t == 0 {
            return;
        }
        let per_batch = [(qkv, t * qd), (out, t * c)];
        let Some((pieces, tiles)) = self.tiles(b, nkv, rep * tt, 1, &[(stats, rep * t * 2)], &per_batch) else {
            return;
        };
        for z in pieces {
            let (b0, b1) = (z.start / nkv, (z.end - 1) / nkv + 1);
            let q = qkv.slice(b0 * t * qd..b1 * t * qd);
            let a = tiles[0].prefix(z.len() * rep * tt);
            let st = stats.slice(z.start * rep * t * 2..z.end * rep * t * 2);
            let batches = Batches { z0: z.start, count: z.len(), inner: nkv };
            // Query head g*REP + r and key/value head g of each (batch, g) plane.
            let q_heads = |r: usize| Operand::rows(q.slice(r * hs..q.len), qd).batched(t * qd, rep * hs);
            let scores = |r: usize| Operand::rows(a.slice(r * tt..a.len), t).each(rep * tt);
            for r in 0..rep {
                // scores = Q K^T
                let kt = Operand::transposed(q.slice(c..q.len), qd).batched(t * qd, hs);
                self.gemm((t, t, hs), q_heads(r), kt, scores(r), None, SKIP_UPPER, batches);
            }
            self.softmax(a, Softmax::Forward(Some(st)), z.len() * rep, t, t, tt, 0, t, scale);
            let o = out.slice(b0 * t * c..b1 * t * c);
            for r in 0..rep {
                // out = P V, into the heads' columns of out
                let v = Operand::rows(q.slice(c + kv..q.len), qd).batched(t * qd, hs);
                let dst = Operand::rows(o.slice(r * hs..o.len), c).batched(t * c, rep * hs);
                self.gemm((t, hs, t), scores(r), v, dst, None, K_UPPER, batches);
            }
        }
    }

    /// dqkv (B, T, QKV) from dout (B, T, C), qkv and the forward's stats: per group of
    /// planes, P again (Q K^T, then the probabilities from the stats), dP = dO V^T, dS =
    /// softmax'(dP), dQ = dS K, dK = dS^T Q, dV = P^T dO; a key/value head's gradient sums its
    /// query heads' in order (the GEMM of r > 0 adds to that of r - 1).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_(
        &mut self,
        dqkv: Buf,
        workspace: Buf,
        dout: Buf,
        qkv: Buf,
        stats: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    ) {
        let ((hs, qd, kv, rep), tt) = (shapes(c, nh, nkv), t * t);
        let scale = 1.0 / (hs as f32).sqrt();
        Self::disjoint("attention_backward", &[dqkv, workspace], &[dout, qkv, stats]);
        if b * t == 0 {
            return;
        }
        let per_batch = [(qkv, t * qd), (dqkv, t * qd), (dout, t * c)];
        let Some((pieces, tiles)) = self.tiles(b, nkv, rep * tt, 2, &[(stats, rep * t * 2)], &per_batch) else {
            return;
        };
        for z in pieces {
            let (b0, b1) = (z.start / nkv, (z.end - 1) / nkv + 1);
            let q = qkv.slice(b0 * t * qd..b1 * t * qd);
            let dq = dqkv.slice(b0 * t * qd..b1 * t * qd);
            let d = dout.slice(b0 * t * c..b1 * t * c);
            let p = tiles[0].prefix(z.len() * rep * tt);
            let dp = tiles[1].prefix(z.len() * rep * tt);
            let st = stats.slice(z.start * rep * t * 2..z.end * rep * t * 2);
            let batches = Batches { z0: z.start, count: z.len(), inner: nkv };
            // Query heads (r) and key/value heads (at `off`) of a (B, T, QKV) buffer.
            let q_heads = |x: Buf, r: usize| Operand::rows(x.slice(r * hs..x.len), qd).batched(t * qd, rep * hs);
            let kv_heads = |x: Buf, off: usize| Operand::rows(x.slice(off..x.len), qd).batched(t * qd, hs);
            let plane = |x: Buf, r: usize| Operand::rows(x.slice(r * tt..x.len), t).each(rep * tt);
            let plane_t = |x: Buf, r: usize| Operand::transposed(x.slice(r * tt..x.len), t).each(rep * tt);
            let d_heads = |r: usize| Operand::rows(d.slice(r * hs..d.len), c).batched(t * c, rep * hs);
            for r in 0..rep {
                // P = Q K^T, then its softmax from the stats; dP = dO V^T
                let kt = Operand::transposed(q.slice(c..q.len), qd).batched(t * qd, hs);
                self.gemm((t, t, hs), q_heads(q, r), kt, plane(p, r), None, SKIP_UPPER, batches);
                let vt = Operand::transposed(q.slice(c + kv..q.len), qd).batched(t * qd, hs);
                self.gemm((t, t, hs), d_heads(r), vt, plane(dp, r), None, SKIP_UPPER, batches);
            }
            self.softmax(p, Softmax::Rebuild(st), z.len() * rep, t, t, tt, 0, t, scale);
            self.softmax(dp, Softmax::Backward(p), z.len() * rep, t, t, tt, 0, t, scale);
            for r in 0..rep {
                // dQ = dS K, dK += dS^T Q, dV += P^T dO: every element of dqkv written, then added to
                let acc = if r > 0 { ACCUMULATE } else { 0 };
                self.gemm((t, hs, t), plane(dp, r), kv_heads(q, c), q_heads(dq, r), None, K_UPPER, batches);
                self.gemm((t, hs, t), plane_t(dp, r), q_heads(q, r), kv_heads(dq, c), None, K_LOWER | acc, batches);
                self.gemm((t, hs, t), plane_t(p, r), d_heads(r), kv_heads(dq, c + kv), None, K_LOWER | acc, batches);
            }
        }
    }

    /// `tn` new positions of one sequence against its KV cache: their keys and values go to
    /// rows pos.. of the caches (maxT, KV*HS), then out (TN, C) = attention over cache rows
    /// 0..=pos+i, in groups of heads whose scores (TN, pos+TN) fit a tile.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_cached_(
        &mut self,
        out: Buf,
        workspace: Buf,
        qkv: Buf,
        k_cache: Buf,
        v_cache: Buf,
        pos: usize,
        tn: usize,
        c: usize,
        nh: usize,
        nkv: usize,
        max_t: usize,
    ) {
        let (hs, qd, kv, rep) = shapes(c, nh, nkv);
        assert!(tn > 0 && pos + tn <= max_t, "attention_forward_cached: positions {pos}+{tn} past {max_t}");
        Self::disjoint("attention_forward_cached", &[out, workspace, k_cache, v_cache], &[qkv]);
        // Scores of the new rows against the keys they see, n per row.
        let n = pos + tn;
        let plane = tn * n;
        let scale = 1.0 / (hs as f32).sqrt();
        self.copy_rows(k_cache.slice(pos * kv..n * kv), kv, qkv.slice(c..qkv.len), qd, tn, kv);
        self.copy_rows(v_cache.slice(pos * kv..n * kv), kv, qkv.slice(c + kv..qkv.len), qd, tn, kv);
        // One batch of KV groups: the queries, caches and output are one sequence's, far below
        // a binding; the scores are cut by groups of heads.
        let Some((pieces, tiles)) = self.tiles(1, nkv, rep * plane, 1, &[], &[]) else { return };
        for z in pieces {
            let groups = Batches { z0: z.start, count: z.len(), inner: nkv };
            let sc = tiles[0].prefix(z.len() * rep * plane);
            let scs = |r: usize| Operand::rows(sc.slice(r * plane..sc.len), n).each(rep * plane);
            let q = |r: usize| Operand::rows(qkv.slice(r * hs..qkv.len), qd).batched(0, rep * hs);
            for r in 0..rep {
                let kt = Operand::transposed(k_cache, kv).batched(0, hs);
                self.gemm((tn, n, hs), q(r), kt, scs(r), None, 0, groups);
            }
            self.softmax(sc, Softmax::Forward(None), z.len() * rep, tn, n, plane, pos, n, scale);
            for r in 0..rep {
                let v = Operand::rows(v_cache, kv).batched(0, hs);
                let dst = Operand::rows(out.slice(r * hs..out.len), c).batched(0, rep * hs);
                self.gemm((tn, hs, n), scs(r), v, dst, None, 0, groups);
            }
        }
    }
}

/// (HS, QKV, KV*HS, REP) of an attention with `nkv` key/value heads.
fn shapes(c: usize, nh: usize, nkv: usize) -> (usize, usize, usize, usize) {
    assert!(
        nh > 0 && nkv > 0 && nh.is_multiple_of(nkv) && c.is_multiple_of(nh),
        "attention: {nh} heads, {nkv} kv heads, C={c}"
    );
    let hs = c / nh;
    (hs, c + 2 * nkv * hs, nkv * hs, nh / nkv)
}

impl AttentionOps for GpuBackend {
    fn attention_forward(&mut self, a: &AttentionForward) {
        let (Seq { b, t }, h) = (a.s, a.h);
        let (c, nh, nkv) = (h.q(), h.nh, h.nkv);
        // bf16 q, k, v read and out written by the GEMMs themselves (the scores and
        // probabilities are f32 tiles), where out's sums over T are one dispatch each.
        if all_bf16(&[a.out, a.qkv]) && all_f32(&[a.stats]) && t <= self.cuts.k_per_dispatch {
            return self.attention_forward_(a.out, a.stats, a.ws, a.qkv, b, t, c, nh, nkv);
        }
        self.call_in_f32(a, Nearest, |g, a| g.attention_forward_(a.out, a.stats, a.ws, a.qkv, b, t, c, nh, nkv))
    }

    fn attention_backward(&mut self, a: &AttentionBackward) {
        let AttentionBackward { dqkv, ws, dout, qkv, stats, s: Seq { b, t }, h } = *a;
        let (c, nh, nkv) = (h.q(), h.nh, h.nkv);
        if all_bf16(&[dqkv, dout, qkv]) && all_f32(&[stats]) {
            // bf16 qkv and dout read by the GEMMs themselves; dqkv written by them where each
            // element is one sum of one dispatch: with one query head per key/value head (the
            // key and value gradients of grouped heads add up over the heads, in f32 in a copy,
            // rounded once) and T at most a dispatch's sum.
            if nh == nkv && t <= self.cuts.k_per_dispatch {
                return self.attention_backward_(dqkv, ws, dout, qkv, stats, b, t, c, nh, nkv);
            }
            return self.in_f32(AttentionBackward::NAME, [(dqkv, Out)], Nearest, |g, [dqkv]| {
                g.attention_backward_(dqkv, ws, dout, qkv, stats, b, t, c, nh, nkv)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| {
            g.attention_backward_(a.dqkv, a.ws, a.dout, a.qkv, a.stats, b, t, c, nh, nkv)
        })
    }

    fn attention_forward_cached(&mut self, a: &AttentionCached) {
        let (pos, tn, cap, h) = (a.pos, a.tn, a.cap, a.h);
        let (c, nh, nkv) = (h.q(), h.nh, h.nkv);
        if all_bf16(&[a.out, a.qkv, a.k, a.v]) && pos + tn <= self.cuts.k_per_dispatch {
            // All read and written as they are (the new keys and values copied into the caches
            // as bf16, exactly), the scores in an f32 tile.
            return self.attention_forward_cached_(a.out, a.ws, a.qkv, a.k, a.v, pos, tn, c, nh, nkv, cap);
        }
        // Only the rows the cache holds, with the new ones, reach the op (its roles' prefixes:
        // in a bf16 run, only they are widened and rounded back; the kernels read no further).
        self.call_in_f32(a, Nearest, |g, a| {
            g.attention_forward_cached_(a.out, a.ws, a.qkv, a.k, a.v, pos, tn, c, nh, nkv, cap)
        })
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// Attention's softmax kernels (kernels/attention.wgsl, which declares its own buffers; its GEMMs are matmul's).
pub(super) const MODULE: Module = Module {
    name: "attention",
    src: include_str!("kernels/attention.wgsl"),
    buffers: &[],
    entries: &[
        Entry { name: "softmax_forward", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
        Entry { name: "softmax_probs", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
        Entry { name: "softmax_backward", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const SOFTMAX_FORWARD: K = K::of(&MODULE, 0);
pub(super) const SOFTMAX_PROBS: K = K::of(&MODULE, 1);
pub(super) const SOFTMAX_BACKWARD: K = K::of(&MODULE, 2);

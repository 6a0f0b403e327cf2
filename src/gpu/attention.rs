//! Causal self-attention on the GPU as GEMMs (kernels/matmul.wgsl) around a row softmax
//! (kernels/attention.wgsl): scores = Q K^T, P = softmax, out = P V per (batch, head) plane,
//! each GEMM skipping the tiles that the causal mask makes zero. The heads are read from and
//! written to the packed (B, T, QKV) and (B, T, C) layouts through strides, with no copies.
//! Planes are processed in groups whose tensors fit one binding each.

use super::matmul::{Batches, Operand, ACCUMULATE, K_LOWER, K_UPPER, SKIP_UPPER};
use super::{u, GpuBackend, Groups, K};
use crate::backend::Buf;
use std::ops::Range;

impl GpuBackend {
    /// The row softmax over `planes` x `rows` rows of x (rows rs apart, planes ps apart), row i
    /// seeing keys 0..=pos+i of `len`; with `p` its backward (x holds dP and becomes dS).
    #[allow(clippy::too_many_arguments)]
    fn softmax(
        &mut self,
        x: Buf,
        p: Option<Buf>,
        planes: usize,
        rows: usize,
        rs: usize,
        ps: usize,
        pos: usize,
        len: usize,
        scale: f32,
    ) {
        let wx = self.win(x);
        let imm = |o1: u32| [wx.off, o1, u(planes), u(rows), u(rs), u(ps), u(pos), u(len), scale.to_bits()];
        match p {
            None => self.dispatch(K::SoftmaxForward, std::slice::from_ref(&wx), &imm(0), Groups(planes * rows)),
            Some(p) => {
                let wp = self.win(p);
                self.dispatch(K::SoftmaxBackward, &[wx.clone(), wp.clone()], &imm(wp.off), Groups(planes * rows))
            }
        }
    }

    /// Groups of the B*NH planes whose per-plane and per-batch tensors fit one binding each
    /// (and a grid); None, and the error reported at the next host read, when a single plane
    /// of `plane` scores does not fit.
    fn planes(
        &mut self,
        b: usize,
        nh: usize,
        plane: usize,
        per_plane: &[(Buf, usize)],
        per_batch: &[(Buf, usize)],
    ) -> Option<Vec<Range<usize>>> {
        let pieces = self.mem.plane_pieces(b * nh, nh, self.cuts.max_groups, per_plane, per_batch);
        if pieces.is_none() {
            self.fault.get_or_insert(format!(
                "attention needs {:.1} MB for the scores of a head (of the heads that share a key/value \
                 head), more than {} binds at once: lower the sequence length (-t), or run on the CPU with \
                 --device cpu",
                (plane * 4) as f64 / 1e6,
                self.ctx.name()
            ));
        }
        pieces
    }

    /// out (B, T, C) and att (B, NH, T, T) from qkv (B, T, QKV). With grouped-query attention
    /// (REP = NH / KV query heads per key/value head), query head h = g*REP + r: the GEMMs run
    /// once per r over the (batch, g) planes, whose operands are then evenly strided. Without
    /// `out` only att, by the same dispatches (the backward's recomputation).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_(
        &mut self,
        out: Option<Buf>,
        att: Buf,
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
        let outs: Vec<Buf> = out.into_iter().chain([att, workspace]).collect();
        Self::disjoint("attention_forward", &outs, &[qkv]);
        let per_batch: Vec<(Buf, usize)> = [(qkv, t * qd)].into_iter().chain(out.map(|o| (o, t * c))).collect();
        let Some(pieces) = self.planes(b, nkv, rep * tt, &[(att, rep * tt)], &per_batch) else { return };
        for z in pieces {
            let (b0, b1) = (z.start / nkv, (z.end - 1) / nkv + 1);
            let q = qkv.slice(b0 * t * qd..b1 * t * qd);
            let a = att.slice(z.start * rep * tt..z.end * rep * tt);
            let batches = Batches { z0: z.start, count: z.end - z.start, inner: nkv };
            // Query head g*REP + r and key/value head g of each (batch, g) plane.
            let q_heads = |r: usize| Operand::rows(q.slice(r * hs..q.len), qd).batched(t * qd, rep * hs);
            let scores = |r: usize| Operand::rows(a.slice(r * tt..a.len), t).each(rep * tt);
            for r in 0..rep {
                // scores = Q K^T
                let kt = Operand::transposed(q.slice(c..q.len), qd).batched(t * qd, hs);
                self.gemm((t, t, hs), q_heads(r), kt, scores(r), None, SKIP_UPPER, batches);
            }
            self.softmax(a, None, (z.end - z.start) * rep, t, t, tt, 0, t, scale);
            let Some(out) = out else { continue };
            let o = out.slice(b0 * t * c..b1 * t * c);
            for r in 0..rep {
                // out = P V, into the heads' columns of out
                let v = Operand::rows(q.slice(c + kv..q.len), qd).batched(t * qd, hs);
                let dst = Operand::rows(o.slice(r * hs..o.len), c).batched(t * c, rep * hs);
                self.gemm((t, hs, t), scores(r), v, dst, None, K_UPPER, batches);
            }
        }
    }

    /// dqkv (B, T, QKV) from dout (B, T, C): dP = dO V^T, dS = softmax'(dP) (in datt),
    /// dQ = dS K, dK = dS^T Q, dV = P^T dO; a key/value head's gradient sums its query heads'
    /// in order (the GEMM of r > 0 adds to that of r - 1).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_(
        &mut self,
        dqkv: Buf,
        datt: Buf,
        workspace: Buf,
        dout: Buf,
        qkv: Buf,
        att: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    ) {
        let ((hs, qd, kv, rep), tt) = (shapes(c, nh, nkv), t * t);
        let scale = 1.0 / (hs as f32).sqrt();
        Self::disjoint("attention_backward", &[dqkv, datt, workspace], &[dout, qkv, att]);
        let per_batch = [(qkv, t * qd), (dqkv, t * qd), (dout, t * c)];
        let per_plane = [(att, rep * tt), (datt, rep * tt)];
        let Some(pieces) = self.planes(b, nkv, rep * tt, &per_plane, &per_batch) else { return };
        for z in pieces {
            let (b0, b1) = (z.start / nkv, (z.end - 1) / nkv + 1);
            let q = qkv.slice(b0 * t * qd..b1 * t * qd);
            let dq = dqkv.slice(b0 * t * qd..b1 * t * qd);
            let d = dout.slice(b0 * t * c..b1 * t * c);
            let p = att.slice(z.start * rep * tt..z.end * rep * tt);
            let dp = datt.slice(z.start * rep * tt..z.end * rep * tt);
            let batches = Batches { z0: z.start, count: z.end - z.start, inner: nkv };
            // Query heads (r) and key/value heads (at `off`) of a (B, T, QKV) buffer.
            let q_heads = |x: Buf, r: usize| Operand::rows(x.slice(r * hs..x.len), qd).batched(t * qd, rep * hs);
            let kv_heads = |x: Buf, off: usize| Operand::rows(x.slice(off..x.len), qd).batched(t * qd, hs);
            let plane = |x: Buf, r: usize| Operand::rows(x.slice(r * tt..x.len), t).each(rep * tt);
            let plane_t = |x: Buf, r: usize| Operand::transposed(x.slice(r * tt..x.len), t).each(rep * tt);
            let d_heads = |r: usize| Operand::rows(d.slice(r * hs..d.len), c).batched(t * c, rep * hs);
            for r in 0..rep {
                // dP = dO V^T
                let vt = Operand::transposed(q.slice(c + kv..q.len), qd).batched(t * qd, hs);
                self.gemm((t, t, hs), d_heads(r), vt, plane(dp, r), None, SKIP_UPPER, batches);
            }
            self.softmax(dp, Some(p), (z.end - z.start) * rep, t, t, tt, 0, t, scale);
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
    /// 0..=pos+i, in groups of heads whose scores (TN, maxT) fit one binding.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_cached_(
        &mut self,
        out: Buf,
        scores: Buf,
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
        Self::disjoint("attention_forward_cached", &[out, scores, workspace, k_cache, v_cache], &[qkv]);
        let (n, plane) = (pos + tn, tn * max_t);
        let scale = 1.0 / (hs as f32).sqrt();
        self.copy_rows(k_cache.slice(pos * kv..n * kv), kv, qkv.slice(c..qkv.len), qd, tn, kv);
        self.copy_rows(v_cache.slice(pos * kv..n * kv), kv, qkv.slice(c + kv..qkv.len), qd, tn, kv);
        // One batch of KV groups: the queries, caches and output are one sequence's, far below
        // a binding; the scores are cut by groups of heads.
        let Some(pieces) = self.planes(1, nkv, rep * plane, &[(scores, rep * plane)], &[]) else { return };
        for z in pieces {
            let groups = Batches { z0: z.start, count: z.end - z.start, inner: nkv };
            let sc = scores.slice(z.start * rep * plane..z.end * rep * plane);
            let scs = |r: usize| Operand::rows(sc.slice(r * plane..sc.len), max_t).each(rep * plane);
            let q = |r: usize| Operand::rows(qkv.slice(r * hs..qkv.len), qd).batched(0, rep * hs);
            for r in 0..rep {
                let kt = Operand::transposed(k_cache, kv).batched(0, hs);
                self.gemm((tn, n, hs), q(r), kt, scs(r), None, 0, groups);
            }
            self.softmax(sc, None, (z.end - z.start) * rep, tn, max_t, plane, pos, n, scale);
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

//! Causal self-attention on the GPU as GEMMs (kernels/matmul.wgsl) around a row softmax
//! (kernels/attention.wgsl): scores = Q K^T, P = softmax, out = P V per (batch, head) plane,
//! each GEMM skipping the tiles that the causal mask makes zero. The heads are read from and
//! written to the packed (B, T, 3*C) and (B, T, C) layouts through strides, with no copies.
//! Planes are processed in groups whose tensors fit one binding each.

use super::matmul::{Batches, Operand, K_LOWER, K_UPPER, SKIP_UPPER};
use super::{u, GpuBackend, Groups, K};
use crate::backend::{lens, Buf};
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
                "attention needs {:.1} MB per head for its scores, more than {} binds at once: lower the \
                 sequence length (-t), or run on the CPU with --device cpu",
                (plane * 4) as f64 / 1e6,
                self.ctx.name()
            ));
        }
        pieces
    }

    /// out (B, T, C) and att (B, NH, T, T) from qkv (B, T, 3*C).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_(
        &mut self,
        out: Buf,
        att: Buf,
        workspace: Buf,
        qkv: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        lens!("attention_forward"; out => b * t * c, att => b * nh * t * t, workspace => b * t * c, qkv => b * t * 3 * c);
        let (hs, tt, c3) = (c / nh, t * t, 3 * c);
        let scale = 1.0 / (hs as f32).sqrt();
        Self::disjoint("attention_forward", &[out, att, workspace], &[qkv]);
        let Some(pieces) = self.planes(b, nh, tt, &[(att, tt)], &[(qkv, t * c3), (out, t * c)]) else { return };
        for z in pieces {
            let (b0, b1) = (z.start / nh, (z.end - 1) / nh + 1);
            let q = qkv.slice(b0 * t * c3..b1 * t * c3);
            let o = out.slice(b0 * t * c..b1 * t * c);
            let a = att.slice(z.start * tt..z.end * tt);
            let batches = Batches { z0: z.start, count: z.end - z.start, inner: nh };
            let heads = |x: Buf, off: usize| Operand::rows(x.slice(off..x.len), c3).batched(t * c3, hs);
            let scores = Operand::rows(a, t).each(tt);
            // scores = Q K^T
            let kt = Operand::transposed(q.slice(c..q.len), c3).batched(t * c3, hs);
            self.gemm((t, t, hs), heads(q, 0), kt, scores, None, SKIP_UPPER, batches);
            self.softmax(a, None, z.end - z.start, t, t, tt, 0, t, scale);
            // out = P V, into the heads' columns of out
            let dst = Operand::rows(o, c).batched(t * c, hs);
            self.gemm((t, hs, t), scores, heads(q, 2 * c), dst, None, K_UPPER, batches);
        }
    }

    /// dqkv (B, T, 3*C) from dout (B, T, C): dP = dO V^T, dS = softmax'(dP) (in datt),
    /// dQ = dS K, dK = dS^T Q, dV = P^T dO.
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
    ) {
        lens!("attention_backward"; dqkv => b * t * 3 * c, datt => b * nh * t * t, workspace => b * t * 3 * c,
              dout => b * t * c, qkv => b * t * 3 * c, att => b * nh * t * t);
        let (hs, tt, c3) = (c / nh, t * t, 3 * c);
        let scale = 1.0 / (hs as f32).sqrt();
        Self::disjoint("attention_backward", &[dqkv, datt, workspace], &[dout, qkv, att]);
        let per_batch = [(qkv, t * c3), (dqkv, t * c3), (dout, t * c)];
        let Some(pieces) = self.planes(b, nh, tt, &[(att, tt), (datt, tt)], &per_batch) else { return };
        for z in pieces {
            let (b0, b1) = (z.start / nh, (z.end - 1) / nh + 1);
            let q = qkv.slice(b0 * t * c3..b1 * t * c3);
            let dq = dqkv.slice(b0 * t * c3..b1 * t * c3);
            let d = dout.slice(b0 * t * c..b1 * t * c);
            let p = att.slice(z.start * tt..z.end * tt);
            let dp = datt.slice(z.start * tt..z.end * tt);
            let batches = Batches { z0: z.start, count: z.end - z.start, inner: nh };
            let heads = |x: Buf, off: usize| Operand::rows(x.slice(off..x.len), c3).batched(t * c3, hs);
            let plane = |x: Buf| Operand::rows(x, t).each(tt);
            let plane_t = |x: Buf| Operand::transposed(x, t).each(tt);
            let d_heads = Operand::rows(d, c).batched(t * c, hs);
            // dP = dO V^T
            let vt = Operand::transposed(q.slice(2 * c..q.len), c3).batched(t * c3, hs);
            self.gemm((t, t, hs), d_heads, vt, plane(dp), None, SKIP_UPPER, batches);
            self.softmax(dp, Some(p), z.end - z.start, t, t, tt, 0, t, scale);
            // dQ = dS K, dK = dS^T Q, dV = P^T dO: every element of dqkv written once
            self.gemm((t, hs, t), plane(dp), heads(q, c), heads(dq, 0), None, K_UPPER, batches);
            self.gemm((t, hs, t), plane_t(dp), heads(q, 0), heads(dq, c), None, K_LOWER, batches);
            self.gemm((t, hs, t), plane_t(p), d_heads, heads(dq, 2 * c), None, K_LOWER, batches);
        }
    }

    /// `tn` new positions of one sequence against its KV cache: their keys and values go to
    /// rows pos.. of the caches, then out (TN, C) = attention over cache rows 0..=pos+i, in
    /// groups of heads whose scores (TN, maxT) fit one binding.
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
        max_t: usize,
    ) {
        lens!("attention_forward_cached"; out => tn * c, scores => nh * tn * max_t, workspace => tn * c,
              qkv => tn * 3 * c, k_cache => max_t * c, v_cache => max_t * c);
        assert!(tn > 0 && pos + tn <= max_t, "attention_forward_cached: positions {pos}+{tn} past {max_t}");
        Self::disjoint("attention_forward_cached", &[out, scores, workspace, k_cache, v_cache], &[qkv]);
        let (hs, n, c3, plane) = (c / nh, pos + tn, 3 * c, tn * max_t);
        let scale = 1.0 / (hs as f32).sqrt();
        self.copy_rows(k_cache.slice(pos * c..n * c), c, qkv.slice(c..qkv.len), c3, tn, c);
        self.copy_rows(v_cache.slice(pos * c..n * c), c, qkv.slice(2 * c..qkv.len), c3, tn, c);
        // One batch of NH heads: the queries, caches and output are one sequence's, far below a
        // binding; the scores are cut by heads.
        let Some(pieces) = self.planes(1, nh, plane, &[(scores, plane)], &[]) else { return };
        for z in pieces {
            let heads = Batches { z0: z.start, count: z.end - z.start, inner: nh };
            let sc = scores.slice(z.start * plane..z.end * plane);
            let scs = Operand::rows(sc, max_t).each(plane);
            let q = Operand::rows(qkv, c3).batched(0, hs);
            let kt = Operand::transposed(k_cache, c).batched(0, hs);
            self.gemm((tn, n, hs), q, kt, scs, None, 0, heads);
            self.softmax(sc, None, z.end - z.start, tn, max_t, plane, pos, n, scale);
            let v = Operand::rows(v_cache, c).batched(0, hs);
            self.gemm((tn, hs, n), scs, v, Operand::rows(out, c).batched(0, hs), None, 0, heads);
        }
    }
}

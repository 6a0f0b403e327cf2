//! RMSNorm on the GPU (kernels/rmsnorm.wgsl).

use super::{f, u, GpuBackend, Groups, Threads, K};
use crate::backend::{Buf, DType};

/// Rows per partial sum of the weight gradient (kernels/rmsnorm.wgsl: ROWS).
const ROWS: usize = 64;

impl GpuBackend {
    /// out (N, C) = inp * rstd * weight; rstd (N) kept.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_forward_(
        &mut self,
        out: Buf,
        rstd: Buf,
        inp: Buf,
        weight: Buf,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        Self::disjoint("rmsnorm_forward", &[out, rstd], &[inp, weight]);
        let w = self.win(weight);
        for r in self.mem.row_pieces(n, &[(out, c), (rstd, 1), (inp, c)]) {
            let rows = r.end - r.start;
            let wins = [
                self.win(out.slice(r.start * c..r.end * c)),
                self.win(rstd.slice(r.clone())),
                self.win(inp.slice(r.start * c..r.end * c)),
                w.clone(),
            ];
            let imm = [wins[0].off, wins[1].off, wins[2].off, w.off, 0, 0, u(rows), u(c), f(eps)];
            self.dispatch(K::RmsnormForward.on(out.dtype == DType::BF16), &wins, &imm, Groups(rows));
        }
    }

    /// dinp (N, C) and dweight (C) += the RMSNorm backward of dout. The weight gradient is a
    /// column sum: partial sums per block of ROWS rows, then their sums, piece after piece.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_backward_(
        &mut self,
        dinp: Buf,
        dweight: Buf,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        rstd: Buf,
        n: usize,
        c: usize,
    ) {
        Self::disjoint("rmsnorm_backward", &[dinp, dweight], &[dout, inp, weight, rstd]);
        let w = self.win(weight);
        for r in self.mem.row_pieces(n, &[(dinp, c), (dout, c), (inp, c), (rstd, 1)]) {
            let rows = r.end - r.start;
            let di = self.win(dinp.slice(r.start * c..r.end * c));
            let d = self.win(dout.slice(r.start * c..r.end * c));
            let x = self.win(inp.slice(r.start * c..r.end * c));
            let s = self.win(rstd.slice(r.clone()));
            let imm = [di.off, d.off, x.off, w.off, s.off, 0, u(rows), u(c), 0];
            let wins = [di, d.clone(), x.clone(), w.clone(), s.clone()];
            self.dispatch(K::RmsnormBackwardInput.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows));
            let blocks = rows.div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, blocks * c, DType::F32) else { return };
            let pw = self.win(part.prefix(blocks * c)); // (blocks, C)
            let imm = [pw.off, d.off, x.off, s.off, 0, 0, u(rows), u(c), 0];
            self.dispatch(
                K::RmsnormBackwardParams.on(dout.dtype == DType::BF16),
                &[pw, d, x, s],
                &imm,
                Threads(blocks * c),
            );
            self.column_sums(dweight, part.prefix(blocks * c), blocks, c, true);
        }
    }

    /// Qwen3's per-head RMSNorm of qkv (N, QKV): one workgroup per (row, head).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_norm_forward_(
        &mut self,
        out: Buf,
        rstd: Buf,
        inp: Buf,
        wq: Buf,
        wk: Buf,
        n: usize,
        (nh, nkv, hs): (usize, usize, usize),
        eps: f32,
    ) {
        let (heads, normed) = (nh + 2 * nkv, nh + nkv);
        let (q, k) = (self.win(wq), self.win(wk));
        for r in self.mem.row_pieces(n, &[(out, heads * hs), (rstd, normed), (inp, heads * hs)]) {
            let rows = r.end - r.start;
            let o = self.win(out.slice(r.start * heads * hs..r.end * heads * hs));
            let s = self.win(rstd.slice(r.start * normed..r.end * normed));
            let x = self.win(inp.slice(r.start * heads * hs..r.end * heads * hs));
            let imm = [o.off, s.off, x.off, q.off, k.off, 0, u(rows), u(hs), f(eps), u(nh), u(nkv), 0, 0];
            self.dispatch(
                K::HeadNormForward.on(out.dtype == DType::BF16),
                &[o, s, x, q.clone(), k.clone()],
                &imm,
                Groups(rows * heads),
            );
        }
    }

    /// Its backward: dinp (N, QKV) (out); dwq, dwk (HS) += column sums in two passes, as
    /// [`GpuBackend::rmsnorm_backward_`]'s.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_norm_backward_(
        &mut self,
        dinp: Buf,
        dwq: Buf,
        dwk: Buf,
        dout: Buf,
        inp: Buf,
        (wq, wk, rstd): (Buf, Buf, Buf),
        n: usize,
        (nh, nkv, hs): (usize, usize, usize),
    ) {
        let (heads, normed, w) = (nh + 2 * nkv, nh + nkv, (nh + 2 * nkv) * hs);
        let (q, k) = (self.win(wq), self.win(wk));
        for r in self.mem.row_pieces(n, &[(dinp, w), (dout, w), (inp, w), (rstd, normed)]) {
            let rows = r.end - r.start;
            let di = self.win(dinp.slice(r.start * w..r.end * w));
            let d = self.win(dout.slice(r.start * w..r.end * w));
            let x = self.win(inp.slice(r.start * w..r.end * w));
            let s = self.win(rstd.slice(r.start * normed..r.end * normed));
            let imm = [di.off, d.off, x.off, q.off, k.off, s.off, u(rows), u(hs), 0, u(nh), u(nkv), 0, 0];
            let wins = [di, d.clone(), x.clone(), q.clone(), k.clone(), s.clone()];
            self.dispatch(K::HeadNormBackwardInput.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows * heads));
            for (dw, h0, count) in [(dwq, 0, nh), (dwk, nh, nkv)] {
                let blocks = (rows * count).div_ceil(ROWS);
                let Some(part) = self.workspace(|s| &mut s.scratch, blocks * hs, DType::F32) else { return };
                let pw = self.win(part.prefix(blocks * hs)); // (blocks, HS)
                let imm = [pw.off, d.off, x.off, s.off, 0, 0, u(rows), u(hs), 0, u(nh), u(nkv), u(h0), u(count)];
                self.dispatch(
                    K::HeadNormBackwardParams.on(dout.dtype == DType::BF16),
                    &[pw, d.clone(), x.clone(), s.clone()],
                    &imm,
                    Threads(blocks * hs),
                );
                self.column_sums(dw, part.prefix(blocks * hs), blocks, hs, true);
            }
        }
    }
}

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
            let imm = [wins[0].off, wins[1].off, wins[2].off, w.off, 0, u(rows), u(c), f(eps)];
            self.dispatch(K::RmsnormForward, &wins, &imm, Groups(rows));
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
            let imm = [di.off, d.off, x.off, w.off, s.off, u(rows), u(c), 0];
            let wins = [di, d.clone(), x.clone(), w.clone(), s.clone()];
            self.dispatch(K::RmsnormBackwardInput, &wins, &imm, Groups(rows));
            let blocks = rows.div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, blocks * c, DType::F32) else { return };
            let pw = self.win(part.prefix(blocks * c)); // (blocks, C)
            let imm = [pw.off, d.off, x.off, s.off, 0, u(rows), u(c), 0];
            self.dispatch(K::RmsnormBackwardParams, &[pw, d, x, s], &imm, Threads(blocks * c));
            self.column_sums(dweight, part.prefix(blocks * c), blocks, c, true);
        }
    }
}

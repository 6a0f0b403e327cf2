//! LayerNorm on the GPU (kernels/layernorm.wgsl).

use super::{u, GpuBackend, Groups, Threads, K};
use crate::backend::{Buf, DType};

/// Rows per partial sum of the parameter gradients (kernels/layernorm.wgsl: ROWS).
const ROWS: usize = 64;

impl GpuBackend {
    /// out (N, C) = (inp - mean) * rstd * weight + bias; mean (N) and rstd (N) kept.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_forward_(
        &mut self,
        out: Buf,
        mean: Buf,
        rstd: Buf,
        inp: Buf,
        weight: Buf,
        bias: Buf,
        n: usize,
        c: usize,
    ) {
        Self::disjoint("layernorm_forward", &[out, mean, rstd], &[inp, weight, bias]);
        let (w, bi) = (self.win(weight), self.win(bias));
        for r in self.mem.row_pieces(n, &[(out, c), (mean, 1), (rstd, 1), (inp, c)]) {
            let rows = r.end - r.start;
            let wins = [
                self.win(out.slice(r.start * c..r.end * c)),
                self.win(mean.slice(r.clone())),
                self.win(rstd.slice(r.clone())),
                self.win(inp.slice(r.start * c..r.end * c)),
                w.clone(),
                bi.clone(),
            ];
            let imm = [wins[0].off, wins[1].off, wins[2].off, wins[3].off, w.off, bi.off, u(rows), u(c)];
            self.dispatch(K::LayernormForward.on(out.dtype == DType::BF16), &wins, &imm, Groups(rows));
        }
    }

    /// dinp (N, C), dweight (C), dbias (C) += the LayerNorm backward of dout. The parameter
    /// gradients are column sums: partial sums per block of ROWS rows, then their sums, added
    /// to the gradients piece after piece.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_backward_(
        &mut self,
        dinp: Buf,
        dweight: Buf,
        dbias: Buf,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        mean: Buf,
        rstd: Buf,
        n: usize,
        c: usize,
    ) {
        Self::disjoint("layernorm_backward", &[dinp, dweight, dbias], &[dout, inp, weight, mean, rstd]);
        let w = self.win(weight);
        for r in self.mem.row_pieces(n, &[(dinp, c), (dout, c), (inp, c), (mean, 1), (rstd, 1)]) {
            let rows = r.end - r.start;
            let di = self.win(dinp.slice(r.start * c..r.end * c));
            let d = self.win(dout.slice(r.start * c..r.end * c));
            let x = self.win(inp.slice(r.start * c..r.end * c));
            let m = self.win(mean.slice(r.clone()));
            let s = self.win(rstd.slice(r.clone()));
            let imm = [di.off, d.off, x.off, w.off, m.off, s.off, u(rows), u(c)];
            let wins = [di, d.clone(), x.clone(), w.clone(), m.clone(), s.clone()];
            self.dispatch(K::LayernormBackwardInput.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows));
            let blocks = rows.div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, 2 * blocks * c, DType::F32) else { return };
            let (pw, pb) = (part.prefix(blocks * c), part.slice(blocks * c..2 * blocks * c)); // (blocks, C) each
            let (ww, wb) = (self.win(pw), self.win(pb));
            let imm = [ww.off, wb.off, d.off, x.off, m.off, s.off, u(rows), u(c)];
            self.dispatch(
                K::LayernormBackwardParams.on(dout.dtype == DType::BF16),
                &[ww, wb, d, x, m, s],
                &imm,
                Threads(blocks * c),
            );
            self.column_sums(dweight, pw, blocks, c, true);
            self.column_sums(dbias, pb, blocks, c, true);
        }
    }
}

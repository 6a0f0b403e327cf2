//! LayerNorm on the GPU (kernels/layernorm.wgsl).

use super::{cut, grid, groups, lens, u, GpuBackend, K, LOOP_ROWS};
use crate::backend::Buf;

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
        lens!("layernorm_forward"; out => n * c, mean => n, rstd => n, inp => n * c, weight => c, bias => c);
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
            self.dispatch(K::LayernormForward, &wins, &imm, groups(rows));
        }
    }

    /// dinp (N, C), dweight (C), dbias (C) += the LayerNorm backward of dout.
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
        lens!("layernorm_backward"; dinp => n * c, dweight => c, dbias => c, dout => n * c, inp => n * c,
              weight => c, mean => n, rstd => n);
        let (w, dw, db) = (self.win(weight), self.win(dweight), self.win(dbias));
        let pieces = self.mem.row_pieces(n, &[(dinp, c), (dout, c), (inp, c), (mean, 1), (rstd, 1)]);
        for r in pieces.into_iter().flat_map(|r| cut(r, LOOP_ROWS)) {
            let rows = r.end - r.start;
            let di = self.win(dinp.slice(r.start * c..r.end * c));
            let d = self.win(dout.slice(r.start * c..r.end * c));
            let x = self.win(inp.slice(r.start * c..r.end * c));
            let m = self.win(mean.slice(r.clone()));
            let s = self.win(rstd.slice(r.clone()));
            let imm = [di.off, d.off, x.off, w.off, m.off, s.off, u(rows), u(c)];
            let wins = [di, d.clone(), x.clone(), w.clone(), m.clone(), s.clone()];
            self.dispatch(K::LayernormBackwardInput, &wins, &imm, groups(rows));
            // The parameter gradients add each piece's rows after the last piece's.
            let imm = [dw.off, db.off, d.off, x.off, m.off, s.off, u(rows), u(c)];
            self.dispatch(K::LayernormBackwardParams, &[dw.clone(), db.clone(), d, x, m, s], &imm, grid(c));
        }
    }
}

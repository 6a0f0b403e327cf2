//! LayerNorm on the GPU (kernels/layernorm.wgsl).

use super::bf16::Role::InOut;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{all_bf16, all_f32};
use super::{u, GpuBackend, Groups, Threads};
use crate::backend::ops::Call;
use crate::backend::ops::{LayerNormBackward, LayerNormForward, LayerNormOps, Rows};
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
            self.dispatch(FORWARD.on(out.dtype == DType::BF16), &wins, &imm, Groups(rows));
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
            self.dispatch(BACKWARD_INPUT.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows));
            let blocks = rows.div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, 2 * blocks * c, DType::F32) else { return };
            let (pw, pb) = (part.prefix(blocks * c), part.slice(blocks * c..2 * blocks * c)); // (blocks, C) each
            let (ww, wb) = (self.win(pw), self.win(pb));
            let imm = [ww.off, wb.off, d.off, x.off, m.off, s.off, u(rows), u(c)];
            self.dispatch(
                BACKWARD_PARAMS.on(dout.dtype == DType::BF16),
                &[ww, wb, d, x, m, s],
                &imm,
                Threads(blocks * c),
            );
            self.column_sums(dweight, pw, blocks, c, true);
            self.column_sums(dbias, pb, blocks, c, true);
        }
    }
}

impl LayerNormOps for GpuBackend {
    fn layernorm_forward(&mut self, a: &LayerNormForward) {
        let Rows { n, c } = a.r;
        if all_bf16(&[a.out, a.x, a.w, a.b]) && all_f32(&[a.mean, a.rstd]) {
            return self.layernorm_forward_(a.out, a.mean, a.rstd, a.x, a.w, a.b, n, c);
        }
        self.call_in_f32(a, Nearest, |g, a| g.layernorm_forward_(a.out, a.mean, a.rstd, a.x, a.w, a.b, n, c))
    }

    fn layernorm_backward(&mut self, a: &LayerNormBackward) {
        let LayerNormBackward { dx, dw, db, dout, x, w, mean, rstd, r: Rows { n, c } } = *a;
        if all_bf16(&[dx, dout, x, w]) && all_f32(&[mean, rstd]) {
            // The parameters' gradients (C each) through f32 copies, rounded once.
            return self.in_f32(LayerNormBackward::NAME, [(dw, InOut), (db, InOut)], Nearest, |g, [dw, db]| {
                g.layernorm_backward_(dx, dw, db, dout, x, w, mean, rstd, n, c)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| {
            g.layernorm_backward_(a.dx, a.dw, a.db, a.dout, a.x, a.w, a.mean, a.rstd, n, c)
        })
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// LayerNorm's kernels (kernels/layernorm.wgsl).
pub(super) const MODULE: Module = Module {
    name: "layernorm",
    src: include_str!("kernels/layernorm.wgsl"),
    buffers: &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F), ("b5", F)],
    entries: &[
        Entry {
            name: "layernorm_forward",
            bindings: 6,
            u32s: 0,
            bf16s: 0,
            variants: &[&[Out16, F, F, In16, In16, In16]],
        },
        Entry {
            name: "layernorm_backward_input",
            bindings: 6,
            u32s: 0,
            bf16s: 0,
            variants: &[&[Out16, In16, In16, In16, F, F]],
        },
        Entry {
            name: "layernorm_backward_params",
            bindings: 6,
            u32s: 0,
            bf16s: 0,
            variants: &[&[F, F, In16, In16, F, F]],
        },
    ],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);
pub(super) const BACKWARD_INPUT: K = K::of(&MODULE, 1);
pub(super) const BACKWARD_PARAMS: K = K::of(&MODULE, 2);

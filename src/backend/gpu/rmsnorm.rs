//! RMSNorm on the GPU (kernels/rmsnorm.wgsl).

use super::bf16::Role::InOut;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{all_bf16, all_f32};
use super::{f, u, GpuBackend, Groups, Threads};
use crate::backend::ops::Call;
use crate::backend::ops::{HeadNormBackward, HeadNormForward, RmsNormBackward, RmsNormForward, RmsNormOps, Rows};
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
            self.dispatch(FORWARD.on(out.dtype == DType::BF16), &wins, &imm, Groups(rows));
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
            self.dispatch(BACKWARD_INPUT.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows));
            let blocks = rows.div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, blocks * c, DType::F32) else { return };
            let pw = self.win(part.prefix(blocks * c)); // (blocks, C)
            let imm = [pw.off, d.off, x.off, s.off, 0, 0, u(rows), u(c), 0];
            self.dispatch(BACKWARD_PARAMS.on(dout.dtype == DType::BF16), &[pw, d, x, s], &imm, Threads(blocks * c));
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
                HEAD_FORWARD.on(out.dtype == DType::BF16),
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
            self.dispatch(HEAD_BACKWARD_INPUT.on(dinp.dtype == DType::BF16), &wins, &imm, Groups(rows * heads));
            for (dw, h0, count) in [(dwq, 0, nh), (dwk, nh, nkv)] {
                let blocks = (rows * count).div_ceil(ROWS);
                let Some(part) = self.workspace(|s| &mut s.scratch, blocks * hs, DType::F32) else { return };
                let pw = self.win(part.prefix(blocks * hs)); // (blocks, HS)
                let imm = [pw.off, d.off, x.off, s.off, 0, 0, u(rows), u(hs), 0, u(nh), u(nkv), u(h0), u(count)];
                self.dispatch(
                    HEAD_BACKWARD_PARAMS.on(dout.dtype == DType::BF16),
                    &[pw, d.clone(), x.clone(), s.clone()],
                    &imm,
                    Threads(blocks * hs),
                );
                self.column_sums(dw, part.prefix(blocks * hs), blocks, hs, true);
            }
        }
    }
}

impl RmsNormOps for GpuBackend {
    fn rmsnorm_forward(&mut self, a: &RmsNormForward) {
        let (Rows { n, c }, eps) = (a.r, a.eps);
        if all_bf16(&[a.out, a.x, a.w]) && all_f32(&[a.rstd]) {
            return self.rmsnorm_forward_(a.out, a.rstd, a.x, a.w, n, c, eps);
        }
        self.call_in_f32(a, Nearest, |g, a| g.rmsnorm_forward_(a.out, a.rstd, a.x, a.w, n, c, eps))
    }

    fn rmsnorm_backward(&mut self, a: &RmsNormBackward) {
        let RmsNormBackward { dx, dw, dout, x, w, rstd, r: Rows { n, c } } = *a;
        if all_bf16(&[dx, dout, x, w]) && all_f32(&[rstd]) {
            return self.in_f32(RmsNormBackward::NAME, [(dw, InOut)], Nearest, |g, [dw]| {
                g.rmsnorm_backward_(dx, dw, dout, x, w, rstd, n, c)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| g.rmsnorm_backward_(a.dx, a.dw, a.dout, a.x, a.w, a.rstd, n, c))
    }

    fn head_norm_forward(&mut self, a: &HeadNormForward) {
        let (n, h, eps) = (a.n, (a.h.nh, a.h.nkv, a.h.hs), a.eps);
        if all_bf16(&[a.out, a.x, a.wq, a.wk]) && all_f32(&[a.rstd]) {
            return self.head_norm_forward_(a.out, a.rstd, a.x, a.wq, a.wk, n, h, eps);
        }
        self.call_in_f32(a, Nearest, |g, a| g.head_norm_forward_(a.out, a.rstd, a.x, a.wq, a.wk, n, h, eps))
    }

    fn head_norm_backward(&mut self, a: &HeadNormBackward) {
        let HeadNormBackward { dx, dwq, dwk, dout, x, wq, wk, rstd, n, h } = *a;
        let h = (h.nh, h.nkv, h.hs);
        if all_bf16(&[dx, dout, x, wq, wk]) && all_f32(&[rstd]) {
            let grads = [(dwq, InOut), (dwk, InOut)];
            return self.in_f32(HeadNormBackward::NAME, grads, Nearest, |g, [dwq, dwk]| {
                g.head_norm_backward_(dx, dwq, dwk, dout, x, (wq, wk, rstd), n, h)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| {
            g.head_norm_backward_(a.dx, a.dwq, a.dwk, a.dout, a.x, (a.wq, a.wk, a.rstd), n, h)
        })
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// RMSNorm's and the heads' norm's kernels (kernels/rmsnorm.wgsl).
pub(super) const MODULE: Module = Module {
    name: "rmsnorm",
    src: include_str!("kernels/rmsnorm.wgsl"),
    buffers: &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F), ("b5", F)],
    entries: &[
        Entry { name: "rmsnorm_forward", bindings: 4, u32s: 0, bf16s: 0, variants: &[&[Out16, F, In16, In16, F, F]] },
        Entry {
            name: "rmsnorm_backward_input",
            bindings: 5,
            u32s: 0,
            bf16s: 0,
            variants: &[&[Out16, In16, In16, In16, F, F]],
        },
        Entry {
            name: "rmsnorm_backward_params",
            bindings: 4,
            u32s: 0,
            bf16s: 0,
            variants: &[&[F, In16, In16, F, F, F]],
        },
        Entry {
            name: "head_norm_forward",
            bindings: 5,
            u32s: 0,
            bf16s: 0,
            variants: &[&[Out16, F, In16, In16, In16, F]],
        },
        Entry {
            name: "head_norm_backward_input",
            bindings: 6,
            u32s: 0,
            bf16s: 0,
            variants: &[&[Out16, In16, In16, In16, In16, F]],
        },
        Entry {
            name: "head_norm_backward_params",
            bindings: 4,
            u32s: 0,
            bf16s: 0,
            variants: &[&[F, In16, In16, F, F, F]],
        },
    ],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);
pub(super) const BACKWARD_INPUT: K = K::of(&MODULE, 1);
pub(super) const BACKWARD_PARAMS: K = K::of(&MODULE, 2);
pub(super) const HEAD_FORWARD: K = K::of(&MODULE, 3);
pub(super) const HEAD_BACKWARD_INPUT: K = K::of(&MODULE, 4);
pub(super) const HEAD_BACKWARD_PARAMS: K = K::of(&MODULE, 5);

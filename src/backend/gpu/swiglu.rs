//! SwiGLU on the GPU (kernels/swiglu.wgsl).

use super::all_bf16;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{u, GpuBackend, Threads};
use crate::backend::ops::{Rows, SwigluBackward, SwigluForward, SwigluOps};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (N, F) = up * silu(gate) from inp (N, 2F).
    pub(super) fn swiglu_forward_(&mut self, out: Buf, inp: Buf, n: usize, f: usize) {
        Self::disjoint("swiglu_forward", &[out], &[inp]);
        for r in self.mem.row_pieces(n, &[(out, f), (inp, 2 * f)]) {
            let rows = r.end - r.start;
            let o = self.win(out.slice(r.start * f..r.end * f));
            let x = self.win(inp.slice(r.start * 2 * f..r.end * 2 * f));
            let imm = [o.off, x.off, 0, u(rows), u(f)];
            self.dispatch(FORWARD.on(out.dtype == DType::BF16), &[o, x], &imm, Threads(rows * f));
        }
    }

    /// dinp (N, 2F) = (d(up), d(gate)) from dout (N, F).
    pub(super) fn swiglu_backward_(&mut self, dinp: Buf, dout: Buf, inp: Buf, n: usize, f: usize) {
        Self::disjoint("swiglu_backward", &[dinp], &[dout, inp]);
        for r in self.mem.row_pieces(n, &[(dinp, 2 * f), (dout, f), (inp, 2 * f)]) {
            let rows = r.end - r.start;
            let di = self.win(dinp.slice(r.start * 2 * f..r.end * 2 * f));
            let d = self.win(dout.slice(r.start * f..r.end * f));
            let x = self.win(inp.slice(r.start * 2 * f..r.end * 2 * f));
            let imm = [di.off, d.off, x.off, u(rows), u(f)];
            self.dispatch(BACKWARD.on(dinp.dtype == DType::BF16), &[di, d, x], &imm, Threads(rows * f));
        }
    }
}

impl SwigluOps for GpuBackend {
    fn swiglu_forward(&mut self, a: &SwigluForward) {
        let Rows { n, c: f } = a.r;
        if all_bf16(&[a.out, a.x]) {
            return self.swiglu_forward_(a.out, a.x, n, f);
        }
        self.call_in_f32(a, Nearest, |g, a| g.swiglu_forward_(a.out, a.x, n, f))
    }

    fn swiglu_backward(&mut self, a: &SwigluBackward) {
        let Rows { n, c: f } = a.r;
        if all_bf16(&[a.dx, a.dout, a.x]) {
            return self.swiglu_backward_(a.dx, a.dout, a.x, n, f);
        }
        self.call_in_f32(a, Nearest, |g, a| g.swiglu_backward_(a.dx, a.dout, a.x, n, f))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// SwiGLU's kernels (kernels/swiglu.wgsl).
pub(super) const MODULE: Module = Module {
    name: "swiglu",
    src: include_str!("kernels/swiglu.wgsl"),
    buffers: &[("b0", F), ("b1", F), ("b2", F)],
    entries: &[
        Entry { name: "swiglu_forward", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[Out16, In16, In16]] },
        Entry { name: "swiglu_backward", bindings: 3, u32s: 0, bf16s: 0, variants: &[&[Out16, In16, In16]] },
    ],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);
pub(super) const BACKWARD: K = K::of(&MODULE, 1);

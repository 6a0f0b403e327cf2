//! SwiGLU on the GPU (kernels/swiglu.wgsl).

use super::{u, GpuBackend, Threads, K};
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
            self.dispatch(K::SwigluForward.on(out.dtype == DType::BF16), &[o, x], &imm, Threads(rows * f));
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
            self.dispatch(K::SwigluBackward.on(dinp.dtype == DType::BF16), &[di, d, x], &imm, Threads(rows * f));
        }
    }
}

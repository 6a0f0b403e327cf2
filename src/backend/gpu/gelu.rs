//! GELU on the GPU (kernels/gelu.wgsl).

use super::{u, GpuBackend, Threads, K};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (N) = gelu(inp (N)).
    pub(super) fn gelu_forward_(&mut self, out: Buf, inp: Buf) {
        Self::disjoint("gelu_forward", &[out], &[inp]);
        self.gelu(K::GeluForward, out, inp);
    }

    /// d (N) *= gelu'(inp (N)).
    pub(super) fn gelu_backward_(&mut self, d: Buf, inp: Buf) {
        Self::disjoint("gelu_backward", &[d], &[inp]);
        self.gelu(K::GeluBackward, d, inp);
    }

    fn gelu(&mut self, k: K, x: Buf, y: Buf) {
        for r in self.mem.pieces(&[x, y], x.len) {
            let n = r.end - r.start;
            let wins = [self.win(x.slice(r.clone())), self.win(y.slice(r))];
            let imm = [wins[0].off, wins[1].off, u(n)];
            self.dispatch(k.on(x.dtype == DType::BF16), &wins, &imm, Threads(n));
        }
    }
}

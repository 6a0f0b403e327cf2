//! The residual connection on the GPU (kernels/residual.wgsl).

use super::{u, GpuBackend, Threads, K};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (N) = a (N) + b (N).
    pub(super) fn residual_forward_(&mut self, out: Buf, a: Buf, b: Buf) {
        Self::disjoint("residual_forward", &[out], &[a, b]);
        for r in self.mem.pieces(&[out, a, b], out.len) {
            let n = r.end - r.start;
            let wins = [self.win(out.slice(r.clone())), self.win(a.slice(r.clone())), self.win(b.slice(r))];
            let imm = [wins[0].off, wins[1].off, wins[2].off, u(n)];
            self.dispatch(K::ResidualForward.on(out.dtype == DType::BF16), &wins, &imm, Threads(n));
        }
    }
}

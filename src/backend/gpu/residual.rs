//! The residual connection on the GPU (kernels/residual.wgsl).

use super::all_bf16;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{u, GpuBackend, Threads};
use crate::backend::ops::{Residual, ResidualOps};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (N) = a (N) + b (N).
    pub(super) fn residual_forward_(&mut self, out: Buf, a: Buf, b: Buf) {
        Self::disjoint("residual_forward", &[out], &[a, b]);
        for r in self.mem.pieces(&[out, a, b], out.len) {
            let n = r.end - r.start;
            let wins = [self.win(out.slice(r.clone())), self.win(a.slice(r.clone())), self.win(b.slice(r))];
            let imm = [wins[0].off, wins[1].off, wins[2].off, u(n)];
            self.dispatch(FORWARD.on(out.dtype == DType::BF16), &wins, &imm, Threads(n));
        }
    }
}

impl ResidualOps for GpuBackend {
    fn residual_forward(&mut self, a: &Residual) {
        if all_bf16(&[a.out, a.a, a.b]) {
            return self.residual_forward_(a.out, a.a, a.b);
        }
        self.call_in_f32(a, Nearest, |g, a| g.residual_forward_(a.out, a.a, a.b))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// The residual add's kernel (kernels/residual.wgsl).
pub(super) const MODULE: Module = Module {
    name: "residual",
    src: include_str!("kernels/residual.wgsl"),
    buffers: &[("out", F), ("a", F), ("b", F)],
    entries: &[Entry { name: "residual_forward", bindings: 3, u32s: 0, bf16s: 0, variants: &[&[Out16, In16, In16]] }],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);

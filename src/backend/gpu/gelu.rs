//! GELU on the GPU (kernels/gelu.wgsl).

use super::all_bf16;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{u, GpuBackend, Threads};
use crate::backend::ops::{GeluBackward, GeluForward, GeluOps};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (N) = gelu(inp (N)).
    pub(super) fn gelu_forward_(&mut self, out: Buf, inp: Buf) {
        Self::disjoint("gelu_forward", &[out], &[inp]);
        self.gelu(FORWARD, out, inp);
    }

    /// d (N) *= gelu'(inp (N)).
    pub(super) fn gelu_backward_(&mut self, d: Buf, inp: Buf) {
        Self::disjoint("gelu_backward", &[d], &[inp]);
        self.gelu(BACKWARD, d, inp);
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

impl GeluOps for GpuBackend {
    fn gelu_forward(&mut self, a: &GeluForward) {
        if all_bf16(&[a.out, a.x]) {
            return self.gelu_forward_(a.out, a.x);
        }
        self.call_in_f32(a, Nearest, |g, a| g.gelu_forward_(a.out, a.x))
    }

    fn gelu_backward(&mut self, a: &GeluBackward) {
        if all_bf16(&[a.d, a.x]) {
            return self.gelu_backward_(a.d, a.x);
        }
        self.call_in_f32(a, Nearest, |g, a| g.gelu_backward_(a.d, a.x))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// GELU's kernels (kernels/gelu.wgsl).
pub(super) const MODULE: Module = Module {
    name: "gelu",
    src: include_str!("kernels/gelu.wgsl"),
    buffers: &[("x", F), ("y", F)],
    entries: &[
        Entry { name: "gelu_forward", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[Out16, In16]] },
        Entry { name: "gelu_backward", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[Out16, In16]] },
    ],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);
pub(super) const BACKWARD: K = K::of(&MODULE, 1);

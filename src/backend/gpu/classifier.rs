//! The fused classifier on the GPU (kernels/classifier.wgsl): per-row loss and log-sum-exp in
//! the forward, the logits' gradient in place in the backward.

use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K, U32};
use super::{all_bf16, all_f32};
use super::{u, GpuBackend, Groups, Threads};
use crate::backend::ops::{AccumulateMean, ClassifierOps, CrossentropyBackward, CrossentropyForward};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// losses (N) = -log softmax(logits (N, Vp)[:, :V])[targets (N)]; lse (N) kept.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn crossentropy_forward_(
        &mut self,
        losses: Buf,
        lse: Buf,
        logits: Buf,
        targets: Buf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        Self::disjoint("crossentropy_forward", &[losses, lse], &[logits, targets]);
        for r in self.mem.row_pieces(n, &[(losses, 1), (lse, 1), (logits, vp), (targets, 1)]) {
            let rows = r.end - r.start;
            let wins = [
                self.win(losses.slice(r.clone())),
                self.win(lse.slice(r.clone())),
                self.win(logits.slice(r.start * vp..r.end * vp)),
                self.win(targets.slice(r)),
            ];
            let imm = [wins[0].off, wins[1].off, wins[2].off, wins[3].off, u(rows), u(v), u(vp)];
            self.dispatch(CROSSENTROPY_FORWARD.on(logits.dtype == DType::BF16), &wins, &imm, Groups(rows));
        }
    }

    /// In place: logits (N, Vp) become (softmax - onehot) * dloss over the first V columns, 0
    /// over the padding.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn crossentropy_backward_(
        &mut self,
        logits: Buf,
        lse: Buf,
        targets: Buf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        Self::disjoint("crossentropy_backward", &[logits], &[lse, targets]);
        let dummy = self.mem.dummy.clone();
        for r in self.mem.row_pieces(n, &[(logits, vp), (lse, 1), (targets, 1)]) {
            let rows = r.end - r.start;
            let x = self.win(logits.slice(r.start * vp..r.end * vp));
            let s = self.win(lse.slice(r.clone()));
            let t = self.win(targets.slice(r));
            let imm = [x.off, s.off, 0, t.off, u(rows), u(v), u(vp), dloss.to_bits()];
            self.dispatch(
                CROSSENTROPY_BACKWARD.on(logits.dtype == DType::BF16),
                &[x, s, dummy.clone(), t],
                &imm,
                Threads(rows * vp),
            );
        }
    }

    /// acc (1) += weight * mean(x (N)).
    pub(super) fn accumulate_mean_(&mut self, acc: Buf, x: Buf, weight: f32) {
        Self::disjoint("accumulate_mean", &[acc], &[x]);
        let (a, w) = (self.win(acc), self.win(x));
        let imm = [a.off, w.off, 0, 0, u(x.len), 0, 0, weight.to_bits()];
        self.dispatch(ACCUMULATE_MEAN, &[a, w], &imm, Groups(1));
    }
}

impl ClassifierOps for GpuBackend {
    fn crossentropy_forward(&mut self, a: &CrossentropyForward) {
        let (n, v, vp) = (a.n, a.v, a.vp);
        if all_bf16(&[a.logits]) && all_f32(&[a.losses, a.lse]) {
            // The bf16 logits read as they are.
            return self.crossentropy_forward_(a.losses, a.lse, a.logits, a.targets, n, v, vp);
        }
        self.call_in_f32(a, Nearest, |g, a| g.crossentropy_forward_(a.losses, a.lse, a.logits, a.targets, n, v, vp))
    }

    fn crossentropy_backward(&mut self, a: &CrossentropyBackward) {
        let (dloss, n, v, vp) = (a.dloss, a.n, a.v, a.vp);
        if all_bf16(&[a.logits]) && all_f32(&[a.lse]) {
            // The bf16 logits become their bf16 gradient in place.
            return self.crossentropy_backward_(a.logits, a.lse, a.targets, dloss, n, v, vp);
        }
        self.call_in_f32(a, Nearest, |g, a| g.crossentropy_backward_(a.logits, a.lse, a.targets, dloss, n, v, vp))
    }

    fn accumulate_mean(&mut self, a: &AccumulateMean) {
        self.call_in_f32(a, Nearest, |g, a| g.accumulate_mean_(a.acc, a.x, a.weight))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// Cross-entropy and the loss's running mean (kernels/classifier.wgsl).
pub(super) const MODULE: Module = Module {
    name: "classifier",
    src: include_str!("kernels/classifier.wgsl"),
    buffers: &[("x", F), ("y", F), ("z", F), ("targets", U32)],
    entries: &[
        Entry { name: "crossentropy_forward", bindings: 4, u32s: 0b1000, bf16s: 0, variants: &[&[F, F, In16, U32]] },
        Entry { name: "crossentropy_backward", bindings: 4, u32s: 0b1000, bf16s: 0, variants: &[&[Out16, F, F, U32]] },
        Entry { name: "accumulate_mean", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const CROSSENTROPY_FORWARD: K = K::of(&MODULE, 0);
pub(super) const CROSSENTROPY_BACKWARD: K = K::of(&MODULE, 1);
pub(super) const ACCUMULATE_MEAN: K = K::of(&MODULE, 2);

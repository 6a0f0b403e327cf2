//! The fused classifier on the GPU (kernels/classifier.wgsl): per-row loss and log-sum-exp in
//! the forward, the logits' gradient in place in the backward.

use super::{u, GpuBackend, Groups, Threads, K};
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
            self.dispatch(K::CrossentropyForward.on(logits.dtype == DType::BF16), &wins, &imm, Groups(rows));
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
                K::CrossentropyBackward.on(logits.dtype == DType::BF16),
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
        self.dispatch(K::AccumulateMean, &[a, w], &imm, Groups(1));
    }
}

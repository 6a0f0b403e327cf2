//! The loss: cross-entropy over the logits, and the running mean of the losses. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{Call, Ops, Out};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// losses (N) = -log softmax(logits (N, Vp)[:, :V])[targets (N)]; lse (N) = each row's
/// log-sum-exp, kept for backward.
#[derive(Clone, Copy, Debug)]
pub struct CrossentropyForward {
    pub losses: Buf,
    pub lse: Buf,
    pub logits: Buf,
    pub targets: Buf,
    pub n: usize,
    pub v: usize,
    pub vp: usize,
}

impl Call<2, 2> for CrossentropyForward {
    const NAME: &'static str = "crossentropy_forward";
    const KIND: Kind = Kind::Classifier;
    fn roles(&self) -> ([Out; 2], [Buf; 2]) {
        ([W(self.losses), W(self.lse)], [self.logits, self.targets])
    }
    fn on(self, [losses, lse]: [Buf; 2], [logits, targets]: [Buf; 2]) -> Self {
        CrossentropyForward { losses, lse, logits, targets, ..self }
    }
    fn check(&self) {
        assert!(self.v <= self.vp, "crossentropy_forward: V > Vp");
        let n = self.n;
        lens!(Self::NAME; self.losses => n, self.lse => n, self.logits => n * self.vp, self.targets => n);
    }
}

/// In place, logits (N, Vp) (inout) become d(loss)/d(logits) = (softmax - onehot) * dloss over
/// the first V columns, 0 over the padding.
#[derive(Clone, Copy, Debug)]
pub struct CrossentropyBackward {
    pub logits: Buf,
    pub lse: Buf,
    pub targets: Buf,
    pub dloss: f32,
    pub n: usize,
    pub v: usize,
    pub vp: usize,
}

impl Call<1, 2> for CrossentropyBackward {
    const NAME: &'static str = "crossentropy_backward";
    const KIND: Kind = Kind::Classifier;
    fn roles(&self) -> ([Out; 1], [Buf; 2]) {
        ([Rw(self.logits)], [self.lse, self.targets])
    }
    fn on(self, [logits]: [Buf; 1], [lse, targets]: [Buf; 2]) -> Self {
        CrossentropyBackward { logits, lse, targets, ..self }
    }
    fn check(&self) {
        let n = self.n;
        lens!(Self::NAME; self.logits => n * self.vp, self.lse => n, self.targets => n);
    }
}

/// acc (1) (inout) += weight * mean(x (N)), summed in a fixed order.
#[derive(Clone, Copy, Debug)]
pub struct AccumulateMean {
    pub acc: Buf,
    pub x: Buf,
    pub weight: f32,
}

impl Call<1, 1> for AccumulateMean {
    const NAME: &'static str = "accumulate_mean";
    const KIND: Kind = Kind::Classifier;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([Rw(self.acc)], [self.x])
    }
    fn on(self, [acc]: [Buf; 1], [x]: [Buf; 1]) -> Self {
        AccumulateMean { acc, x, ..self }
    }
    fn check(&self) {
        lens!(Self::NAME; self.acc => 1);
    }
}

/// The loss: cross-entropy over the logits, and the running mean of the losses.
pub trait ClassifierOps {
    fn crossentropy_forward(&mut self, a: &CrossentropyForward);
    fn crossentropy_backward(&mut self, a: &CrossentropyBackward);
    fn accumulate_mean(&mut self, a: &AccumulateMean);
}

impl Ops<'_> {
    #[allow(clippy::too_many_arguments)]
    pub fn crossentropy_forward(
        &mut self,
        losses: Buf,
        lse: Buf,
        logits: Buf,
        targets: Buf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        let a = CrossentropyForward { losses, lse, logits, targets, n, v, vp };
        self.call(a, |be, a| be.crossentropy_forward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn crossentropy_backward(
        &mut self,
        logits: Buf,
        lse: Buf,
        targets: Buf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        let a = CrossentropyBackward { logits, lse, targets, dloss, n, v, vp };
        self.call(a, |be, a| be.crossentropy_backward(a));
    }

    pub fn accumulate_mean(&mut self, acc: Buf, x: Buf, weight: f32) {
        self.call(AccumulateMean { acc, x, weight }, |be, a| be.accumulate_mean(a));
    }
}

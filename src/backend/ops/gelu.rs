//! GELU, GPT-2's MLP activation. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{Call, Ops, Out};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// out (N) = gelu(x (N)), tanh approximation.
#[derive(Clone, Copy, Debug)]
pub struct GeluForward {
    pub out: Buf,
    pub x: Buf,
}

impl Call<1, 1> for GeluForward {
    const NAME: &'static str = "gelu_forward";
    const KIND: Kind = Kind::Gelu;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([W(self.out)], [self.x])
    }
    fn on(self, [out]: [Buf; 1], [x]: [Buf; 1]) -> Self {
        GeluForward { out, x }
    }
    fn check(&self) {
        lens!(Self::NAME; self.x => self.out.len);
    }
}

/// Its backward: d (N, inout) *= gelu'(x (N)): d(out) becomes d(x).
#[derive(Clone, Copy, Debug)]
pub struct GeluBackward {
    pub d: Buf,
    pub x: Buf,
}

impl Call<1, 1> for GeluBackward {
    const NAME: &'static str = "gelu_backward";
    const KIND: Kind = Kind::Gelu;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([Rw(self.d)], [self.x])
    }
    fn on(self, [d]: [Buf; 1], [x]: [Buf; 1]) -> Self {
        GeluBackward { d, x }
    }
    fn check(&self) {
        lens!(Self::NAME; self.x => self.d.len);
    }
}

pub trait GeluOps {
    fn gelu_forward(&mut self, a: &GeluForward);
    fn gelu_backward(&mut self, a: &GeluBackward);
}

impl Ops<'_> {
    pub fn gelu_forward(&mut self, out: Buf, x: Buf) {
        self.call(GeluForward { out, x }, |be, a| be.gelu_forward(a));
    }

    pub fn gelu_backward(&mut self, d: Buf, x: Buf) {
        self.call(GeluBackward { d, x }, |be, a| be.gelu_backward(a));
    }
}

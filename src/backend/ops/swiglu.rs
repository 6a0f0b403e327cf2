//! SwiGLU, the Llama-style MLP's activation. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::W;
use super::{Call, Ops, Out, Rows};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// SwiGLU: out (N, F) = up * silu(gate), from x (N, 2F) holding up then gate (`r.c` is F).
#[derive(Clone, Copy, Debug)]
pub struct SwigluForward {
    pub out: Buf,
    pub x: Buf,
    pub r: Rows,
}

impl Call<1, 1> for SwigluForward {
    const NAME: &'static str = "swiglu_forward";
    const KIND: Kind = Kind::Swiglu;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([W(self.out)], [self.x])
    }
    fn on(self, [out]: [Buf; 1], [x]: [Buf; 1]) -> Self {
        SwigluForward { out, x, ..self }
    }
    fn check(&self) {
        let Rows { n, c: f } = self.r;
        lens!(Self::NAME; self.out => n * f, self.x => n * 2 * f);
    }
}

/// Its backward: dx (N, 2F) (out): d(up), d(gate) from dout (N, F).
#[derive(Clone, Copy, Debug)]
pub struct SwigluBackward {
    pub dx: Buf,
    pub dout: Buf,
    pub x: Buf,
    pub r: Rows,
}

impl Call<1, 2> for SwigluBackward {
    const NAME: &'static str = "swiglu_backward";
    const KIND: Kind = Kind::Swiglu;
    fn roles(&self) -> ([Out; 1], [Buf; 2]) {
        ([W(self.dx)], [self.dout, self.x])
    }
    fn on(self, [dx]: [Buf; 1], [dout, x]: [Buf; 2]) -> Self {
        SwigluBackward { dx, dout, x, ..self }
    }
    fn check(&self) {
        let Rows { n, c: f } = self.r;
        lens!(Self::NAME; self.dx => n * 2 * f, self.dout => n * f, self.x => n * 2 * f);
    }
}

pub trait SwigluOps {
    fn swiglu_forward(&mut self, a: &SwigluForward);
    fn swiglu_backward(&mut self, a: &SwigluBackward);
}

impl Ops<'_> {
    pub fn swiglu_forward(&mut self, out: Buf, x: Buf, r: Rows) {
        self.call(SwigluForward { out, x, r }, |be, a| be.swiglu_forward(a));
    }

    pub fn swiglu_backward(&mut self, dx: Buf, dout: Buf, x: Buf, r: Rows) {
        self.call(SwigluBackward { dx, dout, x, r }, |be, a| be.swiglu_backward(a));
    }
}

//! LayerNorm (GPT-2). Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{Call, Ops, Out, Rows};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// LayerNorm: out (N, C) = (x - mean) * rstd * w + b; mean, rstd (N) kept for backward.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormForward {
    pub out: Buf,
    pub mean: Buf,
    pub rstd: Buf,
    pub x: Buf,
    pub w: Buf,
    pub b: Buf,
    pub r: Rows,
}

impl Call<3, 3> for LayerNormForward {
    const NAME: &'static str = "layernorm_forward";
    const KIND: Kind = Kind::LayerNorm;
    fn roles(&self) -> ([Out; 3], [Buf; 3]) {
        ([W(self.out), W(self.mean), W(self.rstd)], [self.x, self.w, self.b])
    }
    fn on(self, [out, mean, rstd]: [Buf; 3], [x, w, b]: [Buf; 3]) -> Self {
        LayerNormForward { out, mean, rstd, x, w, b, ..self }
    }
    fn check(&self) {
        let Rows { n, c } = self.r;
        lens!(Self::NAME; self.out => n * c, self.mean => n, self.rstd => n, self.x => n * c, self.w => c,
              self.b => c);
    }
}

/// Its backward: dx (N, C), dw (C), db (C), all inout, `+=`.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormBackward {
    pub dx: Buf,
    pub dw: Buf,
    pub db: Buf,
    pub dout: Buf,
    pub x: Buf,
    pub w: Buf,
    pub mean: Buf,
    pub rstd: Buf,
    pub r: Rows,
}

impl Call<3, 5> for LayerNormBackward {
    const NAME: &'static str = "layernorm_backward";
    const KIND: Kind = Kind::LayerNorm;
    fn roles(&self) -> ([Out; 3], [Buf; 5]) {
        ([Rw(self.dx), Rw(self.dw), Rw(self.db)], [self.dout, self.x, self.w, self.mean, self.rstd])
    }
    fn on(self, [dx, dw, db]: [Buf; 3], [dout, x, w, mean, rstd]: [Buf; 5]) -> Self {
        LayerNormBackward { dx, dw, db, dout, x, w, mean, rstd, ..self }
    }
    fn check(&self) {
        let Rows { n, c } = self.r;
        lens!(Self::NAME; self.dx => n * c, self.dw => c, self.db => c, self.dout => n * c, self.x => n * c,
              self.w => c, self.mean => n, self.rstd => n);
    }
}

pub trait LayerNormOps {
    fn layernorm_forward(&mut self, a: &LayerNormForward);
    fn layernorm_backward(&mut self, a: &LayerNormBackward);
}

impl Ops<'_> {
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(&mut self, out: Buf, mean: Buf, rstd: Buf, x: Buf, w: Buf, b: Buf, r: Rows) {
        self.call(LayerNormForward { out, mean, rstd, x, w, b, r }, |be, a| be.layernorm_forward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &mut self,
        dx: Buf,
        dw: Buf,
        db: Buf,
        dout: Buf,
        x: Buf,
        w: Buf,
        mean: Buf,
        rstd: Buf,
        r: Rows,
    ) {
        let a = LayerNormBackward { dx, dw, db, dout, x, w, mean, rstd, r };
        self.call(a, |be, a| be.layernorm_backward(a));
    }
}

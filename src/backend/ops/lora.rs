//! A LoRA adapter's term on a projection (run by the projection's own matmul call). Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{back, opt, Call, Out};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// The shape of one LoRA adapter's op ([`crate::model::lora`]): N rows of C inputs into a
/// projection of OC outputs, of which the adapter of rank R adds to rows row0..row0+ROWS (all
/// of them but for one of a fused projection's parts), scaled by `scale` (alpha / R).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraShape {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
    pub r: usize,
    pub row0: usize,
    pub rows: usize,
    pub scale: f32,
}

/// A LoRA adapter's term (see [`LoraShape`]): h (N, R) = scale * x (N, C) @ a (R, C)^T, and
/// out[:, row0..row0+ROWS] (N, OC) += h @ b (ROWS, R)^T (inout). h is the pass's: the
/// backward reads it when the pass is over the training activations.
#[derive(Clone, Copy, Debug)]
pub struct LoraForward {
    pub out: Buf,
    pub h: Buf,
    pub x: Buf,
    pub a: Buf,
    pub b: Buf,
    pub s: LoraShape,
}

impl Call<2, 3> for LoraForward {
    const NAME: &'static str = "lora_forward";
    const KIND: Kind = Kind::Lora;
    fn roles(&self) -> ([Out; 2], [Buf; 3]) {
        ([Rw(self.out), W(self.h)], [self.x, self.a, self.b])
    }
    fn on(self, [out, h]: [Buf; 2], [x, a, b]: [Buf; 3]) -> Self {
        LoraForward { out, h, x, a, b, ..self }
    }
    fn check(&self) {
        let s = self.s;
        assert!(s.row0 + s.rows <= s.oc, "a LoRA adapter on rows {}..{} of {}", s.row0, s.row0 + s.rows, s.oc);
        lens!(Self::NAME; self.out => s.n * s.oc, self.h => s.n * s.r, self.x => s.n * s.c, self.a => s.r * s.c,
              self.b => s.rows * s.r);
    }
}

/// Its backward, from the forward's h (in): with g = dout[:, row0..row0+ROWS]: db (ROWS, R)
/// += g^T @ h, dh (N, R) = scale * g @ b (out: the backward's own), da (R, C) += dh^T @ x, dx (N, C) += dh @ a
/// (inout, when given).
#[derive(Clone, Copy, Debug)]
pub struct LoraBackward {
    pub dx: Option<Buf>,
    pub da: Buf,
    pub db: Buf,
    pub dh: Buf,
    pub dout: Buf,
    pub x: Buf,
    pub a: Buf,
    pub b: Buf,
    pub h: Buf,
    pub s: LoraShape,
}

impl Call<4, 5> for LoraBackward {
    const NAME: &'static str = "lora_backward";
    const KIND: Kind = Kind::Lora;
    fn roles(&self) -> ([Out; 4], [Buf; 5]) {
        ([Rw(opt(self.dx)), Rw(self.da), Rw(self.db), W(self.dh)], [self.dout, self.x, self.a, self.b, self.h])
    }
    fn on(self, [dx, da, db, dh]: [Buf; 4], [dout, x, a, b, h]: [Buf; 5]) -> Self {
        LoraBackward { dx: back(self.dx, dx), da, db, dh, dout, x, a, b, h, ..self }
    }
    fn check(&self) {
        let s = self.s;
        lens!(Self::NAME; self.da => s.r * s.c, self.db => s.rows * s.r, self.dh => s.n * s.r,
              self.dout => s.n * s.oc, self.x => s.n * s.c, self.a => s.r * s.c, self.b => s.rows * s.r,
              self.h => s.n * s.r);
        if let Some(d) = self.dx {
            lens!(Self::NAME; d => s.n * s.c);
        }
    }
}

pub trait LoraOps {
    fn lora_forward(&mut self, a: &LoraForward);
    fn lora_backward(&mut self, a: &LoraBackward);
}

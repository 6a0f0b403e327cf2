//! Conversions between f32 and bf16 buffers. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::W;
use super::{Call, Ops, Out};
use crate::backend::{Buf, Noise};
use crate::core::profile::Kind;

/// dst (N) (out) = src (N) converted to dst's dtype: into bf16 rounded to nearest even, or
/// stochastically with `noise` (llm.c's bf16 parameters written from the fp32 master weights).
/// With `consuming`, src is about to be freed (its elements are undefined afterwards): the
/// device may hand its memory back as it goes (the CPU does, piece by piece, so that turning a
/// model's f32 weights into bf16 peaks at about the f32 copy, not at both).
#[derive(Clone, Copy, Debug)]
pub struct Convert {
    pub dst: Buf,
    pub src: Buf,
    pub noise: Option<Noise>,
    pub consuming: bool,
}

impl Call<1, 1> for Convert {
    const NAME: &'static str = "convert";
    const KIND: Kind = Kind::Optimizer;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([W(self.dst)], [self.src])
    }
    fn on(self, [dst]: [Buf; 1], [src]: [Buf; 1]) -> Self {
        Convert { dst, src, ..self }
    }
    fn check(&self) {
        lens!(Self::NAME; self.dst => self.src.len);
    }
}

/// Conversions between f32 and bf16 buffers.
pub trait ConvertOps {
    fn convert(&mut self, a: &Convert);
}

impl Ops<'_> {
    /// dst (N) = src (N) in dst's dtype (see [`Convert`]).
    pub fn convert(&mut self, dst: Buf, src: Buf, noise: Option<Noise>) {
        self.call(Convert { dst, src, noise, consuming: false }, |be, a| be.convert(a));
    }

    /// [`Ops::convert`] to nearest of a src about to be freed.
    pub fn convert_consuming(&mut self, dst: Buf, src: Buf) {
        self.call(Convert { dst, src, noise: None, consuming: true }, |be, a| be.convert(a));
    }
}

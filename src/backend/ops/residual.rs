//! The residual add. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::W;
use super::{Call, Ops, Out};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// out (N) = a (N) + b (N). Its backward is the identity: there is no residual backward.
#[derive(Clone, Copy, Debug)]
pub struct Residual {
    pub out: Buf,
    pub a: Buf,
    pub b: Buf,
}

impl Call<1, 2> for Residual {
    const NAME: &'static str = "residual_forward";
    const KIND: Kind = Kind::Residual;
    fn roles(&self) -> ([Out; 1], [Buf; 2]) {
        ([W(self.out)], [self.a, self.b])
    }
    fn on(self, [out]: [Buf; 1], [a, b]: [Buf; 2]) -> Self {
        Residual { out, a, b }
    }
    fn check(&self) {
        lens!(Self::NAME; self.a => self.out.len, self.b => self.out.len);
    }
}

pub trait ResidualOps {
    fn residual_forward(&mut self, a: &Residual);
}

impl Ops<'_> {
    pub fn residual_forward(&mut self, out: Buf, a: Buf, b: Buf) {
        self.call(Residual { out, a, b }, |be, a| be.residual_forward(a));
    }
}

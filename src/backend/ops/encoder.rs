//! The token (and GPT-2's position) embedding. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{back, opt, Call, Ops, Out, Seq};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// out (B, T, C) = wte (Vp, C)[ids (B, T)] [+ wpe (T, C)[t], the rows of the positions].
/// Ids must be < V.
#[derive(Clone, Copy, Debug)]
pub struct EncoderForward {
    pub out: Buf,
    pub ids: Buf,
    pub wte: Buf,
    pub wpe: Option<Buf>,
    pub s: Seq,
    pub c: usize,
}

impl Call<1, 3> for EncoderForward {
    const NAME: &'static str = "encoder_forward";
    const KIND: Kind = Kind::Encoder;
    fn roles(&self) -> ([Out; 1], [Buf; 3]) {
        ([W(self.out)], [self.ids, self.wte, opt(self.wpe)])
    }
    fn on(self, [out]: [Buf; 1], [ids, wte, wpe]: [Buf; 3]) -> Self {
        EncoderForward { out, ids, wte, wpe: back(self.wpe, wpe), ..self }
    }
    fn check(&self) {
        let (n, c) = (self.s.n(), self.c);
        lens!(Self::NAME; self.out => n * c, self.ids => n);
        assert!(self.wte.len.is_multiple_of(c) && self.wpe.is_none_or(|p| p.len == self.s.t * c), "encoder: tables");
    }
}

/// dwte (Vp, C) [and dwpe (T, C)] (inout) += the scatter of dout (B, T, C) by token [and
/// position].
#[derive(Clone, Copy, Debug)]
pub struct EncoderBackward {
    pub dwte: Buf,
    pub dwpe: Option<Buf>,
    pub dout: Buf,
    pub ids: Buf,
    pub s: Seq,
    pub c: usize,
}

impl Call<2, 2> for EncoderBackward {
    const NAME: &'static str = "encoder_backward";
    const KIND: Kind = Kind::Encoder;
    fn roles(&self) -> ([Out; 2], [Buf; 2]) {
        ([Rw(self.dwte), Rw(opt(self.dwpe))], [self.dout, self.ids])
    }
    fn on(self, [dwte, dwpe]: [Buf; 2], [dout, ids]: [Buf; 2]) -> Self {
        EncoderBackward { dwte, dwpe: back(self.dwpe, dwpe), dout, ids, ..self }
    }
    fn check(&self) {
        let (n, c) = (self.s.n(), self.c);
        lens!(Self::NAME; self.dout => n * c, self.ids => n);
        let tables = self.dwte.len.is_multiple_of(c) && self.dwpe.is_none_or(|p| p.len == self.s.t * c);
        assert!(tables, "encoder_backward: tables");
    }
}

/// The token and position embedding.
pub trait EncoderOps {
    fn encoder_forward(&mut self, a: &EncoderForward);
    fn encoder_backward(&mut self, a: &EncoderBackward);
}

impl Ops<'_> {
    pub fn encoder_forward(&mut self, out: Buf, ids: Buf, wte: Buf, wpe: Option<Buf>, s: Seq, c: usize) {
        self.call(EncoderForward { out, ids, wte, wpe, s, c }, |be, a| be.encoder_forward(a));
    }

    pub fn encoder_backward(&mut self, dwte: Buf, dwpe: Option<Buf>, dout: Buf, ids: Buf, s: Seq, c: usize) {
        self.call(EncoderBackward { dwte, dwpe, dout, ids, s, c }, |be, a| be.encoder_backward(a));
    }
}

//! The rotary position embedding (Llama-style models). Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::Rw;
use super::{Call, Heads, Ops, Out};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// The rotary embedding, in place on the q and k heads of qkv (N, QKV) (N = B*T rows; row r
/// sits at position pos + r % T): within each head, element i and i + HS/2 rotate by the angle
/// of pair i (transformers' `rotate_half` layout); `inverse` rotates back (its backward, on
/// d(qkv)). table (maxT, HS) holds each position's cosines (HS/2) then sines (HS/2).
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub qkv: Buf,
    pub table: Buf,
    pub n: usize,
    pub t: usize,
    pub pos: usize,
    pub h: Heads,
    pub inverse: bool,
}

impl Call<1, 1> for Rope {
    const NAME: &'static str = "rope";
    const KIND: Kind = Kind::Rope;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([Rw(self.qkv)], [self.table])
    }
    fn on(self, [qkv]: [Buf; 1], [table]: [Buf; 1]) -> Self {
        Rope { qkv, table, ..self }
    }
    fn check(&self) {
        lens!(Self::NAME; self.qkv => self.n * self.h.qkv());
        let (t, pos) = (self.t, self.pos);
        let fits = t > 0 && self.n.is_multiple_of(t) && self.table.len >= (pos + t) * self.h.hs;
        assert!(fits, "rope: positions past the table");
    }
}

pub trait RopeOps {
    fn rope(&mut self, a: &Rope);
}

impl Ops<'_> {
    /// The rotary embedding in place on qkv (N, QKV), row r at position pos + r % t.
    pub fn rope_forward(&mut self, qkv: Buf, table: Buf, n: usize, t: usize, pos: usize, h: Heads) {
        self.call(Rope { qkv, table, n, t, pos, h, inverse: false }, |be, a| be.rope(a));
    }

    /// Its backward, in place on dqkv (N, QKV).
    pub fn rope_backward(&mut self, dqkv: Buf, table: Buf, n: usize, t: usize, pos: usize, h: Heads) {
        self.call(Rope { qkv: dqkv, table, n, t, pos, h, inverse: true }, |be, a| be.rope(a));
    }
}

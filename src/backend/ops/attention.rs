//! Causal self-attention, over whole sequences or new positions against a KV cache. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, Scratch, W};
use super::{Call, Heads, Ops, Out, Seq};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// Causal self-attention over B sequences of T: out (B, T, QD) and each query row's softmax
/// statistics stats (B, NH, T, 2) (max(scale * scores), 1 / sum of exps, from which the
/// backward rebuilds the probabilities: no (B, NH, T, T) matrix is kept, flash attention's
/// scheme) from qkv (B, T, QKV): the NH query heads, then the KV key heads, then the value
/// heads, query head h reading key and value head h / (NH / KV) (grouped-query attention).
/// ws (B, T, QD): scratch.
#[derive(Clone, Copy, Debug)]
pub struct AttentionForward {
    pub out: Buf,
    pub stats: Buf,
    pub ws: Buf,
    pub qkv: Buf,
    pub s: Seq,
    pub h: Heads,
}

impl Call<3, 1> for AttentionForward {
    const NAME: &'static str = "attention_forward";
    const KIND: Kind = Kind::Attention;
    fn roles(&self) -> ([Out; 3], [Buf; 1]) {
        ([W(self.out), W(self.stats), Scratch(self.ws)], [self.qkv])
    }
    fn on(self, [out, stats, ws]: [Buf; 3], [qkv]: [Buf; 1]) -> Self {
        AttentionForward { out, stats, ws, qkv, ..self }
    }
    fn check(&self) {
        let (n, h) = (self.s.n(), self.h);
        assert!(h.nkv > 0 && h.nh.is_multiple_of(h.nkv), "attention: {} heads, {} kv heads", h.nh, h.nkv);
        lens!(Self::NAME; self.out => n * h.q(), self.stats => n * h.nh * 2, self.ws => n * h.q(),
              self.qkv => n * h.qkv());
    }
}

/// Its backward: dqkv (B, T, QKV) (out) from dout (B, T, QD), qkv and the forward's stats, the
/// probabilities rebuilt as it goes; a key or value head's gradient sums over its query heads
/// in order. ws (B, T, 3 QD): scratch.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBackward {
    pub dqkv: Buf,
    pub ws: Buf,
    pub dout: Buf,
    pub qkv: Buf,
    pub stats: Buf,
    pub s: Seq,
    pub h: Heads,
}

impl Call<2, 3> for AttentionBackward {
    const NAME: &'static str = "attention_backward";
    const KIND: Kind = Kind::Attention;
    fn roles(&self) -> ([Out; 2], [Buf; 3]) {
        ([W(self.dqkv), Scratch(self.ws)], [self.dout, self.qkv, self.stats])
    }
    fn on(self, [dqkv, ws]: [Buf; 2], [dout, qkv, stats]: [Buf; 3]) -> Self {
        AttentionBackward { dqkv, ws, dout, qkv, stats, ..self }
    }
    fn check(&self) {
        let (n, h) = (self.s.n(), self.h);
        assert!(h.nkv > 0 && h.nh.is_multiple_of(h.nkv), "attention: {} heads, {} kv heads", h.nh, h.nkv);
        lens!(Self::NAME; self.dqkv => n * h.qkv(), self.ws => n * 3 * h.q(), self.dout => n * h.q(),
              self.qkv => n * h.qkv(), self.stats => n * h.nh * 2);
    }
}

/// Attention of `tn` new positions of one sequence against a KV cache of `cap` positions
/// holding `pos`: the new keys and values (in qkv (TN, QKV)) go to rows pos..pos+tn of k and v
/// (cap, KV*HS), then out (TN, QD) = attention of each new position over cache rows 0..=its
/// own. ws (TN, QD): scratch. The call's roles hold only the cache rows it reads and writes
/// (0..pos+tn: the rest is not written yet).
#[derive(Clone, Copy, Debug)]
pub struct AttentionCached {
    pub out: Buf,
    pub ws: Buf,
    pub qkv: Buf,
    pub k: Buf,
    pub v: Buf,
    pub pos: usize,
    pub tn: usize,
    pub cap: usize,
    pub h: Heads,
}

impl AttentionCached {
    /// The elements of each cache that hold positions 0..pos+tn.
    fn held(&self) -> usize {
        ((self.pos + self.tn) * self.h.kv()).min(self.k.len).min(self.v.len)
    }
}

impl Call<4, 1> for AttentionCached {
    const NAME: &'static str = "attention_forward_cached";
    const KIND: Kind = Kind::Attention;
    fn roles(&self) -> ([Out; 4], [Buf; 1]) {
        let held = self.held();
        ([W(self.out), Scratch(self.ws), Rw(self.k.prefix(held)), Rw(self.v.prefix(held))], [self.qkv])
    }
    fn on(self, [out, ws, k, v]: [Buf; 4], [qkv]: [Buf; 1]) -> Self {
        AttentionCached { out, ws, qkv, k, v, ..self }
    }
    fn check(&self) {
        let h = self.h;
        assert!(self.tn > 0 && self.pos + self.tn <= self.cap, "attention_forward_cached: positions past the cache");
        assert!(h.nkv > 0 && h.nh.is_multiple_of(h.nkv), "attention: {} heads, {} kv heads", h.nh, h.nkv);
        lens!(Self::NAME; self.out => self.tn * h.q(), self.ws => self.tn * h.q(), self.qkv => self.tn * h.qkv(),
              self.k => self.cap * h.kv(), self.v => self.cap * h.kv());
    }
}

pub trait AttentionOps {
    fn attention_forward(&mut self, a: &AttentionForward);
    fn attention_backward(&mut self, a: &AttentionBackward);
    fn attention_forward_cached(&mut self, a: &AttentionCached);
}

impl Ops<'_> {
    pub fn attention_forward(&mut self, out: Buf, stats: Buf, ws: Buf, qkv: Buf, s: Seq, h: Heads) {
        self.call(AttentionForward { out, stats, ws, qkv, s, h }, |be, a| be.attention_forward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(&mut self, dqkv: Buf, ws: Buf, dout: Buf, qkv: Buf, stats: Buf, s: Seq, h: Heads) {
        self.call(AttentionBackward { dqkv, ws, dout, qkv, stats, s, h }, |be, a| be.attention_backward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_cached(
        &mut self,
        out: Buf,
        ws: Buf,
        qkv: Buf,
        k: Buf,
        v: Buf,
        pos: usize,
        tn: usize,
        cap: usize,
        h: Heads,
    ) {
        let a = AttentionCached { out, ws, qkv, k, v, pos, tn, cap, h };
        self.call(a, |be, a| be.attention_forward_cached(a));
    }
}

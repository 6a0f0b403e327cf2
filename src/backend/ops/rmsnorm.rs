//! RMSNorm, and its form on each attention head (Qwen3). Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{Call, Heads, Ops, Out, Rows};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// RMSNorm: out (N, C) = x * rstd * w, rstd (N) = 1 / sqrt(mean(x^2) + eps), kept.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormForward {
    pub out: Buf,
    pub rstd: Buf,
    pub x: Buf,
    pub w: Buf,
    pub r: Rows,
    pub eps: f32,
}

impl Call<2, 2> for RmsNormForward {
    const NAME: &'static str = "rmsnorm_forward";
    const KIND: Kind = Kind::RmsNorm;
    fn roles(&self) -> ([Out; 2], [Buf; 2]) {
        ([W(self.out), W(self.rstd)], [self.x, self.w])
    }
    fn on(self, [out, rstd]: [Buf; 2], [x, w]: [Buf; 2]) -> Self {
        RmsNormForward { out, rstd, x, w, ..self }
    }
    fn check(&self) {
        let Rows { n, c } = self.r;
        lens!(Self::NAME; self.out => n * c, self.rstd => n, self.x => n * c, self.w => c);
    }
}

/// Its backward: dx (N, C) and dw (C), both inout, `+=`.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormBackward {
    pub dx: Buf,
    pub dw: Buf,
    pub dout: Buf,
    pub x: Buf,
    pub w: Buf,
    pub rstd: Buf,
    pub r: Rows,
}

impl Call<2, 4> for RmsNormBackward {
    const NAME: &'static str = "rmsnorm_backward";
    const KIND: Kind = Kind::RmsNorm;
    fn roles(&self) -> ([Out; 2], [Buf; 4]) {
        ([Rw(self.dx), Rw(self.dw)], [self.dout, self.x, self.w, self.rstd])
    }
    fn on(self, [dx, dw]: [Buf; 2], [dout, x, w, rstd]: [Buf; 4]) -> Self {
        RmsNormBackward { dx, dw, dout, x, w, rstd, ..self }
    }
    fn check(&self) {
        let Rows { n, c } = self.r;
        lens!(Self::NAME; self.dx => n * c, self.dw => c, self.dout => n * c, self.x => n * c, self.w => c,
              self.rstd => n);
    }
}

/// Qwen3's RMSNorm of each query head (weight wq (HS)) and key head (wk (HS)) of x (N, QKV)
/// into out (N, QKV); the value heads copied; rstd (N, NH + KV) kept for backward.
#[derive(Clone, Copy, Debug)]
pub struct HeadNormForward {
    pub out: Buf,
    pub rstd: Buf,
    pub x: Buf,
    pub wq: Buf,
    pub wk: Buf,
    pub n: usize,
    pub h: Heads,
    pub eps: f32,
}

impl Call<2, 3> for HeadNormForward {
    const NAME: &'static str = "head_norm_forward";
    const KIND: Kind = Kind::RmsNorm;
    fn roles(&self) -> ([Out; 2], [Buf; 3]) {
        ([W(self.out), W(self.rstd)], [self.x, self.wq, self.wk])
    }
    fn on(self, [out, rstd]: [Buf; 2], [x, wq, wk]: [Buf; 3]) -> Self {
        HeadNormForward { out, rstd, x, wq, wk, ..self }
    }
    fn check(&self) {
        let (n, h) = (self.n, self.h);
        lens!(Self::NAME; self.out => n * h.qkv(), self.rstd => n * (h.nh + h.nkv), self.x => n * h.qkv(),
              self.wq => h.hs, self.wk => h.hs);
    }
}

/// Its backward: dx (N, QKV) (out) from dout; dwq, dwk (HS) `+=`.
#[derive(Clone, Copy, Debug)]
pub struct HeadNormBackward {
    pub dx: Buf,
    pub dwq: Buf,
    pub dwk: Buf,
    pub dout: Buf,
    pub x: Buf,
    pub wq: Buf,
    pub wk: Buf,
    pub rstd: Buf,
    pub n: usize,
    pub h: Heads,
}

impl Call<3, 5> for HeadNormBackward {
    const NAME: &'static str = "head_norm_backward";
    const KIND: Kind = Kind::RmsNorm;
    fn roles(&self) -> ([Out; 3], [Buf; 5]) {
        ([W(self.dx), Rw(self.dwq), Rw(self.dwk)], [self.dout, self.x, self.wq, self.wk, self.rstd])
    }
    fn on(self, [dx, dwq, dwk]: [Buf; 3], [dout, x, wq, wk, rstd]: [Buf; 5]) -> Self {
        HeadNormBackward { dx, dwq, dwk, dout, x, wq, wk, rstd, ..self }
    }
    fn check(&self) {
        let (n, h) = (self.n, self.h);
        lens!(Self::NAME; self.dx => n * h.qkv(), self.dwq => h.hs, self.dwk => h.hs, self.dout => n * h.qkv(),
              self.x => n * h.qkv(), self.wq => h.hs, self.wk => h.hs, self.rstd => n * (h.nh + h.nkv));
    }
}

/// RMSNorm, and its form on each attention head (Qwen3's q_norm, k_norm).
pub trait RmsNormOps {
    fn rmsnorm_forward(&mut self, a: &RmsNormForward);
    fn rmsnorm_backward(&mut self, a: &RmsNormBackward);
    fn head_norm_forward(&mut self, a: &HeadNormForward);
    fn head_norm_backward(&mut self, a: &HeadNormBackward);
}

impl Ops<'_> {
    pub fn rmsnorm_forward(&mut self, out: Buf, rstd: Buf, x: Buf, w: Buf, r: Rows, eps: f32) {
        self.call(RmsNormForward { out, rstd, x, w, r, eps }, |be, a| be.rmsnorm_forward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(&mut self, dx: Buf, dw: Buf, dout: Buf, x: Buf, w: Buf, rstd: Buf, r: Rows) {
        self.call(RmsNormBackward { dx, dw, dout, x, w, rstd, r }, |be, a| be.rmsnorm_backward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn head_norm_forward(&mut self, out: Buf, rstd: Buf, x: Buf, wq: Buf, wk: Buf, n: usize, h: Heads, eps: f32) {
        self.call(HeadNormForward { out, rstd, x, wq, wk, n, h, eps }, |be, a| be.head_norm_forward(a));
    }

    #[allow(clippy::too_many_arguments)]
    pub fn head_norm_backward(
        &mut self,
        dx: Buf,
        dwq: Buf,
        dwk: Buf,
        dout: Buf,
        x: Buf,
        wq: Buf,
        wk: Buf,
        rstd: Buf,
        n: usize,
        h: Heads,
    ) {
        let a = HeadNormBackward { dx, dwq, dwk, dout, x, wq, wk, rstd, n, h };
        self.call(a, |be, a| be.head_norm_backward(a));
    }
}

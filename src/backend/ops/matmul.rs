//! The projections: a GEMM with an optional bias, and the LoRA adapters on the weights they adapt. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{back, opt, Adapter, Call, LoraBackward, LoraForward, LoraShape, Mat, Ops, Out, FROZEN};
use crate::backend::Buf;
use crate::core::profile::Kind;

/// out (N, OC) = x (N, C) @ w (OC, C)^T [+ bias (OC)].
#[derive(Clone, Copy, Debug)]
pub struct MatmulForward {
    pub out: Buf,
    pub x: Buf,
    pub w: Buf,
    pub bias: Option<Buf>,
    pub m: Mat,
}

impl Call<1, 3> for MatmulForward {
    const NAME: &'static str = "matmul_forward";
    const KIND: Kind = Kind::Matmul;
    fn roles(&self) -> ([Out; 1], [Buf; 3]) {
        ([W(self.out)], [self.x, self.w, opt(self.bias)])
    }
    fn on(self, [out]: [Buf; 1], [x, w, bias]: [Buf; 3]) -> Self {
        MatmulForward { out, x, w, bias: back(self.bias, bias), ..self }
    }
    fn check(&self) {
        let Mat { n, c, oc } = self.m;
        lens!(Self::NAME; self.out => n * oc, self.x => n * c, self.w => oc * c);
        if let Some(b) = self.bias {
            lens!(Self::NAME; b => oc);
        }
    }
}

/// Its backward: dx (N, C) (out) = dout @ w; dw (OC, C) = dout^T @ x and db (OC) = the column
/// sums of dout (N, OC), added to (inout) when `acc`, else overwritten (out). Each is computed
/// only when given (no dw: a frozen weight's gradient, LoRA's base).
#[derive(Clone, Copy, Debug)]
pub struct MatmulBackward {
    pub dx: Option<Buf>,
    pub dw: Option<Buf>,
    pub db: Option<Buf>,
    pub dout: Buf,
    pub x: Buf,
    pub w: Buf,
    pub m: Mat,
    pub acc: bool,
}

impl Call<3, 3> for MatmulBackward {
    const NAME: &'static str = "matmul_backward";
    const KIND: Kind = Kind::Matmul;
    fn roles(&self) -> ([Out; 3], [Buf; 3]) {
        let grad = |b: Option<Buf>| if self.acc { Rw(opt(b)) } else { W(opt(b)) };
        ([W(opt(self.dx)), grad(self.dw), grad(self.db)], [self.dout, self.x, self.w])
    }
    fn on(self, [dx, dw, db]: [Buf; 3], [dout, x, w]: [Buf; 3]) -> Self {
        let (dx, dw, db) = (back(self.dx, dx), back(self.dw, dw), back(self.db, db));
        MatmulBackward { dx, dw, db, dout, x, w, ..self }
    }
    fn check(&self) {
        let Mat { n, c, oc } = self.m;
        lens!(Self::NAME; self.dout => n * oc, self.x => n * c, self.w => oc * c);
        for (d, len) in [(self.dx, n * c), (self.dw, oc * c), (self.db, oc)] {
            if let Some(d) = d {
                lens!(Self::NAME; d => len);
            }
        }
    }
}

pub trait MatmulOps {
    fn matmul_forward(&mut self, a: &MatmulForward);
    fn matmul_backward(&mut self, a: &MatmulBackward);
}

impl Ops<'_> {
    /// out (N, OC) = x (N, C) @ w (OC, C)^T [+ bias (OC)], plus the terms of the LoRA adapters
    /// on w.
    pub fn matmul_forward(&mut self, out: Buf, x: Buf, w: Buf, bias: Option<Buf>, m: Mat) {
        self.call(MatmulForward { out, x, w, bias, m }, |be, a| be.matmul_forward(a));
        for ad in self.adapters(w) {
            let (s, shared) = self.lora_shape(&ad, m);
            // Kept for the backward when the pass is over the training activations.
            let h = ad.kept_h.filter(|k| k.len >= m.n * ad.r).map_or(shared, |k| k.prefix(m.n * ad.r));
            self.call(LoraForward { out, h, x, a: ad.a, b: ad.b, s }, |be, a| be.lora_forward(a));
        }
    }

    /// dx (N, C) (out) = dout @ w; dw (OC, C) = dout^T @ x and db (OC) = the column sums of dout
    /// (N, OC), added to when `acc`, else overwritten; dw [`FROZEN`]: no weight gradient. The
    /// LoRA adapters on w add their terms to dx and to their gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &mut self,
        dx: Option<Buf>,
        dw: Buf,
        db: Option<Buf>,
        dout: Buf,
        x: Buf,
        w: Buf,
        m: Mat,
        acc: bool,
    ) {
        let dw = (dw != FROZEN).then_some(dw);
        if dx.is_some() || dw.is_some() || db.is_some() {
            self.call(MatmulBackward { dx, dw, db, dout, x, w, m, acc }, |be, a| be.matmul_backward(a));
        }
        for ad in self.adapters(w) {
            let Some((da, dbl)) = ad.grads else { panic!("matmul_backward: a LoRA adapter without gradients") };
            let (s, _) = self.lora_shape(&ad, m);
            let h =
                ad.kept_h.filter(|k| k.len >= m.n * ad.r).expect("matmul_backward: a LoRA adapter without its kept h");
            let (h, dh) = (h.prefix(m.n * ad.r), self.lora.expect("adapters").dh.prefix(m.n * ad.r));
            let a = LoraBackward { dx, da, db: dbl, dh, dout, x, a: ad.a, b: ad.b, h, s };
            self.call(a, |be, a| be.lora_backward(a));
        }
    }

    /// The op shape of adapter `ad` on the projection `m`, and its (N, R) workspace.
    fn lora_shape(&self, ad: &Adapter, m: Mat) -> (LoraShape, Buf) {
        let Mat { n, c, oc } = m;
        let s = LoraShape { n, c, oc, r: ad.r, row0: ad.row0, rows: ad.rows, scale: ad.scale };
        (s, self.lora.expect("adapters").h.prefix(n * ad.r))
    }
}

//! The update: the gradients' global norm, and AdamW. Its calls, the trait a device implements for them, and its ops in the
//! checked front ([`super::Ops`]).

use super::Out::{Rw, W};
use super::{back, opt, Call, Ops, Out};
use crate::backend::{AdamWParams, Buf, DType};
use crate::core::profile::Kind;

/// out (1) = the sum of squares of grads (N), in a fixed order; with `accumulate`, out (inout)
/// += it (a norm over several slices: a ZeRO shard).
#[derive(Clone, Copy, Debug)]
pub struct GlobalNormSquared {
    pub out: Buf,
    pub grads: Buf,
    pub accumulate: bool,
}

impl Call<1, 1> for GlobalNormSquared {
    const NAME: &'static str = "global_norm_squared";
    const KIND: Kind = Kind::Optimizer;
    fn roles(&self) -> ([Out; 1], [Buf; 1]) {
        ([if self.accumulate { Rw(self.out) } else { W(self.out) }], [self.grads])
    }
    fn on(self, [out]: [Buf; 1], [grads]: [Buf; 1]) -> Self {
        GlobalNormSquared { out, grads, ..self }
    }
    fn check(&self) {
        lens!(Self::NAME; self.out => 1);
    }
}

/// One AdamW step on one tensor: params, m, v (N) (inout) from grads (N). `stats` (2) holds
/// the step's [mean loss, squared global gradient norm]: the gradients are scaled by grad_clip
/// / norm when the norm exceeds a non-zero grad_clip, and nothing is updated when `h.skip`
/// skips the step ([`super::SkipAbove::skips`]: a value not finite or above its limit), so a
/// diverged or outlier step leaves the model as it was. With `work` (N, bf16), f32 master
/// weights' working copy is written in the same pass, rounded stochastically with `h.seed` as
/// [`ConvertOps::convert`] rounds (llm.c's bf16 AdamW; left as it was on a skipped step).
#[derive(Clone, Copy, Debug)]
pub struct AdamwUpdate {
    pub params: Buf,
    pub work: Option<Buf>,
    pub grads: Buf,
    pub m: Buf,
    pub v: Buf,
    pub stats: Buf,
    pub h: AdamWParams,
}

impl Call<4, 2> for AdamwUpdate {
    const NAME: &'static str = "adamw_update";
    const KIND: Kind = Kind::Optimizer;
    fn roles(&self) -> ([Out; 4], [Buf; 2]) {
        ([Rw(self.params), Rw(self.m), Rw(self.v), Rw(opt(self.work))], [self.grads, self.stats])
    }
    fn on(self, [params, m, v, work]: [Buf; 4], [grads, stats]: [Buf; 2]) -> Self {
        AdamwUpdate { params, work: back(self.work, work), grads, m, v, stats, ..self }
    }
    fn check(&self) {
        let n = self.params.len;
        lens!(Self::NAME; self.grads => n, self.m => n, self.v => n, self.stats => 2);
        if let Some(w) = self.work {
            lens!(Self::NAME; w => n);
            assert!(self.params.dtype == DType::F32 && w.dtype == DType::BF16, "adamw_update: a working copy of f32");
        }
    }
}

/// The update: the gradients' global norm, and AdamW.
pub trait AdamwOps {
    fn global_norm_squared(&mut self, a: &GlobalNormSquared);
    fn adamw_update(&mut self, a: &AdamwUpdate);
}

impl Ops<'_> {
    pub fn global_norm_squared(&mut self, out: Buf, grads: Buf, accumulate: bool) {
        self.call(GlobalNormSquared { out, grads, accumulate }, |be, a| be.global_norm_squared(a));
    }

    /// One AdamW step on one tensor (see [`AdamwUpdate`]).
    pub fn adamw_update(&mut self, params: Buf, grads: Buf, m: Buf, v: Buf, stats: Buf, h: &AdamWParams) {
        let a = AdamwUpdate { params, work: None, grads, m, v, stats, h: *h };
        self.call(a, |be, a| be.adamw_update(a));
    }

    /// One AdamW step that also writes the bf16 working copy of f32 master weights.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update_and_copy(
        &mut self,
        params: Buf,
        work: Buf,
        grads: Buf,
        m: Buf,
        v: Buf,
        stats: Buf,
        h: &AdamWParams,
    ) {
        let a = AdamwUpdate { params, work: Some(work), grads, m, v, stats, h: *h };
        self.call(a, |be, a| be.adamw_update(a));
    }
}

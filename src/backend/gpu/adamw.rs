//! AdamW and the global gradient norm on the GPU (kernels/adamw.wgsl).

use super::bf16::limit;
use super::bf16::Rounding::{Nearest, Stochastic};
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{all_bf16, all_f32};
use super::{u, GpuBackend, Groups, Threads};
use crate::backend::ops::Call;
use crate::backend::ops::{AdamwOps, AdamwUpdate, GlobalNormSquared};
use crate::backend::{AdamWParams, Buf, DType};

/// Elements per partial sum of the norm (kernels/adamw.wgsl: CHUNK).
const SQ_CHUNK: usize = 4096;

impl GpuBackend {
    /// out (1) [+]= the sum of squares of grads (N): partial sums of fixed pieces, then their
    /// sum, both in a fixed order.
    pub(super) fn global_norm_squared_(&mut self, out: Buf, grads: Buf, accumulate: bool) {
        Self::disjoint("global_norm_squared", &[out], &[grads]);
        let pieces = self.mem.pieces(&[grads], grads.len);
        let total: usize = pieces.iter().map(|r| (r.end - r.start).div_ceil(SQ_CHUNK)).sum();
        let Some(partials) = self.workspace(|s| &mut s.scratch, total, DType::F32) else { return };
        let mut at = 0;
        for r in pieces {
            let n = r.end - r.start;
            let np = n.div_ceil(SQ_CHUNK);
            let (pw, g) = (self.win(partials.slice(at..at + np)), self.win(grads.slice(r)));
            let imm = [pw.off, g.off, 0, 0, 0, u(n)];
            self.dispatch(SUM_SQUARES.on(grads.dtype == DType::BF16), &[pw, g], &imm, Groups(np));
            at += np;
        }
        let (o, pw) = (self.win(out), self.win(partials.prefix(at)));
        let mut imm = [0u32; 17]; // Params: o0 = out, o1 = partials, n, ..., flags
        imm[0] = o.off;
        imm[1] = pw.off;
        imm[5] = u(at);
        imm[16] = accumulate as u32;
        self.dispatch(REDUCE_PARTIALS, &[o, pw], &imm, Groups(1));
    }

    /// One AdamW step on one tensor, skipped on the device when the step's stats say so.
    pub(super) fn adamw_update_(&mut self, params: Buf, grads: Buf, m: Buf, v: Buf, stats: Buf, h: &AdamWParams) {
        Self::disjoint("adamw_update", &[params, m, v], &[grads, stats]);
        // The bias corrections as the CPU computes them.
        let bc1 = 1.0 - h.beta1.powi(h.t);
        let bc2 = 1.0 - h.beta2.powi(h.t);
        let s = self.win(stats);
        // f32 or bf16 parameters (bf16 rounded stochastically, element i of the tensor with
        // the noise of index place + i: gpu/bf16.rs: Rounding), f32 or bf16 gradients.
        let kernel = match (params.dtype, grads.dtype) {
            (DType::F32, DType::F32) => ADAMW,
            (DType::F32, DType::BF16) => ADAMW.variant(1),
            (DType::BF16, DType::BF16) => ADAMW.variant(2),
            x => panic!("adamw of {x:?} parameters and gradients"),
        };
        let place = h.place.unwrap_or(params.off as u64);
        for r in self.mem.pieces(&[params, grads, m, v], params.len) {
            let n = r.end - r.start;
            let wp = self.win(params.slice(r.clone()));
            let wm = self.win(m.slice(r.clone()));
            let wv = self.win(v.slice(r.clone()));
            // The GPU's noise indices stay below 2^32 (its allocations, the parameters).
            let first = u32::try_from(place + r.start as u64).expect("stochastic rounding's index fits 32 bits");
            let wg = self.win(grads.slice(r));
            #[rustfmt::skip]
            let imm = [
                wp.off, wm.off, wv.off, wg.off, s.off, u(n),
                h.lr.to_bits(), h.beta1.to_bits(), h.beta2.to_bits(), h.eps.to_bits(), h.weight_decay.to_bits(),
                h.grad_clip.to_bits(), bc1.to_bits(), bc2.to_bits(), limit(h.skip.loss).to_bits(),
                limit(h.skip.norm_sq).to_bits(), 0, h.seed, first,
            ];
            self.dispatch(kernel, &[wp, wm, wv, wg, s.clone()], &imm, Threads(n));
        }
    }
}

impl AdamwOps for GpuBackend {
    fn global_norm_squared(&mut self, a: &GlobalNormSquared) {
        if all_bf16(&[a.grads]) && all_f32(&[a.out]) {
            // The bf16 gradients read as they are.
            return self.global_norm_squared_(a.out, a.grads, a.accumulate);
        }
        self.call_in_f32(a, Nearest, |g, a| g.global_norm_squared_(a.out, a.grads, a.accumulate))
    }

    fn adamw_update(&mut self, a: &AdamwUpdate) {
        let AdamwUpdate { params, work, grads, m, v, stats, h } = *a;
        if let Some(work) = work {
            // The update of the f32 master weights, then their working copy, as the CPU rounds
            // it (noise keyed by its own places); left as it was when the step is skipped.
            Self::disjoint(AdamwUpdate::NAME, &[params, work, m, v], &[grads, stats]);
            self.adamw_update(&AdamwUpdate { work: None, ..*a });
            return self.narrow(work, params, Stochastic(h.seed, h.place), Some((stats, h.skip)));
        }
        // bf16 parameters (no master weights) are rounded back stochastically; a skipped step
        // rounds their exact f32 copies, which leaves them as they were.
        if all_bf16(&[grads]) && all_f32(&[m, v, stats]) {
            // bf16 gradients read, and bf16 parameters rounded stochastically, as they are.
            return self.adamw_update_(params, grads, m, v, stats, &h);
        }
        self.call_in_f32(a, Stochastic(h.seed, h.place), |g, a| {
            g.adamw_update_(a.params, a.grads, a.m, a.v, a.stats, &h)
        })
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// AdamW and the gradients' norm (kernels/adamw.wgsl). AdamW's variants: 1 f32 master weights from bf16 gradients, 2 bf16 parameters (rounded stochastically) from bf16 gradients.
pub(super) const MODULE: Module = Module {
    name: "adamw",
    src: include_str!("kernels/adamw.wgsl"),
    buffers: &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F)],
    entries: &[
        Entry {
            name: "adamw",
            bindings: 5,
            u32s: 0,
            bf16s: 0,
            variants: &[&[F, F, F, In16, F], &[Out16, F, F, In16, F]],
        },
        Entry { name: "sum_squares", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[F, In16, F, F, F]] },
        Entry { name: "reduce_partials", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const ADAMW: K = K::of(&MODULE, 0);
pub(super) const SUM_SQUARES: K = K::of(&MODULE, 1);
pub(super) const REDUCE_PARTIALS: K = K::of(&MODULE, 2);

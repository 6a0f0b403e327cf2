//! AdamW (decoupled weight decay) and the global gradient norm.

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::sgemm::Elem;
use super::team::{self, Disjoint};
use super::wide::Dest;
use super::wide::{self, Operand};
use crate::backend::ops::{AdamwOps, AdamwUpdate, Call, GlobalNormSquared};
use crate::backend::{AdamWParams, Backend, Buf, DType};

/// Elements per task.
const CHUNK: usize = 1 << 14;

/// Hyperparameters of one AdamW update.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Multiplies every gradient before use (global-norm clipping); 1.0 for none.
    pub grad_scale: f32,
    /// 1-based step count, for bias correction.
    pub t: i32,
}

/// The bf16 working copy that AdamW writes beside f32 parameters in the same pass (llm.c's
/// bf16 build): element i is the updated parameter rounded stochastically with the noise of
/// (seed, first + i), as [`wide::narrow_stochastic`] rounds it.
pub struct WorkCopy<'a> {
    pub dst: &'a mut [u16],
    pub seed: u32,
    pub first: u64,
}

/// One AdamW step over a tensor: params, grads (f32 or bf16), m and v all (N), and the bf16
/// working copy of the updated params when given.
/// `param -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * param)`, as llm.c and PyTorch's AdamW.
pub fn adamw_update(
    params: &mut [f32],
    grads: Operand,
    m: &mut [f32],
    v: &mut [f32],
    h: &AdamW,
    decay: bool,
    work: Option<WorkCopy>,
) {
    let wd = if decay { h.weight_decay } else { 0.0 };
    let bc1 = 1.0 - h.beta1.powi(h.t);
    let bc2 = 1.0 - h.beta2.powi(h.t);
    let n = params.len();
    let (m, v) = (Disjoint::new(&mut m[..n]), Disjoint::new(&mut v[..n]));
    let (seed, first) = work.as_ref().map_or((0, 0), |w| (w.seed, w.first));
    let work = work.map(|w| Disjoint::new(&mut w.dst[..n]));
    team::chunks_mut(params, CHUNK, |i, p| {
        let r = i * CHUNK..i * CHUNK + p.len();
        // SAFETY: chunk i's moments and working copy are this task's alone.
        let (m, v) = unsafe { (m.part(r.clone()), v.part(r.clone())) };
        match grads {
            Operand::F32(g) => adamw_chunk(p, &g[r.clone()], m, v, *h, wd, bc1, bc2),
            Operand::Bf16(g) => adamw_chunk_bf16(p, &g[r.clone()], m, v, *h, wd, bc1, bc2),
        }
        if let Some(w) = &work {
            // SAFETY: as above.
            let w = unsafe { w.part(r.clone()) };
            // While the chunk is in cache.
            wide::narrow_stochastic(w, p, seed, first + r.start as u64);
        }
    });
}

/// One chunk of [`adamw_update`] (bf16 gradients widened element by element, exact).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn adamw_body<G: Elem>(p: &mut [f32], g: &[G], m: &mut [f32], v: &mut [f32], h: AdamW, wd: f32, bc1: f32, bc2: f32) {
    // Zipped iterators carry no bounds checks, so this loop vectorises.
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let grad = g.to_f32() * h.grad_scale;
        let mi = h.beta1 * *m + (1.0 - h.beta1) * grad;
        let vi = h.beta2 * *v + (1.0 - h.beta2) * grad * grad;
        *m = mi;
        *v = vi;
        let m_hat = mi / bc1;
        let v_hat = vi / bc2;
        *p -= h.lr * (m_hat / (v_hat.sqrt() + h.eps) + wd * *p);
    }
}

crate::simd_fn! {
    /// [`adamw_body`] on f32 gradients.
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamW, wd: f32, bc1: f32, bc2: f32) {
        adamw_body(p, g, m, v, h, wd, bc1, bc2)
    }
}

crate::simd_fn! {
    /// [`adamw_body`] on bf16 gradients.
    fn adamw_chunk_bf16(p: &mut [f32], g: &[u16], m: &mut [f32], v: &mut [f32], h: AdamW, wd: f32, bc1: f32, bc2: f32) {
        adamw_body(p, g, m, v, h, wd, bc1, bc2)
    }
}

/// The sum of squares of one chunk, in f64 over 8 lanes: one f64 sum is a chain of dependent
/// adds (~4 cycles each) and made this pass compute-bound; eight vectorise and leave it
/// memory-bound. bf16 gradients are widened element by element (exact): the same bits.
#[inline(always)]
fn sum_of_squares_body<G: Elem>(g: &[G]) -> f64 {
    let mut acc = [0f64; 8];
    let mut it = g.chunks_exact(8);
    for x in &mut it {
        for (a, x) in acc.iter_mut().zip(x) {
            let x = x.to_f32() as f64;
            *a += x * x;
        }
    }
    for (a, x) in acc.iter_mut().zip(it.remainder()) {
        let x = x.to_f32() as f64;
        *a += x * x;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

crate::simd_fn! {
    /// [`sum_of_squares_body`] of f32 gradients.
    fn sum_of_squares_chunk(g: &[f32]) -> f64 {
        sum_of_squares_body(g)
    }
}

crate::simd_fn! {
    /// [`sum_of_squares_body`] of bf16 gradients.
    fn sum_of_squares_chunk_bf16(g: &[u16]) -> f64 {
        sum_of_squares_body(g)
    }
}

/// sqrt(sum of squares) of `grads` (see [`sum_of_squares`]).
pub fn global_norm(grads: &[f32], partials: &mut [f64]) -> f32 {
    sum_of_squares(grads, partials).sqrt() as f32
}

/// The sum of squares of `grads`, in f64. Partial sums go to `partials` (one per CHUNK,
/// allocated by the caller) and are added in order, so the result is the same on every run.
pub fn sum_of_squares(grads: &[f32], partials: &mut [f64]) -> f64 {
    let nchunks = grads.len().div_ceil(CHUNK);
    let partials = &mut partials[..nchunks];
    team::chunks_mut(partials, 1, |i, s| {
        s[0] = sum_of_squares_chunk(&grads[i * CHUNK..((i + 1) * CHUNK).min(grads.len())]);
    });
    partials.iter().sum::<f64>()
}

/// [`sum_of_squares`] of bf16 gradients (bits): the same chunks and the same order, so the
/// same bits as on the widened values.
pub fn sum_of_squares_bf16(grads: &[u16], partials: &mut [f64]) -> f64 {
    let nchunks = grads.len().div_ceil(CHUNK);
    let partials = &mut partials[..nchunks];
    team::chunks_mut(partials, 1, |i, s| {
        s[0] = sum_of_squares_chunk_bf16(&grads[i * CHUNK..((i + 1) * CHUNK).min(grads.len())]);
    });
    partials.iter().sum::<f64>()
}

/// How many partial sums [`global_norm`] needs for `n` gradients.
pub fn global_norm_partials(n: usize) -> usize {
    n.div_ceil(CHUNK)
}

impl AdamwOps for CpuBackend {
    fn global_norm_squared(&mut self, a: &GlobalNormSquared) {
        let GlobalNormSquared { out, grads, accumulate } = *a;
        let mut partials = std::mem::take(&mut self.norm_partials);
        partials.resize(global_norm_partials(grads.len), 0.0);
        if grads.dtype == DType::BF16 && out.dtype == DType::F32 {
            // Widened a chunk at a time inside, not as one f32 copy of every gradient.
            assert!(!out.overlaps(grads), "global_norm_squared: output overlaps its input");
            let p = self.ptr_bf16(grads);
            // SAFETY: p addresses grads.len u16s of a live allocation (bounds checked); read
            // only, and `&mut self` keeps every other reference out while the slice lives.
            let g = unsafe { std::slice::from_raw_parts(p as *const u16, grads.len) };
            let s = sum_of_squares_bf16(g, &mut partials) as f32;
            let o = self.host_f32(out).expect("f32");
            o[0] = if accumulate { o[0] + s } else { s };
            self.norm_partials = partials;
            return;
        }
        let (outs, ins) = a.roles();
        self.run(GlobalNormSquared::NAME, outs, ins, [], |[o], [g], []| {
            let s = sum_of_squares(g, &mut partials) as f32;
            o[0] = if accumulate { o[0] + s } else { s };
        });
        self.norm_partials = partials;
    }

    /// AdamW on one tensor, and its bf16 working copy when given. bf16 gradients are read as
    /// they are.
    fn adamw_update(&mut self, a: &AdamwUpdate) {
        let AdamwUpdate { params, work, grads, h, .. } = *a;
        // With bf16 parameters (no master weights) AdamW runs on pieces, so that their f32
        // copies are a piece's, not the largest tensor's (the same bits: each element's
        // arithmetic and its rounding noise, keyed by its place in the allocation, do not
        // depend on the cut).
        const PIECE: usize = 1 << 20;
        if params.dtype == DType::BF16 && params.len > PIECE {
            for at in (0..params.len).step_by(PIECE) {
                let r = at..(at + PIECE).min(params.len);
                let cut = |b: Buf| b.slice(r.clone());
                let h = AdamWParams { place: h.place.map(|p| p + at as u64), ..h };
                let (m, v, stats) = (cut(a.m), cut(a.v), a.stats);
                self.adamw_update(&AdamwUpdate {
                    params: cut(params),
                    work: work.map(cut),
                    grads: cut(grads),
                    m,
                    v,
                    stats,
                    h,
                });
            }
            return;
        }
        // bf16 parameters without master weights (llm.c's `-w 0`): rounded stochastically, so
        // that updates smaller than a bf16 step still move them on average. The working copy
        // is rounded so too, by the op itself (with the noise of its own offsets).
        let r = Rounding::Stochastic(h.seed, h.place);
        let work_off = h.place.unwrap_or(work.map_or(0, |w| w.off as u64));
        let (outs, ins) = a.roles();
        let native = ([false, false, false, true], [true, false]);
        self.run_native(AdamwUpdate::NAME, outs, ins, [], r, native.0, native.1, |[p, m, v, w], [g, stats], []| {
            let (p, m, v, stats) = (f32_dest(p), f32_dest(m), f32_dest(v), f32_operand(stats));
            let (loss, norm_sq) = (stats[0], stats[1]);
            if h.skip.skips(loss, norm_sq) {
                return; // a diverged or outlier step: leave the model as it was
            }
            let norm = norm_sq.sqrt();
            let grad_scale = if h.grad_clip > 0.0 && norm > h.grad_clip { h.grad_clip / norm } else { 1.0 };
            let a = AdamW {
                lr: h.lr,
                beta1: h.beta1,
                beta2: h.beta2,
                eps: h.eps,
                weight_decay: h.weight_decay,
                grad_scale,
                t: h.t,
            };
            let copy = match w {
                Dest::Bf16(dst) if work.is_some() => Some(WorkCopy { dst, seed: h.seed, first: work_off }),
                _ => None,
            };
            adamw_update(p, g, m, v, &a, true, copy)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_by_hand() {
        // First step: m_hat = g, v_hat = g^2, so the update is lr * (sign(g) + wd * p) (eps aside).
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = vec![0.1f32, -0.3, 0.0];
        let (mut m, mut v) = (vec![0f32; 3], vec![0f32; 3]);
        let h = AdamW { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.5, grad_scale: 1.0, t: 1 };
        adamw_update(&mut p, (&g).into(), &mut m, &mut v, &h, true, None);
        let want = [1.0 - 0.1 * (1.0 + 0.5), -2.0 - 0.1 * (-1.0 + 0.5 * -2.0), 0.5 - 0.1 * (0.0 + 0.5 * 0.5)];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert!((m[1] - -0.03).abs() < 1e-7 && (v[1] - 0.0045).abs() < 1e-7);
        // No decay on this tensor and grads scaled by 2: a 0-gradient parameter does not move.
        let mut q = vec![3.0f32];
        adamw_update(
            &mut q,
            Operand::F32(&[0.0]),
            &mut [0.0],
            &mut [0.0],
            &AdamW { grad_scale: 2.0, ..h },
            false,
            None,
        );
        assert_eq!(q, [3.0]);
    }

    #[test]
    fn norm() {
        let g: Vec<f32> = (0..40000).map(|i| if i % 2 == 0 { 3.0 } else { -4.0 } * 1e-2).collect();
        let mut parts = vec![0f64; global_norm_partials(g.len())];
        let n = global_norm(&g, &mut parts);
        let want = (20000.0f64 * 9e-4 + 20000.0 * 16e-4).sqrt() as f32;
        assert!((n - want).abs() < 1e-5 * want);
    }
}

//! Fused softmax + cross-entropy over the (padded) vocabulary.
//!
//! Only the first V of the Vp logits take part; the padded columns get zero gradient, so the
//! padded rows of `wte` are never trained.

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::math::{add_lanes, combine_lanes, exp, max_lanes};
use super::team::{self, Disjoint};
use super::wide::{self, Dest, Operand};
use crate::backend::ops::Out::{Rw, W};
use crate::backend::ops::{AccumulateMean, Call, ClassifierOps, CrossentropyBackward, CrossentropyForward};
use std::cell::RefCell;

thread_local! {
    /// A bf16 row of logits widened to f32 (grown on first use, then reused).
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` on the first `v` logits of a row as f32: the row itself, or its widening (exact)
/// into this thread's scratch row, so a bf16 row gives the bits of its f32 widening.
fn with_row<R>(row: Operand, v: usize, f: impl FnOnce(&[f32]) -> R) -> R {
    match row {
        Operand::F32(x) => f(&x[..v]),
        Operand::Bf16(x) => ROW.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() < v {
                r.resize(v, 0.0);
            }
            wide::widen(&mut r[..v], &x[..v]);
            f(&r[..v])
        }),
    }
}

crate::simd_fn! {
/// Max and sum of `exp(x - max)` of a row, each over 8 lanes (element i goes to lane i % 8)
/// with the lanes combined at the end. Written over `chunks_exact(8)` so that both loops are
/// vector loops: an iterator with `f32::max` (which must skip NaNs) and an `i % 8` index ran
/// scalar, and the forward took 48 ms on a 256 x 50257 row block against the backward's
/// 15 ms (examples/ops_time.rs). A NaN logit still makes the sum, and so the loss, NaN.
fn max_and_sum_exp(row: &[f32]) -> (f32, f32) {
    let maxv = max_lanes(row);
    // exp of a block into an L1 scratch (a plain elementwise loop, which the compiler turns
    // into 8-wide vector code; inlined into the lane sums it came out as 4-wide halves with
    // scalar loads), then the block's values go to their lanes. Blocks are whole multiples of
    // 8 and only the row's last block has a remainder, so element i lands in lane i % 8, in
    // order.
    let mut acc = [0f32; 8];
    let mut scratch = [0f32; 512];
    for block in row.chunks(512) {
        let e = &mut scratch[..block.len()];
        for (e, x) in e.iter_mut().zip(block) {
            *e = exp(x - maxv);
        }
        add_lanes(&mut acc, e);
    }
    (maxv, combine_lanes(acc))
}
}

crate::simd_fn! {
    /// One row of the backward: the first V logits become softmax * dloss.
    fn softmax_times(live: &mut [f32], lse: f32, dloss: f32) {
        for x in live.iter_mut() {
            *x = exp(*x - lse) * dloss;
        }
    }
}

/// Per-position loss: losses (N) = -log softmax(logits (N, Vp)[:V])[targets (N)]. Also keeps
/// each row's log-sum-exp in `lse (N)`, so the backward pass is a single sweep over the logits.
/// The logits f32 or bf16 (widened a row at a time).
pub fn crossentropy_forward(
    losses: &mut [f32],
    lse: &mut [f32],
    logits: Operand,
    targets: &[u32],
    n: usize,
    v: usize,
    vp: usize,
) {
    let lse = Disjoint::new(&mut lse[..n]);
    team::chunks_mut(&mut losses[..n], 1, |i, loss| {
        let row = match logits {
            Operand::F32(x) => Operand::F32(&x[i * vp..]),
            Operand::Bf16(x) => Operand::Bf16(&x[i * vp..]),
        };
        with_row(row, v, |row| {
            let (maxv, sum) = max_and_sum_exp(row);
            // SAFETY: position i is this task's alone.
            let lse = unsafe { &mut lse.part(i..i + 1)[0] };
            *lse = sum.ln() + maxv;
            loss[0] = *lse - row[targets[i] as usize];
        })
    });
}

/// In place: logits (N, Vp) become d(loss)/d(logits) = (softmax - onehot(target)) * dloss for the
/// first V columns and 0 for the padding, with softmax = exp(logit - lse) from the forward pass.
/// `dloss` is the weight of each position's loss in the objective (1 / (B*T*grad_accum_steps)
/// for a mean loss). bf16 logits are computed in f32 a row at a time and rounded once.
pub fn crossentropy_softmax_backward_inplace(
    logits: Dest,
    lse: &[f32],
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) {
    let row_backward = |i: usize, live: &mut [f32]| {
        softmax_times(live, lse[i], dloss);
        live[targets[i] as usize] -= dloss;
    };
    match logits {
        Dest::F32(logits) => team::chunks_mut(&mut logits[..n * vp], vp, |i, row| {
            let (live, pad) = row.split_at_mut(v);
            row_backward(i, live);
            pad.fill(0.0);
        }),
        Dest::Bf16(logits) => team::chunks_mut(&mut logits[..n * vp], vp, |i, row| {
            let (live, pad) = row.split_at_mut(v);
            ROW.with(|r| {
                let mut r = r.borrow_mut();
                if r.len() < v {
                    r.resize(v, 0.0);
                }
                wide::widen(&mut r[..v], live);
                row_backward(i, &mut r[..v]);
                wide::narrow(live, &r[..v]);
            });
            pad.fill(0);
        }),
    }
}

impl ClassifierOps for CpuBackend {
    fn crossentropy_forward(&mut self, a: &CrossentropyForward) {
        let CrossentropyForward { losses, lse, logits, targets, n, v, vp } = *a;
        // bf16 logits are widened a row at a time inside.
        let (outs, r) = ([W(losses), W(lse)], Rounding::Nearest);
        let name = CrossentropyForward::NAME;
        self.run_native(name, outs, [logits], [targets], r, [false; 2], [true], |[l, s], [x], [y]| {
            crossentropy_forward(f32_dest(l), f32_dest(s), x, y, n, v, vp)
        });
    }

    fn crossentropy_backward(&mut self, a: &CrossentropyBackward) {
        let CrossentropyBackward { logits, lse, targets, dloss, n, v, vp } = *a;
        // bf16 logits are computed a row at a time inside (not in the NaN-checking mode: see
        // gemm_writes_bf16).
        let native = !self.nan_check;
        let name = CrossentropyBackward::NAME;
        self.run_native(name, [Rw(logits)], [lse], [targets], Rounding::Nearest, [native], [false], |[x], [s], [y]| {
            crossentropy_softmax_backward_inplace(x, f32_operand(s), y, dloss, n, v, vp)
        });
    }

    fn accumulate_mean(&mut self, a: &AccumulateMean) {
        let (outs, ins, weight) = (a.roles().0, a.roles().1, a.weight);
        self.run(AccumulateMean::NAME, outs, ins, [], |[acc], [x], []| {
            acc[0] += weight * (x.iter().sum::<f32>() / x.len().max(1) as f32)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn a_nan_logit_makes_its_row_loss_nan() {
        // Rows longer than one scratch block and not a multiple of 8, NaN early, late, in the tail.
        let (n, v) = (3, 1029);
        let mut logits: Vec<f32> = (0..n * v).map(|i| (i % 17) as f32 * 0.1).collect();
        logits[3] = f32::NAN;
        logits[v + 700] = f32::NAN;
        let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
        crossentropy_forward(&mut losses, &mut lse, (&logits).into(), &[0, 1, 2], n, v, v);
        assert!(losses[0].is_nan() && losses[1].is_nan(), "{losses:?}");
        logits[v + 700] = 0.0;
        logits[2 * v + 1028] = f32::NAN;
        crossentropy_forward(&mut losses, &mut lse, (&logits).into(), &[0, 1, 2], n, v, v);
        assert!(losses[1].is_finite() && losses[2].is_nan(), "{losses:?}");
    }

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, v, vp) in &[(1, 1, 1), (3, 5, 8), (7, 13, 13), (2, 129, 256), (2, 1029, 1032)] {
            let mut r = TestRng((n * v) as u64);
            let logits: Vec<f32> = r.vec(n * vp).iter().map(|x| x * 3.0).collect();
            let targets: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % v) as u32).collect();
            let w = 0.7f32;
            let loss = |l: &[f32]| {
                let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
                crossentropy_forward(&mut losses, &mut lse, l.into(), &targets, n, v, vp);
                losses.iter().map(|x| *x as f64 * w as f64).sum::<f64>()
            };
            // Forward against log-sum-exp in f64.
            let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
            crossentropy_forward(&mut losses, &mut lse, (&logits).into(), &targets, n, v, vp);
            for i in 0..n {
                let row = &logits[i * vp..i * vp + v];
                let lse = row.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
                assert!((losses[i] as f64 - (lse - row[targets[i] as usize] as f64)).abs() < 1e-5);
            }
            let mut d = logits.clone();
            crossentropy_softmax_backward_inplace((&mut d).into(), &lse, &targets, w, n, v, vp);
            check_grad(&logits, &d, loss, "dlogits");
            for i in 0..n {
                assert!(d[i * vp + v..(i + 1) * vp].iter().all(|x| *x == 0.0), "padding gets no gradient");
            }
        }
    }
}

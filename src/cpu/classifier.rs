//! Fused softmax + cross-entropy over the (padded) vocabulary.
//!
//! Only the first V of the Vp logits take part; the padded columns get zero gradient, so the
//! padded rows of `wte` are never trained.

use super::math::exp;
use rayon::prelude::*;

/// Sum with 8 running partial sums (vectorisable; one running sum forces scalar adds).
fn sum8(it: impl Iterator<Item = f32>) -> f32 {
    let mut acc = [0f32; 8];
    for (i, x) in it.enumerate() {
        acc[i % 8] += x;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Per-position loss: losses (N) = -log softmax(logits (N, Vp)[:V])[targets (N)]. Also keeps
/// each row's log-sum-exp in `lse (N)`, so the backward pass is a single sweep over the logits.
pub fn crossentropy_forward(
    losses: &mut [f32],
    lse: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
    vp: usize,
) {
    losses[..n].par_iter_mut().zip(&mut lse[..n]).enumerate().for_each(|(i, (loss, lse))| {
        let row = &logits[i * vp..i * vp + v];
        let maxv = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let sum = sum8(row.iter().map(|x| exp(x - maxv)));
        *lse = sum.ln() + maxv;
        *loss = *lse - row[targets[i] as usize];
    });
}

/// In place: logits (N, Vp) become d(loss)/d(logits) = (softmax - onehot(target)) * dloss for the
/// first V columns and 0 for the padding, with softmax = exp(logit - lse) from the forward pass.
/// `dloss` is the weight of each position's loss in the objective (1 / (B*T*grad_accum_steps)
/// for a mean loss).
pub fn crossentropy_softmax_backward_inplace(
    logits: &mut [f32],
    lse: &[f32],
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) {
    logits[..n * vp].par_chunks_mut(vp).enumerate().for_each(|(i, row)| {
        let (live, pad) = row.split_at_mut(v);
        let lse = lse[i];
        for x in live.iter_mut() {
            *x = exp(*x - lse) * dloss;
        }
        live[targets[i] as usize] -= dloss;
        pad.fill(0.0);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, v, vp) in &[(1, 1, 1), (3, 5, 8), (7, 13, 13), (2, 129, 256)] {
            let mut r = TestRng((n * v) as u64);
            let logits: Vec<f32> = r.vec(n * vp).iter().map(|x| x * 3.0).collect();
            let targets: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % v) as u32).collect();
            let w = 0.7f32;
            let loss = |l: &[f32]| {
                let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
                crossentropy_forward(&mut losses, &mut lse, l, &targets, n, v, vp);
                losses.iter().map(|x| *x as f64 * w as f64).sum::<f64>()
            };
            // Forward against log-sum-exp in f64.
            let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
            crossentropy_forward(&mut losses, &mut lse, &logits, &targets, n, v, vp);
            for i in 0..n {
                let row = &logits[i * vp..i * vp + v];
                let lse = row.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
                assert!((losses[i] as f64 - (lse - row[targets[i] as usize] as f64)).abs() < 1e-5);
            }
            let mut d = logits.clone();
            crossentropy_softmax_backward_inplace(&mut d, &lse, &targets, w, n, v, vp);
            check_grad(&logits, &d, loss, "dlogits");
            for i in 0..n {
                assert!(d[i * vp + v..(i + 1) * vp].iter().all(|x| *x == 0.0), "padding gets no gradient");
            }
        }
    }
}

//! RMSNorm over the channel dimension (Llama's; transformers' `LlamaRMSNorm`):
//! out = inp * rstd * weight with rstd = 1 / sqrt(mean(inp^2) + eps).

use super::math::{add_lanes_of, combine_lanes};
use super::team::{self, Disjoint};

/// Rows per task; a row is C floats.
const ROWS: usize = 16;

/// out (N, C) = inp * rstd * weight; stores rstd (N) for backward.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], weight: &[f32], n: usize, c: usize, eps: f32) {
    let rstd = Disjoint::new(&mut rstd[..n]);
    team::chunks_mut(&mut out[..n * c], ROWS * c, |i, out| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        // SAFETY: chunk i owns rows i*ROWS.., which no other chunk touches.
        let rstd = unsafe { rstd.part(rows.clone()) };
        forward_rows(out, rstd, &inp[rows.start * c..rows.end * c], weight, c, eps);
    });
}

crate::simd_fn! {
    /// Rows of [`rmsnorm_forward`].
    fn forward_rows(out: &mut [f32], rstd: &mut [f32], inp: &[f32], weight: &[f32], c: usize, eps: f32) {
        for ((o, r), x) in out.chunks_exact_mut(c).zip(rstd).zip(inp.chunks_exact(c)) {
            let mut acc = [0f32; 8];
            add_lanes_of(&mut acc, x, |v| v * v);
            let s = 1.0 / (combine_lanes(acc) / c as f32 + eps).sqrt();
            // (x * rstd) * weight, in transformers' order.
            for ((o, x), w) in o.iter_mut().zip(x).zip(&weight[..c]) {
                *o = (x * s) * w;
            }
            *r = s;
        }
    }
}

/// Backward of [`rmsnorm_forward`]: `dinp += ...`, `dweight += ...`. With y = w * x * r and
/// r = (mean(x^2) + eps)^(-1/2): dx_i = r * w_i * dy_i - x_i * r^3 / C * sum_j(w_j dy_j x_j).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    team::chunks_mut(&mut dinp[..n * c], ROWS * c, |i, dinp| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        let (dout, inp) = (&dout[rows.start * c..rows.end * c], &inp[rows.start * c..rows.end * c]);
        backward_rows(dinp, dout, inp, weight, &rstd[rows], c);
    });
    // The weight's gradient, column-parallel: each task sums over all rows in order, so the
    // result does not depend on the thread schedule.
    const COLS: usize = 64;
    team::chunks_mut(&mut dweight[..c], COLS, |ci, dw| {
        let c0 = ci * COLS;
        for row in 0..n {
            let r = rstd[row];
            let x = &inp[row * c + c0..row * c + c0 + dw.len()];
            let d = &dout[row * c + c0..row * c + c0 + dw.len()];
            for ((dw, x), d) in dw.iter_mut().zip(x).zip(d) {
                *dw += d * (x * r);
            }
        }
    });
}

crate::simd_fn! {
    /// Input-gradient rows of [`rmsnorm_backward`].
    fn backward_rows(dinp: &mut [f32], dout: &[f32], inp: &[f32], weight: &[f32], rstd: &[f32], c: usize) {
        for (((di, d), x), r) in dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(rstd) {
            let (weight, d, x, di) = (&weight[..c], &d[..c], &x[..c], &mut di[..c]);
            let mut acc = [0f32; 8];
            let mut t = [0f32; 256];
            for i0 in (0..c).step_by(256) {
                let i1 = (i0 + 256).min(c);
                let t = &mut t[..i1 - i0];
                for (((t, w), d), x) in t.iter_mut().zip(&weight[i0..i1]).zip(&d[i0..i1]).zip(&x[i0..i1]) {
                    *t = w * d * x;
                }
                super::math::add_lanes(&mut acc, t);
            }
            let k = combine_lanes(acc) * r * r * r / c as f32;
            for (((di, x), w), d) in di.iter_mut().zip(x).zip(weight).zip(d) {
                *di += r * w * d - x * k;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, c) in &[(1, 1), (1, 3), (3, 7), (7, 65), (17, 3), (3, 517)] {
            let mut r = TestRng(n as u64 * 31 + c as u64);
            let inp = r.vec(n * c);
            let w = r.vec(c);
            let proj = r.vec(n * c);
            let eps = 1e-5;
            let fwd = |inp: &[f32], w: &[f32]| {
                let (mut out, mut s) = (vec![0f32; n * c], vec![0f32; n]);
                rmsnorm_forward(&mut out, &mut s, inp, w, n, c, eps);
                (out, s)
            };
            let (out, s) = fwd(&inp, &w);
            for row in 0..n {
                let x = &inp[row * c..(row + 1) * c];
                let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / c as f64;
                for i in 0..c {
                    let want = x[i] as f64 / (ms + eps as f64).sqrt() * w[i] as f64;
                    assert!((out[row * c + i] as f64 - want).abs() < 1e-5, "rmsnorm fwd");
                }
            }
            let mut dinp = vec![0.25f32; n * c];
            let mut dw = vec![0f32; c];
            rmsnorm_backward(&mut dinp, &mut dw, &proj, &inp, &w, &s, n, c);
            dinp.iter_mut().for_each(|x| *x -= 0.25); // it accumulated onto 0.25
            check_grad(&inp, &dinp, |x| dot(&fwd(x, &w).0, &proj), "dinp");
            check_grad(&w, &dw, |x| dot(&fwd(&inp, x).0, &proj), "dweight");
        }
    }
}

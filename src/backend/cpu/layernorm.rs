//! LayerNorm over the channel dimension (eps 1e-5, as PyTorch and llm.c).

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::math::{add_lanes, add_lanes_of, combine_lanes};
use super::sgemm::Elem;
use super::team::{self, Disjoint};
use super::wide;
use super::wide::{Dest, Operand};
use crate::backend::ops::{Call, LayerNormBackward, LayerNormForward, LayerNormOps, Rows};
use crate::backend::DType;

const EPS: f32 = 1e-5;

/// Sum of f(x_i) over 8 lanes (see [`combine_lanes`]).
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    add_lanes_of(&mut acc, x, f);
    combine_lanes(acc)
}
/// Rows per task; a row is C floats.
const ROWS: usize = 16;

/// out (N, C) = (inp - mean) * rstd * weight + bias; stores mean (N) and rstd (N) for backward.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    let (mean, rstd) = (Disjoint::new(&mut mean[..n]), Disjoint::new(&mut rstd[..n]));
    team::chunks_mut(&mut out[..n * c], ROWS * c, |i, out| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        // SAFETY: chunk i owns rows i*ROWS.., which no other chunk touches.
        let (mean, rstd) = unsafe { (mean.part(rows.clone()), rstd.part(rows.clone())) };
        forward_rows(out, mean, rstd, &inp[rows.start * c..rows.end * c], weight, bias, c);
    });
}

crate::simd_fn! {
    /// Rows of [`layernorm_forward`].
    fn forward_rows(out: &mut [f32], mean: &mut [f32], rstd: &mut [f32], inp: &[f32], weight: &[f32], bias: &[f32], c: usize) {
        for (((o, m), r), x) in out.chunks_exact_mut(c).zip(mean).zip(rstd).zip(inp.chunks_exact(c)) {
            let mu = lane_sum(x, |v| v) / c as f32;
            let var = lane_sum(x, |v| (v - mu) * (v - mu)) / c as f32;
            let s = 1.0 / (var + EPS).sqrt();
            for (((o, x), w), b) in o.iter_mut().zip(x).zip(&weight[..c]).zip(&bias[..c]) {
                *o = (x - mu) * s * w + b;
            }
            *m = mu;
            *r = s;
        }
    }
}

/// Backward of [`layernorm_forward`]: `dinp += ...`, `dweight += ...`, `dbias += ...`.
/// `dinp` accumulates because it is the residual stream's gradient.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    // Input gradient, row-parallel.
    team::chunks_mut(&mut dinp[..n * c], ROWS * c, |i, dinp| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        let (dout, inp) = (&dout[rows.start * c..rows.end * c], &inp[rows.start * c..rows.end * c]);
        let (mean, rstd) = (&mean[rows.clone()], &rstd[rows]);
        backward_rows(dinp, dout, inp, weight, mean, rstd, c);
    });
    dparam_cols(dweight, dbias, dout, inp, mean, rstd, n, c);
}

/// dweight (C) += sum over rows of dout * (inp - mean) * rstd, dbias (C) += sum of dout,
/// column-parallel: each task owns a range of channels and sums over all rows in order, so the
/// result is the same whatever the thread schedule.
#[allow(clippy::too_many_arguments)]
fn dparam_cols<T: Elem>(
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[T],
    inp: &[T],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    const COLS: usize = 64;
    let dbias = Disjoint::new(&mut dbias[..c]);
    team::chunks_mut(&mut dweight[..c], COLS, |ci, dw| {
        let c0 = ci * COLS;
        // SAFETY: chunk ci owns channels c0..c0 + dw.len() of both gradients.
        let db = unsafe { dbias.part(c0..c0 + dw.len()) };
        for row in 0..n {
            let (m, r) = (mean[row], rstd[row]);
            let x = &inp[row * c + c0..row * c + c0 + dw.len()];
            let d = &dout[row * c + c0..row * c + c0 + dw.len()];
            for (((dw, db), x), d) in dw.iter_mut().zip(db.iter_mut()).zip(x).zip(d) {
                let d = d.to_f32();
                *dw += (x.to_f32() - m) * r * d;
                *db += d;
            }
        }
    });
}

/// [`layernorm_forward`] on bf16 out, inp, weight and bias (bits), mean and rstd f32: each row
/// widened, then [`forward_rows`], then rounded once to nearest even (the f32 op's bits on
/// widened inputs, rounded; the widening is per row, in cache, not a copy of the activation).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward_bf16(
    out: &mut [u16],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[u16],
    weight: &[u16],
    bias: &[u16],
    n: usize,
    c: usize,
) {
    let (mut w, mut b) = (vec![0f32; c], vec![0f32; c]);
    wide::widen(&mut w, &weight[..c]);
    wide::widen(&mut b, &bias[..c]);
    let (mean, rstd) = (Disjoint::new(&mut mean[..n]), Disjoint::new(&mut rstd[..n]));
    team::chunks_mut(&mut out[..n * c], ROWS * c, |i, out| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        // SAFETY: chunk i owns rows i*ROWS.., which no other chunk touches.
        let (mean, rstd) = unsafe { (mean.part(rows.clone()), rstd.part(rows.clone())) };
        let (mut x, mut o) = (vec![0f32; c], vec![0f32; c]);
        for (k, ((out, m), r)) in out.chunks_exact_mut(c).zip(mean.iter_mut()).zip(rstd.iter_mut()).enumerate() {
            let row = rows.start + k;
            wide::widen(&mut x, &inp[row * c..(row + 1) * c]);
            forward_rows(&mut o, std::slice::from_mut(m), std::slice::from_mut(r), &x, &w, &b, c);
            wide::narrow(out, &o);
        }
    });
}

/// [`layernorm_backward`] with dinp, dout, inp and weight bf16 (bits): dinp's rows widened,
/// added to by [`backward_rows`] and rounded once; dweight and dbias (f32) as in the f32 op,
/// reading bf16.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_bf16(
    dinp: &mut [u16],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[u16],
    inp: &[u16],
    weight: &[u16],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let mut w = vec![0f32; c];
    wide::widen(&mut w, &weight[..c]);
    wide::add_rows_widened(dinp, dout, inp, (n, c, ROWS), |row, di, d, x| {
        backward_rows(di, d, x, &w, &mean[row..row + 1], &rstd[row..row + 1], c)
    });
    dparam_cols(dweight, dbias, dout, inp, mean, rstd, n, c);
}

crate::simd_fn! {
    /// Input-gradient rows of [`layernorm_backward`].
    fn backward_rows(dinp: &mut [f32], dout: &[f32], inp: &[f32], weight: &[f32], mean: &[f32], rstd: &[f32], c: usize) {
        for ((((di, d), x), m), r) in
            dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(mean).zip(rstd)
        {
            // Every slice cut to exactly c, so the loops below need no bounds checks (with
            // them they ran scalar).
            let (weight, d, x, di) = (&weight[..c], &d[..c], &x[..c], &mut di[..c]);
            // Both means over 8 lanes: the terms of a block of the row go to L1 scratch in
            // plain elementwise loops, then into the lane sums (with the products inlined
            // into the lane sums, the loop ran scalar).
            let (mut sum_d, mut sum_dn) = ([0f32; 8], [0f32; 8]);
            let (mut dnorm, mut dnorm_norm) = ([0f32; 256], [0f32; 256]);
            for i0 in (0..c).step_by(256) {
                let i1 = (i0 + 256).min(c);
                let (dnorm, dnorm_norm) = (&mut dnorm[..i1 - i0], &mut dnorm_norm[..i1 - i0]);
                for ((t, w), d) in dnorm.iter_mut().zip(&weight[i0..i1]).zip(&d[i0..i1]) {
                    *t = w * d;
                }
                for ((t, dn), x) in dnorm_norm.iter_mut().zip(dnorm.iter()).zip(&x[i0..i1]) {
                    *t = dn * ((x - m) * r);
                }
                add_lanes(&mut sum_d, dnorm);
                add_lanes(&mut sum_dn, dnorm_norm);
            }
            let dnorm_mean = combine_lanes(sum_d) / c as f32;
            let dnorm_norm_mean = combine_lanes(sum_dn) / c as f32;
            for (((di, x), w), d) in di.iter_mut().zip(x).zip(weight).zip(d) {
                let norm = (x - m) * r;
                let dnorm = w * d;
                *di += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
            }
        }
    }
}

impl LayerNormOps for CpuBackend {
    fn layernorm_forward(&mut self, a: &LayerNormForward) {
        let Rows { n, c } = a.r;
        // out, x, w and b bf16: widened and rounded a row at a time, no f32 copies.
        let native = [a.out, a.x, a.w, a.b].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let (native_outs, native_ins) = ([native, false, false], [native; 3]);
        let r = Rounding::Nearest;
        self.run_native(LayerNormForward::NAME, outs, ins, [], r, native_outs, native_ins, |o, i, []| {
            let ([o, m, s], [x, w, b]) = (o, i);
            let (m, s) = (f32_dest(m), f32_dest(s));
            match (o, x, w, b) {
                (Dest::F32(o), Operand::F32(x), Operand::F32(w), Operand::F32(b)) => {
                    layernorm_forward(o, m, s, x, w, b, n, c)
                }
                (Dest::Bf16(o), Operand::Bf16(x), Operand::Bf16(w), Operand::Bf16(b)) => {
                    layernorm_forward_bf16(o, m, s, x, w, b, n, c)
                }
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        });
    }

    fn layernorm_backward(&mut self, a: &LayerNormBackward) {
        let Rows { n, c } = a.r;
        // dx, dout, x and w bf16: a row at a time, no f32 copies; the parameters' gradients (C
        // each) accumulate in f32 copies, rounded once.
        let native = [a.dx, a.dout, a.x, a.w].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let (native_outs, native_ins) = ([native, false, false], [native, native, native, false, false]);
        let r = Rounding::Nearest;
        self.run_native(LayerNormBackward::NAME, outs, ins, [], r, native_outs, native_ins, |o, i, []| {
            let ([di, dw, db], [d, x, w, m, s]) = (o, i);
            let (dw, db, m, s) = (f32_dest(dw), f32_dest(db), f32_operand(m), f32_operand(s));
            match (di, d, x, w) {
                (Dest::F32(di), Operand::F32(d), Operand::F32(x), Operand::F32(w)) => {
                    layernorm_backward(di, dw, db, d, x, w, m, s, n, c)
                }
                (Dest::Bf16(di), Operand::Bf16(d), Operand::Bf16(x), Operand::Bf16(w)) => {
                    layernorm_backward_bf16(di, dw, db, d, x, w, m, s, n, c)
                }
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, c) in &[(1, 1), (1, 3), (3, 7), (7, 65), (17, 3), (2, 8), (3, 517)] {
            let mut r = TestRng(n as u64 * 101 + c as u64);
            let inp = r.vec(n * c);
            let w = r.vec(c);
            let b = r.vec(c);
            let proj = r.vec(n * c);
            let fwd = |inp: &[f32], w: &[f32], b: &[f32]| {
                let (mut out, mut m, mut s) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
                layernorm_forward(&mut out, &mut m, &mut s, inp, w, b, n, c);
                (out, m, s)
            };
            let (out, m, s) = fwd(&inp, &w, &b);
            // Forward against the definition, in f64.
            for row in 0..n {
                let x = &inp[row * c..(row + 1) * c];
                let mu = x.iter().map(|v| *v as f64).sum::<f64>() / c as f64;
                let var = x.iter().map(|v| (*v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
                for i in 0..c {
                    let want = (x[i] as f64 - mu) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64;
                    assert!((out[row * c + i] as f64 - want).abs() < 1e-4, "ln fwd");
                }
            }
            let mut dinp = vec![0.5f32; n * c];
            let (mut dw, mut db) = (vec![0f32; c], vec![0f32; c]);
            layernorm_backward(&mut dinp, &mut dw, &mut db, &proj, &inp, &w, &m, &s, n, c);
            dinp.iter_mut().for_each(|x| *x -= 0.5); // it accumulated onto 0.5
            if c > 1 {
                // With C = 1 the output is exactly the bias: d/dinp is 0 but the quotient is noise
                // from rstd = 1/sqrt(eps) amplifying rounding, so only check C > 1 here.
                check_grad(&inp, &dinp, |x| dot(&fwd(x, &w, &b).0, &proj), "dinp");
            }
            check_grad(&w, &dw, |x| dot(&fwd(&inp, x, &b).0, &proj), "dweight");
            check_grad(&b, &db, |x| dot(&fwd(&inp, &w, x).0, &proj), "dbias");
        }
    }

    /// The bf16 versions give the bits of the f32 ones on widened inputs, outputs rounded once
    /// (dinp accumulating onto bf16 values; dweight and dbias f32 either way).
    #[test]
    fn bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        let to16 = |v: Vec<f32>| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
        let narrow = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for &(n, c) in &[(1, 1), (3, 5), (17, 33), (2, 300), (40, 65)] {
            let mut r = TestRng((n * 7 + c) as u64);
            let (inp, w, b) = (to16(r.vec(n * c)), to16(r.vec(c)), to16(r.vec(c)));
            let (dout, dinp0) = (to16(r.vec(n * c)), to16(r.vec(n * c)));
            let (dw0, db0) = (r.vec(c), r.vec(c));
            let (mut o, mut m, mut s) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
            layernorm_forward(&mut o, &mut m, &mut s, &wide(&inp), &wide(&w), &wide(&b), n, c);
            let (mut o16, mut m16, mut s16) = (vec![0u16; n * c], vec![0f32; n], vec![0f32; n]);
            layernorm_forward_bf16(&mut o16, &mut m16, &mut s16, &inp, &w, &b, n, c);
            assert_eq!(narrow(&o), o16, "forward n={n} c={c}");
            assert_eq!(bits(&m), bits(&m16), "mean n={n} c={c}");
            assert_eq!(bits(&s), bits(&s16), "rstd n={n} c={c}");
            let (mut di, mut dw, mut db) = (wide(&dinp0), dw0.clone(), db0.clone());
            layernorm_backward(&mut di, &mut dw, &mut db, &wide(&dout), &wide(&inp), &wide(&w), &m, &s, n, c);
            let (mut di16, mut dw16, mut db16) = (dinp0.clone(), dw0.clone(), db0.clone());
            layernorm_backward_bf16(&mut di16, &mut dw16, &mut db16, &dout, &inp, &w, &m, &s, n, c);
            assert_eq!(narrow(&di), di16, "dinp n={n} c={c}");
            assert_eq!(bits(&dw), bits(&dw16), "dweight n={n} c={c}");
            assert_eq!(bits(&db), bits(&db16), "dbias n={n} c={c}");
        }
    }
}

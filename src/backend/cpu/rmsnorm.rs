//! RMSNorm over the channel dimension (Llama's; transformers' `LlamaRMSNorm`):
//! out = inp * rstd * weight with rstd = 1 / sqrt(mean(inp^2) + eps).

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::math::{add_lanes_of, combine_lanes};
use super::sgemm::Elem;
use super::team::{self, Disjoint};
use super::wide;
use super::wide::{Dest, Operand};
use crate::backend::ops::{Call, HeadNormBackward, HeadNormForward, RmsNormBackward, RmsNormForward, RmsNormOps, Rows};
use crate::backend::DType;

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
    dweight_cols(dweight, dout, inp, rstd, n, c);
}

/// dweight (C) += sum over rows of dout * (inp * rstd), column-parallel: each task sums over
/// all rows in order, so the result does not depend on the thread schedule.
fn dweight_cols<T: Elem>(dweight: &mut [f32], dout: &[T], inp: &[T], rstd: &[f32], n: usize, c: usize) {
    const COLS: usize = 64;
    team::chunks_mut(&mut dweight[..c], COLS, |ci, dw| {
        let c0 = ci * COLS;
        for row in 0..n {
            let r = rstd[row];
            let x = &inp[row * c + c0..row * c + c0 + dw.len()];
            let d = &dout[row * c + c0..row * c + c0 + dw.len()];
            for ((dw, x), d) in dw.iter_mut().zip(x).zip(d) {
                *dw += d.to_f32() * (x.to_f32() * r);
            }
        }
    });
}

/// [`rmsnorm_forward`] on bf16 out, inp and weight (bits), rstd f32: each row widened, then
/// [`forward_rows`], then rounded once to nearest even (the f32 op's bits on widened inputs,
/// rounded; the widening is per row, in cache, not a copy of the whole activation).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward_bf16(
    out: &mut [u16],
    rstd: &mut [f32],
    inp: &[u16],
    weight: &[u16],
    n: usize,
    c: usize,
    eps: f32,
) {
    let mut w = vec![0f32; c];
    wide::widen(&mut w, &weight[..c]);
    let rstd = Disjoint::new(&mut rstd[..n]);
    team::chunks_mut(&mut out[..n * c], ROWS * c, |i, out| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        // SAFETY: chunk i owns rows i*ROWS.., which no other chunk touches.
        let rstd = unsafe { rstd.part(rows.clone()) };
        let (mut x, mut o) = (vec![0f32; c], vec![0f32; c]);
        for (k, (out, r)) in out.chunks_exact_mut(c).zip(rstd.iter_mut()).enumerate() {
            let row = rows.start + k;
            wide::widen(&mut x, &inp[row * c..(row + 1) * c]);
            forward_rows(&mut o, std::slice::from_mut(r), &x, &w, c, eps);
            wide::narrow(out, &o);
        }
    });
}

/// [`rmsnorm_backward`] with dinp, dout, inp and weight bf16 (bits): dinp's rows widened, added
/// to by [`backward_rows`] and rounded once; dweight (f32) as in the f32 op, reading bf16.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_bf16(
    dinp: &mut [u16],
    dweight: &mut [f32],
    dout: &[u16],
    inp: &[u16],
    weight: &[u16],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let mut w = vec![0f32; c];
    wide::widen(&mut w, &weight[..c]);
    wide::add_rows_widened(dinp, dout, inp, (n, c, ROWS), |row, di, d, x| {
        backward_rows(di, d, x, &w, &rstd[row..row + 1], c)
    });
    dweight_cols(dweight, dout, inp, rstd, n, c);
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

/// Qwen3's RMSNorm of each query and key head: in each row of qkv (N, QKV) = NH query heads,
/// then KV key heads, then KV value heads of HS each, out's query heads are inp's normalized
/// with weight wq (HS), its key heads with wk (HS), its value heads copied; rstd (N, NH + KV)
/// is kept for backward.
#[allow(clippy::too_many_arguments)]
pub fn head_norm_forward<T: Elem>(
    out: &mut [T],
    rstd: &mut [f32],
    inp: &[T],
    wq: &[f32],
    wk: &[f32],
    n: usize,
    (nh, nkv, hs): (usize, usize, usize),
    eps: f32,
) {
    let (w, normed) = ((nh + 2 * nkv) * hs, nh + nkv);
    let rstd = Disjoint::new(&mut rstd[..n * normed]);
    team::chunks_mut(&mut out[..n * w], ROWS * w, |i, out| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        // SAFETY: chunk i owns rows i*ROWS.., which no other chunk touches.
        let rstd = unsafe { rstd.part(rows.start * normed..rows.end * normed) };
        // Each row's query and key heads in f32, normalized, stored (rounded, if bf16) once.
        let (mut x, mut o) = (vec![0f32; normed * hs], vec![0f32; normed * hs]);
        for ((out, r), inp) in
            out.chunks_exact_mut(w).zip(rstd.chunks_exact_mut(normed)).zip(inp[rows.start * w..].chunks_exact(w))
        {
            let (out, inp) = (out.split_at_mut(normed * hs), inp.split_at(normed * hs));
            x.iter_mut().zip(inp.0).for_each(|(x, v)| *x = v.to_f32());
            for (h, ((o, r), x)) in o.chunks_exact_mut(hs).zip(r.iter_mut()).zip(x.chunks_exact(hs)).enumerate() {
                forward_rows(o, std::slice::from_mut(r), x, if h < nh { wq } else { wk }, hs, eps);
            }
            T::store_slice(out.0, &o, false, None);
            out.1.copy_from_slice(inp.1);
        }
    });
}

/// Backward of [`head_norm_forward`]: dinp (N, QKV) (out) from dout (N, QKV): the query and key
/// heads through their RMSNorm, the value heads as they are; dwq and dwk (HS) `+=` their
/// gradients, each summed over rows then heads in order.
#[allow(clippy::too_many_arguments)]
pub fn head_norm_backward<T: Elem>(
    dinp: &mut [T],
    dwq: &mut [f32],
    dwk: &mut [f32],
    dout: &[T],
    inp: &[T],
    wq: &[f32],
    wk: &[f32],
    rstd: &[f32],
    n: usize,
    (nh, nkv, hs): (usize, usize, usize),
) {
    let (w, normed) = ((nh + 2 * nkv) * hs, nh + nkv);
    team::chunks_mut(&mut dinp[..n * w], ROWS * w, |i, dinp| {
        let rows = i * ROWS..(i * ROWS + ROWS).min(n);
        let (mut di, mut d, mut x) = (vec![0f32; normed * hs], vec![0f32; normed * hs], vec![0f32; normed * hs]);
        for (k, dst) in dinp.chunks_exact_mut(w).enumerate() {
            let row = rows.start + k;
            let (drow, xrow) = (&dout[row * w..(row + 1) * w], &inp[row * w..(row + 1) * w]);
            d.iter_mut().zip(drow).for_each(|(a, v)| *a = v.to_f32());
            x.iter_mut().zip(xrow).for_each(|(a, v)| *a = v.to_f32());
            di.fill(0.0);
            for (h, di) in di.chunks_exact_mut(hs).enumerate() {
                let (d, x, r) = (&d[h * hs..(h + 1) * hs], &x[h * hs..(h + 1) * hs], &rstd[row * normed + h..][..1]);
                backward_rows(di, d, x, if h < nh { wq } else { wk }, r, hs);
            }
            let (dst, dv) = dst.split_at_mut(normed * hs);
            T::store_slice(dst, &di, false, None);
            dv.copy_from_slice(&drow[normed * hs..]);
        }
    });
    // The weights' gradients, column-parallel and in a fixed order (rows, then heads).
    for (dw, heads) in [(dwq, 0..nh), (dwk, nh..normed)] {
        let heads = &heads;
        team::chunks_mut(&mut dw[..hs], 64, |ci, dw| {
            let c0 = ci * 64;
            for row in 0..n {
                for h in heads.clone() {
                    let r = rstd[row * normed + h];
                    let at = row * w + h * hs + c0;
                    let (x, d) = (&inp[at..at + dw.len()], &dout[at..at + dw.len()]);
                    for ((dw, x), d) in dw.iter_mut().zip(x).zip(d) {
                        *dw += d.to_f32() * (x.to_f32() * r);
                    }
                }
            }
        });
    }
}

impl RmsNormOps for CpuBackend {
    fn rmsnorm_forward(&mut self, a: &RmsNormForward) {
        let (Rows { n, c }, eps) = (a.r, a.eps);
        // out, x and w bf16: widened and rounded a row at a time, no f32 copies.
        let native = [a.out, a.x, a.w].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(RmsNormForward::NAME, outs, ins, [], r, [native, false], [native; 2], |[o, s], [x, w], []| {
            let s = f32_dest(s);
            match (o, x, w) {
                (Dest::F32(o), Operand::F32(x), Operand::F32(w)) => rmsnorm_forward(o, s, x, w, n, c, eps),
                (Dest::Bf16(o), Operand::Bf16(x), Operand::Bf16(w)) => rmsnorm_forward_bf16(o, s, x, w, n, c, eps),
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        });
    }

    fn rmsnorm_backward(&mut self, a: &RmsNormBackward) {
        let Rows { n, c } = a.r;
        // dx, dout, x and w bf16: a row at a time, no f32 copies; the weight's gradient (C)
        // accumulates in an f32 copy, rounded once.
        let native = [a.dx, a.dout, a.x, a.w].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let (native_outs, native_ins) = ([native, false], [native, native, native, false]);
        let r = Rounding::Nearest;
        self.run_native(
            RmsNormBackward::NAME,
            outs,
            ins,
            [],
            r,
            native_outs,
            native_ins,
            |[di, dw], [d, x, w, s], []| {
                let (dw, s) = (f32_dest(dw), f32_operand(s));
                match (di, d, x, w) {
                    (Dest::F32(di), Operand::F32(d), Operand::F32(x), Operand::F32(w)) => {
                        rmsnorm_backward(di, dw, d, x, w, s, n, c)
                    }
                    (Dest::Bf16(di), Operand::Bf16(d), Operand::Bf16(x), Operand::Bf16(w)) => {
                        rmsnorm_backward_bf16(di, dw, d, x, w, s, n, c)
                    }
                    _ => unreachable!("all bf16 or all handed over as f32"),
                }
            },
        );
    }

    fn head_norm_forward(&mut self, a: &HeadNormForward) {
        let (n, h, eps) = (a.n, a.h, a.eps);
        // out and x bf16: a row at a time, no f32 copy of the activation (the weights, HS
        // each, are handed over as f32).
        let native = a.out.dtype == DType::BF16 && a.x.dtype == DType::BF16;
        let (outs, ins) = a.roles();
        let (native_outs, native_ins, rd) = ([native, false], [native, false, false], Rounding::Nearest);
        self.run_native(HeadNormForward::NAME, outs, ins, [], rd, native_outs, native_ins, |[o, r], [x, q, k], []| {
            let (r, q, k, dims) = (f32_dest(r), f32_operand(q), f32_operand(k), (h.nh, h.nkv, h.hs));
            match (o, x) {
                (Dest::F32(o), Operand::F32(x)) => head_norm_forward(o, r, x, q, k, n, dims, eps),
                (Dest::Bf16(o), Operand::Bf16(x)) => head_norm_forward(o, r, x, q, k, n, dims, eps),
                _ => unreachable!("both bf16 or both handed over as f32"),
            }
        });
    }

    fn head_norm_backward(&mut self, a: &HeadNormBackward) {
        let (n, h) = (a.n, a.h);
        // dx, dout and x bf16: a row at a time, no f32 copies of the activations.
        let native = [a.dx, a.dout, a.x].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let (native_outs, native_ins) = ([native, false, false], [native, native, false, false, false]);
        let rd = Rounding::Nearest;
        self.run_native(HeadNormBackward::NAME, outs, ins, [], rd, native_outs, native_ins, |o, i, []| {
            let ([di, dq, dk], [d, x, q, k, r]) = (o, i);
            let (dq, dk) = (f32_dest(dq), f32_dest(dk));
            let (q, k, r, dims) = (f32_operand(q), f32_operand(k), f32_operand(r), (h.nh, h.nkv, h.hs));
            match (di, d, x) {
                (Dest::F32(di), Operand::F32(d), Operand::F32(x)) => {
                    head_norm_backward(di, dq, dk, d, x, q, k, r, n, dims)
                }
                (Dest::Bf16(di), Operand::Bf16(d), Operand::Bf16(x)) => {
                    head_norm_backward(di, dq, dk, d, x, q, k, r, n, dims)
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

    #[test]
    fn head_norm_matches_finite_differences() {
        for &(n, nh, nkv, hs) in &[(1, 1, 1, 2), (3, 4, 2, 6), (5, 3, 3, 65), (2, 6, 1, 128)] {
            let w = (nh + 2 * nkv) * hs;
            let mut r = TestRng((n * 131 + nh * 7 + hs) as u64);
            let (inp, wq, wk, proj) = (r.vec(n * w), r.vec(hs), r.vec(hs), r.vec(n * w));
            let eps = 1e-6;
            let fwd = |inp: &[f32], wq: &[f32], wk: &[f32]| {
                let (mut out, mut s) = (vec![0f32; n * w], vec![0f32; n * (nh + nkv)]);
                head_norm_forward(&mut out, &mut s, inp, wq, wk, n, (nh, nkv, hs), eps);
                (out, s)
            };
            let (out, s) = fwd(&inp, &wq, &wk);
            // Each query and key head is an RMSNorm of its own; the values pass unchanged.
            for row in 0..n {
                for h in 0..nh + 2 * nkv {
                    let x = &inp[row * w + h * hs..row * w + (h + 1) * hs];
                    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / hs as f64;
                    for i in 0..hs {
                        let want = if h < nh + nkv {
                            let wt = if h < nh { wq[i] } else { wk[i] };
                            x[i] as f64 / (ms + eps as f64).sqrt() * wt as f64
                        } else {
                            x[i] as f64
                        };
                        assert!((out[row * w + h * hs + i] as f64 - want).abs() < 1e-5, "head_norm fwd");
                    }
                }
            }
            let mut dinp = vec![f32::NAN; n * w];
            let (mut dwq, mut dwk) = (vec![0f32; hs], vec![0f32; hs]);
            head_norm_backward(&mut dinp, &mut dwq, &mut dwk, &proj, &inp, &wq, &wk, &s, n, (nh, nkv, hs));
            check_grad(&inp, &dinp, |x| dot(&fwd(x, &wq, &wk).0, &proj), "dinp");
            check_grad(&wq, &dwq, |x| dot(&fwd(&inp, x, &wk).0, &proj), "dwq");
            check_grad(&wk, &dwk, |x| dot(&fwd(&inp, &wq, x).0, &proj), "dwk");
        }
    }

    /// The bf16 versions give the bits of the f32 ones on widened inputs, outputs rounded once
    /// (dinp accumulating onto bf16 values; dweight f32 either way).
    #[test]
    fn bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        let to16 = |v: Vec<f32>| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
        let narrow = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for &(n, c) in &[(1, 1), (3, 5), (17, 33), (2, 300)] {
            let mut r = TestRng((n * 7 + c) as u64);
            let (inp, w, dout, dinp0) = (to16(r.vec(n * c)), to16(r.vec(c)), to16(r.vec(n * c)), to16(r.vec(n * c)));
            let dw0 = r.vec(c);
            let (mut o, mut s) = (vec![0f32; n * c], vec![0f32; n]);
            rmsnorm_forward(&mut o, &mut s, &wide(&inp), &wide(&w), n, c, 1e-5);
            let (mut o16, mut s16) = (vec![0u16; n * c], vec![0f32; n]);
            rmsnorm_forward_bf16(&mut o16, &mut s16, &inp, &w, n, c, 1e-5);
            assert_eq!(narrow(&o), o16, "forward n={n} c={c}");
            assert_eq!(bits(&s), bits(&s16), "rstd n={n} c={c}");
            let (mut di, mut dw) = (wide(&dinp0), dw0.clone());
            rmsnorm_backward(&mut di, &mut dw, &wide(&dout), &wide(&inp), &wide(&w), &s, n, c);
            let (mut di16, mut dw16) = (dinp0.clone(), dw0.clone());
            rmsnorm_backward_bf16(&mut di16, &mut dw16, &dout, &inp, &w, &s, n, c);
            assert_eq!(narrow(&di), di16, "dinp n={n} c={c}");
            assert_eq!(bits(&dw), bits(&dw16), "dweight n={n} c={c}");
        }
    }

    /// Qwen3's head norms on bf16 activations (bits) give the f32 op's bits on the widened
    /// values, rounded once (the weights and their gradients f32 either way).
    #[test]
    fn head_norm_bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        let to16 = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for &(n, nh, nkv, hs) in &[(1, 1, 1, 1), (3, 4, 2, 5), (19, 3, 1, 8)] {
            let w = (nh + 2 * nkv) * hs;
            let mut r = TestRng((n * 13 + w) as u64);
            let (inp, dout) = (to16(&r.vec(n * w)), to16(&r.vec(n * w)));
            let (wq, wk, dw0) = (r.vec(hs), r.vec(hs), r.vec(hs));
            let (mut o, mut s) = (vec![0f32; n * w], vec![0f32; n * (nh + nkv)]);
            head_norm_forward(&mut o, &mut s, &wide(&inp), &wq, &wk, n, (nh, nkv, hs), 1e-6);
            let (mut o16, mut s16) = (vec![7u16; n * w], vec![0f32; n * (nh + nkv)]);
            head_norm_forward(&mut o16, &mut s16, &inp, &wq, &wk, n, (nh, nkv, hs), 1e-6);
            assert_eq!(to16(&o), o16, "forward n={n}");
            assert_eq!(bits(&s), bits(&s16), "rstd n={n}");
            let (mut di, mut dq, mut dk) = (vec![9f32; n * w], dw0.clone(), dw0.clone());
            head_norm_backward(&mut di, &mut dq, &mut dk, &wide(&dout), &wide(&inp), &wq, &wk, &s, n, (nh, nkv, hs));
            let (mut di16, mut dq16, mut dk16) = (vec![7u16; n * w], dw0.clone(), dw0.clone());
            head_norm_backward(&mut di16, &mut dq16, &mut dk16, &dout, &inp, &wq, &wk, &s, n, (nh, nkv, hs));
            assert_eq!(to16(&di), di16, "dinp n={n}");
            assert_eq!((bits(&dq), bits(&dk)), (bits(&dq16), bits(&dk16)), "dw n={n}");
        }
    }
}

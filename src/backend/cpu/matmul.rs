//! Matmul with bias: `out = inp @ W^T + b`, the layer behind every Linear in GPT-2.
//!
//! A thin layer over [`super::gemm`], plus the one-row (decode) dot products that skip its
//! packing.

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::gemm::{gemm_dest, parallelism, with_window};
use super::sgemm::{self, Elem};
use super::wide::{self, Dest, Operand};
use crate::backend::ops::{Call, Mat, MatmulBackward, MatmulForward, MatmulOps};

/// out (N, OC) = inp (N, C) @ weight (OC, C)^T + bias (OC), each of the three in f32 or bf16
/// (a bf16 out rounded once from the f32 result).
pub fn matmul_forward(out: Dest, inp: Operand, weight: Operand, bias: Option<&[f32]>, n: usize, c: usize, oc: usize) {
    let c_ = c as isize;
    if n == 1 && c > 0 && sgemm::fast_path_available() {
        // One position (a decode step): each weight is used once, so a GEMM's packing would
        // only add a copy of every weight to a pass that is bound by reading them.
        return with_window(c + oc, |win| {
            let (xw, ow) = win.split_at_mut(c);
            let x: &[f32] = match inp {
                Operand::F32(x) => &x[..c],
                Operand::Bf16(x) => {
                    wide::widen(xw, &x[..c]);
                    xw
                }
            };
            let bias = bias.map(|b| &b[..oc]);
            match out {
                Dest::F32(o) => gemv(&mut o[..oc], x, weight, oc, bias),
                Dest::Bf16(o) => {
                    gemv(ow, x, weight, oc, bias);
                    wide::narrow(&mut o[..oc], ow);
                }
            }
        });
    }
    gemm_dest(n, oc, c, out, oc, false, bias, inp, (c_, 1), weight, (1, c_), parallelism(n, oc, c));
}
/// Partial sums per dot product: 16 on every instruction set (two AVX2 vectors, one AVX-512),
/// so that every path adds the same products in the same order and gets the same bits.
const LANES: usize = 16;
/// Rows of W per step of [`gemv_rows`]: independent FMA chains, and x loaded once for all.
const GEMV_ROWS: usize = 4;
/// Outputs per task of the thread team.
const GEMV_CHUNK: usize = 64;

/// out (OC) = W (OC, C) @ x (C) [+ bias (OC)], threaded over the outputs; W's first `oc` rows.
fn gemv(out: &mut [f32], x: &[f32], w: Operand, oc: usize, bias: Option<&[f32]>) {
    let c = x.len();
    match w {
        Operand::F32(w) => gemv_t(out, x, &w[..oc * c], bias, gemv_rows),
        Operand::Bf16(w) => gemv_t(out, x, &w[..oc * c], bias, gemv_rows_bf16),
    }
}

/// A row kernel of [`gemv`]: out (n), x (C), rows of W (n, C), bias (n).
type GemvRows<T> = fn(&mut [f32], &[f32], &[T], Option<&[f32]>);

/// [`gemv`] for one weight type, with its row kernel.
fn gemv_t<T: Elem>(out: &mut [f32], x: &[f32], w: &[T], bias: Option<&[f32]>, rows: GemvRows<T>) {
    let c = x.len();
    let go = |j0: usize, o: &mut [f32]| rows(o, x, &w[j0 * c..(j0 + o.len()) * c], bias.map(|b| &b[j0..]));
    if out.len() * c < 1 << 16 {
        return go(0, out);
    }
    super::team::chunks_mut(out, GEMV_CHUNK, |i, o| go(i * GEMV_CHUNK, o));
}

/// The dot products of `n` rows with x, in the one order every path uses: lane l sums (with
/// FMAs, in k order) the products at k = l, l+16, ... below the last whole group of 16; the
/// lanes are added in order; the remaining products follow in order; then the bias. bf16
/// rows are widened element by element (exact), so they give the bits of their f32 widening.
#[inline(always)]
fn dots<const N: usize, T: Elem>(w: [&[T]; N], x: &[f32]) -> [f32; N] {
    /// acc[l] = w[l] * x[l] + acc[l] for the 16 lanes: one AVX-512 or two AVX2 FMAs.
    #[inline(always)]
    fn fma16<T: Elem>(acc: &mut [f32; LANES], w: &[T], x: &[f32; LANES]) {
        let w: &[T; LANES] = w.try_into().unwrap();
        for l in 0..LANES {
            acc[l] = w[l].to_f32().mul_add(x[l], acc[l]);
        }
    }
    let whole = x.len() / LANES * LANES;
    let mut acc = [[0f32; LANES]; N];
    for k in (0..whole).step_by(LANES) {
        let xs: &[f32; LANES] = x[k..k + LANES].try_into().unwrap();
        // One named accumulator per row (the compiler keeps each in registers).
        for (a, w) in acc.iter_mut().zip(&w) {
            fma16(a, &w[k..k + LANES], xs);
        }
    }
    std::array::from_fn(|r| {
        let mut s = acc[r].iter().fold(0f32, |s, a| s + a);
        for k in whole..x.len() {
            s = w[r][k].to_f32().mul_add(x[k], s);
        }
        s
    })
}

/// out (n) = rows of w (n, C) dotted with x (C), plus bias (n) when given ([`dots`]).
#[inline(always)]
fn gemv_rows_body<T: Elem>(out: &mut [f32], x: &[f32], w: &[T], bias: Option<&[f32]>) {
    let c = x.len();
    let row = |j: usize| &w[j * c..(j + 1) * c];
    let mut j = 0;
    while j + GEMV_ROWS <= out.len() {
        let d = dots::<GEMV_ROWS, T>(std::array::from_fn(|r| row(j + r)), x);
        for (r, v) in d.iter().enumerate() {
            out[j + r] = v + bias.map_or(0.0, |b| b[j + r]);
        }
        j += GEMV_ROWS;
    }
    for j in j..out.len() {
        out[j] = dots::<1, T>([row(j)], x)[0] + bias.map_or(0.0, |b| b[j]);
    }
}

crate::simd_fn! {
    /// [`gemv_rows_body`] on f32 rows.
    fn gemv_rows(out: &mut [f32], x: &[f32], w: &[f32], bias: Option<&[f32]>) {
        gemv_rows_body(out, x, w, bias)
    }
}

crate::simd_fn! {
    /// [`gemv_rows_body`] on bf16 rows.
    fn gemv_rows_bf16(out: &mut [f32], x: &[f32], w: &[u16], bias: Option<&[f32]>) {
        gemv_rows_body(out, x, w, bias)
    }
}

/// Backward of [`matmul_forward`], each buffer in f32 or bf16 but dbias (f32).
/// - `dinp (N, C)` is overwritten with `dout @ weight` (it is a per-layer scratch buffer);
/// - `dweight (OC, C) += dout^T @ inp` and `dbias (OC) += sum over rows of dout` accumulate, or
///   are overwritten when `accumulate` is false (the first backward after a zero_grad).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: Option<Dest>,
    dweight: Option<Dest>,
    dbias: Option<&mut [f32]>,
    dout: Operand,
    inp: Operand,
    weight: Operand,
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    let (c_, oc_) = (c as isize, oc as isize);
    if let Some(dinp) = dinp {
        gemm_dest(n, c, oc, dinp, c, false, None, dout, (oc_, 1), weight, (c_, 1), parallelism(n, c, oc));
    }
    if let Some(dweight) = dweight {
        gemm_dest(oc, c, n, dweight, c, accumulate, None, dout, (1, oc_), inp, (c_, 1), parallelism(oc, c, n));
    }
    if let Some(dbias) = dbias {
        match dout {
            Operand::F32(d) => bias_backward(dbias, d, n, oc, accumulate),
            Operand::Bf16(d) => bias_backward(dbias, d, n, oc, accumulate),
        }
    }
}

/// dbias (OC) [+]= column sums of dout (N, OC). Split over columns so every thread sums its
/// columns over all rows in the same order: the result does not depend on scheduling.
fn bias_backward<T: Elem>(dbias: &mut [f32], dout: &[T], n: usize, oc: usize, accumulate: bool) {
    const COLS: usize = 64;
    super::team::chunks_mut(&mut dbias[..oc], COLS, |ci, db| {
        let (c0, w) = (ci * COLS, db.len());
        if !accumulate {
            db.fill(0.0);
        }
        for row in dout[..n * oc].chunks_exact(oc) {
            for (d, g) in db.iter_mut().zip(&row[c0..c0 + w]) {
                *d += g.to_f32();
            }
        }
    });
}

impl MatmulOps for CpuBackend {
    fn matmul_forward(&mut self, a: &MatmulForward) {
        let (Mat { n, c, oc }, has_bias) = (a.m, a.bias.is_some());
        // bf16 operands are widened as the GEMM packs them, and a bf16 result is rounded a
        // window at a time ([`Dest`]); the bias (OC) goes in as f32.
        let (native, out_native) = (self.gemm_reads_bf16(), self.gemm_writes_bf16());
        let (outs, ins) = a.roles();
        let (r, native_ins) = (Rounding::Nearest, [native, native, false]);
        self.run_native(MatmulForward::NAME, outs, ins, [], r, [out_native], native_ins, |[o], [x, w, b], []| {
            let b = has_bias.then(|| f32_operand(b));
            matmul_forward(o, x, w, b, n, c, oc)
        });
    }

    fn matmul_backward(&mut self, a: &MatmulBackward) {
        let (Mat { n, c, oc }, acc) = (a.m, a.acc);
        let (has_dx, has_dw, has_db) = (a.dx.is_some(), a.dw.is_some(), a.db.is_some());
        let (native, out_native) = (self.gemm_reads_bf16(), self.gemm_writes_bf16());
        let (outs, ins) = a.roles();
        let (r, native_outs) = (Rounding::Nearest, [out_native, out_native, false]);
        self.run_native(
            MatmulBackward::NAME,
            outs,
            ins,
            [],
            r,
            native_outs,
            [native; 3],
            |[di, dw, db], [d, x, w], []| {
                let db = f32_dest(db);
                let (di, dw, db) = (has_dx.then_some(di), has_dw.then_some(dw), has_db.then_some(db));
                matmul_backward(di, dw, db, d, x, w, n, c, oc, acc)
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    fn naive(inp: &[f32], w: &[f32], b: Option<&[f32]>, n: usize, c: usize, oc: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * oc];
        for i in 0..n {
            for o in 0..oc {
                let mut s = b.map_or(0.0, |b| b[o] as f64);
                for k in 0..c {
                    s += inp[i * c + k] as f64 * w[o * c + k] as f64;
                }
                out[i * oc + o] = s as f32;
            }
        }
        out
    }

    /// One position (the decode step's dot products): against f64 on odd shapes, with and
    /// without a bias, and close to the same row through the GEMM (another summation order).
    #[test]
    fn one_row_matches_the_reference_and_the_gemm() {
        let mut rng = TestRng(17);
        for (c, oc) in [(1, 1), (15, 3), (16, 5), (17, 7), (33, 129), (768, 301)] {
            let (x, w, b) = (rng.vec(2 * c), rng.vec(oc * c), rng.vec(oc));
            for bias in [None, Some(&b[..])] {
                let mut one = vec![0f32; oc];
                matmul_forward((&mut one).into(), x[..c].into(), (&w).into(), bias, 1, c, oc);
                let want = naive(&x[..c], &w, bias, 1, c, oc);
                let mut two = vec![0f32; 2 * oc];
                matmul_forward((&mut two).into(), (&x).into(), (&w).into(), bias, 2, c, oc);
                for j in 0..oc {
                    let tol = 1e-5 * (c as f32).sqrt().max(1.0) * (1.0 + want[j].abs());
                    assert!((one[j] - want[j]).abs() <= tol, "c={c} oc={oc} j={j}: {} vs {}", one[j], want[j]);
                    assert!((one[j] - two[j]).abs() <= tol, "c={c} oc={oc} j={j}: {} vs the GEMM's {}", one[j], two[j]);
                }
            }
        }
    }

    /// bf16 buffers anywhere in the forward and backward (operands read as bf16, results
    /// rounded a window at a time): the bits of the f32 op on the widened buffers, rounded once.
    /// Where the host's bf16 tiles run bf16 x bf16 products (AMX, vdpbf16ps: another summation
    /// order), those products are held to the f32 op within fp32 accumulation's bound, and their
    /// bf16 results to their own f32 results rounded once.
    /// Shapes whose results span several windows, cut by rows and by columns, windows that do
    /// not divide them, one position (the decode step's dot products) and k = 1.
    #[test]
    fn bf16_buffers_give_the_bits_of_the_rounded_f32_op() {
        use crate::core::bf16::{from_f32, to_f32};
        let to16 = |v: &[f32]| v.iter().map(|x| from_f32(*x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|x| to_f32(*x)).collect::<Vec<f32>>();
        let round = |v: &[f32]| wide(&to16(v));
        for &(n, c, oc) in &[(1, 37, 301), (1, 1, 1), (3, 7, 5), (2900, 5, 700), (300, 3, 5000), (37, 1, 29)] {
            let mut r = TestRng((n * 7 + c * 3 + oc) as u64);
            let (inp, w, b, d) = (round(&r.vec(n * c)), round(&r.vec(oc * c)), r.vec(oc), round(&r.vec(n * oc)));
            let (inp16, w16, d16) = (to16(&inp), to16(&w), to16(&d));
            // Forward: every mix of f32 and bf16 input, weight and output.
            let mut want = vec![0f32; n * oc];
            matmul_forward((&mut want).into(), (&inp).into(), (&w).into(), Some(&b), n, c, oc);
            let want16 = to16(&want);
            // bf16 x bf16 on the host's bf16 tiles (a decode step's single row never is).
            let tiles = crate::backend::cpu::bgemm::model_engine().is_some() && n > 1;
            for (x, wt) in [(Operand::Bf16(&inp16), Operand::Bf16(&w16)), (Operand::F32(&inp), Operand::Bf16(&w16))] {
                let both = matches!(x, Operand::Bf16(_));
                let mut got = vec![0f32; n * oc];
                matmul_forward((&mut got).into(), x, wt, Some(&b), n, c, oc);
                let want16 = if tiles && both {
                    within_accumulation(&got, &want, &inp, &w, n, c, oc, "fwd");
                    to16(&got)
                } else {
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "({n},{c},{oc}) fwd f32 out"
                    );
                    want16.clone()
                };
                let mut got16 = vec![0x7FC0u16; n * oc];
                matmul_forward(Dest::Bf16(&mut got16), x, wt, Some(&b), n, c, oc);
                assert!(got16 == want16, "({n},{c},{oc}) fwd bf16 out");
            }
            // Backward: dinp overwritten, dweight accumulated and overwritten, dbias from bf16 dout.
            for accumulate in [true, false] {
                let dw0 = round(&r.vec(oc * c));
                let (mut di, mut dw, mut db) = (vec![0f32; n * c], dw0.clone(), vec![0.5f32; oc]);
                let (dout, x, wt) = ((&d).into(), (&inp).into(), (&w).into());
                matmul_backward(
                    Some((&mut di).into()),
                    Some((&mut dw).into()),
                    Some(&mut db),
                    dout,
                    x,
                    wt,
                    n,
                    c,
                    oc,
                    accumulate,
                );
                let (dout, x, wt) = (Operand::Bf16(&d16), Operand::Bf16(&inp16), Operand::Bf16(&w16));
                if tiles {
                    // The tiles' f32 results on the bf16 operands: near the f32 op's, and what
                    // the bf16 results below must round.
                    let (mut di2, mut dw2, mut db3) = (vec![0f32; n * c], dw0.clone(), vec![0.5f32; oc]);
                    let (di_, dw_) = ((&mut di2).into(), (&mut dw2).into());
                    matmul_backward(Some(di_), Some(dw_), Some(&mut db3), dout, x, wt, n, c, oc, accumulate);
                    let dt = |v: &[f32], r: usize, k: usize| {
                        (0..k * r).map(|i| v[(i % k) * r + i / k]).collect::<Vec<f32>>()
                    };
                    within_accumulation(&di2, &di, &d, &dt(&w, c, oc), n, oc, c, "dinp");
                    let dw_base: Vec<f32> = if accumulate { dw0.clone() } else { vec![0.0; oc * c] };
                    let dw_new: Vec<f32> = dw2.iter().zip(&dw_base).map(|(a, b)| a - b).collect();
                    let dw_want: Vec<f32> = dw.iter().zip(&dw_base).map(|(a, b)| a - b).collect();
                    within_accumulation(&dw_new, &dw_want, &dt(&d, oc, n), &dt(&inp, c, n), oc, n, c, "dweight");
                    (di, dw) = (di2, dw2);
                }
                let (mut di16, mut dw16, mut db2) = (vec![0u16; n * c], to16(&dw0), vec![0.5f32; oc]);
                let (di_, dw_) = (Dest::Bf16(&mut di16), Dest::Bf16(&mut dw16));
                matmul_backward(Some(di_), Some(dw_), Some(&mut db2), dout, x, wt, n, c, oc, accumulate);
                let what = format!("({n},{c},{oc}) acc={accumulate}");
                assert!(di16 == to16(&di), "{what}: dinp");
                assert!(dw16 == to16(&dw), "{what}: dweight");
                assert!(db2.iter().zip(&db).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: dbias");
            }
        }
    }

    /// `got (n, oc)` against `want` for `x (n, c) @ w (oc, c)^T`: apart by at most fp32
    /// accumulation's bound for two summation orders, 2 (c + 2) 2^-24 sum |x w| per element (the
    /// products of bf16 are exact in fp32).
    #[allow(clippy::too_many_arguments)]
    fn within_accumulation(got: &[f32], want: &[f32], x: &[f32], w: &[f32], n: usize, c: usize, oc: usize, what: &str) {
        for i in 0..n {
            for j in 0..oc {
                let mag: f64 = (0..c).map(|p| (x[i * c + p] as f64 * w[j * c + p] as f64).abs()).sum();
                let (g, e) = (got[i * oc + j] as f64, want[i * oc + j] as f64);
                let bound = 2.0 * (c + 2) as f64 * 6e-8 * (mag + e.abs()) + 1e-30;
                assert!((g - e).abs() <= bound, "{what} ({n},{c},{oc}) [{i},{j}]: {g} vs {e} (bound {bound})");
            }
        }
    }

    #[test]
    fn forward_matches_naive_on_odd_shapes() {
        for &(n, c, oc) in &[(1, 1, 1), (3, 7, 5), (7, 3, 1), (13, 17, 67), (65, 33, 129)] {
            let mut r = TestRng(n as u64 * 31 + c as u64);
            let inp = r.vec(n * c);
            let w = r.vec(oc * c);
            let b = r.vec(oc);
            let mut out = vec![0f32; n * oc];
            matmul_forward((&mut out).into(), (&inp).into(), (&w).into(), Some(&b), n, c, oc);
            assert_close(&out, &naive(&inp, &w, Some(&b), n, c, oc), 1e-5, 1e-5, "matmul fwd");
            matmul_forward((&mut out).into(), (&inp).into(), (&w).into(), None, n, c, oc);
            assert_close(&out, &naive(&inp, &w, None, n, c, oc), 1e-5, 1e-5, "matmul fwd nobias");
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, c, oc) in &[(1, 1, 1), (3, 7, 5), (7, 3, 1)] {
            let mut r = TestRng(7 + n as u64);
            let inp = r.vec(n * c);
            let w = r.vec(oc * c);
            let b = r.vec(oc);
            let proj = r.vec(n * oc);
            // loss = sum(out * proj)  =>  dout = proj
            let loss = |inp: &[f32], w: &[f32], b: &[f32]| -> f64 { dot(&naive(inp, w, Some(b), n, c, oc), &proj) };
            let mut dinp = vec![9f32; n * c];
            let mut dw = vec![0.5f32; oc * c];
            let mut db = vec![0.25f32; oc];
            matmul_backward(
                Some((&mut dinp).into()),
                Some((&mut dw).into()),
                Some(&mut db),
                (&proj).into(),
                (&inp).into(),
                (&w).into(),
                n,
                c,
                oc,
                true,
            );
            // dw and db accumulate onto their previous contents...
            dw.iter_mut().for_each(|x| *x -= 0.5);
            db.iter_mut().for_each(|x| *x -= 0.25);
            check_grad(&inp, &dinp, |x| loss(x, &w, &b), "dinp");
            check_grad(&w, &dw, |x| loss(&inp, x, &b), "dweight");
            check_grad(&b, &db, |x| loss(&inp, &w, x), "dbias");
            // ...or overwrite them: same gradients over stale contents.
            let (mut dw2, mut db2) = (vec![7f32; oc * c], vec![-3f32; oc]);
            matmul_backward(
                None,
                Some((&mut dw2).into()),
                Some(&mut db2),
                (&proj).into(),
                (&inp).into(),
                (&w).into(),
                n,
                c,
                oc,
                false,
            );
            assert_close(&dw2, &dw, 1e-6, 1e-5, "dweight overwritten");
            assert_close(&db2, &db, 1e-6, 1e-5, "dbias overwritten");
        }
    }
}

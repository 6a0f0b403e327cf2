//! Matmul with bias: `out = inp @ W^T + b`, the layer behind every Linear in GPT-2.
//!
//! Backed by our packed GEMM ([`super::sgemm`], AVX2 or AVX-512) where the CPU has AVX2+FMA, else by the
//! `gemm` crate. Transposes are expressed with strides rather than copies (the GEMMs pack
//! blocks of their operands internally, as every fast GEMM does).

use super::sgemm;
use gemm::{gemm, Parallelism};

/// Thread the GEMM only when there is enough work for it to pay (m*n*k multiply-adds).
fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m * n * k >= 1 << 18 && super::team::threads() > 1 {
        Parallelism::Rayon(super::team::threads())
    } else {
        Parallelism::None
    }
}

/// `dst (m, n) = [dst +] lhs (m, k) @ rhs (k, n)` with arbitrary strides (row stride, column stride),
/// threaded over the team ([`super::team`]) when large enough.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_s: (isize, isize),
    accumulate: bool,
    lhs: &[f32],
    lhs_s: (isize, isize),
    rhs: &[f32],
    rhs_s: (isize, isize),
) {
    gemm_impl(m, n, k, dst, dst_s, accumulate, None, lhs, lhs_s, rhs, rhs_s, parallelism(m, n, k))
}

/// [`gemm_strided`] on the calling thread only, for use inside an already parallel loop.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_serial(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_s: (isize, isize),
    accumulate: bool,
    lhs: &[f32],
    lhs_s: (isize, isize),
    rhs: &[f32],
    rhs_s: (isize, isize),
) {
    gemm_impl(m, n, k, dst, dst_s, accumulate, None, lhs, lhs_s, rhs, rhs_s, Parallelism::None)
}

/// The one dispatch to a GEMM: the packed AVX2 path when it can run, else the `gemm` crate.
/// `bias (n)`, when given and not accumulating, is added to every row of `dst`.
#[allow(clippy::too_many_arguments)]
fn gemm_impl(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (isize, isize),
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    // What makes the raw-pointer calls below sound for every input: the largest element index
    // each operand's strides reach is in bounds (computed without overflow), and no two
    // elements of dst share an address, since threads write disjoint parts of dst at once.
    assert!(
        reach(m, n, dst_rs, dst_cs).is_some_and(|x| x < dst.len()),
        "gemm: dst ({m}, {n}) with strides ({dst_rs}, {dst_cs}) reaches past its {} elements",
        dst.len()
    );
    assert!(
        rows_and_cols_disjoint(m, n, dst_rs as usize, dst_cs as usize),
        "gemm: dst strides ({dst_rs}, {dst_cs}) make elements of a ({m}, {n}) result share memory"
    );
    if k > 0 {
        assert!(
            reach(m, k, lhs_rs, lhs_cs).is_some_and(|x| x < lhs.len()),
            "gemm: lhs ({m}, {k}) with strides ({lhs_rs}, {lhs_cs}) reaches past its {} elements",
            lhs.len()
        );
        assert!(
            reach(k, n, rhs_rs, rhs_cs).is_some_and(|x| x < rhs.len()),
            "gemm: rhs ({k}, {n}) with strides ({rhs_rs}, {rhs_cs}) reaches past its {} elements",
            rhs.len()
        );
    }
    let bias = if accumulate { None } else { bias.map(|b| &b[..n]) };
    if dst_cs == 1 && sgemm::fast_path_available() {
        let threads = match par {
            Parallelism::Rayon(t) => t,
            _ => 1,
        };
        // SAFETY: as for the call below; the fast path was checked just above, and a bias has
        // n elements.
        unsafe {
            sgemm::sgemm(
                sgemm::Tile::for_rows(m),
                m,
                n,
                k,
                dst.as_mut_ptr(),
                (dst_rs, dst_cs),
                accumulate,
                bias.map_or(std::ptr::null(), |b| b.as_ptr()),
                lhs.as_ptr(),
                (lhs_rs, lhs_cs),
                rhs.as_ptr(),
                (rhs_rs, rhs_cs),
                threads,
            )
        };
        return;
    }
    if let Some(bias) = bias {
        for i in 0..m {
            for (j, b) in bias.iter().enumerate() {
                dst[i * dst_rs as usize + j * dst_cs as usize] = *b;
            }
        }
    }
    // SAFETY: all three operands are valid slices and the asserts above show every index the
    // strides address lies inside them; `dst` is a unique borrow, so it cannot alias lhs/rhs.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs,
            dst_rs,
            accumulate || bias.is_some(),
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// The largest element index of a (rows, cols) operand with strides (rs, cs), both >= 0;
/// None when a stride is negative or the index overflows. rows, cols >= 1.
fn reach(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<usize> {
    let (rs, cs) = (usize::try_from(rs).ok()?, usize::try_from(cs).ok()?);
    let x = (rows - 1).checked_mul(rs)?.checked_add((cols - 1).checked_mul(cs)?)?;
    // Offsets are formed as isize from here on.
    isize::try_from(x).ok().map(|_| x)
}

/// Whether (i, j) -> i*rs + j*cs is one-to-one on a (rows, cols) grid with both strides at
/// least 1 where they matter: one stride steps over the whole extent of the other dimension.
fn rows_and_cols_disjoint(rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    match (rows > 1, cols > 1) {
        (false, false) => true,
        (true, false) => rs >= 1,
        (false, true) => cs >= 1,
        (true, true) => {
            (cs >= 1 && cols.checked_mul(cs).is_some_and(|w| rs >= w))
                || (rs >= 1 && rows.checked_mul(rs).is_some_and(|h| cs >= h))
        }
    }
}

/// out (N, OC) = inp (N, C) @ weight (OC, C)^T + bias (OC).
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let (c_, oc_) = (c as isize, oc as isize);
    let out = &mut out[..n * oc];
    if n == 1 && c > 0 && sgemm::fast_path_available() {
        // One position (a decode step): each weight is used once, so a GEMM's packing would
        // only add a copy of every weight to a pass that is bound by reading them.
        return gemv(out, &inp[..c], &weight[..oc * c], bias.map(|b| &b[..oc]));
    }
    gemm_impl(n, oc, c, out, (oc_, 1), false, bias, inp, (c_, 1), weight, (1, c_), parallelism(n, oc, c));
}

/// Partial sums per dot product: 16 on every instruction set (two AVX2 vectors, one AVX-512),
/// so that every path adds the same products in the same order and gets the same bits.
const LANES: usize = 16;
/// Rows of W per step of [`gemv_rows`]: independent FMA chains, and x loaded once for all.
const GEMV_ROWS: usize = 4;
/// Outputs per task of the thread team.
const GEMV_CHUNK: usize = 64;

/// out (OC) = W (OC, C) @ x (C) [+ bias (OC)], threaded over the outputs.
fn gemv(out: &mut [f32], x: &[f32], w: &[f32], bias: Option<&[f32]>) {
    let c = x.len();
    let go = |j0: usize, o: &mut [f32]| gemv_rows(o, x, &w[j0 * c..(j0 + o.len()) * c], bias.map(|b| &b[j0..]));
    if out.len() * c < 1 << 16 {
        return go(0, out);
    }
    super::team::chunks_mut(out, GEMV_CHUNK, |i, o| go(i * GEMV_CHUNK, o));
}

/// The dot products of `n` rows with x, in the one order every path uses: lane l sums (with
/// FMAs, in k order) the products at k = l, l+16, ... below the last whole group of 16; the
/// lanes are added in order; the remaining products follow in order; then the bias.
#[inline(always)]
fn dots<const N: usize>(w: [&[f32]; N], x: &[f32]) -> [f32; N] {
    /// acc[l] = w[l] * x[l] + acc[l] for the 16 lanes: one AVX-512 or two AVX2 FMAs.
    #[inline(always)]
    fn fma16(acc: &mut [f32; LANES], w: &[f32], x: &[f32; LANES]) {
        let w: &[f32; LANES] = w.try_into().unwrap();
        for l in 0..LANES {
            acc[l] = w[l].mul_add(x[l], acc[l]);
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
            s = w[r][k].mul_add(x[k], s);
        }
        s
    })
}

crate::simd_fn! {
    /// out (n) = rows of w (n, C) dotted with x (C), plus bias (n) when given ([`dots`]).
    fn gemv_rows(out: &mut [f32], x: &[f32], w: &[f32], bias: Option<&[f32]>) {
        let c = x.len();
        let row = |j: usize| &w[j * c..(j + 1) * c];
        let mut j = 0;
        while j + GEMV_ROWS <= out.len() {
            let d = dots::<GEMV_ROWS>(std::array::from_fn(|r| row(j + r)), x);
            for (r, v) in d.iter().enumerate() {
                out[j + r] = v + bias.map_or(0.0, |b| b[j + r]);
            }
            j += GEMV_ROWS;
        }
        for j in j..out.len() {
            out[j] = dots::<1>([row(j)], x)[0] + bias.map_or(0.0, |b| b[j]);
        }
    }
}

/// Backward of [`matmul_forward`].
/// - `dinp (N, C)` is overwritten with `dout @ weight` (it is a per-layer scratch buffer);
/// - `dweight (OC, C) += dout^T @ inp` and `dbias (OC) += sum over rows of dout` accumulate, or
///   are overwritten when `accumulate` is false (the first backward after a zero_grad).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: Option<&mut [f32]>,
    dweight: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    let (c_, oc_) = (c as isize, oc as isize);
    if let Some(dinp) = dinp {
        gemm_strided(n, c, oc, &mut dinp[..n * c], (c_, 1), false, dout, (oc_, 1), weight, (c_, 1));
    }
    if let Some(dweight) = dweight {
        gemm_strided(oc, c, n, &mut dweight[..oc * c], (c_, 1), accumulate, dout, (1, oc_), inp, (c_, 1));
    }
    if let Some(dbias) = dbias {
        bias_backward(dbias, dout, n, oc, accumulate);
    }
}

/// dbias (OC) [+]= column sums of dout (N, OC). Split over columns so every thread sums its
/// columns over all rows in the same order: the result does not depend on scheduling.
fn bias_backward(dbias: &mut [f32], dout: &[f32], n: usize, oc: usize, accumulate: bool) {
    const COLS: usize = 64;
    super::team::chunks_mut(&mut dbias[..oc], COLS, |ci, db| {
        let (c0, w) = (ci * COLS, db.len());
        if !accumulate {
            db.fill(0.0);
        }
        for row in dout[..n * oc].chunks_exact(oc) {
            for (d, g) in db.iter_mut().zip(&row[c0..c0 + w]) {
                *d += g;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

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
                matmul_forward(&mut one, &x[..c], &w, bias, 1, c, oc);
                let want = naive(&x[..c], &w, bias, 1, c, oc);
                let mut two = vec![0f32; 2 * oc];
                matmul_forward(&mut two, &x, &w, bias, 2, c, oc);
                for j in 0..oc {
                    let tol = 1e-5 * (c as f32).sqrt().max(1.0) * (1.0 + want[j].abs());
                    assert!((one[j] - want[j]).abs() <= tol, "c={c} oc={oc} j={j}: {} vs {}", one[j], want[j]);
                    assert!((one[j] - two[j]).abs() <= tol, "c={c} oc={oc} j={j}: {} vs the GEMM's {}", one[j], two[j]);
                }
            }
        }
    }

    /// Strides that would let two elements of dst share memory, or reach past an operand
    /// (also by overflowing), are refused before any thread starts.
    #[test]
    fn gemm_strided_refuses_unsound_strides() {
        let (lhs, rhs) = (vec![1f32; 64 * 64], vec![1f32; 64 * 64]);
        let run = |m, n, dst_len, dst_s, lhs_s: (isize, isize), rhs_s: (isize, isize)| {
            let (lhs, rhs) = (&lhs, &rhs);
            std::panic::catch_unwind(move || {
                let mut dst = vec![0f32; dst_len];
                gemm_strided(m, n, 64, &mut dst, dst_s, false, lhs, lhs_s, rhs, rhs_s);
                dst
            })
        };
        // Sound: row-major and column-major results, broadcast (stride 0) inputs.
        assert!(run(64, 64, 64 * 64, (64, 1), (64, 1), (64, 1)).is_ok_and(|d| d.iter().all(|&x| x == 64.0)));
        assert!(run(64, 64, 64 * 64, (1, 64), (64, 1), (64, 1)).is_ok());
        assert!(run(64, 64, 64 * 64, (64, 1), (0, 1), (0, 0)).is_ok());
        assert!(run(1, 64, 64, (0, 1), (64, 1), (64, 1)).is_ok());
        // Rows overlapping (row stride < row width), a zero column stride, both zero.
        assert!(run(64, 64, 64 * 64, (32, 1), (64, 1), (64, 1)).is_err());
        assert!(run(64, 64, 64 * 64, (64, 0), (64, 1), (64, 1)).is_err());
        assert!(run(64, 1, 64, (0, 0), (64, 1), (64, 1)).is_err());
        // Reaching past dst or an input, negative strides, and strides whose reach overflows.
        assert!(run(64, 64, 64 * 64 - 1, (64, 1), (64, 1), (64, 1)).is_err());
        assert!(run(64, 64, 64 * 64, (64, 1), (65, 1), (64, 1)).is_err());
        assert!(run(64, 64, 64 * 64, (64, 1), (64, 1), (-64, 1)).is_err());
        assert!(run(2, 2, 4, (isize::MAX / 2 + 1, 1), (64, 1), (64, 1)).is_err());
        assert!(run(2, 2, 4, (2, 1), (isize::MAX, 1), (64, 1)).is_err());
    }

    #[test]
    fn forward_matches_naive_on_odd_shapes() {
        for &(n, c, oc) in &[(1, 1, 1), (3, 7, 5), (7, 3, 1), (13, 17, 67), (65, 33, 129)] {
            let mut r = TestRng(n as u64 * 31 + c as u64);
            let inp = r.vec(n * c);
            let w = r.vec(oc * c);
            let b = r.vec(oc);
            let mut out = vec![0f32; n * oc];
            matmul_forward(&mut out, &inp, &w, Some(&b), n, c, oc);
            assert_close(&out, &naive(&inp, &w, Some(&b), n, c, oc), 1e-5, 1e-5, "matmul fwd");
            matmul_forward(&mut out, &inp, &w, None, n, c, oc);
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
            matmul_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &proj, &inp, &w, n, c, oc, true);
            // dw and db accumulate onto their previous contents...
            dw.iter_mut().for_each(|x| *x -= 0.5);
            db.iter_mut().for_each(|x| *x -= 0.25);
            check_grad(&inp, &dinp, |x| loss(x, &w, &b), "dinp");
            check_grad(&w, &dw, |x| loss(&inp, x, &b), "dweight");
            check_grad(&b, &db, |x| loss(&inp, &w, x), "dbias");
            // ...or overwrite them: same gradients over stale contents.
            let (mut dw2, mut db2) = (vec![7f32; oc * c], vec![-3f32; oc]);
            matmul_backward(None, Some(&mut dw2), Some(&mut db2), &proj, &inp, &w, n, c, oc, false);
            assert_close(&dw2, &dw, 1e-6, 1e-5, "dweight overwritten");
            assert_close(&db2, &db, 1e-6, 1e-5, "dbias overwritten");
        }
    }
}

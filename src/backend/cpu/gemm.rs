//! The GEMM every CPU op multiplies with: `dst = [dst +] lhs @ rhs` on strided f32 or bf16
//! operands, through our packed kernels ([`super::sgemm`], [`super::bgemm`]) where the CPU has
//! AVX2+FMA, else through the `gemm` crate. Transposes are strides, not copies.
use super::bgemm;
use super::sgemm::{self, Elem};
use super::wide::{self, Dest, Operand};
use gemm::{gemm, Parallelism};
use std::sync::Mutex;

/// Thread the GEMM only when there is enough work for it to pay (m*n*k multiply-adds).
pub(super) fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
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

/// [`gemm_strided`] on operands and a result of either type: bf16 operands widened as they are
/// packed, a bf16 result rounded to nearest even once per element from its f32 value (the
/// same bits as widening everything, [`gemm_strided`], and rounding). dst's column stride is 1.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_any(
    m: usize,
    n: usize,
    k: usize,
    dst: Dest,
    dst_rs: usize,
    accumulate: bool,
    lhs: Operand,
    lhs_s: (isize, isize),
    rhs: Operand,
    rhs_s: (isize, isize),
) {
    gemm_dest(m, n, k, dst, dst_rs, accumulate, None, lhs, lhs_s, rhs, rhs_s, parallelism(m, n, k))
}

/// [`gemm_strided`] on the calling thread only, for use inside an already parallel loop, on
/// operands of either type. Always the f32 kernels (bf16 operands widened as they are packed,
/// never the host's bf16 engine): the bits of the f32 GEMM on the widened operands, on every
/// host, which is what lets attention read bf16 activations and give the f32 op's bits.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided_serial<TA: Elem, TB: Elem>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_s: (isize, isize),
    accumulate: bool,
    lhs: &[TA],
    lhs_s: (isize, isize),
    rhs: &[TB],
    rhs_s: (isize, isize),
) {
    if m == 0 || n == 0 {
        return;
    }
    check_operands(
        (m, n, k),
        (dst.len(), dst_s.0, dst_s.1),
        (lhs.len(), lhs_s.0, lhs_s.1),
        (rhs.len(), rhs_s.0, rhs_s.1),
    );
    gemm_widening(m, n, k, dst, dst_s, accumulate, None, lhs, lhs_s, rhs, rhs_s, Parallelism::None)
}

/// The one dispatch to a GEMM: the packed AVX2 path when it can run, else the `gemm` crate.
/// `bias (n)`, when given and not accumulating, is added to every row of `dst`.
#[allow(clippy::too_many_arguments)]
fn gemm_impl(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_s: (isize, isize),
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: &[f32],
    lhs_s: (isize, isize),
    rhs: &[f32],
    rhs_s: (isize, isize),
    par: Parallelism,
) {
    gemm_typed(m, n, k, dst, dst_s, accumulate, bias, lhs, lhs_s, rhs, rhs_s, par)
}

/// [`gemm_impl`] on operands of either type.
#[allow(clippy::too_many_arguments)]
fn gemm_any(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_s: (isize, isize),
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: Operand,
    lhs_s: (isize, isize),
    rhs: Operand,
    rhs_s: (isize, isize),
    par: Parallelism,
) {
    use Operand::{Bf16, F32};
    match (lhs, rhs) {
        (F32(a), F32(b)) => gemm_typed(m, n, k, dst, dst_s, accumulate, bias, a, lhs_s, b, rhs_s, par),
        (F32(a), Bf16(b)) => gemm_typed(m, n, k, dst, dst_s, accumulate, bias, a, lhs_s, b, rhs_s, par),
        (Bf16(a), F32(b)) => gemm_typed(m, n, k, dst, dst_s, accumulate, bias, a, lhs_s, b, rhs_s, par),
        (Bf16(a), Bf16(b)) => gemm_typed(m, n, k, dst, dst_s, accumulate, bias, a, lhs_s, b, rhs_s, par),
    }
}

/// Elements of the f32 window through which a bf16 GEMM result passes (4 MiB): bounded, so a
/// bf16 result as large as the classifier's weight gradient never has an f32 copy whole.
const WINDOW: usize = 1 << 20;

/// f32 windows of bf16 results, taken by one GEMM at a time and put back (as sgemm's shared
/// packing buffers: allocated once, reused).
static WINDOWS: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// `dst (m, n) = [dst +] lhs @ rhs [+ bias]` into a result of either type, row-major at row
/// stride `dst_rs`. A bf16 result of one k block is rounded by the GEMM's kernels as they
/// store it; one of several k blocks is computed a window of whole rows or whole-height columns
/// at a time into f32 (the window widened first when accumulating), then rounded: the same
/// bits as widening all of dst, computing, and rounding, since every element's sum does not
/// depend on how C is split. The window cuts the dimension whose other operand is the smaller
/// one, which the GEMM then packs again per window (the activations, not a weight).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_dest(
    m: usize,
    n: usize,
    k: usize,
    dst: Dest,
    dst_rs: usize,
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: Operand,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: Operand,
    (rhs_rs, rhs_cs): (isize, isize),
    par: Parallelism,
) {
    let dst = match dst {
        Dest::F32(d) => {
            return gemm_any(
                m,
                n,
                k,
                d,
                (dst_rs as isize, 1),
                accumulate,
                bias,
                lhs,
                (lhs_rs, lhs_cs),
                rhs,
                (rhs_rs, rhs_cs),
                par,
            )
        }
        Dest::Bf16(d) => d,
    };
    if m == 0 || n == 0 {
        return;
    }
    let bf16_engine = matches!((lhs, rhs), (Operand::Bf16(_), Operand::Bf16(_))) && bgemm::model_engine().is_some();
    if k <= sgemm::KC_MAX && sgemm::fast_path_available() && !bf16_engine {
        // One k block: the kernels round each element as they store it, no f32 window needed.
        // (The bf16 engines store f32 only: their results go through the window below.)
        check_operands(
            (m, n, k),
            (dst.len(), dst_rs as isize, 1),
            (lhs.len(), lhs_rs, lhs_cs),
            (rhs.len(), rhs_rs, rhs_cs),
        );
        let threads = match par {
            Parallelism::Rayon(t) => t,
            _ => 1,
        };
        let bias = if accumulate { None } else { bias.map(|b| &b[..n]) };
        let (bias, d) = (bias.map_or(std::ptr::null(), |b| b.as_ptr()), dst.as_mut_ptr());
        let tile = sgemm::Tile::for_rows(m);
        let (ds, ls, rs) = ((dst_rs as isize, 1), (lhs_rs, lhs_cs), (rhs_rs, rhs_cs));
        use Operand::{Bf16, F32};
        // SAFETY: check_operands shows every element the strides address lies inside its
        // buffer and that dst's elements are distinct; dst is a unique borrow, so it overlaps
        // neither input; the fast path was checked; k is one block; a bias has n elements.
        unsafe {
            match (lhs, rhs) {
                (F32(a), F32(b)) => {
                    sgemm::sgemm(tile, m, n, k, d, ds, accumulate, bias, a.as_ptr(), ls, b.as_ptr(), rs, threads)
                }
                (F32(a), Bf16(b)) => {
                    sgemm::sgemm(tile, m, n, k, d, ds, accumulate, bias, a.as_ptr(), ls, b.as_ptr(), rs, threads)
                }
                (Bf16(a), F32(b)) => {
                    sgemm::sgemm(tile, m, n, k, d, ds, accumulate, bias, a.as_ptr(), ls, b.as_ptr(), rs, threads)
                }
                (Bf16(a), Bf16(b)) => {
                    sgemm::sgemm(tile, m, n, k, d, ds, accumulate, bias, a.as_ptr(), ls, b.as_ptr(), rs, threads)
                }
            }
        }
        return;
    }
    assert!(
        (m - 1).checked_mul(dst_rs).and_then(|x| x.checked_add(n)).is_some_and(|x| x <= dst.len()) && dst_rs >= n,
        "gemm: a bf16 dst ({m}, {n}) at row stride {dst_rs} does not fit its {} elements",
        dst.len()
    );
    // Windows of whole rows (cutting m: rhs packed again per window) or of whole-height
    // column ranges (cutting n: lhs packed again per window).
    let cut_rows = m > n;
    let (rows, cols) = if cut_rows { ((WINDOW / n).clamp(1, m), n) } else { (m, (WINDOW / m).clamp(1, n)) };
    with_window(rows * cols, |pool| {
        // A window's operand starts `off` elements in; an offset past the end (an empty operand,
        // k = 0) leaves it empty.
        fn sub(x: Operand<'_>, off: isize) -> Operand<'_> {
            let off = (off as usize).min(x.len());
            match x {
                Operand::F32(v) => Operand::F32(&v[off..]),
                Operand::Bf16(v) => Operand::Bf16(&v[off..]),
            }
        }
        for i0 in (0..m).step_by(rows) {
            for j0 in (0..n).step_by(cols) {
                let (r, c) = (rows.min(m - i0), cols.min(n - j0));
                let w = &mut pool[..r * c];
                if accumulate {
                    for i in 0..r {
                        wide::widen(&mut w[i * c..(i + 1) * c], &dst[(i0 + i) * dst_rs + j0..][..c]);
                    }
                }
                let bias = bias.map(|b| &b[j0..]);
                let (a, b) = (sub(lhs, i0 as isize * lhs_rs), sub(rhs, j0 as isize * rhs_cs));
                gemm_any(r, c, k, w, (c as isize, 1), accumulate, bias, a, (lhs_rs, lhs_cs), b, (rhs_rs, rhs_cs), par);
                for i in 0..r {
                    wide::narrow(&mut dst[(i0 + i) * dst_rs + j0..][..c], &w[i * c..(i + 1) * c]);
                }
            }
        }
    })
}

/// Run `f` on an f32 window of `len` elements taken from [`WINDOWS`] (grown as needed) and put
/// back. The window starts on a 64-byte line: the AMX tiles load and store C's rows of 16
/// floats there, and a row split over two lines costs both (whether an allocation happened to
/// be aligned moved a 1B model's bf16 step by 8%).
pub(super) fn with_window<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut pool = WINDOWS.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
    if pool.len() < len + 16 {
        pool = vec![0.0; len + 16];
    }
    let at = pool.as_ptr().align_offset(64).min(16);
    let r = f(&mut pool[at..at + len]);
    WINDOWS.lock().unwrap_or_else(|e| e.into_inner()).push(pool);
    r
}

/// The one dispatch to a GEMM, for any operand types: the packed path when it can run (bf16
/// operands widened as they are packed), else the `gemm` crate (on f32 copies of bf16 operands).
#[allow(clippy::too_many_arguments)]
fn gemm_typed<TA: Elem, TB: Elem>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: &[TA],
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: &[TB],
    (rhs_rs, rhs_cs): (isize, isize),
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    check_operands((m, n, k), (dst.len(), dst_rs, dst_cs), (lhs.len(), lhs_rs, lhs_cs), (rhs.len(), rhs_rs, rhs_cs));
    let bias = if accumulate { None } else { bias.map(|b| &b[..n]) };
    if let (1, Some(a), Some(b), Some(engine)) = (dst_cs, TA::bf16s(lhs), TB::bf16s(rhs), bgemm::model_engine()) {
        // bf16 x bf16 on the host's bf16 tiles (AMX or vdpbf16ps), fp32 accumulation.
        // SAFETY: check_operands showed every element the strides address lies inside its
        // buffer (strides non-negative: it refuses others) and dst's elements distinct; dst is a
        // unique borrow; model_engine only names an engine the host runs; a bias has n elements.
        unsafe {
            bgemm::bgemm_on(
                engine,
                m,
                n,
                k,
                dst.as_mut_ptr(),
                dst_rs,
                accumulate,
                bias.map_or(std::ptr::null(), |b| b.as_ptr()),
                a.as_ptr(),
                (lhs_rs, lhs_cs),
                b.as_ptr(),
                (rhs_rs, rhs_cs),
                match par {
                    Parallelism::Rayon(t) => t,
                    _ => 1,
                },
            )
        };
        return;
    }
    gemm_widening(m, n, k, dst, (dst_rs, dst_cs), accumulate, bias, lhs, (lhs_rs, lhs_cs), rhs, (rhs_rs, rhs_cs), par)
}

/// [`gemm_typed`] on the f32 kernels whatever the operand types; the operands were checked
/// ([`check_operands`]), m, n >= 1, and the bias is cut to n (none when accumulating).
#[allow(clippy::too_many_arguments)]
fn gemm_widening<TA: Elem, TB: Elem>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    bias: Option<&[f32]>,
    lhs: &[TA],
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: &[TB],
    (rhs_rs, rhs_cs): (isize, isize),
    par: Parallelism,
) {
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
    // The gemm crate multiplies f32 only: bf16 operands go to it as f32 copies of the part
    // their strides reach (the portable path, where speed is not the point; an operand may be
    // a window into a whole activation, as attention's heads are).
    // (Checked in bounds by check_operands.)
    let extent = |rows: usize, cols: usize, (rs, cs): (isize, isize)| {
        if k == 0 {
            0
        } else {
            reach(rows, cols, rs, cs).map_or(0, |x| x + 1)
        }
    };
    let (lhs_w, rhs_w);
    let lhs: &[f32] = match TA::f32s(lhs) {
        Some(x) => x,
        None => {
            lhs_w = lhs[..extent(m, k, (lhs_rs, lhs_cs))].iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            &lhs_w
        }
    };
    let rhs: &[f32] = match TB::f32s(rhs) {
        Some(x) => x,
        None => {
            rhs_w = rhs[..extent(k, n, (rhs_rs, rhs_cs))].iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            &rhs_w
        }
    };
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

/// What makes the raw-pointer GEMM calls sound for every input: the largest element index
/// each operand's strides reach is in bounds (computed without overflow), and no two elements
/// of dst share an address, since threads write disjoint parts of dst at once. Each operand as
/// (length, row stride, column stride); m, n >= 1.
fn check_operands(
    (m, n, k): (usize, usize, usize),
    (dst_len, dst_rs, dst_cs): (usize, isize, isize),
    (lhs_len, lhs_rs, lhs_cs): (usize, isize, isize),
    (rhs_len, rhs_rs, rhs_cs): (usize, isize, isize),
) {
    assert!(
        reach(m, n, dst_rs, dst_cs).is_some_and(|x| x < dst_len),
        "gemm: dst ({m}, {n}) with strides ({dst_rs}, {dst_cs}) reaches past its {dst_len} elements"
    );
    assert!(
        rows_and_cols_disjoint(m, n, dst_rs as usize, dst_cs as usize),
        "gemm: dst strides ({dst_rs}, {dst_cs}) make elements of a ({m}, {n}) result share memory"
    );
    if k > 0 {
        assert!(
            reach(m, k, lhs_rs, lhs_cs).is_some_and(|x| x < lhs_len),
            "gemm: lhs ({m}, {k}) with strides ({lhs_rs}, {lhs_cs}) reaches past its {lhs_len} elements"
        );
        assert!(
            reach(k, n, rhs_rs, rhs_cs).is_some_and(|x| x < rhs_len),
            "gemm: rhs ({k}, {n}) with strides ({rhs_rs}, {rhs_cs}) reaches past its {rhs_len} elements"
        );
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Elementwise math written so the compiler can vectorise it (the C library's `expf`/`tanhf`
//! are scalar calls). Accurate to a few ulps, which keeps every PyTorch reference test as tight
//! as with the library functions.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// e^x (Cephes `expf`: range reduction by ln 2, degree-6 polynomial, scale by 2^n).
/// Relative error below 2e-7 on [-87, 88]; inputs outside are clamped (0 and ~1.6e38 result).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round x/ln2 to the nearest integer with the 1.5*2^23 trick (no rounding instruction needed):
    // t = 1.5*2^23 + n exactly, so n is also in t's low mantissa bits.
    let t = x * LOG2E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n built from t's bits: n = bits(t) - bits(1.5*2^23) for |n| < 2^22 (here |n| <= 127).
    // Integer ops only; `n as i32` is a saturating cast, which the compiler could not
    // vectorise and which ran as eight scalar converts and fix-ups per vector: GELU's forward
    // took ~7 cycles per element for that alone.
    let pow2n = (t.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127)) << 23;
    y * f32::from_bits(pow2n)
}

/// The total of 8 lane sums, combined as a tree. Reductions here run over 8 lanes (element i
/// in lane i % 8, written as loops over `chunks_exact(8)` that compile to one vector add per
/// chunk): a single running sum is a chain of dependent scalar adds, 4 cycles each.
#[inline(always)]
pub fn combine_lanes(acc: [f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Add `f(v_i)` into 8 lane sums, element i into lane i % 8 (see [`combine_lanes`]). Summing
/// a long vector in pieces keeps that order as long as every piece but the last is a multiple
/// of 8 long.
#[inline(always)]
pub fn add_lanes_of(acc: &mut [f32; 8], v: &[f32], f: impl Fn(f32) -> f32) {
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for ch in chunks {
        for j in 0..8 {
            acc[j] += f(ch[j]);
        }
    }
    for (j, x) in rest.iter().enumerate() {
        acc[j] += f(*x);
    }
}

/// [`add_lanes_of`] the values themselves.
#[inline(always)]
pub fn add_lanes(acc: &mut [f32; 8], v: &[f32]) {
    add_lanes_of(acc, v, |x| x);
}

/// The largest element, over 8 lanes (a single running max is a chain of dependent scalar
/// ops; `f32::max` must also skip NaNs, which keeps it scalar). NaNs are skipped here too (a
/// comparison with NaN is false); callers see them through the exps that follow. -inf for an
/// empty slice.
#[inline(always)]
pub fn max_lanes(x: &[f32]) -> f32 {
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    let mut m = [f32::NEG_INFINITY; 8];
    for c in chunks {
        for j in 0..8 {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    for (j, v) in rest.iter().enumerate() {
        m[j] = if *v > m[j] { *v } else { m[j] };
    }
    m.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// tanh(x) = 1 - 2 / (e^(2x) + 1), saturating to +-1.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_and_tanh_are_accurate() {
        let mut worst_exp = 0f64;
        let mut worst_tanh = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst_exp = worst_exp.max(((super::exp(x) as f64) - want).abs() / want);
            let t = (x as f64).tanh();
            worst_tanh = worst_tanh.max(((super::tanh(x) as f64) - t).abs());
            x += 0.001_3;
        }
        assert!(worst_exp < 2e-7, "exp relative error {worst_exp}");
        assert!(worst_tanh < 2e-7, "tanh absolute error {worst_tanh}");
        assert_eq!(super::exp(-1000.0), super::exp(-87.0));
        assert_eq!(super::tanh(50.0), 1.0);
        assert_eq!(super::tanh(-50.0), -1.0);
    }
}

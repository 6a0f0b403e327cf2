//! bf16 buffers on the CPU: whole buffers widened and narrowed across the thread team (the
//! number format itself is [`crate::core::bf16`]), and the views of a buffer an op that reads or
//! writes bf16 itself receives ([`Operand`], [`Dest`]). The convert op is [`super::bf16`].
//!
//! bf16 -> f32 is exact (a 16-bit shift). f32 -> bf16 rounds to nearest even, as PyTorch's
//! `.bfloat16()` and llm.c's `__float2bfloat16_rn`, or stochastically (llm.c's AdamW writes
//! its bf16 parameters so): up with probability equal to the fraction of the last bf16 step
//! that the dropped bits make, from a hash of (seed, element index) so the result does not
//! depend on the thread count. A NaN stays a NaN (its payload's top bits kept), an infinity an
//! infinity.

use super::team;
use crate::core::bf16::{from_f32, key, mix, round_up_by, to_f32};

/// An input as an op that reads bf16 itself receives it: f32, or bf16 (as bits). (The GEMM
/// widens a bf16 operand as it packs it, so a bf16 weight is never copied whole into f32.)
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> From<&'a [f32]> for Operand<'a> {
    fn from(x: &'a [f32]) -> Self {
        Operand::F32(x)
    }
}

impl<'a> From<&'a Vec<f32>> for Operand<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        Operand::F32(x)
    }
}

impl Operand<'_> {
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(x) => x.len(),
            Operand::Bf16(x) => x.len(),
        }
    }
}

/// An output as an op that writes bf16 itself receives it: f32, or bf16 (as bits) that the op
/// rounds to nearest even from its f32 results, once per element, as the f32 copy of the
/// output would be rounded.
pub enum Dest<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl<'a> From<&'a mut [f32]> for Dest<'a> {
    fn from(x: &'a mut [f32]) -> Self {
        Dest::F32(x)
    }
}

impl<'a> From<&'a mut Vec<f32>> for Dest<'a> {
    fn from(x: &'a mut Vec<f32>) -> Self {
        Dest::F32(x)
    }
}

/// Elements per task of a parallel conversion; smaller conversions run on the calling thread.
const CHUNK: usize = 1 << 16;

crate::simd_fn! {
    /// [`from_f32_stochastic`] of src[j] with index first + j, in runs whose indices share
    /// their high half, so the hash's input is 32-bit arithmetic (8 lanes of AVX2, where a
    /// 64-bit index gave 4).
    fn narrow_stochastic_chunk(dst: &mut [u16], src: &[f32], seed: u32, first: u64) {
        let mut j0 = 0;
        while j0 < dst.len() {
            let i = first + j0 as u64;
            let (lo, k) = (i as u32, key(seed, (i >> 32) as u32));
            let run = ((1u64 << 32) - lo as u64).min((dst.len() - j0) as u64) as usize;
            let (d, s) = (&mut dst[j0..j0 + run], &src[j0..j0 + run]);
            for (j, (d, s)) in d.iter_mut().zip(s).enumerate() {
                *d = round_up_by(*s, mix(lo.wrapping_add(j as u32) ^ k));
            }
            j0 += run;
        }
    }
}

crate::simd_fn! {
    fn widen_chunk(dst: &mut [f32], src: &[u16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = to_f32(*s);
        }
    }
}

crate::simd_fn! {
    fn narrow_chunk(dst: &mut [u16], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = from_f32(*s);
        }
    }
}

/// dst = src widened to f32 (exact), across the team for large buffers.
pub fn widen(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "widen: lengths");
    if dst.len() <= CHUNK {
        return widen_chunk(dst, src);
    }
    team::chunks_mut(dst, CHUNK, |i, d| widen_chunk(d, &src[i * CHUNK..i * CHUNK + d.len()]));
}

/// dst = src rounded to nearest even, across the team for large buffers.
pub fn narrow(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "narrow: lengths");
    if dst.len() <= CHUNK {
        return narrow_chunk(dst, src);
    }
    team::chunks_mut(dst, CHUNK, |i, d| narrow_chunk(d, &src[i * CHUNK..i * CHUNK + d.len()]));
}

/// The input gradient of a row-wise layer (a norm) on bf16 tensors: each row of dinp (N, C),
/// `rows` per task, is widened, added to in f32 by `f(row, dinp_row, dout_row, inp_row)` (those
/// rows widened too) and rounded once: the f32 op's bits on widened values, without f32 copies
/// of the activations.
pub fn add_rows_widened(
    dinp: &mut [u16],
    dout: &[u16],
    inp: &[u16],
    (n, c, rows): (usize, usize, usize),
    f: impl Fn(usize, &mut [f32], &[f32], &[f32]) + Sync,
) {
    team::chunks_mut(&mut dinp[..n * c], rows * c, |i, dinp| {
        let (mut di, mut d, mut x) = (vec![0f32; c], vec![0f32; c], vec![0f32; c]);
        for (k, drow) in dinp.chunks_exact_mut(c).enumerate() {
            let row = i * rows + k;
            widen(&mut di, drow);
            widen(&mut d, &dout[row * c..(row + 1) * c]);
            widen(&mut x, &inp[row * c..(row + 1) * c]);
            f(row, &mut di, &d, &x);
            narrow(drow, &di);
        }
    });
}
/// dst = src rounded stochastically; element i's noise is that of (seed, `first` + i), so a
/// buffer converted in pieces rounds as when converted whole.
pub fn narrow_stochastic(dst: &mut [u16], src: &[f32], seed: u32, first: u64) {
    assert_eq!(dst.len(), src.len(), "narrow_stochastic: lengths");
    team::chunks_mut(dst, CHUNK, |i, d| {
        let (at, n) = (i * CHUNK, d.len());
        narrow_stochastic_chunk(d, &src[at..at + n], seed, first + at as u64)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bf16::from_f32_stochastic;

    #[test]
    fn stochastic_rounding_is_unbiased_and_deterministic() {
        // 1 + 1/4 of a bf16 step: up a quarter of the time.
        let x = 1.0 + 0.25 / 128.0;
        let n = 1 << 16;
        let (src, mut a, mut b) = (vec![x; n], vec![0u16; n], vec![0u16; n]);
        narrow_stochastic(&mut a, &src, 7, 0);
        narrow_stochastic(&mut b, &src, 7, 0);
        assert_eq!(a, b, "the same seed gives the same bits");
        let up = a.iter().filter(|&&v| to_f32(v) > 1.0).count() as f64 / n as f64;
        assert!((up - 0.25).abs() < 0.01, "rounded up {up} of the time");
        assert!(a.iter().all(|&v| to_f32(v) == 1.0 || to_f32(v) == 1.0 + 1.0 / 128.0));
        // In pieces as whole.
        let mut c = vec![0u16; n];
        narrow_stochastic(&mut c[..1000], &src[..1000], 7, 0);
        narrow_stochastic(&mut c[1000..], &src[1000..], 7, 1000);
        assert_eq!(a, c);
        narrow_stochastic(&mut c, &src, 8, 0);
        assert_ne!(a, c, "another seed, other bits");
        // Exact values stay exact; infinities and NaNs stay what they are.
        let exact = [1.5f32, -2.0, 0.0, f32::INFINITY];
        let mut e = [0u16; 4];
        narrow_stochastic(&mut e, &exact, 3, 0);
        assert_eq!(e.map(to_f32), exact);
        assert!(to_f32(from_f32_stochastic(f32::NAN, 1, 2)).is_nan());
        // The vector loop is the element function, also across an index whose high half
        // changes (a run split at 2^32).
        let vals: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        for first in [0u64, (1 << 32) - 1000, 5 << 32] {
            let mut d = vec![0u16; vals.len()];
            narrow_stochastic(&mut d, &vals, 11, first);
            for (j, (d, x)) in d.iter().zip(&vals).enumerate() {
                assert_eq!(*d, from_f32_stochastic(*x, 11, first + j as u64), "index {first} + {j}");
            }
        }
    }

    #[test]
    fn widen_and_narrow_round_trip_across_the_team() {
        let n = 3 * CHUNK + 17; // not a multiple of a task
        let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
        let mut b = vec![0u16; n];
        narrow(&mut b, &src);
        let mut w = vec![0f32; n];
        widen(&mut w, &b);
        for (x, y) in src.iter().zip(&w) {
            assert_eq!(*y, half::bf16::from_f32(*x).to_f32());
        }
    }
}

//! bf16, the number format: the top 16 bits of an f32. bf16 -> f32 is exact (a 16-bit
//! shift). f32 -> bf16 rounds to nearest even, as PyTorch's `.bfloat16()` and llm.c's
//! `__float2bfloat16_rn`, or stochastically (llm.c's AdamW writes its bf16 parameters so): up
//! with probability equal to the fraction of the last bf16 step that the dropped bits make,
//! from a hash of (seed, element index), so the result does not depend on the thread count or
//! the device. A NaN stays a NaN (its payload's top bits kept), an infinity an infinity.

/// bf16 bits to f32.
#[inline(always)]
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, rounded to nearest even.
#[inline(always)]
pub fn from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep a quiet NaN with the top of its payload (the NaN-checking mode's marker).
        return ((bits >> 16) | 0x0040) as u16;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// A well-mixed 32-bit hash of (seed, index) (murmur3's finalizer): the random bits of
/// stochastic rounding. 32-bit arithmetic only, so a loop of it vectorises.
#[inline(always)]
fn noise(seed: u32, i: u64) -> u32 {
    mix((i as u32) ^ key(seed, (i >> 32) as u32))
}

/// The part of [`noise`]'s input that the seed and the index's high half make.
#[inline(always)]
pub fn key(seed: u32, hi: u32) -> u32 {
    hi.wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(0x85EB_CA6B)
}

/// murmur3's 32-bit finalizer.
#[inline(always)]
pub fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

/// f32 to bf16 bits, rounded stochastically with the noise of (seed, index).
#[inline(always)]
pub fn from_f32_stochastic(x: f32, seed: u32, index: u64) -> u16 {
    round_up_by(x, noise(seed, index))
}

/// f32 to bf16 bits, rounded stochastically with the random bits `noise`.
#[inline(always)]
pub fn round_up_by(x: f32, noise: u32) -> u16 {
    let bits = x.to_bits();
    // Adding 16 random bits carries into the kept half with probability (dropped bits) / 2^16.
    // A carry out of the largest finite magnitude gives an infinity, as rounding up would. An
    // infinity or a NaN rounds to nearest (it stays what it is).
    let up = (bits.wrapping_add(noise & 0xFFFF) >> 16) as u16;
    if x.is_finite() {
        up
    } else {
        from_f32(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_even_matches_the_half_crate_on_edge_values() {
        let mut vals = vec![
            0.0,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0, // a tie below: rounds to even (down)
            1.0 + 3.0 / 256.0, // a tie above: rounds to even (up)
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40, // subnormal
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..10_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = f32::from_bits(s);
            if !x.is_nan() {
                vals.push(x);
            }
        }
        for x in vals {
            assert_eq!(from_f32(x), half::bf16::from_f32(x).to_bits(), "{x:e}");
            assert_eq!(to_f32(from_f32(x)), half::bf16::from_f32(x).to_f32());
        }
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        // The NaN-checking marker's payload top survives a round trip.
        let marked = f32::from_bits(0x7FED_0000);
        assert_eq!(from_f32(marked), 0x7FED);
    }
}

//! Random numbers that match llm.c (and therefore PyTorch's CPU generator) bit for bit.
//!
//! - [`Mt19937`]: the Mersenne Twister with PyTorch's seeding and `normal_` algorithm, used for
//!   weight init and for llm.c's shuffled data order.
//! - [`random_u32`] / [`random_f32`]: llm.c's xorshift* generator used for sampling.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UMASK: u32 = 0x8000_0000;
const LMASK: u32 = 0x7fff_ffff;

/// Mersenne Twister state laid out as llm.c's `mt19937_state` so it can be written to and read
/// from llm.c's training-state files unchanged.
#[derive(Clone, PartialEq, Eq)]
pub struct Mt19937 {
    pub seed: u64,
    pub left: i32,
    pub next: u32,
    pub state: [u32; N],
}

impl std::fmt::Debug for Mt19937 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mt19937 {{ left: {}, next: {} }}", self.left, self.next)
    }
}

/// Size of llm.c's `mt19937_state` struct in bytes (u64, i32, u32, u32[624], u32[2]).
pub const MT_STATE_BYTES: usize = 8 + 4 + 4 + 4 * N + 8;

/// 16 uniforms in `d` to 16 N(mean, std) samples, as PyTorch's `normal_fill_16`.
fn box_muller16(d: &mut [f32], mean: f32, std: f32) {
    const EPS: f32 = 1e-12;
    for t in 0..8 {
        let u1 = 1.0 - d[t];
        let u2 = d[t + 8];
        let radius = (-2.0 * (u1 + EPS).ln()).sqrt();
        let theta = (2.0 * std::f64::consts::PI * u2 as f64) as f32;
        d[t] = radius * theta.cos() * std + mean;
        d[t + 8] = radius * theta.sin() * std + mean;
    }
}

impl Mt19937 {
    /// `manual_seed` in llm.c / `torch.manual_seed` on the CPU generator.
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; N];
        state[0] = seed;
        for j in 1..N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(j as u32);
        }
        // llm.c leaves `seed_` unset; we store 0 so files are deterministic.
        Mt19937 { seed: 0, left: 1, next: 0, state }
    }

    fn next_state(&mut self) {
        self.left = N as i32;
        self.next = 0;
        let s = &mut self.state;
        let mix = |a: u32, b: u32, c: u32| {
            let y = (a & UMASK) | (b & LMASK);
            c ^ (y >> 1) ^ if y & 1 == 1 { MATRIX_A } else { 0 }
        };
        for j in 0..N - M {
            s[j] = mix(s[j], s[j + 1], s[j + M]);
        }
        for j in N - M..N - 1 {
            s[j] = mix(s[j], s[j + 1], s[j + M - N]);
        }
        s[N - 1] = mix(s[N - 1], s[0], s[M - 1]);
    }

    pub fn next_u32(&mut self) -> u32 {
        self.left -= 1;
        if self.left <= 0 {
            self.next_state();
        }
        let mut y = self.state[self.next as usize];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        let lo = self.next_u32() as u64;
        (hi << 32) | lo
    }

    fn next_f32(&mut self) -> f32 {
        (self.next_u32() & ((1 << 24) - 1)) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Fill `out` with N(mean, std) samples exactly as `torch.Tensor.normal_` does on the CPU:
    /// Box-Muller over blocks of 16 uniforms for tensors of 16 or more elements, and the
    /// scalar double-precision path below that.
    pub fn normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        const EPS: f32 = 1e-12;
        let n = out.len();
        let fill16 = |d: &mut [f32]| box_muller16(d, mean, std);
        if n >= 16 {
            for x in out.iter_mut() {
                *x = self.next_f32();
            }
            let mut i = 0;
            while i + 16 <= n {
                fill16(&mut out[i..i + 16]);
                i += 16;
            }
            if !n.is_multiple_of(16) {
                // Redo the last 16 (overlapping) elements with fresh uniforms, as torch does.
                let tail = &mut out[n - 16..];
                for x in tail.iter_mut() {
                    *x = self.next_f32();
                }
                fill16(tail);
            }
        } else {
            let mut cached: Option<f64> = None;
            for x in out.iter_mut() {
                if let Some(z) = cached.take() {
                    *x = (z * std as f64 + mean as f64) as f32;
                    continue;
                }
                let u1 = self.next_f64() as f32;
                let u2 = self.next_f64() as f32;
                let radius = (-2.0 * (1.0 - u2 + EPS).ln()).sqrt();
                let theta = (2.0 * std::f64::consts::PI * u1 as f64) as f32;
                cached = Some((radius * theta.sin()) as f64);
                *x = radius * theta.cos() * std + mean;
            }
        }
    }

    /// [`Mt19937::normal`] of `n` values handed to `sink(offset, values)` in pieces of at most
    /// `piece` values (rounded up to whole blocks of 16), so that a tensor too large to hold
    /// twice can be drawn straight into its place: the same values, the same state after. A
    /// value may be handed over twice (the tail block of a length not a multiple of 16 is
    /// drawn again, as `normal_` draws it); the last one is the value.
    pub fn normal_pieces(&mut self, n: usize, mean: f32, std: f32, piece: usize, mut sink: impl FnMut(usize, &[f32])) {
        if n < 16 {
            let mut v = vec![0f32; n];
            self.normal(&mut v, mean, std);
            return sink(0, &v);
        }
        let (full, piece) = (n / 16 * 16, piece.max(16).next_multiple_of(16));
        let mut buf = vec![0f32; piece.min(full)];
        for at in (0..full).step_by(piece) {
            let d = &mut buf[..piece.min(full - at)];
            d.iter_mut().for_each(|x| *x = self.next_f32());
            d.chunks_exact_mut(16).for_each(|b| box_muller16(b, mean, std));
            sink(at, d);
        }
        if full < n {
            // The uniforms normal() draws for the last partial block and then overwrites.
            (full..n).for_each(|_| {
                self.next_f32();
            });
            let mut tail = [0f32; 16];
            tail.iter_mut().for_each(|x| *x = self.next_f32());
            box_muller16(&mut tail, mean, std);
            sink(n - 16, &tail);
        }
    }

    /// Fisher-Yates shuffle of `data` as llm.c's `random_permutation`.
    pub fn permute(&mut self, data: &mut [i32]) {
        for i in (1..data.len()).rev() {
            let j = (self.next_u32() % (i as u32 + 1)) as usize;
            data.swap(i, j);
        }
    }

    /// Serialize as llm.c's in-memory `mt19937_state` (little-endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MT_STATE_BYTES);
        b.extend_from_slice(&self.seed.to_le_bytes());
        b.extend_from_slice(&self.left.to_le_bytes());
        b.extend_from_slice(&self.next.to_le_bytes());
        for s in &self.state {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&MATRIX_A.to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != MT_STATE_BYTES {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let mut state = [0u32; N];
        for (i, s) in state.iter_mut().enumerate() {
            *s = u32_at(16 + 4 * i);
        }
        let next = u32_at(12);
        if next as usize > N {
            return None;
        }
        Some(Mt19937 { seed: u64::from_le_bytes(b[0..8].try_into().unwrap()), left: u32_at(8) as i32, next, state })
    }
}

/// llm.c's xorshift* step (`random_u32`).
pub fn random_u32(state: &mut u64) -> u32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
}

/// A float in [0, 1) from [`random_u32`] (llm.c's `random_f32`).
pub fn random_f32(state: &mut u64) -> f32 {
    (random_u32(state) >> 8) as f32 / 16_777_216.0
}

#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use super::*;

    /// The sequence documented in llm.c's rand.h, which equals `torch.manual_seed(137)`.
    #[test]
    fn matches_torch_sequence() {
        let mut r = Mt19937::new(137);
        let ints: Vec<u32> = (0..5).map(|_| r.next_u32()).collect();
        assert_eq!(ints, [4053805790, 2173880614, 380293709, 1237255315, 2986595568]);
        let mut t8 = [0f32; 8];
        r.normal(&mut t8, 0.0, 1.0);
        let want8 = [0.7947664260864258, 1.4369317293167114, -0.2292192131280899, 0.47556325793266296];
        for (a, b) in t8.iter().zip(want8) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert_eq!(r.next_u32(), 2186503452);
        let mut t16 = [0f32; 16];
        r.normal(&mut t16, 0.0, 1.0);
        let want16 = [-1.2813878059387207, -2.646395683288574, -0.06569503247737885, 0.2180829495191574];
        for (a, b) in t16.iter().zip(want16) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert_eq!(r.next_u32(), 2756748748);
    }

    #[test]
    fn state_bytes_round_trip() {
        let mut r = Mt19937::new(42);
        r.next_u32();
        let b = r.to_bytes();
        assert_eq!(b.len(), MT_STATE_BYTES);
        let mut r2 = Mt19937::from_bytes(&b).unwrap();
        assert_eq!(r.next_u32(), r2.next_u32());
        assert!(Mt19937::from_bytes(&b[1..]).is_none());
    }

    /// Drawn in pieces, normal() gives the same values and leaves the same state, for lengths
    /// below 16, multiples of 16 and not, and pieces not a multiple of 16.
    #[test]
    fn normal_in_pieces_is_normal() {
        for n in [1, 5, 15, 16, 17, 31, 32, 33, 100, 1003, 4099] {
            for piece in [1, 16, 40, 64, 5000] {
                let (mut a, mut b) = (Mt19937::new(9), Mt19937::new(9));
                let mut want = vec![0f32; n];
                a.normal(&mut want, 0.5, 0.02);
                let mut got = vec![f32::NAN; n];
                b.normal_pieces(n, 0.5, 0.02, piece, |at, v| got[at..at + v.len()].copy_from_slice(v));
                assert!(want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()), "n={n} piece={piece}");
                assert_eq!(a.next_u32(), b.next_u32(), "state after n={n} piece={piece}");
            }
        }
    }
}

//! The rotary position embedding (Llama's), in place on the q and k parts of the fused qkv
//! activation, in transformers' layout: within each head, elements i and i + HS/2 form a pair
//! that rotates by position * freq_i (`rotate_half`). The cosines and sines of every position
//! come from a table the model computes once ([`crate::models::decoder::rope_table`]).

use super::backend::{f32_operand, CpuBackend, Rounding};
use super::sgemm::Elem;
use super::team;
use super::wide::Dest;
use crate::backend::ops::{Call, Rope, RopeOps};
use crate::backend::DType;

/// Rotate the q and k heads of qkv (N, QKV) in place: row r sits at position pos + r % t.
/// rope (maxT, HS): each position's HS/2 cosines then HS/2 sines. `sign` = 1 forward, -1 for the
/// backward (the rotation by the opposite angle, its transpose). A bf16 qkv is rotated in
/// f32 and rounded once to nearest even: the f32 op's bits on the widened values, rounded.
#[allow(clippy::too_many_arguments)]
fn rotate<T: Elem>(
    qkv: &mut [T],
    rope: &[f32],
    n: usize,
    t: usize,
    pos: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
    sign: f32,
) {
    let (qkv_dim, half) = ((nh + 2 * nkv) * hs, hs / 2);
    team::chunks_mut(&mut qkv[..n * qkv_dim], qkv_dim, |r, row| {
        let p = pos + r % t;
        let (cos, sin) = rope[p * hs..(p + 1) * hs].split_at(half);
        // The q heads, then the k heads (the v heads are not rotated).
        for head in row[..(nh + nkv) * hs].chunks_exact_mut(hs) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b, s) = (x1[i].to_f32(), x2[i].to_f32(), sign * sin[i]);
                x1[i] = T::from_f32(a * cos[i] - b * s);
                x2[i] = T::from_f32(b * cos[i] + a * s);
            }
        }
    });
}

/// Forward: q, k of qkv (N, QKV) rotated in place.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<T: Elem>(
    qkv: &mut [T],
    rope: &[f32],
    n: usize,
    t: usize,
    pos: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
) {
    rotate(qkv, rope, n, t, pos, nh, nkv, hs, 1.0)
}

/// Backward: dq, dk of dqkv (N, QKV) rotated back in place (the gradient of a rotation is its
/// transpose, the rotation by the opposite angle).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<T: Elem>(
    dqkv: &mut [T],
    rope: &[f32],
    n: usize,
    t: usize,
    pos: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
) {
    rotate(dqkv, rope, n, t, pos, nh, nkv, hs, -1.0)
}

impl RopeOps for CpuBackend {
    fn rope(&mut self, a: &Rope) {
        let Rope { n, t, pos, h, inverse, .. } = *a;
        let (nh, nkv, hs) = (h.nh, h.nkv, h.hs);
        // A bf16 qkv is rotated in place, in f32, rounded once: no f32 copy.
        let native = a.qkv.dtype == DType::BF16;
        let (outs, ins) = a.roles();
        self.run_native(Rope::NAME, outs, ins, [], Rounding::Nearest, [native], [false], |[x], [r], []| {
            let r = f32_operand(r);
            match (x, inverse) {
                (Dest::F32(x), false) => rope_forward(x, r, n, t, pos, nh, nkv, hs),
                (Dest::F32(x), true) => rope_backward(x, r, n, t, pos, nh, nkv, hs),
                (Dest::Bf16(x), false) => rope_forward(x, r, n, t, pos, nh, nkv, hs),
                (Dest::Bf16(x), true) => rope_backward(x, r, n, t, pos, nh, nkv, hs),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn rotates_pairs_and_backward_is_the_transpose() {
        let (b, t, nh, nkv, hs, pos) = (2, 3, 4, 2, 6, 5);
        let (n, qkv_dim, max_t) = (b * t, (nh + 2 * nkv) * hs, pos + t);
        let mut r = TestRng(7);
        // A table of arbitrary angles: cos, sin of angle (p + 1) * (i + 1) / 7.
        let mut rope = vec![0f32; max_t * hs];
        for p in 0..max_t {
            for i in 0..hs / 2 {
                let a = ((p + 1) * (i + 1)) as f32 / 7.0;
                rope[p * hs + i] = a.cos();
                rope[p * hs + hs / 2 + i] = a.sin();
            }
        }
        let x = r.vec(n * qkv_dim);
        let mut y = x.clone();
        rope_forward(&mut y, &rope, n, t, pos, nh, nkv, hs);
        // Row 4 = batch 1, position pos + 1: q head 2's pair 1 by hand; v is untouched.
        let (row, h, i) = (4, 2, 1);
        let p = pos + row % t;
        let (cos, sin) = (rope[p * hs + i], rope[p * hs + hs / 2 + i]);
        let at = row * qkv_dim + h * hs;
        let (a, bb) = (x[at + i], x[at + hs / 2 + i]);
        assert!(
            (y[at + i] - (a * cos - bb * sin)).abs() < 1e-6 && (y[at + hs / 2 + i] - (bb * cos + a * sin)).abs() < 1e-6
        );
        let v = row * qkv_dim + (nh + nkv) * hs;
        assert_eq!(y[v..v + nkv * hs], x[v..v + nkv * hs]);
        // The backward is the transpose: <rope(x), d> = <x, rope^T(d)>.
        let d = r.vec(n * qkv_dim);
        let mut dt = d.clone();
        rope_backward(&mut dt, &rope, n, t, pos, nh, nkv, hs);
        assert!((dot(&y, &d) - dot(&x, &dt)).abs() < 1e-4);
    }

    /// On bf16 (bits), both directions give the f32 op's bits on the widened values, rounded.
    #[test]
    fn bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        let (b, t, nh, nkv, hs, pos) = (3, 5, 3, 1, 10, 2);
        let (n, qkv_dim, max_t) = (b * t, (nh + 2 * nkv) * hs, pos + t);
        let mut r = TestRng(11);
        let rope: Vec<f32> = r.vec(max_t * hs);
        let x16: Vec<u16> = r.vec(n * qkv_dim).iter().map(|&v| from_f32(v)).collect();
        for backward in [false, true] {
            let mut wide: Vec<f32> = x16.iter().map(|&v| to_f32(v)).collect();
            let mut y16 = x16.clone();
            if backward {
                rope_backward(&mut wide, &rope, n, t, pos, nh, nkv, hs);
                rope_backward(&mut y16, &rope, n, t, pos, nh, nkv, hs);
            } else {
                rope_forward(&mut wide, &rope, n, t, pos, nh, nkv, hs);
                rope_forward(&mut y16, &rope, n, t, pos, nh, nkv, hs);
            }
            let want: Vec<u16> = wide.iter().map(|&v| from_f32(v)).collect();
            assert_eq!(want, y16, "backward={backward}");
        }
    }
}

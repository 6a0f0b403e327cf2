//! GELU, tanh approximation (`nn.GELU(approximate='tanh')`, as GPT-2 and llm.c).

use super::backend::{CpuBackend, Rounding};
use super::team;
use super::wide::{Dest, Operand};
use crate::backend::ops::{Call, GeluBackward, GeluForward, GeluOps};
use crate::backend::DType;

const SCALE: f32 = 0.797_884_6; // sqrt(2 / pi)
const CHUNK: usize = 4096;

#[inline(always)]
fn gelu(x: f32) -> f32 {
    let cube = 0.044715 * x * x * x;
    0.5 * x * (1.0 + super::math::tanh(SCALE * (x + cube)))
}

#[inline(always)]
fn gelu_grad(x: f32) -> f32 {
    let cube = 0.044715 * x * x * x;
    let arg = SCALE * (x + cube);
    let th = super::math::tanh(arg);
    let sech2 = 1.0 - th * th;
    0.5 * (1.0 + th) + x * 0.5 * sech2 * SCALE * (1.0 + 3.0 * 0.044715 * x * x)
}

crate::simd_fn! {
    /// One chunk of [`gelu_forward`].
    fn gelu_chunk(out: &mut [f32], inp: &[f32]) {
        for (o, x) in out.iter_mut().zip(inp) {
            *o = gelu(*x);
        }
    }
}

crate::simd_fn! {
    /// One chunk of [`gelu_backward_inplace`].
    fn gelu_grad_chunk(d: &mut [f32], inp: &[f32]) {
        for (d, x) in d.iter_mut().zip(inp) {
            *d *= gelu_grad(*x);
        }
    }
}

crate::simd_fn! {
    /// [`gelu_chunk`] on bf16 (bits): widened as read, rounded to nearest even as stored, so
    /// the bits of the f32 pass on the widened input, rounded.
    fn gelu_chunk_bf16(out: &mut [u16], inp: &[u16]) {
        for (o, x) in out.iter_mut().zip(inp) {
            *o = crate::core::bf16::from_f32(gelu(crate::core::bf16::to_f32(*x)));
        }
    }
}

crate::simd_fn! {
    /// [`gelu_grad_chunk`] on bf16 (bits), as [`gelu_chunk_bf16`].
    fn gelu_grad_chunk_bf16(d: &mut [u16], inp: &[u16]) {
        for (d, x) in d.iter_mut().zip(inp) {
            *d = crate::core::bf16::from_f32(crate::core::bf16::to_f32(*d) * gelu_grad(crate::core::bf16::to_f32(*x)));
        }
    }
}

/// [`gelu_forward`] on bf16 buffers (bits).
pub fn gelu_forward_bf16(out: &mut [u16], inp: &[u16]) {
    assert_eq!(out.len(), inp.len(), "gelu_forward: out and inp differ in length");
    team::chunks_mut(out, CHUNK, |i, o| gelu_chunk_bf16(o, &inp[i * CHUNK..]));
}

/// [`gelu_backward_inplace`] on bf16 buffers (bits).
pub fn gelu_backward_inplace_bf16(d: &mut [u16], inp: &[u16]) {
    assert_eq!(d.len(), inp.len(), "gelu_backward: d and inp differ in length");
    team::chunks_mut(d, CHUNK, |i, d| gelu_grad_chunk_bf16(d, &inp[i * CHUNK..]));
}

/// out (N) = gelu(inp (N)).
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len(), "gelu_forward: out and inp differ in length");
    team::chunks_mut(out, CHUNK, |i, o| gelu_chunk(o, &inp[i * CHUNK..]));
}

/// In place: `d (N) *= gelu'(inp (N))`, turning d(out) into d(inp).
pub fn gelu_backward_inplace(d: &mut [f32], inp: &[f32]) {
    assert_eq!(d.len(), inp.len(), "gelu_backward: d and inp differ in length");
    team::chunks_mut(d, CHUNK, |i, d| gelu_grad_chunk(d, &inp[i * CHUNK..]));
}

impl GeluOps for CpuBackend {
    fn gelu_forward(&mut self, a: &GeluForward) {
        // Both bf16: converted in the loop, no f32 copies.
        let native = a.out.dtype == DType::BF16 && a.x.dtype == DType::BF16;
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(GeluForward::NAME, outs, ins, [], r, [native], [native], |[o], [x], []| match (o, x) {
            (Dest::F32(o), Operand::F32(x)) => gelu_forward(o, x),
            (Dest::Bf16(o), Operand::Bf16(x)) => gelu_forward_bf16(o, x),
            _ => unreachable!("both bf16 or both handed over as f32"),
        });
    }

    fn gelu_backward(&mut self, a: &GeluBackward) {
        let native = a.d.dtype == DType::BF16 && a.x.dtype == DType::BF16;
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(GeluBackward::NAME, outs, ins, [], r, [native], [native], |[d], [x], []| match (d, x) {
            (Dest::F32(d), Operand::F32(x)) => gelu_backward_inplace(d, x),
            (Dest::Bf16(d), Operand::Bf16(x)) => gelu_backward_inplace_bf16(d, x),
            _ => unreachable!("both bf16 or both handed over as f32"),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        for n in [1usize, 3, 7, 4099] {
            let mut r = TestRng(n as u64);
            let x: Vec<f32> = r.vec(n).iter().map(|v| v * 4.0).collect();
            let proj = r.vec(n);
            let fwd = |x: &[f32]| {
                let mut o = vec![0f32; x.len()];
                gelu_forward(&mut o, x);
                dot(&o, &proj)
            };
            let mut d = proj.clone();
            gelu_backward_inplace(&mut d, &x);
            check_grad(
                &x[..n.min(64)],
                &d[..n.min(64)],
                |xs| {
                    let mut full = x.clone();
                    full[..xs.len()].copy_from_slice(xs);
                    fwd(&full)
                },
                "gelu",
            );
        }
        // Known values of the tanh approximation.
        assert!((gelu(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu(-2.0) - -0.045_402_3).abs() < 1e-5);
    }
}

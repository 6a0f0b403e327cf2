//! Residual connection: out = a + b. Its backward is the identity on both inputs, which the model
//! expresses by letting both branches read the same gradient buffer, so there is no
//! `residual_backward`.

use super::backend::{CpuBackend, Rounding};
use super::team;
use super::wide::{Dest, Operand};
use crate::backend::ops::{Call, Residual, ResidualOps};
use crate::backend::DType;

const CHUNK: usize = 4096;

/// out (N) = a (N) + b (N).
pub fn residual_forward(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(a.len() == out.len() && b.len() == out.len(), "residual_forward: lengths differ");
    team::chunks_mut(out, CHUNK, |i, o| {
        for ((o, a), b) in o.iter_mut().zip(&a[i * CHUNK..]).zip(&b[i * CHUNK..]) {
            *o = a + b;
        }
    });
}

/// [`residual_forward`] on bf16 buffers (bits): the f32 sum of the widened inputs, rounded once.
pub fn residual_forward_bf16(out: &mut [u16], a: &[u16], b: &[u16]) {
    assert!(a.len() == out.len() && b.len() == out.len(), "residual_forward: lengths differ");
    team::chunks_mut(out, CHUNK, |i, o| residual_chunk_bf16(o, &a[i * CHUNK..], &b[i * CHUNK..]));
}

crate::simd_fn! {
    fn residual_chunk_bf16(out: &mut [u16], a: &[u16], b: &[u16]) {
        for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
            *o = crate::core::bf16::from_f32(crate::core::bf16::to_f32(*a) + crate::core::bf16::to_f32(*b));
        }
    }
}

impl ResidualOps for CpuBackend {
    fn residual_forward(&mut self, a: &Residual) {
        // All bf16 (a bf16 run's residual stream): converted in the loop, no f32 copies.
        let native = [a.out, a.a, a.b].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(Residual::NAME, outs, ins, [], r, [native], [native; 2], |[o], [a, b], []| match (o, a, b) {
            (Dest::F32(o), Operand::F32(a), Operand::F32(b)) => residual_forward(o, a, b),
            (Dest::Bf16(o), Operand::Bf16(a), Operand::Bf16(b)) => residual_forward_bf16(o, a, b),
            _ => unreachable!("all bf16 or all handed over as f32"),
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        let mut out = [0f32; 3];
        super::residual_forward(&mut out, &[1.0, 2.0, 3.0], &[0.5, -2.0, 1e-3]);
        assert_eq!(out, [1.5, 0.0, 3.001]);
    }
}

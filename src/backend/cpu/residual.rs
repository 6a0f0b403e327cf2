//! Residual connection: out = a + b. Its backward is the identity on both inputs, which the model
//! expresses by letting both branches read the same gradient buffer, so there is no
//! `residual_backward`.

use super::team;

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

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        let mut out = [0f32; 3];
        super::residual_forward(&mut out, &[1.0, 2.0, 3.0], &[0.5, -2.0, 1e-3]);
        assert_eq!(out, [1.5, 0.0, 3.001]);
    }
}

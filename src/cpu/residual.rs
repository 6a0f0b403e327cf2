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

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        let mut out = [0f32; 3];
        super::residual_forward(&mut out, &[1.0, 2.0, 3.0], &[0.5, -2.0, 1e-3]);
        assert_eq!(out, [1.5, 0.0, 3.001]);
    }
}

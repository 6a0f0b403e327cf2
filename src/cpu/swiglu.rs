//! SwiGLU (Llama's MLP nonlinearity): out = up * silu(gate), silu(g) = g / (1 + e^-g), from
//! the MLP's first projection holding up then gate side by side, as llm.c's llama3 branch
//! stores them (`c_fc` then `c_fc2`).

use super::math::exp;
use super::team;

/// Rows per task.
const ROWS: usize = 16;

#[inline(always)]
fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// out (N, F) = inp[:, :F] * silu(inp[:, F:]) from inp (N, 2F).
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) {
    team::chunks_mut(&mut out[..n * f], ROWS * f, |i, out| {
        let rows = &inp[i * ROWS * 2 * f..];
        forward_rows(out, rows, f);
    });
}

crate::simd_fn! {
    /// Rows of [`swiglu_forward`].
    fn forward_rows(out: &mut [f32], inp: &[f32], f: usize) {
        for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
            let (up, gate) = x.split_at(f);
            for ((o, u), g) in o.iter_mut().zip(up).zip(gate) {
                *o = u * silu(*g);
            }
        }
    }
}

/// dinp (N, 2F) = (d(up), d(gate)) from dout (N, F): d(up) = dout * silu(gate),
/// d(gate) = dout * up * silu'(gate), silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
pub fn swiglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], n: usize, f: usize) {
    team::chunks_mut(&mut dinp[..n * 2 * f], ROWS * 2 * f, |i, dinp| {
        backward_rows(dinp, &dout[i * ROWS * f..], &inp[i * ROWS * 2 * f..], f);
    });
}

crate::simd_fn! {
    /// Rows of [`swiglu_backward`].
    fn backward_rows(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize) {
        for ((di, d), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(inp.chunks_exact(2 * f)) {
            let (dup, dgate) = di.split_at_mut(f);
            let (up, gate) = x.split_at(f);
            for ((((du, dg), d), u), g) in dup.iter_mut().zip(dgate.iter_mut()).zip(d).zip(up).zip(gate) {
                let s = 1.0 / (1.0 + exp(-g));
                *du = d * (g * s);
                *dg = d * u * (s * (1.0 + g * (1.0 - s)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        for &(n, f) in &[(1, 1), (3, 5), (17, 3), (2, 65)] {
            let mut r = TestRng((n * f) as u64);
            let inp: Vec<f32> = r.vec(n * 2 * f).iter().map(|x| x * 3.0).collect();
            let proj = r.vec(n * f);
            let fwd = |x: &[f32]| {
                let mut o = vec![0f32; n * f];
                swiglu_forward(&mut o, x, n, f);
                dot(&o, &proj)
            };
            let mut o = vec![0f32; n * f];
            swiglu_forward(&mut o, &inp, n, f);
            let (u, g) = (inp[0] as f64, inp[f] as f64);
            assert!((o[0] as f64 - u * g / (1.0 + (-g).exp())).abs() < 1e-5);
            let mut d = vec![f32::NAN; n * 2 * f];
            swiglu_backward(&mut d, &proj, &inp, n, f);
            check_grad(&inp, &d, fwd, "swiglu");
        }
    }
}

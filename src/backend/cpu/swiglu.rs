//! SwiGLU (Llama's MLP nonlinearity): out = up * silu(gate), silu(g) = g / (1 + e^-g), from
//! the MLP's first projection holding up then gate side by side, as llm.c's llama3 branch
//! stores them (`c_fc` then `c_fc2`).

use super::backend::{CpuBackend, Rounding};
use super::math::exp;
use super::sgemm::Elem;
use super::team;
use super::wide::{Dest, Operand};
use crate::backend::ops::{Call, Rows, SwigluBackward, SwigluForward, SwigluOps};
use crate::backend::DType;

/// Rows per task.
const ROWS: usize = 16;

#[inline(always)]
fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// out (N, F) = inp[:, :F] * silu(inp[:, F:]) from inp (N, 2F).
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) {
    forward(out, inp, n, f, forward_rows)
}

/// [`swiglu_forward`] on bf16 buffers (bits): f32 arithmetic, each output rounded once to
/// nearest even (the bits of the f32 op on widened inputs, rounded).
pub fn swiglu_forward_bf16(out: &mut [u16], inp: &[u16], n: usize, f: usize) {
    forward(out, inp, n, f, forward_rows_bf16)
}

fn forward<T: Elem>(out: &mut [T], inp: &[T], n: usize, f: usize, rows: fn(&mut [T], &[T], usize)) {
    team::chunks_mut(&mut out[..n * f], ROWS * f, |i, out| rows(out, &inp[i * ROWS * 2 * f..], f));
}

#[inline(always)]
fn forward_body<T: Elem>(out: &mut [T], inp: &[T], f: usize) {
    for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
        let (up, gate) = x.split_at(f);
        for ((o, u), g) in o.iter_mut().zip(up).zip(gate) {
            *o = T::from_f32(u.to_f32() * silu(g.to_f32()));
        }
    }
}

crate::simd_fn! {
    /// Rows of [`swiglu_forward`].
    fn forward_rows(out: &mut [f32], inp: &[f32], f: usize) {
        forward_body(out, inp, f)
    }
}

crate::simd_fn! {
    /// Rows of [`swiglu_forward_bf16`].
    fn forward_rows_bf16(out: &mut [u16], inp: &[u16], f: usize) {
        forward_body(out, inp, f)
    }
}

/// dinp (N, 2F) = (d(up), d(gate)) from dout (N, F): d(up) = dout * silu(gate),
/// d(gate) = dout * up * silu'(gate), silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
pub fn swiglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], n: usize, f: usize) {
    backward(dinp, dout, inp, n, f, backward_rows)
}

/// [`swiglu_backward`] on bf16 buffers (bits), each gradient rounded once to nearest even.
pub fn swiglu_backward_bf16(dinp: &mut [u16], dout: &[u16], inp: &[u16], n: usize, f: usize) {
    backward(dinp, dout, inp, n, f, backward_rows_bf16)
}

type BackwardRows<T> = fn(&mut [T], &[T], &[T], usize);

fn backward<T: Elem>(dinp: &mut [T], dout: &[T], inp: &[T], n: usize, f: usize, rows: BackwardRows<T>) {
    team::chunks_mut(&mut dinp[..n * 2 * f], ROWS * 2 * f, |i, dinp| {
        rows(dinp, &dout[i * ROWS * f..], &inp[i * ROWS * 2 * f..], f);
    });
}

#[inline(always)]
fn backward_body<T: Elem>(dinp: &mut [T], dout: &[T], inp: &[T], f: usize) {
    for ((di, d), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(inp.chunks_exact(2 * f)) {
        let (dup, dgate) = di.split_at_mut(f);
        let (up, gate) = x.split_at(f);
        for ((((du, dg), d), u), g) in dup.iter_mut().zip(dgate.iter_mut()).zip(d).zip(up).zip(gate) {
            let (d, u, g) = (d.to_f32(), u.to_f32(), g.to_f32());
            let s = 1.0 / (1.0 + exp(-g));
            *du = T::from_f32(d * (g * s));
            *dg = T::from_f32(d * u * (s * (1.0 + g * (1.0 - s))));
        }
    }
}

crate::simd_fn! {
    /// Rows of [`swiglu_backward`].
    fn backward_rows(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize) {
        backward_body(dinp, dout, inp, f)
    }
}

crate::simd_fn! {
    /// Rows of [`swiglu_backward_bf16`].
    fn backward_rows_bf16(dinp: &mut [u16], dout: &[u16], inp: &[u16], f: usize) {
        backward_body(dinp, dout, inp, f)
    }
}

impl SwigluOps for CpuBackend {
    fn swiglu_forward(&mut self, a: &SwigluForward) {
        let Rows { n, c: f } = a.r;
        // Both bf16: converted in the loop, no f32 copies.
        let native = a.out.dtype == DType::BF16 && a.x.dtype == DType::BF16;
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(SwigluForward::NAME, outs, ins, [], r, [native], [native], |[o], [x], []| match (o, x) {
            (Dest::F32(o), Operand::F32(x)) => swiglu_forward(o, x, n, f),
            (Dest::Bf16(o), Operand::Bf16(x)) => swiglu_forward_bf16(o, x, n, f),
            _ => unreachable!("both bf16 or both handed over as f32"),
        });
    }

    fn swiglu_backward(&mut self, a: &SwigluBackward) {
        let Rows { n, c: f } = a.r;
        let native = [a.dx, a.dout, a.x].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(SwigluBackward::NAME, outs, ins, [], r, [native], [native; 2], |[di], [d, x], []| {
            match (di, d, x) {
                (Dest::F32(di), Operand::F32(d), Operand::F32(x)) => swiglu_backward(di, d, x, n, f),
                (Dest::Bf16(di), Operand::Bf16(d), Operand::Bf16(x)) => swiglu_backward_bf16(di, d, x, n, f),
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

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

    /// The bf16 versions give the bits of the f32 ones on widened inputs, rounded once.
    #[test]
    fn bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        for &(n, f) in &[(1, 1), (3, 5), (17, 3), (2, 65)] {
            let mut r = TestRng(7 + (n * f) as u64);
            let inp: Vec<u16> = r.vec(n * 2 * f).iter().map(|x| from_f32(x * 3.0)).collect();
            let dout: Vec<u16> = r.vec(n * f).iter().map(|&x| from_f32(x)).collect();
            let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
            let narrow = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
            let (mut o, mut o16) = (vec![0f32; n * f], vec![0u16; n * f]);
            swiglu_forward(&mut o, &wide(&inp), n, f);
            swiglu_forward_bf16(&mut o16, &inp, n, f);
            assert_eq!(narrow(&o), o16, "forward n={n} f={f}");
            let (mut d, mut d16) = (vec![0f32; n * 2 * f], vec![0u16; n * 2 * f]);
            swiglu_backward(&mut d, &wide(&dout), &wide(&inp), n, f);
            swiglu_backward_bf16(&mut d16, &dout, &inp, n, f);
            assert_eq!(narrow(&d), d16, "backward n={n} f={f}");
        }
    }
}

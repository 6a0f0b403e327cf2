//! A LoRA adapter on one linear projection, forward and backward ([`crate::model::lora`]): four skinny
//! GEMMs through [`gemm_strided_any`], which reaches the adapted rows of a fused projection's
//! output (Llama's q, k and v in one (N, QKV) buffer) in place, by its row stride. The
//! projection's input, output and their gradients may be bf16 (a bf16 run's activations): the
//! GEMMs widen them as they pack them and round the adapted columns once as they store them, so
//! no f32 copy of the whole (N, OC) output is made per adapter. The adapter itself (a, b, their
//! gradients, h, dh) is f32, as PEFT keeps it under autocast.

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::gemm::{gemm_strided_any, with_window};
use super::wide::{Dest, Operand};
use crate::backend::ops::LoraShape;
use crate::backend::ops::{Call, LoraBackward, LoraForward, LoraOps};

/// h (N, R) = scale * inp (N, C) @ a (R, C)^T, and out[:, row0..row0+ROWS] (N, OC) += h @ b (ROWS, R)^T.
pub fn lora_forward(out: Dest, h: &mut [f32], inp: Operand, a: &[f32], b: &[f32], s: LoraShape) {
    let LoraShape { n, oc, r, row0, rows, .. } = s;
    if n == 0 {
        return;
    }
    down(h, inp, a, s);
    let (h, b) = (Operand::F32(h), Operand::F32(b));
    gemm_strided_any(n, rows, r, shift(out, row0), oc, true, h, (r as isize, 1), b, (1, r as isize));
}

/// Backward of [`lora_forward`], from the forward's h (N, R) (kept, as PEFT's autograd keeps
/// lora_A's output, rather than computed again: one GEMM over inp fewer); with
/// g = dout[:, row0..row0+ROWS], db (ROWS, R) += g^T @ h, dh (N, R) = scale * g @ b,
/// da (R, C) += dh^T @ inp and dinp (N, C) += dh @ a. The adapter's gradients always add (they
/// are zeroed per step).
///
/// The products whose result has R columns (h, dh, db) are computed as their transposes, R
/// rows by N or ROWS columns, into a window and transposed back: the kernels' 12-row tiles
/// then hold R = 8 at two thirds full instead of a quarter of their 32 columns (the adapters'
/// share of a Llama 3.2 1B LoRA step in `llmrs bench` fell from 4.7% to 3.0%). Each element is the same sum in the same order either
/// way, so the bits do not change.
#[allow(clippy::too_many_arguments)]
pub fn lora_backward(
    dinp: Option<Dest>,
    da: &mut [f32],
    db: &mut [f32],
    h: &[f32],
    dh: &mut [f32],
    dout: Operand,
    inp: Operand,
    a: &[f32],
    b: &[f32],
    s: LoraShape,
) {
    let LoraShape { n, c, oc, r, row0, rows, scale } = s;
    if n == 0 {
        return;
    }
    let (c_, oc_, r_) = (c as isize, oc as isize, r as isize);
    let g = match dout {
        Operand::F32(d) => Operand::F32(&d[row0..]),
        Operand::Bf16(d) => Operand::Bf16(&d[row0..]),
    };
    let h = Operand::F32(&h[..n * r]);
    // db (ROWS, R) += g^T (ROWS, N) @ h (N, R), as db^T (R, ROWS) += h^T (R, N) @ g (N, ROWS)
    transposed(&mut db[..rows * r], rows, true, |dbt| {
        gemm_strided_any(r, rows, n, Dest::F32(dbt), rows, true, h, (1, r_), g, (oc_, 1))
    });
    // dh (N, R) = scale * g (N, ROWS) @ b (ROWS, R), as dh^T (R, N) = b^T (R, ROWS) @ g^T (ROWS, N)
    let dh = &mut dh[..n * r];
    transposed(dh, n, false, |dht| {
        gemm_strided_any(r, n, rows, Dest::F32(dht), n, false, Operand::F32(b), (1, r_), g, (1, oc_))
    });
    dh.iter_mut().for_each(|x| *x *= scale);
    let dh = Operand::F32(dh);
    // da (R, C) += dh^T (R, N) @ inp (N, C)
    gemm_strided_any(r, c, n, Dest::F32(&mut da[..r * c]), c, true, dh, (1, r_), inp, (c_, 1));
    if let Some(dinp) = dinp {
        // dinp (N, C) += dh (N, R) @ a (R, C)
        gemm_strided_any(n, c, r, dinp, c, true, dh, (r_, 1), Operand::F32(a), (c_, 1));
    }
}

/// h (N, R) = scale * inp (N, C) @ a (R, C)^T, as h^T (R, N) = a (R, C) @ inp^T (C, N).
fn down(h: &mut [f32], inp: Operand, a: &[f32], s: LoraShape) {
    let LoraShape { n, c, r, scale, .. } = s;
    let h = &mut h[..n * r];
    let (c_, a) = (c as isize, Operand::F32(a));
    transposed(h, n, false, |ht| gemm_strided_any(r, n, c, Dest::F32(ht), n, false, a, (c_, 1), inp, (1, c_)));
    h.iter_mut().for_each(|x| *x *= scale);
}

/// Run `f` on the transpose of `x` (rows, R), R = x.len() / rows, held row-major as (R, rows)
/// in one of the GEMMs' f32 windows (filled from x first when `load`), and write the result
/// back into x.
fn transposed(x: &mut [f32], rows: usize, load: bool, f: impl FnOnce(&mut [f32])) {
    if x.is_empty() {
        return;
    }
    let r = x.len() / rows;
    with_window(x.len(), |t| {
        if load {
            transpose(t, x, rows, r);
        }
        f(t);
        transpose(x, t, r, rows);
    })
}

/// dst (cols, rows) = src (rows, cols)^T, both row-major.
fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    for (i, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (j, v) in row.iter().enumerate() {
            dst[j * rows + i] = *v;
        }
    }
}

/// `out` from its element `off` on.
fn shift(out: Dest, off: usize) -> Dest {
    match out {
        Dest::F32(o) => Dest::F32(&mut o[off..]),
        Dest::Bf16(o) => Dest::Bf16(&mut o[off..]),
    }
}

impl LoraOps for CpuBackend {
    fn lora_forward(&mut self, a: &LoraForward) {
        // A bf16 projection's input and output are read and written by the adapter's GEMMs
        // themselves (widened as packed, the adapted columns rounded as stored); the adapter is f32.
        let (native, out_native) = (self.gemm_reads_bf16(), self.gemm_writes_bf16());
        let (outs, ins, s) = (a.roles().0, a.roles().1, a.s);
        let (native_outs, native_ins) = ([out_native, false], [native, false, false]);
        self.run_native(
            LoraForward::NAME,
            outs,
            ins,
            [],
            Rounding::Nearest,
            native_outs,
            native_ins,
            |[o, h], [x, a, b], []| lora_forward(o, f32_dest(h), x, f32_operand(a), f32_operand(b), s),
        );
    }

    fn lora_backward(&mut self, a: &LoraBackward) {
        let (has_dx, s) = (a.dx.is_some(), a.s);
        let (native, out_native) = (self.gemm_reads_bf16(), self.gemm_writes_bf16());
        let (outs, ins) = a.roles();
        let (native_outs, native_ins) = ([out_native, false, false, false], [native, native, false, false, false]);
        let r = Rounding::Nearest;
        self.run_native(LoraBackward::NAME, outs, ins, [], r, native_outs, native_ins, |o, i, []| {
            let ([di, da, db, dh], [d, x, a, b, h]) = (o, i);
            let (da, db, dh) = (f32_dest(da), f32_dest(db), f32_dest(dh));
            let (a, b, h) = (f32_operand(a), f32_operand(b), f32_operand(h));
            lora_backward(has_dx.then_some(di), da, db, h, dh, d, x, a, b, s)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// h, dh and db, computed as their transposes, are the bits of the products computed
    /// directly ((N, R) and (ROWS, R) results): the same sums in the same order. Shapes past
    /// a k block (N, ROWS, C > 384) and across the threaded GEMM's limits, odd sizes, N = 1.
    #[test]
    fn transposed_products_give_the_direct_bits() {
        let mut rng = crate::backend::cpu::testutil::TestRng(5);
        let mut rand = |k: usize| rng.vec(k);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for (n, c, oc, r, row0, rows) in [(1, 9, 5, 1, 0, 5), (17, 33, 40, 8, 31, 9), (700, 401, 900, 8, 100, 777)] {
            let s = LoraShape { n, c, oc, r, row0, rows, scale: 1.75 };
            let (x, a, b, dout, db0) = (rand(n * c), rand(r * c), rand(rows * r), rand(n * oc), rand(rows * r));
            let (mut h, mut dh, mut da, mut db) =
                (vec![0f32; n * r], vec![0f32; n * r], vec![0f32; r * c], db0.clone());
            let mut dx = vec![0f32; n * c];
            let (xo, g) = (Operand::F32(&x), Operand::F32(&dout));
            down(&mut h, xo, &a, s);
            lora_backward(Some(Dest::F32(&mut dx)), &mut da, &mut db, &h, &mut dh, g, xo, &a, &b, s);
            let (c_, oc_, r_) = (c as isize, oc as isize, r as isize);
            let mut want_h = vec![0f32; n * r];
            gemm_strided_any(n, r, c, Dest::F32(&mut want_h), r, false, xo, (c_, 1), Operand::F32(&a), (1, c_));
            want_h.iter_mut().for_each(|v| *v *= 1.75);
            assert_eq!(bits(&h), bits(&want_h), "h {s:?}");
            let gr = Operand::F32(&dout[row0..]);
            let mut want_dh = vec![0f32; n * r];
            gemm_strided_any(n, r, rows, Dest::F32(&mut want_dh), r, false, gr, (oc_, 1), Operand::F32(&b), (r_, 1));
            want_dh.iter_mut().for_each(|v| *v *= 1.75);
            assert_eq!(bits(&dh), bits(&want_dh), "dh {s:?}");
            let mut want_db = db0.clone();
            gemm_strided_any(rows, r, n, Dest::F32(&mut want_db), r, true, gr, (1, oc_), Operand::F32(&h), (r_, 1));
            assert_eq!(bits(&db), bits(&want_db), "db {s:?}");
        }
    }

    /// The adapter's forward and backward against f64 loops, on a fused output's middle rows,
    /// with odd sizes and N = 1.
    #[test]
    fn lora_matches_f64_loops() {
        let mut rng = crate::backend::cpu::testutil::TestRng(7);
        let mut rand = |k: usize| rng.vec(k);
        for (n, c, oc, r, row0, rows) in [(5, 7, 13, 3, 4, 6), (1, 9, 5, 1, 0, 5), (17, 33, 40, 8, 31, 9)] {
            let scale = 1.75f32;
            let s = LoraShape { n, c, oc, r, row0, rows, scale };
            let (x, a, b, dout, base) = (rand(n * c), rand(r * c), rand(rows * r), rand(n * oc), rand(n * oc));
            let (mut out, mut h, mut dh) = (base.clone(), vec![0f32; n * r], vec![0f32; n * r]);
            lora_forward(Dest::F32(&mut out), &mut h, Operand::F32(&x), &a, &b, s);
            // f64 reference
            let hf: Vec<f64> = (0..n * r)
                .map(|i| (0..c).map(|k| x[i / r * c + k] as f64 * a[i % r * c + k] as f64).sum::<f64>() * scale as f64)
                .collect();
            for i in 0..n {
                for o in 0..oc {
                    let mut want = base[i * oc + o] as f64;
                    if (row0..row0 + rows).contains(&o) {
                        want += (0..r).map(|j| hf[i * r + j] * b[(o - row0) * r + j] as f64).sum::<f64>();
                    }
                    assert!((out[i * oc + o] as f64 - want).abs() < 1e-5, "out[{i},{o}] {} vs {want}", out[i * oc + o]);
                }
            }
            let (da0, db0, dx0) = (rand(r * c), rand(rows * r), rand(n * c));
            let (mut da, mut db, mut dx) = (da0.clone(), db0.clone(), dx0.clone());
            lora_backward(
                Some(Dest::F32(&mut dx)),
                &mut da,
                &mut db,
                &h,
                &mut dh,
                Operand::F32(&dout),
                Operand::F32(&x),
                &a,
                &b,
                s,
            );
            let g = |i: usize, o: usize| dout[i * oc + row0 + o] as f64;
            let dhf: Vec<f64> = (0..n * r)
                .map(|i| (0..rows).map(|o| g(i / r, o) * b[o * r + i % r] as f64).sum::<f64>() * scale as f64)
                .collect();
            for o in 0..rows {
                for j in 0..r {
                    let want = db0[o * r + j] as f64 + (0..n).map(|i| g(i, o) * hf[i * r + j]).sum::<f64>();
                    assert!((db[o * r + j] as f64 - want).abs() < 1e-4, "db");
                }
            }
            for j in 0..r {
                for k in 0..c {
                    let want =
                        da0[j * c + k] as f64 + (0..n).map(|i| dhf[i * r + j] * x[i * c + k] as f64).sum::<f64>();
                    assert!((da[j * c + k] as f64 - want).abs() < 1e-4, "da");
                }
            }
            for i in 0..n {
                for k in 0..c {
                    let want =
                        dx0[i * c + k] as f64 + (0..r).map(|j| dhf[i * r + j] * a[j * c + k] as f64).sum::<f64>();
                    assert!((dx[i * c + k] as f64 - want).abs() < 1e-4, "dx");
                }
            }
        }
    }

    /// With a bf16 projection (input, output and their gradients bf16), the adapter gives the
    /// bits of the f32 adapter on widened copies whose results are rounded once: the GEMMs
    /// widen as they pack and round as they store. Odd sizes, N = 1, and N past a k block.
    #[test]
    fn bf16_projection_gives_the_bits_of_widened_copies() {
        use crate::core::bf16::{from_f32, to_f32};
        let mut rng = crate::backend::cpu::testutil::TestRng(11);
        let mut rand = |k: usize| rng.vec(k);
        let to16 = |v: Vec<f32>| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
        let narrow = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for (n, c, oc, r, row0, rows) in [(5, 7, 13, 3, 4, 6), (1, 9, 5, 1, 0, 5), (401, 33, 70, 8, 31, 39)] {
            let s = LoraShape { n, c, oc, r, row0, rows, scale: 1.75 };
            let (x, out0, dout, dx0) = (to16(rand(n * c)), to16(rand(n * oc)), to16(rand(n * oc)), to16(rand(n * c)));
            let (a, b) = (rand(r * c), rand(rows * r));
            let (mut h, mut h16) = (vec![0f32; n * r], vec![0f32; n * r]);
            let mut out = wide(&out0);
            lora_forward(Dest::F32(&mut out), &mut h, Operand::F32(&wide(&x)), &a, &b, s);
            let mut out16 = out0.clone();
            lora_forward(Dest::Bf16(&mut out16), &mut h16, Operand::Bf16(&x), &a, &b, s);
            assert_eq!(narrow(&out), out16, "forward {s:?}");
            let (da0, db0) = (rand(r * c), rand(rows * r));
            let (mut da, mut db, mut dh, mut dx) = (da0.clone(), db0.clone(), vec![0f32; n * r], wide(&dx0));
            let (d, xw) = (wide(&dout), wide(&x));
            lora_backward(
                Some(Dest::F32(&mut dx)),
                &mut da,
                &mut db,
                &h,
                &mut dh,
                Operand::F32(&d),
                Operand::F32(&xw),
                &a,
                &b,
                s,
            );
            let (mut da16, mut db16, mut dh16, mut dx16) = (da0.clone(), db0.clone(), vec![0f32; n * r], dx0.clone());
            let (g, xb) = (Operand::Bf16(&dout), Operand::Bf16(&x));
            lora_backward(Some(Dest::Bf16(&mut dx16)), &mut da16, &mut db16, &h16, &mut dh16, g, xb, &a, &b, s);
            assert_eq!(narrow(&dx), dx16, "dinp {s:?}");
            assert_eq!(bits(&da), bits(&da16), "da {s:?}");
            assert_eq!(bits(&db), bits(&db16), "db {s:?}");
        }
    }
}

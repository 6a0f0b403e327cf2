//! A LoRA adapter on one linear projection, forward and backward ([`crate::lora`]): four skinny
//! GEMMs through [`gemm_strided`], which reaches the adapted rows of a fused projection's
//! output (Llama's q, k and v in one (N, QKV) buffer) in place, by its row stride.

use super::matmul::gemm_strided;
use crate::backend::LoraShape;

/// h (N, R) = scale * inp (N, C) @ a (R, C)^T, and out[:, row0..row0+ROWS] (N, OC) += h @ b (ROWS, R)^T.
pub fn lora_forward(out: &mut [f32], h: &mut [f32], inp: &[f32], a: &[f32], b: &[f32], s: LoraShape) {
    let LoraShape { n, oc, r, row0, rows, .. } = s;
    if n == 0 {
        return;
    }
    down(h, inp, a, s);
    let (oc_, r_) = (oc as isize, r as isize);
    gemm_strided(n, rows, r, &mut out[row0..], (oc_, 1), true, h, (r_, 1), b, (1, r_));
}

/// Backward of [`lora_forward`]: h is recomputed; with g = dout[:, row0..row0+ROWS],
/// db (ROWS, R) += g^T @ h, dh (N, R) = scale * g @ b, da (R, C) += dh^T @ inp and
/// dinp (N, C) += dh @ a. The adapter's gradients always add (they are zeroed per step).
#[allow(clippy::too_many_arguments)]
pub fn lora_backward(
    dinp: Option<&mut [f32]>,
    da: &mut [f32],
    db: &mut [f32],
    h: &mut [f32],
    dh: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    a: &[f32],
    b: &[f32],
    s: LoraShape,
) {
    let LoraShape { n, c, oc, r, row0, rows, scale } = s;
    if n == 0 {
        return;
    }
    down(h, inp, a, s);
    let (c_, oc_, r_) = (c as isize, oc as isize, r as isize);
    let g = &dout[row0..];
    // db (ROWS, R) += g^T (ROWS, N) @ h (N, R)
    gemm_strided(rows, r, n, &mut db[..rows * r], (r_, 1), true, g, (1, oc_), h, (r_, 1));
    // dh (N, R) = scale * g (N, ROWS) @ b (ROWS, R)
    let dh = &mut dh[..n * r];
    gemm_strided(n, r, rows, dh, (r_, 1), false, g, (oc_, 1), b, (r_, 1));
    dh.iter_mut().for_each(|x| *x *= scale);
    // da (R, C) += dh^T (R, N) @ inp (N, C)
    gemm_strided(r, c, n, &mut da[..r * c], (c_, 1), true, dh, (1, r_), inp, (c_, 1));
    if let Some(dinp) = dinp {
        // dinp (N, C) += dh (N, R) @ a (R, C)
        gemm_strided(n, c, r, &mut dinp[..n * c], (c_, 1), true, dh, (r_, 1), a, (c_, 1));
    }
}

/// h (N, R) = scale * inp (N, C) @ a (R, C)^T.
fn down(h: &mut [f32], inp: &[f32], a: &[f32], s: LoraShape) {
    let LoraShape { n, c, r, scale, .. } = s;
    let h = &mut h[..n * r];
    gemm_strided(n, r, c, h, (r as isize, 1), false, inp, (c as isize, 1), a, (1, c as isize));
    h.iter_mut().for_each(|x| *x *= scale);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The adapter's forward and backward against f64 loops, on a fused output's middle rows,
    /// with odd sizes and N = 1.
    #[test]
    fn lora_matches_f64_loops() {
        let mut rng = crate::cpu::testutil::TestRng(7);
        let mut rand = |k: usize| rng.vec(k);
        for (n, c, oc, r, row0, rows) in [(5, 7, 13, 3, 4, 6), (1, 9, 5, 1, 0, 5), (17, 33, 40, 8, 31, 9)] {
            let scale = 1.75f32;
            let s = LoraShape { n, c, oc, r, row0, rows, scale };
            let (x, a, b, dout, base) = (rand(n * c), rand(r * c), rand(rows * r), rand(n * oc), rand(n * oc));
            let (mut out, mut h, mut dh) = (base.clone(), vec![0f32; n * r], vec![0f32; n * r]);
            lora_forward(&mut out, &mut h, &x, &a, &b, s);
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
            lora_backward(Some(&mut dx), &mut da, &mut db, &mut h, &mut dh, &dout, &x, &a, &b, s);
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
}

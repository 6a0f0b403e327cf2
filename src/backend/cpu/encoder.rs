//! Token embedding, plus GPT-2's learned position embedding (Llama has none: its positions
//! are rotary, inside attention).

use super::backend::{f32_dest, CpuBackend, Rounding};
use super::sgemm::Elem;
use super::team;
use super::wide::Operand;
use crate::backend::ops::Out::{Rw, W};
use crate::backend::ops::{opt, Call, EncoderBackward, EncoderForward, EncoderOps, NONE};
use crate::backend::Backend;
use crate::backend::DType;

/// out (B, T, C) = wte (Vp, C)[inp (B, T)] [+ wpe (T, C)[t]]. Token ids must already be < V.
/// The tables f32 or bf16: only the rows the batch reads are widened (exact).
pub fn encoder_forward(out: &mut [f32], inp: &[u32], wte: Operand, wpe: Option<Operand>, b: usize, t: usize, c: usize) {
    use Operand::{Bf16, F32};
    match (wte, wpe) {
        (F32(w), None) => forward::<f32, f32>(out, inp, w, None, b, t, c),
        (Bf16(w), None) => forward::<u16, f32>(out, inp, w, None, b, t, c),
        (F32(w), Some(F32(p))) => forward(out, inp, w, Some(p), b, t, c),
        (F32(w), Some(Bf16(p))) => forward(out, inp, w, Some(p), b, t, c),
        (Bf16(w), Some(F32(p))) => forward(out, inp, w, Some(p), b, t, c),
        (Bf16(w), Some(Bf16(p))) => forward(out, inp, w, Some(p), b, t, c),
    }
}

/// [`encoder_forward`] for one pair of table types.
fn forward<W: Elem, P: Elem>(out: &mut [f32], inp: &[u32], wte: &[W], wpe: Option<&[P]>, b: usize, t: usize, c: usize) {
    team::chunks_mut(&mut out[..b * t * c], c, |bt, o| {
        let tok = inp[bt] as usize;
        let we = &wte[tok * c..(tok + 1) * c];
        match wpe {
            Some(wpe) => {
                let pos = bt % t;
                let pe = &wpe[pos * c..(pos + 1) * c];
                for i in 0..c {
                    o[i] = we[i].to_f32() + pe[i].to_f32();
                }
            }
            None => o.iter_mut().zip(we).for_each(|(o, w)| *o = w.to_f32()),
        }
    });
}

/// dwte += scatter of dout by token, dwpe (T, C) += sum over the batch of dout.
/// Sequential over positions for dwte (tokens repeat, and the scatter is cheap next to the
/// matmuls); this keeps the summation order fixed.
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    for bt in 0..b * t {
        let tok = inp[bt] as usize;
        let d = &dout[bt * c..(bt + 1) * c];
        for (w, g) in dwte[tok * c..(tok + 1) * c].iter_mut().zip(d) {
            *w += g;
        }
    }
    let Some(dwpe) = dwpe else { return };
    team::chunks_mut(&mut dwpe[..t * c], c, |pos, dp| {
        for bi in 0..b {
            let d = &dout[(bi * t + pos) * c..(bi * t + pos + 1) * c];
            for (w, g) in dp.iter_mut().zip(d) {
                *w += g;
            }
        }
    });
}

/// [`encoder_backward`] into bf16 gradients (bits): each row a token of the batch touches is
/// widened, gets that token's positions added in order in f32, and is rounded once, so the
/// result is the f32 pass's rounded to bf16, while the other rows of the (Vp, C) table are
/// not read at all.
pub fn encoder_backward_bf16(
    dwte: &mut [u16],
    dwpe: Option<&mut [u16]>,
    dout: &[f32],
    inp: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    use super::wide;
    let mut order: Vec<usize> = (0..b * t).collect();
    order.sort_by_key(|&bt| inp[bt]); // stable: each token's positions stay in order
    let mut row = vec![0f32; c];
    for group in order.chunk_by(|&x, &y| inp[x] == inp[y]) {
        let tok = inp[group[0]] as usize;
        let w = &mut dwte[tok * c..(tok + 1) * c];
        wide::widen(&mut row, w);
        for &bt in group {
            for (r, g) in row.iter_mut().zip(&dout[bt * c..(bt + 1) * c]) {
                *r += g;
            }
        }
        wide::narrow(w, &row);
    }
    let Some(dwpe) = dwpe else { return };
    team::chunks_mut(&mut dwpe[..t * c], c, |pos, dp| {
        let mut row = vec![0f32; c];
        wide::widen(&mut row, dp);
        for bi in 0..b {
            for (w, g) in row.iter_mut().zip(&dout[(bi * t + pos) * c..(bi * t + pos + 1) * c]) {
                *w += g;
            }
        }
        wide::narrow(dp, &row);
    });
}

impl EncoderOps for CpuBackend {
    fn encoder_forward(&mut self, a: &EncoderForward) {
        let EncoderForward { out, ids, wte, wpe, s, c } = *a;
        let has_wpe = wpe.is_some();
        // bf16 tables are read as they are: only the rows of the batch's tokens are widened.
        let (ins, r) = ([wte, opt(wpe)], Rounding::Nearest);
        self.run_native(EncoderForward::NAME, [W(out)], ins, [ids], r, [false], [true; 2], |[o], [wte, wpe], [ids]| {
            encoder_forward(f32_dest(o), ids, wte, has_wpe.then_some(wpe), s.b, s.t, c)
        });
    }

    fn encoder_backward(&mut self, a: &EncoderBackward) {
        let EncoderBackward { dwte, dwpe, dout, ids, s, c } = *a;
        if dwte.dtype == DType::BF16 && dwpe.is_none_or(|p| p.dtype == DType::BF16) {
            return self.encoder_backward_bf16(a);
        }
        let has_wpe = dwpe.is_some();
        let outs = [Rw(dwte), dwpe.map_or(W(NONE), Rw)];
        self.run(EncoderBackward::NAME, outs, [dout], [ids], |[dwte, dwpe], [dout], [ids]| {
            encoder_backward(dwte, has_wpe.then_some(dwpe), dout, ids, s.b, s.t, c)
        });
    }
}

impl CpuBackend {
    /// encoder_backward into bf16 gradients: only the rows the batch's tokens touch are
    /// widened (the f32 path would widen and round the whole (Vp, C) table).
    fn encoder_backward_bf16(&mut self, a: &EncoderBackward) {
        let EncoderBackward { dwte, dwpe, dout, ids, s, c } = *a;
        for (o, x) in [(dwte, dout), (dwte, ids), (opt(dwpe), dout), (opt(dwpe), dwte)] {
            assert!(!o.overlaps(x), "encoder_backward: output {o:?} overlaps {x:?}");
        }
        let mut d = vec![0f32; dout.len];
        self.download(dout, &mut d).expect("the CPU's download does not fail");
        let p = self.ptr_u32(ids);
        // SAFETY: p addresses ids.len u32s of a live allocation; copied out at once.
        let ids = unsafe { std::slice::from_raw_parts(p, ids.len) }.to_vec();
        let mut wpe = dwpe.map(|p| self.bf16_slice(p).to_vec());
        encoder_backward_bf16(self.bf16_slice(dwte), wpe.as_deref_mut(), &d, &ids, s.b, s.t, c);
        if let (Some(p), Some(w)) = (dwpe, wpe) {
            self.bf16_slice(p).copy_from_slice(&w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, c, v) = (3, 7, 5, 11);
        let mut r = TestRng(3);
        let wte = r.vec(v * c);
        let wpe = r.vec(t * c);
        let inp: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % v) as u32).collect();
        let proj = r.vec(b * t * c);
        let fwd = |wte: &[f32], wpe: &[f32]| {
            let mut o = vec![0f32; b * t * c];
            encoder_forward(&mut o, &inp, wte.into(), Some(wpe.into()), b, t, c);
            dot(&o, &proj)
        };
        let (mut dwte, mut dwpe) = (vec![0f32; v * c], vec![0f32; t * c]);
        encoder_backward(&mut dwte, Some(&mut dwpe), &proj, &inp, b, t, c);
        check_grad(&wte, &dwte, |x| fwd(x, &wpe), "dwte");
        check_grad(&wpe, &dwpe, |x| fwd(&wte, x), "dwpe");
        // Without positions: the token rows alone.
        let mut o = vec![0f32; b * t * c];
        encoder_forward(&mut o, &inp, (&wte).into(), None, b, t, c);
        assert_eq!(o[2 * c..3 * c], wte[inp[2] as usize * c..][..c]);
        let mut dwte2 = vec![0f32; v * c];
        encoder_backward(&mut dwte2, None, &proj, &inp, b, t, c);
        assert_eq!(dwte2, dwte);
    }
}

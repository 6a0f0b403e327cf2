//! A LoRA adapter's term on the GPU (the CPU's is cpu/lora.rs): matmul.wgsl's GEMM, which
//! reaches the adapted rows of a fused projection's output by its row stride, and one scaling
//! kernel (kernels/lora.wgsl). Rows of N beyond one binding window go piece by piece; the
//! adapter's gradients add over the pieces. A (R, C) and B (ROWS, R) each fit one window: R*C
//! and ROWS*R floats are megabytes for any model, against windows of 128 MiB or more.

use super::matmul::{block, Batches, Operand, ACCUMULATE};
use super::{f, u, GpuBackend, Threads, K};
use crate::backend::{Buf, LoraShape};

impl GpuBackend {
    /// h (N, R) = scale * inp (N, C) @ a (R, C)^T; out[:, row0..row0+ROWS] (N, OC) += h @ b^T.
    pub(super) fn lora_forward_(&mut self, out: Buf, h: Buf, inp: Buf, a: Buf, b: Buf, s: LoraShape) {
        Self::disjoint("lora_forward", &[out, h], &[inp, a, b]);
        let LoraShape { n, c, oc, r, row0, rows, .. } = s;
        let cols = row0..row0 + rows;
        for p in self.mem.row_pieces(n, &[(out, oc), (inp, c), (h, r)]) {
            let hp = self.lora_down(h, inp, a, &p, s);
            let (ha, bb) = (Operand::rows(hp, r), Operand::transposed(b, r));
            let o = Operand::rows(block(out, oc, &p, &cols), oc);
            self.gemm((p.len(), rows, r), ha, bb, o, None, ACCUMULATE, Batches::ONE);
        }
    }

    /// Its backward, from the forward's h: with g = dout[:, row0..row0+ROWS]: db (ROWS, R) +=
    /// g^T @ h, dh (N, R) = scale * g @ b, da (R, C) += dh^T @ inp, dinp (N, C) += dh @ a.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_backward_(
        &mut self,
        dinp: Option<Buf>,
        da: Buf,
        db: Buf,
        h: Buf,
        dh: Buf,
        dout: Buf,
        inp: Buf,
        a: Buf,
        b: Buf,
        s: LoraShape,
    ) {
        let outs: Vec<Buf> = [Some(da), Some(db), Some(dh), dinp].into_iter().flatten().collect();
        Self::disjoint("lora_backward", &outs, &[dout, inp, a, b, h]);
        let LoraShape { n, c, oc, r, row0, rows, scale } = s;
        let cols = row0..row0 + rows;
        let row_bufs: Vec<_> =
            [(dout, oc), (inp, c), (h, r), (dh, r)].into_iter().chain(dinp.map(|d| (d, c))).collect();
        for p in self.mem.row_pieces(n, &row_bufs) {
            let hp = h.slice(p.start * r..p.end * r);
            let g = block(dout, oc, &p, &cols); // (len, ROWS), rows OC apart
            let dhp = dh.slice(p.start * r..p.end * r);
            let xp = inp.slice(p.start * c..p.end * c);
            // db (ROWS, R) += g^T @ h
            let gt = Operand::transposed(g, oc);
            self.gemm(
                (rows, r, p.len()),
                gt,
                Operand::rows(hp, r),
                Operand::rows(db, r),
                None,
                ACCUMULATE,
                Batches::ONE,
            );
            // dh = scale * g @ b
            self.gemm(
                (p.len(), r, rows),
                Operand::rows(g, oc),
                Operand::rows(b, r),
                Operand::rows(dhp, r),
                None,
                0,
                Batches::ONE,
            );
            self.lora_scale(dhp, scale);
            // da (R, C) += dh^T @ inp
            let dht = Operand::transposed(dhp, r);
            self.gemm((r, c, p.len()), dht, Operand::rows(xp, c), Operand::rows(da, c), None, ACCUMULATE, Batches::ONE);
            if let Some(di) = dinp {
                // dinp (N, C) += dh @ a
                let dip = Operand::rows(di.slice(p.start * c..p.end * c), c);
                self.gemm(
                    (p.len(), c, r),
                    Operand::rows(dhp, r),
                    Operand::rows(a, c),
                    dip,
                    None,
                    ACCUMULATE,
                    Batches::ONE,
                );
            }
        }
    }

    /// Rows `p` of h = scale * inp @ a^T, returned.
    fn lora_down(&mut self, h: Buf, inp: Buf, a: Buf, p: &std::ops::Range<usize>, s: LoraShape) -> Buf {
        let LoraShape { c, r, scale, .. } = s;
        let hp = h.slice(p.start * r..p.end * r);
        let (x, at) = (Operand::rows(inp.slice(p.start * c..p.end * c), c), Operand::transposed(a, c));
        self.gemm((p.len(), r, c), x, at, Operand::rows(hp, r), None, 0, Batches::ONE);
        self.lora_scale(hp, scale);
        hp
    }

    /// x *= scale.
    fn lora_scale(&mut self, x: Buf, scale: f32) {
        for piece in self.mem.pieces(&[x], x.len) {
            let w = self.win(x.slice(piece.clone()));
            let n = piece.end - piece.start;
            self.dispatch(K::LoraScale, std::slice::from_ref(&w), &[w.off, u(n), f(scale)], Threads(n));
        }
    }
}

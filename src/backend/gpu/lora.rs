//! A LoRA adapter's term on the GPU (the CPU's is cpu/lora.rs): matmul.wgsl's GEMM, which
//! reaches the adapted rows of a fused projection's output by its row stride, and one scaling
//! kernel (kernels/lora.wgsl). Rows of N beyond one binding window go piece by piece; the
//! adapter's gradients add over the pieces. A (R, C) and B (ROWS, R) each fit one window: R*C
//! and ROWS*R floats are megabytes for any model, against windows of 128 MiB or more.

use super::bf16::Role::{In, Out};
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, Module, K};
use super::matmul::{block, Batches, Operand, ACCUMULATE};
use super::{all_bf16, all_f32};
use super::{f, u, GpuBackend, Threads};
use crate::backend::ops::LoraShape;
use crate::backend::ops::{opt, Call};
use crate::backend::ops::{LoraBackward, LoraForward, LoraOps};
use crate::backend::Buf;

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
            self.dispatch(LORA_SCALE, std::slice::from_ref(&w), &[w.off, u(n), f(scale)], Threads(n));
        }
    }
}

impl LoraOps for GpuBackend {
    fn lora_forward(&mut self, a: &LoraForward) {
        let LoraForward { out, h, x, a: la, b, s } = *a;
        if all_bf16(&[out, x]) && all_f32(&[la, b]) {
            // A bf16 base's input read and output added to as they are (fp32 adapters); h
            // (N, R), scaled after its GEMM, through an f32 copy rounded once.
            return self.in_f32(LoraForward::NAME, [(h, Out)], Nearest, |g, [h]| g.lora_forward_(out, h, x, la, b, s));
        }
        self.call_in_f32(a, Nearest, |g, a| g.lora_forward_(a.out, a.h, a.x, a.a, a.b, s))
    }

    fn lora_backward(&mut self, a: &LoraBackward) {
        let LoraBackward { dx, da, db, dh, dout, x, a: la, b, h, s } = *a;
        if all_bf16(&[dout, x, opt(dx)]) && all_f32(&[la, b, da, db]) {
            // As lora_forward: the base's bf16 tensors as they are, h and dh (N, R) through
            // f32 copies.
            return self.in_f32(LoraBackward::NAME, [(h, In), (dh, Out)], Nearest, |g, [h, dh]| {
                g.lora_backward_(dx, da, db, h, dh, dout, x, la, b, s)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| g.lora_backward_(a.dx, a.da, a.db, a.h, a.dh, a.dout, a.x, a.a, a.b, s))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// LoRA's one element-wise step (kernels/lora.wgsl, which declares its own buffers; its GEMMs are matmul's).
pub(super) const MODULE: Module = Module {
    name: "lora",
    src: include_str!("kernels/lora.wgsl"),
    buffers: &[],
    entries: &[Entry { name: "lora_scale", bindings: 1, u32s: 0, bf16s: 0, variants: &[] }],
    subgroup: None,
};
pub(super) const LORA_SCALE: K = K::of(&MODULE, 0);

//! Matmul with bias on the GPU, and the GEMM that attention shares (kernels/matmul.wgsl).
//! Operands larger than one binding window (wte, the logits) are cut into pieces of rows; a
//! sum over a cut dimension adds the pieces in order.

use super::{grid, lens, u, GpuBackend, K};
use crate::backend::{Buf, DType};

/// Rows per partial sum of the bias gradient (kernels/matmul.wgsl: ROWS).
const ROWS: usize = 64;

/// GEMM flags (kernels/matmul.wgsl).
pub(super) const ACCUMULATE: u32 = 1;
pub(super) const BIAS: u32 = 2;
/// Skip output tiles wholly above the diagonal.
pub(super) const SKIP_UPPER: u32 = 4;
/// A's rows are zero past the diagonal: k runs to the tile's last row.
pub(super) const K_UPPER: u32 = 8;
/// A's rows are zero before the diagonal: k starts at the tile's first row.
pub(super) const K_LOWER: u32 = 16;

/// One GEMM operand: X[i, j] = buf[i*rs + j*cs], moved by bo per outer batch index, bi per
/// inner one and bz per batch index of the dispatch (see kernels/matmul.wgsl). `buf` covers
/// every element the GEMM reads or writes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Operand {
    pub buf: Buf,
    pub rs: usize,
    pub cs: usize,
    pub bo: usize,
    pub bi: usize,
    pub bz: usize,
}

impl Operand {
    /// A row-major matrix (rows rs apart) of one batch.
    pub fn rows(buf: Buf, rs: usize) -> Self {
        Operand { buf, rs, cs: 1, bo: 0, bi: 0, bz: 0 }
    }
    /// The same matrix read transposed.
    pub fn transposed(buf: Buf, rs: usize) -> Self {
        Operand { buf, rs: 1, cs: rs, bo: 0, bi: 0, bz: 0 }
    }
    /// Batched by (outer, inner) index: bo apart per outer index, bi per inner one.
    pub fn batched(self, bo: usize, bi: usize) -> Self {
        Operand { bo, bi, ..self }
    }
    /// One matrix per batch index, `bz` apart.
    pub fn each(self, bz: usize) -> Self {
        Operand { bz, ..self }
    }
}

/// Which batches a GEMM runs: `count` batch indices from z0 of an (outer, inner) grid.
#[derive(Clone, Copy, Debug)]
pub(super) struct Batches {
    pub z0: usize,
    pub count: usize,
    pub inner: usize,
}

impl Batches {
    pub const ONE: Batches = Batches { z0: 0, count: 1, inner: 1 };
}

/// Most of the sum dimension K one dispatch covers; longer sums (the classifier's Vp) are cut
/// into dispatches that add to the output in order. lavapipe stops a shader after 65535 loop
/// iterations in all, which a 64x64 tile reaches at K of about 30000.
const K_PER_DISPATCH: usize = 4096;

/// The first `len` elements past `off` of b, clipped to b (an operand's reach).
fn reach(b: Buf, off: usize, len: usize) -> Buf {
    b.slice(off..(off + len).min(b.len))
}

impl GpuBackend {
    /// C (M, N) [+]= A (M, K) @ B (K, N) [+ bias (N)], for each of `z` batches.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &mut self,
        (m, n, k): (usize, usize, usize),
        a: Operand,
        b: Operand,
        c: Operand,
        bias: Option<Buf>,
        flags: u32,
        z: Batches,
    ) {
        assert!(c.cs == 1, "GEMM output rows are contiguous");
        assert!(z.count <= super::MAX_GROUPS && z.inner > 0, "GEMM batches {z:?}");
        if m == 0 || n == 0 || z.count == 0 {
            return;
        }
        let (wa, wb, wc) = (self.win(a.buf), self.win(b.buf), self.win(c.buf));
        let wbias = match bias {
            Some(x) => self.win(x),
            None => self.mem.dummy.clone(),
        };
        let flags = flags | if bias.is_some() { BIAS } else { 0 };
        let groups = [u(n.div_ceil(64)), u(m.div_ceil(64)), u(z.count)];
        // Dispatches of at most K_PER_DISPATCH of the sum; the first adds the bias, the rest
        // add to what the ones before wrote.
        for kb in (0..k.max(1)).step_by(K_PER_DISPATCH) {
            let flags = if kb > 0 { (flags & !BIAS) | ACCUMULATE } else { flags };
            #[rustfmt::skip]
            let imm = [
                u(m), u(n), u(k.min(kb + K_PER_DISPATCH)),
                wa.off, u(a.rs), u(a.cs),
                wb.off, u(b.rs), u(b.cs),
                wc.off, u(c.rs),
                wbias.off, flags, u(z.inner),
                u(a.bo), u(a.bi), u(b.bo), u(b.bi), u(c.bo), u(c.bi),
                u(z.z0), u(a.bz), u(b.bz), u(c.bz), u(kb),
            ];
            let wins = [wc.clone(), wa.clone(), wb.clone(), wbias.clone()];
            self.dispatch(K::Matmul, &wins, &imm, groups);
        }
    }

    /// out (N, OC) = inp (N, C) @ weight (OC, C)^T [+ bias (OC)].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_forward_(
        &mut self,
        out: Buf,
        inp: Buf,
        weight: Buf,
        bias: Option<Buf>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        lens!("matmul_forward"; out => n * oc, inp => n * c, weight => oc * c);
        if let Some(b) = bias {
            lens!("matmul_forward"; b => oc);
        }
        let outs =
            self.mem.row_pieces(oc, &[(weight, c), (bias.unwrap_or(weight), if bias.is_some() { 1 } else { 0 })]);
        for r in self.mem.row_pieces(n, &[(out, oc), (inp, c)]) {
            for o in &outs {
                let rows = r.end - r.start;
                let a = Operand::rows(inp.slice(r.start * c..r.end * c), c);
                let b = Operand::transposed(weight.slice(o.start * c..o.end * c), c);
                let cc = Operand::rows(reach(out, r.start * oc + o.start, (rows - 1) * oc + o.end - o.start), oc);
                let bias = bias.map(|x| x.slice(o.clone()));
                self.gemm((rows, o.end - o.start, c), a, b, cc, bias, 0, Batches::ONE);
            }
        }
    }

    /// dinp (N, C) = dout @ weight; dweight (OC, C) [+]= dout^T @ inp; dbias (OC) [+]= the
    /// column sums of dout (N, OC).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_backward_(
        &mut self,
        dinp: Option<Buf>,
        dweight: Buf,
        dbias: Option<Buf>,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        lens!("matmul_backward"; dweight => oc * c, dout => n * oc, inp => n * c, weight => oc * c);
        if let Some(d) = dinp {
            lens!("matmul_backward"; d => n * c);
        }
        if let Some(d) = dbias {
            lens!("matmul_backward"; d => oc);
        }
        let dinp_rows = dinp.map_or((inp, 0), |d| (d, c));
        let rows = self.mem.row_pieces(n, &[(dout, oc), (inp, c), dinp_rows]);
        let outs = self.mem.row_pieces(oc, &[(weight, c), (dweight, c)]);
        let dout_block = |r: &std::ops::Range<usize>, o: &std::ops::Range<usize>| {
            reach(dout, r.start * oc + o.start, (r.end - r.start - 1) * oc + o.end - o.start)
        };
        if let Some(dinp) = dinp {
            for r in &rows {
                for (i, o) in outs.iter().enumerate() {
                    let a = Operand::rows(dout_block(r, o), oc);
                    let b = Operand::rows(weight.slice(o.start * c..o.end * c), c);
                    let cc = Operand::rows(dinp.slice(r.start * c..r.end * c), c);
                    let flags = if i > 0 { ACCUMULATE } else { 0 };
                    self.gemm((r.end - r.start, c, o.end - o.start), a, b, cc, None, flags, Batches::ONE);
                }
            }
        }
        for o in &outs {
            for (i, r) in rows.iter().enumerate() {
                let a = Operand::transposed(dout_block(r, o), oc);
                let b = Operand::rows(inp.slice(r.start * c..r.end * c), c);
                let cc = Operand::rows(dweight.slice(o.start * c..o.end * c), c);
                let flags = if accumulate || i > 0 { ACCUMULATE } else { 0 };
                self.gemm((o.end - o.start, c, r.end - r.start), a, b, cc, None, flags, Batches::ONE);
            }
        }
        if let Some(dbias) = dbias {
            // Partial column sums per block of rows, then their sums, piece after piece.
            for (i, r) in rows.iter().enumerate() {
                let blocks = (r.end - r.start).div_ceil(ROWS);
                let Some(part) = self.workspace(|s| &mut s.scratch, blocks * oc, DType::F32) else { return };
                let (pw, d) = (self.win(part), self.win(dout.slice(r.start * oc..r.end * oc)));
                #[rustfmt::skip]
                let imm = [u(r.end - r.start), u(oc), 0, d.off, u(oc), 1, 0, 0, 0, pw.off];
                self.dispatch(K::BiasBackward, &[pw, d], &imm, grid(blocks * oc));
                self.column_sums(dbias, part, blocks, oc, accumulate || i > 0);
            }
        }
    }
}

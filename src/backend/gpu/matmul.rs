//! Matmul with bias on the GPU, and the GEMM that attention shares (kernels/matmul.wgsl).
//! Operands larger than one binding window (wte, the logits) are cut into pieces of rows; a
//! sum over a cut dimension adds the pieces in order.

use super::all_bf16;
use super::bf16::Role::{InOut, Out};
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K};
use super::{u, GpuBackend, Threads, Xyz};
use crate::backend::ops::{opt, Call, NONE};
use crate::backend::ops::{Mat, MatmulBackward, MatmulForward, MatmulOps};
use crate::backend::{Buf, DType};
use std::ops::Range;

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
/// The flags that take a row index for a query position (the GEMM's rows are never cut).
const CAUSAL: u32 = SKIP_UPPER | K_UPPER | K_LOWER;

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
    /// The largest offset into `buf` a GEMM of (rows, cols) over `z` reads or writes (a bound:
    /// every inner index of every outer one).
    fn reach(&self, rows: usize, cols: usize, z: Batches) -> usize {
        let outer = (z.z0 + z.count - 1) / z.inner - z.z0 / z.inner;
        (rows - 1) * self.rs
            + (cols - 1) * self.cs
            + outer * self.bo
            + (z.inner - 1) * self.bi
            + (z.count - 1) * self.bz
    }

    /// The operand moved by `off` elements.
    fn at(self, off: usize) -> Self {
        Operand { buf: self.buf.slice(off..self.buf.len), ..self }
    }

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
        assert!(c.cs == 1 && z.inner > 0, "GEMM output rows are contiguous; batches {z:?}");
        // The callers cut batches to a grid dimension (attention's plane pieces).
        assert!(z.count <= self.cuts.max_groups, "GEMM of {} batches", z.count);
        if m == 0 || n == 0 || z.count == 0 {
            return;
        }
        // More tiles than a grid dimension holds: the rows or columns in parts (never those of
        // a causal GEMM, whose tiles know their place in the plane).
        let (tile_rows, tile_cols) = self.kernels.gemm_tile;
        let (most_rows, most_cols) = (self.cuts.max_groups * tile_rows, self.cuts.max_groups * tile_cols);
        if m > most_rows || n > most_cols {
            assert!(flags & CAUSAL == 0, "a causal GEMM of {m} x {n}");
            for r in super::cut(0..m, most_rows) {
                for j in super::cut(0..n, most_cols) {
                    let (a, b, c) = (a.at(r.start * a.rs), b.at(j.start * b.cs), c.at(r.start * c.rs + j.start));
                    let bias = bias.map(|x| x.slice(j.clone()));
                    self.gemm((r.len(), j.len(), k), a, b, c, bias, flags, z);
                }
            }
            return;
        }
        // Each operand's buffer covers what the kernel reaches (its window is the buffer's).
        let operands = [(a, (m, k)), (b, (k, n)), (c, (m, n))];
        for (x, (rows, cols)) in operands.into_iter().filter(|(_, (r, c))| r * c > 0) {
            assert!(
                x.reach(rows, cols, z) < x.buf.len,
                "GEMM operand {x:?} of ({rows}, {cols}) x {z:?}: past its buffer"
            );
        }
        // Each operand f32 or bf16 (the bias B's type): kernels/matmul.wgsl reads and writes
        // bf16 itself. A bf16 C is rounded where it is stored, so its sum must be one
        // dispatch's (an op with a longer one takes an f32 copy of C).
        let bf16 = |x: Buf| x.dtype == DType::BF16;
        let step = self.cuts.k_per_dispatch;
        assert!(
            bias.is_none_or(|x| x.dtype == b.buf.dtype || x.len == 0) && (!bf16(c.buf) || k <= step),
            "GEMM of A {a:?}, B {b:?}, bias {bias:?} into C {c:?}: the bias is B's type, a bf16 C sums at most {step}"
        );
        let kernel = gemm(bf16(a.buf), bf16(b.buf), bf16(c.buf));
        let (wa, wb, wc) = (self.win(a.buf), self.win(b.buf), self.win(c.buf));
        let wbias = match bias {
            Some(x) => self.win(x),
            None => self.mem.dummy.clone(),
        };
        let flags = flags | if bias.is_some() { BIAS } else { 0 };
        let groups = Xyz([u(n.div_ceil(tile_cols)), u(m.div_ceil(tile_rows)), u(z.count)]);
        // Dispatches of at most k_per_dispatch of the sum; the first adds the bias, the rest
        // add to what the ones before wrote.
        for kb in (0..k.max(1)).step_by(step) {
            let flags = if kb > 0 { (flags & !BIAS) | ACCUMULATE } else { flags };
            #[rustfmt::skip]
            let imm = [
                u(m), u(n), u(k.min(kb + step)),
                wa.off, u(a.rs), u(a.cs),
                wb.off, u(b.rs), u(b.cs),
                wc.off, u(c.rs),
                wbias.off, flags, u(z.inner),
                u(a.bo), u(a.bi), u(b.bo), u(b.bi), u(c.bo), u(c.bi),
                u(z.z0), u(a.bz), u(b.bz), u(c.bz), u(kb),
            ];
            let wins = [wc.clone(), wa.clone(), wb.clone(), wbias.clone()];
            self.dispatch(kernel, &wins, &imm, groups);
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
        let ins: Vec<Buf> = [inp, weight].into_iter().chain(bias).collect();
        Self::disjoint("matmul_forward", &[out], &ins);
        let weight_rows: Vec<_> = [(weight, c)].into_iter().chain(bias.map(|b| (b, 1))).collect();
        let outs = self.mem.row_pieces(oc, &weight_rows);
        for r in self.mem.row_pieces(n, &[(out, oc), (inp, c)]) {
            for o in &outs {
                let a = Operand::rows(inp.slice(r.start * c..r.end * c), c);
                let b = Operand::transposed(weight.slice(o.start * c..o.end * c), c);
                let cc = Operand::rows(block(out, oc, &r, o), oc);
                let bias = bias.map(|x| x.slice(o.clone()));
                self.gemm((r.len(), o.len(), c), a, b, cc, bias, 0, Batches::ONE);
            }
        }
    }

    /// dinp (N, C) = dout @ weight; dweight (OC, C) [+]= dout^T @ inp; dbias (OC) [+]= the
    /// column sums of dout (N, OC).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_backward_(
        &mut self,
        dinp: Option<Buf>,
        dweight: Option<Buf>,
        dbias: Option<Buf>,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        let outs: Vec<Buf> = [dweight, dinp, dbias].into_iter().flatten().collect();
        Self::disjoint("matmul_backward", &outs, &[dout, inp, weight]);
        if n == 0 {
            // No rows: sums of nothing (as the CPU's GEMM writes them).
            if !accumulate {
                outs.iter().filter(|b| Some(**b) != dinp).for_each(|&b| crate::backend::Backend::fill(self, b, 0.0));
            }
            return;
        }
        let row_bufs: Vec<_> = [(dout, oc), (inp, c)].into_iter().chain(dinp.map(|d| (d, c))).collect();
        let rows = self.mem.row_pieces(n, &row_bufs);
        let outs_of: Vec<_> = [Some((weight, c)), dweight.map(|d| (d, c))].into_iter().flatten().collect();
        let outs = self.mem.row_pieces(oc, &outs_of);
        if let Some(dinp) = dinp {
            self.matmul_dinp(dinp, dout, weight, (&rows, &outs), c, oc);
        }
        if let Some(dweight) = dweight {
            self.matmul_dweight(dweight, dout, inp, (&rows, &outs), c, oc, accumulate);
        }
        if let Some(dbias) = dbias {
            self.matmul_dbias(dbias, dout, &rows, oc, accumulate);
        }
    }

    /// dinp (N, C) = dout (N, OC) @ weight (OC, C), summed over the pieces of OC in order.
    fn matmul_dinp(
        &mut self,
        dinp: Buf,
        dout: Buf,
        weight: Buf,
        (rows, outs): (&[Range<usize>], &[Range<usize>]),
        c: usize,
        oc: usize,
    ) {
        for r in rows {
            for (i, o) in outs.iter().enumerate() {
                let a = Operand::rows(block(dout, oc, r, o), oc);
                let b = Operand::rows(weight.slice(o.start * c..o.end * c), c);
                let cc = Operand::rows(dinp.slice(r.start * c..r.end * c), c);
                let flags = if i > 0 { ACCUMULATE } else { 0 };
                self.gemm((r.len(), c, o.len()), a, b, cc, None, flags, Batches::ONE);
            }
        }
    }

    /// dweight (OC, C) [+]= dout^T (OC, N) @ inp (N, C), summed over the pieces of N in order.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dweight(
        &mut self,
        dweight: Buf,
        dout: Buf,
        inp: Buf,
        (rows, outs): (&[Range<usize>], &[Range<usize>]),
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        for o in outs {
            for (i, r) in rows.iter().enumerate() {
                let a = Operand::transposed(block(dout, oc, r, o), oc);
                let b = Operand::rows(inp.slice(r.start * c..r.end * c), c);
                let cc = Operand::rows(dweight.slice(o.start * c..o.end * c), c);
                let flags = if accumulate || i > 0 { ACCUMULATE } else { 0 };
                self.gemm((o.len(), c, r.len()), a, b, cc, None, flags, Batches::ONE);
            }
        }
    }

    /// dbias (OC) [+]= the column sums of dout (N, OC): partial sums per block of ROWS rows,
    /// then their sums, piece of N after piece.
    fn matmul_dbias(&mut self, dbias: Buf, dout: Buf, rows: &[Range<usize>], oc: usize, accumulate: bool) {
        for (i, r) in rows.iter().enumerate() {
            let blocks = r.len().div_ceil(ROWS);
            let Some(part) = self.workspace(|s| &mut s.scratch, blocks * oc, DType::F32) else { return }; // (blocks, OC)
            let (pw, d) = (self.win(part), self.win(dout.slice(r.start * oc..r.end * oc)));
            // Params of bias_backward: m, n, k (unused), a, a_rs, a_cs (unused), ..., c.
            let imm = [u(r.len()), u(oc), 0, d.off, u(oc), 1, 0, 0, 0, pw.off];
            let kernel = if dout.dtype == DType::BF16 { BIAS_BACKWARD.variant(1) } else { BIAS_BACKWARD };
            self.dispatch(kernel, &[pw, d], &imm, Threads(blocks * oc));
            self.column_sums(dbias, part, blocks, oc, accumulate || i > 0);
        }
    }
}

/// Rows `r` and columns `cols` of a row-major (_, width) matrix: the span from the first
/// element of the block to its last.
pub(super) fn block(x: Buf, width: usize, r: &Range<usize>, cols: &Range<usize>) -> Buf {
    let first = r.start * width + cols.start;
    x.slice(first..(r.end - 1) * width + cols.end)
}

impl MatmulOps for GpuBackend {
    fn matmul_forward(&mut self, a: &MatmulForward) {
        let MatmulForward { out, x, w, bias, m: Mat { n, c, oc } } = *a;
        if all_bf16(&[x, w, opt(bias)]) {
            // The GEMM reads its bf16 operands itself, and writes a bf16 output itself when
            // its sum is one dispatch's; a longer one goes through an f32 copy (summed in f32
            // across dispatches, and rounded once at the end).
            Self::disjoint(MatmulForward::NAME, &[out], &[x, w, opt(bias)]);
            if out.dtype == DType::F32 || c <= self.cuts.k_per_dispatch {
                return self.matmul_forward_(out, x, w, bias, n, c, oc);
            }
            return self.in_f32(MatmulForward::NAME, [(out, Out)], Nearest, |g, [out]| {
                g.matmul_forward_(out, x, w, bias, n, c, oc)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| g.matmul_forward_(a.out, a.x, a.w, a.bias, n, c, oc))
    }

    fn matmul_backward(&mut self, a: &MatmulBackward) {
        let MatmulBackward { dx, dw, db, dout, x, w, m: Mat { n, c, oc }, acc } = *a;
        if all_bf16(&[dout, x, w]) {
            // As matmul_forward: the bf16 operands read as they are; dx and dw written by the
            // GEMM itself when each element's sum is one dispatch (dx's over OC, dw's over N,
            // neither cut into pieces that fit a binding), else through f32 copies, as the bias
            // gradient (column sums) always.
            let grad = if acc { InOut } else { Out };
            let outs = [opt(dx), opt(dw), opt(db)];
            Self::disjoint(MatmulBackward::NAME, &outs, &[dout, x, w]);
            let step = self.cuts.k_per_dispatch;
            let one = |g: &Self, k: usize, bufs: &[(Buf, usize)]| k <= step && g.mem.row_pieces(k, bufs).len() <= 1;
            let direct = |b: Option<Buf>, one: bool| b.is_none_or(|b| b.dtype == DType::F32 || one);
            // (The pieces matmul_backward_ cuts OC and N into.)
            let w_rows: Vec<_> = [Some((w, c)), dw.map(|d| (d, c))].into_iter().flatten().collect();
            let n_rows: Vec<_> = [Some((dout, oc)), Some((x, c)), dx.map(|d| (d, c))].into_iter().flatten().collect();
            let dx_direct = direct(dx, one(self, oc, &w_rows));
            let dw_direct = direct(dw, one(self, n, &n_rows));
            let copy = |b: Option<Buf>, direct: bool| if direct { NONE } else { opt(b) };
            let bufs = [(copy(dx, dx_direct), Out), (copy(dw, dw_direct), grad), (outs[2], grad)];
            return self.in_f32(MatmulBackward::NAME, bufs, Nearest, |g, [cx, cw, cb]| {
                let (dx, dw) =
                    (if dx_direct { dx } else { dx.map(|_| cx) }, if dw_direct { dw } else { dw.map(|_| cw) });
                g.matmul_backward_(dx, dw, db.map(|_| cb), dout, x, w, n, c, oc, acc)
            });
        }
        self.call_in_f32(a, Nearest, |g, a| g.matmul_backward_(a.dx, a.dw, a.db, a.dout, a.x, a.w, n, c, oc, acc))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// The GEMM and the bias gradient (kernels/matmul.wgsl; on CPU-run Vulkan drivers the subgroup GEMM of kernels/matmul_subgroup.wgsl). The GEMM's variants, by the types of A, B (and the bias, B's) and C: 1 bf16 A and B into f32 C, 2 into bf16 C, 3 f32 A and bf16 B into f32 C, 4 into bf16 C, 5 bf16 A and f32 B into f32 C, 6 f32 A and B into bf16 C (a LoRA adapter's on a bf16 base); see [`gemm`].
pub(super) const MODULE: Module = Module {
    name: "matmul",
    src: include_str!("kernels/matmul.wgsl"),
    buffers: &[("c", F), ("a", F), ("b", F), ("bias", F)],
    entries: &[
        Entry {
            name: "matmul",
            bindings: 4,
            u32s: 0,
            bf16s: 0,
            variants: &[
                &[F, In16, In16, In16],
                &[Out16, In16, In16, In16],
                &[F, F, In16, In16],
                &[Out16, F, In16, In16],
                &[F, In16, F, F],
                &[Out16, F, F, F],
            ],
        },
        Entry { name: "bias_backward", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[F, In16, F, F]] },
    ],
    subgroup: Some(include_str!("kernels/matmul_subgroup.wgsl")),
};
pub(super) const GEMM: K = K::of(&MODULE, 0);
pub(super) const BIAS_BACKWARD: K = K::of(&MODULE, 1);

/// The GEMM kernel for A, B (and the bias, B's type) and C of these types: f32 or bf16 each,
/// but for a bf16 A and an f32 B into a bf16 C, which no op has.
fn gemm(a16: bool, b16: bool, c16: bool) -> K {
    match (a16, b16, c16) {
        (false, false, false) => GEMM,
        (true, true, false) => GEMM.variant(1),
        (true, true, true) => GEMM.variant(2),
        (false, true, false) => GEMM.variant(3),
        (false, true, true) => GEMM.variant(4),
        (true, false, false) => GEMM.variant(5),
        (false, false, true) => GEMM.variant(6),
        x => panic!("no GEMM kernel for (A bf16, B bf16, C bf16) = {x:?}"),
    }
}

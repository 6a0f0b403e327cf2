//! The CPU backend: buffers are host vectors, and every op turns its handles into slices (the
//! one checked place, [`CpuBackend::run`], which refuses overlapping outputs so that each
//! `&mut` slice is the only reference to its elements) by the roles its call gives
//! ([`crate::backend::ops::Call`]) and calls the layer functions of [`crate::backend::cpu`]:
//! each layer's file implements its ops there. Ops run to completion on the calling thread and
//! the team. The ops' shape contracts are checked once, in front of every backend
//! ([`crate::backend::ops`]).
//!
//! **NaN-checking mode** (`LLMRS_NAN_CHECK=1`, see [`crate::core::env::NAN_CHECK`]): new
//! allocations, and (through the front's [`Backend::poison`]) every op's outputs and scratch
//! buffers before it runs, are filled with a NaN that carries a marker payload. After the op, an
//! output element that still holds the marker was never written, and any output holding a marked
//! NaN got it from memory that no op wrote (NaNs keep their payload through arithmetic); either
//! stops the program with the op's name ([`Backend::check_written`]). A NaN that a computation
//! makes itself (0/0, inf - inf) has no marker and is left to the training loop's divergence
//! checks. Gradient and loss buffers are op outputs, so a NaN that reaches a loss or a gradient
//! from unwritten memory is caught at the op that put it there.

use super::wide;
use super::wide::{Dest, Operand};
use crate::backend::{Backend, Buf, DType};
use crate::core::profile::{Kind, WallTimer};
use anyhow::{bail, Context, Result};

/// The marker NaN (quiet, payload 0xDEAD); its sign may flip in a computation.
const POISON_BITS: u32 = 0x7FC0_DEAD;

/// An output [`CpuBackend::run_native`] hands over as f32 (not marked native).
pub(super) fn f32_dest(d: Dest<'_>) -> &mut [f32] {
    match d {
        Dest::F32(d) => d,
        Dest::Bf16(_) => unreachable!("an output not marked native is handed over as f32"),
    }
}

/// An input [`CpuBackend::run_native`] hands over as f32 (not marked native).
pub(super) fn f32_operand(x: Operand<'_>) -> &[f32] {
    match x {
        Operand::F32(x) => x,
        Operand::Bf16(_) => unreachable!("an input not marked native is handed over as f32"),
    }
}

/// The marker of bf16 memory (quiet, payload 0x2D): widened to f32 it is 0x7FED_0000, which
/// arithmetic carries through and [`bf16::from_f32`] narrows back to the same bits.
const POISON_BF16: u16 = 0x7FED;

fn is_poison(x: f32) -> bool {
    x.to_bits() & 0x7FFF_FFFF == POISON_BITS || x.to_bits() & 0x7FFF_0000 == (POISON_BF16 as u32) << 16
}

enum Storage {
    F32(Vec<f32>),
    /// bf16 values as their bits; ops see them widened to f32 ([`CpuBackend::run`]).
    BF16(Vec<u16>),
    U32(Vec<u32>),
}

/// How a bf16 output is rounded from the f32 values an op computed.
#[derive(Clone, Copy)]
pub(super) enum Rounding {
    Nearest,
    /// Stochastic rounding with this seed; element i of the output draws the noise of index
    /// first + i, where first is the given place of its first element or else its offset in
    /// its allocation (so pieces round as the whole).
    Stochastic(u32, Option<u64>),
}

use crate::backend::ops::Out::{self, Rw, Scratch, W};

pub struct CpuBackend {
    /// Allocations by id; freed ones are None (ids are not reused, so a stale handle fails).
    allocs: Vec<Option<Storage>>,
    pub(super) nan_check: bool,
    timer: WallTimer,
    /// Partial sums of the global norm, one per chunk (grown on first use).
    pub(super) norm_partials: Vec<f64>,
    /// f32 copies of an op's bf16 buffers, kept from op to op (grown on first use).
    widened: Vec<Vec<f32>>,
}

impl CpuBackend {
    pub fn new(nan_check: bool) -> Self {
        CpuBackend { allocs: vec![], nan_check, timer: WallTimer::default(), norm_partials: vec![], widened: vec![] }
    }

    fn storage(&mut self, b: Buf) -> &mut Storage {
        match self.allocs.get_mut(b.alloc as usize).and_then(Option::as_mut) {
            Some(s) => s,
            None => panic!("buffer {b:?} is not an allocation of this backend (freed, or from another one)"),
        }
    }

    /// Pointer to the first element of an f32 buffer (bounds checked).
    pub(super) fn ptr_f32(&mut self, b: Buf) -> *mut f32 {
        let is_f32 = b.dtype == DType::F32;
        self.first(b, "an f32", |s| if let (Storage::F32(v), true) = (s, is_f32) { Some(v) } else { None })
    }

    /// Pointer to the first element of a bf16 buffer (bounds checked).
    pub(super) fn ptr_bf16(&mut self, b: Buf) -> *mut u16 {
        let is_bf16 = b.dtype == DType::BF16;
        self.first(b, "a bf16", |s| if let (Storage::BF16(v), true) = (s, is_bf16) { Some(v) } else { None })
    }

    /// Pointer to element `b.off` of the vector `of` finds in b's allocation, the first of
    /// `b.len` (dangling for an empty `b`, which may be [`crate::backend::ops::NONE`]).
    fn first<T>(&mut self, b: Buf, what: &str, of: impl FnOnce(&mut Storage) -> Option<&mut Vec<T>>) -> *mut T {
        if b.len == 0 {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        match of(self.storage(b)) {
            Some(v) if b.off + b.len <= v.len() => {
                // SAFETY: off + len <= v.len(), so the offset stays inside the vector.
                unsafe { v.as_mut_ptr().add(b.off) }
            }
            _ => panic!("buffer {b:?} is not {what} range of its allocation"),
        }
    }

    /// The bits of a bf16 buffer (bounds checked). `&mut self` is held while the slice lives.
    pub(super) fn bf16_slice(&mut self, b: Buf) -> &mut [u16] {
        let p = self.ptr_bf16(b);
        // SAFETY: p addresses b.len u16s of a live allocation (bounds checked by ptr_bf16); the
        // slice borrows `self` mutably, so nothing else reaches them meanwhile.
        unsafe { std::slice::from_raw_parts_mut(p, b.len) }
    }

    pub(super) fn ptr_u32(&mut self, b: Buf) -> *mut u32 {
        if b.len == 0 {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        match self.storage(b) {
            Storage::U32(v) if b.dtype == DType::U32 && b.off + b.len <= v.len() => {
                // SAFETY: off + len <= v.len(), so the offset stays inside the vector.
                unsafe { v.as_mut_ptr().add(b.off) }
            }
            _ => panic!("buffer {b:?} is not a u32 range of its allocation"),
        }
    }

    /// Run one op: check that no output overlaps any other buffer of the call, hand `f` f32
    /// slices of every buffer, and write its bf16 outputs back rounded to nearest even.
    pub(super) fn run<const O: usize, const I: usize, const K: usize>(
        &mut self,
        op: &'static str,
        outs: [Out; O],
        ins: [Buf; I],
        toks: [Buf; K],
        f: impl FnOnce([&mut [f32]; O], [&[f32]; I], [&[u32]; K]),
    ) {
        self.run_rounded(op, outs, ins, toks, Rounding::Nearest, f)
    }

    /// [`CpuBackend::run`] with the rounding of bf16 outputs given. A bf16 buffer reaches `f` as
    /// an f32 copy: inputs and read outputs widened (exact), outputs rounded back after, so
    /// every kernel computes in f32 and its results are stored as llm.c's bf16 build stores
    /// them. Overwritten outputs are not widened (the op writes them whole) but in the
    /// NaN-checking mode, where the copy carries the poison marker to the check.
    pub(super) fn run_rounded<const O: usize, const I: usize, const K: usize>(
        &mut self,
        op: &'static str,
        outs: [Out; O],
        ins: [Buf; I],
        toks: [Buf; K],
        rounding: Rounding,
        f: impl FnOnce([&mut [f32]; O], [&[f32]; I], [&[u32]; K]),
    ) {
        self.run_native(op, outs, ins, toks, rounding, [false; O], [false; I], |o, i, k| {
            let o = o.map(|d| match d {
                Dest::F32(d) => d,
                Dest::Bf16(_) => unreachable!("no output is handed over as bf16"),
            });
            let i = i.map(|x| match x {
                Operand::F32(x) => x,
                Operand::Bf16(_) => unreachable!("no input is handed over as bf16"),
            });
            f(o, i, k)
        })
    }

    /// [`CpuBackend::run_rounded`] for an op that reads or writes some bf16 buffers itself:
    /// those marked in `native_outs` / `native_ins` reach `f` as they are (bf16 or f32); the
    /// others as f32 (bf16 ones through f32 copies). An op writing a bf16 output itself rounds
    /// it as `rounding` says.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_native<const O: usize, const I: usize, const K: usize>(
        &mut self,
        op: &'static str,
        outs: [Out; O],
        ins: [Buf; I],
        toks: [Buf; K],
        rounding: Rounding,
        native_outs: [bool; O],
        native_ins: [bool; I],
        f: impl FnOnce([Dest; O], [Operand; I], [&[u32]; K]),
    ) {
        for (i, o) in outs.iter().enumerate() {
            let o = o.buf();
            let others = outs.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| x.buf());
            if let Some(x) = others.chain(ins).chain(toks).find(|x| x.overlaps(o)) {
                panic!("{op}: output {o:?} overlaps {x:?}");
            }
        }
        let is_bf16 = |b: Buf| b.dtype == DType::BF16 && b.len > 0;
        let out_native: [bool; O] = std::array::from_fn(|k| native_outs[k] && is_bf16(outs[k].buf()));
        let in_native: [bool; I] = std::array::from_fn(|i| native_ins[i] && is_bf16(ins[i]));
        let widened = |b: Buf, native: bool| is_bf16(b) && !native;
        // f32 copies of the bf16 buffers: slot k for output k, slot O + i for input i, each the
        // best fit from the copies kept from earlier ops (so what is kept is about the largest
        // op's bf16 buffers, not the largest buffer of every slot).
        let mut pool = std::mem::take(&mut self.widened);
        let mut wide: Vec<Vec<f32>> = vec![];
        let all = outs.iter().zip(out_native).map(|(o, n)| (o.buf(), n)).chain(ins.into_iter().zip(in_native));
        for (b, native) in all {
            let len = if widened(b, native) { b.len } else { 0 };
            let fit = pool.iter().enumerate().filter(|(_, v)| v.len() >= len).min_by_key(|(_, v)| v.len()).map(|x| x.0);
            let largest = pool.iter().enumerate().max_by_key(|(_, v)| v.len()).map(|x| x.0);
            let mut w = match (len, fit.or(largest)) {
                (0, _) | (_, None) => vec![],
                (_, Some(i)) => pool.swap_remove(i),
            };
            if w.len() < len {
                w.resize(len, 0.0);
            }
            wide.push(w);
        }
        for (k, o) in outs.iter().enumerate() {
            let b = o.buf();
            if widened(b, out_native[k]) && (matches!(o, Rw(_)) || (matches!(o, W(_)) && self.nan_check)) {
                wide::widen(&mut wide[k][..b.len], self.bf16_slice(b));
            }
        }
        for (i, &b) in ins.iter().enumerate() {
            if widened(b, in_native[i]) {
                wide::widen(&mut wide[O + i][..b.len], self.bf16_slice(b));
            }
        }
        /// Where a buffer's elements are, and as what.
        #[derive(Clone, Copy)]
        enum Ptr {
            F32(*mut f32, usize),
            Bf16(*mut u16, usize),
        }
        let mut ptr = |b: Buf, native: bool, copy: &mut Vec<f32>| {
            if native {
                Ptr::Bf16(self.ptr_bf16(b), b.len)
            } else if is_bf16(b) {
                Ptr::F32(copy.as_mut_ptr(), b.len)
            } else {
                Ptr::F32(self.ptr_f32(b), b.len)
            }
        };
        let out_ptrs: [Ptr; O] = std::array::from_fn(|k| ptr(outs[k].buf(), out_native[k], &mut wide[k]));
        let in_ptrs: [Ptr; I] = std::array::from_fn(|i| ptr(ins[i], in_native[i], &mut wide[O + i]));
        let tok_ptrs = toks.map(|b| (self.ptr_u32(b) as *const u32, b.len));
        // SAFETY: every pointer addresses `len` elements of its type inside a live allocation
        // (bounds checked by ptr_f32 / ptr_bf16 / ptr_u32) or inside its own f32 copy (each
        // copy at least `len` long, one copy per buffer). No output overlaps another output or
        // an input (checked above), so each `&mut` slice is the only reference to its
        // elements; inputs may overlap each other, which shared slices allow. `&mut self` is
        // held for the whole call and the copies are not resized while the slices live, so no
        // other code reaches the allocations meanwhile and no allocation is resized or freed.
        let (o, i, k) = unsafe {
            (
                out_ptrs.map(|p| match p {
                    Ptr::F32(p, n) => Dest::F32(std::slice::from_raw_parts_mut(p, n)),
                    Ptr::Bf16(p, n) => Dest::Bf16(std::slice::from_raw_parts_mut(p, n)),
                }),
                in_ptrs.map(|p| match p {
                    Ptr::F32(p, n) => Operand::F32(std::slice::from_raw_parts(p, n)),
                    Ptr::Bf16(p, n) => Operand::Bf16(std::slice::from_raw_parts(p, n)),
                }),
                tok_ptrs.map(|(p, n)| std::slice::from_raw_parts(p, n)),
            )
        };
        f(o, i, k);
        for (k, o) in outs.iter().enumerate() {
            let b = o.buf();
            if widened(b, out_native[k]) && !matches!(o, Scratch(_)) {
                let (src, dst) = (&wide[k][..b.len], self.bf16_slice(b));
                match rounding {
                    Rounding::Nearest => wide::narrow(dst, src),
                    Rounding::Stochastic(seed, first) => {
                        wide::narrow_stochastic(dst, src, seed, first.unwrap_or(b.off as u64))
                    }
                }
            }
        }
        pool.extend(wide.into_iter().filter(|w| !w.is_empty()));
        self.widened = pool;
    }

    /// Whether the GEMMs read bf16 operands themselves (the packed path widens them as it
    /// packs; the `gemm` crate's path would copy them whole, as the f32 copies do).
    pub(super) fn gemm_reads_bf16(&self) -> bool {
        super::sgemm::fast_path_available()
    }

    /// Whether the GEMMs round bf16 results themselves, a window at a time. Not in the
    /// NaN-checking mode, where an output goes through a whole f32 copy that carries the
    /// poison marker to the check.
    pub(super) fn gemm_writes_bf16(&self) -> bool {
        self.gemm_reads_bf16() && !self.nan_check
    }
}

impl crate::backend::ops::Kernels for CpuBackend {}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        let gemm = if super::sgemm::fast_path_available() {
            let t = super::sgemm::Tile::current();
            format!("{} (wide C by k {})", t.describe(), super::sgemm::Order::for_tile(t).name())
        } else {
            "portable GEMM (the gemm crate)".into()
        };
        let check = if self.nan_check { ", NaN-checking mode" } else { "" };
        let isa = super::simd::isa().name();
        // The tiles bf16 x bf16 products run on (a bf16 run's GEMMs; fp32 runs never use them).
        let bf16 = match super::bgemm::model_engine() {
            Some(e) => format!("bf16 GEMMs on {}", e.name()),
            None => "bf16 GEMMs widened to fp32".into(),
        };
        format!("cpu: fp32, {isa} kernels, {gemm}, {bf16}, {} threads{check}", super::team::threads())
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    fn workspace_bytes(&self) -> usize {
        self.widened.iter().map(|w| 4 * w.capacity()).sum()
    }

    fn measure_peak(&self) -> Option<(f64, String)> {
        Some(super::peak::measure())
    }

    fn poison(&mut self, b: Buf) {
        if self.nan_check && b.len > 0 && b.dtype == DType::BF16 {
            self.bf16_slice(b).fill(POISON_BF16);
        } else if self.nan_check && b.len > 0 {
            let p = self.ptr_f32(b);
            // SAFETY: p addresses b.len floats of a live allocation (bounds checked by ptr_f32),
            // and no other reference to them lives during this call (&mut self).
            unsafe { std::slice::from_raw_parts_mut(p, b.len) }.fill(f32::from_bits(POISON_BITS));
        }
    }

    fn check_written(&mut self, b: Buf, op: &'static str, k: usize) {
        if !self.nan_check || b.len == 0 {
            return;
        }
        let at = if b.dtype == DType::BF16 {
            self.bf16_slice(b).iter().position(|x| x & 0x7FFF == POISON_BF16)
        } else {
            let p = self.ptr_f32(b);
            // SAFETY: as in poison; read only.
            let s = unsafe { std::slice::from_raw_parts(p, b.len) };
            s.iter().position(|x| is_poison(*x))
        };
        if let Some(at) = at {
            panic!(
                "NaN check: {op} left element {at} of its output #{k} ({} elements) unwritten, or computed it from \
                 memory that no op wrote",
                b.len
            );
        }
    }

    fn alloc(&mut self, len: usize, dtype: DType) -> Result<Buf> {
        let bytes = len.checked_mul(dtype.bytes()).context("a buffer of more than usize::MAX bytes")?;
        crate::core::mem::check_available(bytes, &format!("a buffer of {len} values"))?;
        let storage = match dtype {
            DType::F32 => {
                let mut v = crate::core::mem::zeroed::<f32>(len);
                if self.nan_check {
                    v.fill(f32::from_bits(POISON_BITS));
                }
                Storage::F32(v)
            }
            DType::U32 => Storage::U32(vec![0; len]),
            DType::BF16 => {
                let mut v = crate::core::mem::zeroed::<u16>(len);
                if self.nan_check {
                    v.fill(POISON_BF16);
                }
                Storage::BF16(v)
            }
        };
        let id = u32::try_from(self.allocs.len()).ok().filter(|&i| i != u32::MAX);
        let Some(alloc) = id else { bail!("too many allocations") };
        self.allocs.push(Some(storage));
        Ok(Buf { alloc, off: 0, len, dtype })
    }

    fn alloc_from(&mut self, parts: &[usize], data: Vec<f32>) -> Result<Buf> {
        let len = data.len();
        if parts.iter().sum::<usize>() != len {
            bail!("alloc_from: {len} values for parts of {} in all", parts.iter().sum::<usize>());
        }
        let id = u32::try_from(self.allocs.len()).ok().filter(|&i| i != u32::MAX);
        let Some(alloc) = id else { bail!("too many allocations") };
        self.allocs.push(Some(Storage::F32(data)));
        Ok(Buf { alloc, off: 0, len, dtype: DType::F32 })
    }

    fn free(&mut self, buf: Buf) {
        if let Some(slot) = self.allocs.get_mut(buf.alloc as usize) {
            *slot = None;
        }
    }

    fn upload(&mut self, dst: Buf, src: &[f32]) {
        crate::backend::same_len("upload", dst, src.len());
        self.run("upload", [W(dst)], [], [], |[d], [], []| d.copy_from_slice(src));
    }

    fn upload_u32(&mut self, dst: Buf, src: &[u32]) {
        crate::backend::same_len("upload_u32", dst, src.len());
        let p = self.ptr_u32(dst);
        // SAFETY: p addresses dst.len u32s of a live allocation; `&mut self` excludes others.
        unsafe { std::slice::from_raw_parts_mut(p, dst.len) }.copy_from_slice(src);
    }

    fn download(&mut self, src: Buf, dst: &mut [f32]) -> Result<()> {
        crate::backend::same_len("download", src, dst.len());
        if src.dtype == DType::BF16 {
            wide::widen(dst, self.bf16_slice(src));
            return Ok(());
        }
        let p = self.ptr_f32(src);
        // SAFETY: p addresses src.len floats of a live allocation; `&mut self` excludes others.
        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(p, src.len) });
        Ok(())
    }

    fn fill(&mut self, dst: Buf, value: f32) {
        if dst.dtype == DType::BF16 {
            return self.bf16_slice(dst).fill(crate::core::bf16::from_f32(value));
        }
        self.run("fill", [W(dst)], [], [], |[d], [], []| d.fill(value));
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    fn host_f32(&mut self, buf: Buf) -> Option<&mut [f32]> {
        if buf.dtype != DType::F32 {
            return None; // the caller goes through download and upload, which convert
        }
        let p = self.ptr_f32(buf);
        // SAFETY: p addresses buf.len floats of a live allocation (bounds checked by ptr_f32);
        // the slice borrows `self` mutably, so no op, free or other slice reaches them meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut(p, buf.len) })
    }

    fn set_profiling(&mut self, on: bool) {
        self.timer.set(on);
    }
    fn profile_begin(&mut self, kind: Kind) {
        self.timer.begin(kind);
    }
    fn profile_end(&mut self) {
        self.timer.end();
    }
    fn profile_totals(&mut self) -> Result<Vec<(Kind, f64)>> {
        Ok(self.timer.totals())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ops::{
        AdamwOps, AdamwUpdate, Convert, ConvertOps, GeluForward, GeluOps, Residual, ResidualOps,
    };
    use crate::backend::{AdamWParams, SkipAbove};

    fn buf(be: &mut CpuBackend, vals: &[f32]) -> Buf {
        let b = be.alloc(vals.len(), DType::F32).unwrap();
        be.upload(b, vals);
        b
    }

    #[test]
    fn overlapping_outputs_are_refused() {
        let mut be = CpuBackend::new(false);
        let a = buf(&mut be, &[1.0; 8]);
        be.residual_forward(&Residual { out: a.slice(0..4), a: a.slice(4..8), b: a.slice(4..8) }); // disjoint: fine
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            be.residual_forward(&Residual { out: a.slice(0..4), a: a.slice(2..6), b: a.slice(4..8) })
        }));
        assert!(r.is_err(), "an output that overlaps an input must be refused");
        // Called directly, a buffer shorter than the op's others is refused too (by the slices'
        // bounds, not by the front's shape check).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            be.gelu_forward(&GeluForward { out: a.prefix(4), x: a.slice(4..7) })
        }));
        assert!(r.is_err(), "a length that does not fit the shape must be refused");
    }

    /// Converting an f32 copy that is about to go, piece by piece (pieces of odd sizes, not a
    /// multiple of a page), gives the bits of one whole conversion, and hands the converted
    /// pages back (Linux: they read as zero afterwards).
    #[test]
    fn consuming_conversion_matches_and_hands_pages_back() {
        let n = 5 * 4096 + 7;
        let vals: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.37).sin() * 1e-3).collect();
        for piece in [1, 2049, 3 * 4096 + 5, n, 2 * n] {
            let mut be = CpuBackend::new(false);
            let (a, b) = (buf(&mut be, &vals), buf(&mut be, &vals));
            let (whole, pieces) = (be.alloc(n, DType::BF16).unwrap(), be.alloc(n, DType::BF16).unwrap());
            be.convert(&Convert { dst: whole, src: a, noise: None, consuming: false });
            be.convert_consuming_by(pieces, b, piece);
            let (mut x, mut y) = (vec![0f32; n], vec![0f32; n]);
            be.download(whole, &mut x).unwrap();
            be.download(pieces, &mut y).unwrap();
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "pieces of {piece}");
            let left = be.host_f32(b).unwrap();
            let zeros = left.iter().filter(|v| **v == 0.0).count();
            if cfg!(target_os = "linux") && piece >= 4096 {
                assert!(zeros >= 4 * 4096, "pieces of {piece}: only {zeros} elements handed back");
            }
        }
    }

    #[test]
    fn stale_and_foreign_handles_are_refused() {
        let mut be = CpuBackend::new(false);
        let a = buf(&mut be, &[1.0; 4]);
        let mut out = [0f32; 4];
        be.free(a);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.download(a, &mut out)));
        assert!(r.is_err(), "a freed buffer");
        let t = be.alloc(4, DType::U32).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.download(t, &mut out)));
        assert!(r.is_err(), "a u32 buffer read as f32");
    }

    /// The NaN-checking mode, as the checked front of every op ([`crate::backend::ops`]) uses
    /// it: new memory and each op's outputs are poisoned, and an output left unwritten or
    /// computed from unwritten memory stops the program, naming the op.
    #[test]
    fn nan_check_catches_an_op_that_skips_part_of_its_output() {
        use crate::backend::ops::Ops;
        let mut be = CpuBackend::new(true);
        let a = be.alloc(8, DType::F32).unwrap();
        let mut host = [0f32; 8];
        be.download(a, &mut host).unwrap();
        assert!(host.iter().all(|x| is_poison(*x)), "new memory is poisoned");
        // An op that writes only half its output.
        be.poison(a);
        be.run("half", [W(a)], [], [], |[o], [], []| o[..4].fill(2.0));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.check_written(a, "half", 0)));
        let msg = *r.unwrap_err().downcast::<String>().unwrap();
        assert!(msg.contains("half left element 4"), "{msg}");
        // An op that reads memory nobody wrote: the marker reaches its output.
        let (x, y) = (be.alloc(4, DType::F32).unwrap(), be.alloc(4, DType::F32).unwrap());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Ops::new(&mut be).gelu_forward(y, x)));
        assert!(r.is_err(), "gelu of unwritten memory");
        // Correct ops pass, and a NaN they compute themselves is not mistaken for the marker.
        be.fill(x, f32::INFINITY);
        Ops::new(&mut be).residual_forward(y, x, x);
        let z = be.alloc(4, DType::F32).unwrap();
        be.upload(z, &[f32::NEG_INFINITY; 4]);
        Ops::new(&mut be).residual_forward(y, x, z);
        be.download(y, &mut host[..4]).unwrap();
        assert!(host[..4].iter().all(|v| v.is_nan() && !is_poison(*v)));
    }

    #[test]
    fn adamw_skips_a_step_whose_loss_or_norm_is_not_finite() {
        let mut be = CpuBackend::new(false);
        let (p, g) = (buf(&mut be, &[1.0, 2.0]), buf(&mut be, &[0.5, -0.5]));
        let (m, v) = (buf(&mut be, &[0.0; 2]), buf(&mut be, &[0.0; 2]));
        let mut h = AdamWParams {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: 1.0,
            t: 1,
            skip: SkipAbove::NON_FINITE,
            seed: 0,
            place: None,
        };
        let mut out = [0f32; 2];
        for bad in [[f32::NAN, 1.0], [1.0, f32::INFINITY]] {
            let stats = buf(&mut be, &bad);
            be.adamw_update(&AdamwUpdate { params: p, work: None, grads: g, m, v, stats, h });
            be.download(p, &mut out).unwrap();
            assert_eq!(out, [1.0, 2.0], "skipped");
        }
        // Above a limit (outlier skipping): skipped; at the limit: applied.
        let stats = buf(&mut be, &[2.0, 0.5]);
        for skip in [SkipAbove { loss: 1.9, norm_sq: 1.0 }, SkipAbove { loss: 3.0, norm_sq: 0.49 }] {
            h.skip = skip;
            be.adamw_update(&AdamwUpdate { params: p, work: None, grads: g, m, v, stats, h });
            be.download(p, &mut out).unwrap();
            assert_eq!(out, [1.0, 2.0], "skipped by {skip:?}");
        }
        h.skip = SkipAbove { loss: 2.0, norm_sq: 0.5 };
        let stats = buf(&mut be, &[2.0, 0.5]);
        be.adamw_update(&AdamwUpdate { params: p, work: None, grads: g, m, v, stats, h });
        be.download(p, &mut out).unwrap();
        assert!((out[0] - 0.9).abs() < 1e-6 && (out[1] - 2.1).abs() < 1e-6, "{out:?}");
    }

    /// Every op on bf16 buffers gives its f32 result on the same (bf16-valued) inputs rounded
    /// to nearest even, bit for bit: the ops compute in f32 and round each output once, as
    /// llm.c's bf16 kernels do. Statistics (norm mean and rstd, attention's row statistics,
    /// losses, log-sum-exps) stay f32 and equal. Odd shapes; with and without the NaN-checking
    /// mode (which would stop on an output element left unwritten).
    #[test]
    fn bf16_ops_round_their_f32_results_once() {
        use crate::backend::ops::{Heads, Mat, Ops, Rows, Seq};
        use crate::core::bf16::{from_f32, to_f32};
        let (b, t, nh, nkv, hs) = (2, 5, 4, 2, 3);
        let (n, c) = (b * t, nh * hs); // C = 12
        let (v, vp, oc) = (7, 9, 11);
        let h = Heads { nh, nkv, hs };
        let qkv = h.qkv();
        let mut seed = 17u32;
        let mut rand = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    to_f32(from_f32((seed >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0))
                })
                .collect()
        };
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 1) % v as u32).collect();
        let rope: Vec<f32> = (0..t * hs).map(|i| ((i as f32) * 0.3).cos()).collect();
        // (name, input lengths, output (length, stat), the op on (inputs, outputs, token ids))
        type Op = Box<dyn Fn(&mut Ops, &[Buf], &[Buf], Buf)>;
        let s = Seq { b, t };
        const SCRATCH: bool = false; // a workspace: not compared
        type Case = (&'static str, Vec<usize>, Vec<(usize, bool)>, Op);
        let cases: Vec<Case> = vec![
            (
                "matmul_forward",
                vec![n * c, oc * c, oc],
                vec![(n * oc, false)],
                Box::new(move |o, i, x, _| o.matmul_forward(x[0], i[0], i[1], Some(i[2]), Mat { n, c, oc })),
            ),
            (
                "matmul_backward",
                vec![n * oc, n * c, oc * c],
                vec![(n * c, false), (oc * c, false), (oc, false)],
                Box::new(move |o, i, x, _| {
                    o.matmul_backward(Some(x[0]), x[1], Some(x[2]), i[0], i[1], i[2], Mat { n, c, oc }, true)
                }),
            ),
            (
                "layernorm_forward",
                vec![n * c, c, c],
                vec![(n * c, false), (n, true), (n, true)],
                Box::new(move |o, i, x, _| o.layernorm_forward(x[0], x[1], x[2], i[0], i[1], i[2], Rows { n, c })),
            ),
            (
                "layernorm_backward",
                vec![n * c, n * c, c, n, n],
                vec![(n * c, false), (c, false), (c, false)],
                Box::new(move |o, i, x, _| {
                    o.layernorm_backward(x[0], x[1], x[2], i[0], i[1], i[2], i[3], i[4], Rows { n, c })
                }),
            ),
            (
                "rmsnorm_forward",
                vec![n * c, c],
                vec![(n * c, false), (n, true)],
                Box::new(move |o, i, x, _| o.rmsnorm_forward(x[0], x[1], i[0], i[1], Rows { n, c }, 1e-5)),
            ),
            (
                "rmsnorm_backward",
                vec![n * c, n * c, c, n],
                vec![(n * c, false), (c, false)],
                Box::new(move |o, i, x, _| o.rmsnorm_backward(x[0], x[1], i[0], i[1], i[2], i[3], Rows { n, c })),
            ),
            ("gelu_forward", vec![n * c], vec![(n * c, false)], Box::new(|o, i, x, _| o.gelu_forward(x[0], i[0]))),
            ("gelu_backward", vec![n * c], vec![(n * c, false)], Box::new(|o, i, x, _| o.gelu_backward(x[0], i[0]))),
            (
                "swiglu_forward",
                vec![n * 2 * c],
                vec![(n * c, false)],
                Box::new(move |o, i, x, _| o.swiglu_forward(x[0], i[0], Rows { n, c })),
            ),
            (
                "swiglu_backward",
                vec![n * c, n * 2 * c],
                vec![(n * 2 * c, false)],
                Box::new(move |o, i, x, _| o.swiglu_backward(x[0], i[0], i[1], Rows { n, c })),
            ),
            (
                "residual_forward",
                vec![n * c, n * c],
                vec![(n * c, false)],
                Box::new(|o, i, x, _| o.residual_forward(x[0], i[0], i[1])),
            ),
            (
                "rope_forward",
                vec![t * hs],
                vec![(n * qkv, false)],
                Box::new(move |o, i, x, _| o.rope_forward(x[0], i[0], n, t, 0, h)),
            ),
            (
                "rope_backward",
                vec![t * hs],
                vec![(n * qkv, false)],
                Box::new(move |o, i, x, _| o.rope_backward(x[0], i[0], n, t, 0, h)),
            ),
            (
                "head_norm_forward",
                vec![n * qkv, hs, hs],
                vec![(n * qkv, false), (n * (nh + nkv), true)],
                Box::new(move |o, i, x, _| o.head_norm_forward(x[0], x[1], i[0], i[1], i[2], n, h, 1e-6)),
            ),
            (
                "head_norm_backward",
                vec![n * qkv, n * qkv, hs, hs, n * (nh + nkv)],
                vec![(n * qkv, false), (hs, false), (hs, false)],
                Box::new(move |o, i, x, _| o.head_norm_backward(x[0], x[1], x[2], i[0], i[1], i[2], i[3], i[4], n, h)),
            ),
            (
                // 3 new positions after 2 cached ones, in a cache of 6 (its last row unread).
                "attention_forward_cached",
                vec![3 * qkv],
                vec![(3 * c, false), (6 * h.kv(), false), (6 * h.kv(), false), (3 * c, SCRATCH)],
                Box::new(move |o, i, x, _| o.attention_forward_cached(x[0], x[3], i[0], x[1], x[2], 2, 3, 6, h)),
            ),
            (
                "attention_forward",
                vec![n * qkv],
                vec![(n * c, false), (b * nh * t * 2, true), (n * c, SCRATCH)],
                Box::new(move |o, i, x, _| o.attention_forward(x[0], x[1], x[2], i[0], s, h)),
            ),
            (
                "attention_backward",
                vec![n * c, n * qkv, b * nh * t * 2],
                vec![(n * qkv, false), (n * 3 * c, SCRATCH)],
                Box::new(move |o, i, x, _| o.attention_backward(x[0], x[1], i[0], i[1], i[2], s, h)),
            ),
            (
                "crossentropy_backward",
                vec![n],
                vec![(n * vp, false)],
                Box::new(move |o, i, x, ids| o.crossentropy_backward(x[0], i[0], ids, 0.5, n, v, vp)),
            ),
            (
                "encoder_forward",
                vec![vp * c, t * c],
                vec![(n * c, false)],
                Box::new(move |o, i, x, ids| o.encoder_forward(x[0], ids, i[0], Some(i[1]), s, c)),
            ),
            (
                "encoder_backward",
                vec![n * c],
                vec![(vp * c, false), (t * c, false)],
                Box::new(move |o, i, x, ids| o.encoder_backward(x[0], Some(x[1]), i[0], ids, s, c)),
            ),
            (
                "crossentropy_forward",
                vec![n * vp],
                vec![(n, true), (n, true)],
                Box::new(move |o, i, x, ids| o.crossentropy_forward(x[0], x[1], i[0], ids, n, v, vp)),
            ),
        ];
        for nan_check in [false, true] {
            for (name, ins, outs, op) in &cases {
                let host_in: Vec<Vec<f32>> = ins.iter().map(|&l| rand(l)).collect();
                let host_out: Vec<Vec<f32>> = outs.iter().map(|&(l, _)| rand(l)).collect();
                let run = |dtype: DType| -> Vec<Vec<f32>> {
                    let mut be = CpuBackend::new(nan_check);
                    let up = |be: &mut CpuBackend, x: &[f32], dt: DType| {
                        let buf = be.alloc(x.len(), dt).unwrap();
                        be.upload(buf, x);
                        buf
                    };
                    // Statistics inputs (layernorm's mean and rstd, rmsnorm's rstd) are f32.
                    let stat_in = |k: usize| {
                        (name.ends_with("norm_backward") && k >= ins.len() - 2 + name.starts_with("rms") as usize)
                            || (*name == "attention_backward" && k == 2)
                            || *name == "crossentropy_backward"
                    };
                    let i: Vec<Buf> = host_in
                        .iter()
                        .enumerate()
                        .map(|(k, x)| up(&mut be, x, if stat_in(k) { DType::F32 } else { dtype }))
                        .collect();
                    let o: Vec<Buf> = host_out
                        .iter()
                        .zip(outs)
                        .map(|(x, &(_, stat))| up(&mut be, x, if stat { DType::F32 } else { dtype }))
                        .collect();
                    let tok = be.alloc(n, DType::U32).unwrap();
                    be.upload_u32(tok, &ids);
                    // Layer norms' statistics must be positive; the rope table is the rope's.
                    let rope_in = be.alloc(t * hs, DType::F32).unwrap();
                    be.upload(rope_in, &rope);
                    let i = if *name == "rope_forward" { vec![rope_in] } else { i };
                    op(&mut Ops::new(&mut be), &i, &o, tok);
                    o.iter()
                        .map(|&x| {
                            let mut h = vec![0f32; x.len];
                            be.download(x, &mut h).unwrap();
                            h
                        })
                        .collect()
                };
                let (f, bf) = (run(DType::F32), run(DType::BF16));
                for (k, (&(_, stat), (f, bf))) in outs.iter().zip(f.iter().zip(&bf)).enumerate() {
                    if name.starts_with("attention") && k == outs.len() - 1 {
                        continue; // the workspace
                    }
                    let finite = f.iter().filter(|x| x.is_finite() && **x != 0.0).count();
                    assert!(2 * finite >= f.len(), "{name} output {k}: mostly zero or not finite, a vacuous check");
                    for (j, (x, y)) in f.iter().zip(bf).enumerate() {
                        let want = if stat { *x } else { to_f32(from_f32(*x)) };
                        assert!(
                            want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()),
                            "{name} output {k} element {j}: bf16 {y} vs f32 {x} rounded {want} (NaN check {nan_check})"
                        );
                    }
                }
            }
        }
    }
}

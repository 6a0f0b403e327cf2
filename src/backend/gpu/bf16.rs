//! bf16 storage on the GPU (kernels/bf16.wgsl): the conversions, and the f32 copies through
//! which an op runs on bf16 buffers its kernels do not read and write themselves.
//!
//! A bf16 buffer holds two elements in each 32-bit word (WGSL has no 16-bit storage type).
//! Most ops' kernels have bf16 variants that read and write such buffers as they are
//! (kernel.rs: Entry::variants). An op that has none for its case (what it sums across dispatches or
//! pieces, mixed dtypes) runs its fp32 kernels on f32 workspace copies: inputs (and outputs it
//! adds to) widened first, exactly; outputs rounded back after, once per element, to nearest
//! even (or stochastically where the CPU rounds so). Either way that is the CPU's bf16
//! arithmetic (cpu/backend.rs: `run_rounded`, whose native bf16 paths give the same bits): f32
//! inside every op, bf16 between ops. The copies live in a pool that keeps, by best fit, about
//! the largest such op's bf16 buffers.

use super::kernel::{Entry, Module, K};
use super::{f, u, GpuBackend, Threads};
use crate::backend::ops::{Call, Out as CallOut};
use crate::backend::ops::{Convert, ConvertOps};
use crate::backend::{Backend, Buf, DType, Noise, SkipAbove};

/// How an op uses one of its buffers (the roles of [`Backend`]'s docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// Read only: widened before the op.
    In,
    /// Overwritten whole: rounded back after the op.
    Out,
    /// Read and updated (`+=`, in place): widened before, rounded back after.
    InOut,
    /// Workspace: neither.
    Scratch,
}
use Role::{InOut, Out, Scratch};

/// How a bf16 result is rounded from its f32 value (cpu/bf16.rs).
#[derive(Clone, Copy, Debug)]
pub(super) enum Rounding {
    Nearest,
    /// Stochastically, with this seed; element i of the output draws the noise of index
    /// first + i, where first is the given place of its first element or else its offset in
    /// its allocation (cpu/backend.rs: Rounding).
    Stochastic(u32, Option<u64>),
}

fn is_bf16(b: Buf) -> bool {
    b.dtype == DType::BF16 && b.len > 0
}

/// A limit of [`SkipAbove`] as a kernel compares it, without infinities (a limit of +inf skips
/// nothing finite, a NaN limit skips everything).
pub(super) fn limit(x: f32) -> f32 {
    if x.is_nan() {
        f32::MIN
    } else {
        x.min(f32::MAX)
    }
}

/// 32-bit words that elements off..off+n of a bf16 window touch.
fn words(off: u32, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let (off, n) = (off as usize, n);
    ((off + n - 1) >> 1) - (off >> 1) + 1
}

impl GpuBackend {
    /// dst (N, f32) (out) = src (N, bf16), exactly.
    pub(super) fn widen(&mut self, dst: Buf, src: Buf) {
        assert!(dst.dtype == DType::F32 && src.dtype == DType::BF16 && dst.len == src.len, "widen {src:?} to {dst:?}");
        for r in self.mem.pieces(&[dst, src], dst.len) {
            let n = r.end - r.start;
            let (h, x) = (self.win(src.slice(r.clone())), self.win(dst.slice(r)));
            let imm = [h.off, x.off, u(n)];
            self.dispatch(WIDEN, &[h, x], &imm, Threads(n));
        }
    }

    /// dst (N, bf16) (out) = src (N, f32) rounded as `rounding` says; with `skip`, only if the
    /// step's stats (2) do not skip the step ([`SkipAbove::skips`]).
    pub(super) fn narrow(&mut self, dst: Buf, src: Buf, rounding: Rounding, skip: Option<(Buf, SkipAbove)>) {
        assert!(dst.dtype == DType::BF16 && src.dtype == DType::F32 && dst.len == src.len, "narrow {src:?} to {dst:?}");
        let (seed, base, mut flags) = match rounding {
            Rounding::Nearest => (0, dst.off as u64, 0),
            Rounding::Stochastic(seed, first) => (seed, first.unwrap_or(dst.off as u64), 1),
        };
        let (st, limits) = match skip {
            Some((stats, limits)) => {
                assert_eq!((stats.dtype, stats.len), (DType::F32, 2), "narrow: the step's stats");
                flags |= 2;
                (self.win(stats), limits)
            }
            None => (self.mem.dummy.clone(), SkipAbove::NON_FINITE),
        };
        for r in self.mem.pieces(&[dst, src], dst.len) {
            let n = r.end - r.start;
            // The noise of stochastic rounding is keyed by the element's place, as on the
            // CPU; the GPU's indices stay below 2^32 (its allocations, the parameters).
            let first = u32::try_from(base + r.start as u64).expect("stochastic rounding's index fits 32 bits");
            let (h, x) = (self.win(dst.slice(r.clone())), self.win(src.slice(r)));
            #[rustfmt::skip]
            let imm = [
                h.off, x.off, u(n), first, seed, flags, st.off,
                f(limit(limits.loss)), f(limit(limits.norm_sq)), 0,
            ];
            let w = words(h.off, n);
            self.dispatch(NARROW, &[h, x, st.clone()], &imm, Threads(w));
        }
    }

    /// Every element of the bf16 dst (out) = value, rounded to nearest even.
    pub(super) fn fill_bf16(&mut self, dst: Buf, value: f32) {
        for r in self.mem.pieces(&[dst], dst.len) {
            let n = r.end - r.start;
            let h = self.win(dst.slice(r));
            let imm = [h.off, 0, u(n), 0, 0, 0, 0, 0, 0, f(value)];
            let w = words(h.off, n);
            self.dispatch(FILL_BF16, std::slice::from_ref(&h), &imm, Threads(w));
        }
    }

    /// An f32 workspace of `len` elements from the pool: (the whole allocation, its first `len`
    /// elements). The best fit of the pool; when none is large enough, its largest is replaced
    /// by one of this size (so the pool keeps about the largest op's buffers, not one of every
    /// size). None when that does not fit in memory (the fault is reported at the next host
    /// read).
    fn take_wide(&mut self, len: usize) -> Option<(Buf, Buf)> {
        let pool = &self.wide;
        let fit = pool.iter().enumerate().filter(|(_, b)| b.len >= len).min_by_key(|(_, b)| b.len).map(|x| x.0);
        if let Some(i) = fit {
            let b = self.wide.swap_remove(i);
            return Some((b, b.prefix(len)));
        }
        if let Some(i) = pool.iter().enumerate().max_by_key(|(_, b)| b.len).map(|x| x.0) {
            let b = self.wide.swap_remove(i);
            self.free(b);
        }
        match self.mem.alloc(&self.ctx, &[len], DType::F32) {
            Ok(b) => Some((b, b)),
            Err(e) => {
                self.fault.get_or_insert(format!("{e:#}"));
                None
            }
        }
    }

    /// Run `op` on f32 buffers: each bf16 buffer of `bufs` reaches it as an f32 copy (see the
    /// module docs), rounded back by `rounding` if the op writes it. Without bf16 buffers, the
    /// op runs on `bufs` as they are. Panics if an output overlaps another buffer of the call
    /// (the copies would hide it from the op's own check).
    pub(super) fn in_f32<const N: usize>(
        &mut self,
        op: &str,
        bufs: [(Buf, Role); N],
        rounding: Rounding,
        run: impl FnOnce(&mut Self, [Buf; N]),
    ) {
        self.in_f32_of(op, &bufs, rounding, |s, b| run(s, std::array::from_fn(|i| b[i])))
    }

    /// [`GpuBackend::in_f32`] of a whole call, its buffers' roles as the contract gives them
    /// ([`Call::roles`]): `run` gets the call on the copies.
    pub(super) fn call_in_f32<const O: usize, const I: usize, C: Call<O, I>>(
        &mut self,
        a: &C,
        rounding: Rounding,
        run: impl FnOnce(&mut Self, &C),
    ) {
        let (outs, ins) = a.roles();
        let role = |o: &CallOut| match *o {
            CallOut::W(b) => (b, Out),
            CallOut::Rw(b) => (b, InOut),
            CallOut::Scratch(b) => (b, Scratch),
        };
        let bufs: Vec<(Buf, Role)> = outs.iter().map(role).chain(ins.iter().map(|&b| (b, Role::In))).collect();
        self.in_f32_of(C::NAME, &bufs, rounding, |s, b| {
            run(s, &a.on(std::array::from_fn(|i| b[i]), std::array::from_fn(|k| b[O + k])))
        })
    }

    /// [`GpuBackend::in_f32`] on a list of buffers.
    fn in_f32_of(&mut self, op: &str, bufs: &[(Buf, Role)], rounding: Rounding, run: impl FnOnce(&mut Self, &[Buf])) {
        for (i, &(o, role)) in bufs.iter().enumerate() {
            if role == Role::In {
                continue;
            }
            if let Some((x, _)) =
                bufs.iter().enumerate().filter(|(j, _)| *j != i).map(|x| x.1).find(|x| x.0.overlaps(o))
            {
                panic!("{op}: output {o:?} overlaps {x:?}");
            }
        }
        if !bufs.iter().any(|&(b, _)| is_bf16(b)) {
            let plain: Vec<Buf> = bufs.iter().map(|b| b.0).collect();
            return run(self, &plain);
        }
        let mut copies: Vec<Option<(Buf, Buf)>> = vec![None; bufs.len()];
        for (i, &(b, role)) in bufs.iter().enumerate() {
            if !is_bf16(b) {
                continue;
            }
            let Some(c) = self.take_wide(b.len) else {
                self.wide.extend(copies.iter().flatten().map(|c| c.0));
                return;
            };
            if !matches!(role, Out | Scratch) {
                self.widen(c.1, b);
            }
            copies[i] = Some(c);
        }
        let on: Vec<Buf> = copies.iter().zip(bufs).map(|(c, b)| c.map_or(b.0, |c| c.1)).collect();
        run(self, &on);
        for (i, c) in copies.into_iter().enumerate() {
            let Some((whole, copy)) = c else { continue };
            if matches!(bufs[i].1, Out | InOut) {
                self.narrow(bufs[i].0, copy, rounding, None);
            }
            self.wide.push(whole);
        }
    }

    /// Host values into a bf16 buffer, rounded to nearest even (through an f32 copy, so that a
    /// tensor starting or ending in the middle of a word keeps its neighbour's half).
    pub(super) fn upload_bf16(&mut self, dst: Buf, src: &[f32]) {
        let Some((whole, copy)) = self.take_wide(dst.len) else { return };
        self.write(copy, bytemuck::cast_slice(src));
        self.narrow(dst, copy, Rounding::Nearest, None);
        self.wide.push(whole);
    }

    /// A bf16 buffer's values on the host, as f32.
    pub(super) fn download_bf16(&mut self, src: Buf, dst: &mut [f32]) -> anyhow::Result<()> {
        let Some((whole, copy)) = self.take_wide(src.len) else { return self.check() };
        self.widen(copy, src);
        let r = self.download(copy, dst);
        self.wide.push(whole);
        r
    }

    /// dst = src converted ([`Backend::convert`]).
    pub(super) fn convert_(&mut self, dst: Buf, src: Buf, noise: Option<Noise>) {
        assert!(!dst.overlaps(src), "convert: output {dst:?} overlaps {src:?}");
        let rounding = noise.map_or(Rounding::Nearest, |n| Rounding::Stochastic(n.seed, Some(n.first)));
        match (dst.dtype, src.dtype) {
            (DType::F32, DType::F32) => self.copy_rows(dst, dst.len, src, src.len, 1, src.len),
            (DType::BF16, DType::F32) => self.narrow(dst, src, rounding, None),
            (DType::F32, DType::BF16) => self.widen(dst, src),
            (DType::BF16, DType::BF16) => {
                // Widening then rounding is exact: a copy whatever the rounding.
                let Some((whole, copy)) = self.take_wide(src.len) else { return };
                self.widen(copy, src);
                self.narrow(dst, copy, Rounding::Nearest, None);
                self.wide.push(whole);
            }
            (d, s) => panic!("convert: from {s:?} to {d:?}"),
        }
    }
}

impl ConvertOps for GpuBackend {
    fn convert(&mut self, a: &Convert) {
        self.convert_(a.dst, a.src, a.noise)
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// f32 <-> bf16 conversions of whole buffers (kernels/bf16.wgsl, which declares its own buffers).
pub(super) const MODULE: Module = Module {
    name: "bf16",
    src: include_str!("kernels/bf16.wgsl"),
    buffers: &[],
    entries: &[
        Entry { name: "widen", bindings: 2, u32s: 0, bf16s: 0b1, variants: &[] },
        Entry { name: "narrow", bindings: 3, u32s: 0, bf16s: 0b1, variants: &[] },
        Entry { name: "fill_bf16", bindings: 1, u32s: 0, bf16s: 0b1, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const WIDEN: K = K::of(&MODULE, 0);
pub(super) const NARROW: K = K::of(&MODULE, 1);
pub(super) const FILL_BF16: K = K::of(&MODULE, 2);

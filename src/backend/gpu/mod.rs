//! The GPU backend: llm.c's layers as WGSL compute kernels run through wgpu, so one binary
//! trains on Metal (macOS), Vulkan (Linux, Windows: NVIDIA, AMD, Intel) and DX12 (Windows).
//! The kernels compute in fp32; bf16 buffers (`--precision bf16`) are stored two values to a
//! 32-bit word, which the kernels' bf16 variants read and write themselves ([`kernel`]: a
//! prelude types each buffer of a module), and the rest reach as f32 copies ([`bf16`]).
//! Checked against the CPU backend op by op and step by step, in both precisions
//! (tests/gpu_ops.rs, tests/gpu.rs).
//!
//! One file per layer kind, named as the CPU's (`gpu/layernorm.rs` computes the dispatches of
//! `gpu/kernels/layernorm.wgsl`); the device, memory and command recording are in
//! [`context`], [`memory`] and [`record`], the pipelines in [`pipelines`]. Every op only records work; the host waits only in
//! [`Backend::download`] and [`Backend::synchronize`], which is also where a device fault (out
//! of memory, a lost device) becomes an error.

mod adamw;
mod attention;
mod bf16;
mod classifier;
mod context;
mod encoder;
mod gelu;
pub mod kernel;
mod layernorm;
mod lora;
mod matmul;
mod memory;
pub mod pipelines;
mod record;
mod residual;
mod rmsnorm;
mod rope;
mod swiglu;
pub mod wgsl;

use crate::backend::{Backend, Buf, DType};
use crate::core::profile::Kind;
use anyhow::Result;
use context::Context;
use kernel::K;
use memory::{Memory, Sizes, Win};
use pipelines::Kernels;
use record::Recorder;
use std::collections::HashMap;

pub use context::{describe_adapters, software_vulkan_adapters, LOOKED_FOR};

/// Threads per workgroup of the elementwise and row kernels (kernels/common.wgsl: WG).
const WG: usize = 256;

/// `r` cut into pieces of at most `n`.
fn cut(r: std::ops::Range<usize>, n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (r.start..r.end).step_by(n.max(1)).map(move |s| s..(s + n).min(r.end))
}

/// How the backend is set up. The defaults come from the adapter and the drivers' limits; tests
/// make them small, to put tensors at chunk boundaries and make every op cut its work into
/// pieces on tiny shapes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Adapter index (`--device gpu:N`); None picks the best one.
    pub adapter: Option<usize>,
    /// Largest chunk of memory holding several tensors (default: the binding limit).
    pub chunk_bytes: Option<u64>,
    /// Largest binding (default: the adapter's).
    pub max_binding: Option<u64>,
    /// Refuse to hold more than this many bytes (default: no limit but the device's).
    pub memory_limit: Option<u64>,
    /// Lose the device after this many submissions (tests of the error path).
    pub lose_after: Option<usize>,
    /// Most of a GEMM's sum one dispatch covers (default [`K_PER_DISPATCH`]).
    pub k_per_dispatch: Option<usize>,
    /// Most rows a kernel loops over (default [`LOOP_ROWS`]).
    pub loop_rows: Option<usize>,
    /// Most workgroups in one dimension of a grid (default: the adapter's, at most 65535).
    pub max_groups: Option<usize>,
    /// Run the GEMM as the tiled kernel even on a device that would take the subgroup one
    /// (kernels/matmul_subgroup.wgsl): the tests that compare their bits.
    pub tiled_gemm: bool,
}

/// Most of the sum dimension K one GEMM dispatch covers; a longer sum (the classifier's Vp) is
/// cut into dispatches that add to the output in order. lavapipe stops a shader after 65535
/// loop iterations in all, which a 64x64 tile reaches at K of about 30000.
pub const K_PER_DISPATCH: usize = 4096;
/// Most iterations of a kernel's loop over rows (the encoder backward's positions of a token),
/// for the same reason; longer loops are cut into dispatches that continue in order.
pub const LOOP_ROWS: usize = 8192;

/// How work is cut into dispatches (from [`Options`]).
#[derive(Clone, Copy, Debug)]
struct Cuts {
    k_per_dispatch: usize,
    loop_rows: usize,
    max_groups: usize,
}

/// How many workgroups a dispatch runs.
#[derive(Clone, Copy, Debug)]
enum Grid {
    /// One thread per element: ceil(n / WG) workgroups (the kernel skips the extra threads).
    Threads(usize),
    /// n workgroups (one per row).
    Groups(usize),
    /// A 3-D grid as given (GEMM tiles; each dimension within the limit).
    Xyz([u32; 3]),
}
use Grid::{Groups, Threads, Xyz};

/// Environment variable that injects a device fault, for tests of the error paths through the
/// whole program: `lose-device-after=N` (submissions), or `memory-limit=BYTES`.
use crate::core::env::GPU_TEST_FAULT;

impl Options {
    /// `adapter`, with the GEMM [`crate::core::env::GPU_GEMM`] asks for, and a fault from
    /// [`GPU_TEST_FAULT`] when set.
    pub fn from_env(adapter: Option<usize>) -> anyhow::Result<Self> {
        let gemm = crate::core::env::GPU_GEMM;
        let tiled_gemm = match crate::core::env::text(gemm).as_deref() {
            None | Some("auto") => false,
            Some("tiled") => true,
            Some(v) => anyhow::bail!("{gemm}={v}: use tiled or auto (the default)"),
        };
        let mut o = Options { adapter, tiled_gemm, ..Default::default() };
        let Some(v) = crate::core::env::text(GPU_TEST_FAULT) else { return Ok(o) };
        let num = |s: &str| s.parse::<u64>().map_err(|_| anyhow::anyhow!("{GPU_TEST_FAULT}={v}: not a number"));
        match v.split_once('=') {
            Some(("lose-device-after", n)) => o.lose_after = Some(num(n)? as usize),
            Some(("memory-limit", n)) => o.memory_limit = Some(num(n)?),
            _ => anyhow::bail!("{GPU_TEST_FAULT}={v}: use lose-device-after=N or memory-limit=BYTES"),
        }
        Ok(o)
    }
}

pub struct GpuBackend {
    ctx: Context,
    kernels: Kernels,
    mem: Memory,
    rec: Recorder,
    /// The host's copy of every u32 buffer, which only the host writes (token ids): the
    /// encoder's backward groups positions by token from it, as llm.c does on the host.
    host_u32: HashMap<u32, Vec<u32>>,
    /// Workspace of partial sums: (blocks, C) of the column sums, (pieces) of the global norm;
    /// each op uses it only between its own dispatches (which run in the order they are
    /// recorded). Grown on use.
    scratch: Option<Buf>,
    /// Workspace of attention's two score tiles (gpu/attention.rs), grown on use.
    att_tiles: [Option<Buf>; 2],
    /// Workspace of the encoder backward's token buckets (u32; see gpu/encoder.rs), grown on use.
    buckets: Option<Buf>,
    /// An op that could not record its work (its workspace did not fit in memory): reported at
    /// the next host read, as a device fault is.
    fault: Option<String>,
    /// The f32 copies of bf16 buffers that ops compute on (gpu/bf16.rs), kept between ops.
    wide: Vec<Buf>,
    cuts: Cuts,
}

impl GpuBackend {
    /// Open the adapter `opts.adapter` (or the best one) and build every kernel module (each
    /// pipeline is built at its first dispatch).
    pub fn open(opts: Options) -> Result<Self> {
        let ctx = Context::open(context::choose(opts.adapter)?, opts.tiled_gemm)?;
        let kernels = Kernels::build(&ctx)?;
        let l = &ctx.limits;
        let max_binding =
            opts.max_binding.unwrap_or(l.max_storage_buffer_binding_size).min(l.max_storage_buffer_binding_size);
        let sizes = Sizes {
            chunk_bytes: opts.chunk_bytes.unwrap_or(max_binding).min(max_binding),
            max_binding,
            max_buffer: l.max_buffer_size,
            align: l.min_storage_buffer_offset_alignment as u64,
        };
        let mem = Memory::new(&ctx.device, sizes, opts.memory_limit);
        let max_groups = (l.max_compute_workgroups_per_dimension as usize).min(65535);
        let cuts = Cuts {
            k_per_dispatch: opts.k_per_dispatch.unwrap_or(K_PER_DISPATCH).max(1),
            loop_rows: opts.loop_rows.unwrap_or(LOOP_ROWS).max(1),
            max_groups: opts.max_groups.unwrap_or(max_groups).clamp(1, max_groups),
        };
        ctx.check()?;
        Ok(GpuBackend {
            ctx,
            kernels,
            mem,
            rec: Recorder::new(opts.lose_after),
            host_u32: HashMap::new(),
            scratch: None,
            att_tiles: [None, None],
            buckets: None,
            fault: None,
            wide: vec![],
            cuts,
        })
    }

    /// Build a WGSL module and its pipelines on this device through the functions that build
    /// the backend's own kernels (the common helpers prepended; `entries`: entry points and the
    /// buffers each binds): how the tests see that a shader that does not build on a driver is
    /// a clear error.
    pub fn build_wgsl(&self, name: &str, src: &str, entries: &[(&str, usize)]) -> Result<()> {
        let src = format!("{}\n{src}", kernel::COMMON);
        self.kernels.build_extra(&self.ctx, name, &src, entries)
    }

    /// Whether the GEMM runs as the subgroup kernel (kernels/matmul_subgroup.wgsl).
    pub fn subgroup_gemm(&self) -> bool {
        self.ctx.subgroup_gemm
    }

    /// Free the pool of f32 copies of bf16 buffers (gpu/bf16.rs) that earlier ops left, so
    /// that [`Backend::workspace_bytes`] counts only the copies that later ops take (tests of
    /// which ops read bf16 themselves).
    pub fn free_f32_copies(&mut self) {
        for b in std::mem::take(&mut self.wide) {
            self.free(b);
        }
    }

    /// Whether the adapter times passes (`llmrs bench`'s time per layer kind).
    pub fn timestamps(&self) -> bool {
        self.ctx.timestamps
    }

    /// Lose the device on purpose, to test that a lost GPU is a clear error.
    pub fn lose_device(&mut self) {
        self.rec.submit(&self.ctx);
        self.ctx.destroy();
    }

    fn win(&self, b: Buf) -> Win {
        self.mem.win(b)
    }

    fn dispatch(&mut self, k: K, wins: &[Win], imm: &[u32], grid: Grid) {
        let max = self.cuts.max_groups;
        let groups = |n: usize| -> [u32; 3] {
            let y = n.div_ceil(max);
            assert!(y.div_ceil(max) <= max, "{k:?}: {n} workgroups");
            match (n <= max, y <= max) {
                (true, _) => [u(n), 1, 1],
                (false, true) => [u(max), u(y), 1],
                (false, false) => [u(max), u(max), u(y.div_ceil(max))],
            }
        };
        let xyz = match grid {
            Threads(n) => groups(n.div_ceil(WG)),
            Groups(n) => groups(n),
            Xyz(g) => g,
        };
        assert!(xyz.iter().all(|&g| g as usize <= max), "{k:?}: grid {xyz:?} past {max} workgroups");
        for (i, w) in wins.iter().enumerate() {
            let want = Kernels::binding_dtype(k, i);
            assert!(
                w.dtype == want || w.chunk == 0,
                "{k:?}: binding {i} holds {:?}, the kernel reads {want:?}",
                w.dtype
            );
        }
        if let Err(e) = self.kernels.prepare(&self.ctx, k) {
            self.fault.get_or_insert(format!("{e:#}"));
            return;
        }
        self.rec.dispatch(&self.ctx, &self.kernels, k, wins, imm, xyz);
    }

    /// Panic unless no output overlaps another buffer of the call (a bug in the caller): the
    /// kernels bind every buffer read-write, so an overlap would race, where the CPU backend
    /// refuses it.
    fn disjoint(op: &str, outs: &[Buf], ins: &[Buf]) {
        for (i, o) in outs.iter().enumerate() {
            let others = outs.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| x).chain(ins);
            if let Some(x) = others.into_iter().find(|x| x.overlaps(*o)) {
                panic!("{op}: output {o:?} overlaps {x:?}");
            }
        }
    }

    /// A backend-owned workspace of at least `len` elements, grown as needed. None when it
    /// does not fit in memory: the op then records nothing, and the next host read reports it.
    fn workspace(&mut self, slot: fn(&mut Self) -> &mut Option<Buf>, len: usize, dtype: DType) -> Option<Buf> {
        if let Some(b) = *slot(self) {
            if b.len >= len {
                return Some(b.prefix(len));
            }
            *slot(self) = None;
            self.free(b);
        }
        match self.mem.alloc(&self.ctx, &[len.next_power_of_two().max(64)], dtype) {
            Ok(b) => {
                *slot(self) = Some(b);
                if dtype == DType::U32 {
                    self.host_u32.insert(b.alloc, vec![0; b.len]);
                }
                Some(b.prefix(len))
            }
            Err(e) => {
                self.fault.get_or_insert(format!("{e:#}"));
                None
            }
        }
    }

    /// A fault an op could not report when it happened.
    fn check(&self) -> Result<()> {
        if let Some(e) = &self.fault {
            anyhow::bail!("{e}");
        }
        self.ctx.check()
    }

    /// dst (n) [+]= the sum over `blocks` rows of partials (blocks, n), in order (the second
    /// half of a column sum).
    fn column_sums(&mut self, dst: Buf, partials: Buf, blocks: usize, n: usize, accumulate: bool) {
        let (d, p) = (self.win(dst), self.win(partials));
        let imm = [d.off, u(n), 0, u(blocks), 0, p.off, 0, accumulate as u32];
        self.dispatch(memory::COLUMN_SUMS, &[d, p], &imm, Threads(n));
    }

    /// Record a copy of `rows` rows of `cols` elements: dst[r*d_rs + j] = src[r*s_rs + j]
    /// (both f32, or both bf16: the copy of a bf16 value is exact).
    fn copy_rows(&mut self, dst: Buf, d_rs: usize, src: Buf, s_rs: usize, rows: usize, cols: usize) {
        let (d, s) = (self.win(dst), self.win(src));
        let imm = [d.off, u(cols), 0, u(rows), u(d_rs), s.off, u(s_rs)];
        let kernel = memory::COPY_ROWS.on(dst.dtype == DType::BF16);
        self.dispatch(kernel, &[d, s], &imm, Threads(rows * cols));
    }
}

/// A shape or offset as a kernel's u32 (shapes are validated far below 2^32 elements).
fn u(x: usize) -> u32 {
    u32::try_from(x).expect("GPU shapes fit 32 bits")
}

/// An f32 immediate.
fn f(x: f32) -> u32 {
    x.to_bits()
}

impl crate::backend::ops::Kernels for GpuBackend {}

impl Backend for GpuBackend {
    fn describe(&self) -> String {
        let i = &self.ctx.info;
        let gemm = if self.ctx.subgroup_gemm { "; the GEMM through subgroups" } else { "" };
        format!(
            "gpu: fp32 WGSL kernels (bf16 storage read and written by the kernels{gemm}) on {} ({:?} {:?}; {} {})",
            i.name, i.device_type, i.backend, i.driver, i.driver_info
        )
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    fn workspace_bytes(&self) -> usize {
        self.wide.iter().map(|b| b.len * 4).sum()
    }

    fn alloc(&mut self, len: usize, dtype: DType) -> Result<Buf> {
        self.alloc_parts(&[len], dtype)
    }

    fn alloc_parts(&mut self, parts: &[usize], dtype: DType) -> Result<Buf> {
        let b = self.mem.alloc(&self.ctx, parts, dtype)?;
        if dtype == DType::U32 {
            self.host_u32.insert(b.alloc, vec![0; b.len]);
        }
        Ok(b)
    }

    fn free(&mut self, buf: Buf) {
        // Recorded work keeps its buffers alive (wgpu counts references) until it has run.
        self.mem.free(buf);
        self.host_u32.remove(&buf.alloc);
        self.rec.forget_bind_groups();
    }

    fn upload(&mut self, dst: Buf, src: &[f32]) {
        crate::backend::same_len("upload", dst, src.len());
        if dst.dtype == DType::BF16 {
            return self.upload_bf16(dst, src);
        }
        assert_eq!(dst.dtype, DType::F32, "upload: {dst:?} is not an f32 buffer");
        self.write(dst, bytemuck::cast_slice(src));
    }

    fn upload_u32(&mut self, dst: Buf, src: &[u32]) {
        crate::backend::same_len("upload_u32", dst, src.len());
        assert_eq!(dst.dtype, DType::U32, "upload_u32: {dst:?} is not a u32 buffer");
        let host = self.host_u32.get_mut(&dst.alloc).expect("a u32 buffer of this backend");
        host[dst.off..dst.off + dst.len].copy_from_slice(src);
        self.write(dst, bytemuck::cast_slice(src));
    }

    fn download(&mut self, src: Buf, dst: &mut [f32]) -> Result<()> {
        crate::backend::same_len("download", src, dst.len());
        if src.dtype == DType::BF16 {
            return self.download_bf16(src, dst);
        }
        assert_eq!(src.dtype, DType::F32, "download: {src:?} is not an f32 buffer");
        let spans: Vec<_> =
            self.mem.spans(src).into_iter().map(|(b, off, r)| (b, off, (r.end - r.start) as u64 * 4)).collect();
        self.check()?;
        self.rec.read(&self.ctx, &spans, bytemuck::cast_slice_mut(dst))?;
        self.rec.read_timestamps(&self.ctx)
    }

    fn fill(&mut self, dst: Buf, value: f32) {
        if dst.dtype == DType::BF16 {
            return self.fill_bf16(dst, value);
        }
        for r in self.mem.pieces(&[dst], dst.len) {
            let w = self.win(dst.slice(r.clone()));
            let n = r.end - r.start;
            self.dispatch(memory::FILL, std::slice::from_ref(&w), &[w.off, u(n), f(value)], Threads(n));
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.check()?;
        self.rec.submit(&self.ctx);
        self.ctx.wait()?;
        self.rec.read_timestamps(&self.ctx)
    }

    fn host_f32(&mut self, _buf: Buf) -> Option<&mut [f32]> {
        None
    }

    fn set_profiling(&mut self, on: bool) {
        self.rec.set_profiling(&self.ctx, on);
    }
    fn profile_begin(&mut self, kind: Kind) {
        // A failed read of the timestamps is reported at the next host read.
        if let Err(e) = self.rec.profile_begin(&self.ctx, kind) {
            self.fault.get_or_insert(format!("{e:#}"));
        }
    }
    fn profile_end(&mut self) {
        self.rec.profile_end();
    }
    fn profile_totals(&mut self) -> Result<Vec<(Kind, f64)>> {
        self.rec.profile_totals(&self.ctx)
    }

    // An op whose kernels have bf16 variants (kernel.rs: Entry::variants) runs them on its bf16 tensors
    // as they are, where its statistics are f32 and each bf16 output element is one sum of one
    // dispatch, rounded once where it is stored. What is summed across dispatches or pieces
    // (the norms' and biases' parameter gradients, the embedding's gradient, a GEMM over more
    // than a dispatch's K, grouped heads' key and value gradients) goes through `in_f32`
    // (gpu/bf16.rs): f32 copies, rounded once after, with each buffer's role as ops.rs gives
    // it (In, Out, InOut, Scratch), as every op of mixed or unusual dtypes does.
}

/// Whether every operand is bf16 (an absent one aside): the GEMM's kernels then read them as
/// they are (kernels/matmul.wgsl), with no f32 copies.
pub(super) fn all_bf16(bufs: &[Buf]) -> bool {
    bufs.iter().all(|b| b.dtype == DType::BF16 || *b == crate::backend::ops::NONE)
}

/// Whether every buffer is f32: the statistics and tables a bf16 kernel reads and writes as
/// f32 (the native path of an op needs them so; else the op runs on f32 copies).
pub(super) fn all_f32(bufs: &[Buf]) -> bool {
    bufs.iter().all(|b| b.dtype == DType::F32)
}

impl GpuBackend {
    /// Write host bytes into b (after the work recorded so far, which is submitted first: the
    /// queue runs writes and submissions in order).
    fn write(&mut self, b: Buf, bytes: &[u8]) {
        self.rec.submit(&self.ctx);
        for (buf, off, r) in self.mem.spans(b) {
            self.ctx.queue.write_buffer(&buf, off, &bytes[r.start * 4..r.end * 4]);
        }
    }
}

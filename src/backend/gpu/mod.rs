//! The GPU backend: llm.c's layers as WGSL compute kernels run through wgpu, so one binary
//! trains on Metal (macOS), Vulkan (Linux, Windows: NVIDIA, AMD, Intel) and DX12 (Windows).
//! The kernels compute in fp32; bf16 buffers (`--precision bf16`) are stored two values to a
//! 32-bit word, which the kernels' bf16 variants read and write themselves ([`kernels`]: a
//! prelude types each buffer of a module), and the rest reach as f32 copies ([`bf16`]).
//! Checked against the CPU backend op by op and step by step, in both precisions
//! (tests/gpu_ops.rs, tests/gpu.rs).
//!
//! One file per layer kind, named as the CPU's (`gpu/layernorm.rs` computes the dispatches of
//! `gpu/kernels/layernorm.wgsl`); the device, memory and command recording are in
//! [`context`], [`memory`] and [`record`]. Every op only records work; the host waits only in
//! [`Backend::download`] and [`Backend::synchronize`], which is also where a device fault (out
//! of memory, a lost device) becomes an error.

mod adamw;
mod attention;
mod bf16;
mod classifier;
mod context;
mod encoder;
mod gelu;
pub mod kernels;
mod layernorm;
mod lora;
mod matmul;
mod memory;
mod record;
mod residual;
mod rmsnorm;
mod rope;
mod swiglu;

use crate::backend::{AdamWParams, Backend, Buf, DType, LoraShape, Noise};
use crate::core::profile::Kind;
use anyhow::Result;
use bf16::Role::{In, InOut, Out, Scratch};
use bf16::Rounding::{Nearest, Stochastic};
use context::Context;
use kernels::{Kernels, K};
use memory::{Memory, Sizes, Win};
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
        let src = format!("{}\n{src}", kernels::COMMON);
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
        self.dispatch(K::ColumnSums, &[d, p], &imm, Threads(n));
    }

    /// Record a copy of `rows` rows of `cols` elements: dst[r*d_rs + j] = src[r*s_rs + j]
    /// (both f32, or both bf16: the copy of a bf16 value is exact).
    fn copy_rows(&mut self, dst: Buf, d_rs: usize, src: Buf, s_rs: usize, rows: usize, cols: usize) {
        let (d, s) = (self.win(dst), self.win(src));
        let imm = [d.off, u(cols), 0, u(rows), u(d_rs), s.off, u(s_rs)];
        let kernel = K::CopyRows.on(dst.dtype == DType::BF16);
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

use crate::backend::lens;

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
        lens!("upload"; dst => src.len());
        if dst.dtype == DType::BF16 {
            return self.upload_bf16(dst, src);
        }
        assert_eq!(dst.dtype, DType::F32, "upload: {dst:?} is not an f32 buffer");
        self.write(dst, bytemuck::cast_slice(src));
    }

    fn upload_u32(&mut self, dst: Buf, src: &[u32]) {
        lens!("upload_u32"; dst => src.len());
        assert_eq!(dst.dtype, DType::U32, "upload_u32: {dst:?} is not a u32 buffer");
        let host = self.host_u32.get_mut(&dst.alloc).expect("a u32 buffer of this backend");
        host[dst.off..dst.off + dst.len].copy_from_slice(src);
        self.write(dst, bytemuck::cast_slice(src));
    }

    fn download(&mut self, src: Buf, dst: &mut [f32]) -> Result<()> {
        lens!("download"; src => dst.len());
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
            self.dispatch(K::Fill, std::slice::from_ref(&w), &[w.off, u(n), f(value)], Threads(n));
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

    // An op whose kernels have bf16 variants (kernels.rs: BF16) runs them on its bf16 tensors
    // as they are, where its statistics are f32 and each bf16 output element is one sum of one
    // dispatch, rounded once where it is stored. What is summed across dispatches or pieces
    // (the norms' and biases' parameter gradients, the embedding's gradient, a GEMM over more
    // than a dispatch's K, grouped heads' key and value gradients) goes through `in_f32`
    // (gpu/bf16.rs): f32 copies, rounded once after, with each buffer's role as ops.rs gives
    // it (In, Out, InOut, Scratch), as every op of mixed or unusual dtypes does.

    fn encoder_forward(&mut self, out: Buf, inp: Buf, wte: Buf, wpe: Option<Buf>, b: usize, t: usize, c: usize) {
        if all_bf16(&[out, wte, opt(wpe)]) {
            // The bf16 tables read and out written as they are.
            return self.encoder_forward_(out, inp, wte, wpe, b, t, c);
        }
        let bufs = [(out, Out), (inp, In), (wte, In), (opt(wpe), In)];
        self.in_f32("encoder_forward", bufs, Nearest, |s, [out, inp, wte, p]| {
            s.encoder_forward_(out, inp, wte, back(wpe, p), b, t, c)
        })
    }
    fn encoder_backward(&mut self, dwte: Buf, dwpe: Option<Buf>, dout: Buf, inp: Buf, b: usize, t: usize, c: usize) {
        let bufs = [(dwte, InOut), (opt(dwpe), InOut), (dout, In), (inp, In)];
        self.in_f32("encoder_backward", bufs, Nearest, |s, [dwte, p, dout, inp]| {
            s.encoder_backward_(dwte, back(dwpe, p), dout, inp, b, t, c)
        })
    }
    fn layernorm_forward(&mut self, out: Buf, mean: Buf, rstd: Buf, inp: Buf, w: Buf, bias: Buf, n: usize, c: usize) {
        if all_bf16(&[out, inp, w, bias]) && all_f32(&[mean, rstd]) {
            return self.layernorm_forward_(out, mean, rstd, inp, w, bias, n, c);
        }
        let bufs = [(out, Out), (mean, Out), (rstd, Out), (inp, In), (w, In), (bias, In)];
        self.in_f32("layernorm_forward", bufs, Nearest, |s, [out, mean, rstd, inp, w, bias]| {
            s.layernorm_forward_(out, mean, rstd, inp, w, bias, n, c)
        })
    }
    fn layernorm_backward(
        &mut self,
        dinp: Buf,
        dweight: Buf,
        dbias: Buf,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        mean: Buf,
        rstd: Buf,
        n: usize,
        c: usize,
    ) {
        if all_bf16(&[dinp, dout, inp, weight]) && all_f32(&[mean, rstd]) {
            let bufs = [(dweight, InOut), (dbias, InOut)];
            return self.in_f32("layernorm_backward", bufs, Nearest, |s, [dw, db]| {
                s.layernorm_backward_(dinp, dw, db, dout, inp, weight, mean, rstd, n, c)
            });
        }
        #[rustfmt::skip]
        let bufs = [
            (dinp, InOut), (dweight, InOut), (dbias, InOut),
            (dout, In), (inp, In), (weight, In), (mean, In), (rstd, In),
        ];
        self.in_f32("layernorm_backward", bufs, Nearest, |s, [dx, dw, db, dout, inp, w, mean, rstd]| {
            s.layernorm_backward_(dx, dw, db, dout, inp, w, mean, rstd, n, c)
        })
    }
    fn rmsnorm_forward(&mut self, out: Buf, rstd: Buf, inp: Buf, weight: Buf, n: usize, c: usize, eps: f32) {
        if all_bf16(&[out, inp, weight]) && all_f32(&[rstd]) {
            return self.rmsnorm_forward_(out, rstd, inp, weight, n, c, eps);
        }
        let bufs = [(out, Out), (rstd, Out), (inp, In), (weight, In)];
        self.in_f32("rmsnorm_forward", bufs, Nearest, |s, [out, rstd, inp, w]| {
            s.rmsnorm_forward_(out, rstd, inp, w, n, c, eps)
        })
    }
    fn rmsnorm_backward(
        &mut self,
        dinp: Buf,
        dweight: Buf,
        dout: Buf,
        inp: Buf,
        weight: Buf,
        rstd: Buf,
        n: usize,
        c: usize,
    ) {
        if all_bf16(&[dinp, dout, inp, weight]) && all_f32(&[rstd]) {
            return self.in_f32("rmsnorm_backward", [(dweight, InOut)], Nearest, |s, [dw]| {
                s.rmsnorm_backward_(dinp, dw, dout, inp, weight, rstd, n, c)
            });
        }
        let bufs = [(dinp, InOut), (dweight, InOut), (dout, In), (inp, In), (weight, In), (rstd, In)];
        self.in_f32("rmsnorm_backward", bufs, Nearest, |s, [dx, dw, dout, inp, w, rstd]| {
            s.rmsnorm_backward_(dx, dw, dout, inp, w, rstd, n, c)
        })
    }
    fn head_norm_forward(
        &mut self,
        out: Buf,
        rstd: Buf,
        inp: Buf,
        wq: Buf,
        wk: Buf,
        n: usize,
        nh: usize,
        nkv: usize,
        hs: usize,
        eps: f32,
    ) {
        if all_bf16(&[out, inp, wq, wk]) && all_f32(&[rstd]) {
            return self.head_norm_forward_(out, rstd, inp, wq, wk, n, (nh, nkv, hs), eps);
        }
        let bufs = [(out, Out), (rstd, Out), (inp, In), (wq, In), (wk, In)];
        self.in_f32("head_norm_forward", bufs, Nearest, |s, [out, rstd, inp, wq, wk]| {
            s.head_norm_forward_(out, rstd, inp, wq, wk, n, (nh, nkv, hs), eps)
        })
    }
    fn head_norm_backward(
        &mut self,
        dinp: Buf,
        dwq: Buf,
        dwk: Buf,
        dout: Buf,
        inp: Buf,
        wq: Buf,
        wk: Buf,
        rstd: Buf,
        n: usize,
        nh: usize,
        nkv: usize,
        hs: usize,
    ) {
        if all_bf16(&[dinp, dout, inp, wq, wk]) && all_f32(&[rstd]) {
            return self.in_f32("head_norm_backward", [(dwq, InOut), (dwk, InOut)], Nearest, |s, [dwq, dwk]| {
                s.head_norm_backward_(dinp, dwq, dwk, dout, inp, (wq, wk, rstd), n, (nh, nkv, hs))
            });
        }
        #[rustfmt::skip]
        let bufs = [
            (dinp, Out), (dwq, InOut), (dwk, InOut),
            (dout, In), (inp, In), (wq, In), (wk, In), (rstd, In),
        ];
        self.in_f32("head_norm_backward", bufs, Nearest, |s, [dx, dwq, dwk, dout, inp, wq, wk, rstd]| {
            s.head_norm_backward_(dx, dwq, dwk, dout, inp, (wq, wk, rstd), n, (nh, nkv, hs))
        })
    }
    fn rope_forward(&mut self, qkv: Buf, rope: Buf, n: usize, t: usize, pos: usize, nh: usize, nkv: usize, hs: usize) {
        if all_bf16(&[qkv]) && all_f32(&[rope]) {
            return self.rope_(qkv, rope, n, t, pos, nh, nkv, hs, 1.0);
        }
        self.in_f32("rope_forward", [(qkv, InOut), (rope, In)], Nearest, |s, [qkv, rope]| {
            s.rope_(qkv, rope, n, t, pos, nh, nkv, hs, 1.0)
        })
    }
    fn rope_backward(
        &mut self,
        dqkv: Buf,
        rope: Buf,
        n: usize,
        t: usize,
        pos: usize,
        nh: usize,
        nkv: usize,
        hs: usize,
    ) {
        if all_bf16(&[dqkv]) && all_f32(&[rope]) {
            return self.rope_(dqkv, rope, n, t, pos, nh, nkv, hs, -1.0);
        }
        self.in_f32("rope_backward", [(dqkv, InOut), (rope, In)], Nearest, |s, [dqkv, rope]| {
            s.rope_(dqkv, rope, n, t, pos, nh, nkv, hs, -1.0)
        })
    }
    fn swiglu_forward(&mut self, out: Buf, inp: Buf, n: usize, f: usize) {
        if all_bf16(&[out, inp]) {
            return self.swiglu_forward_(out, inp, n, f);
        }
        self.in_f32("swiglu_forward", [(out, Out), (inp, In)], Nearest, |s, [out, inp]| {
            s.swiglu_forward_(out, inp, n, f)
        })
    }
    fn swiglu_backward(&mut self, dinp: Buf, dout: Buf, inp: Buf, n: usize, f: usize) {
        if all_bf16(&[dinp, dout, inp]) {
            return self.swiglu_backward_(dinp, dout, inp, n, f);
        }
        let bufs = [(dinp, Out), (dout, In), (inp, In)];
        self.in_f32("swiglu_backward", bufs, Nearest, |s, [dx, dout, inp]| s.swiglu_backward_(dx, dout, inp, n, f))
    }
    fn residual_forward(&mut self, out: Buf, a: Buf, b: Buf) {
        if all_bf16(&[out, a, b]) {
            return self.residual_forward_(out, a, b);
        }
        let bufs = [(out, Out), (a, In), (b, In)];
        self.in_f32("residual_forward", bufs, Nearest, |s, [out, a, b]| s.residual_forward_(out, a, b))
    }
    fn matmul_forward(&mut self, out: Buf, inp: Buf, weight: Buf, bias: Option<Buf>, n: usize, c: usize, oc: usize) {
        if all_bf16(&[inp, weight, opt(bias)]) {
            // The GEMM reads its bf16 operands itself, and writes a bf16 output itself when
            // its sum is one dispatch's; a longer one goes through an f32 copy (summed in f32
            // across dispatches, and rounded once at the end).
            Self::disjoint("matmul_forward", &[out], &[inp, weight, opt(bias)]);
            if out.dtype == DType::F32 || c <= self.cuts.k_per_dispatch {
                return self.matmul_forward_(out, inp, weight, bias, n, c, oc);
            }
            return self.in_f32("matmul_forward", [(out, Out)], Nearest, |s, [out]| {
                s.matmul_forward_(out, inp, weight, bias, n, c, oc)
            });
        }
        let bufs = [(out, Out), (inp, In), (weight, In), (opt(bias), In)];
        self.in_f32("matmul_forward", bufs, Nearest, |s, [out, inp, w, b]| {
            s.matmul_forward_(out, inp, w, back(bias, b), n, c, oc)
        })
    }
    fn matmul_backward(
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
        let grad = if accumulate { InOut } else { Out };
        if all_bf16(&[dout, inp, weight]) {
            // As matmul_forward: the bf16 operands read as they are; dinp and dweight written
            // by the GEMM itself when each element's sum is one dispatch (dinp's over OC,
            // dweight's over N, neither cut into pieces that fit a binding), else through f32
            // copies, as the bias gradient (column sums) always.
            let outs = [opt(dinp), opt(dweight), opt(dbias)];
            Self::disjoint("matmul_backward", &outs, &[dout, inp, weight]);
            let step = self.cuts.k_per_dispatch;
            let one = |s: &Self, k: usize, bufs: &[(Buf, usize)]| k <= step && s.mem.row_pieces(k, bufs).len() <= 1;
            let direct = |x: Option<Buf>, one: bool| x.is_none_or(|x| x.dtype == DType::F32 || one);
            // (The pieces matmul_backward_ cuts OC and N into.)
            let w_rows: Vec<_> = [Some((weight, c)), dweight.map(|d| (d, c))].into_iter().flatten().collect();
            let n_rows: Vec<_> =
                [Some((dout, oc)), Some((inp, c)), dinp.map(|d| (d, c))].into_iter().flatten().collect();
            let dinp_direct = direct(dinp, one(self, oc, &w_rows));
            let dw_direct = direct(dweight, one(self, n, &n_rows));
            let copy = |x: Option<Buf>, direct: bool| if direct { bf16::NONE } else { opt(x) };
            let bufs = [(copy(dinp, dinp_direct), Out), (copy(dweight, dw_direct), grad), (outs[2], grad)];
            return self.in_f32("matmul_backward", bufs, Nearest, |s, [dx, dw, db]| {
                s.matmul_backward_(
                    if dinp_direct { dinp } else { back(dinp, dx) },
                    if dw_direct { dweight } else { back(dweight, dw) },
                    back(dbias, db),
                    dout,
                    inp,
                    weight,
                    n,
                    c,
                    oc,
                    accumulate,
                )
            });
        }
        #[rustfmt::skip]
        let bufs = [
            (opt(dinp), Out), (opt(dweight), grad), (opt(dbias), grad),
            (dout, In), (inp, In), (weight, In),
        ];
        self.in_f32("matmul_backward", bufs, Nearest, |s, [dx, dw, db, dout, inp, w]| {
            s.matmul_backward_(back(dinp, dx), back(dweight, dw), back(dbias, db), dout, inp, w, n, c, oc, accumulate)
        })
    }
    fn lora_forward(&mut self, out: Buf, h: Buf, inp: Buf, a: Buf, b: Buf, sh: LoraShape) {
        if all_bf16(&[out, inp]) && all_f32(&[a, b]) {
            // A bf16 base's input read and output added to as they are (fp32 adapters); h
            // (N, R), scaled after its GEMM, through an f32 copy rounded once.
            return self.in_f32("lora_forward", [(h, Out)], Nearest, |s, [h]| s.lora_forward_(out, h, inp, a, b, sh));
        }
        // h is written whole (and rounded back, as on the CPU, which the tests compare).
        let bufs = [(out, InOut), (h, Out), (inp, In), (a, In), (b, In)];
        self.in_f32("lora_forward", bufs, Nearest, |s, [out, h, inp, a, b]| s.lora_forward_(out, h, inp, a, b, sh))
    }
    fn lora_backward(
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
        sh: LoraShape,
    ) {
        if all_bf16(&[dout, inp, opt(dinp)]) && all_f32(&[a, b, da, db]) {
            // As lora_forward: the base's bf16 tensors as they are, h and dh (N, R) through
            // f32 copies.
            return self.in_f32("lora_backward", [(h, In), (dh, Out)], Nearest, |s, [h, dh]| {
                s.lora_backward_(dinp, da, db, h, dh, dout, inp, a, b, sh)
            });
        }
        #[rustfmt::skip]
        let bufs = [
            (opt(dinp), InOut), (da, InOut), (db, InOut), (h, In), (dh, Out),
            (dout, In), (inp, In), (a, In), (b, In),
        ];
        self.in_f32("lora_backward", bufs, Nearest, |s, [dx, da, db, h, dh, dout, inp, a, b]| {
            s.lora_backward_(back(dinp, dx), da, db, h, dh, dout, inp, a, b, sh)
        })
    }
    fn gelu_forward(&mut self, out: Buf, inp: Buf) {
        if all_bf16(&[out, inp]) {
            return self.gelu_forward_(out, inp);
        }
        self.in_f32("gelu_forward", [(out, Out), (inp, In)], Nearest, |s, [out, inp]| s.gelu_forward_(out, inp))
    }
    fn gelu_backward(&mut self, d: Buf, inp: Buf) {
        if all_bf16(&[d, inp]) {
            return self.gelu_backward_(d, inp);
        }
        self.in_f32("gelu_backward", [(d, InOut), (inp, In)], Nearest, |s, [d, inp]| s.gelu_backward_(d, inp))
    }
    fn attention_forward(
        &mut self,
        out: Buf,
        stats: Buf,
        ws: Buf,
        qkv: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    ) {
        // bf16 q, k, v read and out written by the GEMMs themselves (the scores and
        // probabilities are f32 tiles), where out's sums over T are one dispatch each.
        if all_bf16(&[out, qkv]) && all_f32(&[stats]) && t <= self.cuts.k_per_dispatch {
            return self.attention_forward_(out, stats, ws, qkv, b, t, c, nh, nkv);
        }
        let bufs = [(out, Out), (stats, Out), (ws, Scratch), (qkv, In)];
        self.in_f32("attention_forward", bufs, Nearest, |s, [out, stats, ws, qkv]| {
            s.attention_forward_(out, stats, ws, qkv, b, t, c, nh, nkv)
        })
    }
    fn attention_backward(
        &mut self,
        dqkv: Buf,
        workspace: Buf,
        dout: Buf,
        qkv: Buf,
        stats: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    ) {
        if all_bf16(&[dqkv, dout, qkv]) && all_f32(&[stats]) {
            // bf16 qkv and dout read by the GEMMs themselves; dqkv written by them where each
            // element is one sum of one dispatch: with one query head per key/value head (the
            // key and value gradients of grouped heads add up over the heads, in f32 in a copy,
            // rounded once) and T at most a dispatch's sum.
            if nh == nkv && t <= self.cuts.k_per_dispatch {
                return self.attention_backward_(dqkv, workspace, dout, qkv, stats, b, t, c, nh, nkv);
            }
            return self.in_f32("attention_backward", [(dqkv, Out)], Nearest, |s, [dqkv]| {
                s.attention_backward_(dqkv, workspace, dout, qkv, stats, b, t, c, nh, nkv)
            });
        }
        let bufs = [(dqkv, Out), (workspace, Scratch), (dout, In), (qkv, In), (stats, In)];
        self.in_f32("attention_backward", bufs, Nearest, |s, [dqkv, ws, dout, qkv, stats]| {
            s.attention_backward_(dqkv, ws, dout, qkv, stats, b, t, c, nh, nkv)
        })
    }
    fn attention_forward_cached(
        &mut self,
        out: Buf,
        workspace: Buf,
        qkv: Buf,
        k_cache: Buf,
        v_cache: Buf,
        pos: usize,
        tn: usize,
        c: usize,
        nh: usize,
        nkv: usize,
        max_t: usize,
    ) {
        // Only the rows the cache holds, with the new ones, reach the op (in a bf16 run, only
        // they are widened and rounded back; the kernels read no further).
        let kv = c.checked_div(nh).unwrap_or(0) * nkv;
        let held = ((pos + tn) * kv).min(k_cache.len).min(v_cache.len);
        if all_bf16(&[out, qkv, k_cache, v_cache]) && pos + tn <= self.cuts.k_per_dispatch {
            // All read and written as they are (the new keys and values copied into the
            // caches as bf16, exactly), the scores in an f32 tile.
            return self.attention_forward_cached_(out, workspace, qkv, k_cache, v_cache, pos, tn, c, nh, nkv, max_t);
        }
        #[rustfmt::skip]
        let bufs = [
            (out, Out), (workspace, Scratch), (qkv, In),
            (k_cache.prefix(held), InOut), (v_cache.prefix(held), InOut),
        ];
        self.in_f32("attention_forward_cached", bufs, Nearest, |s, [out, ws, qkv, k, v]| {
            s.attention_forward_cached_(out, ws, qkv, k, v, pos, tn, c, nh, nkv, max_t)
        })
    }
    fn crossentropy_forward(&mut self, losses: Buf, lse: Buf, logits: Buf, tg: Buf, n: usize, v: usize, vp: usize) {
        if all_bf16(&[logits]) && all_f32(&[losses, lse]) {
            // The bf16 logits read as they are.
            return self.crossentropy_forward_(losses, lse, logits, tg, n, v, vp);
        }
        let bufs = [(losses, Out), (lse, Out), (logits, In), (tg, In)];
        self.in_f32("crossentropy_forward", bufs, Nearest, |s, [losses, lse, logits, tg]| {
            s.crossentropy_forward_(losses, lse, logits, tg, n, v, vp)
        })
    }
    fn crossentropy_backward(&mut self, logits: Buf, lse: Buf, tg: Buf, dloss: f32, n: usize, v: usize, vp: usize) {
        if all_bf16(&[logits]) && all_f32(&[lse]) {
            // The bf16 logits become their bf16 gradient in place.
            return self.crossentropy_backward_(logits, lse, tg, dloss, n, v, vp);
        }
        let bufs = [(logits, InOut), (lse, In), (tg, In)];
        self.in_f32("crossentropy_backward", bufs, Nearest, |s, [logits, lse, tg]| {
            s.crossentropy_backward_(logits, lse, tg, dloss, n, v, vp)
        })
    }
    fn accumulate_mean(&mut self, acc: Buf, x: Buf, weight: f32) {
        self.in_f32("accumulate_mean", [(acc, InOut), (x, In)], Nearest, |s, [acc, x]| {
            s.accumulate_mean_(acc, x, weight)
        })
    }
    fn global_norm_squared(&mut self, out: Buf, grads: Buf, accumulate: bool) {
        if all_bf16(&[grads]) && all_f32(&[out]) {
            // The bf16 gradients read as they are.
            return self.global_norm_squared_(out, grads, accumulate);
        }
        let o = if accumulate { InOut } else { Out };
        self.in_f32("global_norm_squared", [(out, o), (grads, In)], Nearest, |s, [out, grads]| {
            s.global_norm_squared_(out, grads, accumulate)
        })
    }
    fn adamw_update(&mut self, params: Buf, grads: Buf, m: Buf, v: Buf, stats: Buf, h: &AdamWParams) {
        // bf16 parameters (no master weights) are rounded back stochastically; a skipped step
        // rounds their exact f32 copies, which leaves them as they were.
        if all_bf16(&[grads]) && all_f32(&[m, v, stats]) {
            // bf16 gradients read, and bf16 parameters rounded stochastically, as they are.
            return self.adamw_update_(params, grads, m, v, stats, h);
        }
        let bufs = [(params, InOut), (grads, In), (m, InOut), (v, InOut), (stats, In)];
        self.in_f32("adamw_update", bufs, Stochastic(h.seed, h.place), |s, [p, g, m, v, stats]| {
            s.adamw_update_(p, g, m, v, stats, h)
        })
    }
    fn adamw_update_and_copy(
        &mut self,
        params: Buf,
        work: Buf,
        grads: Buf,
        m: Buf,
        v: Buf,
        stats: Buf,
        h: &AdamWParams,
    ) {
        assert!(params.dtype == DType::F32 && work.dtype == DType::BF16, "adamw_update_and_copy: {params:?}, {work:?}");
        Self::disjoint("adamw_update", &[params, work, m, v], &[grads, stats]);
        self.adamw_update(params, grads, m, v, stats, h);
        // The working copy from the updated master weights, as the CPU rounds it (noise keyed
        // by its own places); left as it was when the step is skipped.
        self.narrow(work, params, Stochastic(h.seed, h.place), Some((stats, h.skip)));
    }

    fn convert(&mut self, dst: Buf, src: Buf, noise: Option<Noise>) {
        self.convert_(dst, src, noise)
    }
}

/// An optional operand as a buffer ([`bf16::NONE`] when absent), for [`GpuBackend::in_f32`].
fn opt(b: Option<Buf>) -> Buf {
    b.unwrap_or(bf16::NONE)
}

/// Whether every operand is bf16 (an absent one aside): the GEMM's kernels then read them as
/// they are (kernels/matmul.wgsl), with no f32 copies.
fn all_bf16(bufs: &[Buf]) -> bool {
    bufs.iter().all(|b| b.dtype == DType::BF16 || *b == bf16::NONE)
}

/// Whether every buffer is f32: the statistics and tables a bf16 kernel reads and writes as
/// f32 (the native path of an op needs them so; else the op runs on f32 copies).
fn all_f32(bufs: &[Buf]) -> bool {
    bufs.iter().all(|b| b.dtype == DType::F32)
}

/// The buffer an op gets for the optional operand `orig` (its f32 copy, or itself).
fn back(orig: Option<Buf>, b: Buf) -> Option<Buf> {
    orig.map(|_| b)
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

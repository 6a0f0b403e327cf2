//! The seam between the model and the device it runs on.
//!
//! The model ([`crate::model`]) is a list of llm.c's layer calls on [`Buf`] handles into memory
//! that a [`Backend`] owns. One backend is chosen at start-up ([`Device`], `--device`) and
//! reached through a `Box<dyn Backend>`; a training step makes a few hundred calls, so the
//! dynamic dispatch costs nothing measurable. Adding a device means adding its files (e.g.
//! `src/backend/cuda/mod.rs` and one kernel file per layer) and an arm in [`factory::open`]; the model,
//! the training loop and everything above them do not change.
//!
//! Every op's contract is written once in [`ops`]: its call (buffers and shapes, with the
//! dimension names of [`crate::core::config`]), the role of each buffer, its lengths and its
//! profile kind. The model's families call the ops through [`ops::Ops`], the checked front; a
//! device implements each layer's trait there on calls that keep to the contract, in its own
//! file of that layer. An op only queues work: results reach the host through
//! [`Backend::download`], which waits for everything queued before it. Ops never fail on valid
//! shapes; a device error surfaces at the next download or [`Backend::synchronize`].

pub mod comm;
pub mod cpu;
pub mod factory;
pub mod gpu;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ops;

use crate::core::profile::Kind;
use anyhow::{bail, Result};
use std::ops::Range;

/// Element type of a buffer: f32, bf16 (`--precision bf16`: parameters, gradients and
/// activations, see [`crate::core::config::Precision`]) or u32 (token ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    U32,
}

impl DType {
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 => 2,
        }
    }
}

/// A handle to `len` elements of type `dtype` at element `off` of one backend allocation.
/// Small and `Copy`, so the model passes handles around freely; it carries no lifetime, and the
/// backend checks it against its allocation on every use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    pub alloc: u32,
    pub off: usize,
    pub len: usize,
    pub dtype: DType,
}

impl Buf {
    /// Elements `r` of this buffer.
    pub fn slice(self, r: Range<usize>) -> Buf {
        assert!(r.start <= r.end && r.end <= self.len, "slice {r:?} of a buffer of {} elements", self.len);
        Buf { off: self.off + r.start, len: r.end - r.start, ..self }
    }

    /// The first `n` elements.
    pub fn prefix(self, n: usize) -> Buf {
        self.slice(0..n)
    }

    /// The `i`-th of consecutive pieces of `size` elements (e.g. layer l of an (L, N, C) buffer).
    pub fn part(self, i: usize, size: usize) -> Buf {
        self.slice(i * size..(i + 1) * size)
    }

    /// Whether two handles share an element.
    pub fn overlaps(self, other: Buf) -> bool {
        self.alloc == other.alloc
            && self.len > 0
            && other.len > 0
            && self.off < other.off + other.len
            && other.off < self.off + self.len
    }
}

/// Panic unless the host values of a transfer (`n`) are as many as the buffer's elements (a
/// bug in the caller): every backend's upload and download check it.
pub(crate) fn same_len(op: &str, b: Buf, n: usize) {
    assert_eq!(b.len, n, "{op}: {n} host values for a buffer of {} elements", b.len);
}

/// Where the model runs, chosen once at start-up (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// fp32 on every core ([`crate::backend::cpu`]).
    #[default]
    Cpu,
    /// A GPU through wgpu (Vulkan, Metal, DX12: [`crate::backend::gpu`]): the N-th adapter of `llmrs
    /// devices`, or with None the best one (a discrete GPU first, a software one last).
    Gpu(Option<usize>),
    /// An NVIDIA GPU by index through CUDA (not built yet).
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let index = |prefix: &str| s.strip_prefix(prefix).map(str::parse::<usize>);
        match s {
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu(None)),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match (index("gpu:"), index("cuda:")) {
                (Some(Ok(i)), _) => Ok(Device::Gpu(Some(i))),
                (_, Some(Ok(i))) => Ok(Device::Cuda(i)),
                _ => bail!("unknown device '{s}': use cpu, gpu or gpu:N (`llmrs devices` lists the GPUs)"),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Gpu(None) => write!(f, "gpu"),
            Device::Gpu(Some(i)) => write!(f, "gpu:{i}"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Hyperparameters of one AdamW update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Already chosen for the tensor (0 for those without decay).
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f32,
    /// 1-based step, for bias correction.
    pub t: i32,
    /// When the step is skipped instead of applied.
    pub skip: SkipAbove,
    /// The seed of the stochastic rounding of bf16 parameters (without master weights) and
    /// of the working copy.
    pub seed: u32,
    /// The place of the tensor's first element that the rounding noise is keyed by (element i
    /// draws index `place + i`); None: its offset in its allocation. ZeRO-3 gives a shard its
    /// place in the whole parameters, so that the ranks round as one process does.
    pub place: Option<u64>,
}

/// Stochastic rounding into bf16 (llm.c's, for parameters written from fp32 master weights):
/// deterministic for the seed and each element's index, `first` + its place in the operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Noise {
    pub seed: u32,
    pub first: u64,
}

impl Noise {
    /// The noise of `seed` keyed by each element's place in dst's allocation.
    pub fn at(seed: u32, dst: Buf) -> Self {
        Noise { seed, first: dst.off as u64 }
    }
}

/// The limits above which a step is skipped (llm.c's `-sl`/`-sg` outlier skipping, turned into
/// bounds on the host before the step so that the device decides without a host round trip).
/// A step whose loss or squared gradient norm is not finite is always skipped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SkipAbove {
    pub loss: f32,
    pub norm_sq: f32,
}

impl SkipAbove {
    /// Skip only non-finite steps.
    pub const NON_FINITE: SkipAbove = SkipAbove { loss: f32::INFINITY, norm_sq: f32::INFINITY };

    /// Whether a step with this mean loss and squared gradient norm is skipped. Every backend
    /// decides with exactly this comparison, so the host can tell from the step's statistics.
    pub fn skips(&self, loss: f32, norm_sq: f32) -> bool {
        !(loss.is_finite() && norm_sq.is_finite() && loss <= self.loss && norm_sq <= self.norm_sq)
    }
}

/// A device: memory, transfers, profiling, and llm.c's layer ops on buffers it owns (their
/// contracts and the traits a device implements for them: [`ops`]).
pub trait Backend: ops::Kernels {
    /// What runs, for logs and `llmrs bench` (e.g. "cpu: packed AVX2+FMA GEMM, 2 threads").
    fn describe(&self) -> String;

    /// The device's fp32 peak in GFLOP/s and how it was found, for `llmrs bench`'s MFU; None
    /// where the backend does not measure one.
    fn measure_peak(&self) -> Option<(f64, String)> {
        None
    }

    /// Whether the backend has bf16 buffers (`--precision bf16`).
    fn supports_bf16(&self) -> bool {
        false
    }

    /// Bytes of workspace the backend keeps between ops besides its allocations (the CPU's
    /// f32 copies of bf16 buffers), for the memory report.
    fn workspace_bytes(&self) -> usize {
        0
    }

    // ---- memory -------------------------------------------------------------------------

    /// A new allocation of `len` elements. Its contents are undefined (zero on the CPU, NaN in
    /// the NaN-checking mode); write before reading.
    fn alloc(&mut self, len: usize, dtype: DType) -> Result<Buf>;
    /// A new allocation holding tensors of these lengths one after another, returned whole:
    /// the caller cuts it into the same views (its elements are dense, as with [`Backend::alloc`]).
    /// A device whose memory comes in chunks keeps each part within one of them, so an op on a
    /// part never straddles two (see [`crate::backend::gpu`]).
    fn alloc_parts(&mut self, parts: &[usize], dtype: DType) -> Result<Buf> {
        self.alloc(parts.iter().sum(), dtype)
    }
    /// An f32 allocation of `parts` (as [`Backend::alloc_parts`]) holding `data`, which it may
    /// take as its own memory (the CPU does: loading a model then needs one copy of its
    /// weights, not two).
    fn alloc_from(&mut self, parts: &[usize], data: Vec<f32>) -> Result<Buf> {
        let b = self.alloc_parts(parts, DType::F32)?;
        self.upload(b, &data);
        Ok(b)
    }
    /// Release the allocation that `buf` points into (its other handles become invalid).
    fn free(&mut self, buf: Buf);
    /// dst = src, converted to dst's dtype.
    fn upload(&mut self, dst: Buf, src: &[f32]);
    /// dst = src for a u32 buffer (token ids).
    fn upload_u32(&mut self, dst: Buf, src: &[u32]);
    /// dst = src converted to f32, after everything queued before has run.
    fn download(&mut self, src: Buf, dst: &mut [f32]) -> Result<()>;
    /// Every element of dst (out) = value.
    fn fill(&mut self, dst: Buf, value: f32);
    /// Wait for everything queued.
    fn synchronize(&mut self) -> Result<()>;
    /// The elements of an f32 buffer as host memory, when the backend's memory is the host's
    /// (the CPU backend): collectives hand it to MPI in place. None for device memory (the
    /// caller goes through download and upload). Call after [`Backend::synchronize`].
    fn host_f32(&mut self, buf: Buf) -> Option<&mut [f32]>;

    // ---- the NaN-checking mode (see [`ops`]) -------------------------------------------------

    /// In the NaN-checking mode, fill `buf` with a marked NaN before an op writes it.
    fn poison(&mut self, _buf: Buf) {}
    /// In the NaN-checking mode, stop the program if `buf`, output #`k` of `op`, still holds a
    /// marked NaN: an element the op left unwritten, or computed from memory no op wrote.
    fn check_written(&mut self, _buf: Buf, _op: &'static str, _k: usize) {}

    // ---- profiling (`llmrs bench`) ----------------------------------------------------------

    /// Turn time accounting by layer kind on or off (and clear it).
    fn set_profiling(&mut self, on: bool);
    /// The ops queued from now until [`Backend::profile_end`] are charged to `kind`.
    fn profile_begin(&mut self, kind: Kind);
    fn profile_end(&mut self);
    /// Seconds charged to each kind since profiling was turned on.
    fn profile_totals(&mut self) -> Result<Vec<(Kind, f64)>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_slice_and_overlap() {
        let b = Buf { alloc: 1, off: 10, len: 100, dtype: DType::F32 };
        assert_eq!(b.slice(5..15), Buf { alloc: 1, off: 15, len: 10, dtype: DType::F32 });
        assert_eq!(b.part(3, 20).off, 70);
        assert!(b.prefix(10).overlaps(b.slice(9..11)));
        assert!(!b.prefix(10).overlaps(b.slice(10..11)));
        assert!(!b.prefix(10).overlaps(Buf { alloc: 2, ..b }));
        assert!(!b.slice(5..5).overlaps(b), "an empty handle overlaps nothing");
        assert!(std::panic::catch_unwind(|| b.slice(90..101)).is_err());
    }

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!("gpu".parse::<Device>().unwrap(), Device::Gpu(None));
        assert_eq!("gpu:1".parse::<Device>().unwrap(), Device::Gpu(Some(1)));
        assert_eq!(Device::Gpu(Some(2)).to_string(), "gpu:2");
        assert!("tpu".parse::<Device>().is_err() && "cuda:x".parse::<Device>().is_err());
        assert!("gpu:".parse::<Device>().is_err() && "gpu:-1".parse::<Device>().is_err());
    }
}

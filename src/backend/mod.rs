//! The seam between the model and the device it runs on.
//!
//! The model ([`crate::model`]) is a list of llm.c's layer calls on [`Buf`] handles into memory
//! that a [`Backend`] owns. One backend is chosen at start-up ([`Device`], `--device`) and
//! reached through a `Box<dyn Backend>`; a training step makes a few hundred calls, so the
//! dynamic dispatch costs nothing measurable. Adding a device means adding its files (e.g.
//! `src/cuda/backend.rs` and one kernel file per layer kind) and an arm in [`factory::open`]; the model,
//! the training loop and everything above them do not change.
//!
//! Conventions of every op: outputs first, inputs next, shapes last (the dimension names of
//! [`crate::core::config`]); every buffer has exactly the length its shape says and no output overlaps
//! another buffer of the call. The model's families call the ops through [`ops::Ops`], the
//! checked front that holds each op's contract (those lengths, the overlaps, the NaN-checking
//! mode, the profile kind) once for every device; a device implements the raw op on buffers
//! that keep to it. An op only queues work: results reach the host through
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

/// Panic unless every named buffer has the length its shape gives (a bug in the caller): every
/// backend checks its ops' buffers with it.
macro_rules! lens {
    ($op:expr; $($buf:expr => $len:expr),* $(,)?) => {
        $(assert_eq!($buf.len, $len, "{}: {} has {} elements, its shape says {}", $op, stringify!($buf), $buf.len, $len);)*
    };
}
pub(crate) use lens;

/// The shape of one LoRA adapter's op ([`crate::model::lora`]): N rows of C inputs into a projection
/// of OC outputs, of which the adapter of rank R adds to rows row0..row0+ROWS (all of them but
/// for one of a fused projection's parts), scaled by `scale` (alpha / R).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraShape {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
    pub r: usize,
    pub row0: usize,
    pub rows: usize,
    pub scale: f32,
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

/// A device: memory, transfers, and llm.c's layer ops on buffers it owns.
///
/// Buffer roles in the op docs: *out* is overwritten whole and never read; *inout* is read and
/// updated (`+=` for gradients); *scratch* is workspace the op may overwrite as it likes. All
/// other buffers are read only.
#[allow(clippy::too_many_arguments)]
pub trait Backend {
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

    // ---- layers ---------------------------------------------------------------------------

    /// out (B, T, C) = wte (Vp, C)[inp (B, T)] [+ wpe (maxT, C)[t]]. Ids must be < V.
    fn encoder_forward(&mut self, out: Buf, inp: Buf, wte: Buf, wpe: Option<Buf>, b: usize, t: usize, c: usize);
    /// dwte (Vp, C) [and dwpe (maxT, C)] (inout) += the scatter of dout (B, T, C) by token [and
    /// position].
    fn encoder_backward(&mut self, dwte: Buf, dwpe: Option<Buf>, dout: Buf, inp: Buf, b: usize, t: usize, c: usize);

    /// out (N, C) = (inp - mean) * rstd * weight + bias; mean (N) and rstd (N) kept for backward.
    fn layernorm_forward(
        &mut self,
        out: Buf,
        mean: Buf,
        rstd: Buf,
        inp: Buf,
        weight: Buf,
        bias: Buf,
        n: usize,
        c: usize,
    );
    /// dinp (N, C), dweight (C), dbias (C): all inout, `+=`.
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
    );

    /// RMSNorm: out (N, C) = inp * rstd * weight, rstd (N) = 1 / sqrt(mean(inp^2) + eps), kept
    /// for backward.
    fn rmsnorm_forward(&mut self, out: Buf, rstd: Buf, inp: Buf, weight: Buf, n: usize, c: usize, eps: f32);
    /// dinp (N, C) and dweight (C): both inout, `+=`.
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
    );

    /// Qwen3's RMSNorm of each query and key head: out (N, QKV)'s query heads are inp's (N, QKV)
    /// normalized with wq (HS), its key heads with wk (HS), its value heads copied; rstd
    /// (N, NH + KV) kept for backward.
    #[allow(clippy::too_many_arguments)]
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
    );
    /// dinp (N, QKV) (out) from dout (N, QKV); dwq, dwk (HS) (inout) `+=`.
    #[allow(clippy::too_many_arguments)]
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
    );

    /// The rotary embedding, in place on the q and k of qkv (N, QKV) (N = B*T rows; row r sits
    /// at position pos + r % T): within each head, element i and i + HS/2 rotate by the
    /// angle of pair i (transformers' `rotate_half` layout). rope (maxT, HS) holds each
    /// position's cosines (HS/2) then sines (HS/2).
    #[allow(clippy::too_many_arguments)]
    fn rope_forward(&mut self, qkv: Buf, rope: Buf, n: usize, t: usize, pos: usize, nh: usize, nkv: usize, hs: usize);
    /// Its backward, in place on dqkv (N, QKV): the rotation by the opposite angles.
    #[allow(clippy::too_many_arguments)]
    fn rope_backward(&mut self, dqkv: Buf, rope: Buf, n: usize, t: usize, pos: usize, nh: usize, nkv: usize, hs: usize);

    /// SwiGLU: out (N, F) = up * silu(gate), from inp (N, 2F) holding up then gate.
    fn swiglu_forward(&mut self, out: Buf, inp: Buf, n: usize, f: usize);
    /// dinp (N, 2F) (out): d(up), d(gate) from dout (N, F).
    fn swiglu_backward(&mut self, dinp: Buf, dout: Buf, inp: Buf, n: usize, f: usize);

    /// out (N) = a (N) + b (N). Its backward is the identity, so there is no residual_backward.
    fn residual_forward(&mut self, out: Buf, a: Buf, b: Buf);

    /// out (N, OC) = inp (N, C) @ weight (OC, C)^T [+ bias (OC)].
    fn matmul_forward(&mut self, out: Buf, inp: Buf, weight: Buf, bias: Option<Buf>, n: usize, c: usize, oc: usize);
    /// dinp (N, C) (out) = dout @ weight; dweight (OC, C) = dout^T @ inp and dbias (OC) = the
    /// column sums of dout (N, OC), added to (inout) when `accumulate`, else overwritten (out).
    /// No dweight: a frozen weight's gradient is not computed (LoRA).
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
    );

    /// A LoRA adapter's term (see [`LoraShape`]): h (N, R) = scale * inp (N, C) @ a (R, C)^T
    /// (out), and out[:, row0..row0+ROWS] (N, OC) += h @ b (ROWS, R)^T (inout).
    #[allow(clippy::too_many_arguments)]
    fn lora_forward(&mut self, out: Buf, h: Buf, inp: Buf, a: Buf, b: Buf, s: LoraShape);
    /// Its backward, from the forward's h (in): with g = dout[:, row0..row0+ROWS]: db (ROWS, R)
    /// += g^T @ h, dh (N, R) = scale * g @ b (out), da (R, C) += dh^T @ inp, dinp (N, C) +=
    /// dh @ a (inout).
    #[allow(clippy::too_many_arguments)]
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
        s: LoraShape,
    );

    /// out (N) = gelu(inp (N)), tanh approximation.
    fn gelu_forward(&mut self, out: Buf, inp: Buf);
    /// d (N, inout) *= gelu'(inp (N)): d(out) becomes d(inp).
    fn gelu_backward(&mut self, d: Buf, inp: Buf);

    /// Causal self-attention: out (B, T, C) and stats (B, NH, T, 2) from qkv (B, T, QKV): the
    /// NH query heads, then the `nkv` key heads, then the value heads, query head h reading key
    /// and value head h / (NH / nkv) (grouped-query attention; GPT-2: nkv = NH). stats holds
    /// each query row's softmax statistics (max(scale * scores), 1 / sum of exps), from which
    /// the backward rebuilds the probabilities: no (B, NH, T, T) matrix is kept (flash
    /// attention's scheme). workspace (B, T, C): scratch.
    fn attention_forward(
        &mut self,
        out: Buf,
        stats: Buf,
        workspace: Buf,
        qkv: Buf,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
        nkv: usize,
    );
    /// dqkv (B, T, QKV) (out) from dout (B, T, C), qkv and the forward's stats (B, NH, T, 2); a
    /// key or value head's gradient sums over its query heads in order. workspace (B, T, 3*C):
    /// scratch.
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
    );
    /// Attention of `tn` new positions of one sequence against a KV cache: the new keys and
    /// values in qkv (TN, QKV) go to rows pos..pos+tn of k_cache and v_cache (maxT, KV*HS)
    /// (inout), then out (TN, C) = attention of each new position over cache rows 0..=its own.
    /// workspace (TN, C): scratch.
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
    );

    /// losses (N) = -log softmax(logits (N, Vp)[:, :V])[targets (N)]; lse (N) = each row's
    /// log-sum-exp, kept for backward.
    fn crossentropy_forward(&mut self, losses: Buf, lse: Buf, logits: Buf, targets: Buf, n: usize, v: usize, vp: usize);
    /// In place, logits (N, Vp) (inout) become d(loss)/d(logits) = (softmax - onehot) * dloss
    /// over the first V columns, 0 over the padding.
    fn crossentropy_backward(&mut self, logits: Buf, lse: Buf, targets: Buf, dloss: f32, n: usize, v: usize, vp: usize);
    /// acc (1) (inout) += weight * mean(x (N)), summed in a fixed order.
    fn accumulate_mean(&mut self, acc: Buf, x: Buf, weight: f32);

    /// out (1) = the sum of squares of grads (N), in a fixed order; out (inout) += it with
    /// `accumulate` (a norm over several slices: a ZeRO shard).
    fn global_norm_squared(&mut self, out: Buf, grads: Buf, accumulate: bool);
    /// One AdamW step on one tensor: params, m, v (N) (inout) from grads (N). `stats` (2)
    /// holds the step's [mean loss, squared global gradient norm]: the gradients are scaled by
    /// grad_clip / norm when the norm exceeds a non-zero grad_clip, and nothing is updated
    /// when `h.skip` skips the step ([`SkipAbove::skips`]: a value not finite or above its
    /// limit), so a diverged or outlier step leaves the model as it was.
    fn adamw_update(&mut self, params: Buf, grads: Buf, m: Buf, v: Buf, stats: Buf, h: &AdamWParams);
    /// [`Backend::adamw_update`] of f32 params that also writes their bf16 working copy `work`
    /// (N) in the same pass, rounded stochastically with `h.seed` as [`Backend::convert`]
    /// rounds (llm.c's bf16 AdamW); a skipped step leaves `work` as it was. Only called where
    /// [`Backend::supports_bf16`].
    #[allow(clippy::too_many_arguments)]
    fn adamw_update_and_copy(
        &mut self,
        params: Buf,
        work: Buf,
        grads: Buf,
        m: Buf,
        v: Buf,
        stats: Buf,
        h: &AdamWParams,
    );
    /// dst (N) (out) = src (N) converted to dst's dtype: into bf16 rounded to nearest even, or
    /// stochastically with `noise` (llm.c's bf16 parameters written from the fp32 master
    /// weights).
    fn convert(&mut self, dst: Buf, src: Buf, noise: Option<Noise>);
    /// dst (N) (out) = src (N) rounded to nearest as [`Backend::convert`], where src is about
    /// to be freed (its elements are undefined afterwards): the backend may hand src's memory
    /// back as it goes. The CPU does, piece by piece, so turning a model's f32 weights into
    /// bf16 peaks at about the f32 copy, not at both.
    fn convert_consuming(&mut self, dst: Buf, src: Buf) {
        self.convert(dst, src, None)
    }
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

//! The WGSL kernels: their sources (one file per layer kind, named as the CPU layer), which entry
//! point each kernel is and how many buffers it binds, and their pipelines: the modules built
//! when the backend opens, each pipeline at its first use.

use super::context::{one_line, Context, IMMEDIATE_BYTES, MAX_BINDINGS};
use anyhow::Result;

/// The helpers every module shares, prepended to each.
pub const COMMON: &str = include_str!("kernels/common.wgsl");

/// Every kernel module that declares its own buffers, by name (its file's), as the parts it is
/// made of, in order.
const FILES: [(&str, &[&str]); 3] = [
    ("bf16", &[include_str!("kernels/bf16.wgsl")]),
    ("attention", &[include_str!("kernels/attention.wgsl")]),
    ("lora", &[include_str!("kernels/lora.wgsl")]),
];

/// The GEMM for CPU-run Vulkan drivers (kernels/matmul_subgroup.wgsl): appended to the matmul
/// module and its bf16 variants, whose `matmul` kernels then run its entry point instead, when
/// the device chose it ([`Context::subgroup_gemm`]). It needs subgroup operations, so the
/// modules without it are what every other device builds.
const SUBGROUP_GEMM: &str = include_str!("kernels/matmul_subgroup.wgsl");

/// A module's buffers, by name, as its f32 kernels hold them.
type Buffers = &'static [(&'static str, Io)];

/// The modules whose buffers are typed by a prelude ([`prelude`]): each reads and writes its
/// f32 or bf16 buffers only through `NAME_ld(e)` and `NAME_st(e, v)` (u32 ones, token ids, as
/// arrays), so the same source builds the f32 kernels and, per entry point, a bf16 variant
/// ([`BF16`]). By name, with its source and its buffers (bindings 0, 1, ...) as the f32
/// kernels hold them.
#[rustfmt::skip]
const TYPED: [(&str, &str, Buffers); 11] = [
    ("adamw", include_str!("kernels/adamw.wgsl"), &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F)]),
    ("encoder", include_str!("kernels/encoder.wgsl"), &[("x", F), ("ids", U32), ("y", F), ("z", F)]),
    ("memory", include_str!("kernels/memory.wgsl"), &[("x", F), ("y", F)]),
    ("matmul", include_str!("kernels/matmul.wgsl"), &[("c", F), ("a", F), ("b", F), ("bias", F)]),
    ("layernorm", include_str!("kernels/layernorm.wgsl"), &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F), ("b5", F)]),
    ("rmsnorm", include_str!("kernels/rmsnorm.wgsl"), &[("b0", F), ("b1", F), ("b2", F), ("b3", F), ("b4", F), ("b5", F)]),
    ("rope", include_str!("kernels/rope.wgsl"), &[("x", F), ("tab", F)]),
    ("swiglu", include_str!("kernels/swiglu.wgsl"), &[("b0", F), ("b1", F), ("b2", F)]),
    ("residual", include_str!("kernels/residual.wgsl"), &[("out", F), ("a", F), ("b", F)]),
    ("gelu", include_str!("kernels/gelu.wgsl"), &[("x", F), ("y", F)]),
    ("classifier", include_str!("kernels/classifier.wgsl"), &[("x", F), ("y", F), ("z", F), ("targets", U32)]),
];

/// How a kernel of a [`TYPED`] module holds one of its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Io {
    /// f32: statistics, partial sums, tables (and every buffer of the f32 kernels).
    F32,
    /// bf16 the kernel only reads: two a word, widened as read.
    In16,
    /// bf16 the kernel writes (or updates): its words are atomic, and a thread sets its half
    /// of a word with an `and` and an `or`, so the two threads whose elements share a word do
    /// not race, and a word shared with a neighbouring tensor keeps that tensor's half. Each
    /// value is rounded to nearest even once, when stored.
    Out16,
    /// u32 (token ids), read as an array.
    U32,
}
use Io::{In16, Out16, F32 as F, U32};

/// The bf16 variants of the [`TYPED`] kernels: (the variant, its f32 kernel, how it holds each
/// buffer of its module, bound or not). A variant is its own module, named as the variant.
/// The norms' parameter-gradient kernels read the bf16 activations and write f32 partial sums
/// (the op sums them into f32 copies of the gradients, rounded once, as the CPU does). The
/// GEMM has a variant per operand types it is given (see [`gemm`]).
#[rustfmt::skip]
const BF16: [(K, K, &[Io]); 29] = [
    (K::CopyRowsBf16, K::CopyRows, &[Out16, In16]),
    // params, m, v, grads, stats: f32 master weights or bf16 parameters (rounded
    // stochastically), bf16 gradients; partials, gradients.
    (K::AdamwBf16Grads, K::Adamw, &[F, F, F, In16, F]),
    (K::AdamwBf16, K::Adamw, &[Out16, F, F, In16, F]),
    (K::SumSquaresBf16, K::SumSquares, &[F, In16, F, F, F]),
    // out, inp, wte, wpe (the backward adds up a token's rows piece after piece of positions:
    // through f32 copies of the gradients, rounded once).
    (K::EncoderForwardBf16, K::EncoderForward, &[Out16, U32, In16, In16]),
    // losses, lse, logits, targets; logits (in place), lse, -, targets.
    (K::CrossentropyForwardBf16, K::CrossentropyForward, &[F, F, In16, U32]),
    (K::CrossentropyBackwardBf16, K::CrossentropyBackward, &[Out16, F, F, U32]),
    (K::LayernormForwardBf16, K::LayernormForward, &[Out16, F, F, In16, In16, In16]),
    (K::LayernormBackwardInputBf16, K::LayernormBackwardInput, &[Out16, In16, In16, In16, F, F]),
    (K::LayernormBackwardParamsBf16, K::LayernormBackwardParams, &[F, F, In16, In16, F, F]),
    (K::RmsnormForwardBf16, K::RmsnormForward, &[Out16, F, In16, In16, F, F]),
    (K::RmsnormBackwardInputBf16, K::RmsnormBackwardInput, &[Out16, In16, In16, In16, F, F]),
    (K::RmsnormBackwardParamsBf16, K::RmsnormBackwardParams, &[F, In16, In16, F, F, F]),
    (K::HeadNormForwardBf16, K::HeadNormForward, &[Out16, F, In16, In16, In16, F]),
    (K::HeadNormBackwardInputBf16, K::HeadNormBackwardInput, &[Out16, In16, In16, In16, In16, F]),
    (K::HeadNormBackwardParamsBf16, K::HeadNormBackwardParams, &[F, In16, In16, F, F, F]),
    (K::RopeBf16, K::Rope, &[Out16, F]),
    (K::SwigluForwardBf16, K::SwigluForward, &[Out16, In16, In16]),
    (K::SwigluBackwardBf16, K::SwigluBackward, &[Out16, In16, In16]),
    (K::ResidualForwardBf16, K::ResidualForward, &[Out16, In16, In16]),
    (K::GeluForwardBf16, K::GeluForward, &[Out16, In16]),
    (K::GeluBackwardBf16, K::GeluBackward, &[Out16, In16]),
    // C, A, B, bias.
    (K::MatmulBf16, K::Matmul, &[F, In16, In16, In16]),
    (K::MatmulBf16ToBf16, K::Matmul, &[Out16, In16, In16, In16]),
    (K::MatmulF32Bf16, K::Matmul, &[F, F, In16, In16]),
    (K::MatmulF32Bf16ToBf16, K::Matmul, &[Out16, F, In16, In16]),
    (K::MatmulBf16F32, K::Matmul, &[F, In16, F, F]),
    (K::MatmulToBf16, K::Matmul, &[Out16, F, F, F]),
    (K::BiasBackwardBf16, K::BiasBackward, &[F, In16, F, F]),
];

/// The GEMM kernel for A, B (and the bias, B's type) and C of these types: f32 or bf16 each,
/// but for a bf16 A and an f32 B into a bf16 C, which no op has.
pub fn gemm(a16: bool, b16: bool, c16: bool) -> K {
    match (a16, b16, c16) {
        (false, false, false) => K::Matmul,
        (true, true, false) => K::MatmulBf16,
        (true, true, true) => K::MatmulBf16ToBf16,
        (false, true, false) => K::MatmulF32Bf16,
        (false, true, true) => K::MatmulF32Bf16ToBf16,
        (true, false, false) => K::MatmulBf16F32,
        (false, false, true) => K::MatmulToBf16,
        x => panic!("no GEMM kernel for (A bf16, B bf16, C bf16) = {x:?}"),
    }
}

/// The declarations of a [`TYPED`] module's buffers, held as `io` says, with their accessors:
/// `NAME_ld(e)`, element e as f32, `NAME_st(e, v)`, element e = v (rounded once to nearest
/// even if bf16), and `NAME_st_stochastic(e, v, seed, i)`, the same rounded stochastically
/// with the noise of (seed, i) if bf16 (kernels/bf16.wgsl's, the CPU's).
fn prelude(names: &[&str], io: &[Io]) -> String {
    let mut s = String::new();
    for (i, (name, io)) in names.iter().zip(io).enumerate() {
        let decl = |ty: &str| format!("@group(0) @binding({i}) var<storage, read_write> {name}: array<{ty}>;\n");
        s += &match io {
            Io::U32 => decl("u32"),
            Io::F32 => {
                decl("f32")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return {name}[e]; }}\n")
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}[e] = v; }}\n")
                    + &format!("fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ {name}[e] = v; }}\n")
            }
            // (A store into a bf16 input is never called: declared so that the module builds.)
            Io::In16 => {
                decl("u32")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return half_at({name}[e >> 1u], e); }}\n")
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}[e >> 1u] = f32_to_bf16(v); }}\n")
                    + &format!("fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ {name}_st(e, v); }}\n")
            }
            Io::Out16 => {
                decl("atomic<u32>")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return half_at(atomicLoad(&{name}[e >> 1u]), e); }}\n")
                    + &format!(
                        "fn {name}_put(e: u32, bits: u32) {{ let sh = 16u * (e & 1u); \
                     atomicAnd(&{name}[e >> 1u], ~(0xffffu << sh)); atomicOr(&{name}[e >> 1u], bits << sh); }}\n"
                    )
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}_put(e, f32_to_bf16(v)); }}\n")
                    + &format!(
                        "fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ \
                     {name}_put(e, f32_to_bf16_stochastic(v, seed, i)); }}\n"
                    )
            }
        };
    }
    s
}

/// The complete WGSL of every module (common helpers included), by name: what the
/// pipelines are built from, and what the tests translate for Metal, Vulkan and DX12. With
/// `subgroup_gemm`, the matmul module (then named matmul_subgroup, as the file it adds) and
/// its bf16 variants carry [`SUBGROUP_GEMM`] too.
pub fn wgsl_modules(subgroup_gemm: bool) -> Vec<(String, String)> {
    let own = FILES.iter().map(|(name, parts)| (name.to_string(), parts.join("\n")));
    let names = |b: &'static [(&'static str, Io)]| b.iter().map(|x| x.0).collect::<Vec<_>>();
    let with_gemm = |module: &str, src: &str| match module {
        "matmul" if subgroup_gemm => format!("{src}\n{SUBGROUP_GEMM}"),
        _ => src.to_string(),
    };
    let typed = TYPED.iter().map(|(name, src, b)| {
        let io: Vec<Io> = b.iter().map(|x| x.1).collect();
        let src = prelude(&names(b), &io) + &with_gemm(name, src);
        (with_subgroup_gemm(name, subgroup_gemm).to_string(), src)
    });
    let bf16 = BF16.iter().map(|&(k, f32_kernel, io)| {
        let (_, module, ..) = TABLE[index(f32_kernel)];
        let (_, src, b) = TYPED.iter().find(|t| t.0 == module).expect("a bf16 variant is of a typed module");
        assert!(b.len() == io.len(), "{k:?}: one Io per buffer of {module}");
        let same_u32 = b.iter().zip(io).all(|(x, io)| (x.1 == Io::U32) == (*io == Io::U32));
        assert!(same_u32, "{k:?}: the u32 buffers of {module} stay u32");
        (format!("{k:?}"), prelude(&names(b), io) + &with_gemm(module, src))
    });
    own.chain(typed).chain(bf16).map(|(name, src)| (name, format!("{COMMON}\n{src}"))).collect()
}

/// A module or entry point's name with or without the subgroup GEMM: the matmul module and
/// its `matmul` entry point become `matmul_subgroup` with it (its file and kernel).
fn with_subgroup_gemm(name: &str, subgroup_gemm: bool) -> &str {
    if name == "matmul" && subgroup_gemm {
        "matmul_subgroup"
    } else {
        name
    }
}

/// One compute kernel: an entry point of a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum K {
    Fill,
    CopyRows,
    Widen,
    Narrow,
    FillBf16,
    ColumnSums,
    EncoderForward,
    EncoderBackwardWte,
    EncoderBackwardWpe,
    LayernormForward,
    LayernormBackwardInput,
    LayernormBackwardParams,
    RmsnormForward,
    RmsnormBackwardInput,
    RmsnormBackwardParams,
    HeadNormForward,
    HeadNormBackwardInput,
    HeadNormBackwardParams,
    Rope,
    SwigluForward,
    SwigluBackward,
    ResidualForward,
    GeluForward,
    GeluBackward,
    Matmul,
    BiasBackward,
    SoftmaxForward,
    SoftmaxProbs,
    SoftmaxBackward,
    CrossentropyForward,
    CrossentropyBackward,
    AccumulateMean,
    Adamw,
    SumSquares,
    ReducePartials,
    LoraScale,
    // The bf16 variants of the typed modules' kernels (BF16).
    LayernormForwardBf16,
    LayernormBackwardInputBf16,
    LayernormBackwardParamsBf16,
    RmsnormForwardBf16,
    RmsnormBackwardInputBf16,
    RmsnormBackwardParamsBf16,
    HeadNormForwardBf16,
    HeadNormBackwardInputBf16,
    HeadNormBackwardParamsBf16,
    RopeBf16,
    SwigluForwardBf16,
    SwigluBackwardBf16,
    ResidualForwardBf16,
    GeluForwardBf16,
    GeluBackwardBf16,
    CopyRowsBf16,
    /// AdamW of f32 master weights from bf16 gradients; of bf16 parameters.
    AdamwBf16Grads,
    AdamwBf16,
    SumSquaresBf16,
    EncoderForwardBf16,
    CrossentropyForwardBf16,
    CrossentropyBackwardBf16,
    /// The GEMM reading bf16 A, B and bias into an f32 C; BiasBackward reading a bf16 dout.
    MatmulBf16,
    BiasBackwardBf16,
    /// ... into a bf16 C.
    MatmulBf16ToBf16,
    /// The GEMM of an f32 A and a bf16 B (and bias) into an f32 C, and into a bf16 C.
    MatmulF32Bf16,
    MatmulF32Bf16ToBf16,
    /// The GEMM of a bf16 A and an f32 B into an f32 C, and of f32 ones into a bf16 C (a LoRA
    /// adapter's, on a bf16 base).
    MatmulBf16F32,
    MatmulToBf16,
}

impl K {
    /// The kernel that does this one's work on bf16 activations ([`BF16`]), with `bf16`;
    /// else this one.
    pub fn on(self, bf16: bool) -> K {
        assert!(self != K::Matmul && self != K::Adamw, "{self:?} has several bf16 variants");
        match BF16.iter().find(|v| v.1 == self) {
            Some(v) if bf16 => v.0,
            _ => self,
        }
    }
}

/// (kernel, module, entry point, storage buffers bound at 0..n, which of them hold u32 (a bit
/// per binding), which bf16 (two a word; the others f32)).
const TABLE: [(K, &str, &str, usize, u8, u8); 36] = [
    (K::Fill, "memory", "fill", 1, 0, 0),
    (K::CopyRows, "memory", "copy_rows", 2, 0, 0),
    (K::Widen, "bf16", "widen", 2, 0, 0b1),
    (K::Narrow, "bf16", "narrow", 3, 0, 0b1),
    (K::FillBf16, "bf16", "fill_bf16", 1, 0, 0b1),
    (K::ColumnSums, "memory", "column_sums", 2, 0, 0),
    (K::EncoderForward, "encoder", "encoder_forward", 4, 0b10, 0),
    (K::EncoderBackwardWte, "encoder", "encoder_backward_wte", 3, 0b10, 0),
    (K::EncoderBackwardWpe, "encoder", "encoder_backward_wpe", 3, 0b10, 0),
    (K::LayernormForward, "layernorm", "layernorm_forward", 6, 0, 0),
    (K::LayernormBackwardInput, "layernorm", "layernorm_backward_input", 6, 0, 0),
    (K::LayernormBackwardParams, "layernorm", "layernorm_backward_params", 6, 0, 0),
    (K::RmsnormForward, "rmsnorm", "rmsnorm_forward", 4, 0, 0),
    (K::RmsnormBackwardInput, "rmsnorm", "rmsnorm_backward_input", 5, 0, 0),
    (K::RmsnormBackwardParams, "rmsnorm", "rmsnorm_backward_params", 4, 0, 0),
    (K::HeadNormForward, "rmsnorm", "head_norm_forward", 5, 0, 0),
    (K::HeadNormBackwardInput, "rmsnorm", "head_norm_backward_input", 6, 0, 0),
    (K::HeadNormBackwardParams, "rmsnorm", "head_norm_backward_params", 4, 0, 0),
    (K::Rope, "rope", "rope", 2, 0, 0),
    (K::SwigluForward, "swiglu", "swiglu_forward", 2, 0, 0),
    (K::SwigluBackward, "swiglu", "swiglu_backward", 3, 0, 0),
    (K::ResidualForward, "residual", "residual_forward", 3, 0, 0),
    (K::GeluForward, "gelu", "gelu_forward", 2, 0, 0),
    (K::GeluBackward, "gelu", "gelu_backward", 2, 0, 0),
    (K::Matmul, "matmul", "matmul", 4, 0, 0),
    (K::BiasBackward, "matmul", "bias_backward", 2, 0, 0),
    (K::SoftmaxForward, "attention", "softmax_forward", 2, 0, 0),
    (K::SoftmaxProbs, "attention", "softmax_probs", 2, 0, 0),
    (K::SoftmaxBackward, "attention", "softmax_backward", 2, 0, 0),
    (K::CrossentropyForward, "classifier", "crossentropy_forward", 4, 0b1000, 0),
    (K::CrossentropyBackward, "classifier", "crossentropy_backward", 4, 0b1000, 0),
    (K::AccumulateMean, "classifier", "accumulate_mean", 2, 0, 0),
    (K::Adamw, "adamw", "adamw", 5, 0, 0),
    (K::SumSquares, "adamw", "sum_squares", 2, 0, 0),
    (K::ReducePartials, "adamw", "reduce_partials", 2, 0, 0),
    (K::LoraScale, "lora", "lora_scale", 1, 0, 0),
];

/// The kernels' modules, their pipelines (built on first use), and one bind group layout per
/// number of bound buffers.
pub struct Kernels {
    /// Every module, by name, validated when the backend opened.
    modules: Vec<(String, wgpu::ShaderModule)>,
    /// Per kernel, in [`rows`] order: its module (an index into `modules`), its entry point, and
    /// its pipeline once built ([`Kernels::prepare`]). The driver compiles a kernel when its
    /// pipeline is created, and a run uses a few of them (tests/gpu_ops.rs, which opens many
    /// backends, took 81 s on lavapipe compiling them all at every open, 32 s at first use).
    pipelines: Vec<(usize, &'static str, std::sync::OnceLock<wgpu::ComputePipeline>)>,
    /// (rows, columns) of C per workgroup of the GEMM: 64 x 64 for the tiled kernel, 32 x 32
    /// for the subgroup one (kernels/matmul_subgroup.wgsl: SG_ROWS, SG_COLS).
    pub gemm_tile: (usize, usize),
    /// layouts[n]: n read-write storage buffers at bindings 0..n.
    pub layouts: Vec<wgpu::BindGroupLayout>,
    /// The pipeline layout of each bind group layout, with the immediates.
    pipeline_layouts: Vec<wgpu::PipelineLayout>,
}

impl Kernels {
    /// Build and validate every module, failing with one line that names it and the adapter
    /// when a shader does not build on this driver.
    pub fn build(ctx: &Context) -> Result<Self> {
        let dev = &ctx.device;
        let layouts: Vec<wgpu::BindGroupLayout> = (0..=MAX_BINDINGS)
            .map(|n| {
                let entries: Vec<_> = (0..n as u32)
                    .map(|i| wgpu::BindGroupLayoutEntry {
                        binding: i,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage { read_only: false },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    })
                    .collect();
                dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries })
            })
            .collect();
        let pipeline_layouts: Vec<wgpu::PipelineLayout> = layouts
            .iter()
            .map(|l| {
                dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: None,
                    bind_group_layouts: &[Some(l)],
                    immediate_size: IMMEDIATE_BYTES,
                })
            })
            .collect();
        let sg = ctx.subgroup_gemm;
        let mut modules = vec![];
        let mut pipelines: Vec<_> =
            rows().iter().map(|t| (usize::MAX, with_subgroup_gemm(t.2, sg), Default::default())).collect();
        for (name, src) in wgsl_modules(sg) {
            for (i, _) in rows().iter().enumerate().filter(|(_, t)| with_subgroup_gemm(&t.1, sg) == name) {
                pipelines[i].0 = modules.len();
            }
            let module = create_module(ctx, &name, &src)?;
            modules.push((name, module));
        }
        assert!(pipelines.iter().all(|p| p.0 < modules.len()), "every kernel is in a module");
        let gemm_tile = if sg { (32, 32) } else { (64, 64) };
        Ok(Kernels { modules, pipelines, gemm_tile, layouts, pipeline_layouts })
    }

    /// Build `k`'s pipeline if this is its first use: the driver compiles the kernel now. An
    /// error is one line naming the module and the adapter (the backend reports it at the next
    /// host read, and records nothing of that dispatch).
    pub fn prepare(&self, ctx: &Context, k: K) -> Result<()> {
        let i = position(k);
        let (module, entry, pipeline) = &self.pipelines[i];
        if pipeline.get().is_none() {
            let (name, module) = &self.modules[*module];
            let built = create_pipeline(ctx, &self.pipeline_layouts[rows()[i].3], name, module, entry)?;
            let _ = pipeline.set(built);
        }
        Ok(())
    }

    /// The pipeline of `k`, which [`Kernels::prepare`] built.
    pub fn pipeline(&self, k: K) -> &wgpu::ComputePipeline {
        self.pipelines[position(k)].2.get().expect("a kernel's pipeline is prepared before its first dispatch")
    }

    /// Buffers `k` binds.
    pub fn bindings(k: K) -> usize {
        kernel(k).3
    }

    /// The element type binding `i` of `k` holds.
    pub fn binding_dtype(k: K, i: usize) -> crate::backend::DType {
        let t = kernel(k);
        if t.4 & (1 << i) != 0 {
            crate::backend::DType::U32
        } else if t.5 & (1 << i) != 0 {
            crate::backend::DType::BF16
        } else {
            crate::backend::DType::F32
        }
    }
}

/// One kernel as its pipeline is built: (kernel, module, entry point, buffers bound, the u32
/// ones, the bf16 ones), as [`TABLE`]'s rows.
type Row = (K, String, &'static str, usize, u8, u8);

/// Every kernel: [`TABLE`]'s, then the bf16 variants of [`BF16`] (their modules named as the
/// variants, their bf16 buffers from their [`Io`]s). Built once.
fn rows() -> &'static [Row] {
    static ROWS: std::sync::OnceLock<Vec<Row>> = std::sync::OnceLock::new();
    ROWS.get_or_init(|| {
        let own = TABLE.iter().map(|t| (t.0, t.1.to_string(), t.2, t.3, t.4, t.5));
        own.chain(BF16.iter().map(|&(k, f32_kernel, io)| {
            let (_, _, entry, n, ..) = TABLE[index(f32_kernel)];
            let mask =
                |want: &[Io]| io.iter().enumerate().filter(|(_, x)| want.contains(x)).fold(0u8, |m, (i, _)| m | 1 << i);
            (k, format!("{k:?}"), entry, n, mask(&[U32]), mask(&[In16, Out16]))
        }))
        .collect()
    })
}

/// The position of k's row in [`rows`] (and of its pipeline).
fn position(k: K) -> usize {
    rows().iter().position(|t| t.0 == k).expect("every kernel is in TABLE or BF16")
}

/// [`rows`]'s row of k.
fn kernel(k: K) -> &'static Row {
    &rows()[position(k)]
}

/// The one-line error for a module `name` that does not build on this driver.
fn does_not_build(ctx: &Context, name: &str, e: &wgpu::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "the GPU kernels in {name}.wgsl do not build on {}: {}; run on the CPU with --device cpu (and please \
         report this with the output of `llmrs devices`)",
        ctx.name(),
        one_line(&e.to_string())
    )
}

/// One WGSL module, parsed and validated (with wgpu's run-time checks: a kernel cannot reach
/// outside its bindings), or a one-line error naming it and the adapter.
fn create_module(ctx: &Context, name: &str, src: &str) -> Result<wgpu::ShaderModule> {
    let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = ctx.device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    });
    match pollster::block_on(scope.pop()) {
        Some(e) => Err(does_not_build(ctx, name, &e)),
        None => Ok(module),
    }
}

/// The pipeline of one entry point of module `name`: where the driver translates and compiles
/// it (on Vulkan, Metal and DX12 alike), or a one-line error naming the module and the adapter.
fn create_pipeline(
    ctx: &Context,
    layout: &wgpu::PipelineLayout,
    name: &str,
    module: &wgpu::ShaderModule,
    entry: &str,
) -> Result<wgpu::ComputePipeline> {
    let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let pipeline = ctx.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: Some(layout),
        module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    });
    match pollster::block_on(scope.pop()) {
        Some(e) => Err(does_not_build(ctx, name, &e)),
        None => Ok(pipeline),
    }
}

/// The pipelines of the given (entry point, buffers bound) of one WGSL module, built now as
/// the backend builds its own (module, then each pipeline), or a one-line error naming the
/// module and the adapter when it does not build on this driver.
pub fn build_module(
    ctx: &Context,
    pipeline_layouts: &[wgpu::PipelineLayout],
    name: &str,
    src: &str,
    entries: &[(&str, usize)],
) -> Result<Vec<wgpu::ComputePipeline>> {
    let module = create_module(ctx, name, src)?;
    entries.iter().map(|&(entry, n)| create_pipeline(ctx, &pipeline_layouts[n], name, &module, entry)).collect()
}

impl Kernels {
    /// Build one more module and its pipelines through the functions that build the backend's
    /// own (tests of the error path).
    pub fn build_extra(&self, ctx: &Context, name: &str, src: &str, entries: &[(&str, usize)]) -> Result<()> {
        build_module(ctx, &self.pipeline_layouts, name, src, entries).map(|_| ())
    }
}

fn index(k: K) -> usize {
    TABLE.iter().position(|t| t.0 == k).expect("every kernel is in TABLE")
}

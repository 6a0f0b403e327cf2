//! The WGSL kernels: their sources (one file per layer kind, named as the CPU layer), which entry
//! point each kernel is and how many buffers it binds, and their pipelines, all built once when
//! the backend opens.

use super::context::Context;
use anyhow::{bail, Result};

/// Bytes of immediates every kernel gets (its `Params` struct fits in them): the smallest limit
/// of the three APIs (Vulkan guarantees 128 bytes of push constants, DX12's root constants in
/// wgpu are 128 bytes, Metal allows 4 KiB).
pub const IMMEDIATE_BYTES: u32 = 128;

/// The helpers every module shares, prepended to each.
pub const COMMON: &str = include_str!("kernels/common.wgsl");

/// The GEMM's operands A, B and bias (bindings 1-3 of kernels/matmul.wgsl) in f32.
const MATMUL_F32: &str = "
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> bias: array<f32>;
fn a_at(e: u32) -> f32 { return a[e]; }
fn b_at(e: u32) -> f32 { return b[e]; }
fn bias_at(e: u32) -> f32 { return bias[e]; }
";

/// The same operands in bf16, two a word (kernels/bf16.wgsl's layout: element 2w in the low
/// half of word w), widened as they are read: the GEMM then reads half the bytes of its f32
/// copies, and needs none.
const MATMUL_BF16: &str = "
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@group(0) @binding(2) var<storage, read_write> b: array<u32>;
@group(0) @binding(3) var<storage, read_write> bias: array<u32>;
fn half_at(w: u32, e: u32) -> f32 { return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (e & 1u) == 1u)); }
fn a_at(e: u32) -> f32 { return half_at(a[e >> 1u], e); }
fn b_at(e: u32) -> f32 { return half_at(b[e >> 1u], e); }
fn bias_at(e: u32) -> f32 { return half_at(bias[e >> 1u], e); }
";

const MATMUL: &str = include_str!("kernels/matmul.wgsl");

/// Every kernel module, by name (its file's, and `_bf16` for a variant that reads bf16
/// operands), as the parts it is made of, in order.
const FILES: [(&str, &[&str]); 15] = [
    ("memory", &[include_str!("kernels/memory.wgsl")]),
    ("bf16", &[include_str!("kernels/bf16.wgsl")]),
    ("encoder", &[include_str!("kernels/encoder.wgsl")]),
    ("layernorm", &[include_str!("kernels/layernorm.wgsl")]),
    ("rmsnorm", &[include_str!("kernels/rmsnorm.wgsl")]),
    ("rope", &[include_str!("kernels/rope.wgsl")]),
    ("swiglu", &[include_str!("kernels/swiglu.wgsl")]),
    ("residual", &[include_str!("kernels/residual.wgsl")]),
    ("gelu", &[include_str!("kernels/gelu.wgsl")]),
    ("matmul", &[MATMUL_F32, MATMUL]),
    ("matmul_bf16", &[MATMUL_BF16, MATMUL]),
    ("attention", &[include_str!("kernels/attention.wgsl")]),
    ("classifier", &[include_str!("kernels/classifier.wgsl")]),
    ("adamw", &[include_str!("kernels/adamw.wgsl")]),
    ("lora", &[include_str!("kernels/lora.wgsl")]),
];

/// The complete WGSL of every module (common helpers included), by name: what the
/// pipelines are built from, and what the tests translate for Metal, Vulkan and DX12.
pub fn wgsl_modules() -> Vec<(&'static str, String)> {
    FILES.iter().map(|(name, parts)| (*name, format!("{COMMON}\n{}", parts.join("\n")))).collect()
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
    /// Matmul and BiasBackward reading bf16 A, B and bias (C stays f32).
    MatmulBf16,
    BiasBackwardBf16,
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
}

/// (kernel, module, entry point, storage buffers bound at 0..n, which of them hold u32 (a bit
/// per binding), which bf16 (two a word; the others f32)).
const TABLE: [(K, &str, &str, usize, u8, u8); 38] = [
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
    (K::MatmulBf16, "matmul_bf16", "matmul", 4, 0, 0b1110),
    (K::BiasBackwardBf16, "matmul_bf16", "bias_backward", 2, 0, 0b10),
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

/// Most buffers any kernel binds.
pub const MAX_BINDINGS: usize = 6;

/// The pipelines, and one bind group layout per number of bound buffers.
pub struct Kernels {
    pipelines: Vec<wgpu::ComputePipeline>, // in TABLE order
    /// layouts[n]: n read-write storage buffers at bindings 0..n.
    pub layouts: Vec<wgpu::BindGroupLayout>,
    /// The pipeline layout of each bind group layout, with the immediates.
    pipeline_layouts: Vec<wgpu::PipelineLayout>,
}

impl Kernels {
    /// Build every pipeline, failing with one line that names the kernel and the adapter when a
    /// shader does not build on this driver.
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
        let mut pipelines = Vec::with_capacity(TABLE.len());
        for (name, src) in wgsl_modules() {
            let entries: Vec<_> = TABLE.iter().filter(|t| t.1 == name).map(|t| (t.2, t.3)).collect();
            let built = build_module(ctx, &pipeline_layouts, name, &src, &entries)?;
            let kinds = TABLE.iter().filter(|t| t.1 == name).map(|t| t.0);
            pipelines.extend(kinds.zip(built));
        }
        // Back to TABLE order.
        let pipelines = TABLE
            .iter()
            .map(|t| pipelines.iter().find(|p| p.0 == t.0).expect("every kernel was built").1.clone())
            .collect();
        Ok(Kernels { pipelines, layouts, pipeline_layouts })
    }

    pub fn pipeline(&self, k: K) -> &wgpu::ComputePipeline {
        &self.pipelines[index(k)]
    }

    /// Buffers `k` binds.
    pub fn bindings(k: K) -> usize {
        TABLE[index(k)].3
    }

    /// The element type binding `i` of `k` holds.
    pub fn binding_dtype(k: K, i: usize) -> crate::backend::DType {
        if TABLE[index(k)].4 & (1 << i) != 0 {
            crate::backend::DType::U32
        } else if TABLE[index(k)].5 & (1 << i) != 0 {
            crate::backend::DType::BF16
        } else {
            crate::backend::DType::F32
        }
    }
}

/// The pipelines of the given (entry point, buffers bound) of one WGSL module, or a one-line
/// error naming the module and the adapter when it does not build on this driver.
pub fn build_module(
    ctx: &Context,
    pipeline_layouts: &[wgpu::PipelineLayout],
    name: &str,
    src: &str,
    entries: &[(&str, usize)],
) -> Result<Vec<wgpu::ComputePipeline>> {
    let dev = &ctx.device;
    let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
    // With wgpu's run-time checks: a kernel cannot reach outside its bindings.
    let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    });
    let built: Vec<_> = entries
        .iter()
        .map(|&(entry, n)| {
            dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layouts[n]),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        })
        .collect();
    if let Some(e) = pollster::block_on(scope.pop()) {
        bail!(
            "the GPU kernels in {name}.wgsl do not build on {}: {}; run on the CPU with --device cpu (and please \
             report this with the output of `llmrs devices`)",
            ctx.name(),
            one_line(&e.to_string())
        );
    }
    Ok(built)
}

impl Kernels {
    /// Build one more module as the backend's own are built (tests of the error path).
    pub fn build_extra(&self, ctx: &Context, name: &str, src: &str, entries: &[(&str, usize)]) -> Result<()> {
        build_module(ctx, &self.pipeline_layouts, name, src, entries).map(|_| ())
    }
}

fn index(k: K) -> usize {
    TABLE.iter().position(|t| t.0 == k).expect("every kernel is in TABLE")
}

/// A (multi-line) driver or validation message on one line.
pub fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

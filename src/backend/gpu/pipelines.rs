//! The kernels' pipelines: each kernel's module ([`K::module_source`]) built and validated
//! at the kernel's first use, then its pipeline, and one bind group layout per number of
//! bound buffers.

use super::context::{one_line, Context, IMMEDIATE_BYTES, MAX_BINDINGS};
use super::kernel::{Io, K};
use anyhow::Result;
use std::collections::HashMap;

/// The modules and pipelines built so far, and the layouts every pipeline uses.
pub struct Kernels {
    /// The modules built so far, by name. A module is built (parsed, validated) at the first
    /// use of one of its kernels, and a kernel's pipeline then (the driver compiles a kernel
    /// when its pipeline is created); a run uses a few of them (tests/gpu_ops.rs, which opens
    /// many backends, took 81 s on lavapipe compiling them all at every open, 32 s at first use).
    modules: HashMap<String, wgpu::ShaderModule>,
    /// The pipeline of every kernel used so far.
    pipelines: HashMap<K, wgpu::ComputePipeline>,
    /// Whether the GEMM is the subgroup kernel ([`Context::subgroup_gemm`]).
    subgroup_gemm: bool,
    /// (rows, columns) of C per workgroup of the GEMM: 64 x 64 for the tiled kernel, 32 x 32
    /// for the subgroup one (kernels/matmul_subgroup.wgsl: SG_ROWS, SG_COLS).
    pub gemm_tile: (usize, usize),
    /// layouts[n]: n read-write storage buffers at bindings 0..n.
    pub layouts: Vec<wgpu::BindGroupLayout>,
    /// The pipeline layout of each bind group layout, with the immediates.
    pipeline_layouts: Vec<wgpu::PipelineLayout>,
}

impl Kernels {
    /// The layouts; no module is built yet.
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
        let subgroup_gemm = ctx.subgroup_gemm;
        let gemm_tile = if subgroup_gemm { (32, 32) } else { (64, 64) };
        let (modules, pipelines) = Default::default();
        Ok(Kernels { modules, pipelines, subgroup_gemm, gemm_tile, layouts, pipeline_layouts })
    }

    /// Build `k`'s module and pipeline if this is the first use of either: the driver compiles
    /// the kernel now. An error is one line naming the module and the adapter (the backend
    /// reports it at the next host read, and records nothing of that dispatch).
    pub fn prepare(&mut self, ctx: &Context, k: K) -> Result<()> {
        if self.pipelines.contains_key(&k) {
            return Ok(());
        }
        let sg = self.subgroup_gemm;
        let (name, src) = k.module_source(sg);
        if !self.modules.contains_key(&name) {
            let module = create_module(ctx, &name, &src)?;
            self.modules.insert(name.clone(), module);
        }
        let layout = &self.pipeline_layouts[Kernels::bindings(k)];
        let built = create_pipeline(ctx, layout, &name, &self.modules[&name], k.entry_point(sg))?;
        self.pipelines.insert(k, built);
        Ok(())
    }

    /// The pipeline of `k`, which [`Kernels::prepare`] built.
    pub fn pipeline(&self, k: K) -> &wgpu::ComputePipeline {
        self.pipelines.get(&k).expect("a kernel's pipeline is prepared before its first dispatch")
    }

    /// Buffers `k` binds.
    pub fn bindings(k: K) -> usize {
        k.spec().bindings
    }

    /// The element type binding `i` of `k` holds.
    pub fn binding_dtype(k: K, i: usize) -> crate::backend::DType {
        let e = k.spec();
        let held = match k.variant {
            0 => None,
            v => Some(e.variants[v - 1][i]),
        };
        match held {
            Some(Io::U32) => crate::backend::DType::U32,
            Some(Io::In16 | Io::Out16) => crate::backend::DType::BF16,
            Some(Io::F32) => crate::backend::DType::F32,
            None if e.u32s & (1 << i) != 0 => crate::backend::DType::U32,
            None if e.bf16s & (1 << i) != 0 => crate::backend::DType::BF16,
            None => crate::backend::DType::F32,
        }
    }
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

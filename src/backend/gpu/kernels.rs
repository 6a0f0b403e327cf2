//! The WGSL kernels' machinery: a layer's module (its file under `kernels/`, the buffers it
//! declares, its entry points and their bf16 variants) is described in its own `gpu/<layer>.rs`
//! as a [`Module`], whose kernels are [`K`]s; here every module is built when the backend opens
//! ([`MODULES`]), each pipeline at its first use.

use super::context::{one_line, Context, IMMEDIATE_BYTES, MAX_BINDINGS};
use anyhow::Result;
use std::collections::HashMap;

/// The helpers every module shares, prepended to each.
pub const COMMON: &str = include_str!("kernels/common.wgsl");

/// Every module, a line per layer file.
const MODULES: [&Module; 14] = [
    &super::adamw::MODULE,
    &super::attention::MODULE,
    &super::bf16::MODULE,
    &super::classifier::MODULE,
    &super::encoder::MODULE,
    &super::gelu::MODULE,
    &super::layernorm::MODULE,
    &super::lora::MODULE,
    &super::matmul::MODULE,
    &super::memory::MODULE,
    &super::residual::MODULE,
    &super::rmsnorm::MODULE,
    &super::rope::MODULE,
    &super::swiglu::MODULE,
];

/// A WGSL module: one file of `kernels/`, with [`COMMON`] prepended.
pub struct Module {
    /// Its file's name (without `.wgsl`), and the module's.
    pub name: &'static str,
    pub src: &'static str,
    /// The buffers of a typed module, by name, as its f32 kernels hold them (bindings 0, 1,
    /// ...): declared by a prelude ([`prelude`]), through which the module reads and writes its
    /// f32 or bf16 buffers only (`NAME_ld(e)`, `NAME_st(e, v)`; u32 ones, token ids, as
    /// arrays), so that the same source builds the f32 kernels and each bf16 variant. Empty for
    /// a module that declares its own buffers (and has no variants).
    pub buffers: &'static [(&'static str, Io)],
    pub entries: &'static [Entry],
    /// Appended, with its own entry point `{name}_subgroup` for the entry named as the module,
    /// when the device runs this module's GEMM through subgroups ([`Context::subgroup_gemm`]):
    /// the matmul module, for CPU-run Vulkan drivers. The module is then named
    /// `{name}_subgroup`, as the file it adds.
    pub subgroup: Option<&'static str>,
}

/// One entry point of a module.
pub struct Entry {
    pub name: &'static str,
    /// Storage buffers bound at 0..n.
    pub bindings: usize,
    /// Which hold u32 (a bit per binding), and which bf16 (two a word), in the f32 kernel; the
    /// others hold f32.
    pub u32s: u8,
    pub bf16s: u8,
    /// Its bf16 variants (of a typed module): how each holds every buffer of the module, bound
    /// or not. A variant is its own module, named after it.
    pub variants: &'static [&'static [Io]],
}

impl Entry {
    /// An entry of `bindings` f32 buffers.
    pub const fn f32(name: &'static str, bindings: usize) -> Entry {
        Entry { name, bindings, u32s: 0, bf16s: 0, variants: &[] }
    }
}

/// One compute kernel: entry point `entry` of `module`, as its f32 kernel (`variant` 0) or its
/// bf16 variant `variant` (1, 2, ...).
#[derive(Clone, Copy)]
pub struct K {
    pub module: &'static Module,
    pub entry: usize,
    pub variant: usize,
}

impl K {
    /// The f32 kernel of entry `entry` of `module`.
    pub const fn of(module: &'static Module, entry: usize) -> K {
        K { module, entry, variant: 0 }
    }

    /// Its bf16 variant `v` (1, 2, ...; 0: itself).
    pub fn variant(self, v: usize) -> K {
        assert!(v <= self.spec().variants.len(), "{self:?} has no bf16 variant {v}");
        K { variant: v, ..self }
    }

    /// The kernel that does this one's work on bf16 activations, with `bf16` (an entry with
    /// one variant); else this one.
    pub fn on(self, bf16: bool) -> K {
        let n = self.spec().variants.len();
        assert!(n <= 1, "{self:?} has {n} bf16 variants: choose one");
        if bf16 && n == 1 {
            self.variant(1)
        } else {
            self
        }
    }

    fn spec(self) -> &'static Entry {
        &self.module.entries[self.entry]
    }

    /// Who it is, as its pipeline is found: (module, entry, variant).
    fn key(self) -> (&'static str, usize, usize) {
        (self.module.name, self.entry, self.variant)
    }

    /// Its module's name as built ([`wgsl_modules`]).
    fn module_name(self, subgroup_gemm: bool) -> String {
        let m = self.module;
        match self.variant {
            0 if subgroup_gemm && m.subgroup.is_some() => format!("{}_subgroup", m.name),
            0 => m.name.to_string(),
            v => format!("{}_bf16_{v}", self.spec().name),
        }
    }

    /// Its entry point as built: the subgroup GEMM's for the entry named as the module.
    fn entry_point(self, subgroup_gemm: bool) -> &'static str {
        let (m, e) = (self.module, self.spec());
        match m.subgroup {
            Some(_) if subgroup_gemm && e.name == m.name => SUBGROUP_ENTRY,
            _ => e.name,
        }
    }
}

/// The entry point of the subgroup GEMM ([`Module::subgroup`]).
const SUBGROUP_ENTRY: &str = "matmul_subgroup";

impl std::fmt::Debug for K {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.variant {
            0 => write!(f, "{}::{}", self.module.name, self.spec().name),
            v => write!(f, "{}::{} (bf16 variant {v})", self.module.name, self.spec().name),
        }
    }
}

impl PartialEq for K {
    fn eq(&self, other: &K) -> bool {
        self.key() == other.key()
    }
}

impl Eq for K {}

impl std::hash::Hash for K {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.key().hash(h)
    }
}

/// How a kernel of a typed module ([`Module::buffers`]) holds one of its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
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
pub use Io::{In16, Out16, F32 as F, U32};

/// The declarations of a typed module's buffers, held as `io` says, with their accessors:
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

/// Every kernel of every module: its f32 kernel and its bf16 variants.
fn all_kernels() -> impl Iterator<Item = K> {
    MODULES.into_iter().flat_map(|m| {
        (0..m.entries.len())
            .flat_map(move |e| (0..=m.entries[e].variants.len()).map(move |v| K { module: m, entry: e, variant: v }))
    })
}

/// The complete WGSL of every module (common helpers included), by name: what the pipelines
/// are built from, and what the tests translate for Metal, Vulkan and DX12. With
/// `subgroup_gemm`, a module with a subgroup GEMM and its bf16 variants carry it too.
pub fn wgsl_modules(subgroup_gemm: bool) -> Vec<(String, String)> {
    let mut out = vec![];
    for k in all_kernels() {
        let m = k.module;
        let with_gemm = |src: &str| match m.subgroup {
            Some(sg) if subgroup_gemm => format!("{src}\n{sg}"),
            _ => src.to_string(),
        };
        let names: Vec<&str> = m.buffers.iter().map(|x| x.0).collect();
        let src = match k.variant {
            0 if k.entry > 0 => continue, // a module is built once, with its first entry
            0 if m.buffers.is_empty() => with_gemm(m.src),
            0 => prelude(&names, &m.buffers.iter().map(|x| x.1).collect::<Vec<_>>()) + &with_gemm(m.src),
            v => {
                let io = k.spec().variants[v - 1];
                assert!(m.buffers.len() == io.len(), "{k:?}: one Io per buffer of {}", m.name);
                let same_u32 = m.buffers.iter().zip(io).all(|(x, io)| (x.1 == Io::U32) == (*io == Io::U32));
                assert!(same_u32, "{k:?}: the u32 buffers of {} stay u32", m.name);
                prelude(&names, io) + &with_gemm(m.src)
            }
        };
        out.push((k.module_name(subgroup_gemm), format!("{COMMON}\n{src}")));
    }
    out
}

/// The kernels' modules, their pipelines (built on first use), and one bind group layout per
/// number of bound buffers.
pub struct Kernels {
    /// Every module, by name, validated when the backend opened.
    modules: Vec<(String, wgpu::ShaderModule)>,
    /// Per kernel: its module (an index into `modules`), its entry point, and its pipeline once
    /// built ([`Kernels::prepare`]). The driver compiles a kernel when its
    /// pipeline is created, and a run uses a few of them (tests/gpu_ops.rs, which opens many
    /// backends, took 81 s on lavapipe compiling them all at every open, 32 s at first use).
    pipelines: HashMap<K, (usize, &'static str, std::sync::OnceLock<wgpu::ComputePipeline>)>,
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
        for (name, src) in wgsl_modules(sg) {
            let module = create_module(ctx, &name, &src)?;
            modules.push((name, module));
        }
        let index: HashMap<String, usize> = modules.iter().enumerate().map(|(i, m)| (m.0.clone(), i)).collect();
        let pipelines =
            all_kernels().map(|k| (k, (index[&k.module_name(sg)], k.entry_point(sg), Default::default()))).collect();
        let gemm_tile = if sg { (32, 32) } else { (64, 64) };
        Ok(Kernels { modules, pipelines, gemm_tile, layouts, pipeline_layouts })
    }

    /// Build `k`'s pipeline if this is its first use: the driver compiles the kernel now. An
    /// error is one line naming the module and the adapter (the backend reports it at the next
    /// host read, and records nothing of that dispatch).
    pub fn prepare(&self, ctx: &Context, k: K) -> Result<()> {
        let (module, entry, pipeline) = &self.pipelines[&k];
        if pipeline.get().is_none() {
            let (name, module) = &self.modules[*module];
            let built = create_pipeline(ctx, &self.pipeline_layouts[Kernels::bindings(k)], name, module, entry)?;
            let _ = pipeline.set(built);
        }
        Ok(())
    }

    /// The pipeline of `k`, which [`Kernels::prepare`] built.
    pub fn pipeline(&self, k: K) -> &wgpu::ComputePipeline {
        self.pipelines[&k].2.get().expect("a kernel's pipeline is prepared before its first dispatch")
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

//! The adapter and device: which GPU, its limits, and what went wrong on it.
//!
//! wgpu reports device errors (out of memory, a validation error, a lost device) through
//! callbacks, not return values; they are kept here and turned into one-line errors at the
//! next host read ([`Context::check`]), so an op never panics on a device fault and the
//! training loop stops at its next read, before writing anything.

use anyhow::{bail, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of immediates every kernel gets (its `Params` struct fits in them): the smallest limit
/// of the three APIs (Vulkan guarantees 128 bytes of push constants, DX12's root constants in
/// wgpu are 128 bytes, Metal allows 4 KiB).
pub const IMMEDIATE_BYTES: u32 = 128;

/// Most buffers any kernel binds.
pub const MAX_BINDINGS: usize = 6;

/// A (multi-line) driver or validation message on one line.
pub fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// What the device has reported since it opened.
#[derive(Default, Debug)]
struct Faults {
    /// The first error no error scope caught (an out-of-memory or a validation error).
    error: Option<(bool, String)>,
    /// Why the device was lost.
    lost: Option<String>,
}

pub struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// The adapter can time passes (TIMESTAMP_QUERY): `llmrs bench` times each layer kind.
    pub timestamps: bool,
    /// The GEMM runs as kernels/matmul_subgroup.wgsl (see [`subgroup_gemm`]), not as the tiled
    /// kernel of kernels/matmul.wgsl.
    pub subgroup_gemm: bool,
    faults: Arc<Mutex<Faults>>,
}

/// The wgpu instance: every backend this build has (Vulkan, Metal, DX12), narrowed by
/// wgpu's own `WGPU_BACKEND` where set.
fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

/// Every adapter wgpu finds, in its order (the N of `--device gpu:N`).
pub fn adapters() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()))
}

/// Where `--device gpu` looks, for messages.
pub const LOOKED_FOR: &str = "Vulkan, Metal and DX12 adapters through wgpu";

/// Preference of `--device gpu` without an index: a discrete GPU, then an integrated one, then
/// anything else; a software rasterizer (lavapipe, WARP) last.
fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// The adapter `--device gpu[:index]` means.
pub fn choose(index: Option<usize>) -> Result<wgpu::Adapter> {
    let mut all = adapters();
    if all.is_empty() {
        bail!(
            "--device gpu: no GPU adapter found (looked for {LOOKED_FOR}; on Linux install your GPU's Vulkan \
             driver, e.g. Debian's mesa-vulkan-drivers); run on the CPU with --device cpu"
        );
    }
    match index {
        Some(i) if i >= all.len() => {
            let n = all.len();
            let (are, s) = if n == 1 { ("is", "") } else { ("are", "s") };
            bail!("--device gpu:{i}: there {are} {n} adapter{s} (gpu:0 to gpu:{}); `llmrs devices` lists them", n - 1)
        }
        Some(i) => Ok(all.swap_remove(i)),
        None => {
            let best = (0..all.len()).min_by_key(|&i| (rank(all[i].get_info().device_type), i)).expect("not empty");
            Ok(all.swap_remove(best))
        }
    }
}

/// One line per adapter for `llmrs devices`: index, backend, name, type, driver, limits, and
/// the GEMM kernel it runs (unless `LLMRS_GPU_GEMM=tiled`).
pub fn describe_adapters() -> Vec<String> {
    adapters()
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let (info, l, f) = (a.get_info(), a.limits(), a.features());
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            let yes = |x: bool| if x { "yes" } else { "no" };
            format!(
                "gpu:{i}  {:?}  {} ({:?}; {} {})\n        largest buffer {:.0} MiB, largest binding {:.0} MiB, \
                 workgroup memory {} KiB, immediates {} B; timestamps {}, f16 {}, subgroups {}; GEMM {}{}",
                info.backend,
                info.name,
                info.device_type,
                info.driver,
                info.driver_info,
                mib(l.max_buffer_size),
                mib(l.max_storage_buffer_binding_size),
                l.max_compute_workgroup_storage_size / 1024,
                l.max_immediate_size,
                yes(f.contains(wgpu::Features::TIMESTAMP_QUERY)),
                yes(f.contains(wgpu::Features::SHADER_F16)),
                yes(f.contains(wgpu::Features::SUBGROUP)),
                if subgroup_gemm(&info, f) { "subgroup" } else { "tiled" },
                if f.contains(wgpu::Features::IMMEDIATES) { "" } else { "; NO immediates: llmrs cannot use it" },
            )
        })
        .collect()
}

/// Whether the GEMM on this adapter runs as kernels/matmul_subgroup.wgsl: on a Vulkan driver
/// that runs shaders on the CPU (lavapipe; the one kind of device where that kernel was
/// measured faster: 2.5x a step of a small GPT-2 on a Zen 1), with subgroup operations and
/// subgroups of at least 8 lanes (the kernel shares A through lanes 0..7).
fn subgroup_gemm(info: &wgpu::AdapterInfo, features: wgpu::Features) -> bool {
    software_vulkan(info) && features.contains(wgpu::Features::SUBGROUP) && info.subgroup_min_size >= 8
}

/// A Vulkan driver that runs shaders on the CPU (lavapipe, SwiftShader).
fn software_vulkan(info: &wgpu::AdapterInfo) -> bool {
    info.backend == wgpu::Backend::Vulkan && info.device_type == wgpu::DeviceType::Cpu
}

/// Every Vulkan adapter of the CPU type (lavapipe), by index (as `--device gpu:N`), with
/// whether its GEMM runs as the subgroup kernel.
pub fn software_vulkan_adapters() -> Vec<(usize, bool)> {
    adapters()
        .iter()
        .enumerate()
        .map(|(i, a)| (i, a.get_info(), a.features()))
        .filter(|(_, info, _)| software_vulkan(info))
        .map(|(i, info, f)| (i, subgroup_gemm(&info, f)))
        .collect()
}

impl Context {
    /// Open a device on `adapter` with every limit the adapter has (wgpu's defaults are lower:
    /// fewer storage buffers, smaller bindings). `tiled_gemm`: the tiled GEMM even where the
    /// subgroup one would run (tests that compare the two).
    pub fn open(adapter: wgpu::Adapter, tiled_gemm: bool) -> Result<Self> {
        let info = adapter.get_info();
        let name = format!("{} ({:?})", info.name, info.backend);
        let features = adapter.features();
        let limits = adapter.limits();
        if !features.contains(wgpu::Features::IMMEDIATES) || limits.max_immediate_size < IMMEDIATE_BYTES {
            bail!(
                "--device gpu: {name} lacks immediate data (push constants) of {} bytes, which llmrs's kernels \
                 need; run on the CPU with --device cpu",
                IMMEDIATE_BYTES
            );
        }
        if limits.max_storage_buffers_per_shader_stage < MAX_BINDINGS as u32 {
            bail!(
                "--device gpu: {name} binds at most {} storage buffers per shader, llmrs needs {}; run on the CPU \
                 with --device cpu",
                limits.max_storage_buffers_per_shader_stage,
                MAX_BINDINGS
            );
        }
        let timestamps = features.contains(wgpu::Features::TIMESTAMP_QUERY);
        let mut required_features = wgpu::Features::IMMEDIATES;
        if timestamps {
            required_features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        let subgroup_gemm = !tiled_gemm && subgroup_gemm(&info, features);
        if subgroup_gemm {
            required_features |= wgpu::Features::SUBGROUP;
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("llmrs"),
            required_features,
            required_limits: limits.clone(),
            ..Default::default()
        };
        let (device, queue) = match pollster::block_on(adapter.request_device(&desc)) {
            Ok(dq) => dq,
            Err(e) => bail!("--device gpu: cannot open {name}: {e}; run on the CPU with --device cpu"),
        };
        let faults = Arc::new(Mutex::new(Faults::default()));
        let f = faults.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let oom = matches!(e, wgpu::Error::OutOfMemory { .. });
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            f.error.get_or_insert((oom, one_line(&e.to_string())));
        }));
        let f = faults.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            f.lost.get_or_insert(format!(
                "{reason:?}{}",
                if msg.is_empty() { String::new() } else { format!(": {msg}") }
            ));
        });
        Ok(Context { device, queue, info, limits, timestamps, subgroup_gemm, faults })
    }

    /// The adapter's name and API, for messages.
    pub fn name(&self) -> String {
        format!("{} ({:?})", self.info.name, self.info.backend)
    }

    /// A one-line error for the first fault the device reported, if any.
    pub fn check(&self) -> Result<()> {
        let error = self.faults.lock().unwrap_or_else(|p| p.into_inner()).error.is_some();
        if error && !self.lost() {
            // A lost device makes every later call an error; its callback runs at a poll, so
            // give it the chance to say that the device was lost, the cause.
            let _ = self.device.poll(wgpu::PollType::Poll);
        }
        let f = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let name = self.name();
        if let Some(why) = &f.lost {
            bail!(
                "the GPU {name} was lost ({why}); nothing after the newest complete checkpoint was kept: resume it \
                 with -y 1 (or with --device cpu)"
            );
        }
        match &f.error {
            Some((true, msg)) => bail!(
                "out of GPU memory on {name} ({msg}): lower the batch size (-b) or sequence length (-t), or run on \
                 the CPU with --device cpu"
            ),
            Some((false, msg)) => {
                bail!("GPU error on {name}: {msg}; run on the CPU with --device cpu (and please report this)")
            }
            None => Ok(()),
        }
    }

    /// Whether the device has been lost (a later submit would be in vain).
    pub fn lost(&self) -> bool {
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).lost.is_some()
    }

    /// Wait until everything submitted has run, checking for a lost device every second so
    /// that a dead GPU is an error, not a hang.
    pub fn wait(&self) -> Result<()> {
        let t0 = Instant::now();
        loop {
            let r = self
                .device
                .poll(wgpu::PollType::Wait { submission_index: None, timeout: Some(Duration::from_secs(1)) });
            match r {
                Ok(_) => return self.check(),
                Err(wgpu::PollError::Timeout) => {
                    self.check()?;
                    if t0.elapsed() > WAIT_LIMIT {
                        bail!(
                            "the GPU {} has not finished its work after {} s: it hangs; resume from the newest \
                             checkpoint with -y 1 (or with --device cpu)",
                            self.name(),
                            WAIT_LIMIT.as_secs()
                        );
                    }
                }
                Err(e) => {
                    self.check()?;
                    bail!("waiting for the GPU {}: {e}", self.name());
                }
            }
        }
    }

    /// Lose the device on purpose (tests of the error path). wgpu calls the lost callback only
    /// once the queue has drained; what follows meanwhile fails as on a device lost for real.
    pub fn destroy(&self) {
        self.device.destroy();
        let mut f = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        f.lost.get_or_insert("destroyed on purpose: a test of the error path".into());
    }
}

/// Longest a host read waits for the device (a slow software device runs a big step for
/// minutes; a real GPU that takes this long has hung, and its driver resets it well before).
const WAIT_LIMIT: Duration = Duration::from_secs(1800);

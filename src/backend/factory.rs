//! The one place a backend is chosen: [`open`] makes the device `--device` names, once at
//! start-up. It sits apart from the [`Backend`] trait so that the trait's module imports no
//! device (the devices import it).

use super::{Backend, Device};
use anyhow::{bail, Result};

/// Settle what every backend's host side relies on, once at start-up: the CPU kernels'
/// instruction set, its fp32 GEMM's order and its bf16 GEMM (so a bad `LLMRS_CPU_ISA`,
/// `LLMRS_SGEMM_ORDER` or `LLMRS_BF16_GEMM` is an error here, not a panic in a kernel).
pub fn init_host() -> Result<()> {
    crate::backend::cpu::simd::init()?;
    crate::backend::cpu::sgemm::init()?;
    crate::backend::cpu::bgemm::init().map(|_| ())
}

/// The backend for `device`.
pub fn open(device: Device) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(crate::backend::cpu::backend::CpuBackend::new(crate::core::env::nan_check()))),
        Device::Gpu(adapter) => {
            Ok(Box::new(crate::backend::gpu::GpuBackend::open(crate::backend::gpu::Options::from_env(adapter)?)?))
        }
        Device::Cuda(_) => {
            bail!(
                "--device {device}: llmrs has no CUDA backend yet; an NVIDIA GPU runs with --device gpu (Vulkan), \
                 or run on the CPU (--device cpu, the default)"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_refused_with_the_way_out() {
        let e = open(Device::Cuda(0)).err().unwrap().to_string();
        assert!(e.contains("no CUDA backend yet") && e.contains("--device cpu"), "{e}");
    }
}

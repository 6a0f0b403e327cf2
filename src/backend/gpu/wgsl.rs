//! Every WGSL module the backend has, a line per layer file: what the tests translate for
//! Metal, Vulkan and DX12 and validate. (The backend itself builds a module at its first use.)

use super::kernel::{Module, K};

/// Every module, a line per layer file.
pub const MODULES: [&Module; 14] = [
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

/// Every kernel of every module: its f32 kernel and its bf16 variants.
pub fn all_kernels() -> impl Iterator<Item = K> {
    MODULES.into_iter().flat_map(|m| {
        (0..m.entries.len())
            .flat_map(move |e| (0..=m.entries[e].variants.len()).map(move |v| K { module: m, entry: e, variant: v }))
    })
}

/// The complete WGSL of every module (common helpers included), by name ([`K::module_source`]).
/// With `subgroup_gemm`, a module with a subgroup GEMM and its bf16 variants carry it too.
pub fn wgsl_modules(subgroup_gemm: bool) -> Vec<(String, String)> {
    // A module is built once, with its first entry; each bf16 variant is its own module.
    all_kernels().filter(|k| k.variant > 0 || k.entry == 0).map(|k| k.module_source(subgroup_gemm)).collect()
}

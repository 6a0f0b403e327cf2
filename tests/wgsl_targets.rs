//! Every WGSL kernel module, translated by naga (the translator wgpu uses) to Metal Shading
//! Language, SPIR-V (Vulkan) and HLSL (DX12), so that a shader that would not build on a Mac or
//! on Windows fails here, on a machine that has neither. Needs no GPU. (MSL and HLSL are
//! produced, not compiled: their compilers run only on those systems.) The GEMM modules with
//! the subgroup kernel, which only Vulkan drivers that run on the CPU build, go to SPIR-V.

use naga::back::{hlsl, msl, spv};
use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};

/// The validator of a device with these capabilities (and subgroup broadcasts in compute
/// shaders when SUBGROUP is one of them).
fn validator(caps: Capabilities) -> Validator {
    let mut v = Validator::new(ValidationFlags::all(), caps);
    if caps.contains(Capabilities::SUBGROUP) {
        v.subgroup_stages(ShaderStages::COMPUTE).subgroup_operations(SubgroupOperationSet::BALLOT);
    }
    v
}

type Modules = Vec<(String, naga::Module, naga::valid::ModuleInfo)>;

fn parse(list: Vec<(String, String)>, caps: Capabilities) -> Modules {
    list.into_iter()
        .map(|(name, src)| {
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{name}.wgsl does not parse:\n{}", e.emit_to_string(&src)));
            let info = validator(caps)
                .validate(&module)
                .unwrap_or_else(|e| panic!("{name}.wgsl does not validate:\n{}", e.emit_to_string(&src)));
            (name, module, info)
        })
        .collect()
}

/// Every module as a device without the subgroup GEMM builds it, validated with the
/// capabilities llmrs asks of every device: immediates, nothing else.
fn modules() -> Modules {
    parse(llmrs::backend::gpu::wgsl::wgsl_modules(false), Capabilities::IMMEDIATES)
}

/// The modules that differ with the subgroup GEMM (the GEMM's), validated with the
/// capabilities a device that runs it is opened with: immediates and subgroups.
fn subgroup_modules() -> Modules {
    let plain = llmrs::backend::gpu::wgsl::wgsl_modules(false);
    let with = llmrs::backend::gpu::wgsl::wgsl_modules(true).into_iter().filter(|m| !plain.contains(m)).collect();
    parse(with, Capabilities::IMMEDIATES | Capabilities::SUBGROUP)
}

#[test]
fn every_module_translates_to_metal() {
    let modules = modules();
    // Every .wgsl file beside the helpers they share is a module (some also are the body of a
    // variant, as matmul_bf16 is of matmul), of one set or the other.
    let subgroup = subgroup_modules();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/gpu/kernels");
    for e in std::fs::read_dir(dir).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().to_string();
        if let Some(stem) = n.strip_suffix(".wgsl").filter(|s| *s != "common") {
            assert!(modules.iter().chain(&subgroup).any(|m| m.0 == stem), "kernels/{n} is no module");
        }
    }
    for (name, module, info) in &modules {
        for version in [(2, 0), (2, 4), (3, 0)] {
            let opts = msl::Options { lang_version: version, fake_missing_bindings: true, ..Default::default() };
            let (src, _) = msl::write_string(module, info, &opts, &msl::PipelineOptions::default())
                .unwrap_or_else(|e| panic!("{name}.wgsl -> MSL {version:?}: {e}"));
            assert!(src.contains("kernel void"), "{name}: no compute function in the MSL");
        }
    }
}

#[test]
fn every_module_translates_to_spirv() {
    for (name, module, info) in modules() {
        for version in [(1, 0), (1, 3), (1, 5)] {
            let opts = spv::Options { lang_version: version, ..Default::default() };
            let words = spv::write_vec(&module, &info, &opts, None)
                .unwrap_or_else(|e| panic!("{name}.wgsl -> SPIR-V {version:?}: {e}"));
            assert_eq!(words[0], 0x0723_0203, "{name}: SPIR-V magic number");
        }
    }
}

#[test]
fn the_subgroup_gemm_translates_to_spirv() {
    let modules = subgroup_modules();
    // The matmul module and each of its bf16 variants (one per GEMM and the bias gradient's).
    let names: Vec<&str> = modules.iter().map(|m| m.0.as_str()).collect();
    assert!(names.contains(&"matmul_subgroup") && names.contains(&"matmul_bf16_1"), "subgroup modules: {names:?}");
    assert_eq!(modules.len(), 8, "subgroup modules: {names:?}");
    for (name, module, info) in modules {
        // Vulkan 1.1's SPIR-V and later: subgroup operations need 1.3.
        for version in [(1, 3), (1, 5)] {
            let opts = spv::Options { lang_version: version, ..Default::default() };
            let words = spv::write_vec(&module, &info, &opts, None)
                .unwrap_or_else(|e| panic!("{name}.wgsl -> SPIR-V {version:?}: {e}"));
            assert_eq!(words[0], 0x0723_0203, "{name}: SPIR-V magic number");
        }
        // A device without subgroups could not build it: it is not among the modules they get.
        assert!(validator(Capabilities::IMMEDIATES).validate(&module).is_err(), "{name} needs no subgroups");
    }
}

#[test]
fn every_module_translates_to_hlsl() {
    for (name, module, info) in modules() {
        // FXC's shader model 5.1 and DXC's 6.x, as wgpu's DX12 backend uses them.
        for model in [hlsl::ShaderModel::V5_1, hlsl::ShaderModel::V6_0, hlsl::ShaderModel::V6_6] {
            let opts = hlsl::Options {
                shader_model: model,
                fake_missing_bindings: true,
                immediates_target: Some(hlsl::BindTarget { space: 0, register: 0, ..Default::default() }),
                ..Default::default()
            };
            let mut out = String::new();
            hlsl::Writer::new(&mut out, &opts, &Default::default())
                .write(&module, &info, None)
                .unwrap_or_else(|e| panic!("{name}.wgsl -> HLSL {model:?}: {e}"));
            assert!(out.contains("[numthreads("), "{name}: no compute entry point in the HLSL");
        }
    }
}

#[test]
fn a_broken_kernel_is_caught_here() {
    // The check above would catch a module that does not validate: one that writes a read-only
    // binding, say.
    let src = format!(
        "{}\n@group(0) @binding(0) var<storage, read> x: array<f32>;\n@compute @workgroup_size(1) fn f() {{ x[0] = 1.0; }}",
        llmrs::backend::gpu::kernel::COMMON
    );
    let refused = match naga::front::wgsl::parse_str(&src) {
        Err(_) => true,
        Ok(m) => validator(Capabilities::IMMEDIATES).validate(&m).is_err(),
    };
    assert!(refused, "a write to a read-only buffer was accepted");
}

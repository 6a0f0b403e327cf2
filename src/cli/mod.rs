//! One file per command: its flags (clap) and what it runs. The helpers several commands
//! share (a model opened from its spec, dtype names, the flags' defaults) are here.

pub mod bench;
pub mod convert;
pub mod eval;
pub mod generate;
pub mod prepare;
pub mod train;

use anyhow::{bail, Result};
use llmrs::core::files::Dtype;
use llmrs::train::TrainConfig;
use std::path::{Path, PathBuf};

thread_local! {
    /// The one place defaults live is `TrainConfig::default()`; the flags read them from here.
    pub static D: TrainConfig = TrainConfig::default();
}

/// `spec`'s weights, with `--lora`'s adapters merged in (a LoRA checkpoint's random base drawn
/// with its own seed unless `seed_given`).
pub fn load_with_lora(
    spec: &str,
    seed: u32,
    seed_given: bool,
    lora: Option<&Path>,
) -> Result<llmrs::core::params::Weights> {
    match lora {
        Some(p) => llmrs::source::load_merged(spec, seed, seed_given, p),
        None => llmrs::source::load_any(spec, seed),
    }
}

/// `spec`'s model on `device` in `precision`, with `--lora`'s adapters merged in. Without
/// adapters a descriptor's random weights are drawn, and a Hugging Face checkpoint's read, into
/// the model once its precision is set, so that a bf16 model's fp32 values never exist whole.
pub fn open_model(
    spec: &str,
    seed: u32,
    lora: Option<&Path>,
    device: llmrs::backend::Device,
    precision: llmrs::core::config::Precision,
) -> Result<llmrs::model::Model> {
    let (weights, deferred) = match lora {
        Some(_) => (load_with_lora(spec, seed, false, lora)?, None),
        None => llmrs::source::load_any_deferred(spec, seed)?,
    };
    let mut model = llmrs::model::Model::new(weights, device)?;
    model.set_precision(precision, false)?;
    if let Some(d) = deferred {
        d.make(&mut model)?;
    }
    Ok(model)
}

/// The model to load from `--hf owner/name` (first) or `-e`.
pub fn model_spec(hf: Option<String>, model: Option<String>) -> Result<String> {
    Ok(match (hf, model) {
        (Some(h), _) => format!("hf:{h}"),
        (None, Some(m)) => m,
        (None, None) => bail!("give a model with -e or --hf"),
    })
}

/// A model dtype as the command line names it; `parse_dtype` reads it back.
pub fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "fp32",
        Dtype::BF16 => "bf16",
    }
}

pub fn parse_dtype(d: &str) -> Result<Dtype> {
    Ok(match d {
        "fp32" | "f32" | "float32" => Dtype::F32,
        "bf16" | "bfloat16" => Dtype::BF16,
        _ => bail!("unknown dtype '{d}': use fp32 or bf16"),
    })
}

pub fn devices() -> Result<()> {
    let lines = llmrs::backend::gpu::describe_adapters();
    if lines.is_empty() {
        println!(
            "no GPU adapters found (looked for {}); --device cpu runs on the CPU",
            llmrs::backend::gpu::LOOKED_FOR
        );
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

pub fn plot(logs: &[PathBuf], out: &Path) -> Result<()> {
    let runs = logs.iter().map(|p| llmrs::train::plot::read_log(p)).collect::<Result<Vec<_>>>()?;
    let (png, svg) = llmrs::train::plot::plot(&runs, out)?;
    eprintln!("wrote {} and {}", png.display(), svg.display());
    Ok(())
}

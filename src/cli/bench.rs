//! `llmrs bench`: timed training steps on random tokens.

use super::D;
use anyhow::{bail, Result};
use clap::Args;

type Comm = Box<dyn llmrs::backend::comm::Collectives>;

#[derive(Args)]
pub struct BenchArgs {
    /// Model descriptor or file.
    #[arg(short = 'e', long = "model", default_value = "d12")]
    pub model: String,
    #[arg(short = 'b', long = "batch-size", default_value_t = 4)]
    pub batch_size: usize,
    #[arg(short = 't', long = "seq-len", default_value_t = 64)]
    pub seq_len: usize,
    /// Measured steps.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Unmeasured warm-up steps.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// ZeRO stage when launched by mpirun (0-3, as train's -z).
    #[arg(short = 'z', long = "zero-stage", default_value_t = 0)]
    pub zero_stage: usize,
    /// Recompute in the backward (as train's -r): 0 none, 1 the MLP activation, 2 + the norms' outputs.
    #[arg(short = 'r', long = "recompute", default_value_t = D.with(|d| d.recompute))]
    pub recompute: u8,
    /// Rows of logits the classifier computes at once (as train's --ce-rows; 0 = all).
    #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
    pub ce_rows: usize,
    /// LoRA adapters of this rank, alpha twice it (as train's --lora; 0 = every weight trains).
    #[arg(long = "lora", default_value_t = 0)]
    pub lora: usize,
    /// The projections LoRA adapts (as train's --lora-targets).
    #[arg(long = "lora-targets", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// fp32 or bf16 (as train's --precision).
    #[arg(long, default_value_t = D.with(|d| d.precision))]
    pub precision: llmrs::core::config::Precision,
    /// With bf16: 1 = fp32 master weights, 0 = none (as train's -w).
    #[arg(short = 'w', long = "master-weights", default_value_t = 1)]
    pub master_weights: u8,
}

/// Check the flags, time the steps and print the report (rank 0; as JSON with `--json`).
pub fn run(a: BenchArgs, device: llmrs::backend::Device, comm: Comm) -> Result<()> {
    let BenchArgs {
        model,
        batch_size,
        seq_len,
        steps,
        warmup,
        json,
        zero_stage,
        recompute,
        ce_rows,
        lora,
        lora_targets,
        precision,
        master_weights,
    } = a;
    if batch_size == 0 || seq_len == 0 {
        bail!("-b {batch_size} -t {seq_len}: the batch size and sequence length must be at least 1");
    }
    if steps == 0 {
        bail!("--steps 0: measure at least 1 step");
    }
    if master_weights > 1 {
        bail!("-w {master_weights}: use 1 (fp32 master weights, the default) or 0 (bf16 parameters only)");
    }
    let cfg = llmrs::train::bench::BenchConfig {
        model,
        batch_size,
        seq_len,
        steps,
        warmup,
        device,
        zero_stage,
        recompute,
        ce_rows,
        lora,
        lora_targets,
        precision,
        master_weights: master_weights != 0,
    };
    let r = llmrs::train::bench::run_with(&cfg, comm)?;
    if r.rank != 0 {
        return Ok(());
    }
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("{r}");
    }
    Ok(())
}

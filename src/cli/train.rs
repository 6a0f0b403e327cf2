//! `llmrs train` (llm.c's train_gpt2.cu flags, two-letter ones included) and the default run
//! (`llmrs` with no command).

use super::prepare::TINYSHAKESPEARE_DIR;
use super::{parse_dtype, D};
use anyhow::{bail, Result};
use clap::Args;
use llmrs::core::files::Dtype;
use llmrs::data::prepare::{prepare_tinyshakespeare, Source};
use llmrs::model::optim::OptimConfig;
use llmrs::train::TrainConfig;
use std::path::{Path, PathBuf};

type Comm = Box<dyn llmrs::backend::comm::Collectives>;

/// Flags follow llm.c's train_gpt2.cu; defaults differ only where the default run needs a
/// smaller setup (marked "default run"). Negative values may follow a flag after a space
/// (`-l -1`), so that they reach the validation and its message rather than a parse error.
#[derive(Args)]
#[command(disable_help_flag = true, allow_negative_numbers = true)]
pub struct TrainArgs {
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
    /// Train data: shard file or glob pattern.
    #[arg(short = 'i', long = "train-data", default_value_t = D.with(|d| d.train_data.clone()))]
    pub train_data: String,
    /// Val data: shard file or glob pattern ("" for none: no validation; -v 0 does not read it).
    #[arg(short = 'j', long = "val-data", default_value_t = D.with(|d| d.val_data.clone()))]
    pub val_data: String,
    /// Model to start from: an llm.c .bin, a Hugging Face directory or hf:owner/name, or a
    /// descriptor for random init: GPT-2 d6 d12 d24 d36 d48, gpt2, gpt2-medium, gpt2-large,
    /// gpt2-xl, tiny, LxC:NH[:maxT]; Llama llama:smollm2-135m, llama:smollm2-360m,
    /// llama:smollm2-1.7b, llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b,
    /// llama:LxC:NH:KV[:F[:maxT]]; Qwen qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, qwen3:qwen3-0.6b,
    /// qwen3:qwen3-1.7b, qwen2:LxC:NH:KV[:F[:maxT]], qwen3:LxC:NH:KV:HS[:F[:maxT]]. Default run:
    /// tiny (llm.c: gpt2_124M_bf16.bin).
    #[arg(short = 'e', long = "model")]
    pub model: Option<String>,
    /// Output directory for the log and checkpoints ("" for none). Default run: out (llm.c: none).
    #[arg(short = 'o', long = "output-dir", default_value_t = D.with(|d| d.output_dir.as_ref().map_or(String::new(), |p| p.display().to_string())))]
    pub output_dir: String,
    /// Write a checkpoint every N steps (0 = never).
    #[arg(short = 'n', long = "checkpoint-every", default_value_t = D.with(|d| d.checkpoint_every))]
    pub checkpoint_every: usize,
    /// Keep only the last N checkpoints (0 = all). llm.c: -nk.
    #[arg(long = "checkpoints-keep", default_value_t = D.with(|d| d.checkpoints_keep))]
    pub checkpoints_keep: usize,
    /// Checkpoints at multiples of N are never deleted. llm.c: -nm.
    #[arg(long = "major-checkpoint-every", default_value_t = D.with(|d| d.major_checkpoint_every))]
    pub major_checkpoint_every: usize,
    /// 1 = resume from the latest checkpoint in the output directory.
    #[arg(short = 'y', long = "resume", default_value_t = 0)]
    pub resume: u8,
    /// Micro-batch size B.
    #[arg(short = 'b', long = "batch-size", default_value_t = D.with(|d| d.batch_size))]
    pub batch_size: usize,
    /// Sequence length T. Default run: 64 (llm.c: 1024).
    #[arg(short = 't', long = "seq-len", default_value_t = D.with(|d| d.seq_len))]
    pub seq_len: usize,
    /// Total batch size in tokens per step (gradient accumulation); default B*T.
    #[arg(short = 'd', long = "total-batch-size", default_value_t = -1)]
    pub total_batch_size: i64,
    /// Learning rate. Default run: 1e-3 (llm.c: 3e-4).
    #[arg(short = 'l', long = "lr", default_value_t = D.with(|d| d.learning_rate))]
    pub learning_rate: f32,
    /// Warmup steps. Default run: 20 (llm.c: 0).
    #[arg(short = 'u', long = "warmup", default_value_t = D.with(|d| d.warmup))]
    pub warmup: usize,
    /// Final learning-rate fraction. Default run: 0.1 (llm.c: 1.0).
    #[arg(short = 'q', long = "final-lr-frac", default_value_t = D.with(|d| d.final_lr_frac))]
    pub final_lr_frac: f32,
    /// Learning-rate schedule: cosine, linear, constant, wsd.
    #[arg(short = 'k', long = "schedule", default_value_t = D.with(|d| d.schedule.to_string()))]
    pub schedule: String,
    /// Weight decay (2-D weights only).
    #[arg(short = 'c', long = "weight-decay", default_value_t = D.with(|d| d.optim.weight_decay))]
    pub weight_decay: f32,
    /// Steps to train (-1 = one epoch). Default run: 500 (llm.c: -1).
    #[arg(short = 'x', long = "max-steps", default_value_t = D.with(|d| d.max_steps.map_or(-1, |x| x as i64)), allow_negative_numbers = true)]
    pub max_steps: i64,
    /// Validate every N steps (0 = never). Default run: 50 (llm.c: 20).
    #[arg(short = 'v', long = "val-every", default_value_t = D.with(|d| d.val_every))]
    pub val_every: usize,
    /// Validation batches (-1 = the whole val split).
    #[arg(short = 'm', long = "val-max-steps", default_value_t = D.with(|d| d.val_max_steps.map_or(-1, |x| x as i64)), allow_negative_numbers = true)]
    pub val_max_steps: i64,
    /// Sample text every N steps (0 = never). Default run: 100 (llm.c: 20).
    #[arg(short = 's', long = "sample-every", default_value_t = D.with(|d| d.sample_every))]
    pub sample_every: usize,
    /// Tokens to generate per sample.
    #[arg(short = 'g', long = "gen-tokens", default_value_t = D.with(|d| d.gen_tokens))]
    pub gen_tokens: usize,
    /// 1 = overfit a single batch (debugging).
    #[arg(short = 'a', long = "overfit-single-batch", default_value_t = 0)]
    pub overfit: u8,
    /// Seed for random init.
    #[arg(long, default_value_t = D.with(|d| d.seed))]
    pub seed: u32,
    /// Clip the global gradient norm to this (0 disables).
    #[arg(long = "grad-clip", default_value_t = D.with(|d| d.optim.grad_clip))]
    pub grad_clip: f32,
    /// Skip the update when the loss's z-score over the last 128 steps exceeds this (0 = off). llm.c: -sl.
    #[arg(long = "skip-loss-z", default_value_t = D.with(|d| d.skip_loss_z))]
    pub skip_loss_z: f32,
    /// Skip the update when the gradient norm's z-score exceeds this (0 = off). llm.c: -sg.
    #[arg(long = "skip-grad-z", default_value_t = D.with(|d| d.skip_grad_z))]
    pub skip_grad_z: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.beta1))]
    pub beta1: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.beta2))]
    pub beta2: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.eps))]
    pub eps: f32,
    /// Delete the checkpoints of an earlier run in the output directory (else a fresh run there is refused).
    #[arg(long)]
    pub overwrite: bool,
    /// Read training batches in order instead of llm.c's shuffled order.
    #[arg(long = "no-shuffle")]
    pub no_shuffle: bool,
    /// Checkpoint model dtype: fp32 or bf16 (default: the run's precision).
    #[arg(long = "save-dtype")]
    pub save_dtype: Option<String>,
    /// Precision (llm.c's build setting): fp32, or bf16 (parameters, gradients and activations
    /// in bf16, every op computing in fp32; README: Precision), on the CPU and the GPU.
    #[arg(long, default_value_t = D.with(|d| d.precision))]
    pub precision: llmrs::core::config::Precision,
    /// With bf16: 1 = keep fp32 master weights that AdamW updates (llm.c -w), 0 = AdamW rounds
    /// its updates into the bf16 parameters stochastically (less memory).
    #[arg(short = 'w', long = "master-weights", default_value_t = D.with(|d| d.master_weights as u8))]
    pub master_weights: u8,
    /// Start from a model on the Hugging Face Hub (owner/name[@revision]) instead of -e.
    #[arg(long)]
    pub hf: Option<String>,
    /// 1 = HellaSwag accuracy at every validation step (llm.c -h).
    #[arg(short = 'h', long = "hellaswag", default_value_t = 0)]
    pub hellaswag: u8,
    /// HellaSwag file for -h 1: JSON lines or llm.c's hellaswag_val.bin.
    #[arg(long)]
    pub hellaswag_data: Option<PathBuf>,
    /// Score only the first N HellaSwag examples during training.
    #[arg(long)]
    pub hellaswag_limit: Option<usize>,
    /// ZeRO stage over the processes of an `mpirun` launch (llm.c -z): 0 = gradients
    /// all-reduced, 1 = AdamW state sharded, 2 = + gradients, 3 = + parameters.
    #[arg(short = 'z', long = "zero-stage", default_value_t = D.with(|d| d.zero_stage))]
    pub zero_stage: usize,
    /// Recompute in the backward instead of keeping per layer (llm.c -r): 0 none, 1 the MLP
    /// activation (GELU, SwiGLU), 2 + the norms' outputs. Same losses bit for bit; less memory.
    /// (Attention never keeps its probabilities: its backward rebuilds them at every level.)
    #[arg(short = 'r', long = "recompute", default_value_t = D.with(|d| d.recompute))]
    pub recompute: u8,
    /// Rows of logits the classifier (head, cross-entropy, their backward) computes at once,
    /// instead of all B*T: less memory, most for large vocabularies; chunks of fewer than about
    /// 1024 rows cost speed. 0 = all at once; else at least 3.
    #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
    pub ce_rows: usize,
    /// LoRA: train adapters of this rank on the projections instead of every weight; the base
    /// model is frozen (no gradients, no AdamW state). 0 = full fine-tune.
    #[arg(long = "lora", default_value_t = 0)]
    pub lora: usize,
    /// LoRA's alpha (the adapters' scale is alpha / rank). Default: twice the rank.
    #[arg(long = "lora-alpha")]
    pub lora_alpha: Option<f32>,
    /// The projections LoRA adapts, as PEFT's target_modules (comma-separated last names such
    /// as q_proj,v_proj, or c_attn for GPT-2). Default: all-linear, every projection of a block.
    #[arg(long = "lora-targets", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// Go on from a PEFT adapter directory (its adapter_config.json gives rank, alpha and
    /// targets) or a LoRA checkpoint, on top of -e.
    #[arg(long = "lora-from")]
    pub lora_from: Option<PathBuf>,
}

/// llm.c spells some flags with two letters after one dash (-nk, -nm, -sl, -sg); map them to long names.
/// GPU-only llm.c flags are accepted and ignored on the CPU, with a note. (`-w`, master
/// weights, is not one of them: llmrs's bf16 runs honour it on every device.)
pub fn translate_llmc_args(args: Vec<String>) -> Vec<String> {
    const GPU_ONLY: [&str; 3] = ["-f", "-ge", "-lg"];
    // llm.c's process-group flags (processes, rank, GPUs per node, init method, paths): llmrs
    // takes its ranks from the MPI launcher.
    const PROCESS_GROUP: [&str; 6] = ["-pn", "-pr", "-pg", "-pi", "-pf", "-ps"];
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-nk" => out.push("--checkpoints-keep".into()),
            "-nm" => out.push("--major-checkpoint-every".into()),
            "-sl" => out.push("--skip-loss-z".into()),
            "-sg" => out.push("--skip-grad-z".into()),
            g if GPU_ONLY.contains(&g) => {
                let v = it.next().unwrap_or_default();
                eprintln!("note: {g} {v} is a GPU setting of llm.c; ignored on the CPU");
            }
            g if PROCESS_GROUP.contains(&g) => {
                let v = it.next().unwrap_or_default();
                eprintln!(
                    "note: {g} {v} is ignored: llmrs takes its processes from mpirun (README: Several processes)"
                );
            }
            _ => out.push(a),
        }
    }
    out
}

/// The checks on flags that have no field of their own in `TrainConfig` (0/1 switches, -1 defaults).
pub fn check_train_flags(a: &TrainArgs) -> Result<()> {
    for (flag, v) in
        [("-y/--resume", a.resume), ("-a/--overfit-single-batch", a.overfit), ("-h/--hellaswag", a.hellaswag)]
    {
        if v > 1 {
            bail!("{flag} {v}: must be 0 or 1");
        }
    }
    // -1 means "the default" (one epoch, the whole val split, B*T); -m 0 is refused by validate.
    for (flag, v, min, minus_one) in [
        ("-x/--max-steps", a.max_steps, 0, "one epoch of the train data"),
        ("-m/--val-max-steps", a.val_max_steps, 0, "the whole val split"),
        ("-d/--total-batch-size", a.total_batch_size, 1, "B*T"),
    ] {
        if v < min && v != -1 {
            bail!("{flag} {v}: give a number >= {min}, or -1 for {minus_one}");
        }
    }
    Ok(())
}

pub fn train_config(a: TrainArgs, device: llmrs::backend::Device) -> Result<TrainConfig> {
    check_train_flags(&a)?;
    let cfg = TrainConfig {
        train_data: a.train_data,
        val_data: a.val_data,
        model_given: a.hf.is_some() || a.model.is_some(),
        model: match (a.hf, a.model) {
            (Some(h), _) => format!("hf:{h}"),
            (None, Some(m)) => m,
            (None, None) => TrainConfig::default().model,
        },
        output_dir: (!a.output_dir.is_empty()).then(|| PathBuf::from(a.output_dir)),
        checkpoint_every: a.checkpoint_every,
        checkpoints_keep: a.checkpoints_keep,
        major_checkpoint_every: a.major_checkpoint_every,
        resume: a.resume == 1,
        batch_size: a.batch_size,
        seq_len: a.seq_len,
        total_batch_size: (a.total_batch_size > 0).then_some(a.total_batch_size as usize),
        learning_rate: a.learning_rate,
        warmup: a.warmup,
        final_lr_frac: a.final_lr_frac,
        schedule: a.schedule.parse()?,
        max_steps: (a.max_steps >= 0).then_some(a.max_steps as usize),
        val_every: a.val_every,
        val_max_steps: (a.val_max_steps >= 0).then_some(a.val_max_steps as usize),
        sample_every: a.sample_every,
        gen_tokens: a.gen_tokens,
        overfit_single_batch: a.overfit == 1,
        optim: OptimConfig {
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
            grad_clip: a.grad_clip,
        },
        skip_loss_z: a.skip_loss_z,
        skip_grad_z: a.skip_grad_z,
        seed: a.seed,
        shuffle: !a.no_shuffle,
        save_dtype: match &a.save_dtype {
            Some(d) => parse_dtype(d)?,
            None if a.precision == llmrs::core::config::Precision::Bf16 => Dtype::BF16,
            None => Dtype::F32,
        },
        precision: a.precision,
        master_weights: match a.master_weights {
            0 => false,
            1 => true,
            w => bail!("-w {w}: use 1 (fp32 master weights, the default) or 0 (bf16 parameters only)"),
        },
        hellaswag: a.hellaswag == 1,
        hellaswag_data: a.hellaswag_data,
        hellaswag_limit: a.hellaswag_limit,
        zero_stage: a.zero_stage,
        recompute: a.recompute,
        ce_rows: a.ce_rows,
        lora: a.lora,
        lora_alpha: a.lora_alpha,
        lora_targets: a.lora_targets,
        lora_from: a.lora_from,
        overwrite: a.overwrite,
        quiet: false,
        device,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// `llmrs` with no command: the default training run, preparing its data first if needed.
pub fn default_run(device: llmrs::backend::Device) -> Result<()> {
    let cfg = TrainConfig { device, ..TrainConfig::default() };
    ensure_default_data(&cfg)?;
    llmrs::train::run(&cfg).map(|_| ())
}

pub fn run(a: TrainArgs, device: llmrs::backend::Device, mut comm: Comm) -> Result<()> {
    let cfg = train_config(a, device)?;
    if comm.rank() == 0 {
        ensure_default_data(&cfg)?;
    }
    comm.barrier()?; // the other ranks wait for the data rank 0 prepares
    llmrs::train::run_with(&cfg, comm).map(|_| ())
}

/// The default run's data: prepare Tiny Shakespeare if the default shards are missing.
pub fn ensure_default_data(cfg: &TrainConfig) -> Result<()> {
    let def = TrainConfig::default();
    let missing = |p: &str| !Path::new(p).exists();
    if (cfg.train_data == def.train_data && missing(&cfg.train_data))
        || (cfg.val_data == def.val_data && missing(&cfg.val_data))
    {
        eprintln!("preparing Tiny Shakespeare into {TINYSHAKESPEARE_DIR} (first run)");
        prepare_tinyshakespeare(&Source::from_env(None), Path::new(TINYSHAKESPEARE_DIR))?;
    }
    Ok(())
}

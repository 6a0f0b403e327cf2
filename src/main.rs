//! The `llmrs` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use llmrs::files::Dtype;
use llmrs::generate::SamplerConfig;
use llmrs::optim::OptimConfig;
use llmrs::prepare::{prepare_tinyshakespeare, Source};
use llmrs::train::{run, TrainConfig};
use std::path::{Path, PathBuf};

/// Large blocks page-aligned from the OS ([`llmrs::mem::PageAligned`]).
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: llmrs::mem::PageAligned = llmrs::mem::PageAligned;

/// Where `prepare tinyshakespeare` writes by default, and where the default run's data lives.
const TINYSHAKESPEARE_DIR: &str = "data/tinyshakespeare";

#[derive(Parser)]
#[command(name = "llmrs", version, about = "GPT-2 and Llama training from scratch in pure Rust (llm.c compatible)")]
struct Cli {
    /// Worker threads (default: all cores; under mpirun, the cores this process may use
    /// divided among the ranks on its machine).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Under mpirun: seconds one collective may wait for the other ranks before this process
    /// stops with an error (a rank died or hangs).
    #[arg(long, global = true, default_value_t = 600)]
    comm_timeout: u64,
    /// Where the model runs: cpu, or gpu (the best adapter: Metal, Vulkan or DX12) or gpu:N
    /// (the N-th of `llmrs devices`).
    #[arg(long, global = true, default_value = "cpu")]
    device: llmrs::backend::Device,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once
enum Cmd {
    /// Train or fine-tune a GPT-2 or Llama model (llm.c train_gpt2.cu flags). With no arguments:
    /// a small GPT-2 on Tiny Shakespeare, preparing the data first if needed.
    Train(TrainArgs),
    /// Turn text into llm.c token shards.
    #[command(subcommand)]
    Prepare(PrepareCmd),
    /// Plot training curves from one or more log.jsonl files (PNG and SVG).
    Plot {
        #[arg(required = true)]
        logs: Vec<PathBuf>,
        /// Output path without extension: writes OUT.png and OUT.svg.
        #[arg(short, long, default_value = "curves")]
        out: PathBuf,
    },
    /// Time training steps (forward, backward, AdamW) on random tokens: ms/step, tokens/s, MFU
    /// against the measured fp32 peak, peak memory, and where the time goes.
    Bench {
        /// Model descriptor or file.
        #[arg(short = 'e', long = "model", default_value = "d12")]
        model: String,
        #[arg(short = 'b', long = "batch-size", default_value_t = 4)]
        batch_size: usize,
        #[arg(short = 't', long = "seq-len", default_value_t = 64)]
        seq_len: usize,
        /// Measured steps.
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Unmeasured warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// ZeRO stage when launched by mpirun (0-3, as train's -z).
        #[arg(short = 'z', long = "zero-stage", default_value_t = 0)]
        zero_stage: usize,
        /// Recompute in the backward (as train's -r): 0 none, 1 the MLP activation, 2 + the norms' outputs.
        #[arg(short = 'r', long = "recompute", default_value_t = D.with(|d| d.recompute))]
        recompute: u8,
        /// Rows of logits the classifier computes at once (as train's --ce-rows; 0 = all).
        #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
        ce_rows: usize,
        /// LoRA adapters of this rank, alpha twice it (as train's --lora; 0 = every weight trains).
        #[arg(long = "lora", default_value_t = 0)]
        lora: usize,
        /// The projections LoRA adapts (as train's --lora-targets).
        #[arg(long = "lora-targets", value_delimiter = ',')]
        lora_targets: Vec<String>,
        /// fp32 or bf16 (as train's --precision).
        #[arg(long, default_value_t = D.with(|d| d.precision))]
        precision: llmrs::config::Precision,
        /// With bf16: 1 = fp32 master weights, 0 = none (as train's -w).
        #[arg(short = 'w', long = "master-weights", default_value_t = 1)]
        master_weights: u8,
    },
    /// Evaluate a model.
    #[command(subcommand)]
    Eval(EvalCmd),
    /// List the GPU adapters `--device gpu:N` can use (backend, name, limits).
    Devices,
    /// Generate text from a prompt, streaming it as it is produced (KV-cached).
    Generate(GenArgs),
    /// Convert a model between llm.c .bin and Hugging Face safetensors. OUT ending in .bin is an
    /// llm.c model file; anything else is a directory with model.safetensors + config.json.
    Convert(ConvertArgs),
}

#[derive(Subcommand)]
enum PrepareCmd {
    /// Tiny Shakespeare as llm.c's dev/data/tinyshakespeare.py (from --input, $LLMRS_DATA_DIR, or
    /// downloaded from its public home).
    Tinyshakespeare {
        /// A local copy of input.txt.
        #[arg(long)]
        input: Option<PathBuf>,
        #[arg(short, long, default_value = TINYSHAKESPEARE_DIR)]
        out: PathBuf,
    },
    /// UTF-8 text files, one document each, into train/val shards.
    Text {
        files: Vec<PathBuf>,
        #[arg(short, long, default_value = "data/text")]
        out: PathBuf,
        /// Tokens for the validation shard [default: 32768 (llm.c's), or a tenth of an input
        /// of fewer than ten times that].
        #[arg(long)]
        val_tokens: Option<usize>,
        /// Tokenize with this tokenizer.json (a file, a model directory, or hf:owner/name) instead
        /// of GPT-2's.
        #[arg(long)]
        tokenizer: Option<String>,
    },
    /// FineWeb or FineWeb-Edu as llm.c's dev/data/fineweb.py: local .parquet/.jsonl files, or
    /// (with none given) the sample's parquet files downloaded from the Hugging Face Hub.
    Fineweb {
        files: Vec<PathBuf>,
        /// FineWeb-Edu instead of FineWeb.
        #[arg(long)]
        edu: bool,
        /// Which sample to download: 10B or 100B.
        #[arg(long, default_value = "10B")]
        version: String,
        /// Download only the first N parquet files of the sample.
        #[arg(long)]
        max_files: Option<usize>,
        /// Output directory (default: data/fineweb10B, data/edu_fineweb10B, ...).
        #[arg(short, long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        shards: ShardArgs,
    },
    /// TinyStories: its .json files (arrays of {"story": ...}), or with none given the parquet files
    /// of roneneldan/TinyStories from the Hub (validation first).
    Tinystories {
        files: Vec<PathBuf>,
        #[arg(short, long, default_value = "data/tinystories")]
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
    },
    /// HellaSwag validation set into llm.c's eval file (from --input, $LLMRS_DATA_DIR, or downloaded).
    Hellaswag {
        /// HellaSwag JSON lines (hellaswag_val.jsonl).
        #[arg(long)]
        input: Option<PathBuf>,
        #[arg(short, long, default_value = "data/hellaswag")]
        out: PathBuf,
    },
    /// Any documents (.parquet with a text column, .jsonl or .json with "text") into shards.
    Docs {
        files: Vec<PathBuf>,
        /// Shard name prefix: NAME_val_000000.bin, NAME_train_000001.bin, ...
        #[arg(long, default_value = "docs")]
        name: String,
        #[arg(short, long, default_value = "data/docs")]
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
    },
}

#[derive(Subcommand)]
enum EvalCmd {
    /// HellaSwag accuracy as llm.c's dev/data/hellaswag.py computes it.
    Hellaswag {
        /// Model: llm.c .bin, Hugging Face directory or .safetensors, hf:owner/name, or a descriptor.
        #[arg(short = 'e', long = "model", required_unless_present = "hf")]
        model: Option<String>,
        #[arg(long)]
        hf: Option<String>,
        /// HellaSwag JSON lines or llm.c's hellaswag_val.bin (default: data/hellaswag/hellaswag_val.bin,
        /// else $LLMRS_DATA_DIR/hellaswag/hellaswag_val.preprocessed.jsonl).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Score only the first N examples.
        #[arg(long)]
        limit: Option<usize>,
        /// The tokenizer (a tokenizer.json, a model directory, hf:owner/name, or gpt2); default: the
        /// model's own tokenizer.json, else GPT-2's. A .bin eval file is already tokenized (GPT-2).
        #[arg(long)]
        tokenizer: Option<String>,
        /// LoRA adapters on top of the model (a PEFT adapter directory or a LoRA checkpoint).
        #[arg(long)]
        lora: Option<PathBuf>,
        /// Rows of logits the classifier computes at once (as train's --ce-rows; 0 = all):
        /// the losses are the same bits, the logits buffer that much smaller.
        #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
        ce_rows: usize,
        /// fp32 or bf16 (bf16 weights and activations, ops in fp32; as train's --precision).
        #[arg(long, default_value_t = D.with(|d| d.precision))]
        precision: llmrs::config::Precision,
    },
}

#[derive(Args)]
#[command(allow_negative_numbers = true)]
struct GenArgs {
    /// Model: llm.c .bin, Hugging Face directory or .safetensors, or hf:owner/name.
    #[arg(short = 'e', long = "model", required_unless_present = "hf")]
    model: Option<String>,
    /// Model from the Hugging Face Hub: owner/name[@revision].
    #[arg(long)]
    hf: Option<String>,
    /// Text to continue ("" starts from the document-start token, <|endoftext|> for GPT-2).
    #[arg(short, long, default_value = "")]
    prompt: String,
    /// The tokenizer (a tokenizer.json, a model directory, hf:owner/name, or gpt2); default: the
    /// model's own tokenizer.json, else GPT-2's.
    #[arg(long)]
    tokenizer: Option<String>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = SamplerConfig::default().temperature)]
    temperature: f32,
    /// Sample among the k most likely tokens only (0 = all).
    #[arg(long, default_value_t = SamplerConfig::default().top_k)]
    top_k: usize,
    /// Sample among the most likely tokens that make up probability p (1 = all).
    #[arg(long, default_value_t = SamplerConfig::default().top_p)]
    top_p: f32,
    /// Random seed: the same seed gives the same text.
    #[arg(long, default_value_t = SamplerConfig::default().seed)]
    seed: u64,
    /// Recompute the whole prefix for every token instead of using the KV cache.
    #[arg(long)]
    no_cache: bool,
    /// Keep going after <|endoftext|>.
    #[arg(long)]
    no_stop: bool,
    /// LoRA adapters on top of the model: a PEFT adapter directory or a LoRA run's checkpoint
    /// (merged into the weights at load, as PEFT's merge_and_unload).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// With --no-cache: rows of logits computed at once (as train's --ce-rows; 0 = all).
    #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
    ce_rows: usize,
    /// fp32 or bf16 (bf16 weights, KV cache and activations, ops in fp32; as train's --precision).
    #[arg(long, default_value_t = D.with(|d| d.precision))]
    precision: llmrs::config::Precision,
}

#[derive(Args)]
struct ConvertArgs {
    /// INPUT OUTPUT, or only OUTPUT with --hf. INPUT: llm.c .bin, HF directory or .safetensors,
    /// a LoRA run's checkpoint (written as PEFT's adapter files, or merged with --merge), or a
    /// descriptor such as d12 for random init. OUTPUT: *.bin for llm.c's format, else a
    /// directory (a Hugging Face model, with the tokenizer and generation files of INPUT or
    /// its base, or a PEFT adapter).
    #[arg(required = true, num_args = 1..=2, value_names = ["INPUT", "OUTPUT"])]
    paths: Vec<String>,
    /// Take the input from the Hugging Face Hub: owner/name[@revision].
    #[arg(long)]
    hf: Option<String>,
    /// Output precision: fp32 or bf16 (the weights, or a PEFT adapter's).
    #[arg(long, default_value = dtype_name(Dtype::F32))]
    dtype: String,
    /// Seed when the input is a descriptor for random init (e.g. d12) [default: 42; with
    /// --lora CKPT or --merge CKPT, the seed its base was drawn with].
    #[arg(long)]
    seed: Option<u32>,
    /// INPUT is a LoRA run's checkpoint: write the merged model (base + adapters) instead
    /// of the PEFT adapter directory.
    #[arg(long)]
    merge: bool,
    /// Merge these LoRA adapters (a PEFT directory or LoRA checkpoint) into INPUT.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Replace an existing OUTPUT (a .bin, or a directory's model or adapter files; the files
    /// of the old model that the new one lacks are removed). Without it an existing OUTPUT is
    /// refused. What the conversion reads is never replaced.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args)]
struct ShardArgs {
    /// Tokens per shard (llm.c: 10^8).
    #[arg(long, default_value_t = 100_000_000)]
    shard_size: usize,
    /// Tokenize with this tokenizer.json (a file, a model directory, or hf:owner/name) instead of
    /// GPT-2's; a vocabulary past 16 bits writes uint32 shards (llm.c's llama3 format).
    #[arg(long)]
    tokenizer: Option<String>,
}

thread_local! {
    /// The one place defaults live is `TrainConfig::default()`; the flags read them from here.
    static D: TrainConfig = TrainConfig::default();
}

/// Flags follow llm.c's train_gpt2.cu; defaults differ only where the default run needs a
/// smaller setup (marked "default run"). Negative values may follow a flag after a space
/// (`-l -1`), so that they reach the validation and its message rather than a parse error.
#[derive(Args)]
#[command(disable_help_flag = true, allow_negative_numbers = true)]
struct TrainArgs {
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
    /// Train data: shard file or glob pattern.
    #[arg(short = 'i', long = "train-data", default_value_t = D.with(|d| d.train_data.clone()))]
    train_data: String,
    /// Val data: shard file or glob pattern ("" for none: no validation; -v 0 does not read it).
    #[arg(short = 'j', long = "val-data", default_value_t = D.with(|d| d.val_data.clone()))]
    val_data: String,
    /// Model to start from: an llm.c .bin, a Hugging Face directory or hf:owner/name, or a
    /// descriptor for random init: GPT-2 d6 d12 d24 d36 d48, gpt2, gpt2-medium, gpt2-large,
    /// gpt2-xl, tiny, LxC:NH[:maxT]; Llama llama:smollm2-135m, llama:smollm2-360m,
    /// llama:smollm2-1.7b, llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b,
    /// llama:LxC:NH:KV[:F[:maxT]]; Qwen qwen2:qwen2.5-0.5b, qwen2:qwen2.5-1.5b, qwen3:qwen3-0.6b,
    /// qwen3:qwen3-1.7b, qwen2:LxC:NH:KV[:F[:maxT]], qwen3:LxC:NH:KV:HS[:F[:maxT]]. Default run:
    /// tiny (llm.c: gpt2_124M_bf16.bin).
    #[arg(short = 'e', long = "model")]
    model: Option<String>,
    /// Output directory for the log and checkpoints ("" for none). Default run: out (llm.c: none).
    #[arg(short = 'o', long = "output-dir", default_value_t = D.with(|d| d.output_dir.as_ref().map_or(String::new(), |p| p.display().to_string())))]
    output_dir: String,
    /// Write a checkpoint every N steps (0 = never).
    #[arg(short = 'n', long = "checkpoint-every", default_value_t = D.with(|d| d.checkpoint_every))]
    checkpoint_every: usize,
    /// Keep only the last N checkpoints (0 = all). llm.c: -nk.
    #[arg(long = "checkpoints-keep", default_value_t = D.with(|d| d.checkpoints_keep))]
    checkpoints_keep: usize,
    /// Checkpoints at multiples of N are never deleted. llm.c: -nm.
    #[arg(long = "major-checkpoint-every", default_value_t = D.with(|d| d.major_checkpoint_every))]
    major_checkpoint_every: usize,
    /// 1 = resume from the latest checkpoint in the output directory.
    #[arg(short = 'y', long = "resume", default_value_t = 0)]
    resume: u8,
    /// Micro-batch size B.
    #[arg(short = 'b', long = "batch-size", default_value_t = D.with(|d| d.batch_size))]
    batch_size: usize,
    /// Sequence length T. Default run: 64 (llm.c: 1024).
    #[arg(short = 't', long = "seq-len", default_value_t = D.with(|d| d.seq_len))]
    seq_len: usize,
    /// Total batch size in tokens per step (gradient accumulation); default B*T.
    #[arg(short = 'd', long = "total-batch-size", default_value_t = -1)]
    total_batch_size: i64,
    /// Learning rate. Default run: 1e-3 (llm.c: 3e-4).
    #[arg(short = 'l', long = "lr", default_value_t = D.with(|d| d.learning_rate))]
    learning_rate: f32,
    /// Warmup steps. Default run: 20 (llm.c: 0).
    #[arg(short = 'u', long = "warmup", default_value_t = D.with(|d| d.warmup))]
    warmup: usize,
    /// Final learning-rate fraction. Default run: 0.1 (llm.c: 1.0).
    #[arg(short = 'q', long = "final-lr-frac", default_value_t = D.with(|d| d.final_lr_frac))]
    final_lr_frac: f32,
    /// Learning-rate schedule: cosine, linear, constant, wsd.
    #[arg(short = 'k', long = "schedule", default_value_t = D.with(|d| d.schedule.to_string()))]
    schedule: String,
    /// Weight decay (2-D weights only).
    #[arg(short = 'c', long = "weight-decay", default_value_t = D.with(|d| d.optim.weight_decay))]
    weight_decay: f32,
    /// Steps to train (-1 = one epoch). Default run: 500 (llm.c: -1).
    #[arg(short = 'x', long = "max-steps", default_value_t = D.with(|d| d.max_steps.map_or(-1, |x| x as i64)), allow_negative_numbers = true)]
    max_steps: i64,
    /// Validate every N steps (0 = never). Default run: 50 (llm.c: 20).
    #[arg(short = 'v', long = "val-every", default_value_t = D.with(|d| d.val_every))]
    val_every: usize,
    /// Validation batches (-1 = the whole val split).
    #[arg(short = 'm', long = "val-max-steps", default_value_t = D.with(|d| d.val_max_steps.map_or(-1, |x| x as i64)), allow_negative_numbers = true)]
    val_max_steps: i64,
    /// Sample text every N steps (0 = never). Default run: 100 (llm.c: 20).
    #[arg(short = 's', long = "sample-every", default_value_t = D.with(|d| d.sample_every))]
    sample_every: usize,
    /// Tokens to generate per sample.
    #[arg(short = 'g', long = "gen-tokens", default_value_t = D.with(|d| d.gen_tokens))]
    gen_tokens: usize,
    /// 1 = overfit a single batch (debugging).
    #[arg(short = 'a', long = "overfit-single-batch", default_value_t = 0)]
    overfit: u8,
    /// Seed for random init.
    #[arg(long, default_value_t = D.with(|d| d.seed))]
    seed: u32,
    /// Clip the global gradient norm to this (0 disables).
    #[arg(long = "grad-clip", default_value_t = D.with(|d| d.optim.grad_clip))]
    grad_clip: f32,
    /// Skip the update when the loss's z-score over the last 128 steps exceeds this (0 = off). llm.c: -sl.
    #[arg(long = "skip-loss-z", default_value_t = D.with(|d| d.skip_loss_z))]
    skip_loss_z: f32,
    /// Skip the update when the gradient norm's z-score exceeds this (0 = off). llm.c: -sg.
    #[arg(long = "skip-grad-z", default_value_t = D.with(|d| d.skip_grad_z))]
    skip_grad_z: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.beta1))]
    beta1: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.beta2))]
    beta2: f32,
    #[arg(long, default_value_t = D.with(|d| d.optim.eps))]
    eps: f32,
    /// Delete the checkpoints of an earlier run in the output directory (else a fresh run there is refused).
    #[arg(long)]
    overwrite: bool,
    /// Read training batches in order instead of llm.c's shuffled order.
    #[arg(long = "no-shuffle")]
    no_shuffle: bool,
    /// Checkpoint model dtype: fp32 or bf16 (default: the run's precision).
    #[arg(long = "save-dtype")]
    save_dtype: Option<String>,
    /// Precision (llm.c's build setting): fp32, or bf16 (parameters, gradients and activations
    /// in bf16, every op computing in fp32; README: Precision), on the CPU and the GPU.
    #[arg(long, default_value_t = D.with(|d| d.precision))]
    precision: llmrs::config::Precision,
    /// With bf16: 1 = keep fp32 master weights that AdamW updates (llm.c -w), 0 = AdamW rounds
    /// its updates into the bf16 parameters stochastically (less memory).
    #[arg(short = 'w', long = "master-weights", default_value_t = D.with(|d| d.master_weights as u8))]
    master_weights: u8,
    /// Start from a model on the Hugging Face Hub (owner/name[@revision]) instead of -e.
    #[arg(long)]
    hf: Option<String>,
    /// 1 = HellaSwag accuracy at every validation step (llm.c -h).
    #[arg(short = 'h', long = "hellaswag", default_value_t = 0)]
    hellaswag: u8,
    /// HellaSwag file for -h 1: JSON lines or llm.c's hellaswag_val.bin.
    #[arg(long)]
    hellaswag_data: Option<PathBuf>,
    /// Score only the first N HellaSwag examples during training.
    #[arg(long)]
    hellaswag_limit: Option<usize>,
    /// ZeRO stage over the processes of an `mpirun` launch (llm.c -z): 0 = gradients
    /// all-reduced, 1 = AdamW state sharded, 2 = + gradients, 3 = + parameters.
    #[arg(short = 'z', long = "zero-stage", default_value_t = D.with(|d| d.zero_stage))]
    zero_stage: usize,
    /// Recompute in the backward instead of keeping per layer (llm.c -r): 0 none, 1 the MLP
    /// activation (GELU, SwiGLU), 2 + the norms' outputs. Same losses bit for bit; less memory.
    /// (Attention never keeps its probabilities: its backward rebuilds them at every level.)
    #[arg(short = 'r', long = "recompute", default_value_t = D.with(|d| d.recompute))]
    recompute: u8,
    /// Rows of logits the classifier (head, cross-entropy, their backward) computes at once,
    /// instead of all B*T: less memory, most for large vocabularies; chunks of fewer than about
    /// 1024 rows cost speed. 0 = all at once; else at least 3.
    #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
    ce_rows: usize,
    /// LoRA: train adapters of this rank on the projections instead of every weight; the base
    /// model is frozen (no gradients, no AdamW state). 0 = full fine-tune.
    #[arg(long = "lora", default_value_t = 0)]
    lora: usize,
    /// LoRA's alpha (the adapters' scale is alpha / rank). Default: twice the rank.
    #[arg(long = "lora-alpha")]
    lora_alpha: Option<f32>,
    /// The projections LoRA adapts, as PEFT's target_modules (comma-separated last names such
    /// as q_proj,v_proj, or c_attn for GPT-2). Default: all-linear, every projection of a block.
    #[arg(long = "lora-targets", value_delimiter = ',')]
    lora_targets: Vec<String>,
    /// Go on from a PEFT adapter directory (its adapter_config.json gives rank, alpha and
    /// targets) or a LoRA checkpoint, on top of -e.
    #[arg(long = "lora-from")]
    lora_from: Option<PathBuf>,
}

/// llm.c spells some flags with two letters after one dash (-nk, -nm, -sl, -sg); map them to long names.
/// GPU-only llm.c flags are accepted and ignored on the CPU, with a note. (`-w`, master
/// weights, is not one of them: llmrs's bf16 runs honour it on every device.)
fn translate_llmc_args(args: Vec<String>) -> Vec<String> {
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
fn check_train_flags(a: &TrainArgs) -> Result<()> {
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

fn train_config(a: TrainArgs, device: llmrs::backend::Device) -> Result<TrainConfig> {
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
            None if a.precision == llmrs::config::Precision::Bf16 => Dtype::BF16,
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

/// `spec`'s weights, with `--lora`'s adapters merged in (a LoRA checkpoint's random base drawn
/// with its own seed unless `seed_given`).
fn load_with_lora(spec: &str, seed: u32, seed_given: bool, lora: Option<&Path>) -> Result<llmrs::params::Weights> {
    match lora {
        Some(p) => llmrs::lora::load_merged(spec, seed, seed_given, p),
        None => llmrs::source::load_any(spec, seed),
    }
}

/// `spec`'s model on `device` in `precision`, with `--lora`'s adapters merged in. Without
/// adapters a descriptor's random weights are drawn, and a Hugging Face checkpoint's read, into
/// the model once its precision is set, so that a bf16 model's fp32 values never exist whole.
fn open_model(
    spec: &str,
    seed: u32,
    lora: Option<&Path>,
    device: llmrs::backend::Device,
    precision: llmrs::config::Precision,
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
fn model_spec(hf: Option<String>, model: Option<String>) -> Result<String> {
    Ok(match (hf, model) {
        (Some(h), _) => format!("hf:{h}"),
        (None, Some(m)) => m,
        (None, None) => bail!("give a model with -e or --hf"),
    })
}

fn cmd_generate(a: GenArgs, device: llmrs::backend::Device) -> Result<()> {
    use llmrs::generate::{generate, GenConfig, Utf8Stream};
    use std::io::Write;
    let sampler = SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed };
    sampler.validate()?; // before loading (or downloading) anything
    let spec = model_spec(a.hf, a.model)?;
    let mut model = open_model(&spec, 0, a.lora.as_deref(), device, a.precision)?;
    model.set_classifier_rows(a.ce_rows)?;
    let tok = llmrs::source::tokenizer_for_text(a.tokenizer.as_deref(), &spec, model.config.vocab_size)?;
    let prompt = if a.prompt.is_empty() { vec![tok.doc_start] } else { tok.encode(&a.prompt)? };
    // The model's own end tokens (generation_config.json, config.json), else the tokenizer's.
    let stop_tokens = match llmrs::source::eos_tokens(&spec)? {
        Some(ids) => ids,
        None => match a.tokenizer.as_deref().map(llmrs::source::eos_tokens).transpose()?.flatten() {
            Some(ids) => ids,
            None => vec![tok.eot],
        },
    };
    let max_t = model.config.max_seq_len;
    llmrs::generate::check_prompt(prompt.len(), max_t)?; // before the prompt is printed
    if prompt.len().saturating_add(a.max_new_tokens) > max_t {
        eprintln!(
            "note: the model's context is {max_t} positions: after the {}-token prompt, at most {} new tokens (-n {})",
            prompt.len(),
            max_t - prompt.len(),
            a.max_new_tokens
        );
    }
    let g = GenConfig {
        max_new_tokens: a.max_new_tokens,
        sampler,
        stop_tokens: if a.no_stop { vec![] } else { stop_tokens },
        use_cache: !a.no_cache,
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", a.prompt)?;
    let mut utf8 = Utf8Stream::default();
    let t0 = std::time::Instant::now();
    let mut first: Option<f64> = None;
    let new = generate(&mut model, &prompt, &g, |t| {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        write!(out, "{}", utf8.push(tok.token_bytes(t)))?;
        out.flush()?;
        Ok(())
    })?;
    writeln!(out, "{}", utf8.finish())?;
    let secs = t0.elapsed().as_secs_f64();
    let first = first.unwrap_or(secs);
    let stopped = new.last().is_some_and(|t| g.stop_tokens.contains(t));
    // The first token includes reading the prompt; the rest is one token each.
    eprintln!(
        "{} prompt + {} new tokens in {secs:.2}s ({}{}): first token after {first:.3}s, then {:.2} tokens/s",
        prompt.len(),
        new.len(),
        if g.use_cache { "KV cache" } else { "no cache" },
        if stopped { ", stopped at an end token" } else { "" },
        (new.len().saturating_sub(1)) as f64 / (secs - first).max(1e-9),
    );
    Ok(())
}

/// A model dtype as the command line names it; `parse_dtype` reads it back.
fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "fp32",
        Dtype::BF16 => "bf16",
    }
}

fn parse_dtype(d: &str) -> Result<Dtype> {
    Ok(match d {
        "fp32" | "f32" | "float32" => Dtype::F32,
        "bf16" | "bfloat16" => Dtype::BF16,
        _ => bail!("unknown dtype '{d}': use fp32 or bf16"),
    })
}

/// The default run's data: prepare Tiny Shakespeare if the default shards are missing.
fn ensure_default_data(cfg: &TrainConfig) -> Result<()> {
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

fn main() {
    // std::env::args panics on an argument that is not UTF-8; say which one instead.
    let mut args = vec![];
    for (i, a) in std::env::args_os().enumerate() {
        match a.into_string() {
            Ok(a) => args.push(a),
            Err(a) => {
                eprintln!("error: argument {i} ({}) is not valid UTF-8 text", a.to_string_lossy());
                std::process::exit(1);
            }
        }
    }
    let args = translate_llmc_args(args);
    let cli = Cli::parse_from(args);
    llmrs::backend::launch::finish(real_main(cli));
}

fn real_main(cli: Cli) -> Result<()> {
    // The processes first: under mpirun the thread team is sized by the ranks on this machine.
    let comm = llmrs::backend::launch::open(std::time::Duration::from_secs(cli.comm_timeout.max(1)))?;
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = cli.threads {
        // Many times the cores only spends time starting threads (10000 took 40 s, silently).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let most = 8 * cores.max(8);
        if n == 0 || n > most {
            bail!("--threads {n}: give 1 to {most} (this machine has {cores} cores; the default uses them all)");
        }
        pool = pool.num_threads(n);
    } else if comm.world() > 1 {
        pool = pool.num_threads(threads_per_rank(comm.local_world()));
    }
    pool.build_global().context("cannot set up the worker threads")?;
    llmrs::backend::factory::init_host()?;
    // The pool's size also sizes the host backend's thread team, made on first use. Commands run
    // on a worker of the pool: rayon's loops (data preparation) then fork from a worker that
    // takes its own share at once, instead of the main thread handing each loop to the pool and
    // sleeping until it is done.
    rayon::scope(|_| run_command(cli, comm))
}

/// Threads for one of `local` ranks on this machine: its cores shared evenly, and no more than
/// the cores this process may run on (mpirun may have bound it to some).
fn threads_per_rank(local: usize) -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: sysconf only reads a system setting.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    (online / local.max(1)).min(allowed).max(1)
}

type Comm = Box<dyn llmrs::backend::comm::Collectives>;

fn run_command(cli: Cli, comm: Comm) -> Result<()> {
    let device = cli.device;
    if comm.world() > 1 && !matches!(cli.cmd, Some(Cmd::Train(_)) | Some(Cmd::Bench { .. })) {
        bail!("only `llmrs train` and `llmrs bench` run as several processes; run this command without mpirun");
    }
    match cli.cmd {
        None => cmd_default_run(device),
        Some(Cmd::Train(a)) => cmd_train(a, device, comm),
        Some(Cmd::Prepare(p)) => cmd_prepare(p),
        Some(Cmd::Generate(a)) => cmd_generate(a, device),
        Some(Cmd::Bench {
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
        }) => {
            if batch_size == 0 || seq_len == 0 {
                bail!("-b {batch_size} -t {seq_len}: the batch size and sequence length must be at least 1");
            }
            if steps == 0 {
                bail!("--steps 0: measure at least 1 step");
            }
            if master_weights > 1 {
                bail!("-w {master_weights}: use 1 (fp32 master weights, the default) or 0 (bf16 parameters only)");
            }
            let cfg = llmrs::bench::BenchConfig {
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
            cmd_bench(&cfg, json, comm)
        }
        Some(Cmd::Devices) => cmd_devices(),
        Some(Cmd::Plot { logs, out }) => cmd_plot(&logs, &out),
        Some(Cmd::Eval(e)) => cmd_eval(e, device),
        Some(Cmd::Convert(c)) => cmd_convert(c),
    }
}

/// `llmrs` with no command: the default training run, preparing its data first if needed.
fn cmd_default_run(device: llmrs::backend::Device) -> Result<()> {
    let cfg = TrainConfig { device, ..TrainConfig::default() };
    ensure_default_data(&cfg)?;
    run(&cfg).map(|_| ())
}

fn cmd_train(a: TrainArgs, device: llmrs::backend::Device, mut comm: Comm) -> Result<()> {
    let cfg = train_config(a, device)?;
    if comm.rank() == 0 {
        ensure_default_data(&cfg)?;
    }
    comm.barrier()?; // the other ranks wait for the data rank 0 prepares
    llmrs::train::run_with(&cfg, comm).map(|_| ())
}

fn cmd_bench(cfg: &llmrs::bench::BenchConfig, json: bool, comm: Comm) -> Result<()> {
    let r = llmrs::bench::run_with(cfg, comm)?;
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

fn cmd_devices() -> Result<()> {
    let lines = llmrs::gpu::describe_adapters();
    if lines.is_empty() {
        println!("no GPU adapters found (looked for {}); --device cpu runs on the CPU", llmrs::gpu::LOOKED_FOR);
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

fn cmd_plot(logs: &[PathBuf], out: &Path) -> Result<()> {
    let runs = logs.iter().map(|p| llmrs::plot::read_log(p)).collect::<Result<Vec<_>>>()?;
    let (png, svg) = llmrs::plot::plot(&runs, out)?;
    eprintln!("wrote {} and {}", png.display(), svg.display());
    Ok(())
}

fn cmd_eval(e: EvalCmd, device: llmrs::backend::Device) -> Result<()> {
    let EvalCmd::Hellaswag { model, hf, data, limit, tokenizer, lora, ce_rows, precision } = e;
    if limit == Some(0) {
        bail!("--limit 0: score at least 1 example");
    }
    let spec = model_spec(hf, model)?;
    let mut model = open_model(&spec, 42, lora.as_deref(), device, precision)?;
    model.set_classifier_rows(ce_rows)?;
    let tok = llmrs::source::tokenizer_for_text(tokenizer.as_deref(), &spec, model.config.vocab_size)?;
    let data = match data {
        Some(d) => d,
        None => llmrs::train::default_hellaswag_path(tok.is_gpt2())?,
    };
    let mut ex = llmrs::hellaswag::load(&data, &tok)?;
    if let Some(n) = limit {
        ex.truncate(n);
    }
    let bar = llmrs::progress::bar(ex.len() as u64, "hellaswag");
    let scored = llmrs::hellaswag::score(&mut model, &ex, |d| bar.set_position(d as u64))?;
    bar.finish_and_clear();
    let (c, cn, n) = llmrs::hellaswag::accuracy(&scored);
    for (name, k) in [("acc", c), ("acc_norm", cn)] {
        let (lo, hi) = llmrs::hellaswag::wilson(k, n);
        println!("{name:8} {k}/{n} = {:.4}  (95% CI {lo:.4}..{hi:.4})", k as f64 / n as f64);
    }
    Ok(())
}

fn cmd_convert(c: ConvertArgs) -> Result<()> {
    let ConvertArgs { paths, hf, dtype, seed, merge, lora, overwrite } = c;
    let (seed_given, seed) = (seed.is_some(), seed.unwrap_or(42));
    let dtype = parse_dtype(&dtype)?;
    let (spec, output) = match (hf, &paths[..]) {
        (Some(h), [out]) => (format!("hf:{h}"), PathBuf::from(out)),
        (None, [input, out]) => (input.clone(), PathBuf::from(out)),
        (Some(_), _) => bail!("with --hf, give only the output path: llmrs convert --hf owner/name OUT"),
        (None, _) => bail!("give the input model and the output path: llmrs convert IN OUT"),
    };
    let is_bin = output.extension().is_some_and(|e| e == "bin");
    let input = Path::new(&spec);
    let ckpt = llmrs::lora::is_checkpoint(input);
    let in_dir = |names: &[&str]| names.iter().map(|n| output.join(n)).collect::<Vec<_>>();
    let written = if is_bin {
        vec![output.clone()]
    } else if ckpt && !merge {
        in_dir(&[llmrs::lora::CONFIG_FILE, llmrs::lora::WEIGHTS_FILE])
    } else {
        in_dir(&["model.safetensors", "config.json"])
    };
    check_convert_output(input, lora.as_deref(), &output, &written)?;
    if ckpt && lora.is_some() {
        bail!(
            "{spec} holds LoRA adapters and --lora names more: give --merge {spec} for its own merged model, \
             or its base as INPUT with --lora"
        );
    }
    if ckpt && !merge && is_bin {
        bail!("{spec} holds LoRA adapters: give a directory for PEFT's adapter files, or --merge for the merged model");
    }
    if merge && lora.is_none() && !ckpt {
        bail!("--merge merges a LoRA run's checkpoint into its base: {spec} is not one (or give --lora DIR)");
    }
    let old = old_outputs(&output, is_bin, overwrite)?;
    if ckpt && !merge {
        // A LoRA run's checkpoint: its adapters as a PEFT adapter directory.
        let (cfg, a, base) = llmrs::lora::load_checkpoint(input)?;
        let name = base.source.strip_prefix("hf:").unwrap_or(&base.source);
        a.save_peft(&output, name, &cfg, dtype)?;
        let removed = remove_old_outputs(&output, &old, &written)?;
        eprintln!(
            "wrote {} (PEFT LoRA adapter: rank {}, alpha {}, {} projections, {} parameters in {dtype}; base {name}){removed}",
            output.display(),
            a.r,
            a.alpha,
            a.targets.len(),
            a.num_parameters()
        );
        return Ok(());
    }
    // A LoRA checkpoint loads as its base with the adapters merged (llmrs::source::load_any).
    // The tokenizer and generation settings come from the base.
    let (weights, side_spec) = if merge && ckpt {
        let (_, _, base) = llmrs::lora::load_checkpoint(input)?;
        // With --seed, its base drawn with the seed given, checked by hash, rather than the seed ignored.
        let w = match seed_given {
            true => llmrs::lora::load_merged(&base.source, seed, true, input)?,
            false => load_with_lora(&spec, seed, false, None)?,
        };
        (w, base.source)
    } else {
        (load_with_lora(&spec, seed, seed_given, lora.as_deref())?, spec.clone())
    };
    let side = if is_bin {
        llmrs::checkpoint::save_model(&weights, &output, dtype)?;
        vec![]
    } else {
        llmrs::hf::save_hf(&weights, &output, dtype)?;
        llmrs::source::copy_side_files(&side_spec, &output, false)?
    };
    let removed = remove_old_outputs(&output, &old, &[written, side.clone()].concat())?;
    let side = match side.is_empty() {
        true => String::new(),
        false => format!("; with {} from {side_spec}", file_names(&side)),
    };
    eprintln!("wrote {} ({} parameters, {dtype}{side}){removed}", output.display(), weights.num_parameters());
    Ok(())
}

/// The files of a model or adapter directory: what `convert` writes there, and what an earlier
/// model or adapter there may have left (its shards and index, its tokenizer's files).
fn is_model_file(name: &str) -> bool {
    const NAMES: [&str; 14] = [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "adapter_config.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "added_tokens.json",
        "generation_config.json",
        "tokenizer.json",
    ];
    NAMES.contains(&name)
        || llmrs::source::SIDE_FILES.contains(&name)
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
        || (name.starts_with("pytorch_model-") && name.ends_with(".bin"))
}

/// What an existing OUTPUT holds that the conversion would replace or leave beside its own
/// files: the file OUT (an llm.c file), or a directory's model and adapter files. Refused
/// unless `overwrite`: `convert` replaces nothing without being told to.
fn old_outputs(output: &Path, is_bin: bool, overwrite: bool) -> Result<Vec<PathBuf>> {
    let o = output.display();
    let old = if is_bin {
        match std::fs::symlink_metadata(output) {
            Ok(m) if m.is_dir() => {
                bail!("OUTPUT {o} is a directory; an llm.c model file is written to a path ending in .bin")
            }
            Ok(_) => vec![output.to_path_buf()],
            Err(_) => vec![],
        }
    } else if output.is_dir() {
        let mut old: Vec<PathBuf> = std::fs::read_dir(output)
            .with_context(|| format!("cannot read the directory {o}"))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(is_model_file))
            .map(|e| e.path())
            .collect();
        old.sort();
        old
    } else if output.exists() {
        bail!("OUTPUT {o} is a file: a Hugging Face model or PEFT adapter is written to a directory (or give a path ending in .bin)")
    } else {
        vec![]
    };
    if !old.is_empty() && !overwrite {
        if is_bin {
            bail!("OUTPUT {o} exists: convert replaces nothing unless told to; pass --overwrite to replace it, or write to another path");
        }
        bail!(
            "OUTPUT {o} holds a model's or adapter's files ({}): convert replaces nothing unless told to; pass \
             --overwrite to replace them (those of the old model that the new one lacks are removed), or write to \
             another directory",
            file_names(&old)
        );
    }
    Ok(old)
}

/// After an `--overwrite` conversion: remove the files of the old model (`old`) that the new
/// one did not write, so that OUTPUT never mixes two models (an old index and shards beside
/// a new model.safetensors, another model's tokenizer). Returns a note naming them, if any.
fn remove_old_outputs(output: &Path, old: &[PathBuf], written: &[PathBuf]) -> Result<String> {
    let stale: Vec<PathBuf> = old.iter().filter(|p| !written.contains(p)).cloned().collect();
    for p in &stale {
        std::fs::remove_file(p).with_context(|| format!("cannot remove {} (of the model OUTPUT held)", p.display()))?;
    }
    Ok(match stale.is_empty() {
        true => String::new(),
        false => format!(
            "; removed what the old model in {} had and this one lacks: {}",
            output.display(),
            file_names(&stale)
        ),
    })
}

/// The file names of `paths`, comma-separated.
fn file_names(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned())).collect();
    names.join(", ")
}

/// Refuse an OUTPUT that would replace what the conversion reads or what a run still needs:
/// one of the files it writes (`written`: OUT itself, or the files it puts in the directory
/// OUT) is INPUT, the `--lora` adapters or the base of a LoRA checkpoint among them, or an
/// existing file inside one of those that is a directory (a Hugging Face model or a PEFT
/// adapter); or it is a checkpoint of a training run (`model_%08d.bin` beside its state files
/// or DONE marker). Writing is atomic, so such a file would be replaced whole and its old
/// contents lost.
fn check_convert_output(input: &Path, lora: Option<&Path>, output: &Path, written: &[PathBuf]) -> Result<()> {
    let mut read = vec![(input.to_path_buf(), "INPUT")];
    read.extend(lora.map(|l| (l.to_path_buf(), "the --lora adapters")));
    for (p, _) in read.clone() {
        if p.is_file() && llmrs::lora::is_checkpoint(&p) {
            if let Ok((_, _, base)) = llmrs::lora::load_checkpoint(&p) {
                read.push((PathBuf::from(base.source), "the base of those LoRA adapters"));
            }
        }
    }
    let read: Vec<_> =
        read.into_iter().filter_map(|(p, what)| Some((std::fs::canonicalize(&p).ok()?, p, what))).collect();
    for w in written {
        // (A new file replaces nothing; an existing one is compared by where it really is.)
        let Ok(abs) = std::fs::canonicalize(w) else { continue };
        let hit = read.iter().find(|(r, _, _)| if r.is_dir() { abs.parent() == Some(r.as_path()) } else { abs == *r });
        if let Some((_, p, what)) = hit {
            let o = output.display();
            match w.as_path() == output {
                true => bail!(
                    "OUTPUT {o} is {what} ({}): the conversion would replace it; write to another path",
                    p.display()
                ),
                false => bail!(
                    "OUTPUT {o}: writing {} would replace {what} ({}) or a file of it; write to another path",
                    w.display(),
                    p.display()
                ),
            }
        }
        let name = w.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let step = name.strip_prefix("model_").and_then(|n| n.strip_suffix(".bin")).filter(|n| n.len() == 8);
        if let Some(step) = step.filter(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            let dir = w.parent().map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d });
            let run_file = |f: &str| dir.is_some_and(|d| d.join(f).exists());
            if run_file(&format!("DONE_{step}")) || run_file(&format!("state_{step}_00000.bin")) {
                bail!(
                    "OUTPUT {} is checkpoint {} of a training run (its state files sit beside it): write to another path",
                    w.display(),
                    step.parse::<u64>().unwrap_or(0)
                );
            }
        }
    }
    Ok(())
}

fn cmd_prepare(p: PrepareCmd) -> Result<()> {
    match p {
        PrepareCmd::Tinyshakespeare { input, out } => {
            prepare_tinyshakespeare(&Source::from_env(input.as_deref()), &out).map(|_| ())
        }
        PrepareCmd::Text { files, out, val_tokens, tokenizer } => {
            let tok = llmrs::source::choose_tokenizer(tokenizer.as_deref(), None)?;
            if files.is_empty() {
                bail!("give one or more UTF-8 text files");
            }
            llmrs::prepare::prepare_text_with(&files, &out, val_tokens, &tok).map(|_| ())
        }
        PrepareCmd::Fineweb { files, edu, version, max_files, out, shards } => {
            prepare_fineweb(files, edu, &version, max_files, out, &shards)
        }
        PrepareCmd::Tinystories { files, out, shards } => prepare_tinystories(files, &out, &shards),
        PrepareCmd::Hellaswag { input, out } => prepare_hellaswag(input.as_deref(), &out),
        PrepareCmd::Docs { files, name, out, shards } => shards.prepare(&files, &out, &name),
    }
}

impl ShardArgs {
    /// Tokenize `files` into `out`'s NAME_val/NAME_train shards.
    fn prepare(&self, files: &[PathBuf], out: &Path, name: &str) -> Result<()> {
        let tok = llmrs::source::choose_tokenizer(self.tokenizer.as_deref(), None)?;
        llmrs::corpus::prepare_corpus_with(files, out, name, self.shard_size, &tok).map(|_| ())
    }
}

fn prepare_fineweb(
    files: Vec<PathBuf>,
    edu: bool,
    version: &str,
    max_files: Option<usize>,
    out: Option<PathBuf>,
    shards: &ShardArgs,
) -> Result<()> {
    let (sample, size) = match version {
        "10B" => ("sample/10BT", "10B"),
        "100B" => ("sample/100BT", "100B"),
        v => bail!("unknown FineWeb version '{v}': use 10B or 100B"),
    };
    let (repo, name) =
        if edu { ("HuggingFaceFW/fineweb-edu", "edu_fineweb") } else { ("HuggingFaceFW/fineweb", "fineweb") };
    let out = out.unwrap_or_else(|| PathBuf::from(format!("data/{name}{size}")));
    let files = if files.is_empty() {
        let (ep, cache) = (llmrs::hub::endpoint(), llmrs::hub::cache_dir());
        llmrs::corpus::fetch_parquet_sample(repo, sample, max_files, &ep, &cache)?
    } else {
        files
    };
    shards.prepare(&files, &out, name)
}

fn prepare_tinystories(files: Vec<PathBuf>, out: &Path, shards: &ShardArgs) -> Result<()> {
    let files = if files.is_empty() {
        // The Hub's parquet export of roneneldan/TinyStories; validation first (shard 0).
        let (ep, cache) = (llmrs::hub::endpoint(), llmrs::hub::cache_dir());
        let mut got = llmrs::corpus::fetch_parquet_sample("roneneldan/TinyStories", "data", None, &ep, &cache)?;
        got.sort_by_key(|p| !p.to_string_lossy().contains("validation"));
        got
    } else {
        files
    };
    shards.prepare(&files, out, "TinyStories")
}

fn prepare_hellaswag(input: Option<&Path>, out: &Path) -> Result<()> {
    let tok = llmrs::tokenizer::Tokenizer::gpt2()?;
    let src = llmrs::prepare::hellaswag_jsonl(input, out)?;
    let ex = llmrs::hellaswag::load_jsonl(&src, &tok)?;
    let dest = out.join("hellaswag_val.bin");
    llmrs::hellaswag::write_bin(&dest, &ex)?;
    eprintln!("wrote {} examples to {}", ex.len(), dest.display());
    // The text beside the GPT-2 ids: a model with its own tokenizer scores from it.
    let text = out.join("hellaswag_val.jsonl");
    if !text.is_file() {
        llmrs::files::write_atomic(&text, &[&llmrs::files::read_file(&src)?])?;
        eprintln!("kept the examples as text in {} (for models with their own tokenizer)", text.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convert_takes_one_path_with_hf_and_two_without() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let Some(Cmd::Convert(c)) = parse(&["llmrs", "convert", "--hf", "a/b", "out.bin"]).unwrap().cmd else {
            panic!("not convert")
        };
        assert_eq!((c.paths, c.hf), (vec!["out.bin".to_string()], Some("a/b".to_string())));
        let Some(Cmd::Convert(c)) = parse(&["llmrs", "convert", "in.bin", "out_dir"]).unwrap().cmd else {
            panic!("not convert")
        };
        assert_eq!((c.paths, c.hf), (vec!["in.bin".to_string(), "out_dir".to_string()], None));
        assert!(parse(&["llmrs", "convert"]).is_err());
        assert!(parse(&["llmrs", "convert", "a", "b", "c"]).is_err());
    }

    #[test]
    fn default_flags_give_the_default_config() {
        use llmrs::schedule::ScheduleKind;
        for d in [Dtype::F32, Dtype::BF16] {
            assert_eq!(parse_dtype(dtype_name(d)).unwrap(), d);
        }
        for k in [ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Constant, ScheduleKind::Wsd] {
            assert_eq!(k.to_string().parse::<ScheduleKind>().unwrap(), k);
        }
        let Some(Cmd::Train(a)) = Cli::try_parse_from(["llmrs", "train"]).unwrap().cmd else { panic!("not train") };
        let (cfg, def) = (train_config(a, llmrs::backend::Device::Cpu).unwrap(), TrainConfig::default());
        assert_eq!((cfg.schedule, cfg.save_dtype), (def.schedule, def.save_dtype));
        let Some(Cmd::Generate(g)) = Cli::try_parse_from(["llmrs", "generate", "-e", "m"]).unwrap().cmd else {
            panic!("not generate")
        };
        let s = SamplerConfig::default();
        assert_eq!((g.temperature, g.top_k, g.top_p, g.seed), (s.temperature, s.top_k, s.top_p, s.seed));
    }
}

//! The training loop, step for step as llm.c's train_gpt2.cu: validation every `val_every`
//! steps, a text sample every `sample_every`, checkpoints every `checkpoint_every`, then one
//! optimizer step over `grad_accum` micro-batches.

pub mod bench;
pub mod checkpoint;
pub mod plot;
pub mod rundir;
pub mod schedule;
mod setup;

use crate::backend::Device;
use crate::core::files::Dtype;
use crate::core::rng::random_f32;
use crate::data::loader::DataLoader;
use crate::data::tokenizer::Tokenizer;
use crate::model::optim::{skip_limits, OptimConfig, OutlierDetector};
use crate::model::{Model, StepStats};
use crate::models::acts::KvCache;
use crate::train::rundir::RunDir;
use crate::train::schedule::{LrSchedule, ScheduleKind};
use anyhow::{bail, Context, Result};
use checkpoint::{
    checkpoint_precision, latest_checkpoint, prune_checkpoints, restore_state, resume_hint, write_checkpoint,
};
use setup::{check_fits, load_weights_and_adapters, open_output, resume_paths};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything a training run is told. Defaults are llm.c train_gpt2.cu's except where marked
/// "default run": those make `llmrs train` with no arguments a run of a few minutes on 2 CPU
/// cores (README gives the measured time).
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// -i  glob of train shards
    pub train_data: String,
    /// -j  glob of val shards
    pub val_data: String,
    /// -e  model .bin or descriptor (default run: "tiny"; llm.c: gpt2_124M_bf16.bin)
    pub model: String,
    /// -e (or --hf) was given, not defaulted: with -y 1 a run says when it names another model
    /// than the checkpoint it resumes (which is what it trains, as llm.c).
    pub model_given: bool,
    /// -o  logs and checkpoints (default run: "out"; llm.c: none)
    pub output_dir: Option<PathBuf>,
    /// -n  0 = never
    pub checkpoint_every: usize,
    /// -nk 0 = keep all
    pub checkpoints_keep: usize,
    /// -nm checkpoints at multiples of this are never deleted
    pub major_checkpoint_every: usize,
    /// -y  resume from the latest checkpoint in output_dir
    pub resume: bool,
    /// -b  micro-batch B (4)
    pub batch_size: usize,
    /// -t  T (default run: 64; llm.c: 1024)
    pub seq_len: usize,
    /// -d tokens per step (default B*T: no accumulation)
    pub total_batch_size: Option<usize>,
    /// -l  (default run: 1e-3; llm.c: 3e-4)
    pub learning_rate: f32,
    /// -u  warmup steps (default run: 20; llm.c: 0)
    pub warmup: usize,
    /// -q  final LR fraction (default run: 0.1; llm.c: 1.0)
    pub final_lr_frac: f32,
    /// -k  cosine
    pub schedule: ScheduleKind,
    /// -x  (default run: 500; llm.c: one epoch)
    pub max_steps: Option<usize>,
    /// -v  (default run: 50; llm.c: 20) 0 = never
    pub val_every: usize,
    /// -m 20 batches (None = the whole val split)
    pub val_max_steps: Option<usize>,
    /// -s  (default run: 100; llm.c: 20) 0 = never
    pub sample_every: usize,
    /// -g  64
    pub gen_tokens: usize,
    /// -a
    pub overfit_single_batch: bool,
    /// -c weight decay, --beta1/2, --eps, --grad-clip
    pub optim: OptimConfig,
    /// -sl skip the update when the loss's z-score over the last 128 steps exceeds this (0 = off)
    pub skip_loss_z: f32,
    /// -sg the same for the gradient norm (0 = off)
    pub skip_grad_z: f32,
    /// --seed for random init (llm.c: 42)
    pub seed: u32,
    /// --no-shuffle turns off llm.c's permuted train order
    pub shuffle: bool,
    /// model files in checkpoints (fp32)
    pub save_dtype: Dtype,
    /// -h  HellaSwag accuracy at every validation (llm.c: 0)
    pub hellaswag: bool,
    /// HellaSwag file (default: see `default_hellaswag_path`)
    pub hellaswag_data: Option<PathBuf>,
    /// Score only the first N HellaSwag examples (default: all)
    pub hellaswag_limit: Option<usize>,
    /// --overwrite: a fresh run deletes the checkpoints it finds in output_dir (else refuses)
    pub overwrite: bool,
    /// no per-step lines (tests)
    pub quiet: bool,
    /// --device: where the model runs (cpu)
    pub device: Device,
    /// -z  ZeRO stage over the processes of an `mpirun` launch: 0 none, 1 AdamW state,
    /// 2 + gradients, 3 + parameters (llm.c: 0)
    pub zero_stage: usize,
    /// -r  recompute in the backward instead of keeping per layer: 0 none, 1 the MLP
    /// activation (GELU, SwiGLU), 2 + the norms' outputs; the same bits at every level (llm.c: 1)
    pub recompute: u8,
    /// --ce-rows  rows of logits the classifier computes at once (0: all B*T; else >= 3):
    /// the logits buffer holds (rows, Vp); a training step runs head, loss and their backward
    /// chunk by chunk (1024: free from about that many rows, and B*T <= 1024 is unchunked)
    pub ce_rows: usize,
    /// --precision  fp32, or bf16 as llm.c's bf16 build (llm.c: bf16; the CPU only so far)
    pub precision: crate::core::config::Precision,
    /// -w  with bf16, keep fp32 master weights that AdamW updates (llm.c: on); off: AdamW
    /// rounds its updates into the bf16 parameters stochastically
    pub master_weights: bool,
    /// --lora  LoRA rank: train adapters on the projections, the base frozen (0: every weight)
    pub lora: usize,
    /// --lora-alpha  the adapters' scale is alpha / rank (default 2 * rank)
    pub lora_alpha: Option<f32>,
    /// --lora-targets  PEFT's target_modules (empty: all-linear)
    pub lora_targets: Vec<String>,
    /// --lora-from  a PEFT adapter directory or LoRA checkpoint to go on from
    pub lora_from: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            train_data: "data/tinyshakespeare/tiny_shakespeare_train.bin".into(),
            val_data: "data/tinyshakespeare/tiny_shakespeare_val.bin".into(),
            model: "tiny".into(),
            model_given: false,
            output_dir: Some("out".into()),
            checkpoint_every: 0,
            checkpoints_keep: 0,
            major_checkpoint_every: 0,
            resume: false,
            batch_size: 4,
            seq_len: 64,
            total_batch_size: None,
            learning_rate: 1e-3,
            warmup: 20,
            final_lr_frac: 0.1,
            schedule: ScheduleKind::Cosine,
            max_steps: Some(500),
            val_every: 50,
            val_max_steps: Some(20),
            sample_every: 100,
            gen_tokens: 64,
            overfit_single_batch: false,
            optim: OptimConfig::default(),
            skip_loss_z: 0.0,
            skip_grad_z: 0.0,
            seed: 42,
            shuffle: true,
            save_dtype: Dtype::F32,
            hellaswag: false,
            hellaswag_data: None,
            hellaswag_limit: None,
            overwrite: false,
            quiet: false,
            device: Device::Cpu,
            zero_stage: 0,
            recompute: 1,
            ce_rows: 1024,
            precision: crate::core::config::Precision::Fp32,
            master_weights: true,
            lora: 0,
            lora_alpha: None,
            lora_targets: vec![],
            lora_from: None,
        }
    }
}

impl TrainConfig {
    /// Refuse settings that cannot train sensibly, naming the flag, before anything is
    /// allocated or read (a NaN or negative learning rate would otherwise show up steps later
    /// as a diverged run, or train by gradient ascent).
    pub fn validate(&self) -> Result<()> {
        if self.hellaswag_limit == Some(0) {
            bail!("--hellaswag-limit 0: score at least 1 example");
        }
        let finite = |x: f32, flag: &str, what: &str, ok: bool| -> Result<()> {
            if !x.is_finite() || !ok {
                bail!("{flag} {x}: must be {what}");
            }
            Ok(())
        };
        let lr = self.learning_rate;
        finite(lr, "-l/--lr", "a finite number >= 0", lr >= 0.0)?;
        let q = self.final_lr_frac;
        finite(q, "-q/--final-lr-frac", "a finite number in [0, 1]", (0.0..=1.0).contains(&q))?;
        let o = &self.optim;
        finite(o.beta1, "--beta1", "in [0, 1)", (0.0..1.0).contains(&o.beta1))?;
        finite(o.beta2, "--beta2", "in [0, 1)", (0.0..1.0).contains(&o.beta2))?;
        finite(o.eps, "--eps", "a finite number > 0", o.eps > 0.0)?;
        finite(o.weight_decay, "-c/--weight-decay", "a finite number >= 0", o.weight_decay >= 0.0)?;
        finite(o.grad_clip, "--grad-clip", "a finite number >= 0 (0 = no clipping)", o.grad_clip >= 0.0)?;
        finite(self.skip_loss_z, "-sl", "a finite z-score >= 0 (0 = off)", self.skip_loss_z >= 0.0)?;
        finite(self.skip_grad_z, "-sg", "a finite z-score >= 0 (0 = off)", self.skip_grad_z >= 0.0)?;
        if self.batch_size == 0 || self.seq_len == 0 {
            bail!("-b {} -t {}: the batch size and sequence length must be at least 1", self.batch_size, self.seq_len);
        }
        if self.zero_stage > 3 {
            bail!(
                "-z {}: ZeRO stages are 0 (none), 1 (AdamW state), 2 (+ gradients) and 3 (+ parameters)",
                self.zero_stage
            );
        }
        if self.recompute > crate::models::acts::MAX_RECOMPUTE {
            bail!(
                "-r {}: the recompute levels are 0 (none), 1 (the MLP activation) and 2 (+ the norms' outputs)",
                self.recompute
            );
        }
        if self.ce_rows > 0 && self.ce_rows < crate::model::MIN_CLASSIFIER_ROWS {
            bail!(
                "--ce-rows {}: the classifier's chunks are at least {} rows (0 = all at once)",
                self.ce_rows,
                crate::model::MIN_CLASSIFIER_ROWS
            );
        }
        if let Some(a) = self.lora_alpha {
            finite(a, "--lora-alpha", "a finite number > 0", a > 0.0)?;
        }
        if self.lora == 0 && self.lora_from.is_none() && (self.lora_alpha.is_some() || !self.lora_targets.is_empty()) {
            bail!("--lora-alpha and --lora-targets set up LoRA adapters: give their rank with --lora R");
        }
        if self.lora_from.is_some() && (self.lora > 0 || self.lora_alpha.is_some() || !self.lora_targets.is_empty()) {
            bail!("--lora-from's adapters have their own rank, alpha and targets: give --lora-from without --lora, --lora-alpha or --lora-targets");
        }
        if self.val_max_steps == Some(0) {
            bail!("-m 0: validation would average no batches; give -m N >= 1, -m -1 for the whole val split, or -v 0 for no validation");
        }
        Ok(())
    }
}

/// What a run produced, for callers and tests.
#[derive(Debug, Default, Clone)]
pub struct RunSummary {
    /// (step, train loss) for every optimizer step taken in this process.
    pub train_losses: Vec<(usize, f32)>,
    /// (step, val loss) for every validation.
    pub val_losses: Vec<(usize, f32)>,
    pub samples: Vec<String>,
    /// (step, HellaSwag acc_norm) with -h 1.
    pub hellaswag: Vec<(usize, f32)>,
}

/// Where HellaSwag is looked for when no path is given: llm.c's eval file from `llmrs prepare
/// hellaswag` (GPT-2's ids, so only for `gpt2` tokenization), else the JSON lines that command
/// keeps beside it, else those in `$LLMRS_DATA_DIR`.
pub fn default_hellaswag_path(gpt2: bool) -> Result<PathBuf> {
    let dir = PathBuf::from("data/hellaswag");
    let mut candidates = vec![];
    if gpt2 {
        candidates.push(dir.join("hellaswag_val.bin"));
    }
    candidates.push(dir.join("hellaswag_val.jsonl"));
    if let Some(d) = crate::core::env::data_dir() {
        candidates.push(d.join("hellaswag/hellaswag_val.preprocessed.jsonl"));
    }
    if let Some(p) = candidates.into_iter().find(|p| p.is_file()) {
        return Ok(p);
    }
    if gpt2 {
        bail!("HellaSwag data not found: run `llmrs prepare hellaswag` (or pass its path)")
    }
    bail!(
        "HellaSwag's JSON lines not found (a model with its own tokenizer cannot use the GPT-2 ids of \
         hellaswag_val.bin): run `llmrs prepare hellaswag`, which keeps data/hellaswag/hellaswag_val.jsonl, or pass --data"
    )
}

/// Sample `n` tokens after `start` (GPT-2's <|endoftext|>) with llm.c's sampler (xorshift seeded 1337, softmax
/// over the V real logits, inverse CDF), each from the KV-cached pass over the tokens before
/// it. `cache` must hold `n` positions (see [`sample_cache`]).
pub fn sample_tokens(model: &mut Model, cache: &mut KvCache, n: usize, start: u32) -> Result<Vec<u32>> {
    let n = n.min(cache.capacity + 1);
    let mut rng = 1337u64;
    let mut toks = vec![start; n.max(1)];
    cache.reset();
    for t in 1..n {
        let logits = model.forward_cached(cache, &toks[t - 1..t])?;
        let maxv = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let norm: f64 = logits.iter().map(|&x| ((x - maxv) as f64).exp()).sum();
        let coin = random_f32(&mut rng) as f64 * norm;
        let mut cdf = 0f64;
        let mut next = logits.len() - 1;
        for (i, &x) in logits.iter().enumerate() {
            cdf += ((x - maxv) as f64).exp();
            if coin < cdf {
                next = i;
                break;
            }
        }
        toks[t] = next as u32;
    }
    Ok(toks[1..].to_vec())
}

/// A KV cache for [`sample_tokens`] of `n` tokens (one position at a time), or None when a
/// sample that short needs no forward pass.
pub fn sample_cache(model: &mut Model, n: usize) -> Result<Option<KvCache>> {
    let positions = n.min(model.config.max_seq_len + 1).saturating_sub(1);
    if positions == 0 {
        return Ok(None);
    }
    model.kv_cache(positions, 1).map(Some)
}

/// Where per-step output goes: a progress bar on a terminal, plain lines otherwise, plus the
/// JSON-lines log in the output directory.
struct Reporter {
    bar: indicatif::ProgressBar,
    log: Option<std::fs::File>,
    quiet: bool,
}

impl Reporter {
    fn line(&self, s: &str) {
        if self.quiet {
            return;
        }
        if self.bar.is_hidden() {
            println!("{s}");
        } else {
            self.bar.println(s);
        }
    }
    fn json(&mut self, v: serde_json::Value) -> Result<()> {
        if let Some(f) = &mut self.log {
            writeln!(f, "{v}").context("cannot write the training log")?;
        }
        Ok(())
    }
}

/// Run training as configured, as a single process. Returns the losses it saw.
pub fn run(cfg: &TrainConfig) -> Result<RunSummary> {
    run_with(cfg, Box::new(crate::backend::comm::SingleProcess))
}

/// Run training as one rank of `comm`: each rank reads its part of every batch (llm.c's split)
/// and the step averages gradients and loss over the ranks. Only rank 0 writes the log and
/// checkpoint model files.
pub fn run_with(cfg: &TrainConfig, comm: Box<dyn crate::backend::comm::Collectives>) -> Result<RunSummary> {
    cfg.validate()?;
    let shape = Shape::new(cfg, comm.rank(), comm.world())?;
    // Rank 0's lock on the output directory: held until the run has returned.
    let (run_dir, resume_step) = open_output(cfg, shape.rank)?;
    let mut run = Run::start(cfg, comm, shape, resume_step, run_dir.as_ref())?;
    run.train()?;
    run.finish()
}

/// How one optimizer step's tokens are divided: `grad_accum` micro-batches of B×T tokens on
/// each of `world` ranks.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    t: usize,
    rank: usize,
    world: usize,
    /// One micro-batch over all ranks: B*T*world.
    tokens_per_micro: usize,
    /// One optimizer step (-d): a nonzero multiple of `tokens_per_micro`.
    total: usize,
    grad_accum: usize,
}

impl Shape {
    fn new(cfg: &TrainConfig, rank: usize, world: usize) -> Result<Shape> {
        let (b, t) = (cfg.batch_size, cfg.seq_len);
        let tokens_per_micro = b * t * world; // over all ranks
        let total = cfg.total_batch_size.unwrap_or(tokens_per_micro);
        if tokens_per_micro == 0 || !total.is_multiple_of(tokens_per_micro) {
            bail!("total batch size -d {total} must be a multiple of B*T*processes = {tokens_per_micro}");
        }
        Ok(Shape { b, t, rank, world, tokens_per_micro, total, grad_accum: total / tokens_per_micro })
    }
}

/// This rank's train and val loaders: no val loader when there is no validation (`-j ""`, or
/// `-v 0`, which then reads nothing of `-j`). With -a the train loader reads the val split, in
/// order (the step resets it to the same batch). Also returns whether the train data is
/// shuffled, which a resumed run must match.
fn open_data(cfg: &TrainConfig, s: &Shape, vocab_size: usize) -> Result<(DataLoader, Option<DataLoader>, bool)> {
    if cfg.overfit_single_batch && cfg.val_data.is_empty() {
        bail!("-a 1 trains on the first batch of the val data: give it with -j");
    }
    let train_pattern = if cfg.overfit_single_batch { &cfg.val_data } else { &cfg.train_data };
    let shuffle = cfg.shuffle && !cfg.overfit_single_batch;
    let split = crate::data::loader::Split { rank: s.rank, world: s.world };
    let train =
        DataLoader::new_split(train_pattern, s.b, s.t, vocab_size, shuffle, split).context("train data (-i)")?;
    let val = match cfg.val_data.is_empty() || cfg.val_every == 0 {
        true => None,
        false => Some(
            DataLoader::new_split(&cfg.val_data, s.b, s.t, vocab_size, false, split)
                .context("val data (-j; -j '' or -v 0 trains without validation)")?,
        ),
    };
    Ok((train, val, shuffle))
}

/// The model whose tokenizer a run uses: the checkpoint being resumed when its output
/// directory holds the model's tokenizer.json (see [`crate::source::keep_side_files`]), else
/// `-e` (a run from before llmrs kept it there).
fn tokenizer_spec(cfg: &TrainConfig, resume_step: Option<usize>) -> String {
    let kept = resume_step.map(|s| resume_paths(cfg, s, 0)[0].clone());
    match kept.filter(|m| m.with_file_name(crate::source::TOKENIZER_FILE).is_file()) {
        Some(m) => m.display().to_string(),
        None => cfg.model.clone(),
    }
}

/// A Hugging Face model's own tokenizer.json; else, like llm.c, ./gpt2_tokenizer.bin when it is
/// there, else the built-in GPT-2 BPE.
fn load_tokenizer(model: &str) -> Result<Tokenizer> {
    let llmc_tokenizer = Path::new("gpt2_tokenizer.bin");
    Ok(match crate::source::tokenizer_path(model)? {
        Some(p) => Tokenizer::load_hf(&p)?,
        None if llmc_tokenizer.is_file() => Tokenizer::load_llmc(llmc_tokenizer)?,
        None => Tokenizer::gpt2()?,
    })
}

/// The samples (`-s`) start from the tokenizer's document token: refused before the run starts
/// when the model's vocabulary lacks it (a model file of a small vocabulary, with GPT-2's
/// tokenizer as the fallback), which would otherwise stop the run at its first sample.
fn check_sample_start(
    cfg: &TrainConfig,
    mc: &crate::core::config::ModelConfig,
    spec: &str,
    tok: &Tokenizer,
) -> Result<()> {
    // A sample of at most one token runs no forward pass (see `sample_cache`).
    let samples = cfg.sample_every > 0 && cfg.gen_tokens.min(mc.max_seq_len + 1) > 1;
    if samples && tok.doc_start as usize >= mc.vocab_size {
        bail!(
            "-s {}: the samples start from the tokenizer's document token, id {}, outside {spec}'s vocabulary of {} \
             tokens (its tokenizer: {}): give -s 0 to sample nothing, or put the model's tokenizer.json beside it",
            cfg.sample_every,
            tok.doc_start,
            mc.vocab_size,
            if crate::source::tokenizer_path(spec)?.is_some() {
                "its tokenizer.json"
            } else {
                "GPT-2's, as it has no tokenizer.json"
            }
        );
    }
    Ok(())
}

/// Rank 0's `log.jsonl` in the output directory: appended to when resuming (`open_output`
/// trimmed it to the checkpoint), else started empty.
fn open_log(cfg: &TrainConfig, rank: usize, resuming: bool) -> Result<Option<std::fs::File>> {
    let Some(dir) = cfg.output_dir.as_deref().filter(|_| rank == 0) else { return Ok(None) };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create output directory {}", dir.display()))?;
    let p = dir.join("log.jsonl");
    let f = std::fs::OpenOptions::new().create(true).append(resuming).write(true).truncate(!resuming).open(&p);
    Ok(Some(f.with_context(|| format!("cannot open {}", p.display()))?))
}

/// The HellaSwag examples scored at each validation with -h 1 (the first `hellaswag_limit`).
fn load_hellaswag(cfg: &TrainConfig, tokenizer_spec: &str) -> Result<Option<Vec<crate::infer::hellaswag::Example>>> {
    if !cfg.hellaswag {
        return Ok(None);
    }
    let tok = crate::source::tokenizer_of(tokenizer_spec)?;
    let path = match &cfg.hellaswag_data {
        Some(p) => p.clone(),
        None => default_hellaswag_path(tok.is_gpt2())?,
    };
    let mut ex = crate::infer::hellaswag::load(&path, &tok)?;
    ex.truncate(cfg.hellaswag_limit.unwrap_or(usize::MAX));
    Ok(Some(ex))
}

/// A training run between its setup and its end. `step` counts the optimizer steps taken,
/// those before a resume included; the run ends after the evaluations at `step == steps`.
struct Run<'a> {
    cfg: &'a TrainConfig,
    shape: Shape,
    steps: usize,
    val_batches: usize,
    step: usize,
    /// Only during the first pass of a resumed run: its checkpoint is on disk already (not
    /// written again), and older ones may still be due for pruning.
    resuming: bool,
    sched: LrSchedule,
    train: DataLoader,
    /// None without validation (`-j ""`, `-v 0`).
    val: Option<DataLoader>,
    model: Model,
    /// A LoRA run's base model (the checkpoints hold only the adapters).
    lora_base: Option<crate::formats::lora::BaseId>,
    tokenizer: Tokenizer,
    rep: Reporter,
    hellaswag: Option<Vec<crate::infer::hellaswag::Example>>,
    /// The samples' KV cache (-s), allocated once; None when no sample needs a forward pass.
    sampler_cache: Option<KvCache>,
    /// llm.c's outlier detectors (-sl, -sg) over the recent steps' loss and gradient norm.
    loss_window: OutlierDetector,
    norm_window: OutlierDetector,
    /// A loss this far above uniform guessing's ln(V) is no longer training: stop, whatever
    /// the detectors say.
    exploded: f32,
    summary: RunSummary,
}

impl<'a> Run<'a> {
    /// Everything before the first step, in an order that refuses bad weights and data before
    /// anything big is allocated, and touches the log only once model and state are loaded.
    fn start(
        cfg: &'a TrainConfig,
        comm: Box<dyn crate::backend::comm::Collectives>,
        shape: Shape,
        resume_step: Option<usize>,
        run_dir: Option<&RunDir>,
    ) -> Result<Self> {
        // (On the CPU: a GPU's memory is not the host's. Under mpirun each rank checks its
        // shards as it allocates them.)
        if shape.world == 1 && cfg.device == crate::backend::Device::Cpu {
            check_fits(cfg, resume_step, &shape)?;
        }
        let (weights, mut lora, pending) =
            load_weights_and_adapters(cfg, resume_step, shape.rank).map_err(|e| match resume_step {
                Some(s) => e.context(resume_hint(cfg, s)),
                None => e,
            })?;
        let mc = weights.config;
        if let (Some(s), true, 0) = (resume_step, cfg.model_given, shape.rank) {
            // llm.c resumes the checkpoint whatever -e says; say so when -e names another model.
            if let Ok(Some(e)) = crate::source::peek_config(&cfg.model) {
                if !e.same_shape(&mc) {
                    eprintln!("note: -y 1 resumes checkpoint {s} ({mc}); -e {} ({e}) is not used", cfg.model);
                }
            }
        }
        // The data first: a batch larger than the data is refused before anything big is allocated.
        let (mut train, val, shuffle) = open_data(cfg, &shape, mc.vocab_size)?;
        let steps = cfg.max_steps.unwrap_or(train.num_tokens / shape.total);
        if let Some(s) = resume_step.filter(|&s| s > steps) {
            // The loop ends when its step reaches `steps`: from past it, it would never end.
            let dir = cfg.output_dir.as_deref().map_or(String::new(), |d| format!(" in {}", d.display()));
            bail!(
                "-y 1 resumes checkpoint {s}{dir}, but this run ends at step {steps}{}: give -x {s} or more \
                 (nothing was changed)",
                if cfg.max_steps.is_some() { " (-x)" } else { " (one epoch of the train data)" }
            );
        }
        if cfg.output_dir.is_some() && cfg.checkpoint_every > 0 && lora.is_none() {
            crate::formats::llmc::check_model_file(&mc, cfg.save_dtype)?;
        }
        let tok_spec = tokenizer_spec(cfg, resume_step);
        let tokenizer = load_tokenizer(&tok_spec)?;
        check_sample_start(cfg, &mc, &tok_spec, &tokenizer)?;
        if let (Some(rd), Some(s)) = (run_dir, resume_step) {
            rd.trim_log(s)?;
        }
        if shape.world == 1 && cfg.zero_stage > 0 {
            // (Said, not refused: a script may pass -z to every launch, mpirun's or not.)
            eprintln!(
                "note: -z {} shards over the processes of an mpirun launch; with one process it changes nothing",
                cfg.zero_stage
            );
        }
        let mut model =
            Model::with_collectives(weights, crate::backend::factory::open(cfg.device)?, comm, cfg.zero_stage)?;
        if let Some((a, _)) = &lora {
            model.set_lora(a)?;
        }
        model.set_precision(cfg.precision, cfg.master_weights)?;
        if let Some(mut pb) = pending {
            let hash = crate::source::read_hf_into(&mut model, &mut pb.ck)?;
            if let Some(e) = &pb.expect {
                e.check(&hash, &cfg.model)?;
            }
            if let Some((_, base)) = &mut lora {
                base.hash = hash;
            }
        }
        if let (Some(s), 0) = (resume_step, shape.rank) {
            let [m, st, _] = resume_paths(cfg, s, shape.rank);
            if let Some(was) = checkpoint_precision(&m, &st)?.filter(|&p| p != cfg.precision) {
                eprintln!(
                    "note: checkpoint {s} was written by {} {was} run; this run computes in {} (--precision), so its \
                     losses differ from the run it resumes",
                    if was == crate::core::config::Precision::Fp32 { "an" } else { "a" },
                    cfg.precision
                );
            }
        }
        model.alloc_training_state()?;
        model.set_recompute(cfg.recompute)?;
        model.set_classifier_rows(cfg.ce_rows)?;
        model.reserve(shape.b, shape.t)?;
        let val_tokens = val.as_ref().map_or(0, |v| v.num_tokens);
        let val_batches = cfg.val_max_steps.unwrap_or(val_tokens / shape.tokens_per_micro);
        let step = match resume_step {
            Some(s) => restore_state(&resume_paths(cfg, s, shape.rank)[1], s, shuffle, &mut model, &mut train)?,
            None => 0,
        };
        let (kind, max_lr, warmup, final_frac) = (cfg.schedule, cfg.learning_rate, cfg.warmup, cfg.final_lr_frac);
        let sched = LrSchedule { kind, max_lr, warmup, total_steps: steps, final_frac };
        if let (Some(dir), 0, None) = (cfg.output_dir.as_deref(), shape.rank, resume_step) {
            crate::source::keep_side_files(&cfg.model, dir)?;
        }
        let log = open_log(cfg, shape.rank, resume_step.is_some())?;
        let bar = if cfg.quiet {
            indicatif::ProgressBar::hidden()
        } else {
            crate::core::progress::bar(steps as u64, "train")
        };
        bar.set_position(step as u64);
        let rep = Reporter { bar, log, quiet: cfg.quiet || shape.rank != 0 };
        let mut run = Run {
            cfg,
            shape,
            steps,
            val_batches,
            step,
            resuming: resume_step.is_some(),
            sched,
            train,
            val,
            model,
            lora_base: lora.map(|(_, b)| b),
            tokenizer,
            rep,
            hellaswag: None,
            sampler_cache: None,
            loss_window: OutlierDetector::default(),
            norm_window: OutlierDetector::default(),
            exploded: 2.0 * (mc.vocab_size as f32).ln(),
            summary: RunSummary::default(),
        };
        run.report_start(&mc, resume_step)?;
        run.hellaswag = load_hellaswag(cfg, &tok_spec)?;
        if cfg.sample_every > 0 {
            run.sampler_cache = sample_cache(&mut run.model, cfg.gen_tokens)?;
        }
        Ok(run)
    }

    /// The lines that open a run (model, data, device; memory per rank with several processes)
    /// and the log's first record.
    fn report_start(&mut self, mc: &crate::core::config::ModelConfig, resume_step: Option<usize>) -> Result<()> {
        let (Shape { b, t, grad_accum, world, .. }, steps) = (self.shape, self.steps);
        let (model, rep) = (&self.model, &mut self.rep);
        if !rep.quiet {
            rep.line(&format!(
                "model: {mc} ({} parameters){}",
                model.num_parameters(),
                resume_step.map_or(String::new(), |s| format!(", resumed at step {s}"))
            ));
            let val = match &self.val {
                Some(v) => format!("{} val tokens", v.num_tokens),
                None => "no validation".to_string(),
            };
            rep.line(&format!(
                "data: {} train tokens in {} shard(s), {val}; B={b} T={t} grad_accum={grad_accum}; {steps} steps",
                self.train.num_tokens,
                self.train.num_shards(),
            ));
            rep.line(&format!("device: {}", model.describe_backend()));
            if let (crate::core::config::Precision::Bf16, master) = model.precision() {
                let how = match (master, model.lora().is_some()) {
                    (true, _) => "fp32 master weights",
                    (false, true) => "the frozen base needs no master weights",
                    (false, false) => "no master weights (-w 0)",
                };
                rep.line(&format!("precision: bf16 parameters, gradients and activations; {how}; fp32 AdamW"));
            }
            if let Some(a) = model.lora() {
                rep.line(&format!(
                    "LoRA: rank {} alpha {} on {} projections ({}): {} trainable parameters, the base's {} frozen",
                    a.r,
                    a.alpha,
                    a.targets.len(),
                    a.target_names().join(", "),
                    a.num_parameters(),
                    model.num_parameters()
                ));
            }
        }
        let mem = model.memory();
        if world > 1 {
            let mb = |b: usize| format!("{:.1} MB", b as f64 / 1e6);
            rep.line(&format!(
                "{world} processes, ZeRO stage {}; memory per rank: parameters {}, gradients {}, AdamW {}, ZeRO buffers {}, activations {}",
                model.zero_stage(),
                mb(mem.params),
                mb(mem.grads),
                mb(mem.adamw),
                mb(mem.buffers),
                mb(mem.activations)
            ));
        }
        rep.json(
            serde_json::json!({"step": self.step, "processes": world, "zero_stage": model.zero_stage(), "memory_per_rank": mem}),
        )
    }

    /// At each step the evaluations and checkpoint that are due, then, except at the last, one
    /// optimizer step.
    fn train(&mut self) -> Result<()> {
        loop {
            let last = self.step == self.steps;
            self.validate(last)?;
            self.score_hellaswag(last)?;
            self.sample(last)?;
            self.checkpoint(last)?;
            self.resuming = false;
            if last {
                return Ok(());
            }
            self.train_step()?;
        }
    }

    /// Every `-v` steps (step 0 included) and at the end: the mean loss over the first
    /// `val_batches` batches of the val split.
    fn validate(&mut self, last: bool) -> Result<()> {
        let (cfg, step, Shape { b, t, .. }) = (self.cfg, self.step, self.shape);
        if !(cfg.val_every > 0 && (step % cfg.val_every == 0 || last)) {
            return Ok(());
        }
        let (Some(val), model) = (&mut self.val, &mut self.model) else { return Ok(()) };
        val.reset()?;
        model.take_loss()?;
        for _ in 0..self.val_batches {
            val.next_batch()?;
            model.forward(&val.inputs, Some(&val.targets), b, t)?;
            model.accumulate_loss(1.0 / self.val_batches as f32)?;
        }
        let loss = model.take_mean_loss()?; // the validation's one host read, averaged over the ranks
        self.rep.line(&format!("val loss {loss:.6}"));
        self.rep.json(serde_json::json!({"step": step, "val_loss": loss}))?;
        self.summary.val_losses.push((step, loss));
        Ok(())
    }

    /// With -h 1, at every validation after step 0 and at the end: HellaSwag's acc_norm.
    fn score_hellaswag(&mut self, last: bool) -> Result<()> {
        let (cfg, step) = (self.cfg, self.step);
        let Some(ex) = &self.hellaswag else { return Ok(()) };
        if !(cfg.val_every > 0 && ((step > 0 && step % cfg.val_every == 0) || last)) {
            return Ok(());
        }
        let scored = crate::infer::hellaswag::score(&mut self.model, ex, |_| {})?;
        let (_, cn, n) = crate::infer::hellaswag::accuracy(&scored);
        let acc = cn as f32 / n as f32;
        self.rep.line(&format!("HellaSwag: {cn}/{n} = {acc:.6}"));
        self.rep.json(serde_json::json!({"step": step, "hellaswag": acc}))?;
        self.summary.hellaswag.push((step, acc));
        Ok(())
    }

    /// Every `-s` steps after step 0 and at the end: a text sample of `-g` tokens.
    fn sample(&mut self, last: bool) -> Result<()> {
        let (cfg, step) = (self.cfg, self.step);
        if !(cfg.sample_every > 0 && ((step > 0 && step % cfg.sample_every == 0) || last)) {
            return Ok(());
        }
        let toks = match &mut self.sampler_cache {
            Some(cache) => sample_tokens(&mut self.model, cache, cfg.gen_tokens, self.tokenizer.doc_start)?,
            None => vec![],
        };
        let text = self.tokenizer.decode(&toks);
        self.rep.line(&format!("generating:\n---\n{text}\n---"));
        self.summary.samples.push(text);
        Ok(())
    }

    /// Every `-n` steps after step 0 and at the end: the checkpoint of `step`, except the one a
    /// resumed run starts from (on disk already); then rank 0 prunes old ones (`-nk`).
    fn checkpoint(&mut self, last: bool) -> Result<()> {
        let (cfg, step, Shape { rank, world, .. }) = (self.cfg, self.step, self.shape);
        let Some(dir) = cfg.output_dir.as_deref().filter(|_| cfg.checkpoint_every > 0) else { return Ok(()) };
        if !self.resuming && ((step > 0 && step % cfg.checkpoint_every == 0) || last) {
            write_checkpoint(dir, step, &mut self.model, &self.train, cfg.save_dtype, self.lora_base.as_ref())?;
        }
        // After a checkpoint, and on resuming (a kill may have come between the newest
        // checkpoint and the deletions that should have followed it).
        if rank == 0 && (self.resuming || (step > 0 && step.is_multiple_of(cfg.checkpoint_every)) || last) {
            prune_checkpoints(dir, step, cfg, world);
        }
        Ok(())
    }

    /// One optimizer step over `grad_accum` micro-batches, refused when training diverged
    /// (the step then left the parameters as they were), then its report.
    fn train_step(&mut self) -> Result<()> {
        let (cfg, step, Shape { b, t, grad_accum, .. }) = (self.cfg, self.step, self.shape);
        let (t0, comm0) = (Instant::now(), self.model.comm_seconds());
        let (train, model) = (&mut self.train, &mut self.model);
        if cfg.overfit_single_batch {
            train.reset()?;
        }
        // The step: nothing in it waits on the host until its loss and norm are read at the end.
        model.zero_grad()?;
        for _ in 0..grad_accum {
            train.next_batch()?;
            model.forward_backward(&train.inputs, &train.targets, b, t, 1.0 / grad_accum as f32)?;
        }
        let lr = self.sched.lr(step);
        let skip = skip_limits(&self.loss_window, cfg.skip_loss_z, &self.norm_window, cfg.skip_grad_z);
        model.update(&cfg.optim, lr, step, skip)?;
        let stats = model.step_stats()?;
        let StepStats { loss, grad_norm: norm, skipped } = stats;
        check_diverged(step, loss, norm, self.exploded)?;
        if skipped {
            let (zl, zg) = (self.loss_window.z(loss as f64), self.norm_window.z(norm as f64));
            self.rep
                .line(&format!("step {}: update skipped (loss z-score {zl:.2}, grad norm z-score {zg:.2})", step + 1));
        }
        self.loss_window.push(loss as f64);
        self.norm_window.push(norm as f64);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let comm_ms = (self.model.comm_seconds() - comm0) * 1e3;
        self.report_step(lr, stats, ms, comm_ms)?;
        self.step += 1;
        Ok(())
    }

    /// The step's line and log record: `ms` its wall time, `comm_ms` the part in collectives.
    fn report_step(&mut self, lr: f32, stats: StepStats, ms: f64, comm_ms: f64) -> Result<()> {
        let (step, steps, world) = (self.step, self.steps, self.shape.world);
        let StepStats { loss, grad_norm: norm, skipped } = stats;
        let tok_s = (self.shape.total as f64) / (ms / 1e3);
        let ranks = if world > 1 {
            format!(" ({:.0} per rank, {comm_ms:.1} ms in collectives)", tok_s / world as f64)
        } else {
            String::new()
        };
        self.rep.line(&format!(
            "step {:4}/{steps} | loss {loss:.6} | norm {norm:.4} | lr {lr:.2e} | {ms:.2} ms | {tok_s:.0} tok/s{ranks}",
            step + 1
        ));
        let mut line = serde_json::json!({"step": step, "train_loss": loss, "lr": lr, "grad_norm": norm, "ms": ms, "tok_per_s": tok_s});
        if world > 1 {
            line["tok_per_s_per_rank"] = (tok_s / world as f64).into();
            line["comm_ms"] = comm_ms.into();
        }
        if skipped {
            line["skipped"] = true.into();
        }
        self.rep.json(line)?;
        self.rep.bar.inc(1);
        self.summary.train_losses.push((step, loss));
        Ok(())
    }

    /// After the last step: clear the progress bar, free the sampler's cache and (rank 0 with
    /// an output directory) plot the log's curves.
    fn finish(mut self) -> Result<RunSummary> {
        self.rep.bar.finish_and_clear();
        if let Some(cache) = self.sampler_cache.take() {
            self.model.free_kv_cache(cache);
        }
        if let (Some(dir), 0) = (self.cfg.output_dir.as_deref(), self.shape.rank) {
            drop(self.rep); // flush and close the log before reading it back
            let run = crate::train::plot::read_log(&dir.join("log.jsonl"))?;
            let (png, _) = crate::train::plot::plot(&[run], &dir.join("curves"))?;
            if !self.cfg.quiet {
                println!("training curves: {} (and .svg)", png.display());
                // A LoRA run's checkpoint holds adapters: say how to use them.
                if let (Some(base), Some(s)) = (&self.lora_base, latest_checkpoint(dir)) {
                    let ckpt = dir.join(format!("model_{s:08}.bin"));
                    println!(
                        "LoRA adapters: {c} (sample: llmrs generate -e {b} --lora {c}; PEFT's files: llmrs convert {c} DIR; \
                         merged: llmrs convert --merge {c} OUT)",
                        c = ckpt.display(),
                        b = base.source
                    );
                }
            }
        }
        Ok(self.summary)
    }
}

/// Stop a run whose step came out non-finite or with a loss no longer better than guessing:
/// more steps would not bring it back.
fn check_diverged(step: usize, loss: f32, norm: f32, exploded: f32) -> Result<()> {
    if !loss.is_finite() {
        bail!(
            "the training loss is {loss} at step {step}: training diverged. Lower the learning rate (-l), keep clipping on \
             (--grad-clip 1), or resume from the last good checkpoint with -y 1"
        );
    }
    if !norm.is_finite() {
        bail!(
            "the gradient norm is {norm} at step {step}: training diverged. Lower the learning rate (-l) (or a LoRA run's \
             --lora-alpha) and start again, or resume from the last checkpoint with -y 1 if the run wrote one"
        );
    }
    if loss > exploded {
        bail!(
            "the training loss is {loss} at step {step}, more than twice the {:.2} of guessing uniformly: training \
             diverged. Lower the learning rate (-l), keep clipping on (--grad-clip 1), or skip outlier steps (-sl, -sg)",
            exploded / 2.0
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_cannot_train_are_refused_naming_the_flag() {
        let ok = TrainConfig::default();
        ok.validate().unwrap();
        let o = ok.optim;
        let bad = [
            (TrainConfig { learning_rate: -1.0, ..ok.clone() }, "-l/--lr"),
            (TrainConfig { learning_rate: f32::NAN, ..ok.clone() }, "-l/--lr"),
            (TrainConfig { final_lr_frac: f32::NAN, ..ok.clone() }, "-q/--final-lr-frac"),
            (TrainConfig { final_lr_frac: 1.5, ..ok.clone() }, "-q/--final-lr-frac"),
            (TrainConfig { optim: OptimConfig { beta1: 2.0, ..o }, ..ok.clone() }, "--beta1"),
            (TrainConfig { optim: OptimConfig { beta2: 1.0, ..o }, ..ok.clone() }, "--beta2"),
            (TrainConfig { optim: OptimConfig { eps: 0.0, ..o }, ..ok.clone() }, "--eps"),
            (TrainConfig { optim: OptimConfig { weight_decay: -0.1, ..o }, ..ok.clone() }, "--weight-decay"),
            (TrainConfig { optim: OptimConfig { grad_clip: f32::NAN, ..o }, ..ok.clone() }, "--grad-clip"),
            (TrainConfig { batch_size: 0, ..ok.clone() }, "-b 0"),
            (TrainConfig { val_max_steps: Some(0), ..ok.clone() }, "-m 0"),
        ];
        for (cfg, flag) in bad {
            let e = format!("{:#}", cfg.validate().unwrap_err());
            assert!(e.contains(flag), "{flag}: {e}");
        }
    }
}

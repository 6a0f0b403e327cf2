//! What a run starts from: its output directory (locked, and with -y 1 the newest complete
//! checkpoint in it), the weights it trains, and in a LoRA run its adapters and the base's
//! identity (a resumed checkpoint's base loaded again and checked by hash, `--lora-from`'s, or
//! new adapters), refused before anything big is allocated when they cannot work together.

use super::checkpoint::{ckpt_paths, latest_checkpoint};
use super::rundir::{Existing, RunDir};
use super::{Shape, TrainConfig};
use crate::formats::llmc::load_model;
use crate::formats::lora::BaseId;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// [`crate::model::check_fits`] for the model this run trains (a checkpoint's when resuming),
/// from its shape alone. A model whose shape cannot be read without fetching it (a Hub model
/// not in the cache) or whose files are damaged is left to the loader, which says why.
pub(super) fn check_fits(cfg: &TrainConfig, resume_step: Option<usize>, shape: &Shape) -> Result<()> {
    let (spec, lora) = match resume_step {
        Some(s) => {
            let p = resume_paths(cfg, s, 0)[0].clone();
            (p.display().to_string(), crate::formats::lora::is_checkpoint(&p))
        }
        None => (cfg.model.clone(), cfg.lora > 0 || cfg.lora_from.is_some()),
    };
    let Ok(Some(mc)) = crate::source::peek_config(&spec) else { return Ok(()) };
    let (b, t, recompute, ce_rows) = (shape.b, shape.t, cfg.recompute, cfg.ce_rows);
    let (precision, master_weights) = (cfg.precision, cfg.master_weights);
    crate::model::check_fits(&mc, crate::model::RunMemory { b, t, recompute, ce_rows, precision, master_weights, lora })
}

/// Lock the output directory (rank 0), then resume or start fresh: returns the lock, which must
/// be held for the whole run, and with -y 1 the step of the newest complete checkpoint (only
/// ever with an output directory), whose state file this rank must have.
pub(super) fn open_output(cfg: &TrainConfig, rank: usize) -> Result<(Option<RunDir>, Option<usize>)> {
    let out = cfg.output_dir.as_deref();
    if cfg.checkpoint_every > 0 && out.is_none() {
        bail!("checkpoints (-n) need an output directory (-o)");
    }
    if cfg.resume && out.is_none() {
        bail!("-y 1 needs the output directory (-o) of the run to resume");
    }
    let existing = if cfg.overwrite { Existing::Delete } else { Existing::Refuse };
    let was_there = out.is_some_and(|d| d.exists());
    let run_dir = match out {
        Some(dir) if rank == 0 => Some(RunDir::open(dir, cfg.resume, existing)?),
        _ => None,
    };
    let resume_step = if cfg.resume { out.and_then(latest_checkpoint) } else { None };
    if let (true, None, 0, Some(dir)) = (cfg.resume, resume_step, rank, out) {
        // As llm.c, -y 1 with nothing to resume starts afresh; a mistyped -o should not pass unseen.
        let why = if was_there { "holds no complete checkpoint (DONE_ file)" } else { "did not exist" };
        eprintln!("note: -y 1: {} {why}; starting from step 0", dir.display());
    }
    if let Some(s) = resume_step {
        let state = &resume_paths(cfg, s, rank)[1];
        if !state.exists() {
            bail!(
                "checkpoint {s} has no state file for rank {rank} ({}): it was written by a run with fewer processes; \
                 resume with the same number of processes",
                state.display()
            );
        }
    }
    Ok((run_dir, resume_step))
}

/// The files of checkpoint `s` being resumed. [`open_output`] found it in the output
/// directory, so there is one.
pub(super) fn resume_paths(cfg: &TrainConfig, s: usize, rank: usize) -> [PathBuf; 3] {
    ckpt_paths(cfg.output_dir.as_deref().unwrap(), s, rank)
}

/// The weights to train: checkpoint `resume_step`'s, else `-e`'s. Refused when the model
/// cannot hold `-t` positions.
pub(super) fn load_weights(
    cfg: &TrainConfig,
    resume_step: Option<usize>,
    rank: usize,
) -> Result<crate::core::params::Weights> {
    let weights = match resume_step {
        Some(s) => load_model(&resume_paths(cfg, s, rank)[0])?,
        None => crate::source::load_any(&cfg.model, cfg.seed)?,
    };
    let (t, max_t) = (cfg.seq_len, weights.config.max_seq_len);
    if t > max_t {
        bail!("sequence length -t {t} is longer than the model's max_seq_len {max_t}");
    }
    Ok(weights)
}

/// A LoRA base [`load_weights_and_adapters`] leaves to be read into the model once its
/// precision is set (a Hugging Face checkpoint, read in pieces: a bf16 base's fp32 values never
/// exist whole), with the base its adapters were trained on, whose hash it must have.
pub(super) struct PendingBase {
    pub(super) ck: crate::formats::hf::HfCheckpoint,
    pub(super) expect: Option<Expect>,
}

/// Whose base a pending one must be.
pub(super) enum Expect {
    /// `--lora-from` (this checkpoint)'s.
    LoraFrom(PathBuf, crate::formats::lora::BaseId),
    /// The resumed checkpoint's, given as this spec.
    Resumed(String, crate::formats::lora::BaseId),
}

impl Expect {
    /// Refuse a base of hash `h` (-e `model`) that is not the expected one.
    pub(super) fn check(&self, h: &str, model: &str) -> Result<()> {
        match self {
            Expect::LoraFrom(from, base) if base.hash != h => Err(other_base(from, base, model)),
            Expect::Resumed(spec, base) => base.check(spec, h),
            _ => Ok(()),
        }
    }
}

/// The error of adapters trained on another base than -e.
pub(super) fn other_base(from: &Path, base: &crate::formats::lora::BaseId, model: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "--lora-from {}: its adapters were trained on {} (seed {}), not on -e {model}",
        from.display(),
        base.source,
        base.seed
    )
}

/// Refuse a LoRA base of shape `got` (`spec`) for adapters trained on a base of shape `want`
/// (LoRA checkpoint `ckpt`), before the adapters are fitted to it.
pub(super) fn check_base_shape(
    got: &crate::core::config::ModelConfig,
    want: &crate::core::config::ModelConfig,
    spec: &str,
    ckpt: &Path,
) -> Result<()> {
    if !got.same_shape(want) {
        bail!(
            "the LoRA base model {spec} is of shape {got}, but the adapters of {} were trained on a base of shape \
             {want}: give that base with -e",
            ckpt.display()
        );
    }
    Ok(())
}

/// The weights to train and, in a LoRA run, its adapters and the base's identity: a resumed
/// LoRA checkpoint's (its base loaded again and checked by hash), `--lora-from`'s, or new ones
/// of rank `--lora`.
pub(super) type Loaded = (
    crate::core::params::Weights,
    Option<(crate::model::lora::Adapters, crate::formats::lora::BaseId)>,
    Option<PendingBase>,
);

pub(super) fn load_weights_and_adapters(cfg: &TrainConfig, resume_step: Option<usize>, rank: usize) -> Result<Loaded> {
    use crate::model::lora::Adapters;
    let ckpt =
        resume_step.map(|s| resume_paths(cfg, s, rank)[0].clone()).filter(|p| crate::formats::lora::is_checkpoint(p));
    let mut pending = None;
    let (w, lora) = match ckpt {
        Some(p) => {
            let (c, a, base) = crate::formats::lora::load_checkpoint(&p)?;
            // -e may name the base another way (a local copy); its values must be the same. A
            // Hugging Face base is read into the model later (not under ZeRO-3), and checked then.
            let spec = if cfg.model_given { cfg.model.as_str() } else { base.source.as_str() };
            let deferred = match cfg.zero_stage < 3 {
                true => crate::source::load_hf_deferred(spec)
                    .with_context(|| format!("the LoRA base model {spec} (moved? give it with -e)"))?,
                false => None,
            };
            let w = match deferred {
                Some((w, ck)) => {
                    pending = Some(PendingBase { ck, expect: Some(Expect::Resumed(spec.to_string(), base.clone())) });
                    w
                }
                None => crate::source::load_base(&base, cfg.model_given.then_some(cfg.model.as_str()))?,
            };
            check_base_shape(&w.config, &c, spec, &p)?;
            // The base as -e gives it (a moved or renamed copy, checked to hold the same
            // values): the checkpoints this run writes, and the commands it prints, name it.
            let mut base = base;
            if cfg.model_given {
                base.source = BaseId::with_hash(&cfg.model, base.seed, String::new()).source;
            }
            // (Said only when the flags ask for other adapters than the checkpoint's: a resume
            // may repeat the command that started the run.)
            let asked = cfg.lora > 0 && {
                let alpha = cfg.lora_alpha.unwrap_or(2.0 * cfg.lora as f32);
                let targets = crate::model::lora::select(&c, &cfg.lora_targets).ok();
                cfg.lora != a.r || alpha != a.alpha || targets.as_ref() != Some(&a.targets)
            };
            let other = cfg.lora_from.is_some() || asked;
            if other && rank == 0 {
                eprintln!(
                    "note: -y 1 resumes the LoRA checkpoint's adapters (rank {}, alpha {}, {} projections); the \
                     --lora, --lora-alpha, --lora-targets and --lora-from given are not used",
                    a.r,
                    a.alpha,
                    a.targets.len()
                );
            }
            (w, Some((a, base)))
        }
        None if resume_step.is_none() && (cfg.lora > 0 || cfg.lora_from.is_some()) => {
            // A Hugging Face base is read into the model later, in its precision (not under
            // ZeRO-3, whose ranks hold shards).
            let deferred = if cfg.zero_stage < 3 { crate::source::load_hf_deferred(&cfg.model)? } else { None };
            let w = match deferred {
                Some((w, ck)) => {
                    pending = Some(PendingBase { ck, expect: None });
                    w
                }
                None => crate::source::load_any(&cfg.model, cfg.seed)?,
            };
            let a = match &cfg.lora_from {
                Some(p) if !p.is_dir() => {
                    // A LoRA checkpoint: its adapters were trained on one base, which -e must be.
                    let (c, a, base) = crate::formats::lora::load_checkpoint(p).context("--lora-from")?;
                    check_base_shape(&w.config, &c, &cfg.model, p)?;
                    match &mut pending {
                        Some(pb) => pb.expect = Some(Expect::LoraFrom(p.clone(), base)),
                        None if base.hash != crate::core::params::weights_hash(&w) => {
                            return Err(other_base(p, &base, &cfg.model))
                        }
                        None => {}
                    }
                    a
                }
                Some(p) => crate::source::load_adapters(p, &w.config, true).context("--lora-from")?,
                None => {
                    let targets = crate::model::lora::select(&w.config, &cfg.lora_targets).context("--lora-targets")?;
                    let alpha = cfg.lora_alpha.unwrap_or(2.0 * cfg.lora as f32);
                    Adapters::new(cfg.lora, alpha, targets, &mut crate::core::rng::Mt19937::new(cfg.seed))?
                }
            };
            // (A pending base's hash is known once it is read: Trainer::new sets it.)
            let base = match pending {
                Some(_) => BaseId::with_hash(&cfg.model, cfg.seed, String::new()),
                None => BaseId::of(&cfg.model, cfg.seed, &w),
            };
            (w, Some((a, base)))
        }
        None => {
            // (Said once the checkpoint has read as one: an empty or damaged LoRA checkpoint is
            // not recognised as LoRA's, and its error is the one to see.)
            let w = load_weights(cfg, resume_step, rank)?;
            if resume_step.is_some() && (cfg.lora > 0 || cfg.lora_from.is_some()) && rank == 0 {
                eprintln!("note: -y 1 resumes a full fine-tune's checkpoint; --lora and --lora-from are not used");
            }
            (w, None)
        }
    };
    let (t, max_t) = (cfg.seq_len, w.config.max_seq_len);
    if t > max_t {
        bail!("sequence length -t {t} is longer than the model's max_seq_len {max_t}");
    }
    Ok((w, lora, pending))
}

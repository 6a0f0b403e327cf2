//! A run's checkpoints, as llm.c's: `model_%08d.bin` (the model file: [`crate::formats::llmc`],
//! or a LoRA run's adapters: [`crate::formats::lora`]), one `state_%08d_%05d.bin` per rank
//! (llm.c's training-state file, magic 20240527: the data position, AdamW's moments, the fp32
//! parameters the model file does not hold exactly), then `DONE_%08d`, written last, so that
//! a checkpoint without it is ignored. Writing, pruning (`-nk`, `-nm`), and finding and
//! restoring the newest one for `-y 1`.

use super::TrainConfig;
use crate::core::files::{f32s_from_le, parse_header, read_file, write_atomic_with, Dtype, HEADER_BYTES, HEADER_INTS};
use crate::data::loader::DataLoader;
use crate::formats::llmc::{read_file_prefix, save_model, write_values};
use crate::model::{Model, Slot};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub const STATE_MAGIC: i32 = 20240527;
/// Header slot of the ZeRO stage in a training-state file (llmrs only: padding in llm.c's),
/// stored as STATE_ZERO_MARK | stage.
const STATE_ZERO_STAGE: usize = 6;
const STATE_ZERO_MARK: i32 = 0x5A00;
/// Header slot of the kind of run (llmrs only, padding in llm.c's): STATE_RUN_MARK | 1 for a
/// bf16 run | 2 for a LoRA run. llmrs's older files lack it.
const STATE_RUN: usize = 7;
const STATE_RUN_MARK: i32 = 0x5200;
const RUN_BF16: i32 = 1;
const RUN_LORA: i32 = 2;
/// Header slots of the number of AdamW values per moment (a u64 in two ints): what the state
/// belongs to is checked before its values are read.
const STATE_VALUES: usize = 8;

/// Everything besides the weights that a resumed run needs.
pub struct TrainState {
    pub step: usize,
    pub loader: crate::data::loader::LoaderState,
    pub should_shuffle: bool,
}

/// The precision of the run that wrote a checkpoint: what its state file's header says, or
/// for files written before llmrs recorded it, bf16 when its model file is (version 5) or
/// its state file holds master weights. None for an older LoRA checkpoint, whose files tell
/// neither.
pub fn checkpoint_precision(model: &Path, state: &Path) -> Result<Option<crate::core::config::Precision>> {
    use crate::core::config::Precision;
    let header = |p: &Path, what: &str| -> Result<[i32; HEADER_INTS]> {
        parse_header(&read_file_prefix(p, HEADER_BYTES)?, p, what)
    };
    let st = header(state, "training-state")?;
    if st[STATE_RUN] & !0xFF == STATE_RUN_MARK {
        return Ok(Some(if st[STATE_RUN] & RUN_BF16 != 0 { Precision::Bf16 } else { Precision::Fp32 }));
    }
    let m = header(model, "model")?;
    if m[0] == crate::formats::lora::LORA_MAGIC {
        return Ok(None);
    }
    Ok(Some(if m[1] == 5 || st[4] == 1 { Precision::Bf16 } else { Precision::Fp32 }))
}

/// The error [`save_state`] gives for AdamW moments that are not finite (a diverged run).
pub const NON_FINITE_STATE: &str = "the AdamW state holds non-finite values";

/// Write llm.c's training-state file: header (step, data position; llmrs adds the ZeRO stage,
/// the kind of run and the number of AdamW values), AdamW m and v, the fp32 parameters when
/// the model file does not hold them exactly (a bf16 run's master weights, or an fp32 run's
/// parameters when `model_file` is bf16), and with shuffling the loader's permutations and RNG.
pub fn save_state(path: &Path, model: &mut Model, st: &TrainState, model_file: Dtype) -> Result<()> {
    let mut h = [0i32; HEADER_INTS];
    let (rank, world) = model.rank();
    h[0] = STATE_MAGIC;
    h[1] = 1; // version
    h[2] = world as i32; // num_processes
    h[3] = rank as i32; // process rank
                        // use_master_weights: fp32 parameters follow the moments. A bf16 run's master weights (its
                        // model file holds the bf16 working copy), and an fp32 run's parameters when its model file
                        // rounds them to bf16, so that a resume continues from the exact values. A LoRA run's model
                        // file holds its adapters in fp32, and its base never changes.
    let (precision, master) = model.precision();
    let lora = model.lora().is_some();
    let rounded = precision == crate::core::config::Precision::Fp32 && model_file == Dtype::BF16 && !lora;
    let keep_f32 = master || rounded;
    h[4] = keep_f32 as i32;
    h[5] = st.should_shuffle as i32;
    // Not in llm.c's header (its slots are padding there): the ZeRO stage, which decides what
    // the moments below hold, the kind of run, and how many values each moment has.
    h[STATE_ZERO_STAGE] = STATE_ZERO_MARK | model.zero_stage() as i32;
    let bf16 = precision == crate::core::config::Precision::Bf16;
    h[STATE_RUN] = STATE_RUN_MARK | if bf16 { RUN_BF16 } else { 0 } | if lora { RUN_LORA } else { 0 };
    h[10] = st.step as i32;
    // h[20..24]: llm.c's stochastic-rounding RNG state; unused in fp32, left 0.
    let put64 = |h: &mut [i32; HEADER_INTS], i: usize, v: u64| {
        h[i] = v as u32 as i32;
        h[i + 1] = (v >> 32) as u32 as i32;
    };
    put64(&mut h, STATE_VALUES, model.slot_len(Slot::AdamM)? as u64);
    put64(&mut h, 30, st.loader.current_shard_idx as u64);
    put64(&mut h, 32, st.loader.current_sample_idx as u64);
    let header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut tail = Vec::new();
    if st.should_shuffle {
        let l = &st.loader;
        tail.extend_from_slice(&(l.shard_indices.len() as u64).to_le_bytes());
        l.shard_indices.iter().for_each(|x| tail.extend_from_slice(&x.to_le_bytes()));
        tail.extend_from_slice(&(l.shard_num_samples as u64).to_le_bytes());
        l.intra_shard_indices.iter().for_each(|x| tail.extend_from_slice(&x.to_le_bytes()));
        tail.extend_from_slice(&l.rng.as_ref().context("shuffling loader without RNG")?.to_bytes());
    }
    // One moment on the host at a time; a non-finite one aborts the write (nothing is left).
    write_atomic_with(path, |f| {
        f.write_all(&header)?;
        for slot in [Slot::AdamM, Slot::AdamV] {
            let vals = model.read_all(slot).map_err(std::io::Error::other)?;
            if vals.iter().any(|x| !x.is_finite()) {
                return Err(std::io::Error::other(NON_FINITE_STATE));
            }
            write_values(f, &vals, Dtype::F32)?;
        }
        if keep_f32 {
            let vals = model.read_param_shard().map_err(std::io::Error::other)?;
            write_values(f, &vals, Dtype::F32)?;
        }
        f.write_all(&tail)
    })
}

/// Read a training-state file into the model's AdamW moments (which must be allocated) and
/// return the step and data position.
pub fn load_state(path: &Path, model: &mut Model) -> Result<TrainState> {
    let bytes = read_file(path)?;
    let h = parse_header(&bytes, path, "training-state")?;
    if h[0] != STATE_MAGIC {
        bail!("{} is not an llm.c training-state file (magic {})", path.display(), h[0]);
    }
    if h[1] != 1 {
        bail!("{}: training-state version {} is not supported (expected 1)", path.display(), h[1]);
    }
    let (rank, world) = model.rank();
    if h[2] != world as i32 || h[3] != rank as i32 {
        bail!(
            "{}: state of rank {} of a {}-process run; this is rank {rank} of {world}: resume with the same number of processes",
            path.display(),
            h[3],
            h[2]
        );
    }
    // llm.c's files do not record their stage (-z 0 or 1, which the user must repeat on resume);
    // llmrs's carry it with a marker.
    let n = model.slot_len(Slot::AdamM)?;
    let marked = h[STATE_ZERO_STAGE] & !0xFF == STATE_ZERO_MARK;
    let stage = if marked { h[STATE_ZERO_STAGE] & 0xFF } else { model.zero_stage() as i32 };
    if stage != model.zero_stage() as i32 {
        bail!(
            "{}: state of a run with ZeRO stage {stage} (-z {stage}); this run has -z {}: resume with the same -z",
            path.display(),
            model.zero_stage()
        );
    }
    // What llmrs records of the run (older files lack it): a LoRA run's state beside a full
    // model file or the other way round, or one of a model of another size, is named as such
    // before any value is read.
    let p = path.display();
    if h[STATE_RUN] & !0xFF == STATE_RUN_MARK {
        let (was_lora, is_lora) = (h[STATE_RUN] & RUN_LORA != 0, model.lora().is_some());
        let kind = |lora: bool| if lora { "a LoRA run (adapters on a frozen base)" } else { "a full fine-tune" };
        if was_lora != is_lora {
            bail!(
                "{p} is the state of {}, but the checkpoint's model file is of {}: the checkpoint's files do not \
                 belong together",
                kind(was_lora),
                kind(is_lora)
            );
        }
        let values = (h[STATE_VALUES] as u32 as u64) | ((h[STATE_VALUES + 1] as u32 as u64) << 32);
        if values != n as u64 {
            bail!(
                "{p}: the state of {values} trainable values per moment; this model has {n} here: it belongs to \
                 another model (or another --lora rank or targets)"
            );
        }
    }
    let mut off = HEADER_BYTES;
    let mut take = |k: usize| -> Result<&[u8]> {
        let s = bytes
            .get(off..off + k)
            .with_context(|| format!("{p}: truncated training-state file (or the state of a model of another size)"))?;
        off += k;
        Ok(s)
    };
    let mut host = crate::core::mem::zeroed::<f32>(n);
    for slot in [Slot::AdamM, Slot::AdamV] {
        f32s_from_le(take(4 * n)?, &mut host);
        model.write_all(slot, &host)?;
    }
    if h[4] == 1 {
        // fp32 master weights from a mixed-precision llm.c run: they are the exact parameters
        // (this rank's part of them under ZeRO).
        f32s_from_le(take(4 * n)?, &mut host);
        model.write_param_shard(&host)?;
    }
    drop(host);
    let get64 = |i: usize| (h[i] as u32 as u64) | ((h[i + 1] as u32 as u64) << 32);
    let should_shuffle = h[5] == 1;
    let mut loader = crate::data::loader::LoaderState {
        current_shard_idx: get64(30) as usize,
        current_sample_idx: get64(32) as usize,
        shard_indices: vec![],
        shard_num_samples: 0,
        intra_shard_indices: vec![],
        rng: None,
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap()) as usize;
    let i32s = |b: &[u8]| b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    if should_shuffle {
        let nshards = u64_at(take(8)?);
        if nshards > 1 << 24 {
            bail!(
                "{}: implausible shard count {nshards}: the file is damaged or the state of another model",
                path.display()
            );
        }
        loader.shard_indices = i32s(take(4 * nshards)?);
        loader.shard_num_samples = u64_at(take(8)?);
        if loader.shard_num_samples > bytes.len() {
            bail!(
                "{}: implausible sample count {}: the file is damaged or the state of another model",
                path.display(),
                loader.shard_num_samples
            );
        }
        loader.intra_shard_indices = i32s(take(4 * loader.shard_num_samples)?);
        loader.rng = Some(
            crate::core::rng::Mt19937::from_bytes(take(crate::core::rng::MT_STATE_BYTES)?).context("bad RNG state")?,
        );
    }
    if off != bytes.len() {
        bail!(
            "{}: {} unexpected trailing bytes: the state belongs to a model of another size",
            path.display(),
            bytes.len() - off
        );
    }
    Ok(TrainState { step: usize::try_from(h[10]).context("negative step")?, loader, should_shuffle })
}

/// `-nk`: after the checkpoint of `step`, delete the one `keep` checkpoints back, as llm.c
/// does, and every older one too, also the files of one whose deletion a kill interrupted
/// (its DONE already gone); checkpoints at multiples of `-nm` stay.
pub(super) fn prune_checkpoints(dir: &Path, step: usize, cfg: &TrainConfig, world: usize) {
    let keep = cfg.checkpoints_keep * cfg.checkpoint_every;
    if cfg.checkpoints_keep == 0 || step <= keep {
        return;
    }
    let major = |s: usize| cfg.major_checkpoint_every > 0 && s.is_multiple_of(cfg.major_checkpoint_every);
    for old in checkpoint_steps(dir, true).into_iter().filter(|&s| s <= step - keep && !major(s)) {
        let [m, s, d] = ckpt_paths(dir, old, 0);
        let others = (1..world).map(|r| ckpt_paths(dir, old, r)[1].clone());
        for p in [d, m].into_iter().chain(others).chain([s]) {
            let _ = std::fs::remove_file(p); // DONE first, so a half-deleted checkpoint is never "complete"
        }
    }
}

/// What to say before an error reading checkpoint `step` for -y 1: which one failed, and how
/// to go on from the one before it if this one's files are damaged (-y 1 takes the newest
/// complete checkpoint, so it has to be moved away; nothing is deleted for the user).
pub(super) fn resume_hint(cfg: &TrainConfig, step: usize) -> String {
    let Some(dir) = cfg.output_dir.as_deref() else { return format!("-y 1: checkpoint {step}") };
    let earlier = checkpoint_steps(dir, false).into_iter().filter(|&s| s < step).max();
    let how = match earlier {
        Some(e) => format!("; if its files are damaged, move DONE_{step:08} out of the way to resume checkpoint {e}"),
        None => String::new(),
    };
    format!("-y 1: checkpoint {step} in {}{how}", dir.display())
}

/// Steps of the newest complete checkpoint (`DONE_%08d`) in `dir`.
pub fn latest_checkpoint(dir: &Path) -> Option<usize> {
    checkpoint_steps(dir, false).into_iter().max()
}

/// Steps of the complete checkpoints in `dir` (`DONE_%08d`), or with `partial` of any
/// checkpoint file (`model_%08d.bin`, `state_%08d_%05d.bin` too), without repeats.
pub(super) fn checkpoint_steps(dir: &Path, partial: bool) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    let step = |name: &str| -> Option<usize> {
        if let Some(s) = name.strip_prefix("DONE_") {
            return s.parse().ok();
        }
        let rest = name.strip_prefix("model_").or_else(|| name.strip_prefix("state_")).filter(|_| partial)?;
        rest.get(..8)?.parse().ok()
    };
    let mut steps: Vec<usize> = entries.filter_map(|e| step(e.ok()?.file_name().to_str()?)).collect();
    steps.sort_unstable();
    steps.dedup();
    steps
}

/// The model, this rank's state and the DONE marker of the checkpoint at `step`.
pub(super) fn ckpt_paths(dir: &Path, step: usize, rank: usize) -> [PathBuf; 3] {
    [
        dir.join(format!("model_{step:08}.bin")),
        dir.join(format!("state_{step:08}_{rank:05}.bin")),
        dir.join(format!("DONE_{step:08}")),
    ]
}

/// Load the optimizer and data-loader state of checkpoint `s` from `path`, refused when the
/// file is another step's or the run being resumed had another shuffle setting. Returns the
/// step to go on from.
pub(super) fn restore_state(
    path: &Path,
    s: usize,
    shuffle: bool,
    model: &mut Model,
    train: &mut DataLoader,
) -> Result<usize> {
    let st: TrainState = load_state(path, model)?;
    if st.step != s {
        bail!(
            "{} holds the state of step {}, not of checkpoint {s}: the checkpoint's files do not belong together; \
             resume from another checkpoint (delete DONE_{s:08}) or start afresh",
            path.display(),
            st.step
        );
    }
    if st.should_shuffle != shuffle {
        bail!(
            "the run being resumed {} its training data; pass the same --no-shuffle setting",
            if st.should_shuffle { "shuffled" } else { "did not shuffle" }
        );
    }
    train.restore(&st.loader)?;
    Ok(st.step)
}

/// Write the checkpoint of `step` as llm.c does: every rank its state file, rank 0 the model
/// file, then (after all have) rank 0 the DONE marker, so a checkpoint without DONE is ignored.
/// A diverged model (non-finite parameters or AdamW moments) is refused before anything is
/// written, so the newest complete checkpoint is always one that can be resumed.
pub(super) fn write_checkpoint(
    dir: &Path,
    step: usize,
    model: &mut Model,
    train: &DataLoader,
    dtype: Dtype,
    lora_base: Option<&crate::formats::lora::BaseId>,
) -> Result<()> {
    let rank = model.rank().0;
    let [m, s, d] = ckpt_paths(dir, step, rank);
    let diverged = |what: &str| {
        let newest = latest_checkpoint(dir).map_or("there is no earlier checkpoint".to_string(), |s| {
            format!(
                "the newest complete checkpoint is step {s}: resume it with -y 1 after lowering the learning rate (-l)"
            )
        });
        anyhow::anyhow!(
            "step {step}: {what} not finite: training diverged and no checkpoint was written for this step; {newest}"
        )
    };
    // Every rank checks what it holds and all agree, so that all write or none does.
    let (params_ok, state_ok) = model.state_finite()?;
    if let (Some(base), Some(meta)) = (lora_base, model.lora().cloned()) {
        // A LoRA run's model file holds the adapters and the base's identity.
        if !params_ok {
            return Err(diverged("an adapter is"));
        }
        if !state_ok {
            return Err(diverged("the AdamW state is"));
        }
        let st = TrainState { step, loader: train.state(), should_shuffle: train.should_shuffle() };
        save_state(&s, model, &st, dtype)?;
        if rank == 0 {
            let a = crate::model::lora::Adapters { data: model.read_adapters()?, ..meta };
            if let Err(e) = crate::formats::lora::save_checkpoint(&m, &model.config, &a, base) {
                let _ = std::fs::remove_file(&s);
                return Err(e);
            }
        }
        model.barrier()?;
        if rank == 0 {
            crate::core::files::write_atomic(&d, &[])?;
        }
        return Ok(());
    }
    let weights = model.weights_on_rank0()?;
    if !params_ok {
        let bad = weights.as_ref().and_then(|w| {
            w.layout.ids().find(|&t| w.tensor(t).iter().any(|x| !x.is_finite())).map(|t| w.layout.spec(t).name)
        });
        return Err(diverged(&bad.map_or("a parameter is".into(), |t| format!("parameter {t} is"))));
    }
    if !state_ok {
        return Err(diverged("the AdamW state is"));
    }
    crate::formats::llmc::check_model_file(&model.config, dtype)?;
    let st = TrainState { step, loader: train.state(), should_shuffle: train.should_shuffle() };
    // save_state refuses non-finite moments and then writes nothing.
    if let Err(e) = save_state(&s, model, &st, dtype) {
        return Err(if format!("{e:#}").contains(NON_FINITE_STATE) { diverged("the AdamW state is") } else { e });
    }
    if let Some(w) = &weights {
        if let Err(e) = save_model(w, &m, dtype) {
            // A state file without its model file is no checkpoint: never leave one behind.
            let _ = std::fs::remove_file(&s);
            return Err(e);
        }
    }
    model.barrier()?;
    if rank == 0 {
        crate::core::files::write_atomic(&d, &[])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;
    use crate::core::config::ModelConfig;
    use crate::core::params::Weights;

    fn on_cpu(w: Weights) -> Model {
        Model::new(w, Device::Cpu).unwrap()
    }

    /// A model on a device writes the same model file as its host weights.
    #[test]
    fn a_model_writes_its_weights_file() {
        let dir = tempfile::tempdir().unwrap();
        let w = Weights::random(ModelConfig::from_descriptor("2x16:2:8").unwrap(), 3).unwrap();
        let (p, q) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
        save_model(&w, &p, Dtype::BF16).unwrap();
        save_model(&on_cpu(w).weights().unwrap(), &q, Dtype::BF16).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
    }

    #[test]
    fn training_state_round_trip_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::from_descriptor("1x8:2:4").unwrap();
        let mut model = on_cpu(Weights::random(cfg, 1).unwrap());
        model.alloc_training_state().unwrap();
        let n = model.num_parameters();
        let m: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
        model.write_all(Slot::AdamM, &m).unwrap();
        model.write_all(Slot::AdamV, &v).unwrap();
        let mut rng = crate::core::rng::Mt19937::new(42);
        rng.next_u32();
        let loader = crate::data::loader::LoaderState {
            current_shard_idx: 1,
            current_sample_idx: 7,
            shard_indices: vec![1, 0],
            shard_num_samples: 3,
            intra_shard_indices: vec![2, 0, 1],
            rng: Some(rng),
        };
        let p = dir.path().join("state.bin");
        save_state(&p, &mut model, &TrainState { step: 12, loader: loader.clone(), should_shuffle: true }, Dtype::F32)
            .unwrap();
        let mut back = on_cpu(Weights::random(cfg, 2).unwrap());
        back.alloc_training_state().unwrap();
        let st = load_state(&p, &mut back).unwrap();
        assert_eq!((st.step, st.should_shuffle), (12, true));
        assert_eq!(st.loader, loader);
        assert_eq!((back.read_all(Slot::AdamM).unwrap(), back.read_all(Slot::AdamV).unwrap()), (m, v));
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        assert!(format!("{:#}", load_state(&p, &mut back).err().unwrap()).contains("truncated"));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        assert!(format!("{:#}", load_state(&p, &mut back).err().unwrap()).contains("not an llm.c training-state"));
        let mut other_world = bytes.clone();
        other_world[8] = 2; // num_processes = 2
        std::fs::write(&p, &other_world).unwrap();
        assert!(format!("{:#}", load_state(&p, &mut back).err().unwrap()).contains("same number of processes"));
        // A state for a bigger model does not load into a smaller one.
        let mut big = on_cpu(Weights::random(ModelConfig::from_descriptor("1x16:2:4").unwrap(), 1).unwrap());
        big.alloc_training_state().unwrap();
        save_state(&p, &mut big, &TrainState { step: 1, loader, should_shuffle: true }, Dtype::F32).unwrap();
        assert!(load_state(&p, &mut back).is_err());
    }

    #[test]
    fn a_diverged_model_is_never_checkpointed() {
        let dir = tempfile::tempdir().unwrap();
        let shard = dir.path().join("shard.bin");
        crate::data::loader::write_shard(&shard, &(0..200).map(|i| i % 50).collect::<Vec<_>>()).unwrap();
        let dl = DataLoader::new(shard.to_str().unwrap(), 2, 8, 50, false).unwrap();
        let cfg = crate::core::config::ModelConfig::from_descriptor("1x16:2:32").unwrap();
        let mut model = Model::new(crate::core::params::Weights::random(cfg, 1).unwrap(), Device::Cpu).unwrap();
        model.alloc_training_state().unwrap();
        let out = dir.path().join("run");
        write_checkpoint(&out, 3, &mut model, &dl, Dtype::F32, None).unwrap();
        assert_eq!(latest_checkpoint(&out), Some(3));
        let files = || std::fs::read_dir(&out).unwrap().count();
        assert_eq!(files(), 3);
        // A NaN parameter, then an infinite AdamW moment: refused, nothing written, and the
        // message points at the last good checkpoint.
        for slot in [Slot::Params, Slot::AdamV] {
            let good = model.read_all(slot).unwrap();
            let mut bad = good.clone();
            bad[good.len() / 2] = if slot == Slot::Params { f32::NAN } else { f32::INFINITY };
            model.write_all(slot, &bad).unwrap();
            let e = format!("{:#}", write_checkpoint(&out, 4, &mut model, &dl, Dtype::F32, None).unwrap_err());
            assert!(e.contains("not finite") && e.contains("newest complete checkpoint is step 3"), "{e}");
            assert_eq!((files(), latest_checkpoint(&out)), (3, Some(3)), "{slot:?}: something was written");
            model.write_all(slot, &good).unwrap();
        }
        write_checkpoint(&out, 4, &mut model, &dl, Dtype::F32, None).unwrap();
        assert_eq!(latest_checkpoint(&out), Some(4));
    }

    /// A checkpoint whose model file cannot be written (here its name is taken by a directory)
    /// leaves no state file behind; one whose model llm.c's file cannot describe is refused
    /// before anything is written.
    #[test]
    fn a_checkpoint_is_whole_or_absent() {
        let dir = tempfile::tempdir().unwrap();
        let shard = dir.path().join("shard.bin");
        crate::data::loader::write_shard(&shard, &(0..200).map(|i| i % 50).collect::<Vec<_>>()).unwrap();
        let dl = DataLoader::new(shard.to_str().unwrap(), 2, 8, 50, false).unwrap();
        let cfg = crate::core::config::ModelConfig::from_descriptor("llama:1x16:2:1:32:8").unwrap();
        let mut model = Model::new(crate::core::params::Weights::random(cfg, 1).unwrap(), Device::Cpu).unwrap();
        model.alloc_training_state().unwrap();
        let out = dir.path().join("run");
        std::fs::create_dir_all(out.join("model_00000003.bin")).unwrap();
        assert!(write_checkpoint(&out, 3, &mut model, &dl, Dtype::F32, None).is_err());
        let names: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["model_00000003.bin"], "only the directory in the way is there");
        let scaling = crate::core::config::Llama3Scaling {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 2.0,
            original_max_position_embeddings: 1 << 40,
        };
        let bad = crate::core::config::ModelConfig {
            rope: crate::core::config::Rope { theta: 1e4, scaling: Some(scaling) },
            ..cfg
        };
        let mut model = Model::new(crate::core::params::Weights::random(bad, 1).unwrap(), Device::Cpu).unwrap();
        model.alloc_training_state().unwrap();
        let e = format!("{:#}", write_checkpoint(&out, 4, &mut model, &dl, Dtype::F32, None).unwrap_err());
        assert!(e.contains("cannot be checkpointed") && e.contains("original_max_position_embeddings"), "{e}");
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "nothing written");
    }
}

//! llm.c's binary files: the model file (magic 20240326, v3 fp32 / v5 bf16), the debug-state file
//! (magic 20240327) and the training-state file (magic 20240527).
//!
//! Every file starts with llm.c's header of 256 little-endian int32 and is written atomically
//! (crate::files).

use crate::config::ModelConfig;
use crate::files::{
    f32s_from_le, f32s_to_bf16_le, f32s_to_le, parse_header, read_file, write_atomic_with, Dtype, ModelFile,
    HEADER_BYTES, HEADER_INTS,
};
use crate::model::{Model, Slot};
use crate::params::Weights;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

pub const DEBUG_STATE_MAGIC: i32 = 20240327;

/// Write `vals` to `w` in `dtype`, a block at a time (no copy of the whole buffer as bytes).
fn write_values(w: &mut dyn Write, vals: &[f32], dtype: Dtype) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(1 << 16);
    for block in vals.chunks(1 << 14) {
        bytes.clear();
        match dtype {
            Dtype::F32 => f32s_to_le(block, &mut bytes),
            Dtype::BF16 => f32s_to_bf16_le(block, &mut bytes),
        }
        w.write_all(&bytes)?;
    }
    Ok(())
}

/// llmrs's own model file, for the families llm.c has no file for (Qwen): llm.c's header of
/// 256 ints (magic, version 3 fp32 / 5 bf16, the config.json's length in bytes, the number of
/// values), then the model's config.json as `llmrs convert` writes it, then the values in the
/// family's layout order.
pub const LLMRS_MAGIC: i32 = 20261203;

/// A model file's magic, as a family that reads it, or llmrs's own file (None).
fn family_of(magic: i32, path: &Path) -> Result<Option<&'static dyn crate::models::family::Arch>> {
    if magic == LLMRS_MAGIC {
        return Ok(None);
    }
    match crate::models::by_llmc_magic(magic) {
        Some(a) => Ok(Some(a)),
        None => {
            let known: Vec<String> = crate::models::FAMILIES
                .iter()
                .filter_map(|f| f.llmc_magic().map(|m| format!("llm.c's {} file {m}", f.name())))
                .collect();
            bail!(
                "{} is not a model file llmrs reads (magic {magic}; {}, llmrs's own {LLMRS_MAGIC}); pass a model .bin \
                 written by llm.c or llmrs",
                path.display(),
                known.join(", ")
            )
        }
    }
}

/// llmrs's own model file: its config and dtype, and where the values start (the header and
/// the config after it, read from `f`).
fn llmrs_header(f: &mut ModelFile) -> Result<(ModelConfig, Dtype, usize)> {
    let path = f.path;
    let h = parse_header(&f.head, path, "model")?;
    let dtype = match h[1] {
        3 => Dtype::F32,
        5 => Dtype::BF16,
        v => bail!("{}: llmrs model file version {v} is not supported (3 = fp32, 5 = bf16)", path.display()),
    };
    let len = usize::try_from(h[2]).ok().filter(|&n| n > 0 && n < 1 << 20);
    let len = len.with_context(|| format!("{}: header field config length {} is invalid", path.display(), h[2]))?;
    if f.len < (HEADER_BYTES + len) as u64 {
        bail!("{}: truncated header", path.display());
    }
    let text = f.bytes(HEADER_BYTES as u64, len)?;
    let text =
        std::str::from_utf8(&text).map_err(|_| anyhow::anyhow!("{}: its config is not UTF-8", path.display()))?;
    let cfg = crate::hf::parse_config(text, path)?;
    Ok((cfg, dtype, HEADER_BYTES + len))
}

/// The shape a model file declares in its header, reading only the header. A llama3 file's
/// head counts as untied and its biases as present (the values decide those;
/// [`crate::config::ModelConfig::same_shape`] ignores them).
pub fn peek_config(path: &Path) -> Result<ModelConfig> {
    let mut f = ModelFile::open(path)?;
    let h = parse_header(&f.head, path, "model")?;
    match family_of(h[0], path)? {
        Some(a) => Ok(a.llmc_config(&f.head, path)?.0),
        None => Ok(llmrs_header(&mut f)?.0),
    }
}

fn read_file_prefix(path: &Path, n: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(n);
    std::fs::File::open(path)
        .and_then(|f| f.take(n as u64).read_to_end(&mut bytes))
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(bytes)
}

/// Load a model file (fp32 or bf16): llm.c's for the families it has one for (GPT-2's, magic
/// 20240326; the llama3 branch's, 20240803), llmrs's own for the others. Non-finite weights are
/// refused, naming the tensor.
pub fn load_model(path: &Path) -> Result<Weights> {
    let mut f = ModelFile::open(path)?;
    let h = parse_header(&f.head, path, "model")?;
    let w = match family_of(h[0], path)? {
        Some(a) => a.llmc_read(&mut f)?,
        None => {
            let (cfg, dtype, at) = llmrs_header(&mut f)?;
            let n = cfg.num_parameters();
            let want = at + n * dtype.bytes();
            if f.len != want as u64 {
                bail!(
                    "{}: file is {} bytes but a {dtype} model of this shape needs {want}: the file is truncated or corrupt",
                    path.display(),
                    f.len
                );
            }
            let mut w = Weights::zeros(cfg)?;
            f.values(at as u64, dtype, &mut w.data)?;
            w
        }
    };
    w.check_finite(&path.display().to_string())?;
    Ok(w)
}

/// Refuse, before anything is written, a model that [`save_model`] could not write in
/// `dtype`: a run that checkpoints checks this at its start, not at its first checkpoint.
pub fn check_model_file(cfg: &ModelConfig, dtype: Dtype) -> Result<()> {
    let a = crate::models::arch(cfg);
    if a.llmc_magic().is_some() {
        a.llmc_header(cfg, dtype).context("this model cannot be checkpointed")?;
    }
    Ok(())
}

/// Write parameters as a model file (bf16 rounds to nearest even): llm.c's where it has one
/// for the family, else llmrs's own.
pub fn save_model(w: &Weights, path: &Path, dtype: Dtype) -> Result<()> {
    let a = crate::models::arch(&w.config);
    if a.llmc_magic().is_some() {
        let (header, vals) = a.llmc_write(w, dtype)?;
        return write_atomic_with(path, |f| {
            f.write_all(&header)?;
            write_values(f, &vals, dtype)
        });
    }
    let json = crate::hf::config_json(&w.config, Dtype::F32);
    let mut h = [0i32; HEADER_INTS];
    (h[0], h[1], h[2]) = (LLMRS_MAGIC, dtype.version(), json.len() as i32);
    h[3] = i32::try_from(w.data.len()).unwrap_or(-1);
    let header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    write_atomic_with(path, |f| {
        f.write_all(&header)?;
        f.write_all(json.as_bytes())?;
        write_values(f, &w.data, dtype)
    })
}

/// llm.c's debug-state file (`gpt2_124M_debug_state.bin`): one batch with the reference logits,
/// loss and parameter gradients computed by PyTorch.
pub struct DebugState {
    pub b: usize,
    pub t: usize,
    pub inputs: Vec<u32>,  // (B, T)
    pub targets: Vec<u32>, // (B, T)
    pub logits: Vec<f32>,  // (B, T, V)
    pub loss: f32,
    pub grads: Vec<f32>, // (num_parameters)
}

/// Read a debug-state file for a model of shape `cfg`.
pub fn load_debug_state(path: &Path, cfg: &ModelConfig) -> Result<DebugState> {
    let bytes = read_file(path)?;
    let h = parse_header(&bytes, path, "debug-state")?;
    if h[0] != DEBUG_STATE_MAGIC {
        bail!("{} is not an llm.c debug-state file (magic {})", path.display(), h[0]);
    }
    if h[1] != 2 {
        bail!("{}: debug-state version {} is not supported (expected 2); re-run train_gpt2.py", path.display(), h[1]);
    }
    let (b, t) = (h[2].max(0) as usize, h[3].max(0) as usize);
    let n = cfg.num_parameters();
    let bt = b * t; // both < 2^31
    let want = (bt as u128) * (8 + 4 * cfg.vocab_size as u128) + (HEADER_BYTES + 4 + 4 * n) as u128;
    if b == 0 || t == 0 || bytes.len() as u128 != want {
        bail!(
            "{}: {} bytes, expected {want} for B={b} T={t} and this model: truncated, or for another model",
            path.display(),
            bytes.len()
        );
    }
    let mut off = HEADER_BYTES;
    let mut ints = |k: usize| {
        let v: Vec<u32> =
            bytes[off..off + 4 * k].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect();
        off += 4 * k;
        v
    };
    let inputs = ints(bt);
    let targets = ints(bt);
    let mut floats = |k: usize| {
        let mut v = vec![0f32; k];
        f32s_from_le(&bytes[off..off + 4 * k], &mut v);
        off += 4 * k;
        v
    };
    let logits = floats(bt * cfg.vocab_size);
    let loss = floats(1)[0];
    let grads = floats(n);
    Ok(DebugState { b, t, inputs, targets, logits, loss, grads })
}

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
    pub loader: crate::data::LoaderState,
    pub should_shuffle: bool,
}

/// The precision of the run that wrote a checkpoint: what its state file's header says, or
/// for files written before llmrs recorded it, bf16 when its model file is (version 5) or
/// its state file holds master weights. None for an older LoRA checkpoint, whose files tell
/// neither.
pub fn checkpoint_precision(model: &Path, state: &Path) -> Result<Option<crate::config::Precision>> {
    use crate::config::Precision;
    let header = |p: &Path, what: &str| -> Result<[i32; HEADER_INTS]> {
        parse_header(&read_file_prefix(p, HEADER_BYTES)?, p, what)
    };
    let st = header(state, "training-state")?;
    if st[STATE_RUN] & !0xFF == STATE_RUN_MARK {
        return Ok(Some(if st[STATE_RUN] & RUN_BF16 != 0 { Precision::Bf16 } else { Precision::Fp32 }));
    }
    let m = header(model, "model")?;
    if m[0] == crate::lora::LORA_MAGIC {
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
    let rounded = precision == crate::config::Precision::Fp32 && model_file == Dtype::BF16 && !lora;
    let keep_f32 = master || rounded;
    h[4] = keep_f32 as i32;
    h[5] = st.should_shuffle as i32;
    // Not in llm.c's header (its slots are padding there): the ZeRO stage, which decides what
    // the moments below hold, the kind of run, and how many values each moment has.
    h[STATE_ZERO_STAGE] = STATE_ZERO_MARK | model.zero_stage() as i32;
    let bf16 = precision == crate::config::Precision::Bf16;
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
    let mut host = crate::mem::zeroed::<f32>(n);
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
    let mut loader = crate::data::LoaderState {
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
        loader.rng = Some(crate::rng::Mt19937::from_bytes(take(crate::rng::MT_STATE_BYTES)?).context("bad RNG state")?);
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::backend::Device;

    fn on_cpu(w: Weights) -> Model {
        Model::new(w, Device::Cpu).unwrap()
    }

    #[test]
    fn model_round_trip_fp32_and_bf16() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        let w = Weights::random(cfg, 3).unwrap();
        let p = dir.path().join("m.bin");
        save_model(&w, &p, Dtype::F32).unwrap();
        let back = load_model(&p).unwrap();
        assert_eq!(back, w);
        save_model(&w, &p, Dtype::BF16).unwrap();
        let back = load_model(&p).unwrap();
        assert_eq!(back.config, cfg);
        for (a, b) in back.data.iter().zip(&w.data) {
            assert!((a - b).abs() <= b.abs() / 128.0, "bf16 keeps 8 bits of mantissa");
        }
        // Writing bf16 again from the bf16-loaded model is lossless.
        let p2 = dir.path().join("m2.bin");
        save_model(&back, &p2, Dtype::BF16).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&p2).unwrap());
        // And a model on a device writes the same file as its host weights.
        let p3 = dir.path().join("m3.bin");
        save_model(&on_cpu(back.clone()).weights().unwrap(), &p3, Dtype::BF16).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&p3).unwrap());
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
        let mut rng = crate::rng::Mt19937::new(42);
        rng.next_u32();
        let loader = crate::data::LoaderState {
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
    fn bad_model_files_give_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::from_descriptor("1x8:2:4").unwrap();
        let p = dir.path().join("m.bin");
        save_model(&Weights::random(cfg, 1).unwrap(), &p, Dtype::F32).unwrap();
        let good = std::fs::read(&p).unwrap();
        let err = |bytes: &[u8]| {
            std::fs::write(&p, bytes).unwrap();
            format!("{:#}", load_model(&p).map(|_| ()).expect_err("must fail"))
        };
        assert!(err(&good[..good.len() - 1]).contains("truncated"));
        assert!(err(&good[..100]).contains("too short"));
        let mut foreign = good.clone();
        foreign[0] = 0x7f;
        assert!(err(&foreign).contains("not a model file llmrs reads"));
        let mut v = good.clone();
        v[4] = 4;
        assert!(err(&v).contains("version 4"));
        let mut shape = good.clone();
        shape[6 * 4..6 * 4 + 4].copy_from_slice(&7i32.to_le_bytes()); // C=7 not divisible by NH=2
        assert!(err(&shape).contains("bad model header"));
        let mut huge = good;
        huge[4 * 4..4 * 4 + 4].copy_from_slice(&i32::MAX.to_le_bytes()); // L = 2^31-1
        assert!(err(&huge).contains("implausibly large"));
        assert!(format!("{:#}", load_model(&dir.path().join("missing.bin")).err().unwrap()).contains("cannot read"));
    }
}

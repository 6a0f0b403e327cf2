//! llm.c's binary files: the model file (magic 20240326, v3 fp32 / v5 bf16; the families hold
//! their layouts), llmrs's own model file for the families llm.c has none for, and the
//! debug-state file (magic 20240327). The training-state file (magic 20240527) is a run's:
//! [`crate::train::checkpoint`].
//!
//! Every file starts with llm.c's header of 256 little-endian int32 and is written atomically
//! (crate::core::files).

use crate::core::config::ModelConfig;
use crate::core::files::{
    f32s_from_le, f32s_to_bf16_le, f32s_to_le, parse_header, read_file, write_atomic_with, Dtype, ModelFile,
    HEADER_BYTES, HEADER_INTS,
};
use crate::core::params::Weights;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

pub const DEBUG_STATE_MAGIC: i32 = 20240327;

/// Write `vals` to `w` in `dtype`, a block at a time (no copy of the whole buffer as bytes).
pub fn write_values(w: &mut dyn Write, vals: &[f32], dtype: Dtype) -> std::io::Result<()> {
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
    let cfg = crate::models::parse_config(text, path)?;
    Ok((cfg, dtype, HEADER_BYTES + len))
}

/// The shape a model file declares in its header, reading only the header. A llama3 file's
/// head counts as untied and its biases as present (the values decide those;
/// [`crate::core::config::ModelConfig::same_shape`] ignores them).
pub fn peek_config(path: &Path) -> Result<ModelConfig> {
    let mut f = ModelFile::open(path)?;
    let h = parse_header(&f.head, path, "model")?;
    match family_of(h[0], path)? {
        Some(a) => Ok(a.llmc_config(&f.head, path)?.0),
        None => Ok(llmrs_header(&mut f)?.0),
    }
}

pub fn read_file_prefix(path: &Path, n: usize) -> Result<Vec<u8>> {
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
    let json = crate::formats::hf::config_json(&w.config, Dtype::F32);
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

#[cfg(test)]
mod tests {
    use super::*;

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

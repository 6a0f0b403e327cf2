//! One way to name a model everywhere: an llm.c `.bin`, a Hugging Face directory or
//! `.safetensors` file, `hf:owner/name[@revision]` from the Hub, or a descriptor for random init.

use crate::checkpoint::load_model;
use crate::config::ModelConfig;
use crate::params::Weights;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The weights `spec` names, in host memory (a descriptor gives llm.c's random init with `seed`).
pub fn load_any(spec: &str, seed: u32) -> Result<Weights> {
    if let Some(hub) = spec.strip_prefix("hf:") {
        let dir = crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::hf_cache_dir())?;
        return crate::hf::load_hf(&dir);
    }
    let p = Path::new(spec);
    if p.is_dir() || spec.ends_with(".safetensors") {
        return crate::hf::load_hf(p);
    }
    // A LoRA run's checkpoint: its base with the adapters merged.
    if crate::lora::is_checkpoint(p) {
        let (_, a, base) = crate::lora::load_checkpoint(p)?;
        let mut w = base.load(None).with_context(|| {
            format!(
                "{spec} holds LoRA adapters of base {}: give the base and the adapters apart (-e BASE --lora {spec}; \
                 llmrs convert BASE OUT --lora {spec})",
                base.source
            )
        })?;
        a.merge_into(&mut w);
        return Ok(w);
    }
    // Anything that exists is read as a file (a FIFO or device is refused by name).
    if spec.ends_with(".bin") || p.exists() {
        return load_model(p);
    }
    Weights::random(ModelConfig::from_descriptor(spec)?, seed)
}

/// Weights [`load_any_deferred`] left to be made in the model, once its precision is set.
pub enum Deferred {
    /// A descriptor's random weights, with this seed ([`crate::model::Model::init_random`]).
    Random(u32),
    /// A Hugging Face checkpoint's, read in pieces ([`crate::model::Model::load_hf`]).
    Hf(Box<crate::hf::HfCheckpoint>),
}

impl Deferred {
    /// Make the weights in `model` (built from the zero weights that came with this). Returns
    /// a read checkpoint's [`crate::lora::weights_hash`].
    pub fn make(self, model: &mut crate::model::Model) -> Result<Option<String>> {
        match self {
            Deferred::Random(seed) => model.init_random(seed).map(|_| None),
            Deferred::Hf(mut ck) => model.load_hf(&mut ck).map(Some),
        }
    }
}

/// [`load_any`], except that a descriptor's random weights are not drawn and a Hugging Face
/// checkpoint's are not read: zero weights (pages not yet touched), and what makes them, in
/// the model once its precision is set, so that they are made in that precision (a bf16
/// model's fp32 values never exist whole).
pub fn load_any_deferred(spec: &str, seed: u32) -> Result<(Weights, Option<Deferred>)> {
    if let Some(cfg) = random_descriptor(spec) {
        return Ok((Weights::zeros(cfg?)?, Some(Deferred::Random(seed))));
    }
    match load_hf_deferred(spec)? {
        Some((w, ck)) => Ok((w, Some(Deferred::Hf(Box::new(ck))))),
        None => Ok((load_any(spec, seed)?, None)),
    }
}

/// For a Hugging Face checkpoint (a directory, a `.safetensors` file, `hf:owner/name`, fetched
/// as [`load_any`] fetches it): zero weights of its shape and the checkpoint opened and checked,
/// to be read into the model ([`crate::model::Model::load_hf`]). None for any other spec.
pub fn load_hf_deferred(spec: &str) -> Result<Option<(Weights, crate::hf::HfCheckpoint)>> {
    let p = Path::new(spec);
    let dir = if let Some(hub) = spec.strip_prefix("hf:") {
        crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::hf_cache_dir())?
    } else if p.is_dir() || spec.ends_with(".safetensors") {
        p.to_path_buf()
    } else {
        return Ok(None);
    };
    // (Refused if it cannot fit even in bf16; the model checks its own precision's size.)
    let ck = crate::hf::open_hf(&dir, crate::files::Dtype::BF16)?;
    Ok(Some((Weights::zeros(ck.config())?, ck)))
}

/// The config of a descriptor that [`load_any`] makes random weights for, or None for what it
/// reads (a Hub model, a directory, a file: the same tests in the same order).
fn random_descriptor(spec: &str) -> Option<Result<ModelConfig>> {
    let p = Path::new(spec);
    let file = spec.starts_with("hf:") || p.is_dir() || spec.ends_with(".safetensors") || spec.ends_with(".bin");
    (!file && !p.exists()).then(|| ModelConfig::from_descriptor(spec))
}

/// The shape `spec` declares, read without its weights (a file's header, a config.json, a
/// descriptor) and without a download: None for a Hub model not in the cache yet.
pub fn peek_config(spec: &str) -> Result<Option<ModelConfig>> {
    if let Some(hub) = spec.strip_prefix("hf:") {
        let dir = crate::hub::cached_model(&hub.parse()?, &crate::hub::hf_cache_dir());
        return dir.map(|d| crate::hf::peek_config(&d)).transpose();
    }
    let p = Path::new(spec);
    if p.is_dir() || spec.ends_with(".safetensors") {
        return crate::hf::peek_config(p).map(Some);
    }
    if crate::lora::is_checkpoint(p) {
        return crate::lora::load_checkpoint(p).map(|(c, _, _)| Some(c));
    }
    if spec.ends_with(".bin") || p.exists() {
        return crate::checkpoint::peek_config(p).map(Some);
    }
    ModelConfig::from_descriptor(spec).map(Some)
}

pub use crate::hub::{GENERATION_CONFIG_FILE, TOKENIZER_FILE};

/// The directory that holds `spec`'s side files (tokenizer.json, generation_config.json,
/// config.json): a Hugging Face directory, a `.safetensors` file's directory, the Hub snapshot
/// of `hf:owner/name`, or the directory of an llm.c `.bin` (a training run keeps the model's
/// side files in its output directory, beside its checkpoints). None for descriptors. For
/// `hf:` names, `whole_model` fetches the whole model (it is about to be loaded anyway), else
/// only the side files.
fn side_dir(spec: &str, whole_model: bool) -> Result<Option<PathBuf>> {
    if let Some(hub) = spec.strip_prefix("hf:") {
        let (r, ep, cache) = (hub.parse()?, crate::hub::endpoint(), crate::hub::hf_cache_dir());
        let dir = if whole_model {
            crate::hub::fetch_model(&r, &ep, &cache)?
        } else {
            crate::hub::fetch_side_files(&r, &ep, &cache)?
        };
        return Ok(Some(dir));
    }
    let p = Path::new(spec);
    Ok(if p.is_dir() {
        Some(p.to_path_buf())
    } else if p.is_file() && (spec.ends_with(".safetensors") || spec.ends_with(".bin") || spec.ends_with(".json")) {
        Some(p.parent().map_or_else(
            || PathBuf::from("."),
            |d| if d.as_os_str().is_empty() { ".".into() } else { d.to_path_buf() },
        ))
    } else {
        None
    })
}

/// Where `spec`'s tokenizer.json is: `spec` itself (a `.json` file), or the one in its side
/// directory (see [`side_dir`]; for `hf:owner/name` only the tokenizer and small side files
/// are downloaded, not the weights). None when there is none (GPT-2's tokenizer).
pub fn tokenizer_path(spec: &str) -> Result<Option<PathBuf>> {
    let p = Path::new(spec);
    if spec.ends_with(".json") {
        if !crate::files::present(p)? {
            bail!("{spec}: no such file");
        }
        return Ok(Some(p.to_path_buf()));
    }
    match side_dir(spec, false)?.map(|d| d.join(TOKENIZER_FILE)) {
        Some(t) if crate::files::present(&t)? => Ok(Some(t)),
        _ => Ok(None),
    }
}

/// The tokenizer of model `spec`: its tokenizer.json (see [`tokenizer_path`]), else GPT-2's.
pub fn tokenizer_of(spec: &str) -> Result<Tokenizer> {
    match tokenizer_path(spec)? {
        Some(p) => Tokenizer::load_hf(&p),
        None => Tokenizer::gpt2(),
    }
}

/// The tokenizer `--tokenizer` names (a tokenizer.json, a directory holding one,
/// `hf:owner/name`, or `gpt2`), else model `model`'s ([`tokenizer_of`]), else GPT-2's.
pub fn choose_tokenizer(explicit: Option<&str>, model: Option<&str>) -> Result<Tokenizer> {
    match (explicit, model) {
        (Some("gpt2"), _) => Tokenizer::gpt2(),
        (Some(t), _) => {
            let give = "give a tokenizer.json, a model directory holding one, hf:owner/name, or gpt2";
            let path = Path::new(t);
            if !t.starts_with("hf:") && !path.exists() {
                bail!("--tokenizer {t}: no such file or directory; {give}");
            }
            if path.is_file() && !t.ends_with(".json") {
                bail!("--tokenizer {t}: not a tokenizer.json; {give}");
            }
            let p = tokenizer_path(t)?.with_context(|| format!("--tokenizer {t}: has no tokenizer.json; {give}"))?;
            Tokenizer::load_hf(&p).with_context(|| format!("--tokenizer {t}"))
        }
        (None, Some(m)) => tokenizer_of(m),
        (None, None) => Tokenizer::gpt2(),
    }
}

/// The tokenizer the text of model `spec` (of `vocab` tokens) goes through in `generate` and
/// `eval`: `--tokenizer`'s, else the model's own ([`tokenizer_of`]). Refused when it cannot be
/// the model's: one larger than the model's vocabulary, or GPT-2's fallback for a model whose
/// vocabulary is not GPT-2's (a Llama 3 checkpoint without its tokenizer.json beside it would
/// otherwise read and write the wrong words).
pub fn tokenizer_for_text(explicit: Option<&str>, spec: &str, vocab: usize) -> Result<Tokenizer> {
    let tok = choose_tokenizer(explicit, Some(spec))?;
    if explicit.is_none() && tok.is_gpt2() && vocab != crate::config::GPT2_VOCAB {
        bail!(
            "{spec} has a vocabulary of {vocab} tokens, not GPT-2's {}, and no tokenizer.json beside it: give its \
             tokenizer with --tokenizer (a tokenizer.json, a model directory or hf:owner/name)",
            crate::config::GPT2_VOCAB
        );
    }
    tok.check_fits(vocab)?;
    Ok(tok)
}

/// The model's own end-of-sequence tokens, as transformers' `generate` stops at them:
/// `eos_token_id` (one id or a list) of generation_config.json in its side directory, else of
/// its config.json. None when neither says (the tokenizer's end-of-text token is used).
pub fn eos_tokens(spec: &str) -> Result<Option<Vec<u32>>> {
    let Some(dir) = side_dir(spec, false)? else { return Ok(None) };
    for f in [GENERATION_CONFIG_FILE, "config.json"] {
        let path = dir.join(f);
        if !crate::files::present(&path)? {
            continue;
        }
        let text = crate::files::read_file(&path)?;
        let v: serde_json::Value =
            serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let ids = match &v["eos_token_id"] {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_u64()).collect::<Option<Vec<_>>>(),
            x => x.as_u64().map(|i| vec![i]),
        };
        let ids =
            ids.with_context(|| format!("{}: eos_token_id is not a token id or a list of them", path.display()))?;
        let ids: Vec<u32> = ids.into_iter().filter_map(|i| u32::try_from(i).ok()).collect();
        if !ids.is_empty() {
            return Ok(Some(ids));
        }
    }
    Ok(None)
}

/// The files beside a model's weights that describe its tokenizer, chat template and generation
/// settings: what a training run keeps beside its checkpoints and `convert` copies into a
/// model directory it writes.
pub const SIDE_FILES: [&str; 5] =
    [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", GENERATION_CONFIG_FILE];

/// Copy `spec`'s side files ([`SIDE_FILES`] in its [`side_dir`]) into the directory `out`, and
/// with `prune` remove those in `out` that `spec` lacks; returns the side files `out` holds
/// after. When the side directory is `out` itself nothing is copied or removed. A model whose
/// end tokens are only in its config.json gets them as generation settings.
pub fn copy_side_files(spec: &str, out: &Path, prune: bool) -> Result<Vec<PathBuf>> {
    let src = side_dir(spec, false)?;
    if src.as_deref().is_some_and(|d| same_dir(d, out)) {
        return Ok(SIDE_FILES.iter().map(|f| out.join(f)).filter(|p| p.is_file()).collect());
    }
    let mut kept = vec![];
    for f in SIDE_FILES {
        let dest = out.join(f);
        match src.as_ref().map(|d| d.join(f)).filter(|p| p.is_file()) {
            Some(from) => {
                crate::files::write_atomic(&dest, &[&crate::files::read_file(&from)?])?;
                kept.push(dest);
            }
            None if prune && dest.is_file() => {
                std::fs::remove_file(&dest).with_context(|| format!("cannot remove {}", dest.display()))?
            }
            None => {}
        }
    }
    let generation = out.join(GENERATION_CONFIG_FILE);
    if src.is_some() && !generation.is_file() {
        if let Some(ids) = eos_tokens(spec)? {
            let v = serde_json::json!({ "eos_token_id": ids });
            crate::files::write_atomic(&generation, &[v.to_string().as_bytes()])?;
            kept.push(generation);
        }
    }
    Ok(kept)
}

/// Keep `spec`'s side files in a fresh training run's output directory ([`copy_side_files`]),
/// so that its checkpoints (llm.c `.bin` files, which hold only weights) generate and evaluate
/// with the model's own tokenizer and end tokens; those an earlier run left there go when this
/// model has none. (A model inside `out` itself is left alone.)
pub fn keep_side_files(spec: &str, out: &Path) -> Result<()> {
    copy_side_files(spec, out, true).map(|_| ())
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_source() {
        let dir = tempfile::tempdir().unwrap();
        let m = load_any("1x8:2:8", 5).unwrap();
        let bin = dir.path().join("m.bin");
        crate::checkpoint::save_model(&m, &bin, crate::files::Dtype::F32).unwrap();
        assert_eq!(load_any(bin.to_str().unwrap(), 0).unwrap(), m);
        crate::hf::save_hf(&m, &dir.path().join("hf"), crate::files::Dtype::F32).unwrap();
        assert_eq!(load_any(dir.path().join("hf").to_str().unwrap(), 0).unwrap(), m);
        let st = dir.path().join("hf/model.safetensors");
        assert_eq!(load_any(st.to_str().unwrap(), 0).unwrap(), m);
        assert!(load_any("hf:not a name", 0).is_err());
        assert!(load_any("nonsense", 0).is_err());
    }
}

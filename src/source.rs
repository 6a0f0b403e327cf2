//! One way to name a model everywhere: an llm.c `.bin`, a Hugging Face directory or
//! `.safetensors` file, `hf:owner/name[@revision]` from the Hub, or a descriptor for random init.

use crate::core::config::ModelConfig;
use crate::core::params::{weights_hash, Weights};
use crate::data::tokenizer::Tokenizer;
use crate::formats::llmc::load_model;
use crate::formats::lora::{self, BaseId};
use crate::formats::peft;
use crate::model::lora::Adapters;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The weights `spec` names, in host memory (a descriptor gives llm.c's random init with `seed`).
pub fn load_any(spec: &str, seed: u32) -> Result<Weights> {
    if let Some(hub) = spec.strip_prefix("hf:") {
        let dir = crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::hf_cache_dir())?;
        return crate::formats::hf::load_hf(&dir);
    }
    let p = Path::new(spec);
    if p.is_dir() || spec.ends_with(".safetensors") {
        return crate::formats::hf::load_hf(p);
    }
    // A LoRA run's checkpoint: its base with the adapters merged.
    if crate::formats::lora::is_checkpoint(p) {
        let (_, a, base) = crate::formats::lora::load_checkpoint(p)?;
        let mut w = load_base(&base, None).with_context(|| {
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

/// The base a LoRA checkpoint's adapters were trained on: `base.source` (or `other`, a spec the
/// user gave instead), loaded and checked to hash as the one the adapters were trained on.
pub fn load_base(base: &BaseId, other: Option<&str>) -> Result<Weights> {
    let spec = other.unwrap_or(&base.source);
    let w =
        load_any(spec, base.seed).with_context(|| format!("the LoRA base model {spec} (moved? give it with -e)"))?;
    base.check(spec, &weights_hash(&w))?;
    Ok(w)
}

/// Adapters for a base of shape `cfg` from `path`: a PEFT adapter directory, or a LoRA run's
/// checkpoint (its base checked to be of the same shape). `training`: as [`peft::load`].
pub fn load_adapters(path: &Path, cfg: &ModelConfig, training: bool) -> Result<Adapters> {
    if path.is_dir() {
        return peft::load(cfg, path, training);
    }
    let (c, a, _) = lora::load_checkpoint(path)?;
    if !c.same_shape(cfg) {
        bail!("{}: adapters for a base of shape {c}, not {cfg}", path.display());
    }
    Ok(a)
}

/// The merged model (PEFT's `merge_and_unload`) of base `spec` and the adapters at `lora_path`
/// (a PEFT directory, or a LoRA checkpoint, whose base `spec` must be). A descriptor's random
/// base is drawn with `seed`, or for a checkpoint with the checkpoint's own seed unless
/// `seed_given` (a seed the user chose, then checked like any other base by the values' hash).
pub fn load_merged(spec: &str, seed: u32, seed_given: bool, lora_path: &Path) -> Result<Weights> {
    let (mut w, a) = if lora_path.is_dir() {
        let w = load_any(spec, seed)?;
        let a = peft::load(&w.config, lora_path, false)?;
        (w, a)
    } else {
        // Its base is checked by hash, so the adapters fit it.
        let (_, a, mut base) = lora::load_checkpoint(lora_path)?;
        let want = base.clone();
        if seed_given {
            base.seed = seed;
        }
        let w = load_any(spec, base.seed)
            .with_context(|| format!("--lora {}: its base model {spec}", lora_path.display()))?;
        want.check(spec, &weights_hash(&w)).with_context(|| match seed_given && seed != want.seed {
            true => {
                format!("--lora {} with --seed {seed} (leave --seed out to draw its base's seed)", lora_path.display())
            }
            false => format!("--lora {}", lora_path.display()),
        })?;
        (w, a)
    };
    a.merge_into(&mut w);
    Ok(w)
}

/// Weights [`load_any_deferred`] left to be made in the model, once its precision is set.
pub enum Deferred {
    /// A descriptor's random weights, with this seed ([`crate::model::Model::init_random`]).
    Random(u32),
    /// A Hugging Face checkpoint's, read in pieces ([`crate::model::Model::load_hf`]).
    Hf(Box<crate::formats::hf::HfCheckpoint>),
}

impl Deferred {
    /// Make the weights in `model` (built from the zero weights that came with this). Returns
    /// a read checkpoint's [`crate::core::params::weights_hash`].
    pub fn make(self, model: &mut crate::model::Model) -> Result<Option<String>> {
        match self {
            Deferred::Random(seed) => model.init_random(seed).map(|_| None),
            Deferred::Hf(mut ck) => read_hf_into(model, &mut ck).map(Some),
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

/// Read a Hugging Face checkpoint's weights into `model` (built from zero weights of its shape),
/// in pieces, straight into its precision ([`crate::model::Model::write_params`]): the same
/// values as building from [`crate::formats::hf::load_hf`]'s weights, rounded as
/// [`crate::model::Model::set_precision`] rounds them. Returns the weights'
/// [`weights_hash`] (a LoRA base's identity).
pub fn read_hf_into(model: &mut crate::model::Model, ck: &mut crate::formats::hf::HfCheckpoint) -> Result<String> {
    if !ck.config().same_shape(&model.config) {
        bail!("a checkpoint of shape {} read into a model of {}", ck.config(), model.config);
    }
    let mut hash = String::new();
    model.write_params("reading weights in place", |sink| {
        hash = ck.read_into(sink)?;
        Ok(())
    })?;
    Ok(hash)
}

/// For a Hugging Face checkpoint (a directory, a `.safetensors` file, `hf:owner/name`, fetched
/// as [`load_any`] fetches it): zero weights of its shape and the checkpoint opened and checked,
/// to be read into the model ([`crate::model::Model::load_hf`]). None for any other spec.
pub fn load_hf_deferred(spec: &str) -> Result<Option<(Weights, crate::formats::hf::HfCheckpoint)>> {
    let p = Path::new(spec);
    let dir = if let Some(hub) = spec.strip_prefix("hf:") {
        crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::hf_cache_dir())?
    } else if p.is_dir() || spec.ends_with(".safetensors") {
        p.to_path_buf()
    } else {
        return Ok(None);
    };
    // (Refused if it cannot fit even in bf16; the model checks its own precision's size.)
    let ck = crate::formats::hf::open_hf(&dir, crate::core::files::Dtype::BF16)?;
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
        return dir.map(|d| crate::formats::hf::peek_config(&d)).transpose();
    }
    let p = Path::new(spec);
    if p.is_dir() || spec.ends_with(".safetensors") {
        return crate::formats::hf::peek_config(p).map(Some);
    }
    if crate::formats::lora::is_checkpoint(p) {
        return crate::formats::lora::load_checkpoint(p).map(|(c, _, _)| Some(c));
    }
    if spec.ends_with(".bin") || p.exists() {
        return crate::formats::llmc::peek_config(p).map(Some);
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
        if !crate::core::files::present(p)? {
            bail!("{spec}: no such file");
        }
        return Ok(Some(p.to_path_buf()));
    }
    match side_dir(spec, false)?.map(|d| d.join(TOKENIZER_FILE)) {
        Some(t) if crate::core::files::present(&t)? => Ok(Some(t)),
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
    if explicit.is_none() && tok.is_gpt2() && vocab != crate::core::config::GPT2_VOCAB {
        bail!(
            "{spec} has a vocabulary of {vocab} tokens, not GPT-2's {}, and no tokenizer.json beside it: give its \
             tokenizer with --tokenizer (a tokenizer.json, a model directory or hf:owner/name)",
            crate::core::config::GPT2_VOCAB
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
        if !crate::core::files::present(&path)? {
            continue;
        }
        let text = crate::core::files::read_file(&path)?;
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
                crate::core::files::write_atomic(&dest, &[&crate::core::files::read_file(&from)?])?;
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
            crate::core::files::write_atomic(&generation, &[v.to_string().as_bytes()])?;
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
        crate::formats::llmc::save_model(&m, &bin, crate::core::files::Dtype::F32).unwrap();
        assert_eq!(load_any(bin.to_str().unwrap(), 0).unwrap(), m);
        crate::formats::hf::save_hf(&m, &dir.path().join("hf"), crate::core::files::Dtype::F32).unwrap();
        assert_eq!(load_any(dir.path().join("hf").to_str().unwrap(), 0).unwrap(), m);
        let st = dir.path().join("hf/model.safetensors");
        assert_eq!(load_any(st.to_str().unwrap(), 0).unwrap(), m);
        assert!(load_any("hf:not a name", 0).is_err());
        assert!(load_any("nonsense", 0).is_err());
    }

    /// A Hugging Face checkpoint read in place (in pieces, into the model's precision) gives
    /// the parameters of the weights load_hf reads, rounded as set_precision rounds them, and
    /// their hash; tied heads (GPT-2, Qwen3 here) are checked against the embedding.
    #[test]
    fn hf_checkpoint_read_in_place_equals_load_hf() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let round = |v: &[f32]| {
            v.iter().map(|&x| crate::core::bf16::to_f32(crate::core::bf16::from_f32(x))).collect::<Vec<_>>()
        };
        for desc in ["2x32:2:16", "llama:2x32:4:2", "qwen3:3x24:4:2:8:40:16"] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            crate::formats::hf::save_hf(&Weights::random(cfg, 5).unwrap(), dir.path(), crate::core::files::Dtype::F32)
                .unwrap();
            let want = crate::formats::hf::load_hf(dir.path()).unwrap();
            for (precision, master) in [
                (crate::core::config::Precision::Fp32, true),
                (crate::core::config::Precision::Bf16, true),
                (crate::core::config::Precision::Bf16, false),
            ] {
                let mut ck = crate::formats::hf::open_hf(dir.path(), crate::core::files::Dtype::F32).unwrap();
                let mut m = crate::model::Model::new(Weights::zeros(ck.config()).unwrap(), crate::backend::Device::Cpu)
                    .unwrap();
                m.set_precision(precision, master).unwrap();
                let hash = read_hf_into(&mut m, &mut ck).unwrap();
                assert_eq!(hash, crate::core::params::weights_hash(&want), "{desc}");
                let w = if precision == crate::core::config::Precision::Fp32 {
                    want.data.clone()
                } else {
                    round(&want.data)
                };
                assert!(bits(&m.weights().unwrap().data) == bits(&w), "{desc} {precision} -w {master}");
            }
        }
    }
}

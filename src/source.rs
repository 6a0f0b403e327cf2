//! One way to name a model everywhere: an llm.c `.bin`, a Hugging Face directory or
//! `.safetensors` file, `hf:owner/name[@revision]` from the Hub, or a descriptor for random init.

use crate::checkpoint::load_model;
use crate::config::ModelConfig;
use crate::params::Weights;
use anyhow::Result;
use std::path::Path;

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
    // Anything that exists is read as a file (a FIFO or device is refused by name).
    if spec.ends_with(".bin") || p.exists() {
        return load_model(p);
    }
    Weights::random(ModelConfig::from_descriptor(spec)?, seed)
}

/// Where `spec`'s tokenizer.json is: `spec` itself (a tokenizer.json), beside a Hugging Face
/// model (its directory or `.safetensors` file), or in the Hub cache for `hf:owner/name`
/// (fetched with the model). None for llm.c files and descriptors (GPT-2's tokenizer).
pub fn tokenizer_path(spec: &str) -> Result<Option<std::path::PathBuf>> {
    let dir = if let Some(hub) = spec.strip_prefix("hf:") {
        crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::hf_cache_dir())?
    } else {
        let p = Path::new(spec);
        if p.is_file() && spec.ends_with(".json") {
            return Ok(Some(p.to_path_buf()));
        }
        if p.is_dir() {
            p.to_path_buf()
        } else if spec.ends_with(".safetensors") {
            p.parent().map(Path::to_path_buf).unwrap_or_default()
        } else {
            return Ok(None);
        }
    };
    let t = dir.join("tokenizer.json");
    Ok(t.is_file().then_some(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_source() {
        let dir = tempfile::tempdir().unwrap();
        let m = load_any("1x8:2:8", 5).unwrap();
        let bin = dir.path().join("m.bin");
        crate::checkpoint::save_model(&m, &bin, crate::checkpoint::Dtype::F32).unwrap();
        assert_eq!(load_any(bin.to_str().unwrap(), 0).unwrap(), m);
        crate::hf::save_hf(&m, &dir.path().join("hf"), crate::checkpoint::Dtype::F32).unwrap();
        assert_eq!(load_any(dir.path().join("hf").to_str().unwrap(), 0).unwrap(), m);
        let st = dir.path().join("hf/model.safetensors");
        assert_eq!(load_any(st.to_str().unwrap(), 0).unwrap(), m);
        assert!(load_any("hf:not a name", 0).is_err());
        assert!(load_any("nonsense", 0).is_err());
    }
}

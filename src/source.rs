//! One way to name a model everywhere: an llm.c `.bin`, a Hugging Face directory or
//! `.safetensors` file, `hf:owner/name[@revision]` from the Hub, or a descriptor for random init.

use crate::checkpoint::load_model;
use crate::config::GPT2Config;
use crate::params::Weights;
use anyhow::Result;
use std::path::Path;

/// The weights `spec` names, in host memory (a descriptor gives llm.c's random init with `seed`).
pub fn load_any(spec: &str, seed: u32) -> Result<Weights> {
    if let Some(hub) = spec.strip_prefix("hf:") {
        let dir = crate::hub::fetch_model(&hub.parse()?, &crate::hub::endpoint(), &crate::hub::cache_dir())?;
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
    Weights::random(GPT2Config::from_descriptor(spec)?, seed)
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

//! llmrs's LoRA checkpoint (a LoRA run's `model_%08d.bin`): llm.c's 256-int header (magic
//! [`LORA_MAGIC`], version 1, the JSON's length, the number of values), then JSON (the base's
//! config.json, its [`BaseId`], r, lora_alpha and the adapted modules), then the adapters'
//! fp32 values.

use crate::core::config::ModelConfig;
use crate::core::files::{f32s_to_le, read_file, write_atomic, Dtype};
use crate::core::params::{weights_hash, Weights};
use crate::formats::peft::{CONFIG_FILE, WEIGHTS_FILE};
use crate::model::lora::{select, values, Adapters};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The magic of llmrs's LoRA checkpoint (a LoRA run's `model_%08d.bin`).
pub const LORA_MAGIC: i32 = 20261204;
const LORA_VERSION: i32 = 1;

/// Which base model adapters were trained on: how to load it again (`-e`'s spec and the seed
/// of a random one) and a hash of its values, so that a resume or a merge refuses another base.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BaseId {
    pub source: String,
    pub seed: u32,
    pub hash: String,
}

impl BaseId {
    /// The base `source` (`-e`'s spec; a path made absolute, so that a run resumed or merged
    /// from another directory finds it) with `seed`, and its values' hash.
    pub fn of(source: &str, seed: u32, w: &Weights) -> BaseId {
        BaseId::with_hash(source, seed, weights_hash(w))
    }

    /// [`BaseId::of`] for values whose [`weights_hash`] is `hash` (a base read into a model).
    pub fn with_hash(source: &str, seed: u32, hash: String) -> BaseId {
        let p = Path::new(source);
        let source = match p.exists().then(|| std::fs::canonicalize(p)) {
            Some(Ok(abs)) => abs.display().to_string(),
            _ => source.to_string(),
        };
        BaseId { source, seed, hash }
    }

    /// Refuse base `spec` of hash `h` unless it is this one.
    pub fn check(&self, spec: &str, h: &str) -> Result<()> {
        if h != self.hash {
            bail!(
                "base model {spec} (hash {h}) is not the one these adapters were trained on ({} with seed {}, hash {}): give that base instead",
                self.source,
                self.seed,
                self.hash
            );
        }
        Ok(())
    }
}

/// Whether `path` is a LoRA checkpoint (its magic), without reading the rest.
pub fn is_checkpoint(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut m)).is_ok()
        && i32::from_le_bytes(m) == LORA_MAGIC
}

/// Write a LoRA run's checkpoint model file: llm.c's 256-int header (magic [`LORA_MAGIC`],
/// version 1, the JSON's length, the number of values), then JSON (the base's config.json, its
/// [`BaseId`], r, lora_alpha and the adapted modules), then the adapters' fp32 values.
pub fn save_checkpoint(path: &Path, cfg: &ModelConfig, a: &Adapters, base: &BaseId) -> Result<()> {
    let config: serde_json::Value = serde_json::from_str(&crate::formats::hf::config_json(cfg, Dtype::F32))?;
    let modules: Vec<&str> = a.targets.iter().map(|t| t.module.as_str()).collect();
    let json =
        serde_json::json!({"base_config": config, "base": base, "r": a.r, "lora_alpha": a.alpha, "modules": modules});
    let json = serde_json::to_string(&json)?;
    let mut h = [0i32; crate::core::files::HEADER_INTS];
    (h[0], h[1], h[2]) = (LORA_MAGIC, LORA_VERSION, json.len() as i32);
    h[3] = i32::try_from(a.data.len()).context("adapters too large for the file")?;
    let header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut vals = vec![];
    f32s_to_le(&a.data, &mut vals);
    write_atomic(path, &[&header, json.as_bytes(), &vals])
}

/// Read a LoRA checkpoint: the base's shape, the adapters, and the base's identity.
pub fn load_checkpoint(path: &Path) -> Result<(ModelConfig, Adapters, BaseId)> {
    let p = path.display();
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name == WEIGHTS_FILE || name == CONFIG_FILE {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        bail!("{p} is one file of a PEFT adapter: give its directory ({})", dir.display());
    }
    if name.ends_with(".safetensors") {
        bail!(
            "{p} is a safetensors file, not LoRA adapters: give a PEFT adapter's directory or a LoRA run's checkpoint"
        );
    }
    let bytes = read_file(path)?;
    let h = crate::core::files::parse_header(&bytes, path, "LoRA checkpoint")?;
    if h[0] != LORA_MAGIC {
        bail!("{p} is not a LoRA checkpoint (magic {}, expected {LORA_MAGIC})", h[0]);
    }
    if h[1] != LORA_VERSION {
        bail!("{p}: LoRA checkpoint version {} is not supported (expected {LORA_VERSION})", h[1]);
    }
    let hb = crate::core::files::HEADER_BYTES;
    let len =
        usize::try_from(h[2]).ok().filter(|&n| n > 0 && n < 1 << 26).with_context(|| format!("{p}: bad header"))?;
    let text = bytes.get(hb..hb + len).with_context(|| format!("{p}: truncated header"))?;
    let v: serde_json::Value = serde_json::from_slice(text).with_context(|| format!("{p}: corrupt header"))?;
    let cfg_text = serde_json::to_string(&v["base_config"])?;
    let cfg = crate::models::parse_config(&cfg_text, path)?;
    let base: BaseId = serde_json::from_value(v["base"].clone()).with_context(|| format!("{p}: corrupt header"))?;
    let r = v["r"].as_u64().filter(|&r| r > 0).with_context(|| format!("{p}: corrupt header (r)"))? as usize;
    let alpha = v["lora_alpha"].as_f64().map(|a| a as f32).filter(|a| a.is_finite() && *a > 0.0);
    let alpha = alpha.with_context(|| format!("{p}: corrupt header (lora_alpha)"))?;
    let modules: Vec<String> =
        serde_json::from_value(v["modules"].clone()).with_context(|| format!("{p}: corrupt header"))?;
    let targets = select(&cfg, &modules).with_context(|| format!("{p}: modules"))?;
    if targets.len() != modules.len() {
        bail!("{p}: its modules do not match its base's projections");
    }
    let n = values(r, &targets).with_context(|| format!("{p}: corrupt header (r)"))?;
    let vals = &bytes[hb + len..];
    if n != h[3] as usize || vals.len() != n.saturating_mul(4) {
        bail!(
            "{p}: {} bytes of values, adapters of rank {r} on these modules need {}: the file is truncated or corrupt",
            vals.len(),
            4 * n
        );
    }
    let mut data = vec![0f32; n];
    crate::core::files::f32s_from_le(vals, &mut data);
    if data.iter().any(|x| !x.is_finite()) {
        bail!("{p}: the adapters hold non-finite values (a diverged run)");
    }
    Ok((cfg, Adapters { r, alpha, targets, data }, base))
}

//! PEFT's adapter directory (`adapter_config.json`, `adapter_model.safetensors`): LoRA adapters
//! ([`crate::model::lora::Adapters`]) written as `PeftModel.save_pretrained` writes them and
//! read back, checked to be a LoRA that llmrs computes exactly on this base.

use crate::core::config::ModelConfig;
use crate::core::files::{f32s_to_le, read_file, write_atomic, Dtype};
use crate::formats::hf::to_f32;
use crate::model::lora::{linear_modules, select, values, Adapters};
use crate::models;
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// The adapter file names PEFT's `save_pretrained` writes.
pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// Write a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors` in
/// `dtype`: fp32, or bf16 rounded to nearest even) for the base its targets came from (of shape
/// `cfg`), which PEFT's `PeftModel.from_pretrained` loads onto that base. `base` names the base
/// model in the config.
pub fn save(a: &Adapters, dir: &Path, base: &str, cfg: &ModelConfig, dtype: Dtype) -> Result<()> {
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
    for (i, t) in a.targets.iter().enumerate() {
        for (part, range, shape) in
            [("lora_A", a.a_range(i), vec![a.r, t.cols]), ("lora_B", a.b_range(i), vec![t.rows, a.r])]
        {
            let mut b = vec![];
            match dtype {
                Dtype::F32 => f32s_to_le(&a.data[range], &mut b),
                Dtype::BF16 => crate::core::files::f32s_to_bf16_le(&a.data[range], &mut b),
            }
            bytes.push((format!("base_model.model.{}.{part}.weight", t.module), shape, b));
        }
    }
    let st_dtype = match dtype {
        Dtype::F32 => StDtype::F32,
        Dtype::BF16 => StDtype::BF16,
    };
    let views = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(st_dtype, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let out = safetensors::serialize(views, Some(meta))?;
    let conv1d = a.targets.iter().any(|t| t.conv1d);
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": a.r,
        "lora_alpha": a.alpha,
        "target_modules": a.target_modules(cfg),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "init_lora_weights": true,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": true,
        "revision": null,
    });
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join(WEIGHTS_FILE), &[&out])?;
    write_atomic(&dir.join(CONFIG_FILE), &[serde_json::to_string_pretty(&config)?.as_bytes()])?;
    Ok(())
}

/// Read a PEFT adapter directory made for a base of shape `cfg`: its config checked to be a
/// LoRA llmrs computes exactly, every tensor checked against the base's projections. For
/// training (`--lora-from`) a dropout is refused too (llmrs trains without one); for
/// inference it changes nothing.
pub fn load(cfg: &ModelConfig, dir: &Path, training: bool) -> Result<Adapters> {
    let cpath = dir.join(CONFIG_FILE);
    let text =
        String::from_utf8(read_file(&cpath)?).map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", cpath.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", cpath.display()))?;
    let pc = PeftConfig::parse(&v, &cpath, training)?;
    let targets = select(cfg, &pc.targets).with_context(|| format!("{}: target_modules", cpath.display()))?;
    let wpath = dir.join(WEIGHTS_FILE);
    let len = values(pc.r, &targets).with_context(|| format!("{}: r {}", cpath.display(), pc.r))?;
    // Refused before reading: a file far larger than these adapters in fp32 (the widest
    // dtype read) with a generous header is not theirs, and reading it whole could take
    // all memory.
    let most = len.saturating_mul(4).saturating_add(targets.len().saturating_mul(4096)).saturating_add(1 << 20);
    if let Ok(m) = std::fs::metadata(&wpath) {
        if m.len() > most as u64 {
            bail!(
                    "{}: {} bytes, where fp32 adapters of rank {} on this base's {} projections take {}: the adapter was made for another base",
                    wpath.display(),
                    m.len(),
                    pc.r,
                    targets.len(),
                    4 * len
                );
        }
    }
    let bytes = read_file(&wpath)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        let why = safetensors_damage(&bytes).map_or(String::new(), |d| format!(" ({d})"));
        anyhow::anyhow!("{}: not a valid safetensors file: {e}{why}", wpath.display())
    })?;
    // Refused before allocating: a file smaller than the adapters' values in bf16 (the
    // smallest dtype read) cannot hold them.
    if len.saturating_mul(2) > bytes.len() {
        bail!(
                "{}: {} bytes cannot hold adapters of rank {} on this base's {} projections: the adapter was made for another base",
                wpath.display(),
                bytes.len(),
                pc.r,
                targets.len()
            );
    }
    let mut a = Adapters { r: pc.r, alpha: pc.alpha, data: vec![0.0; len], targets };
    let prefix = models::arch(cfg).hf_prefix();
    let mut used = std::collections::HashSet::new();
    for i in 0..a.targets.len() {
        let t = a.targets[i].clone();
        for (part, range, shape) in [("lora_A", a.a_range(i), [a.r, t.cols]), ("lora_B", a.b_range(i), [t.rows, a.r])] {
            // With the family's prefix (a PEFT model of the LM) or without (of the bare model).
            let bare = t.module.strip_prefix(prefix).unwrap_or(&t.module);
            let names = [
                format!("base_model.model.{}.{part}.weight", t.module),
                format!("base_model.model.{bare}.{part}.weight"),
            ];
            let Some((name, x)) = names.iter().find_map(|n| st.tensor(n).ok().map(|x| (n.clone(), x))) else {
                bail!(
                    "{}: tensor {} is missing: the adapter was not made for this base model",
                    wpath.display(),
                    names[0]
                );
            };
            if x.shape() != shape {
                bail!(
                        "{}: tensor {name} has shape {:?}, this base model's {} needs {shape:?}: the adapter was made for another base",
                        wpath.display(),
                        x.shape(),
                        t.module
                    );
            }
            let vals = to_f32(&x, &name).with_context(|| wpath.display().to_string())?;
            if let Some(v) = vals.iter().find(|v| !v.is_finite()) {
                bail!("{}: tensor {name} holds {v}", wpath.display());
            }
            a.data[range].copy_from_slice(&vals);
            used.insert(name);
        }
    }
    if let Some(n) = st.names().into_iter().find(|n| !used.contains(*n)) {
        // A projection of this base that target_modules leaves out (a config edited, or
        // files from two adapters): say that, rather than blame the base.
        let module = n
            .strip_prefix("base_model.model.")
            .and_then(|m| m.strip_suffix(".lora_A.weight").or_else(|| m.strip_suffix(".lora_B.weight")));
        let all = linear_modules(cfg);
        let base_module =
            module.and_then(|m| all.iter().find(|t| t.module == m || t.module.strip_prefix(prefix) == Some(m)));
        // (One of the targets, named twice, with and without the prefix, is not this case.)
        if let Some(t) = base_module.filter(|t| !a.targets.iter().any(|x| x.module == t.module)) {
            let mut listed = pc.targets.iter().take(6).cloned().collect::<Vec<_>>().join(", ");
            if pc.targets.len() > 6 {
                listed += &format!(", and {} more", pc.targets.len() - 6);
            }
            bail!(
                    "{}: tensor {n} adapts {}, which {} does not list in target_modules ({listed}): the two files do not belong together",
                    wpath.display(),
                    t.module,
                    cpath.display(),
                );
        }
        bail!(
            "{}: tensor {n} is not a LoRA A or B of this base's projections (the adapter was made for another \
                 base, or holds what llmrs does not implement: biases, DoRA, modules_to_save)",
            wpath.display()
        );
    }
    Ok(a)
}

/// What is wrong with a safetensors file the library refuses, where its header says: a tensor
/// whose dtype and shape do not fill its byte range (named), or tensors reaching past the end
/// of the file (truncated). None when the header itself cannot be read.
fn safetensors_damage(bytes: &[u8]) -> Option<String> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let data = bytes.len() - 8 - n;
    let mut end = 0usize;
    for (name, t) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let size = match t["dtype"].as_str()? {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
            _ => 0, // (another dtype: its size is not checked, only where it ends)
        };
        let shape: Option<Vec<u64>> = t["shape"].as_array()?.iter().map(|d| d.as_u64()).collect();
        let numel = shape?.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let offs: Option<Vec<u64>> = t["data_offsets"].as_array()?.iter().map(|d| d.as_u64()).collect();
        let [a, b] = offs?[..] else { return None };
        let (need, have) = (numel.and_then(|k| k.checked_mul(size)), b.checked_sub(a));
        if size > 0 && (need.is_none() || have.is_none() || need != have) {
            return Some(format!(
                "tensor {name}: {} of shape {} needs {} bytes, its offsets give {}",
                t["dtype"],
                t["shape"],
                numel.map_or("too many".into(), |k| (k as u128 * size as u128).to_string()),
                b as i128 - a as i128
            ));
        }
        end = end.max(usize::try_from(b).ok()?);
    }
    (end > data).then(|| format!("truncated: its tensors need {end} bytes after the header, the file holds {data}"))
}

/// The fields of PEFT's `adapter_config.json` that llmrs honours.
#[derive(Clone, Debug, PartialEq)]
pub struct PeftConfig {
    pub r: usize,
    pub alpha: f32,
    pub targets: Vec<String>,
}

impl PeftConfig {
    /// Read and check an `adapter_config.json`: what would compute another model (DoRA,
    /// rsLoRA, trained biases, modules_to_save, dropout, per-module ranks) is a one-line error
    /// naming the field.
    pub fn parse(v: &serde_json::Value, path: &Path, training: bool) -> Result<PeftConfig> {
        let p = path.display();
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        match field("peft_type").and_then(|x| x.as_str()) {
            Some("LORA") | None => {}
            Some(other) => bail!("{p}: peft_type {other:?}: llmrs reads LoRA adapters only"),
        }
        let r = match field("r") {
            None => bail!("{p}: no field r (the rank)"),
            Some(x) => match x.as_u64() {
                Some(0) => bail!("{p}: r is 0"),
                Some(r) => usize::try_from(r).with_context(|| format!("{p}: r {r} is too large"))?,
                None => bail!("{p}: r {x} is not a positive integer (the rank)"),
            },
        };
        // PEFT's default alpha is 8. A scale of 0 would leave the model unchanged, and an
        // infinite or NaN one (a float past f32's range reads as infinity) would make every
        // output NaN: both are refused here rather than met as a silent no-op or a NaN loss.
        let alpha = match field("lora_alpha") {
            None => 8.0,
            Some(x) => match x.as_f64().map(|a| a as f32) {
                Some(a) if a.is_finite() && a > 0.0 => a,
                _ => bail!("{p}: lora_alpha {x}: must be a finite number > 0"),
            },
        };
        let bool_field = |k: &str| field(k).and_then(|x| x.as_bool()).unwrap_or(false);
        for k in ["use_dora", "use_rslora", "lora_bias", "use_qalora"] {
            if bool_field(k) {
                bail!("{p}: {k} true is not supported (llmrs computes plain LoRA)");
            }
        }
        if let Some(b) = field("bias").and_then(|x| x.as_str()).filter(|b| *b != "none") {
            bail!("{p}: bias {b:?} is not supported (llmrs trains no biases in a LoRA run); use \"none\"");
        }
        let drop = field("lora_dropout").and_then(|x| x.as_f64()).unwrap_or(0.0);
        if training && drop != 0.0 {
            bail!(
                "{p}: lora_dropout {drop}: llmrs trains adapters without dropout; set it to 0 to go on training these"
            );
        }
        let nonempty = |k: &str| match field(k) {
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(serde_json::Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
            None => false,
        };
        for k in [
            "modules_to_save",
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "exclude_modules",
            "target_parameters",
            "trainable_token_indices",
            "layer_replication",
            "alora_invocation_tokens",
        ] {
            if nonempty(k) {
                bail!("{p}: {k} is set; llmrs does not implement it (one rank and alpha for every projection of every layer)");
            }
        }
        let targets = match field("target_modules") {
            // (PEFT refuses an empty list too; llmrs's own empty --lora-targets means every
            // projection, which this file would not have said.)
            Some(serde_json::Value::Array(a)) if a.is_empty() => {
                bail!("{p}: target_modules is empty; list the adapted projections (e.g. [\"q_proj\", \"v_proj\"])")
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str().map(String::from).with_context(|| format!("{p}: target_modules holds {x}, not a name"))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(serde_json::Value::String(s)) if s == "all-linear" => vec![s.clone()],
            Some(serde_json::Value::String(s)) => {
                bail!("{p}: target_modules {s:?} is a regular expression; llmrs reads a list of module names")
            }
            Some(other) => bail!("{p}: target_modules {other} is not a list of module names"),
            None => bail!("{p}: no target_modules"),
        };
        Ok(PeftConfig { r, alpha, targets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::rng::Mt19937;

    #[test]
    fn peft_configs_llmrs_cannot_honour_are_refused_by_field() {
        let ok = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "lora_dropout": 0.0, "bias": "none", "use_dora": false, "modules_to_save": null, "rank_pattern": {}});
        let p = Path::new("adapter_config.json");
        assert_eq!(
            PeftConfig::parse(&ok, p, true).unwrap(),
            PeftConfig { r: 4, alpha: 8.0, targets: vec!["q_proj".into()] }
        );
        // A dropout only matters to training: inference (and merging) reads such an adapter.
        let mut drop = ok.clone();
        drop["lora_dropout"] = serde_json::json!(0.05);
        assert!(PeftConfig::parse(&drop, p, false).is_ok());
        for (k, v, says) in [
            ("use_dora", serde_json::json!(true), "use_dora"),
            ("lora_dropout", serde_json::json!(0.1), "lora_dropout"),
            ("bias", serde_json::json!("all"), "bias"),
            ("modules_to_save", serde_json::json!(["lm_head"]), "modules_to_save"),
            ("rank_pattern", serde_json::json!({"q_proj": 8}), "rank_pattern"),
            ("target_modules", serde_json::json!(".*proj"), "regular expression"),
            ("peft_type", serde_json::json!("IA3"), "peft_type"),
            ("layer_replication", serde_json::json!([[0, 2]]), "layer_replication"),
            ("target_modules", serde_json::json!([]), "target_modules is empty"),
            ("lora_alpha", serde_json::json!(0), "lora_alpha 0"),
            ("lora_alpha", serde_json::json!(-8), "lora_alpha -8"),
            ("lora_alpha", serde_json::json!(1e300), "finite number"),
            ("lora_alpha", serde_json::json!("16"), "lora_alpha"),
            ("r", serde_json::json!(0), "r is 0"),
            ("r", serde_json::json!(-4), "not a positive integer"),
            ("r", serde_json::json!(2.5), "not a positive integer"),
            ("r", serde_json::json!(1.2e21), "not a positive integer"),
        ] {
            let mut bad = ok.clone();
            bad[k] = v;
            let e = PeftConfig::parse(&bad, p, true).unwrap_err().to_string();
            assert!(e.contains(says) && !e.contains('\n'), "{k}: {e}");
        }
    }

    /// Save then load gives the same adapters; a base of another shape refuses them.
    #[test]
    fn peft_files_round_trip_and_refuse_another_base() {
        let dir = std::env::temp_dir().join(format!("llmrs-lora-rt-{}", std::process::id()));
        for desc in ["llama:2x16:4:2", "2x16:2:8"] {
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            let mut a = Adapters::new(3, 5.0, select(&cfg, &[]).unwrap(), &mut Mt19937::new(1)).unwrap();
            a.data.iter_mut().enumerate().for_each(|(i, x)| *x += i as f32 * 1e-3);
            save(&a, &dir, "base", &cfg, Dtype::F32).unwrap();
            assert_eq!(load(&cfg, &dir, true).unwrap(), a);
            let other =
                ModelConfig::from_descriptor(if desc.starts_with("llama") { "llama:2x24:4:2" } else { "2x24:2:8" })
                    .unwrap();
            let e = load(&other, &dir, true).unwrap_err().to_string();
            assert!(e.contains("another base"), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A PEFT adapter's damaged or mismatched files are refused naming what is wrong: a
    /// truncated safetensors file, a tensor whose dtype does not fit its bytes, a tensor of a
    /// projection the config does not list, a file far too large to be these adapters.
    #[test]
    fn damaged_peft_files_say_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("llmrs-lora-dmg-{}", std::process::id()));
        let cfg = ModelConfig::from_descriptor("llama:2x16:4:2").unwrap();
        let a = Adapters::new(2, 4.0, select(&cfg, &[]).unwrap(), &mut Mt19937::new(1)).unwrap();
        let err = |edit: &dyn Fn(&Path)| {
            save(&a, &dir, "base", &cfg, Dtype::F32).unwrap();
            edit(&dir);
            load(&cfg, &dir, true).unwrap_err().to_string()
        };
        let wf = dir.join(WEIGHTS_FILE);
        let e = err(&|_| {
            let b = std::fs::read(&wf).unwrap();
            std::fs::write(&wf, &b[..b.len() - 100]).unwrap();
        });
        assert!(e.contains("truncated: its tensors need") && !e.contains('\n'), "{e}");
        let e = err(&|_| {
            // The first tensor's dtype in the header, F32 -> F64 (same length).
            let b = std::fs::read(&wf).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let h = String::from_utf8(b[8..8 + n].to_vec()).unwrap().replacen("\"F32\"", "\"F64\"", 1);
            std::fs::write(&wf, [&b[..8], h.as_bytes(), &b[8 + n..]].concat()).unwrap();
        });
        assert!(e.contains("lora_") && e.contains("\"F64\" of shape") && e.contains("needs"), "{e}");
        let e = err(&|d| {
            let c = d.join(CONFIG_FILE);
            let j = std::fs::read_to_string(&c).unwrap();
            let mut v: serde_json::Value = serde_json::from_str(&j).unwrap();
            v["target_modules"] = serde_json::json!(["q_proj"]);
            std::fs::write(&c, v.to_string()).unwrap();
        });
        assert!(e.contains("does not list in target_modules (q_proj)"), "{e}");
        // Far larger than these adapters could be (sparse: no disk is used): refused unread.
        let e = err(&|_| std::fs::File::options().write(true).open(&wf).unwrap().set_len(1 << 30).unwrap());
        assert!(e.contains("1073741824 bytes, where fp32 adapters of rank 2"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Adapters on some of a family's projections (one layer's, or GPT-2's attention c_proj
    /// and not the MLP's) come back from their PEFT files on the same targets: the config
    /// names them in full where their last names would adapt more.
    #[test]
    fn peft_files_keep_a_subset_of_targets() {
        let dir = std::env::temp_dir().join(format!("llmrs-lora-sub-{}", std::process::id()));
        for (desc, wanted, names) in [
            ("llama:2x16:4:2", vec!["q_proj", "v_proj"], vec!["q_proj", "v_proj"]),
            ("llama:2x16:4:2", vec!["layers.1.self_attn.q_proj", "v_proj"], vec![]),
            ("2x16:2:8", vec!["attn.c_proj"], vec![]),
            ("2x16:2:8", vec!["c_proj"], vec!["c_proj"]),
        ] {
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            let wanted: Vec<String> = wanted.into_iter().map(String::from).collect();
            let a = Adapters::new(2, 4.0, select(&cfg, &wanted).unwrap(), &mut Mt19937::new(1)).unwrap();
            save(&a, &dir, "base", &cfg, Dtype::F32).unwrap();
            let back = load(&cfg, &dir, true).unwrap();
            assert_eq!(back, a, "{desc} {wanted:?}");
            let written = a.target_modules(&cfg);
            if names.is_empty() {
                // Full module names, one per target.
                assert_eq!(written.len(), a.targets.len(), "{desc} {wanted:?}: {written:?}");
            } else {
                assert_eq!(written, names, "{desc} {wanted:?}");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

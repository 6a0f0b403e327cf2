//! Hugging Face checkpoints: `config.json` and safetensors (one `model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) in transformers' layout, for every family.
//!
//! `config.json` names the architecture (`GPT2LMHeadModel`, `LlamaForCausalLM`); the family's
//! file ([`crate::models::gpt2`], [`crate::models::llama`]) turns it into a [`ModelConfig`],
//! writes it back, and lists its tensors as [`HfTensor`]s: transformers' name, where the values
//! live in the flat parameter buffer, the shape as stored, and whether stored transposed. Import
//! and export follow that one table. fp32, bf16 and f16 are read; fp32 and bf16 written.

use crate::config::ModelConfig;
use crate::files::Dtype;
use crate::files::{bf16s_from_le, f32s_from_le, f32s_to_bf16_le, f32s_to_le, read_file, write_atomic};
use crate::models;
use crate::params::{HfTensor, Weights};
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Parse `config.json` into the model's shape, checking that llmrs computes exactly this model.
pub fn parse_config(text: &str, path: &Path) -> Result<ModelConfig> {
    let v: serde_json::Value =
        serde_json::from_str(text).with_context(|| format!("{}: not a model config.json", path.display()))?;
    if !v.is_object() {
        bail!("{}: not a model config.json (not a JSON object)", path.display());
    }
    let cfg = models::by_hf_config(&v, path)?.parse_hf_config(&v, path)?;
    models::validate(&cfg).with_context(|| format!("{}: bad model shape", path.display()))?;
    Ok(cfg)
}

/// `config.json` as transformers writes it for a model of this shape.
pub fn config_json(cfg: &ModelConfig, dtype: Dtype) -> String {
    let torch_dtype = match dtype {
        Dtype::F32 => "float32",
        Dtype::BF16 => "bfloat16",
    };
    serde_json::to_string_pretty(&models::arch(cfg).hf_config(cfg, torch_dtype)).unwrap() + "\n"
}

fn hf_tensors(w: &Weights) -> Vec<HfTensor> {
    models::arch(&w.config).hf_tensors(&w.config, &w.layout)
}

/// The safetensors files of a checkpoint: `config.json` and its shards.
struct Files {
    config: PathBuf,
    shards: Vec<PathBuf>,
}

/// Locate `config.json` and the safetensors file(s) of a directory or a `.safetensors` file.
fn resolve(path: &Path) -> Result<Files> {
    let (dir, single) = if path.is_dir() {
        (path.to_path_buf(), path.join("model.safetensors"))
    } else {
        (path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf), path.to_path_buf())
    };
    let config = dir.join("config.json");
    let index = dir.join("model.safetensors.index.json");
    let shards = if single.is_file() {
        vec![single]
    } else if path.is_dir() && index.is_file() {
        let text =
            String::from_utf8(read_file(&index)?).map_err(|_| anyhow::anyhow!("{} is not UTF-8", index.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not a safetensors index", index.display()))?;
        let map = v["weight_map"].as_object().with_context(|| format!("{}: no weight_map", index.display()))?;
        let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
        files.sort();
        files.dedup();
        if files.is_empty() || files.iter().any(|f| f.contains('/') || f.contains("..")) {
            bail!("{}: weight_map must name shard files in this directory", index.display());
        }
        files.into_iter().map(|f| dir.join(f)).collect()
    } else {
        bail!(
            "{} not found: a Hugging Face model directory holds model.safetensors (or shards and \
             model.safetensors.index.json) and config.json",
            single.display()
        );
    };
    if !config.is_file() {
        bail!("{} not found next to {}: it gives the model's shape", config.display(), shards[0].display());
    }
    Ok(Files { config, shards })
}

/// Convert one stored tensor to f32 (F32, BF16 and F16 are accepted).
pub(crate) fn to_f32(t: &TensorView, name: &str) -> Result<Vec<f32>> {
    let d = t.data();
    let n = t.shape().iter().product();
    let mut out = vec![0f32; n];
    match t.dtype() {
        StDtype::F32 => f32s_from_le(d, &mut out),
        StDtype::BF16 => bf16s_from_le(d, &mut out),
        StDtype::F16 => out
            .iter_mut()
            .zip(d.chunks_exact(2))
            .for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        other => bail!("tensor {name} has dtype {other:?}; expected F32, BF16 or F16"),
    }
    Ok(out)
}

/// The (cols, rows) transpose of a row-major (rows, cols) matrix: between llm.c's (out, in)
/// weights and transformers' Conv1D (in, out).
fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            y[j * rows + i] = x[i * cols + j];
        }
    }
    y
}

/// The shape a Hugging Face model (directory or `.safetensors` path) declares in its
/// config.json, without reading its weights.
pub fn peek_config(path: &Path) -> Result<ModelConfig> {
    let files = resolve(path)?;
    let text = String::from_utf8(read_file(&files.config)?)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", files.config.display()))?;
    parse_config(&text, &files.config)
}

/// Load a Hugging Face model (directory or `.safetensors` path) as llmrs-layout weights.
pub fn load_hf(path: &Path) -> Result<Weights> {
    let files = resolve(path)?;
    let cfg_text = String::from_utf8(read_file(&files.config)?)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", files.config.display()))?;
    let cfg = parse_config(&cfg_text, &files.config)?;
    // The files are read whole beside the fp32 weights they become: refuse what cannot fit
    // before reading gigabytes.
    let file_bytes: u64 = files.shards.iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let need = (file_bytes as usize).saturating_add(cfg.num_parameters().saturating_mul(4));
    let what = format!(
        "loading {} ({:.2} GiB of files, {} parameters as fp32)",
        path.display(),
        file_bytes as f64 / (1u64 << 30) as f64,
        cfg.num_parameters()
    );
    crate::mem::check_available(need, &what)?;
    let shards: Vec<Vec<u8>> = files.shards.iter().map(|p| read_file(p)).collect::<Result<_>>()?;
    let mut parsed = vec![];
    for (bytes, p) in shards.iter().zip(&files.shards) {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", p.display()))?;
        parsed.push(st);
    }
    let names: Vec<String> = parsed.iter().flat_map(|st| st.names().into_iter().map(String::from)).collect();
    let arch = models::arch(&cfg);
    let prefix = if !arch.hf_prefix().is_empty() && names.iter().any(|n| n.starts_with(arch.hf_prefix())) {
        arch.hf_prefix()
    } else {
        ""
    };
    // The files must hold every tensor config.json implies, and no other (a layer more or a
    // layer less than config.json says is a model of another shape): checked by name before
    // anything is allocated for them.
    let table = arch.hf_tensors(&cfg, &models::layout(&cfg));
    let expected: std::collections::HashSet<String> = table.iter().map(|e| format!("{prefix}{}", e.name)).collect();
    if let Some(e) = table.iter().find(|e| !names.contains(&format!("{prefix}{}", e.name))) {
        bail!(
            "{}: tensor {prefix}{} is missing (config.json describes {} layers)",
            files.shards[0].display(),
            e.name,
            cfg.num_layers
        );
    }
    // Buffers transformers saves beside the weights (GPT-2's causal mask, rotary tables) and a
    // stored copy of a tied head (checked below) are not parameters.
    let not_a_parameter = |n: &str| n == "lm_head.weight" || arch.hf_ignored(n);
    if let Some(n) = names.iter().find(|n| !expected.contains(*n) && !not_a_parameter(n)) {
        bail!(
            "{}: tensor {n} is not part of the model config.json describes ({} layers): the weights and config.json \
             do not belong together",
            files.shards[0].display(),
            cfg.num_layers
        );
    }
    let stored: usize =
        parsed.iter().flat_map(|st| st.tensors()).map(|(_, t)| t.shape().iter().product::<usize>()).sum();
    let padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.channels;
    let heads = if cfg.tied_head { 1 } else { 2 };
    if stored < cfg.num_parameters() - heads * padding {
        bail!(
            "{}: holds {stored} values, fewer than the {} parameters config.json describes",
            files.shards[0].display(),
            cfg.num_parameters()
        );
    }
    let find = |name: &str| parsed.iter().zip(&files.shards).find_map(|(st, p)| st.tensor(name).ok().map(|t| (t, p)));
    let mut w = Weights::zeros(cfg)?;
    for e in hf_tensors(&w) {
        let full = format!("{prefix}{}", e.name);
        let (t, p) =
            find(&full).ok_or_else(|| anyhow::anyhow!("{}: tensor {full} is missing", files.shards[0].display()))?;
        if t.shape() != e.shape {
            bail!("{}: tensor {full} has shape {:?}, config.json implies {:?}", p.display(), t.shape(), e.shape);
        }
        let x = to_f32(&t, &full)?;
        if let Some((i, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!(
                "{}: tensor {full} holds {v} at element {i}: the weights are corrupt or come from a diverged run",
                p.display()
            );
        }
        let x = if e.transposed { transposed(&x, e.shape[0], e.shape[1]) } else { x };
        w.data[e.range].copy_from_slice(&x);
    }
    if cfg.tied_head {
        if let Some((head, p)) = find("lm_head.weight") {
            // A stored head must be the tied embedding.
            let (v, c) = (cfg.vocab_size, cfg.channels);
            if head.shape() != [v, c] || to_f32(&head, "lm_head.weight")? != w.tensor(arch.head(&cfg))[..v * c] {
                bail!(
                    "{}: lm_head.weight differs from the token embedding, but config.json ties them \
                     (tie_word_embeddings)",
                    p.display()
                );
            }
        }
    }
    Ok(w)
}

/// Export to a directory with `model.safetensors` and `config.json` that transformers'
/// `from_pretrained` loads. The padded vocab rows are dropped.
pub fn save_hf(w: &Weights, dir: &Path, dtype: Dtype) -> Result<()> {
    let table = hf_tensors(w);
    let st_dtype = match dtype {
        Dtype::F32 => StDtype::F32,
        Dtype::BF16 => StDtype::BF16,
    };
    let bytes: Vec<Vec<u8>> = table
        .iter()
        .map(|e| {
            let x = &w.data[e.range.clone()];
            // Conv1D (in, out) from llm.c's (out, in) = (shape[1], shape[0]).
            let x = if e.transposed { transposed(x, e.shape[1], e.shape[0]) } else { x.to_vec() };
            let mut b = vec![];
            match dtype {
                Dtype::F32 => f32s_to_le(&x, &mut b),
                Dtype::BF16 => f32s_to_bf16_le(&x, &mut b),
            }
            b
        })
        .collect();
    let prefix = models::arch(&w.config).hf_prefix();
    let views = table
        .iter()
        .zip(&bytes)
        .map(|(e, b)| Ok((format!("{prefix}{}", e.name), TensorView::new(st_dtype, e.shape.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let out = safetensors::serialize(views, Some(meta))?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join("model.safetensors"), &[&out])?;
    write_atomic(&dir.join("config.json"), &[config_json(&w.config, dtype).as_bytes()])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_import_round_trip() {
        for desc in ["2x16:2:8", "llama:2x16:4:2"] {
            let dir = tempfile::tempdir().unwrap();
            let model = Weights::random(ModelConfig::from_descriptor(desc).unwrap(), 7).unwrap();
            save_hf(&model, dir.path(), Dtype::F32).unwrap();
            let back = load_hf(dir.path()).unwrap();
            assert_eq!(back, model, "{desc}");
            save_hf(&model, dir.path(), Dtype::BF16).unwrap();
            let back = load_hf(&dir.path().join("model.safetensors")).unwrap();
            for (a, b) in back.data.iter().zip(&model.data) {
                assert!((a - b).abs() <= b.abs() / 128.0);
            }
        }
    }

    #[test]
    fn bad_checkpoints_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let model = Weights::random(ModelConfig::from_descriptor("1x8:2:8").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let cfg_path = dir.path().join("config.json");
        let good_cfg = std::fs::read_to_string(&cfg_path).unwrap();
        let err = || format!("{:#}", load_hf(dir.path()).map(|_| ()).expect_err("must fail"));
        std::fs::write(&cfg_path, good_cfg.replace("\"n_embd\": 8", "\"n_embd\": 16")).unwrap();
        assert!(err().contains("fewer than"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("\"n_positions\": 8", "\"n_positions\": 4")).unwrap();
        assert!(err().contains("has shape"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("gelu_new", "relu")).unwrap();
        assert!(err().contains("activation"));
        std::fs::write(&cfg_path, good_cfg.replace("GPT2LMHeadModel", "MistralForCausalLM")).unwrap();
        assert!(err().contains("'MistralForCausalLM' is not supported"), "{}", err());
        std::fs::write(&cfg_path, "{not json").unwrap();
        assert!(err().contains("not a model config.json"));
        std::fs::write(&cfg_path, &good_cfg).unwrap();
        let st = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&st).unwrap();
        std::fs::write(&st, &bytes[..bytes.len() - 10]).unwrap();
        assert!(err().contains("not a valid safetensors"));
        std::fs::remove_file(&st).unwrap();
        assert!(err().contains("not found"));
    }
}

//! Hugging Face GPT-2 checkpoints: `model.safetensors` + `config.json` in transformers' layout.
//!
//! transformers stores GPT-2's linear layers as `Conv1D`, whose weight is (in, out): the
//! transpose of llm.c's (out, in). Names are `transformer.h.N.attn.c_attn.weight` and so on (the
//! `transformer.` prefix is absent in some Hub checkpoints); the LM head is tied to `wte` and
//! usually not stored. Buffers such as `attn.bias` (the causal mask) are ignored.

use crate::checkpoint::{write_atomic, Dtype};
use crate::config::{pad_vocab, GPT2Config};
use crate::model::GPT2;
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The fields of transformers' `GPT2Config` that matter to llmrs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct HfConfig {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "default_act")]
    pub activation_function: String,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_act() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

impl HfConfig {
    /// Parse and check that llmrs computes exactly this model.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let c: HfConfig =
            serde_json::from_str(text).with_context(|| format!("{}: not a GPT-2 config.json", path.display()))?;
        if let Some(inner) = c.n_inner {
            if inner != 4 * c.n_embd {
                bail!("{}: n_inner {inner} is not 4*n_embd; llmrs's GPT-2 has a 4C MLP", path.display());
            }
        }
        if !matches!(c.activation_function.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
            bail!("{}: activation '{}' is not GPT-2's tanh GELU (gelu_new)", path.display(), c.activation_function);
        }
        if (c.layer_norm_epsilon - 1e-5).abs() > 1e-12 {
            bail!("{}: layer_norm_epsilon {} is not 1e-5", path.display(), c.layer_norm_epsilon);
        }
        if !c.tie_word_embeddings {
            bail!("{}: untied word embeddings are not supported (GPT-2 ties the LM head to wte)", path.display());
        }
        Ok(c)
    }

    pub fn to_llmc(&self) -> Result<GPT2Config> {
        let cfg = GPT2Config {
            max_seq_len: self.n_positions,
            vocab_size: self.vocab_size,
            padded_vocab_size: pad_vocab(self.vocab_size),
            num_layers: self.n_layer,
            num_heads: self.n_head,
            channels: self.n_embd,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `config.json` as transformers writes it for a GPT2LMHeadModel of this shape.
pub fn config_json(cfg: &GPT2Config, dtype: Dtype) -> String {
    let v = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": match dtype { Dtype::F32 => "float32", Dtype::BF16 => "bfloat16" },
    });
    serde_json::to_string_pretty(&v).unwrap() + "\n"
}

/// Locate `config.json` and `model.safetensors` for a directory or a `.safetensors` file.
pub fn resolve_paths(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let (dir, st) = if path.is_dir() {
        (path.to_path_buf(), path.join("model.safetensors"))
    } else {
        (path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf), path.to_path_buf())
    };
    let cfg = dir.join("config.json");
    if !st.is_file() {
        bail!("{} not found: a Hugging Face model directory holds model.safetensors and config.json", st.display());
    }
    if !cfg.is_file() {
        bail!("{} not found next to {}: it gives the model's shape", cfg.display(), st.display());
    }
    Ok((cfg, st))
}

/// Convert one stored tensor to f32 (F32, BF16 and F16 are accepted).
fn to_f32(t: &TensorView, name: &str) -> Result<Vec<f32>> {
    let d = t.data();
    Ok(match t.dtype() {
        StDtype::F32 => d.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        StDtype::BF16 => d.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        StDtype::F16 => d.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => bail!("tensor {name} has dtype {other:?}; expected F32, BF16 or F16"),
    })
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

/// Load a Hugging Face GPT-2 (directory or `.safetensors` path) as an llmrs model.
pub fn load_hf(path: &Path) -> Result<GPT2> {
    let (cfg_path, st_path) = resolve_paths(path)?;
    let hf = HfConfig::parse(
        &std::fs::read_to_string(&cfg_path).with_context(|| format!("cannot read {}", cfg_path.display()))?,
        &cfg_path,
    )?;
    let cfg = hf.to_llmc().with_context(|| format!("{}: bad model shape", cfg_path.display()))?;
    let bytes = crate::checkpoint::read_file(&st_path)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", st_path.display()))?;
    let prefix = if st.names().iter().any(|n| n.starts_with("transformer.")) { "transformer." } else { "" };
    // The file must hold every tensor config.json implies (checked before allocating for it).
    let stored: usize = st.tensors().iter().map(|(_, t)| t.shape().iter().product::<usize>()).sum();
    if stored < cfg.num_parameters() - (cfg.padded_vocab_size - cfg.vocab_size) * cfg.channels {
        bail!(
            "{}: holds {stored} values, fewer than the {} parameters config.json describes",
            st_path.display(),
            cfg.num_parameters()
        );
    }
    let mut model = GPT2::zeros(cfg)?;
    let (c, v) = (cfg.channels, cfg.vocab_size);
    // Fetch a tensor, check its shape, optionally transpose a (rows, cols) matrix.
    let get = |name: &str, shape: &[usize], transpose: bool| -> Result<Vec<f32>> {
        let full = format!("{prefix}{name}");
        let t = st.tensor(&full).map_err(|_| anyhow::anyhow!("{}: tensor {full} is missing", st_path.display()))?;
        if t.shape() != shape {
            bail!("{}: tensor {full} has shape {:?}, config.json implies {shape:?}", st_path.display(), t.shape());
        }
        let x = to_f32(&t, &full)?;
        Ok(if transpose { transposed(&x, shape[0], shape[1]) } else { x })
    };
    let lay = model.layout.clone();
    let p = &mut model.params;
    lay.wte.of_mut(p)[..v * c].copy_from_slice(&get("wte.weight", &[v, c], false)?);
    lay.wpe.of_mut(p).copy_from_slice(&get("wpe.weight", &[cfg.max_seq_len, c], false)?);
    for (l, b) in lay.blocks.iter().enumerate() {
        let h = |s: &str| format!("h.{l}.{s}");
        b.ln1_w.of_mut(p).copy_from_slice(&get(&h("ln_1.weight"), &[c], false)?);
        b.ln1_b.of_mut(p).copy_from_slice(&get(&h("ln_1.bias"), &[c], false)?);
        b.qkv_w.of_mut(p).copy_from_slice(&get(&h("attn.c_attn.weight"), &[c, 3 * c], true)?);
        b.qkv_b.of_mut(p).copy_from_slice(&get(&h("attn.c_attn.bias"), &[3 * c], false)?);
        b.attn_proj_w.of_mut(p).copy_from_slice(&get(&h("attn.c_proj.weight"), &[c, c], true)?);
        b.attn_proj_b.of_mut(p).copy_from_slice(&get(&h("attn.c_proj.bias"), &[c], false)?);
        b.ln2_w.of_mut(p).copy_from_slice(&get(&h("ln_2.weight"), &[c], false)?);
        b.ln2_b.of_mut(p).copy_from_slice(&get(&h("ln_2.bias"), &[c], false)?);
        b.fc_w.of_mut(p).copy_from_slice(&get(&h("mlp.c_fc.weight"), &[c, 4 * c], true)?);
        b.fc_b.of_mut(p).copy_from_slice(&get(&h("mlp.c_fc.bias"), &[4 * c], false)?);
        b.fc_proj_w.of_mut(p).copy_from_slice(&get(&h("mlp.c_proj.weight"), &[4 * c, c], true)?);
        b.fc_proj_b.of_mut(p).copy_from_slice(&get(&h("mlp.c_proj.bias"), &[c], false)?);
    }
    lay.lnf_w.of_mut(p).copy_from_slice(&get("ln_f.weight", &[c], false)?);
    lay.lnf_b.of_mut(p).copy_from_slice(&get("ln_f.bias", &[c], false)?);
    if let Ok(head) = st.tensor("lm_head.weight") {
        // A stored head must be the tied embedding.
        if head.shape() != [v, c] || to_f32(&head, "lm_head.weight")? != lay.wte.of(p)[..v * c] {
            bail!("{}: lm_head.weight differs from wte: untied heads are not supported", st_path.display());
        }
    }
    Ok(model)
}

/// Export to a directory with `model.safetensors` and `config.json` that transformers'
/// `GPT2LMHeadModel.from_pretrained` loads. The padded vocab rows are dropped.
pub fn save_hf(model: &GPT2, dir: &Path, dtype: Dtype) -> Result<()> {
    let cfg = model.config;
    let (c, v) = (cfg.channels, cfg.vocab_size);
    let lay = &model.layout;
    let p = &model.params;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![];

    tensors.push(("transformer.wte.weight".into(), vec![v, c], lay.wte.of(p)[..v * c].to_vec()));
    tensors.push(("transformer.wpe.weight".into(), vec![cfg.max_seq_len, c], lay.wpe.of(p).to_vec()));
    for (l, b) in lay.blocks.iter().enumerate() {
        let h = |s: &str| format!("transformer.h.{l}.{s}");
        tensors.push((h("ln_1.weight"), vec![c], b.ln1_w.of(p).to_vec()));
        tensors.push((h("ln_1.bias"), vec![c], b.ln1_b.of(p).to_vec()));
        // llm.c (out, in) -> Conv1D (in, out)
        tensors.push((h("attn.c_attn.weight"), vec![c, 3 * c], transposed(b.qkv_w.of(p), 3 * c, c)));
        tensors.push((h("attn.c_attn.bias"), vec![3 * c], b.qkv_b.of(p).to_vec()));
        tensors.push((h("attn.c_proj.weight"), vec![c, c], transposed(b.attn_proj_w.of(p), c, c)));
        tensors.push((h("attn.c_proj.bias"), vec![c], b.attn_proj_b.of(p).to_vec()));
        tensors.push((h("ln_2.weight"), vec![c], b.ln2_w.of(p).to_vec()));
        tensors.push((h("ln_2.bias"), vec![c], b.ln2_b.of(p).to_vec()));
        tensors.push((h("mlp.c_fc.weight"), vec![c, 4 * c], transposed(b.fc_w.of(p), 4 * c, c)));
        tensors.push((h("mlp.c_fc.bias"), vec![4 * c], b.fc_b.of(p).to_vec()));
        tensors.push((h("mlp.c_proj.weight"), vec![4 * c, c], transposed(b.fc_proj_w.of(p), c, 4 * c)));
        tensors.push((h("mlp.c_proj.bias"), vec![c], b.fc_proj_b.of(p).to_vec()));
    }
    tensors.push(("transformer.ln_f.weight".into(), vec![c], lay.lnf_w.of(p).to_vec()));
    tensors.push(("transformer.ln_f.bias".into(), vec![c], lay.lnf_b.of(p).to_vec()));
    let (st_dtype, bytes): (StDtype, Vec<Vec<u8>>) = match dtype {
        Dtype::F32 => {
            (StDtype::F32, tensors.iter().map(|t| t.2.iter().flat_map(|x| x.to_le_bytes()).collect()).collect())
        }
        Dtype::BF16 => (
            StDtype::BF16,
            tensors.iter().map(|t| t.2.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()).collect(),
        ),
    };
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| Ok((t.0.clone(), TensorView::new(st_dtype, t.1.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let out = safetensors::serialize(views, Some(meta))?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join("model.safetensors"), &[&out])?;
    write_atomic(&dir.join("config.json"), &[config_json(&cfg, dtype).as_bytes()])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_import_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let model = GPT2::random(GPT2Config::from_descriptor("2x16:2:8").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let back = load_hf(dir.path()).unwrap();
        assert_eq!(back.config, model.config);
        assert_eq!(back.params, model.params);
        save_hf(&model, dir.path(), Dtype::BF16).unwrap();
        let back = load_hf(&dir.path().join("model.safetensors")).unwrap();
        for (a, b) in back.params.iter().zip(&model.params) {
            assert!((a - b).abs() <= b.abs() / 128.0);
        }
    }

    #[test]
    fn bad_checkpoints_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let model = GPT2::random(GPT2Config::from_descriptor("1x8:2:8").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let cfg_path = dir.path().join("config.json");
        let good_cfg = std::fs::read_to_string(&cfg_path).unwrap();
        let err = || format!("{:#}", load_hf(dir.path()).err().expect("must fail"));
        std::fs::write(&cfg_path, good_cfg.replace("\"n_embd\": 8", "\"n_embd\": 16")).unwrap();
        assert!(err().contains("fewer than"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("\"n_positions\": 8", "\"n_positions\": 4")).unwrap();
        assert!(err().contains("has shape"), "{}", err());
        std::fs::write(&cfg_path, good_cfg.replace("gelu_new", "relu")).unwrap();
        assert!(err().contains("activation"));
        std::fs::write(&cfg_path, "{not json").unwrap();
        assert!(err().contains("not a GPT-2 config.json"));
        std::fs::write(&cfg_path, &good_cfg).unwrap();
        let st = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&st).unwrap();
        std::fs::write(&st, &bytes[..bytes.len() - 10]).unwrap();
        assert!(err().contains("not a valid safetensors"));
        std::fs::remove_file(&st).unwrap();
        assert!(err().contains("not found"));
    }
}

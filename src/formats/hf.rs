//! Hugging Face checkpoints: `config.json` and safetensors (one `model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) in transformers' layout, for every family.
//!
//! `config.json` names the architecture (`GPT2LMHeadModel`, `LlamaForCausalLM`); the family's
//! file ([`crate::models::gpt2`], [`crate::models::llama`]) turns it into a [`ModelConfig`],
//! writes it back, and lists its tensors as [`HfTensor`]s: transformers' name, where the values
//! live in the flat parameter buffer, the shape as stored, and whether stored transposed. Import
//! and export follow that one table. fp32, bf16 and f16 are read; fp32 and bf16 written.

use crate::core::config::ModelConfig;
use crate::core::files::Dtype;
use crate::core::files::{bf16s_from_le, f32s_from_le, f32s_to_bf16_le, f32s_to_le, read_file, write_atomic};
use crate::core::params::{HfTensor, Weights};
use crate::models;
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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

/// The config file of a PEFT adapter directory (`crate::formats::peft` reads it): a directory
/// holding one instead of a model is named as an adapter.
const PEFT_CONFIG: &str = "adapter_config.json";

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
    let present = crate::core::files::present;
    let shards = if present(&single)? {
        vec![single]
    } else if path.is_dir() && present(&index)? {
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
    } else if path.is_dir() && dir.join(PEFT_CONFIG).is_file() {
        let d = path.display();
        bail!(
            "{d} holds a PEFT adapter ({}), not a model: give its base model with the adapter on top \
             (llmrs convert BASE OUT --lora {d} for the merged model; -e BASE --lora {d} in generate and eval)",
            PEFT_CONFIG
        );
    } else {
        bail!(
            "{} not found: a Hugging Face model directory holds model.safetensors (or shards and \
             model.safetensors.index.json) and config.json",
            single.display()
        );
    };
    if !present(&config)? {
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

/// One safetensors file whose tensors are read one at a time, so that loading never holds a
/// whole file in memory beside the weights it becomes. Its header is checked as the
/// safetensors crate checks it: every tensor's bytes inside the file's data, of its dtype and
/// shape's size.
struct Shard {
    path: PathBuf,
    file: std::fs::File,
    /// Where the data section starts (after the 8-byte length and the JSON header).
    data: u64,
    tensors: HashMap<String, safetensors::tensor::TensorInfo>,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        use std::io::Read;
        crate::core::files::check_regular(path)?;
        let bad = |why: String| anyhow::anyhow!("{}: not a valid safetensors file: {why}", path.display());
        let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let len = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|_| bad(format!("{len} bytes, shorter than its header's length")))?;
        let n = u64::from_le_bytes(n);
        // The crate's limit on a header (100 MB).
        if n > 100_000_000 || n > len - 8 {
            bail!(bad(format!("a header of {n} bytes in a file of {len}")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| bad(format!("cannot read its header: {e}")))?;
        let header = std::str::from_utf8(&header).map_err(|_| bad("its header is not UTF-8".into()))?;
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(header).map_err(|e| bad(format!("its header is not a JSON object: {e}")))?;
        let data_len = len - 8 - n;
        let mut tensors = HashMap::new();
        for (name, v) in map {
            if name == "__metadata__" {
                continue;
            }
            let info: safetensors::tensor::TensorInfo =
                serde_json::from_value(v).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            let (start, end) = info.data_offsets;
            let size =
                info.shape.iter().try_fold(info.dtype.bitsize(), |a, &d| a.checked_mul(d)).map(|bits| bits.div_ceil(8));
            if start > end || end as u64 > data_len || size != Some(end - start) {
                bail!(bad(format!(
                    "tensor {name} ({:?} {:?}) at bytes {start}..{end} of {data_len} does not fit its data",
                    info.dtype, info.shape
                )));
            }
            tensors.insert(name, info);
        }
        Ok(Shard { path: path.to_path_buf(), file, data: 8 + n, tensors })
    }

    /// Tensor `name`'s values as f32.
    fn read(&mut self, name: &str) -> Result<Vec<f32>> {
        let mut x = vec![0f32; self.tensors[name].shape.iter().product()];
        self.read_range(name, 0, &mut x)?;
        Ok(x)
    }

    /// Tensor `name`'s values `off..off + dst.len()` as f32 into `dst`, read in pieces of at
    /// most 64 MiB of the file.
    fn read_range(&mut self, name: &str, off: usize, dst: &mut [f32]) -> Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let info = &self.tensors[name];
        if !matches!(info.dtype, StDtype::F32 | StDtype::BF16 | StDtype::F16) {
            bail!("tensor {name} has dtype {:?}; expected F32, BF16 or F16", info.dtype);
        }
        // (The header was checked: the tensor's bytes are its shape's, which dst's length is.)
        let width = info.dtype.bitsize() / 8;
        let n: usize = info.shape.iter().product();
        assert!(off + dst.len() <= n, "read_range: {name} has {n} values");
        let step = ((64 << 20) / width.max(1)).max(1);
        self.file
            .seek(SeekFrom::Start(self.data + (info.data_offsets.0 + off * width) as u64))
            .with_context(|| format!("cannot read tensor {name} of {}", self.path.display()))?;
        let mut bytes = vec![0u8; step.min(dst.len()) * width];
        for piece in dst.chunks_mut(step) {
            let b = &mut bytes[..piece.len() * width];
            self.file.read_exact(b).with_context(|| format!("cannot read tensor {name} of {}", self.path.display()))?;
            let view = TensorView::new(info.dtype, vec![piece.len()], b)
                .map_err(|e| anyhow::anyhow!("{}: tensor {name}: {e}", self.path.display()))?;
            piece.copy_from_slice(&to_f32(&view, name)?);
        }
        Ok(())
    }
}

/// The shape a Hugging Face model (directory or `.safetensors` path) declares in its
/// config.json, without reading its weights.
pub fn peek_config(path: &Path) -> Result<ModelConfig> {
    let files = resolve(path)?;
    let text = String::from_utf8(read_file(&files.config)?)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", files.config.display()))?;
    crate::models::parse_config(&text, &files.config)
}

/// A Hugging Face checkpoint whose shape and tensor names were checked, its values not read
/// yet ([`HfCheckpoint::read_into`] reads them into a model or [`Weights`]).
pub struct HfCheckpoint {
    cfg: ModelConfig,
    files: Files,
    shards: Vec<Shard>,
    prefix: String,
}

/// Open a Hugging Face model (directory or `.safetensors` path) to be read into parameters of
/// `dtype`: its config.json and the headers of its safetensors files, checked against each
/// other.
pub fn open_hf(path: &Path, dtype: Dtype) -> Result<HfCheckpoint> {
    let files = resolve(path)?;
    let cfg_text = String::from_utf8(read_file(&files.config)?)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", files.config.display()))?;
    let cfg = crate::models::parse_config(&cfg_text, &files.config)?;
    // Refuse what cannot fit (its parameters in `dtype`) before checking the files against a
    // config.json of such a size, or reading gigabytes.
    let file_bytes: u64 = files.shards.iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let what = format!(
        "loading {} ({:.2} GiB of files, {} parameters as {dtype})",
        path.display(),
        file_bytes as f64 / (1u64 << 30) as f64,
        cfg.num_parameters()
    );
    crate::core::mem::check_available(cfg.num_parameters().saturating_mul(dtype.bytes()), &what)?;
    let shards: Vec<Shard> = files.shards.iter().map(|p| Shard::open(p)).collect::<Result<_>>()?;
    let names: Vec<String> = shards.iter().flat_map(|s| s.tensors.keys().cloned()).collect();
    // A tensor stored twice: which copy a loader takes differs (transformers takes the last
    // shard's, an index names one), so the files describe two models.
    let mut seen = std::collections::HashMap::new();
    for (i, s) in shards.iter().enumerate() {
        for n in s.tensors.keys() {
            if let Some(j) = seen.insert(n.as_str(), i) {
                bail!(
                    "tensor {n} is stored twice, in {} and {}: keep one copy (loaders differ on which they take)",
                    files.shards[j].display(),
                    files.shards[i].display()
                );
            }
        }
    }
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
    let stored: usize = shards.iter().flat_map(|s| s.tensors.values()).map(|t| t.shape.iter().product::<usize>()).sum();
    let padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.channels;
    let heads = if cfg.tied_head { 1 } else { 2 };
    if stored < cfg.num_parameters() - heads * padding {
        bail!(
            "{}: holds {stored} values, fewer than the {} parameters config.json describes",
            files.shards[0].display(),
            cfg.num_parameters()
        );
    }
    for e in &table {
        let full = format!("{prefix}{}", e.name);
        let shape = &shards.iter().find_map(|s| s.tensors.get(&full)).expect("checked above").shape;
        if *shape != e.shape {
            let p = &files.shards[shards.iter().position(|s| s.tensors.contains_key(&full)).expect("checked above")];
            bail!("{}: tensor {full} has shape {shape:?}, config.json implies {:?}", p.display(), e.shape);
        }
    }
    Ok(HfCheckpoint { cfg, files, shards, prefix: prefix.to_string() })
}

/// Values per piece in which [`HfCheckpoint::read_into`] reads a tensor (64 MiB of f32).
const PIECE: usize = 1 << 24;

impl HfCheckpoint {
    /// The model's shape, from config.json.
    pub fn config(&self) -> ModelConfig {
        self.cfg
    }

    /// The largest tensor's bytes in the files.
    fn largest_bytes(&self) -> usize {
        self.shards
            .iter()
            .flat_map(|s| s.tensors.values())
            .map(|t| t.data_offsets.1 - t.data_offsets.0)
            .max()
            .unwrap_or(0)
    }

    /// Every parameter into `sink`, in the order of the flat buffer (the vocabulary's padding
    /// rows 0), in pieces of at most [`PIECE`] values (a transposed tensor, GPT-2's Conv1D,
    /// whole), each checked finite: the fp32 values never exist whole unless the sink keeps
    /// them. Returns their [`crate::core::params::weights_hash`].
    pub fn read_into(&mut self, sink: &mut dyn crate::core::params::InitSink) -> Result<String> {
        let cfg = self.cfg;
        let arch = models::arch(&cfg);
        let mut table = arch.hf_tensors(&cfg, sink.layout());
        table.sort_by_key(|e| e.range.start);
        let mut hash = crate::core::params::WeightsHasher::new();
        let mut at = 0;
        let mut piece = vec![];
        for e in &table {
            let full = format!("{}{}", self.prefix, e.name);
            let i = self.shards.iter().position(|s| s.tensors.contains_key(&full)).expect("checked by open_hf");
            let (shard, p) = (&mut self.shards[i], &self.files.shards[i]);
            if e.range.start > at {
                sink.fill(at..e.range.start, 0.0);
                hash.zeros(e.range.start - at);
            }
            let non_finite = |x: &[f32], base: usize| {
                x.iter().position(|v| !v.is_finite()).map(|i| {
                    let j = base + i;
                    // (The element's index as stored.)
                    let j = if e.transposed { (j % e.shape[0]) * e.shape[1] + j / e.shape[0] } else { j };
                    anyhow::anyhow!(
                        "{}: tensor {full} holds {} at element {j}: the weights are corrupt or come from a diverged run",
                        p.display(),
                        x[i]
                    )
                })
            };
            if e.transposed {
                let x = transposed(&shard.read(&full)?, e.shape[0], e.shape[1]);
                if let Some(err) = non_finite(&x, 0) {
                    return Err(err);
                }
                hash.feed(&x);
                sink.write(e.range.start, &x);
            } else {
                for off in (0..e.range.len()).step_by(PIECE) {
                    let n = PIECE.min(e.range.len() - off);
                    piece.resize(n, 0.0);
                    shard.read_range(&full, off, &mut piece)?;
                    if let Some(err) = non_finite(&piece, off) {
                        return Err(err);
                    }
                    hash.feed(&piece);
                    sink.write(e.range.start + off, &piece);
                }
            }
            at = e.range.end;
        }
        let total = cfg.num_parameters();
        if total > at {
            sink.fill(at..total, 0.0);
            hash.zeros(total - at);
        }
        if cfg.tied_head {
            self.check_tied_head(&table)?;
        }
        Ok(hash.finish())
    }

    /// A stored head of a model whose config.json ties it must be the token embedding:
    /// compared piece by piece from the files.
    fn check_tied_head(&mut self, table: &[crate::core::params::HfTensor]) -> Result<()> {
        let Some(i) = self.shards.iter().position(|s| s.tensors.contains_key("lm_head.weight")) else { return Ok(()) };
        let (v, c) = (self.cfg.vocab_size, self.cfg.channels);
        let head_range = models::layout(&self.cfg).range(models::arch(&self.cfg).head(&self.cfg));
        let wte = table.iter().find(|e| e.range.start == head_range.start && !e.transposed);
        let differs = || {
            anyhow::anyhow!(
                "{}: lm_head.weight differs from the token embedding, but config.json ties them \
                 (tie_word_embeddings)",
                self.files.shards[i].display()
            )
        };
        let Some(wte) = wte.filter(|_| self.shards[i].tensors["lm_head.weight"].shape == [v, c]) else {
            return Err(differs());
        };
        let wte_name = format!("{}{}", self.prefix, wte.name);
        let j = self.shards.iter().position(|s| s.tensors.contains_key(&wte_name)).expect("checked by open_hf");
        let (mut a, mut b) = (vec![], vec![]);
        for off in (0..v * c).step_by(PIECE) {
            let n = PIECE.min(v * c - off);
            a.resize(n, 0.0);
            b.resize(n, 0.0);
            self.shards[i].read_range("lm_head.weight", off, &mut a)?;
            self.shards[j].read_range(&wte_name, off, &mut b)?;
            if a != b {
                return Err(differs());
            }
        }
        Ok(())
    }
}

/// Load a Hugging Face model (directory or `.safetensors` path) as llmrs-layout weights.
pub fn load_hf(path: &Path) -> Result<Weights> {
    let mut ck = open_hf(path, Dtype::F32)?;
    let cfg = ck.config();
    // (And a transposed tensor's f32 values: at most the largest's, twice its bf16 bytes.)
    let need = cfg.num_parameters().saturating_mul(4).saturating_add(ck.largest_bytes().saturating_mul(2));
    crate::core::mem::check_available(
        need,
        &format!("loading {} ({} parameters as fp32)", path.display(), cfg.num_parameters()),
    )?;
    let mut w = Weights::zeros(cfg)?;
    ck.read_into(&mut w)?;
    Ok(w)
}

/// Export to a directory with `model.safetensors` and `config.json` that transformers'
/// `from_pretrained` loads. The padded vocab rows are dropped.
pub fn save_hf(w: &Weights, dir: &Path, dtype: Dtype) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_safetensors(&dir.join("model.safetensors"), hf_views(w, dtype), pt_metadata())?;
    write_atomic(&dir.join("config.json"), &[config_json(&w.config, dtype).as_bytes()])?;
    Ok(())
}

/// The metadata transformers expects in a PyTorch checkpoint's safetensors header.
fn pt_metadata() -> HashMap<String, String> {
    HashMap::from([("format".into(), "pt".into())])
}

/// The tensors of a Hugging Face export, by their names there.
fn hf_views(w: &Weights, dtype: Dtype) -> Vec<(String, Lazy<'_>)> {
    let st_dtype = match dtype {
        Dtype::F32 => StDtype::F32,
        Dtype::BF16 => StDtype::BF16,
    };
    let prefix = models::arch(&w.config).hf_prefix();
    // Each tensor's bytes are made when the writer reaches it, so the file never exists whole
    // in memory beside the weights.
    hf_tensors(w)
        .into_iter()
        .map(|e| {
            let x = &w.data[e.range.clone()];
            (format!("{prefix}{}", e.name), Lazy { x, shape: e.shape, transposed: e.transposed, dtype, st_dtype })
        })
        .collect()
}

/// Write `tensors` to `path` in safetensors' format, the bytes `safetensors::serialize` gives
/// (the crate's own header: its `Metadata` as JSON, padded with spaces to 8 bytes; tensors in
/// its order, by dtype then name), each tensor's bytes made as the writer reaches it. Through
/// [`crate::core::files::write_atomic_with`] rather than the crate's `serialize_to_file`, whose
/// temporary file has a random name: a killed export leaves a temporary that the next write
/// of the file knows as llmrs's and removes.
fn write_safetensors<V: safetensors::View>(
    path: &Path,
    mut tensors: Vec<(String, V)>,
    meta: HashMap<String, String>,
) -> Result<()> {
    use safetensors::tensor::{Metadata, TensorInfo};
    tensors.sort_by(|(ln, l), (rn, r)| r.dtype().cmp(&l.dtype()).then(ln.cmp(rn)));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for (name, t) in &tensors {
        let n = t.data_len();
        infos.push((
            name.clone(),
            TensorInfo { dtype: t.dtype(), shape: t.shape().to_vec(), data_offsets: (offset, offset + n) },
        ));
        offset += n;
    }
    let metadata = Metadata::new(Some(meta), infos).map_err(|e| anyhow::anyhow!("safetensors header: {e}"))?;
    let mut header = serde_json::to_string(&metadata)?.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    crate::core::files::write_atomic_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        tensors.iter().try_for_each(|(_, t)| w.write_all(&t.data()))
    })
}

/// A tensor for [`write_safetensors`] whose bytes are made when it is written.
struct Lazy<'a> {
    x: &'a [f32],
    /// As stored.
    shape: Vec<usize>,
    /// Stored as GPT-2's Conv1D (in, out), from llm.c's (out, in) = (shape[1], shape[0]).
    transposed: bool,
    dtype: Dtype,
    st_dtype: StDtype,
}

impl safetensors::View for Lazy<'_> {
    fn dtype(&self) -> StDtype {
        self.st_dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let t;
        let x = if self.transposed {
            t = transposed(self.x, self.shape[1], self.shape[0]);
            &t[..]
        } else {
            self.x
        };
        let mut b = Vec::with_capacity(self.data_len());
        match self.dtype {
            Dtype::F32 => f32s_to_le(x, &mut b),
            Dtype::BF16 => f32s_to_bf16_le(x, &mut b),
        }
        std::borrow::Cow::Owned(b)
    }
    fn data_len(&self) -> usize {
        self.x.len() * self.dtype.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The export is the bytes of `safetensors::serialize` on the same tensors (GPT-2's and
    /// Llama's names and shapes, fp32 and bf16), written under llmrs's temporary name: one a
    /// killed writer left is removed by the next export.
    #[test]
    fn export_is_the_crates_bytes_and_leaves_no_temporary() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        for desc in ["2x16:2:8", "llama:2x16:4:2"] {
            let dir = tempfile::tempdir().unwrap();
            let stale = dir.path().join(format!(".model.safetensors.tmp{dead}_0"));
            std::fs::write(&stale, b"half an export").unwrap();
            let model = Weights::random(ModelConfig::from_descriptor(desc).unwrap(), 7).unwrap();
            for dtype in [Dtype::F32, Dtype::BF16] {
                save_hf(&model, dir.path(), dtype).unwrap();
                let want = safetensors::serialize(hf_views(&model, dtype), Some(pt_metadata())).unwrap();
                assert!(std::fs::read(dir.path().join("model.safetensors")).unwrap() == want, "{desc} {dtype:?}");
            }
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(left.len(), 2, "{desc}: {left:?}");
        }
    }

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

    /// Files that describe two models at once are refused, not read one way: a rotary base
    /// or scaling written twice with different values (transformers 4 and 5 read different
    /// fields), a tensor stored in two shards (loaders differ on which copy they take).
    #[test]
    fn contradictions_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let model = Weights::random(ModelConfig::from_descriptor("llama:1x16:4:2").unwrap(), 7).unwrap();
        save_hf(&model, dir.path(), Dtype::F32).unwrap();
        let cfg_path = dir.path().join("config.json");
        let good: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            std::fs::write(&cfg_path, v.to_string()).unwrap();
            load_hf(dir.path()).map(|w| w.config)
        };
        let theta = good["rope_theta"].as_f64().unwrap();
        let same = with(&|v| v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta}));
        assert_eq!(same.unwrap(), model.config, "agreeing fields are read");
        let e = with(&|v| v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6}));
        let e = format!("{:#}", e.unwrap_err());
        assert!(e.contains("rope_theta") && e.contains("disagree"), "{e}");
        let llama3 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let e = with(&|v| {
            v["rope_scaling"] = llama3.clone();
            v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
        });
        assert!(format!("{:#}", e.unwrap_err()).contains("different rotary scalings"));
        with(&|_| {}).unwrap();
        // Two shards, the second holding another copy of a tensor of the first.
        let sharded = dir.path().join("sharded");
        std::fs::create_dir(&sharded).unwrap();
        std::fs::copy(&cfg_path, sharded.join("config.json")).unwrap();
        std::fs::rename(dir.path().join("model.safetensors"), sharded.join("model-00001-of-00002.safetensors"))
            .unwrap();
        let names: Vec<String> = hf_views(&model, Dtype::F32).into_iter().map(|(n, _)| n).collect();
        let twice = names.iter().find(|n| n.contains("q_proj")).unwrap().clone();
        let copy = hf_views(&model, Dtype::F32).into_iter().filter(|(n, _)| *n == twice).collect();
        write_safetensors(&sharded.join("model-00002-of-00002.safetensors"), copy, pt_metadata()).unwrap();
        let map: serde_json::Map<String, serde_json::Value> = names
            .iter()
            .map(|n| {
                let shard = if *n == twice { 2 } else { 1 };
                (n.clone(), format!("model-0000{shard}-of-00002.safetensors").into())
            })
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let e = format!("{:#}", load_hf(&sharded).unwrap_err());
        assert!(e.contains(&format!("tensor {twice} is stored twice")), "{e}");
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
        assert!(err().contains("not a valid safetensors") && err().contains("does not fit its data"), "{}", err());
        // The header is read alone (the tensors one at a time): a length past the file, a
        // header that is not JSON, a file shorter than the length's 8 bytes.
        let mut long = (u64::MAX / 2).to_le_bytes().to_vec();
        long.extend_from_slice(&bytes[8..]);
        std::fs::write(&st, &long).unwrap();
        assert!(err().contains("not a valid safetensors") && err().contains("a header of"), "{}", err());
        let mut junk = 4u64.to_le_bytes().to_vec();
        junk.extend_from_slice(b"{x:1");
        std::fs::write(&st, &junk).unwrap();
        assert!(err().contains("not a valid safetensors") && err().contains("not a JSON object"), "{}", err());
        std::fs::write(&st, [1u8, 2, 3]).unwrap();
        assert!(err().contains("not a valid safetensors") && err().contains("shorter than"), "{}", err());
        std::fs::remove_file(&st).unwrap();
        assert!(err().contains("not found"));
        // A non-finite weight is named by its tensor and its index as stored, in a tensor read
        // in pieces and in one stored transposed (GPT-2's Conv1D, (in, out)).
        for transposed in [false, true] {
            let mut bad = model.clone();
            let e = hf_tensors(&bad).into_iter().find(|e| e.transposed == transposed).unwrap();
            bad.data[e.range.start + 7] = f32::NAN;
            save_hf(&bad, dir.path(), Dtype::F32).unwrap();
            let at = if transposed { (7 % e.shape[0]) * e.shape[1] + 7 / e.shape[0] } else { 7 };
            let want = format!("tensor {}{} holds NaN at element {at}", models::arch(&bad.config).hf_prefix(), e.name);
            assert!(err().contains(&want), "{} (want {want})", err());
        }
    }
}

//! LoRA adapters (Hu et al. 2021, as Hugging Face PEFT implements them): a frozen projection
//! W (out, in) gains a trained low-rank term, y = x W^T + scale * (x A^T) B^T with A (R, in),
//! B (out, R) and scale = alpha / R. PEFT's `lora_A` initialisation (Kaiming-uniform with
//! a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and zero `lora_B`, so a new adapter starts as the
//! base model.
//!
//! The adapted modules are transformers' linear projections, found from the family's own table
//! of transformers tensors ([`crate::models::family::Arch::hf_tensors`]): every 2-D tensor that
//! lives in a block. Where llmrs fuses projections (Llama's q, k and v in one qkv weight, up
//! and gate in one), an adapter covers its rows of the fused weight ([`Target::row0`]), so a
//! PEFT adapter maps one to one onto llmrs's adapters. The ops are [`crate::backend::ops`]'s
//! (`Adapter`, `BlockLora`); this file holds the adapters' values, their files (PEFT's
//! `adapter_config.json` and `adapter_model.safetensors`) and the merge into the base.

use crate::config::ModelConfig;
use crate::files::{f32s_to_le, read_file, write_atomic, Dtype};
use crate::hf::to_f32;
use crate::models;
use crate::params::{TensorId, Weights};
use crate::rng::Mt19937;
use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

/// The adapter file names PEFT's `save_pretrained` writes.
pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// One adapted projection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// transformers' module path (`model.layers.0.self_attn.q_proj`, `transformer.h.0.attn.c_attn`).
    pub module: String,
    /// Its last name (`q_proj`), what `target_modules` lists.
    pub short: String,
    /// The llmrs tensor and layer holding its weight, and its rows there.
    pub tensor: TensorId,
    pub layer: usize,
    pub row0: usize,
    /// out and in features.
    pub rows: usize,
    pub cols: usize,
    /// Stored transposed by transformers (GPT-2's Conv1D: PEFT's `fan_in_fan_out`).
    pub conv1d: bool,
}

/// Every linear projection of a model of shape `cfg` that LoRA can adapt, in layer order.
pub fn linear_modules(cfg: &ModelConfig) -> Vec<Target> {
    let arch = models::arch(cfg);
    let lay = models::layout(cfg);
    let mut out = vec![];
    for e in arch.hf_tensors(cfg, &lay) {
        let Some(module) = e.name.strip_suffix(".weight") else { continue };
        if e.shape.len() != 2 {
            continue;
        }
        let (rows, cols) = if e.transposed { (e.shape[1], e.shape[0]) } else { (e.shape[0], e.shape[1]) };
        // The block tensor and layer whose values hold these rows (none for the embeddings
        // and the head, which are not adapted).
        let found = lay.block_ids().into_iter().find_map(|t| {
            (0..cfg.num_layers).find_map(|l| {
                let r = lay.layer(t, l);
                (r.start <= e.range.start && e.range.end <= r.end).then_some((t, l, r.start))
            })
        });
        if let Some((tensor, layer, start)) = found {
            let short = module.rsplit('.').next().unwrap_or(module).to_string();
            let module = format!("{}{module}", arch.hf_prefix());
            let row0 = (e.range.start - start) / cols;
            out.push(Target { module, short, tensor, layer, row0, rows, cols, conv1d: e.transposed });
        }
    }
    out
}

/// The names `target_modules` can list for this family (every projection's last name).
pub fn module_names(cfg: &ModelConfig) -> Vec<String> {
    let mut names: Vec<String> = vec![];
    for t in linear_modules(cfg) {
        if !names.contains(&t.short) {
            names.push(t.short);
        }
    }
    names
}

/// The projections `wanted` names, as PEFT matches `target_modules`: a module whose path is a
/// name or ends with `.name`; `all-linear` (or nothing) is every projection. A name that matches
/// none is an error that lists what the family has.
pub fn select(cfg: &ModelConfig, wanted: &[String]) -> Result<Vec<Target>> {
    let all = linear_modules(cfg);
    if wanted.is_empty() || wanted.iter().any(|w| w == "all-linear") {
        return Ok(all);
    }
    let hits = |t: &Target, w: &str| {
        let m = t.module.strip_prefix(models::arch(cfg).hf_prefix()).unwrap_or(&t.module);
        t.module == w || m == w || t.module.ends_with(&format!(".{w}"))
    };
    if let Some(w) = wanted.iter().find(|w| !all.iter().any(|t| hits(t, w))) {
        bail!(
            "LoRA target {w:?}: the {} family has no such projection (it has {}, in layers 0 to {})",
            models::arch(cfg).name(),
            module_names(cfg).join(", "),
            cfg.num_layers.saturating_sub(1)
        );
    }
    Ok(all.into_iter().filter(|t| wanted.iter().any(|w| hits(t, w))).collect())
}

/// The adapters of one model: rank, alpha, the adapted projections and, for each in order,
/// A (R, in) then B (out, R) in one flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapters {
    pub r: usize,
    pub alpha: f32,
    pub targets: Vec<Target>,
    pub data: Vec<f32>,
}

impl Adapters {
    /// New adapters on `targets`: A drawn as PEFT's init from `rng`, B zero.
    pub fn new(r: usize, alpha: f32, targets: Vec<Target>, rng: &mut Mt19937) -> Result<Adapters> {
        if r == 0 {
            bail!("--lora 0: the rank must be at least 1");
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            bail!("--lora-alpha {alpha}: must be a positive number");
        }
        let most = targets.iter().map(|t| t.rows.min(t.cols)).min().unwrap_or(usize::MAX);
        if let Some(t) = targets.iter().find(|t| r > most && t.rows.min(t.cols) == most) {
            bail!("--lora {r}: above the size of {} ({} x {}); use a rank of at most {most}", t.module, t.rows, t.cols);
        }
        let len = values(r, &targets)?;
        let mut a = Adapters { r, alpha, targets, data: vec![0.0; len] };
        for i in 0..a.targets.len() {
            let bound = 1.0 / (a.targets[i].cols as f32).sqrt();
            let ra = a.a_range(i);
            for x in &mut a.data[ra] {
                *x = (rng.next_u32() as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32 * bound;
            }
        }
        Ok(a)
    }

    /// PEFT's scaling, alpha / R.
    pub fn scale(&self) -> f32 {
        self.alpha / self.r as f32
    }

    /// The adapters' values: R * (in + out) per target.
    pub fn num_parameters(&self) -> usize {
        self.targets.iter().map(|t| self.r * (t.cols + t.rows)).sum()
    }

    fn start(&self, i: usize) -> usize {
        self.targets[..i].iter().map(|t| self.r * (t.cols + t.rows)).sum()
    }

    /// Where target i's A (R, in) lives in [`Adapters::data`].
    pub fn a_range(&self, i: usize) -> Range<usize> {
        let s = self.start(i);
        s..s + self.r * self.targets[i].cols
    }

    /// Where target i's B (out, R) lives.
    pub fn b_range(&self, i: usize) -> Range<usize> {
        let s = self.a_range(i).end;
        s..s + self.r * self.targets[i].rows
    }

    /// `target_modules` for PEFT's `adapter_config.json`: the projections' last names when
    /// those name exactly these targets on a base of shape `cfg` (every layer's, and for
    /// GPT-2's `c_proj` both the attention's and the MLP's), else each target's full module
    /// name, which PEFT matches exactly (a run on `--lora-targets layers.1.self_attn.q_proj`
    /// or `attn.c_proj`).
    pub fn target_modules(&self, cfg: &ModelConfig) -> Vec<String> {
        let short = self.target_names();
        let modules = |ts: &[Target]| ts.iter().map(|t| t.module.clone()).collect::<Vec<_>>();
        match select(cfg, &short) {
            Ok(ts) if modules(&ts) == modules(&self.targets) => short,
            _ => modules(&self.targets),
        }
    }

    /// The projections' last names (q_proj, ...), each once, in the targets' order.
    pub fn target_names(&self) -> Vec<String> {
        let mut names: Vec<String> = vec![];
        for t in &self.targets {
            if !names.contains(&t.short) {
                names.push(t.short.clone());
            }
        }
        names
    }

    /// W += scale * (B @ A) for every target: the merged model (PEFT's `merge_and_unload`, in
    /// its order: the product in fp32 by the threaded GEMM, then scaled and added).
    pub fn merge_into(&self, w: &mut Weights) {
        let s = self.scale();
        for (i, t) in self.targets.iter().enumerate() {
            let (a, b) = (&self.data[self.a_range(i)], &self.data[self.b_range(i)]);
            let mut delta = vec![0f32; t.rows * t.cols]; // (out, in)
            let (r_, c_) = (self.r as isize, t.cols as isize);
            crate::cpu::matmul::gemm_strided(
                t.rows,
                t.cols,
                self.r,
                &mut delta,
                (c_, 1),
                false,
                b,
                (r_, 1),
                a,
                (c_, 1),
            );
            let dst = &mut w.layer_mut(t.tensor, t.layer)[t.row0 * t.cols..(t.row0 + t.rows) * t.cols];
            dst.iter_mut().zip(&delta).for_each(|(x, d)| *x += d * s);
        }
    }

    /// Write a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors` in
    /// `dtype`: fp32, or bf16 rounded to nearest even) for the base its targets came from (of
    /// shape `cfg`), which PEFT's `PeftModel.from_pretrained` loads onto that base. `base` names
    /// the base model in the config.
    pub fn save_peft(&self, dir: &Path, base: &str, cfg: &ModelConfig, dtype: Dtype) -> Result<()> {
        let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
        for (i, t) in self.targets.iter().enumerate() {
            for (part, range, shape) in
                [("lora_A", self.a_range(i), vec![self.r, t.cols]), ("lora_B", self.b_range(i), vec![t.rows, self.r])]
            {
                let mut b = vec![];
                match dtype {
                    Dtype::F32 => f32s_to_le(&self.data[range], &mut b),
                    Dtype::BF16 => crate::files::f32s_to_bf16_le(&self.data[range], &mut b),
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
        let conv1d = self.targets.iter().any(|t| t.conv1d);
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.r,
            "lora_alpha": self.alpha,
            "target_modules": self.target_modules(cfg),
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
    pub fn load_peft(cfg: &ModelConfig, dir: &Path, training: bool) -> Result<Adapters> {
        let cpath = dir.join(CONFIG_FILE);
        let text = String::from_utf8(read_file(&cpath)?)
            .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", cpath.display()))?;
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
            for (part, range, shape) in
                [("lora_A", a.a_range(i), [a.r, t.cols]), ("lora_B", a.b_range(i), [t.rows, a.r])]
            {
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
}

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

    /// Load the base: `source` (or `other`, a spec the user gave instead), checked to hash as
    /// the one the adapters were trained on.
    pub fn load(&self, other: Option<&str>) -> Result<Weights> {
        let spec = other.unwrap_or(&self.source);
        let w = crate::source::load_any(spec, self.seed)
            .with_context(|| format!("the LoRA base model {spec} (moved? give it with -e)"))?;
        self.check(spec, &weights_hash(&w))?;
        Ok(w)
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

/// A hash of the values of `w` (64-bit, over their bits), in hex.
pub fn weights_hash(w: &Weights) -> String {
    let mut h = WeightsHasher::new();
    h.feed(&w.data);
    h.finish()
}

/// [`weights_hash`] of values fed in order, in pieces (a base read straight into a model).
pub struct WeightsHasher {
    lanes: [u64; 4],
    n: u64,
}

impl Default for WeightsHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightsHasher {
    pub fn new() -> Self {
        WeightsHasher { lanes: [0xcbf29ce484222325u64; 4], n: 0 }
    }

    /// FNV-1a's constants over 32-bit words, folded from 4 lanes (value i to lane i % 4): fast
    /// on gigabytes, and any changed value changes it with overwhelming likelihood.
    pub fn feed(&mut self, x: &[f32]) {
        let mut x = x;
        while !self.n.is_multiple_of(4) && !x.is_empty() {
            self.one(x[0]);
            x = &x[1..];
        }
        let chunks = x.chunks_exact(4);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (l, v) in self.lanes.iter_mut().zip(chunk) {
                *l = (*l ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
            }
        }
        self.n += (x.len() - rest.len()) as u64;
        rest.iter().for_each(|&v| self.one(v));
    }

    fn one(&mut self, v: f32) {
        let l = &mut self.lanes[(self.n % 4) as usize];
        *l = (*l ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
        self.n += 1;
    }

    /// `n` zeros.
    pub fn zeros(&mut self, n: usize) {
        let z = [0f32; 1024];
        for i in (0..n).step_by(1024) {
            self.feed(&z[..1024.min(n - i)]);
        }
    }

    pub fn finish(&self) -> String {
        let h = self.lanes.iter().fold(self.n, |h, l| (h ^ l).wrapping_mul(0x100000001b3).rotate_left(29));
        format!("{h:016x}")
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
    let config: serde_json::Value = serde_json::from_str(&crate::hf::config_json(cfg, Dtype::F32))?;
    let modules: Vec<&str> = a.targets.iter().map(|t| t.module.as_str()).collect();
    let json =
        serde_json::json!({"base_config": config, "base": base, "r": a.r, "lora_alpha": a.alpha, "modules": modules});
    let json = serde_json::to_string(&json)?;
    let mut h = [0i32; crate::files::HEADER_INTS];
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
    let h = crate::files::parse_header(&bytes, path, "LoRA checkpoint")?;
    if h[0] != LORA_MAGIC {
        bail!("{p} is not a LoRA checkpoint (magic {}, expected {LORA_MAGIC})", h[0]);
    }
    if h[1] != LORA_VERSION {
        bail!("{p}: LoRA checkpoint version {} is not supported (expected {LORA_VERSION})", h[1]);
    }
    let hb = crate::files::HEADER_BYTES;
    let len =
        usize::try_from(h[2]).ok().filter(|&n| n > 0 && n < 1 << 26).with_context(|| format!("{p}: bad header"))?;
    let text = bytes.get(hb..hb + len).with_context(|| format!("{p}: truncated header"))?;
    let v: serde_json::Value = serde_json::from_slice(text).with_context(|| format!("{p}: corrupt header"))?;
    let cfg_text = serde_json::to_string(&v["base_config"])?;
    let cfg = crate::hf::parse_config(&cfg_text, path)?;
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
    crate::files::f32s_from_le(vals, &mut data);
    if data.iter().any(|x| !x.is_finite()) {
        bail!("{p}: the adapters hold non-finite values (a diverged run)");
    }
    Ok((cfg, Adapters { r, alpha, targets, data }, base))
}

/// Adapters for a base of shape `cfg` from `path`: a PEFT adapter directory, or a LoRA run's
/// checkpoint (its base checked to be of the same shape). `training`: as [`Adapters::load_peft`].
pub fn load_adapters(path: &Path, cfg: &ModelConfig, training: bool) -> Result<Adapters> {
    if path.is_dir() {
        return Adapters::load_peft(cfg, path, training);
    }
    let (c, a, _) = load_checkpoint(path)?;
    if !c.same_shape(cfg) {
        bail!("{}: adapters for a base of shape {c}, not {cfg}", path.display());
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

/// The merged model (PEFT's `merge_and_unload`) of base `spec` and the adapters at `lora` (a
/// PEFT directory, or a LoRA checkpoint, whose base `spec` must be). A descriptor's random base
/// is drawn with `seed`, or for a checkpoint with the checkpoint's own seed unless `seed_given`
/// (a seed the user chose, then checked like any other base by the values' hash).
pub fn load_merged(spec: &str, seed: u32, seed_given: bool, lora: &Path) -> Result<Weights> {
    let (mut w, a) = if lora.is_dir() {
        let w = crate::source::load_any(spec, seed)?;
        let a = Adapters::load_peft(&w.config, lora, false)?;
        (w, a)
    } else {
        // Its base is checked by hash, so the adapters fit it.
        let (_, a, mut base) = load_checkpoint(lora)?;
        let want = base.clone();
        if seed_given {
            base.seed = seed;
        }
        let w = crate::source::load_any(spec, base.seed)
            .with_context(|| format!("--lora {}: its base model {spec}", lora.display()))?;
        want.check(spec, &weights_hash(&w)).with_context(|| match seed_given && seed != want.seed {
            true => format!("--lora {} with --seed {seed} (leave --seed out to draw its base's seed)", lora.display()),
            false => format!("--lora {}", lora.display()),
        })?;
        (w, a)
    };
    a.merge_into(&mut w);
    Ok(w)
}

/// The adapters' values for rank `r` on `targets`, R * (in + out) each; an error when that
/// overflows (a corrupt or hostile rank).
fn values(r: usize, targets: &[Target]) -> Result<usize> {
    targets
        .iter()
        .try_fold(0usize, |n, t| t.cols.checked_add(t.rows)?.checked_mul(r)?.checked_add(n))
        .with_context(|| format!("rank {r}: the adapters would not fit in memory"))
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

    /// The hash of values fed in pieces of any lengths, and of zeros fed as a count, is the
    /// hash of the whole.
    #[test]
    fn hashing_in_pieces_is_hashing_the_whole() {
        let cfg = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        let mut w = Weights::random(cfg, 3).unwrap();
        w.data[10..50].fill(0.0);
        let whole = weights_hash(&w);
        for cut in [1, 3, 7, 33, 1001] {
            let mut h = WeightsHasher::new();
            w.data.chunks(cut).for_each(|x| h.feed(x));
            assert_eq!(h.finish(), whole, "pieces of {cut}");
        }
        let mut h = WeightsHasher::new();
        h.feed(&w.data[..10]);
        h.zeros(40);
        h.feed(&w.data[50..]);
        assert_eq!(h.finish(), whole, "zeros as a count");
        w.data[3] += 1.0;
        assert_ne!(weights_hash(&w), whole);
    }

    #[test]
    fn targets_cover_every_projection_and_their_rows() {
        let cfg = ModelConfig::from_descriptor("llama:2x16:4:2").unwrap();
        let all = linear_modules(&cfg);
        assert_eq!(module_names(&cfg), ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"]);
        assert_eq!(all.len(), 14);
        let q = &all[0];
        assert_eq!((q.module.as_str(), q.row0, q.rows, q.cols), ("model.layers.0.self_attn.q_proj", 0, 16, 16));
        let k = &all[1];
        assert_eq!((k.row0, k.rows), (16, cfg.kv_dim()));
        let g = select(&cfg, &["gpt".into()]).unwrap_err().to_string();
        assert!(g.contains("no such projection") && g.contains("q_proj"), "{g}");
        assert_eq!(select(&cfg, &["q_proj".into(), "self_attn.v_proj".into()]).unwrap().len(), 4);
        let gpt = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        assert_eq!(module_names(&gpt), ["c_attn", "c_proj", "c_fc"]);
        let t = select(&gpt, &["attn.c_proj".into()]).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].module, "transformer.h.0.attn.c_proj");
    }

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
            a.save_peft(&dir, "base", &cfg, Dtype::F32).unwrap();
            assert_eq!(Adapters::load_peft(&cfg, &dir, true).unwrap(), a);
            let other =
                ModelConfig::from_descriptor(if desc.starts_with("llama") { "llama:2x24:4:2" } else { "2x24:2:8" })
                    .unwrap();
            let e = Adapters::load_peft(&other, &dir, true).unwrap_err().to_string();
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
            a.save_peft(&dir, "base", &cfg, Dtype::F32).unwrap();
            edit(&dir);
            Adapters::load_peft(&cfg, &dir, true).unwrap_err().to_string()
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
            a.save_peft(&dir, "base", &cfg, Dtype::F32).unwrap();
            let back = Adapters::load_peft(&cfg, &dir, true).unwrap();
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

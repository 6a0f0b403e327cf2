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
//! (`Adapter`, `BlockLora`); this file holds the adapters' targets and values and the merge
//! into the base. Their files are [`crate::formats::peft`] (PEFT's) and
//! [`crate::formats::lora`] (a LoRA run's checkpoint).

use super::{Last, LoraState, Model};
use crate::backend::ops::{Adapter, BlockLora};
use crate::backend::DType;
use crate::core::config::ModelConfig;
use crate::core::params::{TensorId, Weights};
use crate::core::rng::Mt19937;
use crate::models;
use anyhow::{bail, Context, Result};
use std::ops::Range;

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
            crate::backend::cpu::gemm::gemm_strided(
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
}

/// The adapters' values for rank `r` on `targets`, R * (in + out) each; an error when that
/// overflows (a corrupt or hostile rank).
pub fn values(r: usize, targets: &[Target]) -> Result<usize> {
    targets
        .iter()
        .try_fold(0usize, |n, t| t.cols.checked_add(t.rows)?.checked_mul(r)?.checked_add(n))
        .with_context(|| format!("rank {r}: the adapters would not fit in memory"))
}

impl Model {
    /// Make this a LoRA run ([`crate::model::lora`]): the base parameters are frozen (no gradients,
    /// no AdamW state: backward computes only what the adapters and the inputs need) and the
    /// adapters are added to the projections they adapt in every pass. Call before
    /// [`Model::alloc_training_state`]. Every backend runs it, as one process or over ranks:
    /// the adapters and their gradients are every rank's; ZeRO-1..3 shard their AdamW state
    /// and update, and ZeRO-3 shards the frozen base as in a full run.
    pub fn set_lora(&mut self, adapters: &crate::model::lora::Adapters) -> Result<()> {
        if self.lora.is_some() || self.train.is_some() {
            bail!("LoRA adapters are set once, before the training state is allocated");
        }
        if let Some(work) = self.work.take() {
            // A frozen base needs no master weights: keep its bf16 copy only.
            self.be.free(self.params);
            self.params = work;
        }
        let all = crate::model::lora::linear_modules(&self.config);
        if let Some(t) = adapters.targets.iter().find(|t| !all.contains(t)) {
            bail!("LoRA target {} is not a projection of this model", t.module);
        }
        // Padded to a multiple of the ranks, so that ZeRO-1..3 can shard their AdamW state.
        let len = adapters.num_parameters();
        let world = self.comm.world();
        let params = self.be.alloc(len.div_ceil(world).max(1) * world, DType::F32)?;
        self.be.fill(params, 0.0);
        self.be.upload(params.prefix(len), &adapters.data);
        // The frozen tensors that backward still writes (norms, biases): disjoint slices of one
        // sink, as large as the larger of a block's and the outer tensors' sets.
        let small = |ids: Vec<TensorId>| -> usize {
            ids.into_iter()
                .filter(|&t| self.layout.spec(t).shape.len() < 2)
                .map(|t| self.layout.spec(t).numel_per_layer())
                .sum()
        };
        let sink_len = small(self.layout.block_ids()).max(small(self.layout.outer_ids())).max(1);
        let sink = self.be.alloc(sink_len, DType::F32)?;
        // Backward adds to it (the norms' weight gradients): finite, never read.
        self.be.fill(sink, 0.0);
        // Workspaces for a pass over the activations' positions or a KV cache's (at most maxT).
        let n = self.acts.as_ref().map_or(0, |a| a.cap_b * a.cap_t).max(self.config.max_seq_len);
        let scratch = self.be.alloc(2 * n * adapters.r, DType::F32)?;
        let meta = crate::model::lora::Adapters { data: vec![], ..adapters.clone() };
        self.lora = Some(LoraState { meta, params, blocks: vec![], sink, scratch, kept: None });
        self.wire_lora();
        self.last = Last::default();
        Ok(())
    }

    /// The LoRA run's adapters (rank, alpha, targets; no values), if any.
    pub fn lora(&self) -> Option<&crate::model::lora::Adapters> {
        self.lora.as_ref().map(|lo| &lo.meta)
    }

    /// A host copy of the adapters' values.
    pub fn read_adapters(&mut self) -> Result<Vec<f32>> {
        let lo = self.lora.as_ref().context("not a LoRA run")?;
        let b = lo.params.prefix(lo.meta.num_parameters());
        let mut out = vec![0f32; b.len];
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// Tell every block's ops where its adapters, their gradients and workspaces are.
    pub(super) fn wire_lora(&mut self) {
        let grads = self.train.map(|tr| tr.grads);
        // The weight as the block's pass sees it: a view of the parameters, or under ZeRO-3 of
        // the one-block buffer every layer's weights are gathered into.
        let gathered = self.gathered.map(|g| self.zero.block_bucket().0.map(|r| g.block.slice(r.clone())));
        let Some(lo) = &mut self.lora else { return };
        let scratch = lo.scratch;
        let (h, dh) = (scratch.prefix(scratch.len / 2), scratch.slice(scratch.len / 2..scratch.len));
        let per_target = lo.kept.map_or(0, |k| k.len / lo.meta.targets.len().max(1));
        let mut blocks: Vec<BlockLora> =
            (0..self.config.num_layers).map(|_| BlockLora { adapters: vec![], h, dh }).collect();
        for (i, t) in lo.meta.targets.iter().enumerate() {
            let (ra, rb) = (lo.meta.a_range(i), lo.meta.b_range(i));
            blocks[t.layer].adapters.push(Adapter {
                weight: match &gathered {
                    Some(v) => v[t.tensor],
                    None => self.params.slice(self.layout.layer(t.tensor, t.layer)),
                },
                a: lo.params.slice(ra.clone()),
                b: lo.params.slice(rb.clone()),
                grads: grads.map(|g| (g.slice(ra), g.slice(rb))),
                kept_h: lo.kept.map(|k| k.slice(i * per_target..(i + 1) * per_target)),
                r: lo.meta.r,
                row0: t.row0,
                rows: t.rows,
                scale: lo.meta.scale(),
            });
        }
        lo.blocks = blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

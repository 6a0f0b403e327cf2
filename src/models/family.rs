//! What a model family is: one trait, [`Arch`], that a family's file implements and
//! [`crate::models`] registers. Shared code (the model's passes, AdamW, ZeRO, checkpoints,
//! generation, Hugging Face import and export) asks the family and names none.

use crate::backend::ops::{Ops, Seq};
use crate::backend::Buf;
use crate::core::config::ModelConfig;
use crate::core::files::Dtype;
use crate::core::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View, Weights};
use crate::core::rng::Mt19937;
use crate::models::acts::{ActPlan, BackActs, BlockActs, NormActs};
use anyhow::{bail, Result};
use std::path::Path;

/// How a block's attention sees its positions.
#[derive(Clone, Copy, Debug)]
pub enum Attn {
    /// B whole sequences of T positions (training and evaluation).
    Causal(Seq),
    /// New positions of one sequence after `pos` cached ones; k and v (cap, KV*HS) hold the cache.
    /// Only the last `keep` positions' outputs are read (a prompt's last layer: the last one,
    /// whose logits pick the next token): past attention, the block runs on those alone.
    Cached { k: Buf, v: Buf, pos: usize, cap: usize, keep: usize },
}

impl Attn {
    /// How many of the block's `n` positions go on past attention (the last ones).
    pub fn keep(self, n: usize) -> usize {
        match self {
            Attn::Causal(_) => n,
            Attn::Cached { keep, .. } => keep.min(n),
        }
    }
}

/// What a pass reads besides the activations and the weights: a table the family computes once
/// (Llama's rotary table), on the device.
#[derive(Clone, Copy, Debug, Default)]
pub struct Consts {
    pub table: Option<Buf>,
}

/// A model family: its configuration, tensors, activations, the block's list of calls forward
/// and backward, and its files. Implemented by one file each under `src/models/`.
pub trait Arch: Sync {
    /// Its name in configs and messages (`gpt2`, `llama`).
    fn name(&self) -> &'static str;

    // ---- configuration ----------------------------------------------------------------------

    /// The config a descriptor names (`d12`, `llama:smollm2-135m`, ...), or None when the
    /// descriptor is not this family's.
    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>>;
    /// The descriptors it takes, for messages and `--help`.
    fn descriptor_help(&self) -> &'static str;
    /// Refuse a config this family does not compute (after [`ModelConfig::validate_dims`]).
    fn validate(&self, cfg: &ModelConfig) -> Result<()>;

    // ---- parameters -------------------------------------------------------------------------

    /// Its tensors, in file order.
    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec>;
    /// Its random init, drawn from `rng` in a fixed order.
    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937);
    /// The tensor the LM head multiplies by (the token embedding when tied).
    fn head(&self, cfg: &ModelConfig) -> TensorId;

    // ---- the passes -------------------------------------------------------------------------

    /// The activations its block keeps and the backward's buffers.
    fn acts(&self, cfg: &ModelConfig) -> ActPlan;
    /// A table computed once and uploaded (Llama's rotary table), or None.
    fn host_consts(&self, _cfg: &ModelConfig) -> Option<Vec<f32>> {
        None
    }
    /// The embedding: out (N, C) from the token ids (N) at positions pos...
    #[allow(clippy::too_many_arguments)]
    fn embed(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, out: Buf, ids: Buf, s: Seq, pos: usize);
    /// Its backward (training, pos 0): the scatter into the embedding's gradients.
    fn embed_backward(&self, ops: &mut Ops, cfg: &ModelConfig, dw: &View<Buf>, dout: Buf, ids: Buf, s: Seq);
    /// One block over N positions: x.res_out from x.res_in.
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        k: &Consts,
        w: &View<Buf>,
        x: &BlockActs,
        n: usize,
        attn: Attn,
    );
    /// Backward of [`Arch::block_forward`] (training): d.dres holds d(res_out) on entry and
    /// d(res_in) on return (unless not `d.input_grad`: then what it holds is never read);
    /// parameter gradients go to `dw` (added to, or overwritten when not `acc`, for the tensors
    /// backward writes whole).
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        k: &Consts,
        w: &View<Buf>,
        dw: &View<Buf>,
        x: &BlockActs,
        d: &BackActs,
        s: Seq,
        acc: bool,
    );
    /// The final norm of x (N, C) into a.out.
    fn final_norm(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, a: &NormActs, x: Buf, n: usize);
    /// Its backward: dx (N, C) += ..., from dout (N, C).
    #[allow(clippy::too_many_arguments)]
    fn final_norm_backward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        w: &View<Buf>,
        dw: &View<Buf>,
        a: &NormActs,
        dx: Buf,
        dout: Buf,
        x: Buf,
        n: usize,
    );

    // ---- files ------------------------------------------------------------------------------

    /// transformers' `architectures[0]` and `model_type` for this family.
    fn hf_names(&self) -> (&'static str, &'static str);
    /// A config.json of this family, checked to be a model llmrs computes exactly.
    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig>;
    /// config.json as transformers writes it for a model of this shape.
    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value;
    /// transformers' tensors and where their values live.
    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor>;
    /// A prefix some of this family's checkpoints put before every tensor name (GPT-2's
    /// `transformer.`): read with or without it, written with it.
    fn hf_prefix(&self) -> &'static str {
        ""
    }
    /// Names transformers saves beside the weights that are no parameters (buffers).
    fn hf_ignored(&self, name: &str) -> bool {
        name.ends_with("rotary_emb.inv_freq")
    }

    /// The magic of llm.c's model file for this family, where llm.c has one; other families'
    /// checkpoints are llmrs's own model file ([`crate::formats::llmc`]).
    fn llmc_magic(&self) -> Option<i32> {
        None
    }
    /// llm.c's header for `cfg`, refused when the file cannot hold the model.
    fn llmc_header(&self, _cfg: &ModelConfig, _dtype: Dtype) -> Result<Vec<u8>> {
        bail!("llm.c has no model file for the {} family", self.name())
    }
    /// The header and the values of llm.c's model file (the weights' own, or a reordered copy).
    fn llmc_write<'a>(&self, _w: &'a Weights, _dtype: Dtype) -> Result<(Vec<u8>, std::borrow::Cow<'a, [f32]>)> {
        bail!("llm.c has no model file for the {} family", self.name())
    }
    /// Read llm.c's model file (its magic recognised), its values a piece at a time.
    fn llmc_read(&self, f: &mut crate::core::files::ModelFile) -> Result<Weights> {
        bail!("{}: llm.c has no model file for the {} family", f.path.display(), self.name())
    }
    /// The shape in llm.c's header (its first 2 KiB), without the values.
    fn llmc_config(&self, _bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        bail!("{}: llm.c has no model file for the {} family", path.display(), self.name())
    }
}

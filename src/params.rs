//! The parameter tensors by name, where each lives in the one flat parameter buffer, and a
//! model's weights in host memory.
//!
//! All parameters (and, with the same layout, their gradients and the AdamW moments) live in one
//! buffer, tensor after tensor in [`Tensor::ALL`]'s order (llm.c's file order for GPT-2 and for
//! Llama), so the optimizer, checkpoints and collectives work on one flat buffer. Which tensors
//! a model has and their shapes are its family's ([`crate::models`]); a tensor the family does
//! not have takes no space. Code reaches a tensor by name, `layout.layer(Tensor::QkvW, l)` or
//! `layout.block(l).qkv_w`, never by an offset computed at the call site. The parameter count
//! is computed here and nowhere else ([`Tensor::numel`]).

use crate::config::ModelConfig;
use crate::rng::Mt19937;
use anyhow::Result;
use std::ops::Range;

/// Every parameter tensor of every family, in file order. The per-layer ones are stacked over
/// the L blocks, e.g. `QkvW` is (L, QKV, C). Shapes are (out, in) for the weights of a
/// projection; what each tensor holds in a family is described in [`crate::models`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tensor {
    Wte,      // (Vp, C) token embedding (and the tied LM head)
    Wpe,      // (maxT, C) GPT-2's learned positions
    LmHead,   // (Vp, C) an untied LM head (Llama)
    Ln1W,     // (L, C) the attention's norm
    Ln1B,     // (L, C)
    QkvW,     // (L, QKV, C) q, k and v stacked
    QkvB,     // (L, QKV)
    AttProjW, // (L, C, C)
    AttProjB, // (L, C)
    Ln2W,     // (L, C) the MLP's norm
    Ln2B,     // (L, C)
    FcW,      // (L, F or 2F, C) GPT-2's fc; Llama's up and gate projections stacked
    FcB,      // (L, F)
    FcProjW,  // (L, C, F)
    FcProjB,  // (L, C)
    LnfW,     // (C) the final norm
    LnfB,     // (C)
}

impl Tensor {
    /// All of them, in file order.
    pub const ALL: [Tensor; 17] = [
        Tensor::Wte,
        Tensor::Wpe,
        Tensor::LmHead,
        Tensor::Ln1W,
        Tensor::Ln1B,
        Tensor::QkvW,
        Tensor::QkvB,
        Tensor::AttProjW,
        Tensor::AttProjB,
        Tensor::Ln2W,
        Tensor::Ln2B,
        Tensor::FcW,
        Tensor::FcB,
        Tensor::FcProjW,
        Tensor::FcProjB,
        Tensor::LnfW,
        Tensor::LnfB,
    ];

    /// The twelve tensors of a block, in file order (those of [`Tensor::ALL`] between the
    /// embeddings and the final norm).
    pub const BLOCK: [Tensor; 12] = {
        let mut b = [Tensor::Wte; 12];
        let mut i = 0;
        while i < 12 {
            b[i] = Tensor::ALL[i + 3];
            i += 1;
        }
        b
    };

    /// llm.c's name for the tensor (`wte`, `qkvw`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Tensor::Wte => "wte",
            Tensor::Wpe => "wpe",
            Tensor::LmHead => "lmhead",
            Tensor::Ln1W => "ln1w",
            Tensor::Ln1B => "ln1b",
            Tensor::QkvW => "qkvw",
            Tensor::QkvB => "qkvb",
            Tensor::AttProjW => "attprojw",
            Tensor::AttProjB => "attprojb",
            Tensor::Ln2W => "ln2w",
            Tensor::Ln2B => "ln2b",
            Tensor::FcW => "fcw",
            Tensor::FcB => "fcb",
            Tensor::FcProjW => "fcprojw",
            Tensor::FcProjB => "fcprojb",
            Tensor::LnfW => "lnfw",
            Tensor::LnfB => "lnfb",
        }
    }

    /// True for the tensors stacked over the L blocks.
    pub fn per_layer(self) -> bool {
        Tensor::BLOCK.contains(&self)
    }

    /// Shape of the tensor in a model of `cfg`, per layer for the stacked ones; None when its
    /// family does not have it.
    pub fn shape(self, cfg: &ModelConfig) -> Option<Vec<usize>> {
        crate::models::shape(cfg, self)
    }

    /// Elements of one layer's tensor (of the whole tensor when it is not per layer); 0 when
    /// the model does not have it.
    pub fn numel_per_layer(self, cfg: &ModelConfig) -> usize {
        self.shape(cfg).map_or(0, |s| s.iter().product())
    }

    /// Elements of the whole (stacked) tensor.
    pub fn numel(self, cfg: &ModelConfig) -> usize {
        self.numel_per_layer(cfg) * if self.per_layer() { cfg.num_layers } else { 1 }
    }

    /// Whether AdamW applies weight decay: the 2-D weights (matrices and embeddings), as
    /// llm.c's train_gpt2.cu and PyTorch's `p.dim() >= 2` rule.
    pub fn weight_decay(self, cfg: &ModelConfig) -> bool {
        self.shape(cfg).is_some_and(|s| s.len() == 2)
    }

    /// Whether a backward pass writes the whole gradient through a matmul, so that the first
    /// backward after a zero_grad can overwrite it instead of adding to it (every other
    /// gradient is added to and must be cleared).
    pub fn written_whole_by_backward(self, cfg: &ModelConfig) -> bool {
        crate::models::written_whole_by_backward(cfg, self)
    }
}

/// The tensors a model of `cfg` has, in file order.
pub fn tensors(cfg: &ModelConfig) -> Vec<Tensor> {
    Tensor::ALL.into_iter().filter(|t| t.numel(cfg) > 0).collect()
}

/// One transformer block's tensors, as ranges of the flat buffer ([`ParamLayout::block`]) or
/// mapped to anything else with [`Block::map`] (a backend's buffer handles, host slices). A
/// tensor the model's family does not have is an empty range or buffer.
#[derive(Clone, Copy, Debug)]
pub struct Block<T> {
    pub ln1_w: T,       // (C)
    pub ln1_b: T,       // (C)
    pub qkv_w: T,       // (QKV, C)
    pub qkv_b: T,       // (QKV)
    pub attn_proj_w: T, // (C, C)
    pub attn_proj_b: T, // (C)
    pub ln2_w: T,       // (C)
    pub ln2_b: T,       // (C)
    pub fc_w: T,        // (F or 2F, C)
    pub fc_b: T,        // (F)
    pub fc_proj_w: T,   // (C, F)
    pub fc_proj_b: T,   // (C)
}

impl<T: Clone> Block<T> {
    /// The field of block tensor `t` (one of [`Tensor::BLOCK`]).
    pub fn get(&self, t: Tensor) -> T {
        let f = match t {
            Tensor::Ln1W => &self.ln1_w,
            Tensor::Ln1B => &self.ln1_b,
            Tensor::QkvW => &self.qkv_w,
            Tensor::QkvB => &self.qkv_b,
            Tensor::AttProjW => &self.attn_proj_w,
            Tensor::AttProjB => &self.attn_proj_b,
            Tensor::Ln2W => &self.ln2_w,
            Tensor::Ln2B => &self.ln2_b,
            Tensor::FcW => &self.fc_w,
            Tensor::FcB => &self.fc_b,
            Tensor::FcProjW => &self.fc_proj_w,
            Tensor::FcProjB => &self.fc_proj_b,
            _ => panic!("{} is not a block tensor", t.name()),
        };
        f.clone()
    }
}

impl<T> Block<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Block<U> {
        Block {
            ln1_w: f(self.ln1_w),
            ln1_b: f(self.ln1_b),
            qkv_w: f(self.qkv_w),
            qkv_b: f(self.qkv_b),
            attn_proj_w: f(self.attn_proj_w),
            attn_proj_b: f(self.attn_proj_b),
            ln2_w: f(self.ln2_w),
            ln2_b: f(self.ln2_b),
            fc_w: f(self.fc_w),
            fc_b: f(self.fc_b),
            fc_proj_w: f(self.fc_proj_w),
            fc_proj_b: f(self.fc_proj_b),
        }
    }
}

/// The tensors outside the blocks, as ranges of the flat buffer or anything else (see
/// [`Block`]): what the embedding and the head of a pass read.
#[derive(Clone, Copy, Debug)]
pub struct Outer<T> {
    pub wte: T,     // (Vp, C)
    pub wpe: T,     // (maxT, C) or empty
    pub lm_head: T, // (Vp, C) or empty (tied)
    pub lnf_w: T,   // (C)
    pub lnf_b: T,   // (C) or empty
}

impl<T> Outer<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Outer<U> {
        Outer {
            wte: f(self.wte),
            wpe: f(self.wpe),
            lm_head: f(self.lm_head),
            lnf_w: f(self.lnf_w),
            lnf_b: f(self.lnf_b),
        }
    }
}

impl<T> Outer<T> {
    /// From the tensors in [`OUTER`]'s order.
    pub fn from_array([wte, wpe, lm_head, lnf_w, lnf_b]: [T; 5]) -> Self {
        Outer { wte, wpe, lm_head, lnf_w, lnf_b }
    }
}

impl<T: Clone> Outer<T> {
    /// The field of tensor `t` (one of [`OUTER`]).
    pub fn get(&self, t: Tensor) -> T {
        match t {
            Tensor::Wte => self.wte.clone(),
            Tensor::Wpe => self.wpe.clone(),
            Tensor::LmHead => self.lm_head.clone(),
            Tensor::LnfW => self.lnf_w.clone(),
            Tensor::LnfB => self.lnf_b.clone(),
            _ => panic!("{} is a block tensor", t.name()),
        }
    }
}

/// The tensors outside the blocks, in file order.
pub const OUTER: [Tensor; 5] = [Tensor::Wte, Tensor::Wpe, Tensor::LmHead, Tensor::LnfW, Tensor::LnfB];

/// One tensor as transformers stores it, and where its values live in the flat buffer.
pub struct HfTensor {
    /// transformers' name (GPT-2's without the optional `transformer.` prefix).
    pub name: String,
    /// Its elements in the flat parameter buffer (row-major, contiguous).
    pub range: std::ops::Range<usize>,
    /// Its shape as stored.
    pub shape: Vec<usize>,
    /// Stored as the transpose of llmrs's (out, in) (GPT-2's Conv1D weights).
    pub transposed: bool,
}

/// Where every parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    /// Start of each stacked tensor, in `Tensor::ALL` order, then the total.
    starts: [usize; Tensor::ALL.len() + 1],
    /// Elements per layer of each tensor.
    per_layer: [usize; Tensor::ALL.len()],
    pub num_parameters: usize,
}

impl ParamLayout {
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut starts = [0usize; Tensor::ALL.len() + 1];
        for (i, t) in Tensor::ALL.iter().enumerate() {
            starts[i + 1] = starts[i] + t.numel(cfg);
        }
        let n = starts[Tensor::ALL.len()];
        ParamLayout { starts, per_layer: Tensor::ALL.map(|t| t.numel_per_layer(cfg)), num_parameters: n }
    }

    /// The whole (stacked) tensor (empty when the model does not have it).
    pub fn range(&self, t: Tensor) -> Range<usize> {
        let i = t as usize;
        self.starts[i]..self.starts[i + 1]
    }

    /// Layer `l` of a per-layer tensor (for the others, `l` must be 0: the whole tensor).
    pub fn layer(&self, t: Tensor, l: usize) -> Range<usize> {
        let (i, n) = (t as usize, self.per_layer[t as usize]);
        let start = self.starts[i] + l * n;
        assert!(
            start + n <= self.starts[i + 1] || (n == 0 && start == self.starts[i]),
            "layer {l} of {} is out of range",
            t.name()
        );
        start..start + n
    }

    /// Block `l`'s twelve tensors.
    pub fn block(&self, l: usize) -> Block<Range<usize>> {
        Block {
            ln1_w: self.layer(Tensor::Ln1W, l),
            ln1_b: self.layer(Tensor::Ln1B, l),
            qkv_w: self.layer(Tensor::QkvW, l),
            qkv_b: self.layer(Tensor::QkvB, l),
            attn_proj_w: self.layer(Tensor::AttProjW, l),
            attn_proj_b: self.layer(Tensor::AttProjB, l),
            ln2_w: self.layer(Tensor::Ln2W, l),
            ln2_b: self.layer(Tensor::Ln2B, l),
            fc_w: self.layer(Tensor::FcW, l),
            fc_b: self.layer(Tensor::FcB, l),
            fc_proj_w: self.layer(Tensor::FcProjW, l),
            fc_proj_b: self.layer(Tensor::FcProjB, l),
        }
    }

    /// The tensors outside the blocks.
    pub fn outer(&self) -> Outer<Range<usize>> {
        Outer {
            wte: self.range(Tensor::Wte),
            wpe: self.range(Tensor::Wpe),
            lm_head: self.range(Tensor::LmHead),
            lnf_w: self.range(Tensor::LnfW),
            lnf_b: self.range(Tensor::LnfB),
        }
    }
}

/// A model's parameters in host memory, fp32 in llm.c's order: what model files hold, what
/// Hugging Face import and export work on, and what a model on a device is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub config: ModelConfig,
    pub layout: ParamLayout,
    pub data: Vec<f32>, // (num_parameters)
}

impl Weights {
    /// All parameters zero (to be filled from a file).
    pub fn zeros(config: ModelConfig) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        // A model bigger than the machine is an error here, not an abort in the allocator.
        let what = format!("the model's {} parameters (fp32, in host memory)", layout.num_parameters);
        crate::mem::check_available(layout.num_parameters.saturating_mul(4), &what)?;
        let data = crate::mem::zeroed::<f32>(layout.num_parameters);
        Ok(Weights { config, layout, data })
    }

    /// The family's random init ([`crate::models`]: llm.c's for GPT-2), drawn from the
    /// PyTorch-compatible Mersenne Twister seeded with `seed`.
    pub fn random(config: ModelConfig, seed: u32) -> Result<Self> {
        let mut w = Self::zeros(config)?;
        crate::models::init(&mut w, &mut Mt19937::new(seed));
        Ok(w)
    }

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
    }

    /// Refuse weights that hold a NaN or an infinity, naming the first such tensor (and layer)
    /// and element: such a model computes nothing meaningful, so it must not be trained,
    /// sampled, scored or copied as if it could. `source` names where they came from.
    pub fn check_finite(&self, source: &str) -> Result<()> {
        use rayon::prelude::*;
        if self.data.par_chunks(1 << 20).all(|c| c.iter().all(|x| x.is_finite())) {
            return Ok(());
        }
        let layers = |t: Tensor| if t.per_layer() { self.config.num_layers } else { 1 };
        for t in tensors(&self.config) {
            for l in 0..layers(t) {
                if let Some((i, x)) = self.layer(t, l).iter().enumerate().find(|(_, x)| !x.is_finite()) {
                    let layer = if t.per_layer() { format!(" of layer {l}") } else { String::new() };
                    anyhow::bail!(
                        "{source}: tensor {}{layer} holds {x} at element {i}: the weights are corrupt or come from a \
                         diverged run; use another file (an earlier checkpoint)",
                        t.name()
                    );
                }
            }
        }
        Ok(())
    }

    /// The whole (stacked) tensor.
    pub fn tensor(&self, t: Tensor) -> &[f32] {
        &self.data[self.layout.range(t)]
    }
    pub fn tensor_mut(&mut self, t: Tensor) -> &mut [f32] {
        &mut self.data[self.layout.range(t)]
    }
    /// Layer `l` of a tensor ([`ParamLayout::layer`]).
    pub fn layer(&self, t: Tensor, l: usize) -> &[f32] {
        &self.data[self.layout.layer(t, l)]
    }
    pub fn layer_mut(&mut self, t: Tensor, l: usize) -> &mut [f32] {
        &mut self.data[self.layout.layer(t, l)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_parameter_count() {
        // llm.c prints num_parameters: 124475904 for GPT-2 124M with the padded vocab.
        let cfg = ModelConfig::from_descriptor("d12").unwrap();
        let lay = ParamLayout::new(&cfg);
        assert_eq!(lay.num_parameters, 124_475_904);
        assert_eq!(cfg.num_parameters(), lay.num_parameters);
        assert_eq!(lay.range(Tensor::LnfB).end, lay.num_parameters);
        // Per-layer views tile their stacked tensor exactly, in order.
        assert_eq!(lay.layer(Tensor::QkvW, 0).start, lay.range(Tensor::QkvW).start);
        assert_eq!(lay.layer(Tensor::QkvW, 11).end, lay.range(Tensor::QkvW).end);
        assert_eq!(lay.block(3).fc_b, lay.layer(Tensor::FcB, 3));
        for pair in Tensor::ALL.windows(2) {
            assert_eq!(lay.range(pair[0]).end, lay.range(pair[1]).start, "{:?}", pair);
        }
        assert_eq!(Tensor::ALL.iter().filter(|t| t.weight_decay(&cfg)).count(), 6);
        assert!(lay.range(Tensor::LmHead).is_empty(), "GPT-2's head is wte");
        assert_eq!(tensors(&cfg).len(), 16);
        // BLOCK is the per-layer tensors, and a block's fields are their layer slices.
        assert_eq!(Tensor::ALL.iter().filter(|t| t.per_layer()).count(), Tensor::BLOCK.len());
        for t in Tensor::BLOCK {
            assert!(t.per_layer());
            assert_eq!(lay.block(3).get(t), lay.layer(t, 3), "{t:?}");
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_layer_past_the_last_is_refused() {
        let cfg = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        ParamLayout::new(&cfg).layer(Tensor::QkvW, 2);
    }
}

//! llm.c's 16 parameter tensors by name, where each lives in the one flat parameter buffer, and
//! a model's weights in host memory.
//!
//! All parameters (and, with the same layout, their gradients and the AdamW moments) live in one
//! buffer in llm.c's order, so the optimizer, checkpoints and collectives work on one flat
//! buffer. Code reaches a tensor by name, `layout.layer(Tensor::QkvW, l)` or
//! `layout.block(l).qkv_w`, never by an offset computed at the call site. The parameter count
//! is computed here and nowhere else ([`Tensor::numel`]).

use crate::config::GPT2Config;
use crate::rng::Mt19937;
use anyhow::Result;
use std::ops::Range;

/// llm.c's 16 parameter tensors, in file order. The per-layer ones are stacked over the L
/// blocks, e.g. `QkvW` is (L, 3*C, C).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tensor {
    Wte,      // (Vp, C)
    Wpe,      // (maxT, C)
    Ln1W,     // (L, C)
    Ln1B,     // (L, C)
    QkvW,     // (L, 3*C, C)
    QkvB,     // (L, 3*C)
    AttProjW, // (L, C, C)
    AttProjB, // (L, C)
    Ln2W,     // (L, C)
    Ln2B,     // (L, C)
    FcW,      // (L, 4*C, C)
    FcB,      // (L, 4*C)
    FcProjW,  // (L, C, 4*C)
    FcProjB,  // (L, C)
    LnfW,     // (C)
    LnfB,     // (C)
}

impl Tensor {
    /// All 16, in llm.c's file order.
    pub const ALL: [Tensor; 16] = [
        Tensor::Wte,
        Tensor::Wpe,
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

    /// The twelve tensors of a block, in file order (those of [`Tensor::ALL`] between wpe and lnf).
    pub const BLOCK: [Tensor; 12] = {
        let mut b = [Tensor::Wte; 12];
        let mut i = 0;
        while i < 12 {
            b[i] = Tensor::ALL[i + 2];
            i += 1;
        }
        b
    };

    /// llm.c's name for the tensor (`wte`, `qkvw`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Tensor::Wte => "wte",
            Tensor::Wpe => "wpe",
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
        !matches!(self, Tensor::Wte | Tensor::Wpe | Tensor::LnfW | Tensor::LnfB)
    }

    /// Shape of the tensor, per layer for the stacked ones (llm.c's (out, in) for weights).
    pub fn shape(self, cfg: &GPT2Config) -> Vec<usize> {
        let c = cfg.channels;
        match self {
            Tensor::Wte => vec![cfg.padded_vocab_size, c],
            Tensor::Wpe => vec![cfg.max_seq_len, c],
            Tensor::QkvW => vec![3 * c, c],
            Tensor::QkvB => vec![3 * c],
            Tensor::AttProjW => vec![c, c],
            Tensor::FcW => vec![4 * c, c],
            Tensor::FcB => vec![4 * c],
            Tensor::FcProjW => vec![c, 4 * c],
            Tensor::Ln1W | Tensor::Ln1B | Tensor::AttProjB | Tensor::Ln2W | Tensor::Ln2B | Tensor::FcProjB => vec![c],
            Tensor::LnfW | Tensor::LnfB => vec![c],
        }
    }

    /// Elements of one layer's tensor (of the whole tensor when it is not per layer).
    pub fn numel_per_layer(self, cfg: &GPT2Config) -> usize {
        self.shape(cfg).iter().product()
    }

    /// Elements of the whole (stacked) tensor.
    pub fn numel(self, cfg: &GPT2Config) -> usize {
        self.numel_per_layer(cfg) * if self.per_layer() { cfg.num_layers } else { 1 }
    }

    /// Whether AdamW applies weight decay: the 2-D weights only, as llm.c's train_gpt2.cu.
    pub fn weight_decay(self) -> bool {
        matches!(self, Tensor::Wte | Tensor::Wpe | Tensor::QkvW | Tensor::AttProjW | Tensor::FcW | Tensor::FcProjW)
    }

    /// Whether a backward pass writes the whole gradient through a matmul, so that the first
    /// backward after a zero_grad can overwrite it instead of adding to it: every block's
    /// qkv, attn_proj, fc and fc_proj weights and biases, and wte through the LM head (the
    /// encoder's scatter-add into it comes after).
    pub fn written_whole_by_backward(self) -> bool {
        matches!(
            self,
            Tensor::Wte
                | Tensor::QkvW
                | Tensor::QkvB
                | Tensor::AttProjW
                | Tensor::AttProjB
                | Tensor::FcW
                | Tensor::FcB
                | Tensor::FcProjW
                | Tensor::FcProjB
        )
    }
}

/// One transformer block's tensors, as ranges of the flat buffer ([`ParamLayout::block`]) or
/// mapped to anything else with [`Block::map`] (a backend's buffer handles, host slices).
#[derive(Clone, Copy, Debug)]
pub struct Block<T> {
    pub ln1_w: T,       // (C)
    pub ln1_b: T,       // (C)
    pub qkv_w: T,       // (3*C, C)
    pub qkv_b: T,       // (3*C)
    pub attn_proj_w: T, // (C, C)
    pub attn_proj_b: T, // (C)
    pub ln2_w: T,       // (C)
    pub ln2_b: T,       // (C)
    pub fc_w: T,        // (4*C, C)
    pub fc_b: T,        // (4*C)
    pub fc_proj_w: T,   // (C, 4*C)
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

/// Where every parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    /// Start of each of the 16 stacked tensors, in `Tensor::ALL` order, then the total.
    starts: [usize; 17],
    /// Elements per layer of each tensor.
    per_layer: [usize; 16],
    pub num_parameters: usize,
}

impl ParamLayout {
    pub fn new(cfg: &GPT2Config) -> Self {
        let mut starts = [0usize; 17];
        for (i, t) in Tensor::ALL.iter().enumerate() {
            starts[i + 1] = starts[i] + t.numel(cfg);
        }
        ParamLayout { starts, per_layer: Tensor::ALL.map(|t| t.numel_per_layer(cfg)), num_parameters: starts[16] }
    }

    /// The whole (stacked) tensor.
    pub fn range(&self, t: Tensor) -> Range<usize> {
        let i = t as usize;
        self.starts[i]..self.starts[i + 1]
    }

    /// Layer `l` of a per-layer tensor (for the others, `l` must be 0: the whole tensor).
    pub fn layer(&self, t: Tensor, l: usize) -> Range<usize> {
        let (i, n) = (t as usize, self.per_layer[t as usize]);
        let start = self.starts[i] + l * n;
        assert!(start + n <= self.starts[i + 1], "layer {l} of {} is out of range", t.name());
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
}

/// A model's parameters in host memory, fp32 in llm.c's order: what model files hold, what
/// Hugging Face import and export work on, and what a model on a device is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub config: GPT2Config,
    pub layout: ParamLayout,
    pub data: Vec<f32>, // (num_parameters)
}

impl Weights {
    /// All parameters zero (to be filled from a file).
    pub fn zeros(config: GPT2Config) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        let data = crate::mem::zeroed::<f32>(layout.num_parameters);
        Ok(Weights { config, layout, data })
    }

    /// llm.c's random init (train_gpt2.cu `gpt_build_from_descriptor`): N(0, 0.02) weights,
    /// residual projections N(0, 0.02/sqrt(2L)), zero biases, unit LayerNorm weights, drawn from
    /// the PyTorch-compatible Mersenne Twister in PyTorch's module order.
    pub fn random(config: GPT2Config, seed: u32) -> Result<Self> {
        let mut w = Self::zeros(config)?;
        let (l_n, c, v) = (config.num_layers, config.channels, config.vocab_size);
        let mut rng = Mt19937::new(seed);
        let residual_scale = 1.0 / (2.0 * l_n as f32).sqrt();
        for t in [Tensor::Ln1W, Tensor::Ln2W, Tensor::LnfW] {
            w.tensor_mut(t).fill(1.0);
        }
        rng.normal(&mut w.tensor_mut(Tensor::Wte)[..v * c], 0.0, 0.02); // only the V real rows
        rng.normal(w.tensor_mut(Tensor::Wpe), 0.0, 0.02);
        for l in 0..l_n {
            rng.normal(w.layer_mut(Tensor::QkvW, l), 0.0, 0.02);
            rng.normal(w.layer_mut(Tensor::AttProjW, l), 0.0, 0.02 * residual_scale);
            rng.normal(w.layer_mut(Tensor::FcW, l), 0.0, 0.02);
            rng.normal(w.layer_mut(Tensor::FcProjW, l), 0.0, 0.02 * residual_scale);
        }
        Ok(w)
    }

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
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
        let cfg = GPT2Config::from_descriptor("d12").unwrap();
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
        assert_eq!(Tensor::ALL.iter().filter(|t| t.weight_decay()).count(), 6);
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
        let cfg = GPT2Config::from_descriptor("2x16:2:8").unwrap();
        ParamLayout::new(&cfg).layer(Tensor::QkvW, 2);
    }
}

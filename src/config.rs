//! Model shapes. Plain data; every preset is defined here and nowhere else.
//!
//! Dimension names used in shape comments throughout the crate:
//! - `B`   micro-batch size (sequences per forward pass)
//! - `T`   sequence length of a batch (`T <= maxT`)
//! - `C`   channels (embedding width)
//! - `NH`  attention heads; `HS = C / NH` is the head size
//! - `L`   transformer blocks (layers)
//! - `V`   vocabulary size (50257 for GPT-2)
//! - `Vp`  padded vocabulary size (V rounded up to a multiple of 128: 50304);
//!   rows `V..Vp` of the token embedding are never used by the loss and stay zero-gradient.
//! - `maxT` the longest sequence the position embedding covers (1024 for GPT-2)

use anyhow::{bail, Result};

/// GPT-2 vocabulary size (number of BPE tokens, `<|endoftext|>` = 50256 included).
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2 vocabulary padded to a multiple of 128, as llm.c does.
pub const GPT2_PADDED_VOCAB: usize = 50304;
/// The `<|endoftext|>` token id.
pub const GPT2_EOT: u32 = 50256;

/// Shape of a GPT-2 model, the same fields as llm.c's model-file header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GPT2Config {
    pub max_seq_len: usize,       // maxT
    pub vocab_size: usize,        // V
    pub padded_vocab_size: usize, // Vp
    pub num_layers: usize,        // L
    pub num_heads: usize,         // NH
    pub channels: usize,          // C
}

/// Round a vocabulary size up to the next multiple of 128.
pub fn pad_vocab(v: usize) -> usize {
    v.div_ceil(128) * 128
}

impl GPT2Config {
    /// A GPT-2 shape with the standard vocabulary and context of 1024.
    pub fn gpt2(num_layers: usize, num_heads: usize, channels: usize) -> Self {
        GPT2Config {
            max_seq_len: 1024,
            vocab_size: GPT2_VOCAB,
            padded_vocab_size: GPT2_PADDED_VOCAB,
            num_layers,
            num_heads,
            channels,
        }
    }

    /// Parse a model descriptor as llm.c's `-e` does for non-file arguments:
    /// `d6 d12 d24 d36 d48` (llm.c's depth presets), `gpt2:dN`, the four GPT-2
    /// names (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`), `tiny` (L=4, C=256, NH=4, maxT=256,
    /// the default run's model), and the explicit
    /// form `LxC:NH[:maxT]` (e.g. `2x64:4:256`) for small experiments.
    pub fn from_descriptor(desc: &str) -> Result<Self> {
        let by_depth = |d: usize| -> Result<Self> {
            let (c, nh) = match d {
                6 => (384, 6),    // (unofficial) gpt2-tiny, 30M
                12 => (768, 12),  // gpt2 (124M)
                24 => (1024, 16), // gpt2-medium (350M)
                36 => (1280, 20), // gpt2-large (774M)
                48 => (1600, 25), // gpt2-xl (1558M)
                _ => bail!("unsupported GPT-2 depth d{d}: use one of d6 d12 d24 d36 d48"),
            };
            Ok(Self::gpt2(d, nh, c))
        };
        let d = desc.trim();
        match d {
            "gpt2" | "gpt2-small" | "124M" => return by_depth(12),
            "gpt2-medium" | "350M" => return by_depth(24),
            "gpt2-large" | "774M" => return by_depth(36),
            "gpt2-xl" | "1558M" => return by_depth(48),
            // llmrs's small model for the default run: trains on 2 CPU cores in minutes.
            "tiny" => return Ok(GPT2Config { max_seq_len: 256, ..Self::gpt2(4, 4, 256) }),
            _ => {}
        }
        if let Some(rest) = d.strip_prefix("gpt2:d").or_else(|| d.strip_prefix('d')) {
            if let Ok(depth) = rest.parse::<usize>() {
                return by_depth(depth);
            }
        }
        if let Some((lc, rest)) = d.split_once(':') {
            if let Some((l, c)) = lc.split_once('x') {
                let mut it = rest.split(':');
                let nh = it.next().and_then(|s| s.parse().ok());
                let maxt = it.next().map(|s| s.parse::<usize>().ok());
                if let (Ok(l), Ok(c), Some(nh)) = (l.parse(), c.parse(), nh) {
                    let mut cfg = Self::gpt2(l, nh, c);
                    match maxt {
                        None => {}
                        Some(Some(t)) => cfg.max_seq_len = t,
                        Some(None) => bail!("bad maxT in model descriptor '{desc}'"),
                    }
                    cfg.validate()?;
                    return Ok(cfg);
                }
            }
        }
        bail!(
            "unknown model '{desc}': give a model file (.bin), a preset (d6 d12 d24 d36 d48, gpt2, \
             gpt2-medium, gpt2-large, gpt2-xl) or an explicit shape LxC:NH[:maxT] such as 4x256:4:256"
        )
    }

    /// Check the invariants every kernel relies on.
    pub fn validate(&self) -> Result<()> {
        let GPT2Config { max_seq_len, vocab_size, padded_vocab_size, num_layers, num_heads, channels } = *self;
        if max_seq_len == 0 || vocab_size == 0 || num_layers == 0 || num_heads == 0 || channels == 0 {
            bail!("model shape has a zero dimension: {self:?}");
        }
        if padded_vocab_size < vocab_size {
            bail!("padded vocab size {padded_vocab_size} is smaller than vocab size {vocab_size}");
        }
        if channels % num_heads != 0 {
            bail!("channels {channels} is not a multiple of the number of heads {num_heads}");
        }
        // Guard against absurd headers before anything is allocated from them.
        if num_layers > 4096
            || channels > 1 << 16
            || max_seq_len > 1 << 20
            || padded_vocab_size > 1 << 24
            || num_heads > channels
        {
            bail!("model shape is implausibly large: {self:?}");
        }
        Ok(())
    }

    /// Number of parameters (llm.c's count, padded vocab included), from the shape alone: the
    /// sum of the 16 tensors' sizes ([`crate::params::Tensor::numel`]).
    pub fn num_parameters(&self) -> usize {
        crate::params::Tensor::ALL.iter().map(|t| t.numel(self)).sum()
    }
}

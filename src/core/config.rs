//! Model shapes: plain data, at the bottom of the crate. What a family makes of them (its
//! tensors, its presets, which fields it reads) is the family's ([`crate::models`]).
//!
//! Dimension names used in shape comments throughout the crate:
//! - `B`   micro-batch size (sequences per forward pass)
//! - `T`   sequence length of a batch (`T <= maxT`)
//! - `C`   channels (embedding width)
//! - `NH`  attention (query) heads, of `HS` channels each (`C / NH` for GPT-2 and Llama; Qwen3
//!   sets it on its own)
//! - `KV`  key and value heads (grouped-query attention; `KV = NH` for GPT-2); each serves
//!   `NH / KV` query heads
//! - `QD`  the width of the queries and of attention's output: `NH * HS` (C for GPT-2)
//! - `QKV` the width of the fused q, k, v projection: `(NH + 2 * KV) * HS` (3C for GPT-2)
//! - `F`   the MLP's hidden width (4C for GPT-2; Llama's `intermediate_size`)
//! - `L`   transformer blocks (layers)
//! - `V`   vocabulary size (50257 for GPT-2)
//! - `Vp`  padded vocabulary size (V rounded up to a multiple of 128: 50304);
//!   rows `V..Vp` of the token embedding are never used by the loss and stay zero-gradient.
//! - `maxT` the longest sequence the model covers (GPT-2's position embedding: 1024)

use anyhow::{bail, Result};

/// GPT-2 vocabulary size (number of BPE tokens, `<|endoftext|>` = 50256 included).
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2 vocabulary padded to a multiple of 128, as llm.c does.
pub const GPT2_PADDED_VOCAB: usize = 50304;
/// The `<|endoftext|>` token id.
pub const GPT2_EOT: u32 = 50256;

/// The precision a model computes in (`--precision`; llm.c's `PRECISION` build setting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Precision {
    /// Everything f32.
    #[default]
    Fp32,
    /// llm.c's bf16 build: parameters (the working copy), gradients and activations in bf16;
    /// master weights, AdamW's moments, norm statistics, attention's row statistics and the
    /// losses in f32; every op computes in f32 (README: Precision).
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            _ => bail!("unknown precision '{s}': use fp32 or bf16"),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// The family a model belongs to, by its name in the registry of [`crate::models`] (`gpt2`,
/// `llama`, `qwen2`, `qwen3`): the family decides the tensors, the block's calls and the files.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Family(pub &'static str);

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// Llama 3.1's rescaling of the rotary frequencies (transformers' `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

impl std::fmt::Display for Llama3Scaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "llama3 (factor {}, low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {})",
            self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings
        )
    }
}

/// Rotary position embedding: pair i of each head rotates by position * theta^(-2i/HS).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub scaling: Option<Llama3Scaling>,
}

impl Rope {
    /// Llama 2's and SmolLM's default (no scaling).
    pub const BASE: Rope = Rope { theta: 10000.0, scaling: None };
}

/// Shape of a model: the fields every family has, and the switches some families read (each
/// family's `validate` refuses the ones it does not implement).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub max_seq_len: usize,       // maxT
    pub vocab_size: usize,        // V
    pub padded_vocab_size: usize, // Vp
    pub num_layers: usize,        // L
    pub num_heads: usize,         // NH
    pub num_kv_heads: usize,      // KV
    pub channels: usize,          // C
    pub head_dim: usize,          // HS
    pub hidden: usize,            // F
    /// The norms' epsilon (GPT-2's LayerNorm: 1e-5; Llama's `rms_norm_eps`).
    pub norm_eps: f32,
    /// The rotary embedding (families with learned positions ignore it).
    pub rope: Rope,
    /// The LM head is the token embedding.
    pub tied_head: bool,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on attention's output projection.
    pub out_bias: bool,
}

/// Round a vocabulary size up to the next multiple of 128.
pub fn pad_vocab(v: usize) -> usize {
    v.div_ceil(128) * 128
}

/// A model's shape in one line, in the dimension names above (e.g. `llama L=30 C=576 NH=9
/// KV=3 HS=64 F=1536 maxT=8192 V=49152`), for logs and error messages.
impl std::fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} L={} C={} NH={}", self.family, self.num_layers, self.channels, self.num_heads)?;
        if (self.num_kv_heads, self.head_dim, self.hidden)
            != (self.num_heads, self.channels / self.num_heads.max(1), 4 * self.channels)
        {
            write!(f, " KV={} HS={} F={}", self.num_kv_heads, self.head_dim, self.hidden)?;
        }
        write!(f, " maxT={} V={}", self.max_seq_len, self.vocab_size)?;
        if self.padded_vocab_size != pad_vocab(self.vocab_size) {
            write!(f, " Vp={}", self.padded_vocab_size)?;
        }
        Ok(())
    }
}

impl ModelConfig {
    /// HS
    pub fn head_size(&self) -> usize {
        self.head_dim
    }

    /// QD = NH * HS: the width of the queries and of attention's output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// KV * HS: the width of the keys (and of the values).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// QKV = (NH + 2 KV) * HS: the width of the fused q, k, v projection.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }

    /// Whether two configs give the same tensors (family and every dimension); norms, rotary
    /// settings and the like may differ.
    pub fn same_shape(&self, o: &ModelConfig) -> bool {
        let dims = |c: &ModelConfig| {
            (c.family, c.num_layers, c.channels, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden, c.vocab_size)
        };
        dims(self) == dims(o)
    }

    /// The invariants every kernel relies on, whatever the family (which checks its own on
    /// top: [`crate::models::validate`]). Also bounds every dimension, so that a corrupt header
    /// cannot make anything allocate what no machine holds.
    pub fn validate_dims(&self) -> Result<()> {
        let ModelConfig { max_seq_len, vocab_size, padded_vocab_size, num_layers, num_heads, num_kv_heads, .. } = *self;
        let (channels, hs, hidden) = (self.channels, self.head_dim, self.hidden);
        if max_seq_len == 0
            || vocab_size == 0
            || num_layers == 0
            || num_heads == 0
            || channels == 0
            || hidden == 0
            || hs == 0
        {
            bail!("model shape has a zero dimension: {self}");
        }
        if padded_vocab_size < vocab_size {
            bail!("padded vocab size {padded_vocab_size} is smaller than vocab size {vocab_size}");
        }
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail!(
                "{num_heads} attention heads cannot share {num_kv_heads} key/value heads: use a divisor of {num_heads}"
            );
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            bail!("norm epsilon {} must be a positive number", self.norm_eps);
        }
        if num_layers > 4096
            || channels > 1 << 16
            || hs > 1 << 12
            || num_heads > 1 << 12
            || hidden > 1 << 18
            || max_seq_len > 1 << 20
            || padded_vocab_size > 1 << 24
        {
            bail!("model shape is implausibly large: {self}");
        }
        Ok(())
    }

    /// The rotary embedding's own checks, for the families that use it.
    pub fn validate_rope(&self) -> Result<()> {
        if !self.head_dim.is_multiple_of(2) {
            bail!("head size {} must be even for the rotary embedding", self.head_dim);
        }
        let r = self.rope;
        if !(r.theta.is_finite() && r.theta > 1.0) {
            bail!("rope_theta {} must be a number above 1", r.theta);
        }
        if let Some(s) = r.scaling {
            let ok = s.factor >= 1.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.original_max_position_embeddings > 0;
            if !ok {
                bail!("rope_scaling {s} is not a valid llama3 scaling");
            }
        }
        Ok(())
    }
}

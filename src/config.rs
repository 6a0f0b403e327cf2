//! Model shapes. Plain data; every preset is defined here and nowhere else.
//!
//! Dimension names used in shape comments throughout the crate:
//! - `B`   micro-batch size (sequences per forward pass)
//! - `T`   sequence length of a batch (`T <= maxT`)
//! - `C`   channels (embedding width)
//! - `NH`  attention (query) heads; `HS = C / NH` is the head size
//! - `KV`  key and value heads (grouped-query attention; `KV = NH` for GPT-2); each serves
//!   `NH / KV` query heads
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

/// The architecture a model follows: its tensors, its block's list of calls and its files
/// (`src/models/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2 (llm.c's): learned positions, LayerNorm, GELU MLP, biases, tied head.
    Gpt2,
    /// Llama 3 and its kin (transformers' `LlamaForCausalLM`: SmolLM2, TinyLlama): RoPE,
    /// RMSNorm, SwiGLU MLP, grouped-query attention, no biases unless asked.
    Llama,
}

/// Llama 3.1's rescaling of the rotary frequencies (transformers' `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
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

/// Shape of a model. The GPT-2 fields are llm.c's model-file header; the rest are fixed for
/// GPT-2 (one key/value head per query head, F = 4C, biases, a tied head, eps 1e-5).
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
    pub hidden: usize,            // F
    /// The norms' epsilon (GPT-2's LayerNorm: 1e-5; Llama's `rms_norm_eps`).
    pub norm_eps: f32,
    /// Llama's rotary embedding (GPT-2 has learned positions instead; unused there).
    pub rope: Rope,
    /// The LM head is wte (GPT-2 always; Llama's `tie_word_embeddings`).
    pub tied_head: bool,
    /// The q, k, v and output projections have biases (GPT-2 always; Llama's `attention_bias`).
    pub attn_bias: bool,
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

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::Gpt2 => "GPT-2",
            Family::Llama => "Llama",
        })
    }
}

/// A model's shape in one line, in the dimension names above (e.g. `Llama L=30 C=576 NH=9
/// KV=3 F=1536 maxT=8192 V=49152`), for logs and error messages.
impl std::fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} L={} C={} NH={}", self.family, self.num_layers, self.channels, self.num_heads)?;
        if self.family != Family::Gpt2 {
            write!(f, " KV={} F={}", self.num_kv_heads, self.hidden)?;
        }
        write!(f, " maxT={} V={}", self.max_seq_len, self.vocab_size)?;
        if self.padded_vocab_size != pad_vocab(self.vocab_size) {
            write!(f, " Vp={}", self.padded_vocab_size)?;
        }
        if self.family != Family::Gpt2 {
            if !self.tied_head {
                f.write_str(", untied head")?;
            }
            if self.attn_bias {
                f.write_str(", attention biases")?;
            }
        }
        Ok(())
    }
}

/// Round a vocabulary size up to the next multiple of 128.
pub fn pad_vocab(v: usize) -> usize {
    v.div_ceil(128) * 128
}

impl ModelConfig {
    /// A GPT-2 shape with the standard vocabulary and context of 1024.
    pub fn gpt2(num_layers: usize, num_heads: usize, channels: usize) -> Self {
        ModelConfig {
            family: Family::Gpt2,
            max_seq_len: 1024,
            vocab_size: GPT2_VOCAB,
            padded_vocab_size: GPT2_PADDED_VOCAB,
            num_layers,
            num_heads,
            num_kv_heads: num_heads,
            channels,
            hidden: 4 * channels,
            norm_eps: 1e-5,
            rope: Rope::BASE,
            tied_head: true,
            attn_bias: true,
        }
    }

    /// A Llama shape: no biases, a tied head, eps 1e-5, the vocabulary and context given.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        layers: usize,
        channels: usize,
        heads: usize,
        kv: usize,
        hidden: usize,
        vocab: usize,
        max_t: usize,
        rope: Rope,
    ) -> Self {
        ModelConfig {
            family: Family::Llama,
            max_seq_len: max_t,
            vocab_size: vocab,
            padded_vocab_size: pad_vocab(vocab),
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            channels,
            hidden,
            norm_eps: 1e-5,
            rope,
            tied_head: true,
            attn_bias: false,
        }
    }

    /// Parse a model descriptor as llm.c's `-e` does for non-file arguments:
    /// `d6 d12 d24 d36 d48` (llm.c's depth presets), `gpt2:dN`, the four GPT-2
    /// names (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`), `tiny` (L=4, C=256, NH=4, maxT=256,
    /// the default run's model), and the explicit form `LxC:NH[:maxT]` (e.g. `2x64:4:256`) for
    /// small experiments; and Llama shapes: `llama:NAME` (a preset below) or
    /// `llama:LxC:NH:KV[:F[:maxT]]` (F defaults to SwiGLU's 8C/3 rounded up to a multiple of 64,
    /// with the GPT-2 vocabulary so that the GPT-2 tokenizer's data trains it).
    pub fn from_descriptor(desc: &str) -> Result<Self> {
        let d = desc.trim();
        if let Some(rest) = d.strip_prefix("llama:") {
            return Self::llama_descriptor(rest, desc);
        }
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
        match d {
            "gpt2" | "gpt2-small" | "124M" => return by_depth(12),
            "gpt2-medium" | "350M" => return by_depth(24),
            "gpt2-large" | "774M" => return by_depth(36),
            "gpt2-xl" | "1558M" => return by_depth(48),
            // llmrs's small model for the default run: trains on 2 CPU cores in minutes.
            "tiny" => return Ok(ModelConfig { max_seq_len: 256, ..Self::gpt2(4, 4, 256) }),
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
             gpt2-medium, gpt2-large, gpt2-xl, llama:smollm2-135m), or an explicit shape LxC:NH[:maxT] such as \
             4x256:4:256 (GPT-2) or llama:LxC:NH:KV[:F[:maxT]] such as llama:4x256:8:2 (Llama)"
        )
    }

    /// `llama:NAME` or `llama:LxC:NH:KV[:F[:maxT]]` (after the `llama:`).
    fn llama_descriptor(rest: &str, desc: &str) -> Result<Self> {
        // The configs of the models on the Hub (config.json), without their weights.
        let llama3_scaling = |factor: f32| Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let rope = |theta: f32, scaling: Option<Llama3Scaling>| Rope { theta, scaling };
        let preset = match rest {
            "smollm2-135m" => Some(Self::llama(30, 576, 9, 3, 1536, 49152, 8192, rope(100000.0, None))),
            "smollm2-360m" => Some(Self::llama(32, 960, 15, 5, 2560, 49152, 8192, rope(100000.0, None))),
            "smollm2-1.7b" => Some(Self::llama(24, 2048, 32, 32, 8192, 49152, 8192, rope(130000.0, None))),
            "tinyllama-1.1b" => {
                Some(ModelConfig { tied_head: false, ..Self::llama(22, 2048, 32, 4, 5632, 32000, 2048, Rope::BASE) })
            }
            "llama3.2-1b" => {
                Some(Self::llama(16, 2048, 32, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
            }
            "llama3.2-3b" => {
                Some(Self::llama(28, 3072, 24, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
            }
            _ => None,
        };
        if let Some(cfg) = preset {
            return Ok(cfg);
        }
        let parts: Vec<&str> = rest.split(':').collect();
        let lc = parts.first().and_then(|lc| lc.split_once('x'));
        let num = |i: usize| parts.get(i).map(|s| s.parse::<usize>().ok());
        if let (Some((l, c)), Some(Some(nh)), Some(Some(kv))) = (lc, num(1), num(2)) {
            if let (Ok(l), Ok(c)) = (l.parse::<usize>(), c.parse::<usize>()) {
                let f = match num(3) {
                    None => (8 * c / 3).div_ceil(64) * 64,
                    Some(Some(f)) => f,
                    Some(None) => bail!("bad F in model descriptor '{desc}'"),
                };
                let max_t = match num(4) {
                    None => 1024,
                    Some(Some(t)) => t,
                    Some(None) => bail!("bad maxT in model descriptor '{desc}'"),
                };
                if parts.len() <= 5 {
                    let cfg = Self::llama(l, c, nh, kv, f, GPT2_VOCAB, max_t, Rope::BASE);
                    cfg.validate()?;
                    return Ok(cfg);
                }
            }
        }
        bail!(
            "unknown Llama model '{desc}': use llama:smollm2-135m, llama:smollm2-360m, llama:smollm2-1.7b, \
             llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b, or llama:LxC:NH:KV[:F[:maxT]] such as \
             llama:4x256:8:2"
        )
    }

    /// HS
    pub fn head_size(&self) -> usize {
        self.channels / self.num_heads
    }

    /// KV * HS: the width of the keys (and of the values).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_size()
    }

    /// QKV = (NH + 2 KV) * HS: the width of the fused q, k, v projection.
    pub fn qkv_dim(&self) -> usize {
        self.channels + 2 * self.kv_dim()
    }

    /// The width of the MLP's first projection: F for GPT-2's GELU MLP, 2F for SwiGLU's
    /// up and gate projections side by side.
    pub fn fc_dim(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.hidden,
            Family::Llama => 2 * self.hidden,
        }
    }

    /// Check the invariants every kernel relies on.
    pub fn validate(&self) -> Result<()> {
        let ModelConfig {
            max_seq_len,
            vocab_size,
            padded_vocab_size,
            num_layers,
            num_heads,
            num_kv_heads,
            channels,
            ..
        } = *self;
        if max_seq_len == 0 || vocab_size == 0 || num_layers == 0 || num_heads == 0 || channels == 0 || self.hidden == 0
        {
            bail!("model shape has a zero dimension: {self}");
        }
        if padded_vocab_size < vocab_size {
            bail!("padded vocab size {padded_vocab_size} is smaller than vocab size {vocab_size}");
        }
        if channels % num_heads != 0 {
            bail!("channels {channels} is not a multiple of the number of heads {num_heads}");
        }
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail!(
                "{num_heads} attention heads cannot share {num_kv_heads} key/value heads: use a divisor of {num_heads}"
            );
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            bail!("norm epsilon {} must be a positive number", self.norm_eps);
        }
        match self.family {
            Family::Gpt2 => {
                if num_kv_heads != num_heads || self.hidden != 4 * channels || !self.tied_head || !self.attn_bias {
                    bail!("a GPT-2 model has one key/value head per head, a 4C MLP, biases and a tied head: {self}");
                }
            }
            Family::Llama => {
                if !self.head_size().is_multiple_of(2) {
                    bail!("head size {} must be even for the rotary embedding", self.head_size());
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
            }
        }
        // Guard against absurd headers before anything is allocated from them.
        if num_layers > 4096
            || channels > 1 << 16
            || self.hidden > 1 << 18
            || max_seq_len > 1 << 20
            || padded_vocab_size > 1 << 24
            || num_heads > channels
        {
            bail!("model shape is implausibly large: {self}");
        }
        Ok(())
    }

    /// Whether two configs give the same tensors (family and every dimension); norms, rotary
    /// settings and the like may differ.
    pub fn same_shape(&self, o: &ModelConfig) -> bool {
        (self.family, self.num_layers, self.channels, self.num_heads, self.num_kv_heads, self.hidden, self.vocab_size)
            == (o.family, o.num_layers, o.channels, o.num_heads, o.num_kv_heads, o.hidden, o.vocab_size)
    }

    /// Number of parameters (llm.c's count for GPT-2, padded vocab included), from the shape
    /// alone: the sum of the tensors' sizes ([`crate::params::Tensor::numel`]).
    pub fn num_parameters(&self) -> usize {
        crate::params::Tensor::ALL.iter().map(|t| t.numel(self)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_descriptors() {
        let s = ModelConfig::from_descriptor("llama:smollm2-135m").unwrap();
        assert_eq!((s.num_layers, s.channels, s.num_heads, s.num_kv_heads, s.hidden), (30, 576, 9, 3, 1536));
        assert_eq!((s.head_size(), s.kv_dim(), s.qkv_dim(), s.fc_dim()), (64, 192, 960, 3072));
        // SmolLM2-135M has 134,515,008 parameters (tied head; its vocabulary is a multiple of 128).
        assert_eq!(s.num_parameters(), 134_515_008);
        let e = ModelConfig::from_descriptor("llama:4x256:8:2").unwrap();
        assert_eq!((e.num_layers, e.channels, e.num_heads, e.num_kv_heads, e.hidden), (4, 256, 8, 2, 704));
        assert_eq!(ModelConfig::from_descriptor("llama:2x64:4:4:96:32").unwrap().max_seq_len, 32);
        for bad in ["llama:2x64:3:2", "llama:2x64:4:3", "llama:nope", "llama:2x64:4", "llama:2x60:4:4"] {
            assert!(ModelConfig::from_descriptor(bad).is_err(), "{bad}");
        }
        let g = ModelConfig::from_descriptor("d12").unwrap();
        assert_eq!((g.qkv_dim(), g.fc_dim(), g.kv_dim()), (3 * 768, 4 * 768, 768));
    }
}

//! Model families: what differs between GPT-2 and Llama, in one file each.
//!
//! A family describes its tensors (which of [`Tensor::ALL`] it has and their shapes, which ones
//! a backward pass writes whole, its random init), its block's list of layer calls forward and
//! backward, its final norm, and its files (llm.c's model file header, transformers' names:
//! [`crate::checkpoint`], [`crate::hf`]). Everything the families share (the flat parameter
//! buffer, AdamW, ZeRO, checkpoints, the training loop, the KV cache, generation) is written
//! once in [`crate::model`] and above, and calls the family through the functions here, which
//! dispatch on [`ModelConfig::family`]. Adding a family means adding its file and an arm in each.

pub mod gpt2;
pub mod llama;

use crate::acts::{BackActs, BlockActs};
use crate::backend::{Backend, Buf};
use crate::config::{Family, ModelConfig};
use crate::params::{Block, Outer, Tensor, Weights};
use crate::rng::Mt19937;

/// Charge a layer call to its kind in `llmrs bench`'s profile.
macro_rules! t {
    ($be:expr, $kind:ident, $e:expr) => {{
        $be.profile_begin(crate::profile::Kind::$kind);
        $e;
        $be.profile_end();
    }};
}
pub(crate) use t;

/// Shape of tensor `t` in a model of `cfg` (per layer for the stacked ones), or None when the
/// family does not have it.
pub fn shape(cfg: &ModelConfig, t: Tensor) -> Option<Vec<usize>> {
    match cfg.family {
        Family::Gpt2 => gpt2::shape(cfg, t),
        Family::Llama => llama::shape(cfg, t),
    }
}

/// Whether a backward pass writes the whole gradient of `t` (a GEMM's weight or bias
/// gradient, or the tied embedding through the LM head) before anything adds to it, so that
/// the first backward after zero_grad may overwrite instead of add.
pub fn written_whole_by_backward(cfg: &ModelConfig, t: Tensor) -> bool {
    if shape(cfg, t).is_none() {
        return false;
    }
    match t {
        // The LM head's GEMM writes the head's gradient first; the encoder then adds to wte.
        Tensor::Wte => cfg.tied_head,
        Tensor::LmHead => true,
        Tensor::QkvW | Tensor::QkvB | Tensor::AttProjW | Tensor::AttProjB => true,
        Tensor::FcW | Tensor::FcB | Tensor::FcProjW | Tensor::FcProjB => true,
        _ => false,
    }
}

/// The family's random init, drawn from `rng` in a fixed order.
pub fn init(w: &mut Weights, rng: &mut Mt19937) {
    match w.config.family {
        Family::Gpt2 => gpt2::init(w, rng),
        Family::Llama => llama::init(w, rng),
    }
}

/// How a block's attention sees its positions.
#[derive(Clone, Copy)]
pub enum Attn {
    /// B whole sequences of T positions (training and evaluation).
    Causal { b: usize, t: usize },
    /// New positions of one sequence after `pos` cached ones; k and v (cap, KV*HS) hold the cache.
    /// Only the last `keep` positions' outputs are read (a prompt's last layer: the last one,
    /// whose logits pick the next token): past attention, the block runs on those alone.
    Cached { k: Buf, v: Buf, pos: usize, cap: usize, keep: usize },
}

impl Attn {
    /// How many of the block's `n` positions go on past attention (the last ones).
    pub fn keep(self, n: usize) -> usize {
        match self {
            Attn::Causal { .. } => n,
            Attn::Cached { keep, .. } => keep.min(n),
        }
    }
}

/// What a pass reads besides the activations and the weights: constants the model computes
/// once (Llama's rotary table).
#[derive(Clone, Copy, Debug)]
pub struct Consts {
    /// Llama: (maxT, HS) each position's cosines then sines; GPT-2: empty.
    pub rope: Option<Buf>,
}

/// The constants of a model of `cfg` on the host, to be uploaded once.
pub fn host_consts(cfg: &ModelConfig) -> Option<Vec<f32>> {
    match cfg.family {
        Family::Gpt2 => None,
        Family::Llama => Some(llama::rope_table(cfg)),
    }
}

/// The embedding of a pass: out (N, C) from the token ids (N) at positions pos.. (and the
/// learned positions, where the family has them).
#[allow(clippy::too_many_arguments)]
pub fn embed(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    w: &Outer<Buf>,
    out: Buf,
    ids: Buf,
    b: usize,
    t: usize,
    pos: usize,
) {
    let c = cfg.channels;
    let wpe = (w.wpe.len > 0).then(|| w.wpe.slice(pos * c..(pos + t) * c));
    t!(be, Encoder, be.encoder_forward(out, ids, w.wte, wpe, b, t, c));
}

/// Backward of [`embed`] (training, pos 0): the scatter into dwte (and dwpe).
pub fn embed_backward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    dw: &Outer<Buf>,
    dout: Buf,
    ids: Buf,
    b: usize,
    t: usize,
) {
    let c = cfg.channels;
    let dwpe = (dw.wpe.len > 0).then(|| dw.wpe.slice(0..t * c));
    t!(be, Encoder, be.encoder_backward(dw.wte, dwpe, dout, ids, b, t, c));
}

/// One transformer block over N positions ([`gpt2::block_forward`], [`llama::block_forward`]).
pub fn block_forward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    k: &Consts,
    w: &Block<Buf>,
    x: &BlockActs,
    n: usize,
    attn: Attn,
) {
    match cfg.family {
        Family::Gpt2 => gpt2::block_forward(be, cfg, w, x, n, attn),
        Family::Llama => llama::block_forward(be, cfg, k, w, x, n, attn),
    }
}

/// Backward of [`block_forward`] (training): d.dresidual holds d(residual out) on entry and
/// d(residual in) on return; parameter gradients go to `dw` (added to, or overwritten when not
/// `acc`).
#[allow(clippy::too_many_arguments)]
pub fn block_backward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    k: &Consts,
    w: &Block<Buf>,
    dw: &Block<Buf>,
    x: &BlockActs,
    d: &BackActs,
    bt: (usize, usize),
    acc: bool,
) {
    match cfg.family {
        Family::Gpt2 => gpt2::block_backward(be, cfg, w, dw, x, d, bt, acc),
        Family::Llama => llama::block_backward(be, cfg, k, w, dw, x, d, bt, acc),
    }
}

/// The final norm's buffers for N positions.
#[derive(Clone, Copy, Debug)]
pub struct NormActs {
    pub out: Buf,  // (N, C)
    pub mean: Buf, // (N) LayerNorm only
    pub rstd: Buf, // (N)
}

/// The final norm: LayerNorm (GPT-2) or RMSNorm (Llama) of x (N, C).
pub fn final_norm(be: &mut dyn Backend, cfg: &ModelConfig, w: &Outer<Buf>, a: &NormActs, x: Buf, n: usize) {
    let c = cfg.channels;
    match cfg.family {
        Family::Gpt2 => t!(be, LayerNorm, be.layernorm_forward(a.out, a.mean, a.rstd, x, w.lnf_w, w.lnf_b, n, c)),
        Family::Llama => t!(be, LayerNorm, be.rmsnorm_forward(a.out, a.rstd, x, w.lnf_w, n, c, cfg.norm_eps)),
    }
}

/// Backward of [`final_norm`]: dx (N, C) += ..., from dout (N, C).
#[allow(clippy::too_many_arguments)]
pub fn final_norm_backward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    w: &Outer<Buf>,
    dw: &Outer<Buf>,
    a: &NormActs,
    dx: Buf,
    dout: Buf,
    x: Buf,
    n: usize,
) {
    let c = cfg.channels;
    match cfg.family {
        Family::Gpt2 => {
            t!(be, LayerNorm, be.layernorm_backward(dx, dw.lnf_w, dw.lnf_b, dout, x, w.lnf_w, a.mean, a.rstd, n, c))
        }
        Family::Llama => t!(be, LayerNorm, be.rmsnorm_backward(dx, dw.lnf_w, dout, x, w.lnf_w, a.rstd, n, c)),
    }
}

/// The LM head's weight (Vp, C): wte when tied, else lm_head.
pub fn head<T: Copy>(cfg: &ModelConfig, w: &Outer<T>) -> T {
    if cfg.tied_head {
        w.wte
    } else {
        w.lm_head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_backward_writes_whole() {
        let g = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        let whole: Vec<_> = Tensor::ALL.into_iter().filter(|&t| written_whole_by_backward(&g, t)).collect();
        use Tensor::*;
        assert_eq!(whole, [Wte, QkvW, QkvB, AttProjW, AttProjB, FcW, FcB, FcProjW, FcProjB]);
        let l = ModelConfig { tied_head: false, ..ModelConfig::from_descriptor("llama:2x16:2:1").unwrap() };
        let whole: Vec<_> = Tensor::ALL.into_iter().filter(|&t| written_whole_by_backward(&l, t)).collect();
        assert_eq!(whole, [LmHead, QkvW, AttProjW, FcW, FcProjW], "no biases; wte is only scattered into");
    }
}

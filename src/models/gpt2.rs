//! GPT-2 (llm.c's): learned position embeddings, pre-LayerNorm blocks with a GELU MLP of width
//! F = 4C, biases everywhere, the LM head tied to the token embedding.

use super::{t, Attn};
use crate::acts::{BackActs, BlockActs};
use crate::backend::{Backend, Buf};
use crate::config::ModelConfig;
use crate::params::HfTensor;
use crate::params::{Block, ParamLayout, Tensor, Weights};
use crate::rng::Mt19937;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// GPT-2's tensors: every one of [`Tensor::ALL`] but the untied head.
pub fn shape(cfg: &ModelConfig, t: Tensor) -> Option<Vec<usize>> {
    let (c, f, qkv) = (cfg.channels, cfg.hidden, cfg.qkv_dim());
    Some(match t {
        Tensor::Wte => vec![cfg.padded_vocab_size, c],
        Tensor::Wpe => vec![cfg.max_seq_len, c],
        Tensor::LmHead => return None,
        Tensor::QkvW => vec![qkv, c],
        Tensor::QkvB => vec![qkv],
        Tensor::AttProjW => vec![c, c],
        Tensor::FcW => vec![f, c],
        Tensor::FcB => vec![f],
        Tensor::FcProjW => vec![c, f],
        Tensor::Ln1W | Tensor::Ln1B | Tensor::AttProjB | Tensor::Ln2W | Tensor::Ln2B | Tensor::FcProjB => vec![c],
        Tensor::LnfW | Tensor::LnfB => vec![c],
    })
}

/// llm.c's init (train_gpt2.py's `_init_weights`): N(0, 0.02) for the embeddings (the V real
/// rows of wte) and the matrices, scaled by 1/sqrt(2L) for the two projections into the
/// residual stream; LayerNorm weights 1, biases 0.
pub fn init(w: &mut Weights, rng: &mut Mt19937) {
    let (l_n, c, v) = (w.config.num_layers, w.config.channels, w.config.vocab_size);
    let residual_scale = 1.0 / (2.0 * l_n as f32).sqrt();
    for t in [Tensor::Ln1W, Tensor::Ln2W, Tensor::LnfW] {
        w.tensor_mut(t).fill(1.0);
    }
    rng.normal(&mut w.tensor_mut(Tensor::Wte)[..v * c], 0.0, 0.02);
    rng.normal(w.tensor_mut(Tensor::Wpe), 0.0, 0.02);
    for l in 0..l_n {
        rng.normal(w.layer_mut(Tensor::QkvW, l), 0.0, 0.02);
        rng.normal(w.layer_mut(Tensor::AttProjW, l), 0.0, 0.02 * residual_scale);
        rng.normal(w.layer_mut(Tensor::FcW, l), 0.0, 0.02);
        rng.normal(w.layer_mut(Tensor::FcProjW, l), 0.0, 0.02 * residual_scale);
    }
}

/// residual2 = res_in + attn_proj(attention(qkv(ln1(res_in)))),
/// residual3 = residual2 + fc_proj(gelu(fc(ln2(residual2)))).
pub fn block_forward(be: &mut dyn Backend, cfg: &ModelConfig, w: &Block<Buf>, x: &BlockActs, n: usize, attn: Attn) {
    let (c, f, nh) = (cfg.channels, cfg.hidden, cfg.num_heads);
    t!(be, LayerNorm, be.layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.res_in, w.ln1_w, w.ln1_b, n, c));
    t!(be, Matmul, be.matmul_forward(x.qkv, x.ln1, w.qkv_w, Some(w.qkv_b), n, c, 3 * c));
    match attn {
        Attn::Causal { b, t } => {
            t!(be, Attention, be.attention_forward(x.atty, x.att, x.scratch, x.qkv, b, t, c, nh, nh))
        }
        Attn::Cached { k, v, pos, cap, .. } => t!(
            be,
            Attention,
            be.attention_forward_cached(x.atty, x.att, x.scratch, x.qkv, k, v, pos, n, c, nh, nh, cap)
        ),
    }
    // Attention has filled the cache for all n positions; only the outputs read go on.
    let (x, n) = (&x.last_rows(cfg, n, attn.keep(n)), attn.keep(n));
    t!(be, Matmul, be.matmul_forward(x.scratch, x.atty, w.attn_proj_w, Some(w.attn_proj_b), n, c, c));
    t!(be, Residual, be.residual_forward(x.residual2, x.res_in, x.scratch));
    t!(be, LayerNorm, be.layernorm_forward(x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w.ln2_w, w.ln2_b, n, c));
    t!(be, Matmul, be.matmul_forward(x.fch, x.ln2, w.fc_w, Some(w.fc_b), n, c, f));
    t!(be, Gelu, be.gelu_forward(x.fch_act, x.fch));
    t!(be, Matmul, be.matmul_forward(x.scratch, x.fch_act, w.fc_proj_w, Some(w.fc_proj_b), n, f, c));
    t!(be, Residual, be.residual_forward(x.residual3, x.residual2, x.scratch));
}

/// Backward of [`block_forward`], in reverse.
#[allow(clippy::too_many_arguments)]
pub fn block_backward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    w: &Block<Buf>,
    dw: &Block<Buf>,
    x: &BlockActs,
    d: &BackActs,
    (b, t): (usize, usize),
    acc: bool,
) {
    let (c, f, nh, n) = (cfg.channels, cfg.hidden, cfg.num_heads, b * t);
    let dfch = d.dfch.prefix(n * f);
    // MLP branch.
    t!(
        be,
        Matmul,
        be.matmul_backward(
            Some(dfch),
            dw.fc_proj_w,
            Some(dw.fc_proj_b),
            d.dresidual,
            x.fch_act,
            w.fc_proj_w,
            n,
            f,
            c,
            acc
        )
    );
    t!(be, Gelu, be.gelu_backward(dfch, x.fch));
    t!(be, Matmul, be.matmul_backward(Some(x.scratch), dw.fc_w, Some(dw.fc_b), dfch, x.ln2, w.fc_w, n, c, f, acc));
    t!(
        be,
        LayerNorm,
        be.layernorm_backward(
            d.dresidual,
            dw.ln2_w,
            dw.ln2_b,
            x.scratch,
            x.residual2,
            w.ln2_w,
            x.ln2_mean,
            x.ln2_rstd,
            n,
            c
        )
    );
    // Attention branch; dfch is free again and serves as the attention workspace.
    t!(
        be,
        Matmul,
        be.matmul_backward(
            Some(x.scratch),
            dw.attn_proj_w,
            Some(dw.attn_proj_b),
            d.dresidual,
            x.atty,
            w.attn_proj_w,
            n,
            c,
            c,
            acc
        )
    );
    t!(
        be,
        Attention,
        be.attention_backward(d.dqkv, d.datt, d.dfch.prefix(n * 3 * c), x.scratch, x.qkv, x.att, b, t, c, nh, nh)
    );
    t!(
        be,
        Matmul,
        be.matmul_backward(Some(x.scratch), dw.qkv_w, Some(dw.qkv_b), d.dqkv, x.ln1, w.qkv_w, n, c, 3 * c, acc)
    );
    t!(
        be,
        LayerNorm,
        be.layernorm_backward(
            d.dresidual,
            dw.ln1_w,
            dw.ln1_b,
            x.scratch,
            x.res_in,
            w.ln1_w,
            x.ln1_mean,
            x.ln1_rstd,
            n,
            c
        )
    );
}

// ---- Hugging Face (transformers' GPT2LMHeadModel) -----------------------------------------------

/// The fields of transformers' `GPT2Config` that matter to llmrs.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
struct HfConfig {
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    #[serde(default)]
    n_inner: Option<usize>,
    #[serde(default = "default_act")]
    activation_function: String,
    #[serde(default = "default_eps")]
    layer_norm_epsilon: f64,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

fn default_act() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

/// A GPT-2 `config.json`, checked to be exactly the model llmrs computes.
pub fn parse_hf_config(text: &str, path: &Path) -> Result<ModelConfig> {
    let c: HfConfig =
        serde_json::from_str(text).with_context(|| format!("{}: not a GPT-2 config.json", path.display()))?;
    if let Some(inner) = c.n_inner {
        if inner != 4 * c.n_embd {
            bail!("{}: n_inner {inner} is not 4*n_embd; llmrs's GPT-2 has a 4C MLP", path.display());
        }
    }
    if !matches!(c.activation_function.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
        bail!("{}: activation '{}' is not GPT-2's tanh GELU (gelu_new)", path.display(), c.activation_function);
    }
    if (c.layer_norm_epsilon - 1e-5).abs() > 1e-12 {
        bail!("{}: layer_norm_epsilon {} is not 1e-5", path.display(), c.layer_norm_epsilon);
    }
    if !c.tie_word_embeddings {
        bail!("{}: untied word embeddings are not supported (GPT-2 ties the LM head to wte)", path.display());
    }
    Ok(ModelConfig {
        max_seq_len: c.n_positions,
        vocab_size: c.vocab_size,
        padded_vocab_size: crate::config::pad_vocab(c.vocab_size),
        ..ModelConfig::gpt2(c.n_layer, c.n_head, c.n_embd)
    })
}

/// `config.json` as transformers writes it for a GPT2LMHeadModel of this shape.
pub fn hf_config(cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": torch_dtype,
    })
}

/// transformers' GPT2LMHeadModel tensors (names without the `transformer.` prefix, which some
/// Hub checkpoints lack). Its linear layers are `Conv1D`, whose weight is (in, out): the
/// transpose of llmrs's (out, in). The LM head is tied to wte and usually not stored; buffers
/// such as `attn.bias` (the causal mask) are ignored.
pub fn hf_tensors(cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
    let wte = lay.range(Tensor::Wte);
    let shape = |t: Tensor| t.shape(cfg).expect("a GPT-2 tensor");
    let mut out = vec![
        // Only the V real rows of the padded embedding.
        HfTensor {
            name: "wte.weight".into(),
            range: wte.start..wte.start + cfg.vocab_size * cfg.channels,
            shape: vec![cfg.vocab_size, cfg.channels],
            transposed: false,
        },
        HfTensor {
            name: "wpe.weight".into(),
            range: lay.range(Tensor::Wpe),
            shape: shape(Tensor::Wpe),
            transposed: false,
        },
    ];
    let per_layer = [
        ("ln_1.weight", Tensor::Ln1W),
        ("ln_1.bias", Tensor::Ln1B),
        ("attn.c_attn.weight", Tensor::QkvW),
        ("attn.c_attn.bias", Tensor::QkvB),
        ("attn.c_proj.weight", Tensor::AttProjW),
        ("attn.c_proj.bias", Tensor::AttProjB),
        ("ln_2.weight", Tensor::Ln2W),
        ("ln_2.bias", Tensor::Ln2B),
        ("mlp.c_fc.weight", Tensor::FcW),
        ("mlp.c_fc.bias", Tensor::FcB),
        ("mlp.c_proj.weight", Tensor::FcProjW),
        ("mlp.c_proj.bias", Tensor::FcProjB),
    ];
    for l in 0..cfg.num_layers {
        for (suffix, t) in per_layer {
            let mut shape = shape(t);
            let transposed = shape.len() == 2;
            shape.reverse();
            out.push(HfTensor { name: format!("h.{l}.{suffix}"), range: lay.layer(t, l), shape, transposed });
        }
    }
    for (name, t) in [("ln_f.weight", Tensor::LnfW), ("ln_f.bias", Tensor::LnfB)] {
        out.push(HfTensor { name: name.into(), range: lay.range(t), shape: shape(t), transposed: false });
    }
    out
}

//! Llama (transformers' `LlamaForCausalLM`: Llama 3, SmolLM2, TinyLlama): rotary positions,
//! pre-RMSNorm blocks, grouped-query attention, a SwiGLU MLP, no biases (unless the config sets
//! `attention_bias`: q, k, v and the output projection), the LM head tied or not.
//!
//! Tensors in the shared [`Tensor`] names: `QkvW` (L, QKV, C) is q_proj, k_proj, v_proj stacked
//! (QKV = (NH + 2 KV) * HS, rows in transformers' layout, each head's halves rotated together);
//! `FcW` (L, 2F, C) is up_proj then gate_proj (llm.c's llama3 `c_fc` then `c_fc2`); `FcProjW`
//! (L, C, F) is down_proj; `Ln1W`, `Ln2W`, `LnfW` the RMSNorm weights.

use super::{t, Attn, Consts};
use crate::acts::{BackActs, BlockActs};
use crate::backend::{Backend, Buf};
use crate::config::{Llama3Scaling, ModelConfig};
use crate::params::HfTensor;
use crate::params::{Block, ParamLayout, Tensor, Weights};
use crate::rng::Mt19937;
use anyhow::{bail, Context, Result};
use std::path::Path;

pub fn shape(cfg: &ModelConfig, t: Tensor) -> Option<Vec<usize>> {
    let (c, f, qkv) = (cfg.channels, cfg.hidden, cfg.qkv_dim());
    let bias = cfg.attn_bias;
    Some(match t {
        Tensor::Wte => vec![cfg.padded_vocab_size, c],
        Tensor::LmHead if !cfg.tied_head => vec![cfg.padded_vocab_size, c],
        Tensor::QkvW => vec![qkv, c],
        Tensor::QkvB if bias => vec![qkv],
        Tensor::AttProjW => vec![c, c],
        Tensor::AttProjB if bias => vec![c],
        Tensor::FcW => vec![2 * f, c],
        Tensor::FcProjW => vec![c, f],
        Tensor::Ln1W | Tensor::Ln2W | Tensor::LnfW => vec![c],
        _ => return None,
    })
}

/// transformers' `_init_weights` for Llama: N(0, 0.02) for the embedding (its V real rows),
/// the untied head and every projection; biases 0; RMSNorm weights 1.
pub fn init(w: &mut Weights, rng: &mut Mt19937) {
    let (l_n, c, v) = (w.config.num_layers, w.config.channels, w.config.vocab_size);
    for t in [Tensor::Ln1W, Tensor::Ln2W, Tensor::LnfW] {
        w.tensor_mut(t).fill(1.0);
    }
    rng.normal(&mut w.tensor_mut(Tensor::Wte)[..v * c], 0.0, 0.02);
    if !w.config.tied_head {
        rng.normal(&mut w.tensor_mut(Tensor::LmHead)[..v * c], 0.0, 0.02);
    }
    for l in 0..l_n {
        for t in [Tensor::QkvW, Tensor::AttProjW, Tensor::FcW, Tensor::FcProjW] {
            rng.normal(w.layer_mut(t, l), 0.0, 0.02);
        }
    }
}

/// The rotary frequencies, as transformers computes them in f32: inv_freq_i =
/// 1 / theta^(2i/HS), then Llama 3.1's rescaling when the config has it (low frequencies
/// divided by `factor`, high ones kept, a smooth blend between).
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let hs = cfg.head_size();
    let base = cfg.rope.theta;
    let f: Vec<f32> =
        (0..hs / 2).map(|i| 1.0 / ((base as f64).powf(((2 * i) as f32 / hs as f32) as f64) as f32)).collect();
    let Some(s) = cfg.rope.scaling else { return f };
    let old = s.original_max_position_embeddings as f32;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    f.into_iter()
        .map(|x| {
            let wavelen = 2.0 * std::f32::consts::PI / x;
            let scaled = if wavelen > low_wavelen { x / s.factor } else { x };
            let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            // Neither high nor low frequency (wavelengths are finite and positive: no NaN).
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            } else {
                scaled
            }
        })
        .collect()
}

/// The rotary table (maxT, HS): each position's HS/2 cosines then HS/2 sines of
/// position * inv_freq_i (the angle rounded to f32 as transformers does, then its cosine
/// and sine rounded once).
pub fn rope_table(cfg: &ModelConfig) -> Vec<f32> {
    let (hs, half) = (cfg.head_size(), cfg.head_size() / 2);
    let f = inv_freq(cfg);
    let mut out = vec![0f32; cfg.max_seq_len * hs];
    for (p, row) in out.chunks_exact_mut(hs).enumerate() {
        for (i, &fi) in f.iter().enumerate() {
            let angle = (fi * p as f32) as f64;
            row[i] = angle.cos() as f32;
            row[half + i] = angle.sin() as f32;
        }
    }
    out
}

/// residual2 = res_in + o_proj(attention(rope(qkv(rmsnorm1(res_in))))),
/// residual3 = residual2 + down(swiglu(up_gate(rmsnorm2(residual2)))).
#[allow(clippy::too_many_arguments)]
pub fn block_forward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    k: &Consts,
    w: &Block<Buf>,
    x: &BlockActs,
    n: usize,
    attn: Attn,
) {
    let (c, f, nh, nkv, hs, qkv, eps) =
        (cfg.channels, cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_size(), cfg.qkv_dim(), cfg.norm_eps);
    let rope = k.rope.expect("a Llama model has its rotary table");
    let bias = |b: Buf| cfg.attn_bias.then_some(b);
    t!(be, LayerNorm, be.rmsnorm_forward(x.ln1, x.ln1_rstd, x.res_in, w.ln1_w, n, c, eps));
    t!(be, Matmul, be.matmul_forward(x.qkv, x.ln1, w.qkv_w, bias(w.qkv_b), n, c, qkv));
    match attn {
        Attn::Causal { b, t } => {
            t!(be, Attention, be.rope_forward(x.qkv, rope, n, t, 0, nh, nkv, hs));
            t!(be, Attention, be.attention_forward(x.atty, x.att, x.scratch, x.qkv, b, t, c, nh, nkv))
        }
        Attn::Cached { k, v, pos, cap, .. } => {
            t!(be, Attention, be.rope_forward(x.qkv, rope, n, n, pos, nh, nkv, hs));
            t!(
                be,
                Attention,
                be.attention_forward_cached(x.atty, x.att, x.scratch, x.qkv, k, v, pos, n, c, nh, nkv, cap)
            )
        }
    }
    // Attention has filled the cache for all n positions; only the outputs read go on.
    let (x, n) = (&x.last_rows(cfg, n, attn.keep(n)), attn.keep(n));
    t!(be, Matmul, be.matmul_forward(x.scratch, x.atty, w.attn_proj_w, bias(w.attn_proj_b), n, c, c));
    t!(be, Residual, be.residual_forward(x.residual2, x.res_in, x.scratch));
    t!(be, LayerNorm, be.rmsnorm_forward(x.ln2, x.ln2_rstd, x.residual2, w.ln2_w, n, c, eps));
    t!(be, Matmul, be.matmul_forward(x.fch, x.ln2, w.fc_w, None, n, c, 2 * f));
    t!(be, Gelu, be.swiglu_forward(x.fch_act, x.fch, n, f));
    t!(be, Matmul, be.matmul_forward(x.scratch, x.fch_act, w.fc_proj_w, None, n, f, c));
    t!(be, Residual, be.residual_forward(x.residual3, x.residual2, x.scratch));
}

/// Backward of [`block_forward`], in reverse. The rotation was applied to qkv in place, so
/// attention's backward sees the rotated q and k it used, and its dq, dk are rotated back
/// before the projection's backward.
#[allow(clippy::too_many_arguments)]
pub fn block_backward(
    be: &mut dyn Backend,
    cfg: &ModelConfig,
    k: &Consts,
    w: &Block<Buf>,
    dw: &Block<Buf>,
    x: &BlockActs,
    d: &BackActs,
    (b, t): (usize, usize),
    acc: bool,
) {
    let (c, f, nh, nkv, hs, qkv) =
        (cfg.channels, cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_size(), cfg.qkv_dim());
    let n = b * t;
    let rope = k.rope.expect("a Llama model has its rotary table");
    let bias = |b: Buf| cfg.attn_bias.then_some(b);
    let (dact, dfch) = (d.dact.prefix(n * f), d.dfch.prefix(n * 2 * f));
    // MLP branch.
    t!(
        be,
        Matmul,
        be.matmul_backward(Some(dact), dw.fc_proj_w, None, d.dresidual, x.fch_act, w.fc_proj_w, n, f, c, acc)
    );
    t!(be, Gelu, be.swiglu_backward(dfch, dact, x.fch, n, f));
    t!(be, Matmul, be.matmul_backward(Some(x.scratch), dw.fc_w, None, dfch, x.ln2, w.fc_w, n, c, 2 * f, acc));
    t!(be, LayerNorm, be.rmsnorm_backward(d.dresidual, dw.ln2_w, x.scratch, x.residual2, w.ln2_w, x.ln2_rstd, n, c));
    // Attention branch; dfch is free again and serves as the attention workspace.
    t!(
        be,
        Matmul,
        be.matmul_backward(
            Some(x.scratch),
            dw.attn_proj_w,
            bias(dw.attn_proj_b),
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
        be.attention_backward(d.dqkv, d.datt, d.dfch.prefix(n * 3 * c), x.scratch, x.qkv, x.att, b, t, c, nh, nkv)
    );
    t!(be, Attention, be.rope_backward(d.dqkv, rope, n, t, 0, nh, nkv, hs));
    t!(
        be,
        Matmul,
        be.matmul_backward(Some(x.scratch), dw.qkv_w, bias(dw.qkv_b), d.dqkv, x.ln1, w.qkv_w, n, c, qkv, acc)
    );
    t!(be, LayerNorm, be.rmsnorm_backward(d.dresidual, dw.ln1_w, x.scratch, x.res_in, w.ln1_w, x.ln1_rstd, n, c));
}

// ---- llm.c's llama3 model file ----------------------------------------------------------------

/// Magic of llm.c's llama3 model file (its `llama3` branch, train_llama3.py's write_model).
pub const LLMC_MAGIC: i32 = 20240803;

/// The rescaling llm.c's file means by `use_scaled_rope` for Llama 3.`minor` (3.1: factor 8,
/// as train_llama3.py; 3.2: factor 32, as Meta's Llama 3.2 configs).
fn llmc_scaling(minor: i32) -> Option<Llama3Scaling> {
    let factor = match minor {
        1 => 8.0,
        2 => 32.0,
        _ => return None,
    };
    Some(Llama3Scaling { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 })
}

/// Meta's hidden size of the SwiGLU MLP: 2/3 of 4C, times ffn_dim_multiplier, rounded up to
/// a multiple of multiple_of (train_llama3.py's MLP).
fn llmc_hidden(c: usize, multiple_of: usize, multiplier: f32) -> usize {
    let h = ((2 * 4 * c) as f64 / 3.0) as usize;
    let h = (multiplier as f64 * h as f64) as usize;
    multiple_of * h.div_ceil(multiple_of)
}

/// (multiple_of, ffn_dim_multiplier) that give hidden size F: multiplier 1 with the largest
/// power-of-two multiple_of that works (the form train_llama3.py's configs take), else F's
/// own ratio to 8C/3 with multiple_of = F.
fn llmc_ffn(c: usize, f: usize) -> Option<(usize, f32)> {
    let pow2 = (0..=10).rev().map(|k| 1usize << k);
    if let Some(m) = pow2.into_iter().find(|&m| llmc_hidden(c, m, 1.0) == f) {
        return Some((m, 1.0));
    }
    let h = ((2 * 4 * c) as f64 / 3.0) as usize;
    let ratio = (f as f64 / h.max(1) as f64) as f32;
    (llmc_hidden(c, f, ratio) == f).then_some((f, ratio))
}

/// The header of an llm.c llama3 model file (magic 20240803) for `cfg`: an int header of 256
/// (magic, version 3 fp32 / 5 bf16, maxT, V, L, NH, KV, C, multiple_of, use_scaled_rope, major,
/// minor), then a float header of 256 (ffn_dim_multiplier, norm_eps, rope_theta). A rope
/// scaling other than Llama 3.1's and 3.2's is written as llmrs's extension: minor 0, with
/// original_max_position_embeddings in int slot 12 and factor, low_freq_factor and
/// high_freq_factor in float slots 3-5 (llm.c reads neither; it knows only 3.1's scaling).
/// An error says what cannot be written, before anything is: a checkpoint's model file is
/// checked with this at the start of a run.
pub fn llmc_header(cfg: &ModelConfig, dtype: crate::files::Dtype) -> anyhow::Result<Vec<u8>> {
    let (c, v, l, f) = (cfg.channels, cfg.vocab_size, cfg.num_layers, cfg.hidden);
    let (multiple_of, multiplier) = llmc_ffn(c, f).ok_or_else(|| {
        anyhow::anyhow!("the MLP's hidden size {f} cannot be written in llm.c's llama3 header (C={c})")
    })?;
    let mut h = [0i32; 256];
    let mut hf = [0f32; 256];
    let minor = match cfg.rope.scaling {
        None => 1,
        Some(s) if Some(s) == llmc_scaling(1) => 1,
        Some(s) if Some(s) == llmc_scaling(2) => 2,
        Some(s) => {
            h[12] = i32::try_from(s.original_max_position_embeddings).map_err(|_| {
                anyhow::anyhow!(
                    "rope scaling's original_max_position_embeddings {} does not fit llm.c's llama3 header",
                    s.original_max_position_embeddings
                )
            })?;
            hf[3..6].copy_from_slice(&[s.factor, s.low_freq_factor, s.high_freq_factor]);
            0
        }
    };
    let vals = [LLMC_MAGIC, dtype.version(), cfg.max_seq_len as i32, v as i32, l as i32, cfg.num_heads as i32];
    h[..6].copy_from_slice(&vals);
    h[6..12].copy_from_slice(&[
        cfg.num_kv_heads as i32,
        c as i32,
        multiple_of as i32,
        cfg.rope.scaling.is_some() as i32,
        3,
        minor,
    ]);
    hf[..3].copy_from_slice(&[multiplier, cfg.norm_eps, cfg.rope.theta]);
    let mut header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    header.extend(hf.iter().flat_map(|x| x.to_le_bytes()));
    Ok(header)
}

/// The bytes of an llm.c llama3 model file: [`llmc_header`], then GPT-2's 16 tensor slots:
/// wte (V, C), the LM head in wpe's slot (V, C; wte again when tied), zero biases where Llama
/// has none, fc = [up; gate], q and k rows in Meta's interleaved-pair layout.
pub fn llmc_file(w: &Weights, dtype: crate::files::Dtype) -> anyhow::Result<(Vec<u8>, Vec<f32>)> {
    let cfg = &w.config;
    let (c, v, l) = (cfg.channels, cfg.vocab_size, cfg.num_layers);
    let header = llmc_header(cfg, dtype)?;
    // The values in file order.
    let mut out = Vec::with_capacity(w.data.len() + 2 * v * c);
    out.extend_from_slice(&w.tensor(Tensor::Wte)[..v * c]);
    let head = if cfg.tied_head { Tensor::Wte } else { Tensor::LmHead };
    out.extend_from_slice(&w.tensor(head)[..v * c]);
    let zeros = |n: usize| std::iter::repeat_n(0f32, n);
    let per_layer = |t: Tensor, out: &mut Vec<f32>| {
        for layer in 0..l {
            let x = w.layer(t, layer);
            if x.is_empty() {
                out.extend(zeros(t_len(cfg, t)));
            } else if t == Tensor::QkvW || t == Tensor::QkvB {
                out.extend(interleave_qk(cfg, x, t == Tensor::QkvW, false));
            } else {
                out.extend_from_slice(x);
            }
        }
    };
    for t in Tensor::BLOCK {
        per_layer(t, &mut out);
    }
    out.extend_from_slice(w.tensor(Tensor::LnfW));
    out.extend(zeros(c));
    Ok((header, out))
}

/// Elements per layer of a block tensor's slot in llm.c's llama3 file (GPT-2's slots, with
/// Llama's widths: QKV rows, 2F for fc).
fn t_len(cfg: &ModelConfig, t: Tensor) -> usize {
    let (c, f, qkv) = (cfg.channels, cfg.hidden, cfg.qkv_dim());
    match t {
        Tensor::QkvW => qkv * c,
        Tensor::QkvB => qkv,
        Tensor::AttProjW => c * c,
        Tensor::FcW => 2 * f * c,
        Tensor::FcB => 2 * f,
        Tensor::FcProjW => c * f,
        _ => c,
    }
}

/// The q and k rows of a layer's qkv weight (`rows` true; its bias when false) moved between
/// transformers' layout (per head: the first halves of the rotated pairs, then the second
/// halves) and Meta's (pairs interleaved): `to_hf` reads Meta's. v is unchanged.
fn interleave_qk(cfg: &ModelConfig, x: &[f32], rows: bool, to_hf: bool) -> Vec<f32> {
    let (hs, heads) = (cfg.head_size(), cfg.num_heads + cfg.num_kv_heads);
    let width = if rows { cfg.channels } else { 1 };
    let mut out = x.to_vec();
    for h in 0..heads {
        for j in 0..hs / 2 {
            for p in 0..2 {
                let (hf, meta) = (h * hs + p * hs / 2 + j, h * hs + 2 * j + p);
                let (dst, src) = if to_hf { (hf, meta) } else { (meta, hf) };
                out[dst * width..(dst + 1) * width].copy_from_slice(&x[src * width..(src + 1) * width]);
            }
        }
    }
    out
}

/// The shape and dtype in the headers of an llm.c llama3 model file (its first 2 KiB). Tied
/// head and biases are told by the values ([`read_llmc`]): here every slot counts (untied,
/// biased).
pub fn llmc_config(bytes: &[u8], path: &std::path::Path) -> anyhow::Result<(ModelConfig, crate::files::Dtype)> {
    use crate::files::Dtype;
    use crate::files::HEADER_BYTES;
    use anyhow::{bail, Context};
    let at = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    if bytes.len() < 2 * HEADER_BYTES {
        bail!(
            "{} is too short to be an llm.c llama3 model file ({} bytes): it is truncated",
            path.display(),
            bytes.len()
        );
    }
    let atf = |i: usize| f32::from_le_bytes(bytes[HEADER_BYTES + 4 * i..HEADER_BYTES + 4 * i + 4].try_into().unwrap());
    let dtype = match at(1) {
        3 => Dtype::F32,
        5 => Dtype::BF16,
        v => bail!("{}: llama3 model file version {v} is not supported (3 = fp32, 5 = bf16)", path.display()),
    };
    let dim = |i: usize, name: &str| -> anyhow::Result<usize> {
        usize::try_from(at(i))
            .ok()
            .filter(|&x| x > 0)
            .with_context(|| format!("{}: header field {name} = {} is invalid", path.display(), at(i)))
    };
    let (max_t, v, l, nh, kv, c) = (
        dim(2, "max_seq_len")?,
        dim(3, "vocab_size")?,
        dim(4, "num_layers")?,
        dim(5, "num_heads")?,
        dim(6, "num_kv_heads")?,
        dim(7, "channels")?,
    );
    let multiple_of = dim(8, "multiple_of")?;
    let (multiplier, eps, theta) = (atf(0), atf(1), atf(2));
    if !(multiplier.is_finite() && multiplier > 0.0 && multiplier < 1e3) {
        bail!("{}: header field ffn_dim_multiplier = {multiplier} is invalid", path.display());
    }
    if c > 1 << 16 || multiple_of > 1 << 18 {
        bail!("{}: model shape is implausibly large (C={c}, multiple_of={multiple_of})", path.display());
    }
    let scaling = match (at(9), at(10), at(11)) {
        (0, 3, _) => None,
        (1, 3, 0) => {
            // llmrs's extension: the scaling written out (see llmc_header).
            let old = usize::try_from(at(12)).ok().filter(|&x| x > 0).with_context(|| {
                format!("{}: header field original_max_position_embeddings = {} is invalid", path.display(), at(12))
            })?;
            Some(Llama3Scaling {
                factor: atf(3),
                low_freq_factor: atf(4),
                high_freq_factor: atf(5),
                original_max_position_embeddings: old,
            })
        }
        (1, 3, minor) => Some(
            llmc_scaling(minor)
                .with_context(|| format!("{}: Llama 3.{minor}'s rope scaling is unknown", path.display()))?,
        ),
        (s, major, minor) => {
            bail!("{}: use_scaled_rope {s} for Llama {major}.{minor} is not supported", path.display())
        }
    };
    let f = llmc_hidden(c, multiple_of, multiplier);
    let mut cfg = ModelConfig::llama(l, c, nh, kv, f, v, max_t, crate::config::Rope { theta, scaling });
    cfg.norm_eps = eps;
    cfg.tied_head = false;
    cfg.attn_bias = true; // read every slot first; dropped below when the biases are zero
    cfg.validate().with_context(|| format!("{}: bad model header", path.display()))?;
    Ok((cfg, dtype))
}

/// Read an llm.c llama3 model file ([`llmc_file`]'s layout) into weights in transformers'
/// layout: the untied head and the biases are kept only when non-zero and distinct.
pub fn read_llmc(bytes: &[u8], path: &std::path::Path) -> anyhow::Result<Weights> {
    use crate::files::Dtype;
    use crate::files::{bf16s_from_le, f32s_from_le, HEADER_BYTES};
    use anyhow::bail;
    let (mut cfg, dtype) = llmc_config(bytes, path)?;
    let (v, l, c) = (cfg.vocab_size, cfg.num_layers, cfg.channels);
    // The file's values: wte, head, then the 12 block slots and lnf w, b.
    let n = 2 * v * c + Tensor::BLOCK.iter().map(|&t| l * t_len(&cfg, t)).sum::<usize>() + 2 * c;
    let want = 2 * HEADER_BYTES + n * dtype.bytes();
    if bytes.len() != want {
        bail!(
            "{}: file is {} bytes but a {dtype} llama3 model of this shape needs {want}: truncated or corrupt",
            path.display(),
            bytes.len()
        );
    }
    let mut vals = crate::mem::zeroed::<f32>(n);
    match dtype {
        Dtype::F32 => f32s_from_le(&bytes[2 * HEADER_BYTES..], &mut vals),
        Dtype::BF16 => bf16s_from_le(&bytes[2 * HEADER_BYTES..], &mut vals),
    }
    let mut at = 0;
    let mut take = |k: usize| {
        at += k;
        &vals[at - k..at]
    };
    let (wte, head) = (take(v * c).to_vec(), take(v * c).to_vec());
    let mut blocks = vec![];
    for t in Tensor::BLOCK {
        blocks.push((t, take(l * t_len(&cfg, t)).to_vec()));
    }
    let (lnf_w, lnf_b) = (take(c).to_vec(), take(c).to_vec());
    let zero = |x: &[f32]| x.iter().all(|&y| y == 0.0);
    for (t, x) in &blocks {
        if matches!(t, Tensor::Ln1B | Tensor::Ln2B | Tensor::FcB | Tensor::FcProjB) && !zero(x) {
            bail!(
                "{}: the {} slot holds non-zero values, but a Llama model has no such bias",
                path.display(),
                t.name()
            );
        }
    }
    if !zero(&lnf_b) {
        bail!("{}: the lnfb slot holds non-zero values, but a Llama model has no such bias", path.display());
    }
    let bias = |t: Tensor| &blocks.iter().find(|b| b.0 == t).unwrap().1;
    cfg.attn_bias = !(zero(bias(Tensor::QkvB)) && zero(bias(Tensor::AttProjB)));
    cfg.tied_head = head == wte;
    let mut w = Weights::zeros(cfg)?;
    w.tensor_mut(Tensor::Wte)[..v * c].copy_from_slice(&wte);
    if !cfg.tied_head {
        w.tensor_mut(Tensor::LmHead)[..v * c].copy_from_slice(&head);
    }
    w.tensor_mut(Tensor::LnfW).copy_from_slice(&lnf_w);
    for (t, x) in blocks {
        if t.numel(&cfg) == 0 {
            continue;
        }
        for (layer, xl) in x.chunks_exact(t_len(&cfg, t)).enumerate() {
            let y = if t == Tensor::QkvW || t == Tensor::QkvB {
                interleave_qk(&cfg, xl, t == Tensor::QkvW, true)
            } else {
                xl.to_vec()
            };
            w.layer_mut(t, layer).copy_from_slice(&y);
        }
    }
    Ok(w)
}

// ---- Hugging Face (transformers' LlamaForCausalLM) ----------------------------------------------

/// A `LlamaForCausalLM` config.json, checked to be a model llmrs computes exactly: every field
/// that changes the computation is read, and one that llmrs does not implement is an error
/// that names it.
pub fn parse_hf_config(v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
    let p = path.display();
    let int = |k: &str| -> Result<usize> {
        v[k].as_u64().map(|x| x as usize).with_context(|| format!("{p}: {k} is missing or not a whole number"))
    };
    let opt_int = |k: &str| v.get(k).filter(|x| !x.is_null()).map(|x| x.as_u64().map(|x| x as usize));
    let num = |x: &serde_json::Value, k: &str| -> Result<f32> {
        x.as_f64().map(|x| x as f32).with_context(|| format!("{p}: {k} is not a number"))
    };
    let flag = |k: &str, default: bool| -> Result<bool> {
        match v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(x) => x.as_bool().with_context(|| format!("{p}: {k} is not true or false")),
        }
    };
    let (c, heads, layers) = (int("hidden_size")?, int("num_attention_heads")?, int("num_hidden_layers")?);
    let kv = match opt_int("num_key_value_heads") {
        None => heads,
        Some(x) => x.with_context(|| format!("{p}: num_key_value_heads is not a whole number"))?,
    };
    if let Some(hd) = opt_int("head_dim") {
        let hd = hd.with_context(|| format!("{p}: head_dim is not a whole number"))?;
        if heads == 0 || hd * heads != c {
            bail!("{p}: head_dim {hd} is not hidden_size / num_attention_heads; llmrs needs HS = C / NH");
        }
    }
    let act = v["hidden_act"].as_str().unwrap_or("silu");
    if act != "silu" {
        bail!("{p}: hidden_act '{act}' is not supported (Llama's SwiGLU uses silu)");
    }
    if flag("mlp_bias", false)? {
        bail!("{p}: mlp_bias true is not supported (llmrs's Llama MLP has no biases)");
    }
    let max_t = match opt_int("max_position_embeddings") {
        None => 2048,
        Some(x) => x.with_context(|| format!("{p}: max_position_embeddings is not a whole number"))?,
    };
    // transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters.
    for k in ["rope_parameters", "rope_scaling"] {
        if !(v[k].is_null() || v[k].is_object()) {
            bail!("{p}: {k} is not a JSON object (of rope_type, rope_theta and the scaling's fields)");
        }
    }
    let params = &v["rope_parameters"];
    let theta = match (&v["rope_theta"], &params["rope_theta"]) {
        (t, _) if !t.is_null() => num(t, "rope_theta")?,
        (_, t) if !t.is_null() => num(t, "rope_parameters.rope_theta")?,
        _ => 10000.0,
    };
    let (field, s) =
        if !v["rope_scaling"].is_null() { ("rope_scaling", &v["rope_scaling"]) } else { ("rope_parameters", params) };
    let kind = s["rope_type"].as_str().or(s["type"].as_str()).unwrap_or("default");
    let scaling = match kind {
        "default" => None,
        "llama3" => {
            let f = |k: &str| num(&s[k], &format!("{field}.{k}"));
            let old = s["original_max_position_embeddings"].as_u64().with_context(|| {
                format!("{p}: {field}.original_max_position_embeddings is missing or not a whole number")
            })?;
            Some(Llama3Scaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: old as usize,
            })
        }
        other => bail!("{p}: {field}.rope_type '{other}' is not supported (llmrs implements 'default' and 'llama3')"),
    };
    let eps = match &v["rms_norm_eps"] {
        serde_json::Value::Null => 1e-6,
        x => num(x, "rms_norm_eps")?,
    };
    let rope = crate::config::Rope { theta, scaling };
    let mut cfg = ModelConfig::llama(layers, c, heads, kv, int("intermediate_size")?, int("vocab_size")?, max_t, rope);
    cfg.norm_eps = eps;
    cfg.tied_head = flag("tie_word_embeddings", false)?;
    cfg.attn_bias = flag("attention_bias", false)?;
    Ok(cfg)
}

/// `config.json` as transformers writes it for a LlamaForCausalLM of this shape.
pub fn hf_config(cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
    let scaling = cfg.rope.scaling.map(|s| {
        serde_json::json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        })
    });
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.channels,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size(),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tied_head,
        "attention_bias": cfg.attn_bias,
        "mlp_bias": false,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": torch_dtype,
    })
}

/// transformers' LlamaForCausalLM tensors. Its linear layers are `nn.Linear` (out, in), as
/// llmrs's; q, k and v are rows of QkvW, up and gate rows of FcW.
pub fn hf_tensors(cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
    let (c, v, f, kv) = (cfg.channels, cfg.vocab_size, cfg.hidden, cfg.kv_dim());
    let t = |name: String, range: std::ops::Range<usize>, shape: Vec<usize>| HfTensor {
        name,
        range,
        shape,
        transposed: false,
    };
    // Rows r0..r0+n of a tensor laid out as rows of `width`.
    let rows = |whole: std::ops::Range<usize>, r0: usize, n: usize, width: usize| {
        whole.start + r0 * width..whole.start + (r0 + n) * width
    };
    let mut out = vec![t(
        "model.embed_tokens.weight".into(),
        lay.range(Tensor::Wte).start..lay.range(Tensor::Wte).start + v * c,
        vec![v, c],
    )];
    for l in 0..cfg.num_layers {
        let b = lay.block(l);
        let name = |s: &str| format!("model.layers.{l}.{s}");
        out.push(t(name("input_layernorm.weight"), b.ln1_w.clone(), vec![c]));
        for (proj, r0, n) in [("q_proj", 0, c), ("k_proj", c, kv), ("v_proj", c + kv, kv)] {
            out.push(t(name(&format!("self_attn.{proj}.weight")), rows(b.qkv_w.clone(), r0, n, c), vec![n, c]));
            if cfg.attn_bias {
                out.push(t(name(&format!("self_attn.{proj}.bias")), rows(b.qkv_b.clone(), r0, n, 1), vec![n]));
            }
        }
        out.push(t(name("self_attn.o_proj.weight"), b.attn_proj_w.clone(), vec![c, c]));
        if cfg.attn_bias {
            out.push(t(name("self_attn.o_proj.bias"), b.attn_proj_b.clone(), vec![c]));
        }
        out.push(t(name("post_attention_layernorm.weight"), b.ln2_w.clone(), vec![c]));
        out.push(t(name("mlp.up_proj.weight"), rows(b.fc_w.clone(), 0, f, c), vec![f, c]));
        out.push(t(name("mlp.gate_proj.weight"), rows(b.fc_w.clone(), f, f, c), vec![f, c]));
        out.push(t(name("mlp.down_proj.weight"), b.fc_proj_w.clone(), vec![c, f]));
    }
    out.push(t("model.norm.weight".into(), lay.range(Tensor::LnfW), vec![c]));
    if !cfg.tied_head {
        let h = lay.range(Tensor::LmHead);
        out.push(t("lm_head.weight".into(), h.start..h.start + v * c, vec![v, c]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rope;

    #[test]
    fn llmc_file_round_trip() {
        use crate::files::Dtype;
        for desc in ["llama:2x64:4:2", "llama:1x32:2:1:40:16"] {
            for (tied, bias) in [(true, false), (false, true)] {
                let cfg =
                    ModelConfig { tied_head: tied, attn_bias: bias, ..ModelConfig::from_descriptor(desc).unwrap() };
                let mut w = Weights::random(cfg, 5).unwrap();
                if bias {
                    let n = w.tensor(Tensor::QkvB).len();
                    w.tensor_mut(Tensor::QkvB).copy_from_slice(&(0..n).map(|i| i as f32 * 0.01).collect::<Vec<_>>());
                }
                let (h, vals) = llmc_file(&w, Dtype::F32).unwrap();
                let mut bytes = h.clone();
                crate::files::f32s_to_le(&vals, &mut bytes);
                let back = read_llmc(&bytes, std::path::Path::new("x.bin")).unwrap();
                assert_eq!(back, w, "{desc} tied={tied}");
                let (h2, vals2) = llmc_file(&back, Dtype::F32).unwrap();
                assert!(h2 == h && vals2 == vals, "byte-exact");
                assert!(read_llmc(&bytes[..bytes.len() - 4], std::path::Path::new("x.bin")).is_err());
            }
        }
        // A rope scaling llm.c's file cannot name (neither 3.1's nor 3.2's) is written out in
        // llmrs's extension and read back exactly; one that no file can hold is refused before
        // anything is written.
        let custom = Llama3Scaling {
            factor: 16.0,
            low_freq_factor: 2.0,
            high_freq_factor: 8.0,
            original_max_position_embeddings: 4096,
        };
        let base = ModelConfig::from_descriptor("llama:2x64:4:2").unwrap();
        let cfg = ModelConfig { rope: Rope { theta: 500000.0, scaling: Some(custom) }, ..base };
        let w = Weights::random(cfg, 3).unwrap();
        let (h, vals) = llmc_file(&w, Dtype::F32).unwrap();
        let mut bytes = h.clone();
        crate::files::f32s_to_le(&vals, &mut bytes);
        assert_eq!(read_llmc(&bytes, std::path::Path::new("x.bin")).unwrap(), w);
        let huge = Llama3Scaling { original_max_position_embeddings: 1 << 40, ..custom };
        let e = llmc_header(&ModelConfig { rope: Rope { theta: 1e4, scaling: Some(huge) }, ..base }, Dtype::F32);
        assert!(e.unwrap_err().to_string().contains("original_max_position_embeddings"));
        // Meta's layout interleaves the pairs of each q and k head.
        let cfg = ModelConfig::from_descriptor("llama:1x8:2:1").unwrap(); // HS 4, 3 rotated heads
        let x: Vec<f32> = (0..cfg.qkv_dim()).map(|i| i as f32).collect();
        let meta = interleave_qk(&cfg, &x, false, false);
        assert_eq!(&meta[..4], &[0.0, 2.0, 1.0, 3.0]);
        assert_eq!(&meta[12..], &x[12..], "v is not permuted");
        assert_eq!(interleave_qk(&cfg, &meta, false, true), x);
    }

    #[test]
    fn rotary_frequencies() {
        let cfg = ModelConfig::from_descriptor("llama:1x64:2:1").unwrap(); // HS 32
        let f = inv_freq(&cfg);
        assert_eq!(f.len(), 16);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 10000f32.powf(-2.0 / 32.0)).abs() < 1e-7);
        // Llama 3.1 scaling: the highest frequencies are kept, the lowest divided by the factor.
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        };
        let scaled = inv_freq(&ModelConfig { rope: Rope { theta: 10000.0, scaling: Some(s) }, ..cfg });
        assert_eq!(scaled[0], f[0]);
        assert_eq!(scaled[15], f[15] / 8.0);
        assert!(scaled.iter().zip(&f).all(|(a, b)| a <= b && *a >= b / 8.0));
        let table = rope_table(&cfg);
        assert_eq!(table.len(), cfg.max_seq_len * 32);
        let p = 7;
        assert!((table[p * 32 + 1] - (7.0 * f[1]).cos()).abs() < 1e-6);
        assert!((table[p * 32 + 16 + 1] - (7.0 * f[1]).sin()).abs() < 1e-6);
    }
}

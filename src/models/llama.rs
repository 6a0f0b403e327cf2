//! Llama (transformers' `LlamaForCausalLM`: Llama 3, SmolLM2, TinyLlama): the decoder of
//! [`super::decoder`] as it is, HS = C / NH, no biases unless the config sets `attention_bias`
//! (q, k, v and the output projection alike), the LM head tied or not. Its files: llm.c's
//! `llama3`-branch model file (magic 20240803, below) and transformers' directories.

use super::decoder::{self, DecoderFamily, HfFields, T};
use crate::core::config::{Family, Llama3Scaling, ModelConfig, Rope, GPT2_VOCAB};
use crate::core::files::{Dtype, ModelFile, HEADER_BYTES};
use crate::core::params::Weights;
use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;

pub struct Llama;

pub const LLAMA: Family = Family("llama");

/// Magic of llm.c's llama3 model file (its `llama3` branch, train_llama3.py's write_model).
pub const LLMC_MAGIC: i32 = 20240803;

/// A Llama shape: [`decoder::config`]'s.
#[allow(clippy::too_many_arguments)]
fn config(
    layers: usize,
    c: usize,
    heads: usize,
    kv: usize,
    f: usize,
    vocab: usize,
    max_t: usize,
    rope: Rope,
) -> ModelConfig {
    decoder::config(LLAMA, layers, c, heads, kv, f, vocab, max_t, rope)
}

/// `NAME` presets and the explicit `LxC:NH:KV[:F[:maxT]]` form of `llama:...` descriptors (F
/// defaults to SwiGLU's 8C/3 rounded up to a multiple of 64; GPT-2's vocabulary, so that
/// GPT-2-tokenized data trains it).
fn descriptor(rest: &str, desc: &str) -> Result<ModelConfig> {
    // The configs of the models on the Hub (config.json), without their weights.
    let llama3_scaling = |factor: f32| Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let rope = |theta: f32, scaling: Option<Llama3Scaling>| Rope { theta, scaling };
    let preset = match rest {
        "smollm2-135m" => Some(config(30, 576, 9, 3, 1536, 49152, 8192, rope(100000.0, None))),
        "smollm2-360m" => Some(config(32, 960, 15, 5, 2560, 49152, 8192, rope(100000.0, None))),
        "smollm2-1.7b" => Some(config(24, 2048, 32, 32, 8192, 49152, 8192, rope(130000.0, None))),
        "tinyllama-1.1b" => {
            Some(ModelConfig { tied_head: false, ..config(22, 2048, 32, 4, 5632, 32000, 2048, Rope::BASE) })
        }
        "llama3.2-1b" => {
            Some(config(16, 2048, 32, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
        }
        "llama3.2-3b" => {
            Some(config(28, 3072, 24, 8, 8192, 128256, 131072, rope(500000.0, Some(llama3_scaling(32.0)))))
        }
        _ => None,
    };
    if let Some(cfg) = preset {
        return Ok(cfg);
    }
    if let Some(n) = decoder::descriptor_numbers(rest, 2, 4, desc) {
        let n = n?;
        let (l, c, nh, kv) = (n[0], n[1], n[2], n[3]);
        let f = n.get(4).copied().unwrap_or((8 * c / 3).div_ceil(64) * 64);
        if nh == 0 || !c.is_multiple_of(nh) {
            bail!("model descriptor '{desc}': channels {c} is not a multiple of the number of heads {nh}");
        }
        return Ok(config(l, c, nh, kv, f, GPT2_VOCAB, n.get(5).copied().unwrap_or(1024), Rope::BASE));
    }
    bail!(
        "unknown Llama model '{desc}': use llama:smollm2-135m, llama:smollm2-360m, llama:smollm2-1.7b, \
         llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b, or llama:LxC:NH:KV[:F[:maxT]] such as \
         llama:4x256:8:2"
    )
}

impl DecoderFamily for Llama {
    const NAME: &'static str = LLAMA.0;
    const HF_NAMES: (&'static str, &'static str) = ("LlamaForCausalLM", "llama");
    const DESCRIPTOR_HELP: &'static str = "Llama: llama:smollm2-135m, llama:smollm2-360m, llama:smollm2-1.7b, \
        llama:tinyllama-1.1b, llama:llama3.2-1b, llama:llama3.2-3b, llama:LxC:NH:KV[:F[:maxT]] such as llama:4x256:8:2";

    fn descriptor(&self, rest: &str, desc: &str) -> Result<ModelConfig> {
        descriptor(rest, desc)
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        if cfg.head_dim * cfg.num_heads != cfg.channels {
            bail!(
                "a Llama model has HS = C / NH (head_dim {} with {} heads of C={})",
                cfg.head_dim,
                cfg.num_heads,
                cfg.channels
            );
        }
        if cfg.qkv_bias != cfg.out_bias {
            bail!("a Llama model's attention_bias puts biases on q, k, v and the output projection alike");
        }
        Ok(())
    }

    /// A `LlamaForCausalLM` config.json: every field that changes the computation is read, and
    /// one that llmrs does not implement is an error that names it.
    fn config_from_hf(&self, f: &HfFields, path: &Path) -> Result<ModelConfig> {
        if f.head_dim * f.heads != f.c {
            bail!(
                "{}: head_dim {} is not hidden_size / num_attention_heads; a Llama model has HS = C / NH",
                path.display(),
                f.head_dim
            );
        }
        if f.flag("mlp_bias", false)? {
            bail!("{}: mlp_bias true is not supported (llmrs's Llama MLP has no biases)", path.display());
        }
        let bias = f.flag("attention_bias", false)?;
        Ok(ModelConfig { qkv_bias: bias, out_bias: bias, ..f.config(LLAMA, f.flag("tie_word_embeddings", false)?) })
    }

    fn hf_config_extra(&self, cfg: &ModelConfig, v: &mut serde_json::Value) {
        v["attention_bias"] = cfg.qkv_bias.into();
        v["mlp_bias"] = false.into();
    }

    fn llmc_magic(&self) -> Option<i32> {
        Some(LLMC_MAGIC)
    }

    fn llmc_header(&self, cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
        llmc_header(cfg, dtype)
    }

    fn llmc_write(&self, w: &Weights, dtype: Dtype) -> Result<(Vec<u8>, Vec<f32>)> {
        llmc_write(w, dtype)
    }

    fn llmc_read(&self, f: &mut ModelFile) -> Result<Weights> {
        llmc_read(f)
    }

    fn llmc_config(&self, bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        read_header(bytes, path)
    }
}

// ---- llm.c's llama3 model file ----------------------------------------------------------------

/// The 12 block slots of llm.c's file (GPT-2's), with Llama's widths: the tensor that fills each
/// (None: a bias Llama lacks, written as zeros) and its values per layer.
fn slots(cfg: &ModelConfig) -> [(&'static str, Option<T>, usize); 12] {
    let (c, f, qkv) = (cfg.channels, cfg.hidden, cfg.qkv_dim());
    [
        ("ln1w", Some(T::Ln1W), c),
        ("ln1b", None, c),
        ("qkvw", Some(T::QkvW), qkv * c),
        ("qkvb", Some(T::QkvB), qkv),
        ("attprojw", Some(T::AttProjW), c * c),
        ("attprojb", Some(T::AttProjB), c),
        ("ln2w", Some(T::Ln2W), c),
        ("ln2b", None, c),
        ("fcw", Some(T::FcW), 2 * f * c),
        ("fcb", None, 2 * f),
        ("fcprojw", Some(T::FcProjW), c * f),
        ("fcprojb", None, c),
    ]
}

/// The bytes of an llm.c llama3 model file: [`llmc_header`], then GPT-2's 16 tensor slots:
/// wte (V, C), the LM head in wpe's slot (V, C; wte again when tied), zero biases where Llama
/// has none, fc = [up; gate], q and k rows in Meta's interleaved-pair layout.
pub fn llmc_write(w: &Weights, dtype: Dtype) -> Result<(Vec<u8>, Vec<f32>)> {
    let cfg = &w.config;
    let (c, v, l) = (cfg.channels, cfg.vocab_size, cfg.num_layers);
    let header = llmc_header(cfg, dtype)?;
    let mut out = Vec::with_capacity(w.data.len() + 2 * v * c);
    out.extend_from_slice(&w.tensor(T::Wte)[..v * c]);
    let head = if cfg.tied_head { T::Wte } else { T::LmHead };
    out.extend_from_slice(&w.tensor(head)[..v * c]);
    for (_, t, len) in slots(cfg) {
        for layer in 0..l {
            match t.map(|t| w.layer(t, layer)).filter(|x| !x.is_empty()) {
                None => out.extend(std::iter::repeat_n(0f32, len)),
                Some(x) if matches!(t, Some(T::QkvW | T::QkvB)) => {
                    out.extend(interleave_qk(cfg, x, t == Some(T::QkvW), false))
                }
                Some(x) => out.extend_from_slice(x),
            }
        }
    }
    out.extend_from_slice(w.tensor(T::LnfW));
    out.extend(std::iter::repeat_n(0f32, c));
    Ok((header, out))
}

/// Read an llm.c llama3 model file ([`llmc_write`]'s layout) into weights in transformers'
/// layout: the untied head and the biases are kept only when non-zero and distinct.
pub fn llmc_read(f: &mut ModelFile) -> Result<Weights> {
    let path = f.path;
    let (mut cfg, dtype) = read_header(&f.head, path)?;
    let (v, l, c) = (cfg.vocab_size, cfg.num_layers, cfg.channels);
    let slots = slots(&cfg);
    // The file's values: wte, head, then the 12 block slots and lnf w, b.
    let n = 2 * v * c + slots.iter().map(|s| l * s.2).sum::<usize>() + 2 * c;
    let want = 2 * HEADER_BYTES + n * dtype.bytes();
    if f.len != want as u64 {
        bail!(
            "{}: file is {} bytes but a {dtype} llama3 model of this shape needs {want}: truncated or corrupt",
            path.display(),
            f.len
        );
    }
    let mut vals = crate::core::mem::zeroed::<f32>(n);
    f.values(2 * HEADER_BYTES as u64, dtype, &mut vals)?;
    let mut at = 0;
    let mut take = |k: usize| {
        at += k;
        &vals[at - k..at]
    };
    // Views into the values (no copies: the file's values and the weights are the peak).
    let (wte, head) = (take(v * c), take(v * c));
    let blocks: Vec<(&str, Option<T>, usize, &[f32])> =
        slots.iter().map(|&(name, t, len)| (name, t, len, take(l * len))).collect();
    let (lnf_w, lnf_b) = (take(c), take(c));
    let zero = |x: &[f32]| x.iter().all(|&y| y == 0.0);
    for (name, t, _, x) in &blocks {
        if t.is_none() && !zero(x) {
            bail!("{}: the {name} slot holds non-zero values, but a Llama model has no such bias", path.display());
        }
    }
    if !zero(lnf_b) {
        bail!("{}: the lnfb slot holds non-zero values, but a Llama model has no such bias", path.display());
    }
    let slot = |t: T| blocks.iter().find(|b| b.1 == Some(t)).unwrap().3;
    let bias = !(zero(slot(T::QkvB)) && zero(slot(T::AttProjB)));
    (cfg.qkv_bias, cfg.out_bias) = (bias, bias);
    cfg.tied_head = head == wte;
    let mut w = Weights::zeros(cfg)?;
    w.tensor_mut(T::Wte)[..v * c].copy_from_slice(wte);
    if !cfg.tied_head {
        w.tensor_mut(T::LmHead)[..v * c].copy_from_slice(head);
    }
    w.tensor_mut(T::LnfW).copy_from_slice(lnf_w);
    for (_, t, len, x) in blocks {
        let Some(t) = t.filter(|&t| w.layout.spec(t).numel_per_layer() > 0) else { continue };
        for (layer, xl) in x.chunks_exact(len).enumerate() {
            if matches!(t, T::QkvW | T::QkvB) {
                w.layer_mut(t, layer).copy_from_slice(&interleave_qk(&cfg, xl, t == T::QkvW, true));
            } else {
                w.layer_mut(t, layer).copy_from_slice(xl);
            }
        }
    }
    Ok(w)
}

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
pub fn llmc_header(cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
    let (c, v, l, f) = (cfg.channels, cfg.vocab_size, cfg.num_layers, cfg.hidden);
    if cfg.head_dim * cfg.num_heads != c {
        bail!(
            "llm.c's llama3 header has no head size: it needs HS = C / NH (here {} x {} != {c})",
            cfg.num_heads,
            cfg.head_dim
        );
    }
    let (multiple_of, multiplier) = llmc_ffn(c, f)
        .ok_or_else(|| anyhow!("the MLP's hidden size {f} cannot be written in llm.c's llama3 header (C={c})"))?;
    let mut h = [0i32; 256];
    let mut hf = [0f32; 256];
    let minor = match cfg.rope.scaling {
        None => 1,
        Some(s) if Some(s) == llmc_scaling(1) => 1,
        Some(s) if Some(s) == llmc_scaling(2) => 2,
        Some(s) => {
            h[12] = i32::try_from(s.original_max_position_embeddings).map_err(|_| {
                anyhow!(
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
fn read_header(bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
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
    let dim = |i: usize, name: &str| -> Result<usize> {
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
    let mut cfg = config(l, c, nh, kv, f, v, max_t, Rope { theta, scaling });
    cfg.norm_eps = eps;
    cfg.tied_head = false;
    (cfg.qkv_bias, cfg.out_bias) = (true, true); // read every slot first; dropped when the biases are zero
    if nh == 0 || !c.is_multiple_of(nh) {
        bail!("{}: bad model header: channels {c} is not a multiple of the number of heads {nh}", path.display());
    }
    super::validate(&cfg).with_context(|| format!("{}: bad model header", path.display()))?;
    Ok((cfg, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::Rope;

    /// [`llmc_read`] of a file's bytes in memory.
    fn read_bytes(bytes: &[u8]) -> Result<Weights> {
        llmc_read(&mut ModelFile::from_bytes(bytes, std::path::Path::new("x.bin"))?)
    }

    #[test]
    fn llmc_file_round_trip() {
        use crate::core::files::Dtype;
        for desc in ["llama:2x64:4:2", "llama:1x32:2:1:40:16"] {
            for (tied, bias) in [(true, false), (false, true)] {
                let cfg = ModelConfig {
                    tied_head: tied,
                    qkv_bias: bias,
                    out_bias: bias,
                    ..ModelConfig::from_descriptor(desc).unwrap()
                };
                let mut w = Weights::random(cfg, 5).unwrap();
                if bias {
                    let n = w.tensor(T::QkvB).len();
                    w.tensor_mut(T::QkvB).copy_from_slice(&(0..n).map(|i| i as f32 * 0.01).collect::<Vec<_>>());
                }
                let (h, vals) = llmc_write(&w, Dtype::F32).unwrap();
                let mut bytes = h.clone();
                crate::core::files::f32s_to_le(&vals, &mut bytes);
                let back = read_bytes(&bytes).unwrap();
                assert_eq!(back, w, "{desc} tied={tied}");
                let (h2, vals2) = llmc_write(&back, Dtype::F32).unwrap();
                assert!(h2 == h && vals2 == vals, "byte-exact");
                assert!(read_bytes(&bytes[..bytes.len() - 4]).is_err());
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
        let (h, vals) = llmc_write(&w, Dtype::F32).unwrap();
        let mut bytes = h.clone();
        crate::core::files::f32s_to_le(&vals, &mut bytes);
        assert_eq!(read_bytes(&bytes).unwrap(), w);
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
}

//! GPT-2 (llm.c's): learned position embeddings, pre-LayerNorm blocks with a GELU MLP of width
//! F = 4C, biases everywhere, the LM head tied to the token embedding. Its files: llm.c's model
//! file (magic 20240326) and transformers' `GPT2LMHeadModel`.

use super::family::{Arch, Attn, Consts};
use crate::backend::ops::{Heads, Mat, Ops, Rows, Seq};
use crate::backend::Buf;
use crate::core::config::{Family, ModelConfig, Rope, GPT2_PADDED_VOCAB, GPT2_VOCAB};
use crate::core::files::{parse_header, Dtype, ModelFile, HEADER_BYTES, HEADER_INTS};
use crate::core::params::{HfTensor, InitSink, ParamLayout, TensorId, TensorSpec, View, Weights};
use crate::core::rng::Mt19937;
use crate::models::acts::{ActPlan, ActSpec, BackActs, BlockActs, NormActs, Width};
use anyhow::{bail, Context, Result};
use std::path::Path;

pub struct Gpt2;

/// GPT-2's family name.
pub const GPT2: Family = Family("gpt2");

/// llm.c's model file.
pub const MODEL_MAGIC: i32 = 20240326;

/// GPT-2's tensors, in llm.c's file order; the per-layer ones are stacked over the L blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T {
    Wte,      // (Vp, C) token embedding, and the tied LM head
    Wpe,      // (maxT, C) learned positions
    Ln1W,     // (L, C)
    Ln1B,     // (L, C)
    QkvW,     // (L, 3C, C) q, k and v stacked
    QkvB,     // (L, 3C)
    AttProjW, // (L, C, C)
    AttProjB, // (L, C)
    Ln2W,     // (L, C)
    Ln2B,     // (L, C)
    FcW,      // (L, 4C, C)
    FcB,      // (L, 4C)
    FcProjW,  // (L, C, 4C)
    FcProjB,  // (L, C)
    LnfW,     // (C)
    LnfB,     // (C)
}
crate::ids!(T);

/// The activations a block keeps (per layer), and its workspace.
#[derive(Clone, Copy, Debug)]
pub enum A {
    Ln1,       // (N, C)
    Ln1Mean,   // (N)
    Ln1Rstd,   // (N)
    Qkv,       // (N, 3C)
    Atty,      // (N, C)
    AttStats,  // (B, NH, T, 2) each query row's softmax statistics (flash attention's)
    Residual2, // (N, C)
    Ln2,       // (N, C)
    Ln2Mean,   // (N)
    Ln2Rstd,   // (N)
    Fch,       // (N, 4C)
    FchGelu,   // (N, 4C)
    Scratch,   // (N, C) shared: attention's workspace, then the projections' outputs; d(ln), d(atty)
}
crate::ids!(A);

/// The backward's buffers.
#[derive(Clone, Copy, Debug)]
pub enum D {
    DFch, // (N, 4C) d(fch); attention backward's workspace (N, 3C)
    DQkv, // (N, 3C)
}
crate::ids!(D);

/// A GPT-2 shape with the standard vocabulary and context of 1024.
pub fn config(num_layers: usize, num_heads: usize, channels: usize) -> ModelConfig {
    ModelConfig {
        family: GPT2,
        max_seq_len: 1024,
        vocab_size: GPT2_VOCAB,
        padded_vocab_size: GPT2_PADDED_VOCAB,
        num_layers,
        num_heads,
        num_kv_heads: num_heads,
        channels,
        head_dim: channels / num_heads.max(1),
        hidden: 4 * channels,
        norm_eps: 1e-5,
        rope: Rope::BASE,
        tied_head: true,
        qkv_bias: true,
        out_bias: true,
    }
}

fn heads(cfg: &ModelConfig) -> Heads {
    Heads { nh: cfg.num_heads, nkv: cfg.num_heads, hs: cfg.head_dim }
}

impl Arch for Gpt2 {
    fn name(&self) -> &'static str {
        GPT2.0
    }

    /// llm.c's `-e` descriptors: `d6 d12 d24 d36 d48` (llm.c's depth presets), `gpt2:dN`, the
    /// four GPT-2 names, `tiny` (L=4, C=256, NH=4, maxT=256: the default run's model), and
    /// `LxC:NH[:maxT]` (e.g. `2x64:4:256`) for small experiments.
    fn descriptor(&self, desc: &str) -> Option<Result<ModelConfig>> {
        let d = desc.trim();
        let by_depth = |d: usize| -> Result<ModelConfig> {
            let (c, nh) = match d {
                6 => (384, 6),    // (unofficial) gpt2-tiny, 30M
                12 => (768, 12),  // gpt2 (124M)
                24 => (1024, 16), // gpt2-medium (350M)
                36 => (1280, 20), // gpt2-large (774M)
                48 => (1600, 25), // gpt2-xl (1558M)
                _ => bail!("unsupported GPT-2 depth d{d}: use one of d6 d12 d24 d36 d48"),
            };
            Ok(config(d, nh, c))
        };
        match d {
            "gpt2" | "gpt2-small" | "124M" => return Some(by_depth(12)),
            "gpt2-medium" | "350M" => return Some(by_depth(24)),
            "gpt2-large" | "774M" => return Some(by_depth(36)),
            "gpt2-xl" | "1558M" => return Some(by_depth(48)),
            // llmrs's small model for the default run: trains on 2 CPU cores in minutes.
            "tiny" => return Some(Ok(ModelConfig { max_seq_len: 256, ..config(4, 4, 256) })),
            _ => {}
        }
        if let Some(rest) = d.strip_prefix("gpt2:d").or_else(|| d.strip_prefix('d')) {
            if let Ok(depth) = rest.parse::<usize>() {
                return Some(by_depth(depth));
            }
        }
        let (lc, rest) = d.split_once(':')?;
        let (l, c) = lc.split_once('x')?;
        let mut it = rest.split(':');
        let nh = it.next().and_then(|s| s.parse().ok())?;
        let (l, c) = (l.parse().ok()?, c.parse().ok()?);
        let mut cfg = config(l, nh, c);
        match it.next().map(|s| s.parse::<usize>().ok()) {
            None => {}
            Some(Some(t)) => cfg.max_seq_len = t,
            Some(None) => return Some(Err(anyhow::anyhow!("bad maxT in model descriptor '{desc}'"))),
        }
        Some(Ok(cfg))
    }

    fn descriptor_help(&self) -> &'static str {
        "GPT-2: d6 d12 d24 d36 d48, gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny, LxC:NH[:maxT] such as 4x256:4:256"
    }

    fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let c = cfg.channels;
        let ok = cfg.num_heads > 0
            && c.is_multiple_of(cfg.num_heads)
            && cfg.head_dim * cfg.num_heads == c
            && cfg.num_kv_heads == cfg.num_heads
            && cfg.hidden == 4 * c
            && cfg.tied_head
            && cfg.qkv_bias
            && cfg.out_bias;
        if !ok {
            bail!(
                "a GPT-2 model has C a multiple of NH, one key/value head per head, a 4C MLP, biases and a tied \
                 head: {cfg}"
            );
        }
        Ok(())
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        let (c, vp, f) = (cfg.channels, cfg.padded_vocab_size, cfg.hidden);
        let s = TensorSpec::new;
        // The GEMMs' gradients are written whole by the first backward after zero_grad; the
        // LM head's GEMM writes wte's before the encoder adds to it.
        vec![
            s("wte", &[vp, c], false, true),
            s("wpe", &[cfg.max_seq_len, c], false, false),
            s("ln1w", &[c], true, false),
            s("ln1b", &[c], true, false),
            s("qkvw", &[3 * c, c], true, true),
            s("qkvb", &[3 * c], true, true),
            s("attprojw", &[c, c], true, true),
            s("attprojb", &[c], true, true),
            s("ln2w", &[c], true, false),
            s("ln2b", &[c], true, false),
            s("fcw", &[f, c], true, true),
            s("fcb", &[f], true, true),
            s("fcprojw", &[c, f], true, true),
            s("fcprojb", &[c], true, true),
            s("lnfw", &[c], false, false),
            s("lnfb", &[c], false, false),
        ]
    }

    /// llm.c's init (train_gpt2.py's `_init_weights`): N(0, 0.02) for the embeddings (the V
    /// real rows of wte) and the matrices, scaled by 1/sqrt(2L) for the two projections into
    /// the residual stream; LayerNorm weights 1, biases 0.
    fn init(&self, w: &mut dyn InitSink, rng: &mut Mt19937) {
        let (cfg, lay) = (*w.config(), w.layout().clone());
        let (l_n, c, v) = (cfg.num_layers, cfg.channels, cfg.vocab_size);
        let residual_scale = 1.0 / (2.0 * l_n as f32).sqrt();
        for t in [T::Ln1W, T::Ln2W, T::LnfW] {
            w.fill(lay.range(t), 1.0);
        }
        let wte = lay.range(T::Wte).start;
        w.normal(wte..wte + v * c, rng, 0.0, 0.02); // the V real rows
        w.normal(lay.range(T::Wpe), rng, 0.0, 0.02);
        for l in 0..l_n {
            w.normal(lay.layer(T::QkvW, l), rng, 0.0, 0.02);
            w.normal(lay.layer(T::AttProjW, l), rng, 0.0, 0.02 * residual_scale);
            w.normal(lay.layer(T::FcW, l), rng, 0.0, 0.02);
            w.normal(lay.layer(T::FcProjW, l), rng, 0.0, 0.02 * residual_scale);
        }
    }

    fn head(&self, _cfg: &ModelConfig) -> TensorId {
        T::Wte.into()
    }

    fn acts(&self, cfg: &ModelConfig) -> ActPlan {
        let (c, f) = (cfg.channels, cfg.hidden);
        let k = ActSpec::kept;
        let r = ActSpec::recomputed;
        let st = ActSpec::stat;
        let p = Width::Pos;
        ActPlan {
            fwd: vec![
                r("ln1", p(c), 2),
                st("ln1_mean", p(1)),
                st("ln1_rstd", p(1)),
                k("qkv", p(3 * c)),
                k("atty", p(c)),
                st("att_stats", Width::Heads(2)),
                k("residual2", p(c)),
                r("ln2", p(c), 2),
                st("ln2_mean", p(1)),
                st("ln2_rstd", p(1)),
                k("fch", p(f)),
                r("fch_gelu", p(f), 1),
                ActSpec::shared("scratch", p(c)),
            ],
            back: vec![ActSpec::shared("dfch", p(f.max(3 * c))), ActSpec::shared("dqkv", p(3 * c))],
            recompute: 0,
        }
    }

    fn embed(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, out: Buf, ids: Buf, s: Seq, pos: usize) {
        let c = cfg.channels;
        let wpe = w[T::Wpe].slice(pos * c..(pos + s.t) * c);
        ops.encoder_forward(out, ids, w[T::Wte], Some(wpe), s, c);
    }

    fn embed_backward(&self, ops: &mut Ops, cfg: &ModelConfig, dw: &View<Buf>, dout: Buf, ids: Buf, s: Seq) {
        let c = cfg.channels;
        ops.encoder_backward(dw[T::Wte], Some(dw[T::Wpe].slice(0..s.t * c)), dout, ids, s, c);
    }

    /// residual2 = res_in + attn_proj(attention(qkv(ln1(res_in)))),
    /// res_out = residual2 + fc_proj(gelu(fc(ln2(residual2)))).
    fn block_forward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        _: &Consts,
        w: &View<Buf>,
        x: &BlockActs,
        n: usize,
        attn: Attn,
    ) {
        let (c, f, h) = (cfg.channels, cfg.hidden, heads(cfg));
        let a = &x.a;
        ops.layernorm_forward(a[A::Ln1], a[A::Ln1Mean], a[A::Ln1Rstd], x.res_in, w[T::Ln1W], w[T::Ln1B], Rows { n, c });
        ops.matmul_forward(a[A::Qkv], a[A::Ln1], w[T::QkvW], Some(w[T::QkvB]), Mat { n, c, oc: 3 * c });
        match attn {
            Attn::Causal(s) => ops.attention_forward(a[A::Atty], a[A::AttStats], a[A::Scratch], a[A::Qkv], s, h),
            Attn::Cached { k, v, pos, cap, .. } => {
                ops.attention_forward_cached(a[A::Atty], a[A::Scratch], a[A::Qkv], k, v, pos, n, cap, h)
            }
        }
        // Attention has filled the cache for all n positions; only the outputs read go on.
        let (x, n) = (&x.last_rows(&self.acts(cfg), c, n, attn.keep(n)), attn.keep(n));
        let a = &x.a;
        ops.matmul_forward(a[A::Scratch], a[A::Atty], w[T::AttProjW], Some(w[T::AttProjB]), Mat { n, c, oc: c });
        ops.residual_forward(a[A::Residual2], x.res_in, a[A::Scratch]);
        let ln2 = Rows { n, c };
        ops.layernorm_forward(a[A::Ln2], a[A::Ln2Mean], a[A::Ln2Rstd], a[A::Residual2], w[T::Ln2W], w[T::Ln2B], ln2);
        ops.matmul_forward(a[A::Fch], a[A::Ln2], w[T::FcW], Some(w[T::FcB]), Mat { n, c, oc: f });
        ops.gelu_forward(a[A::FchGelu], a[A::Fch]);
        ops.matmul_forward(a[A::Scratch], a[A::FchGelu], w[T::FcProjW], Some(w[T::FcProjB]), Mat { n, c: f, oc: c });
        ops.residual_forward(x.res_out, a[A::Residual2], a[A::Scratch]);
    }

    /// Backward of [`Gpt2::block_forward`], in reverse. Under recompute (`x.recompute`) the
    /// GELU's output (1) and the norms' outputs (2) are recomputed from the kept activations
    /// just before they are read, by the forward's own calls, so every value is the same bits.
    /// (Attention's probabilities are never kept: its backward rebuilds them at every level.)
    fn block_backward(
        &self,
        ops: &mut Ops,
        cfg: &ModelConfig,
        _: &Consts,
        w: &View<Buf>,
        dw: &View<Buf>,
        x: &BlockActs,
        d: &BackActs,
        s: Seq,
        acc: bool,
    ) {
        let (c, f, h, n) = (cfg.channels, cfg.hidden, heads(cfg), s.n());
        let (a, dres, scratch) = (&x.a, d.dres, x.a[A::Scratch]);
        let dfch = d.d[D::DFch].prefix(n * f);
        // MLP branch.
        if x.recompute >= 1 {
            ops.gelu_forward(a[A::FchGelu], a[A::Fch]);
        }
        let proj = Mat { n, c: f, oc: c };
        ops.matmul_backward(
            Some(dfch),
            dw[T::FcProjW],
            Some(dw[T::FcProjB]),
            dres,
            a[A::FchGelu],
            w[T::FcProjW],
            proj,
            acc,
        );
        ops.gelu_backward(dfch, a[A::Fch]);
        let (mean, rstd) = (a[A::Ln2Mean], a[A::Ln2Rstd]);
        if x.recompute >= 2 {
            ops.layernorm_forward(a[A::Ln2], mean, rstd, a[A::Residual2], w[T::Ln2W], w[T::Ln2B], Rows { n, c });
        }
        ops.matmul_backward(
            Some(scratch),
            dw[T::FcW],
            Some(dw[T::FcB]),
            dfch,
            a[A::Ln2],
            w[T::FcW],
            Mat { n, c, oc: f },
            acc,
        );
        ops.layernorm_backward(
            dres,
            dw[T::Ln2W],
            dw[T::Ln2B],
            scratch,
            a[A::Residual2],
            w[T::Ln2W],
            mean,
            rstd,
            Rows { n, c },
        );
        // Attention branch; dfch is free again and serves as the attention workspace.
        let attn_proj = Mat { n, c, oc: c };
        ops.matmul_backward(
            Some(scratch),
            dw[T::AttProjW],
            Some(dw[T::AttProjB]),
            dres,
            a[A::Atty],
            w[T::AttProjW],
            attn_proj,
            acc,
        );
        let ws = d.d[D::DFch].prefix(n * 3 * c);
        ops.attention_backward(d.d[D::DQkv], ws, scratch, a[A::Qkv], a[A::AttStats], s, h);
        let (mean, rstd) = (a[A::Ln1Mean], a[A::Ln1Rstd]);
        if x.recompute >= 2 {
            ops.layernorm_forward(a[A::Ln1], mean, rstd, x.res_in, w[T::Ln1W], w[T::Ln1B], Rows { n, c });
        }
        let dln = d.input_grad.then_some(scratch);
        ops.matmul_backward(
            dln,
            dw[T::QkvW],
            Some(dw[T::QkvB]),
            d.d[D::DQkv],
            a[A::Ln1],
            w[T::QkvW],
            Mat { n, c, oc: 3 * c },
            acc,
        );
        if let Some(dln) = dln {
            ops.layernorm_backward(
                dres,
                dw[T::Ln1W],
                dw[T::Ln1B],
                dln,
                x.res_in,
                w[T::Ln1W],
                mean,
                rstd,
                Rows { n, c },
            );
        }
    }

    fn final_norm(&self, ops: &mut Ops, cfg: &ModelConfig, w: &View<Buf>, a: &NormActs, x: Buf, n: usize) {
        ops.layernorm_forward(a.out, a.mean, a.rstd, x, w[T::LnfW], w[T::LnfB], Rows { n, c: cfg.channels });
    }

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
    ) {
        let r = Rows { n, c: cfg.channels };
        ops.layernorm_backward(dx, dw[T::LnfW], dw[T::LnfB], dout, x, w[T::LnfW], a.mean, a.rstd, r);
    }

    // ---- Hugging Face (transformers' GPT2LMHeadModel) ---------------------------------------

    fn hf_names(&self) -> (&'static str, &'static str) {
        ("GPT2LMHeadModel", "gpt2")
    }

    /// A GPT-2 `config.json`, checked to be exactly the model llmrs computes.
    fn parse_hf_config(&self, v: &serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let c: HfConfig = serde_json::from_value(v.clone())
            .with_context(|| format!("{}: not a GPT-2 config.json", path.display()))?;
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
            padded_vocab_size: crate::core::config::pad_vocab(c.vocab_size),
            ..config(c.n_layer, c.n_head, c.n_embd)
        })
    }

    /// `config.json` as transformers writes it for a GPT2LMHeadModel of this shape.
    fn hf_config(&self, cfg: &ModelConfig, torch_dtype: &str) -> serde_json::Value {
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

    /// transformers' GPT2LMHeadModel tensors (names without the `transformer.` prefix, which
    /// some Hub checkpoints lack). Its linear layers are `Conv1D`, whose weight is (in, out):
    /// the transpose of llmrs's (out, in). The LM head is tied to wte and usually not stored.
    fn hf_tensors(&self, cfg: &ModelConfig, lay: &ParamLayout) -> Vec<HfTensor> {
        let wte = lay.range(T::Wte);
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
                range: lay.range(T::Wpe),
                shape: lay.spec(T::Wpe).shape.clone(),
                transposed: false,
            },
        ];
        let per_layer = [
            ("ln_1.weight", T::Ln1W),
            ("ln_1.bias", T::Ln1B),
            ("attn.c_attn.weight", T::QkvW),
            ("attn.c_attn.bias", T::QkvB),
            ("attn.c_proj.weight", T::AttProjW),
            ("attn.c_proj.bias", T::AttProjB),
            ("ln_2.weight", T::Ln2W),
            ("ln_2.bias", T::Ln2B),
            ("mlp.c_fc.weight", T::FcW),
            ("mlp.c_fc.bias", T::FcB),
            ("mlp.c_proj.weight", T::FcProjW),
            ("mlp.c_proj.bias", T::FcProjB),
        ];
        for l in 0..cfg.num_layers {
            for (suffix, t) in per_layer {
                let mut shape = lay.spec(t).shape.clone();
                let transposed = shape.len() == 2;
                shape.reverse();
                out.push(HfTensor { name: format!("h.{l}.{suffix}"), range: lay.layer(t, l), shape, transposed });
            }
        }
        for (name, t) in [("ln_f.weight", T::LnfW), ("ln_f.bias", T::LnfB)] {
            out.push(HfTensor {
                name: name.into(),
                range: lay.range(t),
                shape: lay.spec(t).shape.clone(),
                transposed: false,
            });
        }
        out
    }

    fn hf_prefix(&self) -> &'static str {
        "transformer."
    }

    /// GPT-2's buffers (the causal mask) and a stored copy of the tied head.
    fn hf_ignored(&self, name: &str) -> bool {
        name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") || name == "lm_head.weight"
    }

    // ---- llm.c's model file -----------------------------------------------------------------

    fn llmc_magic(&self) -> Option<i32> {
        Some(MODEL_MAGIC)
    }

    /// llm.c's model-file header: magic, version (3 fp32, 5 bf16), maxT, V, L, NH, C, Vp.
    fn llmc_header(&self, cfg: &ModelConfig, dtype: Dtype) -> Result<Vec<u8>> {
        let mut h = [0i32; HEADER_INTS];
        h[0] = MODEL_MAGIC;
        h[1] = dtype.version();
        h[2] = cfg.max_seq_len as i32;
        h[3] = cfg.vocab_size as i32;
        h[4] = cfg.num_layers as i32;
        h[5] = cfg.num_heads as i32;
        h[6] = cfg.channels as i32;
        h[7] = cfg.padded_vocab_size as i32;
        Ok(h.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn llmc_write<'a>(&self, w: &'a Weights, dtype: Dtype) -> Result<(Vec<u8>, std::borrow::Cow<'a, [f32]>)> {
        Ok((self.llmc_header(&w.config, dtype)?, std::borrow::Cow::Borrowed(&w.data)))
    }

    fn llmc_config(&self, bytes: &[u8], path: &Path) -> Result<(ModelConfig, Dtype)> {
        let h = parse_header(bytes, path, "model")?;
        let dtype = match h[1] {
            3 => Dtype::F32,
            5 => Dtype::BF16,
            v => bail!(
                "{}: model file version {v} is not supported (3 = fp32, 5 = bf16); re-export it with llm.c's \
                 train_gpt2.py or llmrs",
                path.display()
            ),
        };
        let dim = |i: usize, name: &str| -> Result<usize> {
            usize::try_from(h[i])
                .ok()
                .filter(|&x| x > 0)
                .with_context(|| format!("{}: header field {name} = {} is invalid", path.display(), h[i]))
        };
        let (l, nh, c) = (dim(4, "num_layers")?, dim(5, "num_heads")?, dim(6, "channels")?);
        let cfg = ModelConfig {
            max_seq_len: dim(2, "max_seq_len")?,
            vocab_size: dim(3, "vocab_size")?,
            padded_vocab_size: dim(7, "padded_vocab_size")?,
            ..config(l, nh, c)
        };
        super::validate(&cfg).with_context(|| format!("{}: bad model header", path.display()))?;
        Ok((cfg, dtype))
    }

    fn llmc_read(&self, f: &mut ModelFile) -> Result<Weights> {
        let (cfg, dtype) = self.llmc_config(&f.head, f.path)?;
        // Check the size before allocating anything the header asks for.
        let n = cfg.num_parameters();
        let want = HEADER_BYTES + n * dtype.bytes();
        if f.len != want as u64 {
            bail!(
                "{}: file is {} bytes but a {dtype} model of this shape needs {want}: the file is truncated or corrupt",
                f.path.display(),
                f.len,
            );
        }
        let mut w = Weights::zeros(cfg)?;
        f.values(HEADER_BYTES as u64, dtype, &mut w.data)?;
        Ok(w)
    }
}

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

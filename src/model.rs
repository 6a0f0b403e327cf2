//! GPT-2: the forward, backward and update passes as llm.c's list of layer calls, on whatever
//! backend was chosen at start-up. No autograd: every layer's backward is called by hand, in
//! reverse. The model knows buffers only as [`Buf`] handles; the rest of the crate reaches
//! parameters, gradients, optimizer state, losses and logits through the methods at the end
//! (host copies of named tensors, the step's loss, one position's logits).

use crate::acts::{Acts, BackActs, BlockActs, KvCache};
use crate::backend::comm::{Collectives, Reduce, SingleProcess};
use crate::backend::{self, AdamWParams, Backend, Buf, DType, Device, SkipAbove};
use crate::config::GPT2Config;
use crate::optim::OptimConfig;
use crate::params::{Block, ParamLayout, Tensor, Weights};
use anyhow::{bail, Context, Result};

/// Charge a layer call to its kind in `llmrs bench`'s profile.
macro_rules! t {
    ($be:expr, $kind:ident, $e:expr) => {{
        $be.profile_begin(crate::profile::Kind::$kind);
        $e;
        $be.profile_end();
    }};
}

/// Which of the model's flat buffers (all in the parameter layout) a host copy is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Params,
    Grads,
    /// AdamW's first moment.
    AdamM,
    /// AdamW's second moment.
    AdamV,
}

/// What one optimizer step reports (one host read per step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The step's mean loss over all its micro-batches (and ranks).
    pub loss: f32,
    /// The global gradient norm before clipping.
    pub grad_norm: f32,
    /// The update was skipped (a value not finite, or above the step's [`SkipAbove`]).
    pub skipped: bool,
}

/// Gradients and AdamW moments, each (num_parameters) in the parameter layout.
#[derive(Clone, Copy, Debug)]
struct TrainBufs {
    grads: Buf,
    m: Buf,
    v: Buf,
}

/// The last forward pass: its shape and what its buffers hold now.
#[derive(Clone, Copy, Debug, Default)]
struct Last {
    b: usize,
    t: usize,
    /// The logits buffer holds the forward's logits (backward turns them into their gradient).
    logits: bool,
    /// The pass had targets: the per-position losses are there.
    losses: bool,
    /// The pass had targets and backward has not run on it yet.
    backward_ready: bool,
}

pub struct GPT2 {
    pub config: GPT2Config,
    layout: ParamLayout,
    be: Box<dyn Backend>,
    comm: Box<dyn Collectives>,
    params: Buf, // (num_parameters)
    /// [loss accumulator, squared gradient norm].
    stats: Buf, // (2)
    train: Option<TrainBufs>,
    acts: Option<Acts>,
    last: Last,
    /// Set by [`GPT2::zero_grad`]: the next backward overwrites the GEMM-produced gradients.
    grads_overwrite: bool,
    /// The limits of the last update, for step_stats to tell whether it was skipped.
    skip: SkipAbove,
}

/// How a block's attention sees its positions.
#[derive(Clone, Copy)]
enum Attn {
    /// B whole sequences of T positions (training and evaluation).
    Causal { b: usize, t: usize },
    /// New positions of one sequence after `pos` cached ones; k and v (cap, C) hold the cache.
    Cached { k: Buf, v: Buf, pos: usize, cap: usize },
}

/// One transformer block over N positions: residual2 = res_in + attn_proj(attention(qkv(ln1(res_in)))),
/// residual3 = residual2 + fc_proj(gelu(fc(ln2(residual2)))). The training forward pass and the
/// KV-cached inference pass both run this.
fn block_forward(be: &mut dyn Backend, cfg: &GPT2Config, w: &Block<Buf>, x: &BlockActs, n: usize, attn: Attn) {
    let (c, nh) = (cfg.channels, cfg.num_heads);
    t!(be, LayerNorm, be.layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.res_in, w.ln1_w, w.ln1_b, n, c));
    t!(be, Matmul, be.matmul_forward(x.qkv, x.ln1, w.qkv_w, Some(w.qkv_b), n, c, 3 * c));
    match attn {
        Attn::Causal { b, t } => {
            t!(be, Attention, be.attention_forward(x.atty, x.att, x.scratch, x.qkv, b, t, c, nh))
        }
        Attn::Cached { k, v, pos, cap } => {
            t!(be, Attention, be.attention_forward_cached(x.atty, x.att, x.scratch, x.qkv, k, v, pos, n, c, nh, cap))
        }
    }
    t!(be, Matmul, be.matmul_forward(x.scratch, x.atty, w.attn_proj_w, Some(w.attn_proj_b), n, c, c));
    t!(be, Residual, be.residual_forward(x.residual2, x.res_in, x.scratch));
    t!(be, LayerNorm, be.layernorm_forward(x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w.ln2_w, w.ln2_b, n, c));
    t!(be, Matmul, be.matmul_forward(x.fch, x.ln2, w.fc_w, Some(w.fc_b), n, c, 4 * c));
    t!(be, Gelu, be.gelu_forward(x.fch_gelu, x.fch));
    t!(be, Matmul, be.matmul_forward(x.scratch, x.fch_gelu, w.fc_proj_w, Some(w.fc_proj_b), n, 4 * c, c));
    t!(be, Residual, be.residual_forward(x.residual3, x.residual2, x.scratch));
}

/// Backward of [`block_forward`] (training): d.dresidual holds d(residual3) on entry and
/// d(res_in) on return; parameter gradients go to `dw` (added to, or overwritten when not `acc`).
#[allow(clippy::too_many_arguments)]
fn block_backward(
    be: &mut dyn Backend,
    cfg: &GPT2Config,
    w: &Block<Buf>,
    dw: &Block<Buf>,
    x: &BlockActs,
    d: &BackActs,
    (b, t): (usize, usize),
    acc: bool,
) {
    let (c, nh, n) = (cfg.channels, cfg.num_heads, b * t);
    // MLP branch.
    t!(
        be,
        Matmul,
        be.matmul_backward(
            Some(d.dfch),
            dw.fc_proj_w,
            Some(dw.fc_proj_b),
            d.dresidual,
            x.fch_gelu,
            w.fc_proj_w,
            n,
            4 * c,
            c,
            acc
        )
    );
    t!(be, Gelu, be.gelu_backward(d.dfch, x.fch));
    t!(
        be,
        Matmul,
        be.matmul_backward(Some(x.scratch), dw.fc_w, Some(dw.fc_b), d.dfch, x.ln2, w.fc_w, n, c, 4 * c, acc)
    );
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
        be.attention_backward(d.dqkv, d.datt, d.dfch.prefix(n * 3 * c), x.scratch, x.qkv, x.att, b, t, c, nh)
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

impl GPT2 {
    /// The model with these weights on `device`, as a single process.
    pub fn new(weights: Weights, device: Device) -> Result<Self> {
        Self::with_collectives(weights, backend::open(device)?, Box::new(SingleProcess))
    }

    /// The model on a given backend, as one rank of `comm`.
    pub fn with_collectives(weights: Weights, mut be: Box<dyn Backend>, comm: Box<dyn Collectives>) -> Result<Self> {
        let Weights { config, layout, data } = weights;
        let params = be.alloc(layout.num_parameters, DType::F32)?;
        be.upload(params, &data);
        drop(data); // the host copy goes before anything else is allocated
        let stats = be.alloc(2, DType::F32)?;
        be.fill(stats, 0.0);
        Ok(GPT2 {
            config,
            layout,
            be,
            comm,
            params,
            stats,
            train: None,
            acts: None,
            last: Last::default(),
            grads_overwrite: false,
            skip: SkipAbove::NON_FINITE,
        })
    }

    /// Forward pass over `inputs (b, t)`: logits (b, t, Vp), and with `targets (b, t)` the
    /// per-position losses (see [`GPT2::accumulate_loss`], [`GPT2::backward`]).
    pub fn forward(&mut self, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
        let cfg = self.config;
        let (c, v, vp, n) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, b * t);
        check_tokens(&cfg, inputs, targets, b, t)?;
        self.reserve(b, t)?;
        let (a, p, lay, be) = (self.acts.context("no activations")?, self.params, &self.layout, &mut *self.be);
        let pw = |x: Tensor| p.slice(lay.range(x));
        let (inp, tgt) = a.tokens(n);
        be.upload_u32(inp, inputs);
        t!(be, Encoder, be.encoder_forward(a.encoded.prefix(n * c), inp, pw(Tensor::Wte), pw(Tensor::Wpe), b, t, c));
        for l in 0..cfg.num_layers {
            let w = lay.block(l).map(|r| p.slice(r));
            block_forward(be, &cfg, &w, &a.layer(&cfg, l, b, t), n, Attn::Causal { b, t });
        }
        let (lnf, logits) = (a.lnf.prefix(n * c), a.logits.prefix(n * vp));
        let last = a.layer(&cfg, cfg.num_layers - 1, b, t).residual3;
        let (lnf_w, lnf_b) = (pw(Tensor::LnfW), pw(Tensor::LnfB));
        t!(
            be,
            LayerNorm,
            be.layernorm_forward(lnf, a.lnf_mean.prefix(n), a.lnf_rstd.prefix(n), last, lnf_w, lnf_b, n, c)
        );
        t!(be, Classifier, be.matmul_forward(logits, lnf, pw(Tensor::Wte), None, n, c, vp));
        if let Some(y) = targets {
            be.upload_u32(tgt, y);
            t!(be, Classifier, be.crossentropy_forward(a.losses.prefix(n), a.lse.prefix(n), logits, tgt, n, v, vp));
        }
        self.last = Last { b, t, logits: true, losses: targets.is_some(), backward_ready: targets.is_some() };
        Ok(())
    }

    /// Backward pass of the last forward (which must have had targets), for the objective
    /// `loss_scale * mean loss` (gradient accumulation over k micro-batches passes 1/k). Adds
    /// to the gradients (see [`GPT2::zero_grad`]) and that objective to the step's loss.
    /// Overwrites the logits with their gradient.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        let cfg = self.config;
        let (c, v, vp, nl) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, cfg.num_layers);
        let tr = self.train.context("backward needs training state: call alloc_training_state first")?;
        let Last { b, t, backward_ready: true, .. } = self.last else {
            bail!("backward needs a forward pass with targets (and runs once per pass)")
        };
        self.last = Last { logits: false, backward_ready: false, ..self.last };
        let acc = !std::mem::take(&mut self.grads_overwrite);
        let (a, p, g, lay, be) =
            (self.acts.context("no activations")?, self.params, tr.grads, &self.layout, &mut *self.be);
        let n = b * t;
        let (pw, gw) = (|x: Tensor| p.slice(lay.range(x)), |x: Tensor| g.slice(lay.range(x)));
        let (inp, tgt) = a.tokens(n);
        let (logits, lse, lnf, scratch) =
            (a.logits.prefix(n * vp), a.lse.prefix(n), a.lnf.prefix(n * c), a.scratch.prefix(n * c));
        let d = a.back(&cfg, b, t);
        be.accumulate_mean(self.stats.prefix(1), a.losses.prefix(n), loss_scale);
        t!(be, Classifier, be.crossentropy_backward(logits, lse, tgt, loss_scale / n as f32, n, v, vp));
        t!(
            be,
            Classifier,
            be.matmul_backward(Some(scratch), gw(Tensor::Wte), None, logits, lnf, pw(Tensor::Wte), n, c, vp, acc)
        );
        be.fill(d.dresidual, 0.0);
        let last = a.layer(&cfg, nl - 1, b, t).residual3;
        let (lnf_mean, lnf_rstd) = (a.lnf_mean.prefix(n), a.lnf_rstd.prefix(n));
        t!(
            be,
            LayerNorm,
            be.layernorm_backward(
                d.dresidual,
                gw(Tensor::LnfW),
                gw(Tensor::LnfB),
                scratch,
                last,
                pw(Tensor::LnfW),
                lnf_mean,
                lnf_rstd,
                n,
                c
            )
        );
        for l in (0..nl).rev() {
            let (w, dw) = (lay.block(l).map(|r| p.slice(r)), lay.block(l).map(|r| g.slice(r)));
            block_backward(be, &cfg, &w, &dw, &a.layer(&cfg, l, b, t), &d, (b, t), acc);
        }
        t!(be, Encoder, be.encoder_backward(gw(Tensor::Wte), gw(Tensor::Wpe), d.dresidual, inp, b, t, c));
        Ok(())
    }

    /// Start a step: the step's loss to 0, and a new gradient. Like PyTorch's
    /// `zero_grad(set_to_none=True)`, the tensors that the next backward writes whole
    /// ([`Tensor::written_whole_by_backward`]) are overwritten by it instead of being cleared
    /// now, which saves a pass over all gradients and the read of every weight gradient in the
    /// backward GEMMs; the rest are zeroed here.
    pub fn zero_grad(&mut self) -> Result<()> {
        let tr = self.train.context("zero_grad needs training state: call alloc_training_state first")?;
        for t in Tensor::ALL.into_iter().filter(|t| !t.written_whole_by_backward()) {
            self.be.fill(tr.grads.slice(self.layout.range(t)), 0.0);
        }
        self.be.fill(self.stats.prefix(1), 0.0);
        self.grads_overwrite = true;
        Ok(())
    }

    /// The optimizer step, queued without waiting on the host: average the gradients and the
    /// loss over the ranks, take the global gradient norm, then clip and apply AdamW to every
    /// tensor (weight decay on the 2-D weights). A step whose loss or norm is not finite, or
    /// above `skip`, leaves the model unchanged ([`Backend::adamw_update`]);
    /// [`GPT2::step_stats`] tells.
    pub fn update(&mut self, o: &OptimConfig, lr: f32, step: usize, skip: SkipAbove) -> Result<()> {
        let tr = self.train.context("update needs training state: call alloc_training_state first")?;
        self.skip = skip;
        let (be, stats) = (&mut *self.be, self.stats);
        self.comm.all_reduce(be, tr.grads, Reduce::Mean)?;
        self.comm.all_reduce(be, stats.prefix(1), Reduce::Mean)?;
        t!(be, Optimizer, be.global_norm_squared(stats.slice(1..2), tr.grads));
        for x in Tensor::ALL {
            let r = self.layout.range(x);
            let h = AdamWParams {
                lr,
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: if x.weight_decay() { o.weight_decay } else { 0.0 },
                grad_clip: o.grad_clip,
                t: step as i32 + 1,
                skip,
            };
            let (p, g, m, v) =
                (self.params.slice(r.clone()), tr.grads.slice(r.clone()), tr.m.slice(r.clone()), tr.v.slice(r));
            t!(be, Optimizer, be.adamw_update(p, g, m, v, stats, &h));
        }
        Ok(())
    }

    /// The last step's loss and gradient norm: the one host read of a training step.
    pub fn step_stats(&mut self) -> Result<StepStats> {
        let mut s = [0f32; 2];
        self.be.download(self.stats, &mut s)?;
        Ok(StepStats { loss: s[0], grad_norm: s[1].sqrt(), skipped: self.skip.skips(s[0], s[1]) })
    }

    // ---- set-up ---------------------------------------------------------------------------

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The backend in use, for logs.
    pub fn describe_backend(&self) -> String {
        self.be.describe()
    }

    /// This process's rank and the number of ranks.
    pub fn rank(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world())
    }

    /// Wait until every rank has got here.
    pub fn barrier(&mut self) -> Result<()> {
        self.comm.barrier()
    }

    /// Allocate gradients and AdamW moments (zeroed). Call once before training.
    pub fn alloc_training_state(&mut self) -> Result<()> {
        if self.train.is_none() {
            let n = self.num_parameters();
            let mut z = || -> Result<Buf> {
                let b = self.be.alloc(n, DType::F32)?;
                self.be.fill(b, 0.0);
                Ok(b)
            };
            self.train = Some(TrainBufs { grads: z()?, m: z()?, v: z()? });
            // Activations sized before training lack the backward buffers.
            if let Some(a) = self.acts.take() {
                a.free(&mut *self.be);
                self.reserve(a.cap_b, a.cap_t)?;
            }
        }
        Ok(())
    }

    /// Make sure activations can hold a pass over (b, t) (with the backward buffers once there
    /// is training state). Allocates only when they cannot.
    pub fn reserve(&mut self, b: usize, t: usize) -> Result<()> {
        let backward = self.train.is_some();
        if self.acts.is_some_and(|a| a.fits(b, t, backward)) {
            return Ok(());
        }
        let (cb, ct) = self.acts.map_or((b, t), |a| (a.cap_b.max(b), a.cap_t.max(t)));
        // A bound on every activation size Acts computes, so that none of them overflows.
        let cfg = &self.config;
        let wide = (4 * cfg.channels).max(cfg.padded_vocab_size);
        let per_position = ct.checked_mul(cfg.num_heads).and_then(|x| x.checked_add(wide));
        let per_position = per_position.and_then(|x| x.checked_mul(16 * (cfg.num_layers + 2)));
        if per_position.and_then(|p| cb.checked_mul(ct)?.checked_mul(p)).is_none() {
            bail!("B={cb} x T={ct} is far more than any machine can hold activations for; lower -b or -t");
        }
        if let Some(a) = self.acts.take() {
            a.free(&mut *self.be);
        }
        let acts = Acts::new(&mut *self.be, &self.config, cb, ct, backward);
        self.acts = Some(acts.with_context(|| format!("activations for B={cb} x T={ct}: lower -b or -t"))?);
        Ok(())
    }

    // ---- KV-cached inference --------------------------------------------------------------

    /// A KV cache for one sequence of up to `positions` tokens (at most maxT), fed at most
    /// `chunk` tokens per call. Release it with [`GPT2::free_kv_cache`] when done.
    pub fn kv_cache(&mut self, positions: usize, chunk: usize) -> Result<KvCache> {
        let max_t = self.config.max_seq_len;
        if positions == 0 || positions > max_t || chunk == 0 {
            bail!("a KV cache holds 1 to {max_t} positions (asked: {positions}, chunks of {chunk})");
        }
        KvCache::new(&mut *self.be, &self.config, positions, chunk.min(positions))
    }

    pub fn free_kv_cache(&mut self, cache: KvCache) {
        self.be.free(cache.whole);
        self.be.free(cache.tokens);
    }

    /// Feed `tokens` after the cached positions (in chunks); returns the first V logits of the
    /// last one, read to the host once.
    pub fn forward_cached<'a>(&mut self, cache: &'a mut KvCache, tokens: &[u32]) -> Result<&'a [f32]> {
        let cfg = self.config;
        let (c, vp) = (cfg.channels, cfg.padded_vocab_size);
        if tokens.is_empty() {
            bail!("nothing to feed");
        }
        if cache.pos + tokens.len() > cache.capacity {
            bail!(
                "the sequence would exceed the KV cache's {} positions (the model's context is {})",
                cache.capacity,
                cfg.max_seq_len
            );
        }
        check_tokens(&cfg, tokens, None, 1, tokens.len())?;
        let (p, lay, be) = (self.params, &self.layout, &mut *self.be);
        let pw = |x: Tensor| p.slice(lay.range(x));
        let mut tn = 0;
        for chunk in tokens.chunks(cache.chunk) {
            let pos = cache.pos;
            tn = chunk.len();
            let ids = cache.tokens.prefix(tn);
            be.upload_u32(ids, chunk);
            let wpe = pw(Tensor::Wpe).slice(pos * c..(pos + tn) * c); // positions pos..pos+tn
            t!(be, Encoder, be.encoder_forward(cache.x.res_in.prefix(tn * c), ids, pw(Tensor::Wte), wpe, 1, tn, c));
            for l in 0..cfg.num_layers {
                let w = lay.block(l).map(|r| p.slice(r));
                let (x, k, v) = cache.layer(&cfg, l, tn);
                block_forward(be, &cfg, &w, &x, tn, Attn::Cached { k, v, pos, cap: cache.capacity });
            }
            cache.pos += tn;
        }
        // Only the last position's logits are needed.
        let last = cache.x.residual3.slice((tn - 1) * c..tn * c);
        let (lnf_w, lnf_b) = (pw(Tensor::LnfW), pw(Tensor::LnfB));
        t!(be, LayerNorm, be.layernorm_forward(cache.lnf, cache.lnf_mean, cache.lnf_rstd, last, lnf_w, lnf_b, 1, c));
        t!(be, Classifier, be.matmul_forward(cache.logits, cache.lnf, pw(Tensor::Wte), None, 1, c, vp));
        be.download(cache.logits.prefix(cfg.vocab_size), &mut cache.host_logits)?;
        Ok(&cache.host_logits)
    }

    // ---- host copies ------------------------------------------------------------------------

    fn slot(&self, slot: Slot) -> Result<Buf> {
        Ok(match slot {
            Slot::Params => self.params,
            _ => {
                let tr = self.train.with_context(|| format!("{slot:?} need training state"))?;
                match slot {
                    Slot::Grads => tr.grads,
                    Slot::AdamM => tr.m,
                    _ => tr.v,
                }
            }
        })
    }

    /// A host copy of one tensor of a slot (llm.c order, all layers).
    pub fn read_tensor(&mut self, slot: Slot, t: Tensor) -> Result<Vec<f32>> {
        let b = self.slot(slot)?.slice(self.layout.range(t));
        let mut out = vec![0f32; b.len];
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// A host copy of a whole slot (num_parameters, llm.c order).
    pub fn read_all(&mut self, slot: Slot) -> Result<Vec<f32>> {
        let b = self.slot(slot)?;
        let mut out = crate::mem::zeroed(b.len);
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// Overwrite a whole slot from the host (num_parameters, llm.c order).
    pub fn write_all(&mut self, slot: Slot, data: &[f32]) -> Result<()> {
        let b = self.slot(slot)?;
        if data.len() != b.len {
            bail!("{} values for {slot:?}, the model has {}", data.len(), b.len);
        }
        self.be.upload(b, data);
        Ok(())
    }

    /// The parameters as host [`Weights`] (for model files and export).
    pub fn weights(&mut self) -> Result<Weights> {
        Ok(Weights { config: self.config, layout: self.layout.clone(), data: self.read_all(Slot::Params)? })
    }

    /// The first V logits of position `row` (0..b*t) of the last forward pass.
    pub fn logits_at(&mut self, row: usize) -> Result<Vec<f32>> {
        let (v, vp) = (self.config.vocab_size, self.config.padded_vocab_size);
        let Last { b, t, logits: true, .. } = self.last else { bail!("no logits: run a forward pass first") };
        if row >= b * t {
            bail!("position {row} is outside the last pass's {} positions", b * t);
        }
        let a = self.acts.context("no activations")?;
        let mut out = vec![0f32; v];
        self.be.download(a.logits.slice(row * vp..row * vp + v), &mut out)?;
        Ok(out)
    }

    /// The per-position losses (b*t) of the last forward pass with targets.
    pub fn losses(&mut self) -> Result<Vec<f32>> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no losses: run a forward pass with targets first")
        };
        let a = self.acts.context("no activations")?;
        let mut out = vec![0f32; b * t];
        self.be.download(a.losses.prefix(b * t), &mut out)?;
        Ok(out)
    }

    /// Add `weight * mean loss` of the last forward pass (with targets) to the loss accumulator.
    pub fn accumulate_loss(&mut self, weight: f32) -> Result<()> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no loss: run a forward pass with targets first")
        };
        let a = self.acts.context("no activations")?;
        self.be.accumulate_mean(self.stats.prefix(1), a.losses.prefix(b * t), weight);
        Ok(())
    }

    /// Read the loss accumulator and set it back to 0 (one host read).
    pub fn take_loss(&mut self) -> Result<f32> {
        let mut s = [0f32];
        self.be.download(self.stats.prefix(1), &mut s)?;
        self.be.fill(self.stats.prefix(1), 0.0);
        Ok(s[0])
    }

    /// [`GPT2::take_loss`] of the accumulator averaged over the ranks (validation, where each
    /// rank evaluates its part of every batch).
    pub fn take_mean_loss(&mut self) -> Result<f32> {
        self.comm.all_reduce(&mut *self.be, self.stats.prefix(1), Reduce::Mean)?;
        self.take_loss()
    }

    /// The mean loss of one batch: forward, then read it (evaluation and tests).
    pub fn loss(&mut self, inputs: &[u32], targets: &[u32], b: usize, t: usize) -> Result<f32> {
        self.take_loss()?;
        self.forward(inputs, Some(targets), b, t)?;
        self.accumulate_loss(1.0)?;
        self.take_loss()
    }

    // ---- profiling --------------------------------------------------------------------------

    pub fn set_profiling(&mut self, on: bool) {
        self.be.set_profiling(on);
    }

    pub fn profile_totals(&mut self) -> Result<Vec<(crate::profile::Kind, f64)>> {
        self.be.profile_totals()
    }

    /// Wait for all queued work (for timing).
    pub fn synchronize(&mut self) -> Result<()> {
        self.be.synchronize()
    }
}

/// Shapes and token ids of a batch, checked on the host before anything reaches the device.
fn check_tokens(cfg: &GPT2Config, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
    let (v, n) = (cfg.vocab_size, b * t);
    if b == 0 || t == 0 || t > cfg.max_seq_len {
        bail!("sequence length {t} must be between 1 and the model's max_seq_len {} (and B > 0)", cfg.max_seq_len);
    }
    if inputs.len() != n || targets.is_some_and(|y| y.len() != n) {
        bail!("batch holds {} inputs, expected B*T = {n}", inputs.len());
    }
    if let Some(&bad) = inputs.iter().chain(targets.unwrap_or(&[])).find(|&&x| x as usize >= v) {
        bail!("token id {bad} is out of range for vocab size {v}: the data was tokenized for another vocabulary");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(desc: &str, seed: u32) -> GPT2 {
        GPT2::new(Weights::random(GPT2Config::from_descriptor(desc).unwrap(), seed).unwrap(), Device::Cpu).unwrap()
    }

    /// zero_grad leaves stale values in the tensors the next backward overwrites; the gradients
    /// must come out bit-identical to clearing everything and accumulating.
    #[test]
    fn zero_grad_then_backward_equals_clearing_everything() {
        let (b, t) = (2, 5);
        let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 50257) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 50257 + 1) as u32).collect();
        let mut grads = vec![];
        for stale in [false, true] {
            let mut m = model("2x32:2:16", 3);
            m.alloc_training_state().unwrap();
            if stale {
                let junk: Vec<f32> = (0..m.num_parameters()).map(|i| (i % 7) as f32 - 3.0).collect();
                m.write_all(Slot::Grads, &junk).unwrap();
                m.zero_grad().unwrap();
            }
            for _ in 0..2 {
                m.forward(&inputs, Some(&targets), b, t).unwrap();
                m.backward(0.5).unwrap();
            }
            grads.push(m.read_all(Slot::Grads).unwrap());
        }
        assert!(grads[0] == grads[1], "gradients differ after zero_grad over stale values");
    }

    #[test]
    fn cached_logits_match_the_full_forward_pass() {
        let cfg = GPT2Config {
            vocab_size: 101,
            padded_vocab_size: 128,
            ..GPT2Config::from_descriptor("2x24:3:600").unwrap()
        };
        let mut m = GPT2::new(Weights::random(cfg, 11).unwrap(), Device::Cpu).unwrap();
        // 540 tokens: 530 in chunks of 256 (two whole and one partial), then single tokens.
        let toks: Vec<u32> = (0..540).map(|i| (i * 37 % 101) as u32).collect();
        let mut cache = m.kv_cache(540, 256).unwrap();
        let mut cached = vec![m.forward_cached(&mut cache, &toks[..530]).unwrap().to_vec()];
        for &t in &toks[530..] {
            cached.push(m.forward_cached(&mut cache, &[t]).unwrap().to_vec());
        }
        m.forward(&toks, None, 1, toks.len()).unwrap();
        for (j, pos) in (529..540).enumerate() {
            let full = m.logits_at(pos).unwrap();
            for (a, b) in cached[j].iter().zip(&full) {
                assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "pos {pos}: {a} vs {b}");
            }
        }
        assert!(m.forward_cached(&mut cache, &[1]).is_err(), "past the cache's capacity");
        assert!(m.kv_cache(601, 1).is_err(), "past the model's context");
        m.free_kv_cache(cache);
    }

    #[test]
    fn a_diverged_step_leaves_the_model_unchanged() {
        let mut m = model("1x16:2:8", 1);
        m.alloc_training_state().unwrap();
        let (x, y) = ([1u32, 2, 3, 4], [2u32, 3, 4, 5]);
        let before = m.read_all(Slot::Params).unwrap();
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(f32::NAN).unwrap(); // a NaN objective: NaN loss and gradients
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove::NON_FINITE).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss.is_nan() && s.skipped);
        assert!(m.read_all(Slot::Params).unwrap() == before, "parameters moved on a NaN step");
        // An outlier: finite, but above the step's limit (llm.c's -sl).
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(1.0).unwrap();
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove { loss: 0.5, norm_sq: f32::INFINITY }).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss > 0.5 && s.skipped, "{s:?}");
        assert!(m.read_all(Slot::Params).unwrap() == before, "parameters moved on a skipped step");
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(1.0).unwrap();
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove::NON_FINITE).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss.is_finite() && s.grad_norm > 0.0 && !s.skipped);
        assert!(m.read_all(Slot::Params).unwrap() != before, "a good step moves the parameters");
    }

    #[test]
    fn misuse_gives_errors_not_panics() {
        let mut m = model("1x16:2:8", 1);
        assert!(m.backward(1.0).is_err(), "backward before training state");
        assert!(m.logits_at(0).is_err(), "logits before a forward pass");
        m.alloc_training_state().unwrap();
        m.forward(&[1, 2], None, 1, 2).unwrap();
        assert!(m.backward(1.0).is_err(), "backward without targets");
        assert!(m.logits_at(2).is_err() && m.logits_at(1).is_ok());
        assert!(m.forward(&[1, 2, 3], None, 1, 2).is_err(), "wrong length");
        assert!(m.forward(&[1, 60000], None, 1, 2).is_err(), "token out of range");
        assert!(m.forward(&[1; 9], None, 1, 9).is_err(), "past maxT");
        assert!(m.write_all(Slot::AdamM, &[0.0; 3]).is_err(), "wrong size");
    }
}

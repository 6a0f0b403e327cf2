//! GPT-2: parameters, activations, and the forward / backward / update passes as a list of
//! layer calls. No autograd: every layer's backward is called by hand, in reverse.

use crate::config::GPT2Config;
use crate::cpu::adamw::{adamw_update, global_norm, global_norm_partials, AdamW};
use crate::cpu::attention::{attention_backward, attention_forward};
use crate::cpu::classifier::{crossentropy_forward, crossentropy_softmax_backward_inplace};
use crate::cpu::encoder::{encoder_backward, encoder_forward};
use crate::cpu::gelu::{gelu_backward_inplace, gelu_forward};
use crate::cpu::layernorm::{layernorm_backward, layernorm_forward};
use crate::cpu::matmul::{matmul_backward, matmul_forward};
use crate::cpu::residual::residual_forward;
use crate::params::{ParamLayout, Span};
use crate::rng::Mt19937;
use anyhow::{bail, Result};

/// Charge a layer call's time to its kind (only when `llmrs bench` turns profiling on).
macro_rules! t {
    ($kind:ident, $e:expr) => {
        crate::profile::timed(crate::profile::Kind::$kind, || $e)
    };
}

/// The model: shape, parameter layout, and flat buffers that share that layout.
pub struct GPT2 {
    pub config: GPT2Config,
    pub layout: ParamLayout,
    pub params: Vec<f32>, // (num_parameters)
    /// Training state, allocated by [`GPT2::alloc_training_state`]; empty for inference.
    pub grads: Vec<f32>, // (num_parameters)
    pub m: Vec<f32>,      // (num_parameters) AdamW first moment
    pub v: Vec<f32>,      // (num_parameters) AdamW second moment
    norm_partials: Vec<f64>,
    /// Set by [`GPT2::zero_grad`]: the next backward overwrites the GEMM-produced gradients.
    grads_overwrite: bool,
    pub acts: Activations,
}

/// Which of the 16 tensors (llm.c order) a backward pass writes whole through a matmul: the LM
/// head's dW covers all of wte (the encoder's scatter-add comes after it), and every block's
/// qkv, attn_proj, fc and fc_proj weights and biases.
const WRITTEN_WHOLE_BY_BACKWARD: [bool; 16] =
    [true, false, false, false, true, true, true, true, false, false, true, true, true, true, false, false];

/// Everything the forward pass keeps for backward, plus one layer's worth of backward scratch.
/// Sized for a capacity (B, T); a pass over a smaller (b, t) uses a prefix of each buffer.
#[derive(Default)]
pub struct Activations {
    pub cap_b: usize,
    pub cap_t: usize,
    /// Shape of the last forward pass, and whether it had targets.
    pub b: usize,
    pub t: usize,
    pub has_targets: bool,
    pub inputs: Vec<u32>,    // (B, T)
    pub targets: Vec<u32>,   // (B, T)
    pub encoded: Vec<f32>,   // (B, T, C)
    pub ln1: Vec<f32>,       // (L, B, T, C)
    pub ln1_mean: Vec<f32>,  // (L, B, T)
    pub ln1_rstd: Vec<f32>,  // (L, B, T)
    pub qkv: Vec<f32>,       // (L, B, T, 3*C)
    pub atty: Vec<f32>,      // (L, B, T, C)
    pub att: Vec<f32>,       // (L, B, NH, T, T)
    pub residual2: Vec<f32>, // (L, B, T, C)
    pub ln2: Vec<f32>,       // (L, B, T, C)
    pub ln2_mean: Vec<f32>,  // (L, B, T)
    pub ln2_rstd: Vec<f32>,  // (L, B, T)
    pub fch: Vec<f32>,       // (L, B, T, 4*C)
    pub fch_gelu: Vec<f32>,  // (L, B, T, 4*C)
    pub residual3: Vec<f32>, // (L, B, T, C)
    pub lnf: Vec<f32>,       // (B, T, C)
    pub lnf_mean: Vec<f32>,  // (B, T)
    pub lnf_rstd: Vec<f32>,  // (B, T)
    pub logits: Vec<f32>,    // (B, T, Vp); after backward it holds d(loss)/d(logits)
    pub losses: Vec<f32>,    // (B, T)
    pub lse: Vec<f32>,       // (B, T) log-sum-exp of each row of logits
    pub scratch: Vec<f32>,   // (B, T, C) projection outputs; d(ln) and d(atty) in backward
    pub dresidual: Vec<f32>, // (B, T, C) gradient of the residual stream
    pub dfch: Vec<f32>,      // (B, T, 4*C)
    pub dqkv: Vec<f32>,      // (B, T, 3*C)
    pub datt: Vec<f32>,      // (B, NH, T, T)
}

impl Activations {
    fn new(cfg: &GPT2Config, b: usize, t: usize) -> Self {
        let (c, l, nh, vp) = (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size);
        let n = b * t;
        let z = |len: usize| crate::mem::zeroed::<f32>(len);
        Activations {
            cap_b: b,
            cap_t: t,
            b: 0,
            t: 0,
            has_targets: false,
            inputs: vec![0; n],
            targets: vec![0; n],
            encoded: z(n * c),
            ln1: z(l * n * c),
            ln1_mean: z(l * n),
            ln1_rstd: z(l * n),
            qkv: z(l * n * 3 * c),
            atty: z(l * n * c),
            att: z(l * b * nh * t * t),
            residual2: z(l * n * c),
            ln2: z(l * n * c),
            ln2_mean: z(l * n),
            ln2_rstd: z(l * n),
            fch: z(l * n * 4 * c),
            fch_gelu: z(l * n * 4 * c),
            residual3: z(l * n * c),
            lnf: z(n * c),
            lnf_mean: z(n),
            lnf_rstd: z(n),
            logits: z(n * vp),
            losses: z(n),
            lse: z(n),
            scratch: z(n * c),
            dresidual: z(n * c),
            dfch: z(n * 4 * c),
            dqkv: z(n * 3 * c),
            datt: z(b * nh * t * t),
        }
    }

    /// Views of layer `l`'s activations for a pass over (b, t), plus the shared scratch.
    fn layer(&mut self, l: usize, b: usize, t: usize, cfg: &GPT2Config) -> LayerActs<'_> {
        let (c, nh) = (cfg.channels, cfg.num_heads);
        let n = b * t;
        fn at(v: &mut [f32], l: usize, sz: usize) -> &mut [f32] {
            &mut v[l * sz..(l + 1) * sz]
        }
        let (prev, cur) = self.residual3.split_at_mut(l * n * c);
        let res_in: &[f32] = if l == 0 { &self.encoded[..n * c] } else { &prev[(l - 1) * n * c..] };
        LayerActs {
            res_in,
            ln1: at(&mut self.ln1, l, n * c),
            ln1_mean: at(&mut self.ln1_mean, l, n),
            ln1_rstd: at(&mut self.ln1_rstd, l, n),
            qkv: at(&mut self.qkv, l, n * 3 * c),
            atty: at(&mut self.atty, l, n * c),
            att: at(&mut self.att, l, b * nh * t * t),
            residual2: at(&mut self.residual2, l, n * c),
            ln2: at(&mut self.ln2, l, n * c),
            ln2_mean: at(&mut self.ln2_mean, l, n),
            ln2_rstd: at(&mut self.ln2_rstd, l, n),
            fch: at(&mut self.fch, l, n * 4 * c),
            fch_gelu: at(&mut self.fch_gelu, l, n * 4 * c),
            residual3: &mut cur[..n * c],
            scratch: &mut self.scratch[..n * c],
            dresidual: &mut self.dresidual[..n * c],
            dfch: &mut self.dfch[..n * 4 * c],
            dqkv: &mut self.dqkv[..n * 3 * c],
            datt: &mut self.datt[..b * nh * t * t],
        }
    }
}

/// One block's activations (shapes as in [`Activations`] without the L dimension).
struct LayerActs<'a> {
    res_in: &'a [f32],
    ln1: &'a mut [f32],
    ln1_mean: &'a mut [f32],
    ln1_rstd: &'a mut [f32],
    qkv: &'a mut [f32],
    atty: &'a mut [f32],
    att: &'a mut [f32],
    residual2: &'a mut [f32],
    ln2: &'a mut [f32],
    ln2_mean: &'a mut [f32],
    ln2_rstd: &'a mut [f32],
    fch: &'a mut [f32],
    fch_gelu: &'a mut [f32],
    residual3: &'a mut [f32],
    scratch: &'a mut [f32],
    dresidual: &'a mut [f32],
    dfch: &'a mut [f32],
    dqkv: &'a mut [f32],
    datt: &'a mut [f32],
}

/// Two disjoint tensors of one flat buffer, both mutable (e.g. a weight's and a bias's gradient).
fn pair<'a>(buf: &'a mut [f32], a: &Span, b: &Span) -> (&'a mut [f32], &'a mut [f32]) {
    assert!(a.0.end <= b.0.start, "spans must be in buffer order and disjoint");
    let (lo, hi) = buf.split_at_mut(b.0.start);
    (&mut lo[a.0.clone()], &mut hi[..b.len()])
}

impl GPT2 {
    /// A model with all parameters zero (to be filled from a file or by [`GPT2::random`]).
    pub fn zeros(config: GPT2Config) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        let params = crate::mem::zeroed::<f32>(layout.num_parameters);
        Ok(GPT2 {
            config,
            layout,
            params,
            grads: vec![],
            m: vec![],
            v: vec![],
            norm_partials: vec![],
            grads_overwrite: false,
            acts: Activations::default(),
        })
    }

    /// llm.c's random init (train_gpt2.cu `gpt_build_from_descriptor`): N(0, 0.02) weights,
    /// residual projections N(0, 0.02/sqrt(2L)), zero biases, unit LayerNorm weights, drawn from
    /// the PyTorch-compatible Mersenne Twister in PyTorch's module order.
    pub fn random(config: GPT2Config, seed: u32) -> Result<Self> {
        let mut model = Self::zeros(config)?;
        let (l_n, c, v) = (config.num_layers, config.channels, config.vocab_size);
        let mut rng = Mt19937::new(seed);
        let residual_scale = 1.0 / (2.0 * l_n as f32).sqrt();
        let lay = &model.layout;
        let p = &mut model.params;
        for i in [2, 8, 14] {
            lay.tensors[i].of_mut(p).fill(1.0);
        }
        rng.normal(&mut lay.wte.of_mut(p)[..v * c], 0.0, 0.02); // only the V real rows
        rng.normal(lay.wpe.of_mut(p), 0.0, 0.02);
        for blk in &lay.blocks {
            rng.normal(blk.qkv_w.of_mut(p), 0.0, 0.02);
            rng.normal(blk.attn_proj_w.of_mut(p), 0.0, 0.02 * residual_scale);
            rng.normal(blk.fc_w.of_mut(p), 0.0, 0.02);
            rng.normal(blk.fc_proj_w.of_mut(p), 0.0, 0.02 * residual_scale);
        }
        Ok(model)
    }

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
    }

    /// Allocate gradients and AdamW moments (zeroed). Call once before training.
    pub fn alloc_training_state(&mut self) {
        let n = self.num_parameters();
        if self.grads.len() != n {
            self.grads = crate::mem::zeroed(n);
            self.m = crate::mem::zeroed(n);
            self.v = crate::mem::zeroed(n);
            self.norm_partials = vec![0f64; global_norm_partials(n)];
        }
    }

    /// Make sure activations can hold a pass over (b, t). Allocates only when they cannot.
    pub fn reserve(&mut self, b: usize, t: usize) {
        let a = &self.acts;
        if a.cap_b * a.cap_t < b * t || a.cap_b < b || a.cap_t < t {
            self.acts = Activations::new(&self.config, b.max(a.cap_b), t.max(a.cap_t));
        }
    }

    /// Forward pass over `inputs (b, t)`. Leaves logits (b, t, Vp) in `acts.logits`; with
    /// `targets (b, t)` also the per-position losses, and returns their mean.
    pub fn forward(&mut self, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<Option<f32>> {
        let cfg = self.config;
        let (c, nh, v, vp) = (cfg.channels, cfg.num_heads, cfg.vocab_size, cfg.padded_vocab_size);
        let n = b * t;
        if b == 0 || t == 0 || t > cfg.max_seq_len {
            bail!("sequence length {t} must be between 1 and the model's max_seq_len {}", cfg.max_seq_len);
        }
        if inputs.len() != n || targets.is_some_and(|y| y.len() != n) {
            bail!("batch holds {} inputs, expected B*T = {n}", inputs.len());
        }
        if let Some(&bad) = inputs.iter().chain(targets.unwrap_or(&[])).find(|&&x| x as usize >= v) {
            bail!("token id {bad} is out of range for vocab size {v}: the data was tokenized for another vocabulary");
        }
        self.reserve(b, t);
        let p = &self.params;
        let lay = &self.layout;
        let a = &mut self.acts;
        (a.b, a.t, a.has_targets) = (b, t, targets.is_some());
        a.inputs[..n].copy_from_slice(inputs);
        t!(Encoder, encoder_forward(&mut a.encoded, inputs, lay.wte.of(p), lay.wpe.of(p), b, t, c));
        for (l, w) in lay.blocks.iter().enumerate() {
            let x = a.layer(l, b, t, &cfg);
            t!(
                LayerNorm,
                layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.res_in, w.ln1_w.of(p), w.ln1_b.of(p), n, c)
            );
            t!(Matmul, matmul_forward(x.qkv, x.ln1, w.qkv_w.of(p), Some(w.qkv_b.of(p)), n, c, 3 * c));
            t!(Attention, attention_forward(x.atty, x.att, x.scratch, x.qkv, b, t, c, nh));
            t!(Matmul, matmul_forward(x.scratch, x.atty, w.attn_proj_w.of(p), Some(w.attn_proj_b.of(p)), n, c, c));
            t!(Residual, residual_forward(x.residual2, x.res_in, x.scratch));
            t!(
                LayerNorm,
                layernorm_forward(x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w.ln2_w.of(p), w.ln2_b.of(p), n, c)
            );
            t!(Matmul, matmul_forward(x.fch, x.ln2, w.fc_w.of(p), Some(w.fc_b.of(p)), n, c, 4 * c));
            t!(Gelu, gelu_forward(x.fch_gelu, x.fch));
            t!(Matmul, matmul_forward(x.scratch, x.fch_gelu, w.fc_proj_w.of(p), Some(w.fc_proj_b.of(p)), n, 4 * c, c));
            t!(Residual, residual_forward(x.residual3, x.residual2, x.scratch));
        }
        let last = &a.residual3[(cfg.num_layers - 1) * n * c..][..n * c];
        t!(
            LayerNorm,
            layernorm_forward(
                &mut a.lnf,
                &mut a.lnf_mean,
                &mut a.lnf_rstd,
                last,
                lay.lnf_w.of(p),
                lay.lnf_b.of(p),
                n,
                c
            )
        );
        t!(Classifier, matmul_forward(&mut a.logits, &a.lnf, lay.wte.of(p), None, n, c, vp));
        let Some(targets) = targets else {
            return Ok(None);
        };
        a.targets[..n].copy_from_slice(targets);
        t!(Classifier, crossentropy_forward(&mut a.losses, &mut a.lse, &a.logits, targets, n, v, vp));
        Ok(Some(a.losses[..n].iter().sum::<f32>() / n as f32))
    }

    /// Backward pass of the last forward (which must have had targets), accumulating (+=) into
    /// `grads`. The objective is `loss_scale * mean loss`; gradient accumulation over k
    /// micro-batches passes `1/k`. Overwrites the logits with their gradient.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        let cfg = self.config;
        let (c, nh, v, vp) = (cfg.channels, cfg.num_heads, cfg.vocab_size, cfg.padded_vocab_size);
        if self.grads.len() != self.num_parameters() {
            bail!("backward needs training state: call alloc_training_state first");
        }
        let a = &mut self.acts;
        if !a.has_targets {
            bail!("backward needs a forward pass with targets");
        }
        a.has_targets = false; // the logits are about to be overwritten
        let (b, t) = (a.b, a.t);
        let n = b * t;
        // After zero_grad the GEMM-produced gradients are overwritten, not added to.
        let acc = !std::mem::take(&mut self.grads_overwrite);
        let (p, g, lay) = (&self.params, &mut self.grads, &self.layout);
        t!(
            Classifier,
            crossentropy_softmax_backward_inplace(&mut a.logits, &a.lse, &a.targets, loss_scale / n as f32, n, v, vp)
        );
        t!(
            Classifier,
            matmul_backward(
                Some(&mut a.scratch),
                lay.wte.of_mut(g),
                None,
                &a.logits,
                &a.lnf,
                lay.wte.of(p),
                n,
                c,
                vp,
                acc
            )
        );
        a.dresidual[..n * c].fill(0.0);
        let last = &a.residual3[(cfg.num_layers - 1) * n * c..][..n * c];
        let (dlnf_w, dlnf_b) = pair(g, &lay.lnf_w, &lay.lnf_b);
        let (lnf_w, m, r) = (lay.lnf_w.of(p), &a.lnf_mean, &a.lnf_rstd);
        t!(LayerNorm, layernorm_backward(&mut a.dresidual, dlnf_w, dlnf_b, &a.scratch, last, lnf_w, m, r, n, c));
        for (l, w) in lay.blocks.iter().enumerate().rev() {
            let x = a.layer(l, b, t, &cfg);
            // MLP branch: residual3 = residual2 + fc_proj(gelu(fc(ln2(residual2)))).
            let (dw, db) = pair(g, &w.fc_proj_w, &w.fc_proj_b);
            t!(
                Matmul,
                matmul_backward(
                    Some(x.dfch),
                    dw,
                    Some(db),
                    x.dresidual,
                    x.fch_gelu,
                    w.fc_proj_w.of(p),
                    n,
                    4 * c,
                    c,
                    acc
                )
            );
            t!(Gelu, gelu_backward_inplace(x.dfch, x.fch));
            let (dw, db) = pair(g, &w.fc_w, &w.fc_b);
            t!(Matmul, matmul_backward(Some(x.scratch), dw, Some(db), x.dfch, x.ln2, w.fc_w.of(p), n, c, 4 * c, acc));
            let (dw, db) = pair(g, &w.ln2_w, &w.ln2_b);
            let (ln2_w, mean, rstd) = (w.ln2_w.of(p), &*x.ln2_mean, &*x.ln2_rstd);
            t!(LayerNorm, layernorm_backward(x.dresidual, dw, db, x.scratch, x.residual2, ln2_w, mean, rstd, n, c));
            // Attention branch: residual2 = res_in + attn_proj(attention(qkv(ln1(res_in)))).
            let (dw, db) = pair(g, &w.attn_proj_w, &w.attn_proj_b);
            t!(
                Matmul,
                matmul_backward(Some(x.scratch), dw, Some(db), x.dresidual, x.atty, w.attn_proj_w.of(p), n, c, c, acc)
            );
            // dfch (B, T, 4*C) is free again here: it serves as the per-head workspace.
            t!(Attention, attention_backward(x.dqkv, x.datt, x.dfch, x.scratch, x.qkv, x.att, b, t, c, nh));
            let (dw, db) = pair(g, &w.qkv_w, &w.qkv_b);
            t!(Matmul, matmul_backward(Some(x.scratch), dw, Some(db), x.dqkv, x.ln1, w.qkv_w.of(p), n, c, 3 * c, acc));
            let (dw, db) = pair(g, &w.ln1_w, &w.ln1_b);
            t!(
                LayerNorm,
                layernorm_backward(
                    x.dresidual,
                    dw,
                    db,
                    x.scratch,
                    x.res_in,
                    w.ln1_w.of(p),
                    x.ln1_mean,
                    x.ln1_rstd,
                    n,
                    c
                )
            );
        }
        let (dwte, dwpe) = pair(g, &lay.wte, &lay.wpe);
        t!(Encoder, encoder_backward(dwte, dwpe, &a.dresidual, &a.inputs, b, t, c));
        Ok(())
    }

    /// Start a new gradient: like PyTorch's `zero_grad(set_to_none=True)`, the tensors that the
    /// next backward writes whole (every matmul weight and bias, and wte through the LM head) are
    /// overwritten by it instead of being cleared now, which saves a pass over all gradients and
    /// the read of every weight gradient in the backward GEMMs; the rest are zeroed here. Until
    /// that backward has run, those tensors in `grads` hold stale values.
    pub fn zero_grad(&mut self) {
        for (i, span) in self.layout.tensors.iter().enumerate() {
            if !WRITTEN_WHOLE_BY_BACKWARD[i] {
                span.of_mut(&mut self.grads).fill(0.0);
            }
        }
        self.grads_overwrite = true;
    }

    /// L2 norm of all gradients (deterministic).
    pub fn grad_norm(&mut self) -> f32 {
        global_norm(&self.grads, &mut self.norm_partials)
    }

    /// One AdamW step on every tensor; weight decay only where the layout says (2-D weights).
    pub fn update(&mut self, h: &AdamW) {
        for (span, &decay) in self.layout.tensors.iter().zip(&self.layout.decay) {
            let r = span.0.clone();
            let (p, g) = (&mut self.params[r.clone()], &self.grads[r.clone()]);
            t!(Optimizer, adamw_update(p, g, &mut self.m[r.clone()], &mut self.v[r], h, decay));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// zero_grad leaves stale values in the tensors the next backward overwrites; the gradients
    /// must come out bit-identical to clearing everything and accumulating.
    #[test]
    fn zero_grad_then_backward_equals_clearing_everything() {
        let cfg = GPT2Config::from_descriptor("2x32:2:16").unwrap();
        let (b, t) = (2, 5);
        let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % cfg.vocab_size + 1) as u32).collect();
        let mut grads = vec![];
        for stale in [false, true] {
            let mut model = GPT2::random(cfg, 3).unwrap();
            model.alloc_training_state();
            if stale {
                model.grads.iter_mut().enumerate().for_each(|(i, g)| *g = (i % 7) as f32 - 3.0);
                model.zero_grad();
            }
            for _ in 0..2 {
                model.forward(&inputs, Some(&targets), b, t).unwrap();
                model.backward(0.5).unwrap();
            }
            grads.push(model.grads);
        }
        assert!(grads[0] == grads[1], "gradients differ after zero_grad over stale values");
    }
}

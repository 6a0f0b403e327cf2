//! The passes: forward (training and evaluation, the classifier in chunks of rows), backward,
//! and the host reads of their results (losses, logits). The family's block gives each layer's
//! calls; under ZeRO-3 the weights are gathered a block at a time.

use super::*;

/// Shapes and token ids of a batch, checked on the host before anything reaches the device.
/// The fewest rows of a classifier chunk: a single row would go through the one-row GEMV,
/// which adds its products in another order than the GEMM, so its loss would change by a
/// rounding; with 3 rows or more the chunks can always be cut with none of a single row.
pub const MIN_CLASSIFIER_ROWS: usize = 3;

/// The classifier's chunks over `n` positions as (first row, rows): `rows` at a time, except
/// that a last chunk of a single row (see [`MIN_CLASSIFIER_ROWS`]) takes one row from the
/// chunk before it. `rows` >= 3 or >= n.
pub(super) fn classifier_chunks(n: usize, rows: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = (0..n).step_by(rows.max(1)).map(|r0| (r0, rows.min(n - r0))).collect();
    if let [.., (_, before), (last0, last)] = v.as_mut_slice() {
        if *last == 1 && *before >= MIN_CLASSIFIER_ROWS {
            *before -= 1;
            *last0 -= 1;
            *last = 2;
        }
    }
    v
}

impl Model {
    /// Forward pass over `inputs (b, t)`: logits (b, t, Vp), and with `targets (b, t)` the
    /// per-position losses (see [`Model::accumulate_loss`], [`Model::backward`]). Under ZeRO-3
    /// it gathers weights, a collective: every rank must make the same passes.
    pub fn forward(&mut self, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
        self.forward_impl(inputs, targets, b, t, true)
    }

    /// A training micro-step: [`Model::forward`] with targets then [`Model::backward`] with
    /// `loss_scale`, the same bits, with the classifier fused: each chunk of rows (see
    /// [`Model::set_classifier_rows`]) goes through the head, the loss, d(logits) and the head's
    /// backward at once, so its logits are computed once (a chunked forward then backward
    /// computes them twice). The per-position losses are there afterwards; the logits are not.
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
        loss_scale: f32,
    ) -> Result<()> {
        self.train.context("forward_backward needs training state: call alloc_training_state first")?;
        self.forward_impl(inputs, Some(targets), b, t, false)?;
        self.backward_impl(loss_scale, true)?;
        self.last.losses = true;
        Ok(())
    }

    /// The forward pass, and the classifier unless `head` is false (then [`Model::backward_impl`]
    /// runs it, fused).
    pub(super) fn forward_impl(
        &mut self,
        inputs: &[u32],
        targets: Option<&[u32]>,
        b: usize,
        t: usize,
        head: bool,
    ) -> Result<()> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, v, vp, n, s) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, b * t, Seq { b, t });
        check_tokens(&cfg, inputs, targets, b, t)?;
        self.reserve(b, t)?;
        let a = self.acts.clone().context("no activations")?;
        let o = self.outer_weights()?;
        let (inp, tgt) = a.tokens(n);
        self.be.upload_u32(inp, inputs);
        arch.embed(&mut Ops::new(&mut *self.be), &cfg, &o, a.encoded(n), inp, s, 0);
        for l in 0..cfg.num_layers {
            let w = self.block_weights(l)?;
            let x = a.layer(l, b, t);
            let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
            arch.block_forward(
                &mut Ops::new(&mut *self.be).with_lora(lora),
                &cfg,
                &self.consts,
                &w,
                &x,
                n,
                Attn::Causal(s),
            );
        }
        let mut ops = Ops::new(&mut *self.be);
        let norm = a.norm(n);
        arch.final_norm(&mut ops, &cfg, &o, &norm, a.last_residual(&cfg, n), n);
        let head_w = o[arch.head(&cfg)];
        if let Some(y) = targets {
            ops.backend().upload_u32(tgt, y);
        }
        // The classifier, `rows` positions at a time into a logits buffer of that many rows.
        // Chunked without targets, it computes nothing here: logits_at computes the rows read.
        let rows = a.logit_rows.min(n);
        if head && (rows == n || targets.is_some()) {
            for (r0, r) in classifier_chunks(n, rows) {
                let (x, logits) = (norm.out.slice(r0 * c..(r0 + r) * c), a.logits.prefix(r * vp));
                let m = Mat { n: r, c, oc: vp };
                ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head_w, None, m));
                if targets.is_some() {
                    let (losses, lse, tgt) =
                        (a.losses.slice(r0..r0 + r), a.lse.slice(r0..r0 + r), tgt.slice(r0..r0 + r));
                    ops.crossentropy_forward(losses, lse, logits, tgt, r, v, vp);
                }
            }
        }
        let losses = head && targets.is_some();
        self.last = Last { b, t, logits: head, losses, backward_ready: targets.is_some() };
        Ok(())
    }

    /// Backward pass of the last forward (which must have had targets), for the objective
    /// `loss_scale * mean loss` (gradient accumulation over k micro-batches passes 1/k). Adds
    /// to the gradients (see [`Model::zero_grad`]) and that objective to the step's loss.
    /// Overwrites the logits with their gradient. Under ZeRO-2/3 each block's gradients are
    /// reduce-scattered into this rank's shard as soon as the block is done.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        self.backward_impl(loss_scale, false)
    }

    /// The backward pass; `fused`: the forward left the classifier to it (forward_backward),
    /// so each chunk's logits and losses are computed here, just before their backward.
    pub(super) fn backward_impl(&mut self, loss_scale: f32, fused: bool) -> Result<()> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, v, vp, nl) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, cfg.num_layers);
        self.train.context("backward needs training state: call alloc_training_state first")?;
        let Last { b, t, backward_ready: true, .. } = self.last else {
            bail!("backward needs a forward pass with targets (and runs once per pass)")
        };
        self.last = Last { logits: false, backward_ready: false, ..self.last };
        let acc = !std::mem::take(&mut self.grads_overwrite) && self.zero.stage < 2;
        let a = self.acts.clone().context("no activations")?;
        let o = self.outer_weights()?;
        let d_o = self.outer_grads();
        let (n, s) = (b * t, Seq { b, t });
        let (inp, tgt) = a.tokens(n);
        let norm = a.norm(n);
        let mut d = a.back(b, t);
        let mut ops = Ops::new(&mut *self.be);
        let (head, dhead) = (o[arch.head(&cfg)], d_o[arch.head(&cfg)]);
        // The classifier's backward, chunk by chunk as its forward: a chunked pass first
        // computes the chunk's logits again (the forward kept only the last chunk's), a fused
        // one its logits and losses. Each chunk's rows of d(lnf) are as unchunked; the head's
        // gradient adds chunk by chunk.
        let rows = a.logit_rows.min(n);
        for (r0, r) in classifier_chunks(n, rows) {
            let (x, dx) = (norm.out.slice(r0 * c..(r0 + r) * c), a.scratch.slice(r0 * c..(r0 + r) * c));
            let (logits, lse, tgt) = (a.logits.prefix(r * vp), a.lse.slice(r0..r0 + r), tgt.slice(r0..r0 + r));
            let m = Mat { n: r, c, oc: vp };
            if rows < n || fused {
                ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head, None, m));
            }
            if fused {
                ops.crossentropy_forward(a.losses.slice(r0..r0 + r), lse, logits, tgt, r, v, vp);
            }
            ops.crossentropy_backward(logits, lse, tgt, loss_scale / n as f32, r, v, vp);
            let acc = acc || r0 > 0;
            ops.charged_to(Kind::Classifier, |ops| ops.matmul_backward(Some(dx), dhead, None, logits, x, head, m, acc));
        }
        ops.accumulate_mean(self.stats.prefix(1), a.losses.prefix(n), loss_scale);
        let dnorm = a.scratch.prefix(n * c);
        ops.backend().fill(d.dres, 0.0);
        arch.final_norm_backward(&mut ops, &cfg, &o, &d_o, &norm, d.dres, dnorm, a.last_residual(&cfg, n), n);
        for l in (0..nl).rev() {
            let (w, dw) = (self.block_weights(l)?, self.block_grads(l));
            let x = a.layer(l, b, t);
            let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
            // A LoRA run's embedding is frozen: nothing reads the first block's input gradient.
            d.input_grad = l > 0 || self.lora.is_none();
            let mut ops = Ops::new(&mut *self.be).with_lora(lora);
            arch.block_backward(&mut ops, &cfg, &self.consts, &w, &dw, &x, &d, s, acc);
            self.reduce_grads(&self.layout.block_ids(), l)?;
        }
        // A frozen embedding has no gradient to scatter.
        if self.lora.is_none() {
            arch.embed_backward(&mut Ops::new(&mut *self.be), &cfg, &d_o, d.dres, inp, s);
        }
        self.reduce_grads(&self.layout.outer_ids(), 0)
    }

    /// The tensors outside the blocks for this pass: views of the parameters, or under ZeRO-3
    /// gathered from every rank's shard (once per update).
    pub(super) fn outer_weights(&mut self) -> Result<View<Buf>> {
        let p = self.work.unwrap_or(self.params);
        let Some(mut g) = self.gathered else { return Ok(self.layout.outer().map(|r| p.slice(r.clone()))) };
        let views = self.zero.outer_bucket().0.map(|r| g.embed.slice(r.clone()));
        if !g.embed_valid {
            for t in self.layout.outer_ids().into_iter().filter(|&t| views[t].len > 0) {
                let src = p.slice(self.zero.piece(t, 0).shard);
                self.comm.all_gather(&mut *self.be, src, views[t])?;
            }
            g.embed_valid = true;
            self.gathered = Some(g);
        }
        Ok(views)
    }

    /// Block `l`'s weights: views of the parameters, or under ZeRO-3 gathered just before use
    /// into the one-block buffer (which the next block's gathering overwrites).
    pub(super) fn block_weights(&mut self, l: usize) -> Result<View<Buf>> {
        let p = self.work.unwrap_or(self.params);
        let Some(mut g) = self.gathered else { return Ok(self.layout.block(l).map(|r| p.slice(r.clone()))) };
        let views = self.zero.block_bucket().0.map(|r| g.block.slice(r.clone()));
        if g.block_held != Some(l) {
            for t in self.layout.block_ids().into_iter().filter(|&t| views[t].len > 0) {
                let src = p.slice(self.zero.piece(t, l).shard);
                self.comm.all_gather(&mut *self.be, src, views[t])?;
            }
            g.block_held = Some(l);
            self.gathered = Some(g);
        }
        Ok(views)
    }

    /// The gathered parameters no longer match the shards (after an update or a write).
    pub(super) fn forget_gathered(&mut self) {
        if let Some(g) = &mut self.gathered {
            g.embed_valid = false;
            g.block_held = None;
        }
    }

    /// Recompute level `level` (llm.c's `-r`; [`crate::models::acts::MAX_RECOMPUTE`] at most): 1 keeps
    /// one MLP activation buffer for all layers instead of one per layer and recomputes it in
    /// each block's backward, 2 the norms' outputs too. Every loss and gradient is the same
    /// bits as at 0; the memory saved costs a few element-wise passes per step. Activations
    /// already sized are made again at the same capacity.
    pub fn set_recompute(&mut self, level: u8) -> Result<()> {
        if level > crate::models::acts::MAX_RECOMPUTE {
            bail!("-r {level}: the recompute levels are 0 (none), 1 (the MLP activation) and 2 (+ the norms' outputs)");
        }
        self.plan = self.arch.acts(&self.config).with_recompute(level);
        self.remake_acts()
    }

    /// Run the classifier (the head's GEMM, the cross-entropy and their backward) `rows`
    /// positions at a time (0: all B*T at once, the default), so that the logits buffer holds
    /// (rows, Vp) instead of (B*T, Vp): 4.2 GB less for Llama 3's 128,256 tokens at B=4,
    /// T=1024 with 256 rows. The backward computes each chunk's logits again (one more head
    /// GEMM per step). Losses and every gradient but the head's are the same bits; the head's
    /// gradient adds its chunks in another order. A forward without targets computes only the
    /// logits [`Model::logits_at`] reads.
    pub fn set_classifier_rows(&mut self, rows: usize) -> Result<()> {
        if rows > 0 && rows < MIN_CLASSIFIER_ROWS {
            bail!(
                "--ce-rows {rows}: the classifier's chunks are at least {MIN_CLASSIFIER_ROWS} rows (0 = all at once)"
            );
        }
        self.ce_rows = rows;
        self.remake_acts()
    }

    /// Make sure activations can hold a pass over (b, t) (with the backward buffers once there
    /// is training state). Allocates only when they cannot.
    pub fn reserve(&mut self, b: usize, t: usize) -> Result<()> {
        let backward = self.train.is_some();
        if self.acts.as_ref().is_some_and(|a| a.fits(b, t, backward)) {
            return Ok(());
        }
        let (cb, ct) = self.acts.as_ref().map_or((b, t), |a| (a.cap_b.max(b), a.cap_t.max(t)));
        // A bound on every activation size Acts computes, so that none of them overflows.
        let cfg = &self.config;
        let widths = self.plan.fwd.iter().chain(&self.plan.back).map(|s| match s.width {
            crate::models::acts::Width::Pos(w) => w,
            crate::models::acts::Width::Heads(k) => k.saturating_mul(cfg.num_heads),
        });
        let wide = widths.fold(cfg.padded_vocab_size, usize::saturating_add);
        let per_position = wide.checked_mul(16 * (cfg.num_layers + 2));
        if per_position.and_then(|p| cb.checked_mul(ct)?.checked_mul(p)).is_none() {
            bail!("B={cb} x T={ct} is far more than any machine can hold activations for; lower -b or -t");
        }
        if let Some(a) = self.acts.take() {
            a.free(&mut *self.be);
        }
        let rows = if self.ce_rows == 0 { cb * ct } else { self.ce_rows };
        let dtype = self.act_dtype();
        let acts = Acts::new(&mut *self.be, &self.config, &self.plan, cb, ct, backward, rows, dtype);
        let hint = if self.plan.recompute < crate::models::acts::MAX_RECOMPUTE {
            ", or keep fewer with -r 2 (README: Memory)"
        } else {
            ""
        };
        self.acts = Some(acts.with_context(|| format!("activations for B={cb} x T={ct}: lower -b or -t{hint}"))?);
        if let Some(r) = self.lora.as_ref().map(|lo| lo.meta.r) {
            // Adapters' (N, R) workspaces for a pass over the activations' positions or a KV
            // cache's (at most maxT).
            let n = (cb * ct).max(self.config.max_seq_len);
            let old = self.lora.as_ref().expect("checked").scratch;
            if old.len < 2 * n * r {
                self.be.free(old);
                let scratch = self.be.alloc(2 * n * r, DType::F32)?;
                self.lora.as_mut().expect("checked").scratch = scratch;
                self.wire_lora();
            }
            // Each adapter's h for the backward: (B*T, R) a target.
            let targets = self.lora.as_ref().expect("checked").meta.targets.len();
            let kept = self.lora.as_ref().expect("checked").kept;
            if backward && kept.is_none_or(|k| k.len < targets * cb * ct * r) {
                if let Some(k) = kept {
                    self.be.free(k);
                }
                let k = self.be.alloc(targets * cb * ct * r, DType::F32)?;
                self.lora.as_mut().expect("checked").kept = Some(k);
                self.wire_lora();
            }
        }
        Ok(())
    }

    // ---- KV-cached inference --------------------------------------------------------------

    /// The first V logits of position `row` (0..b*t) of the last forward pass.
    pub fn logits_at(&mut self, row: usize) -> Result<Vec<f32>> {
        let (v, vp) = (self.config.vocab_size, self.config.padded_vocab_size);
        let Last { b, t, logits: true, .. } = self.last else { bail!("no logits: run a forward pass first") };
        if row >= b * t {
            bail!("position {row} is outside the last pass's {} positions", b * t);
        }
        let a = self.acts.clone().context("no activations")?;
        let mut out = vec![0f32; v];
        if a.logit_rows >= b * t {
            self.be.download(a.logits.slice(row * vp..row * vp + v), &mut out)?;
        } else {
            // A chunked classifier keeps no pass's logits whole: compute this row's (the
            // gathered embedding is still valid after the forward: no collective here).
            let (c, cfg) = (self.config.channels, self.config);
            let head = self.outer_weights()?[self.arch.head(&cfg)];
            let x = a.norm(b * t).out.slice(row * c..(row + 1) * c);
            let mut ops = Ops::new(&mut *self.be);
            let logits = a.logits.prefix(vp);
            ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head, None, Mat { n: 1, c, oc: vp }));
            self.be.download(logits.prefix(v), &mut out)?;
        }
        Ok(out)
    }

    /// The per-position losses (b*t) of the last forward pass with targets.
    pub fn losses(&mut self) -> Result<Vec<f32>> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no losses: run a forward pass with targets first")
        };
        let a = self.acts.as_ref().context("no activations")?;
        let mut out = vec![0f32; b * t];
        self.be.download(a.losses.prefix(b * t), &mut out)?;
        Ok(out)
    }

    /// Add `weight * mean loss` of the last forward pass (with targets) to the loss accumulator.
    pub fn accumulate_loss(&mut self, weight: f32) -> Result<()> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no loss: run a forward pass with targets first")
        };
        let a = self.acts.as_ref().context("no activations")?;
        Ops::new(&mut *self.be).accumulate_mean(self.stats.prefix(1), a.losses.prefix(b * t), weight);
        Ok(())
    }

    /// Read the loss accumulator and set it back to 0 (one host read).
    pub fn take_loss(&mut self) -> Result<f32> {
        let mut s = [0f32];
        self.be.download(self.stats.prefix(1), &mut s)?;
        self.be.fill(self.stats.prefix(1), 0.0);
        Ok(s[0])
    }

    /// [`Model::take_loss`] of the accumulator averaged over the ranks (validation, where each
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::model;

    /// Recompute (-r 1, 2) refills the shared buffers with the forward's own calls: the losses
    /// and every gradient are the same bits as keeping them per layer, over two steps (the
    /// second reads the first's updated weights), with less activation memory at each level.
    #[test]
    fn recompute_gives_the_same_bits_with_less_memory() {
        let (b, t) = (2, 7);
        for desc in ["3x32:2:16", "llama:3x24:4:2:40:16", "qwen3:3x24:4:2:8:40:16", "qwen2:3x24:4:2:40:16"] {
            let runs: Vec<(Vec<f32>, Vec<f32>, usize)> = (0..=crate::models::acts::MAX_RECOMPUTE)
                .map(|r| {
                    let mut m = model(desc, 5);
                    m.alloc_training_state().unwrap();
                    m.set_recompute(r).unwrap();
                    let v = m.config.vocab_size;
                    let (mut losses, mut grads) = (vec![], vec![]);
                    for step in 0..2 {
                        let inputs: Vec<u32> = (0..b * t).map(|i| ((i * 7 + step) % v) as u32).collect();
                        let targets: Vec<u32> = (0..b * t).map(|i| ((i * 3 + 1) % v) as u32).collect();
                        m.zero_grad().unwrap();
                        m.forward(&inputs, Some(&targets), b, t).unwrap();
                        losses.extend(m.losses().unwrap());
                        m.backward(1.0).unwrap();
                        grads.extend(m.read_all(Slot::Grads).unwrap());
                        m.update(&OptimConfig::default(), 1e-2, step + 1, SkipAbove::NON_FINITE).unwrap();
                    }
                    (losses, grads, m.memory().activations)
                })
                .collect();
            for (r, run) in runs.iter().enumerate().skip(1) {
                let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same(&run.0, &runs[0].0), "{desc}: -r {r} changed a loss");
                assert!(same(&run.1, &runs[0].1), "{desc}: -r {r} changed a gradient");
                assert!(run.2 < runs[r - 1].2, "{desc}: -r {r} keeps {} bytes, -r {} {}", run.2, r - 1, runs[r - 1].2);
            }
        }
        let mut m = model("1x16:2:16", 1);
        assert!(m.set_recompute(3).unwrap_err().to_string().contains("-r 3"));
    }

    /// The classifier in chunks of rows (3, 5 and 13 of 14 rows: none a divisor, and 13 leaves
    /// a single row, which the chunks cut around): the
    /// same losses, logits and gradients bit for bit, except the head's gradient, whose chunks
    /// add in another order (held to 1e-6 of its largest element); the logits buffer shrinks.
    #[test]
    fn chunked_classifier_gives_the_same_results_with_less_memory() {
        let (b, t) = (2, 7);
        let fp32 = crate::core::config::Precision::Fp32;
        for (desc, precision) in [
            ("2x32:2:16", fp32),
            ("llama:2x24:4:2:40:16", fp32),
            ("2x32:2:16", crate::core::config::Precision::Bf16),
            ("llama:2x24:4:2:40:16", crate::core::config::Precision::Bf16),
        ] {
            let cfg = ModelConfig {
                vocab_size: 1001,
                padded_vocab_size: 1024,
                ..ModelConfig::from_descriptor(desc).unwrap()
            };
            let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 1001) as u32).collect();
            let targets: Vec<u32> = (0..b * t).map(|i| (i * 389 % 1001) as u32).collect();
            let runs: Vec<_> = [0, 3, 5, 13]
                .into_iter()
                .map(|rows| {
                    let mut m = Model::new(Weights::random(cfg, 4).unwrap(), Device::Cpu).unwrap();
                    m.set_precision(precision, true).unwrap();
                    m.alloc_training_state().unwrap();
                    m.set_classifier_rows(rows).unwrap();
                    m.forward(&inputs, None, b, t).unwrap();
                    let logits: Vec<f32> = (0..b * t).flat_map(|r| m.logits_at(r).unwrap()).collect();
                    let mut losses = vec![];
                    for _ in 0..2 {
                        m.forward(&inputs, Some(&targets), b, t).unwrap();
                        losses.extend(m.losses().unwrap());
                        m.backward(0.5).unwrap();
                    }
                    (logits, losses, m.read_all(Slot::Grads).unwrap(), m.memory().activations, m)
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let head = runs[0].4.arch.head(&cfg);
            let layout = runs[0].4.layout().clone();
            // The head's gradient adds its chunks: in fp32 the sums move by rounding; in bf16
            // the gradient is a bf16 buffer, so each chunk's share is rounded as it adds (as
            // llm.c's bf16 gradients round at each micro-batch), a few of bf16's 2^-8 steps.
            let rel = if precision == fp32 { 1e-6 } else { 1.0 / 64.0 };
            for (rows, run) in [3, 5, 13].iter().zip(&runs[1..]) {
                let tol = |x: &[f32]| rel * x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| (a - b).abs() <= tol(y));
                assert!(close(&run.0, &runs[0].0), "{desc} {precision}: logits in chunks of {rows}");
                assert!(bits(&run.1) == bits(&runs[0].1), "{desc}: losses in chunks of {rows}");
                for id in layout.ids() {
                    let (x, y) = (&run.2[layout.range(id)], &runs[0].2[layout.range(id)]);
                    if id == head {
                        assert!(close(x, y), "{desc}: head gradient in chunks of {rows}");
                    } else {
                        assert!(bits(x) == bits(y), "{desc}: {} gradient in chunks of {rows}", layout.spec(id).name);
                    }
                }
                assert!(run.3 < runs[0].3, "{desc}: chunks of {rows} use {} bytes, unchunked {}", run.3, runs[0].3);
            }
        }
        assert_eq!(classifier_chunks(14, 4), [(0, 4), (4, 4), (8, 4), (12, 2)]);
        assert_eq!(classifier_chunks(13, 4), [(0, 4), (4, 4), (8, 3), (11, 2)]);
        assert_eq!(classifier_chunks(7, 3), [(0, 3), (3, 2), (5, 2)]);
        assert_eq!(classifier_chunks(5, 5), [(0, 5)]);
        let mut m = model("1x16:2:16", 1);
        assert!(m.set_classifier_rows(2).unwrap_err().to_string().contains("at least 3 rows"));
    }

    /// The fused micro-step is the two passes: the same losses, step loss and gradients, bit
    /// for bit, whole and in chunks (where it computes each chunk's logits once, not twice).
    #[test]
    fn forward_backward_is_forward_then_backward() {
        let (b, t) = (2, 7);
        for desc in ["2x32:2:16", "llama:2x24:4:2:40:16"] {
            let cfg = ModelConfig {
                vocab_size: 1001,
                padded_vocab_size: 1024,
                ..ModelConfig::from_descriptor(desc).unwrap()
            };
            let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 1001) as u32).collect();
            let targets: Vec<u32> = (0..b * t).map(|i| (i * 389 % 1001) as u32).collect();
            for rows in [0, 3, 13] {
                let runs: Vec<_> = [false, true]
                    .into_iter()
                    .map(|fused| {
                        let mut m = Model::new(Weights::random(cfg, 4).unwrap(), Device::Cpu).unwrap();
                        m.alloc_training_state().unwrap();
                        m.set_classifier_rows(rows).unwrap();
                        m.zero_grad().unwrap();
                        let mut losses = vec![];
                        for _ in 0..2 {
                            if fused {
                                m.forward_backward(&inputs, &targets, b, t, 0.5).unwrap();
                            } else {
                                m.forward(&inputs, Some(&targets), b, t).unwrap();
                                m.backward(0.5).unwrap();
                            }
                            losses.extend(m.losses().unwrap());
                        }
                        let step = m.step_stats().unwrap();
                        losses.push(step.loss);
                        (losses, m.read_all(Slot::Grads).unwrap())
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&runs[0].0) == bits(&runs[1].0), "{desc} rows {rows}: losses");
                assert!(bits(&runs[0].1) == bits(&runs[1].1), "{desc} rows {rows}: gradients");
            }
        }
    }
}

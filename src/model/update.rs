//! The update: gradients zeroed and reduced over the ranks (ZeRO's reduce-scatter where the
//! stage shards them), then AdamW (with clipping and llm.c's outlier skipping) on the tensors or
//! the shard this rank holds, and the bf16 working copy written from the master weights.

use super::*;

/// Clip (if the global norm exceeds `grad_clip`) and apply AdamW for 0-based `step`, then read
/// the step's loss and the gradient norm before clipping.
pub fn optimizer_step(model: &mut Model, o: &OptimConfig, lr: f32, step: usize) -> Result<StepStats> {
    model.update(o, lr, step, SkipAbove::NON_FINITE)?;
    model.step_stats()
}

/// The gradient views of a frozen model's tensors `ranges` (a block's or the outer ones): a
/// matrix's is [`FROZEN`] (its GEMM gradient is not computed), the others' disjoint slices of
/// `sink`, which nothing reads.
pub(super) fn frozen_grads(layout: &ParamLayout, ranges: View<std::ops::Range<usize>>, sink: Buf) -> View<Buf> {
    let mut off = 0;
    View(
        layout
            .ids()
            .zip(&ranges.0)
            .map(|(t, r)| {
                if layout.spec(t).shape.len() >= 2 || r.is_empty() {
                    return if r.is_empty() { sink.prefix(0) } else { FROZEN };
                }
                off += r.len();
                sink.slice(off - r.len()..off)
            })
            .collect(),
    )
}

/// The seed of the stochastic rounding of step `step`'s bf16 parameters: a function of the
/// step alone, so a resumed run rounds as the uninterrupted one.
pub(super) fn rounding_seed(step: usize) -> u32 {
    (step as u32).wrapping_mul(0x9E37_79B9) ^ 0x6A09_E667
}

impl Model {
    /// Allocate gradients and AdamW moments (zeroed). Call once before training.
    pub fn alloc_training_state(&mut self) -> Result<()> {
        if self.train.is_none() {
            let gdt = self.act_dtype();
            let mut z = |parts: Vec<usize>, dtype: DType| -> Result<Buf> {
                let b = self.be.alloc_parts(&parts, dtype)?;
                self.be.fill(b, 0.0);
                Ok(b)
            };
            let f32 = DType::F32;
            if let Some(len) = self.lora.as_ref().map(|lo| lo.params.len) {
                // ZeRO-1..3 shard the adapters' AdamW state; every rank's backward writes all
                // of their gradients (reduce-scattered in the update). The adapters and their
                // gradients stay f32 at every precision, as PEFT's under autocast.
                let own = if self.zero.stage > 0 { len / self.comm.world() } else { len };
                let (grads, m, v) = (z(vec![len], f32)?, z(vec![own], f32)?, z(vec![own], f32)?);
                self.train = Some(TrainBufs { grads, buckets: None, m, v });
                self.wire_lora();
                return self.remake_acts();
            }
            // Gradients in the activations' dtype (bf16 as llm.c's), AdamW's moments f32.
            let (grads, m, v) =
                (z(self.zero.parts_at(2), gdt)?, z(self.zero.parts_at(1), f32)?, z(self.zero.parts_at(1), f32)?);
            let buckets = if self.zero.stage >= 2 {
                let (e, b) = (self.zero.outer_bucket().1, self.zero.block_bucket().1);
                let whole = z(self.zero.bucket_parts(), gdt)?;
                Some((whole.prefix(e), whole.slice(e..e + b)))
            } else {
                None
            };
            self.train = Some(TrainBufs { grads, buckets, m, v });
            // Activations sized before training lack the backward buffers.
            self.remake_acts()?;
        }
        Ok(())
    }

    /// Start a step: the step's loss to 0, and a new gradient. Like PyTorch's
    /// `zero_grad(set_to_none=True)`, the tensors that the next backward writes whole
    /// ([`crate::core::params::TensorSpec::whole`]) are overwritten by it instead of being cleared
    /// now, which saves a pass over all gradients and the read of every weight gradient in the
    /// backward GEMMs; the rest are zeroed here. Under ZeRO-2/3 the shard is cleared (backward
    /// adds each micro-batch's reduced gradients to it).
    pub fn zero_grad(&mut self) -> Result<()> {
        let tr = self.train.context("zero_grad needs training state: call alloc_training_state first")?;
        if self.lora.is_some() || self.zero.stage >= 2 {
            self.be.fill(tr.grads, 0.0);
        } else {
            for t in self.layout.ids().filter(|&t| !self.layout.spec(t).whole) {
                self.be.fill(tr.grads.slice(self.layout.range(t)), 0.0);
            }
        }
        self.be.fill(self.stats.prefix(1), 0.0);
        self.grads_overwrite = true;
        Ok(())
    }

    /// The optimizer step, queued without waiting on the host (see [`Sharding::update`]: AdamW
    /// with clipping, on the parts of the parameters this rank's ZeRO stage gives it). A step
    /// whose loss or norm is not finite, or above `skip`, leaves the model unchanged
    /// ([`Backend::adamw_update`]); [`Model::step_stats`] tells.
    pub fn update(&mut self, o: &OptimConfig, lr: f32, step: usize, skip: SkipAbove) -> Result<()> {
        let tr = self.train.context("update needs training state: call alloc_training_state first")?;
        self.skip = skip;
        if let Some(lo) = &self.lora {
            // The adapters: data parallel over the ranks. ZeRO-0: gradients averaged everywhere
            // and every rank's AdamW over all; ZeRO-1..3: this rank's shard of the gradients
            // (reduce-scattered), of the AdamW state and of the update, then the adapters
            // gathered whole again.
            let (be, norm) = (&mut *self.be, self.stats.slice(1..2));
            self.comm.all_reduce(be, self.stats.prefix(1), Reduce::Mean)?;
            let (params, grads) = if self.zero.stage == 0 {
                self.comm.all_reduce(be, tr.grads, Reduce::Mean)?;
                Ops::new(be).global_norm_squared(norm, tr.grads, false);
                (lo.params, tr.grads)
            } else {
                let own = tr.m.len;
                let shard = self.comm.rank() * own..(self.comm.rank() + 1) * own;
                let g = tr.grads.slice(shard.clone());
                self.comm.reduce_scatter(be, tr.grads, g, Reduce::Mean, false)?;
                Ops::new(be).global_norm_squared(norm, g, false);
                self.comm.all_reduce(be, norm, Reduce::Sum)?;
                (lo.params.slice(shard), g)
            };
            let h = AdamWParams {
                lr,
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
                grad_clip: o.grad_clip,
                t: step as i32 + 1,
                skip,
                seed: rounding_seed(step),
                place: None,
            };
            Ops::new(be).adamw_update(params, grads, tr.m, tr.v, self.stats, &h);
            if self.zero.stage > 0 {
                self.comm.all_gather(be, params, lo.params)?;
            }
            return Ok(());
        }
        let (params, grads, m, v, stats, work) = (self.params, tr.grads, tr.m, tr.v, self.stats, self.work);
        let bufs = crate::model::zero::StepBufs { params, grads, m, v, stats, work };
        let layout = &self.layout;
        let hyper = |t: TensorId| AdamWParams {
            lr,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: if layout.spec(t).decay { o.weight_decay } else { 0.0 },
            grad_clip: o.grad_clip,
            t: step as i32 + 1,
            skip,
            seed: rounding_seed(step),
            place: None,
        };
        self.zero.update(&mut *self.be, &mut *self.comm, bufs, hyper)?;
        if let (Some(work), 1 | 2) = (self.work, self.zero.stage) {
            // The bf16 working copy from the gathered master weights, rounded stochastically
            // as llm.c's AdamW writes it (stages 0 and 3 write it in AdamW's pass); a skipped
            // step leaves it as it was (a host read of the statistics that these stages add).
            let s = self.step_stats()?;
            if !s.skipped {
                let noise = Noise::at(rounding_seed(step), work);
                Ops::new(&mut *self.be).convert(work, self.params, Some(noise));
            }
        }
        self.forget_gathered();
        Ok(())
    }

    // ---- where parameters and gradients are for a pass (ZeRO) ------------------------------

    /// Where backward writes the gradients of the tensors outside the blocks: the gradient
    /// buffer, or under ZeRO-2/3 the outer bucket, whose tensors that backward adds to are
    /// zeroed.
    pub(super) fn outer_grads(&mut self) -> View<Buf> {
        let tr = self.train.expect("checked by the caller");
        if let Some(lo) = &self.lora {
            return frozen_grads(&self.layout, self.layout.outer(), lo.sink);
        }
        let Some((bucket, _)) = tr.buckets else { return self.layout.outer().map(|r| tr.grads.slice(r.clone())) };
        let views = self.zero.outer_bucket().0.map(|r| bucket.slice(r.clone()));
        for t in self.layout.outer_ids().into_iter().filter(|&t| !self.layout.spec(t).whole) {
            self.be.fill(views[t], 0.0);
        }
        views
    }

    /// Where backward writes block `l`'s gradients: the gradient buffer, or under ZeRO-2/3 the
    /// block bucket, with the gradients that backward adds to (the norms') zeroed.
    pub(super) fn block_grads(&mut self, l: usize) -> View<Buf> {
        let tr = self.train.expect("checked by the caller");
        if let Some(lo) = &self.lora {
            return frozen_grads(&self.layout, self.layout.block(l), lo.sink);
        }
        let Some((_, bucket)) = tr.buckets else { return self.layout.block(l).map(|r| tr.grads.slice(r.clone())) };
        let views = self.zero.block_bucket().0.map(|r| bucket.slice(r.clone()));
        for t in self.layout.block_ids().into_iter().filter(|&t| !self.layout.spec(t).whole) {
            self.be.fill(views[t], 0.0);
        }
        views
    }

    /// ZeRO-2/3: reduce-scatter the bucket's gradients of `tensors` (layer `l`) into this
    /// rank's shard, averaged over the ranks and added to the micro-batches before.
    pub(super) fn reduce_grads(&mut self, tensors: &[TensorId], l: usize) -> Result<()> {
        let tr = self.train.expect("checked by the caller");
        let Some((outer, block)) = tr.buckets else { return Ok(()) };
        let (or, br) = (self.zero.outer_bucket().0, self.zero.block_bucket().0);
        for &t in tensors.iter().filter(|&&t| self.layout.spec(t).numel_per_layer() > 0) {
            let src =
                if self.layout.spec(t).per_layer { block.slice(br[t].clone()) } else { outer.slice(or[t].clone()) };
            let dst = tr.grads.slice(self.zero.piece(t, l).shard);
            self.comm.reduce_scatter(&mut *self.be, src, dst, Reduce::Mean, true)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::model;

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
}

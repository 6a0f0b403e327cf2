//! The model's state as host values: parameters, gradients and AdamW moments by slot (whole, a
//! tensor, or this rank's shard), the weights for a model file, and the finiteness checks a
//! checkpoint makes first.

use super::*;

impl Model {
    pub(super) fn slot(&self, slot: Slot) -> Result<Buf> {
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

    /// Values of a slot as this rank holds it: num_parameters, or this rank's shard
    /// (num_parameters / world) where the ZeRO stage shards the slot.
    pub fn slot_len(&self, slot: Slot) -> Result<usize> {
        Ok(if slot == Slot::Params { self.layout.num_parameters } else { self.slot(slot)?.len })
    }

    /// A host copy of one tensor of a slot (llm.c order, all layers); of the parameters (under
    /// ZeRO-3 gathered: a collective), or of a slot this rank holds whole.
    pub fn read_tensor(&mut self, slot: Slot, t: impl Into<TensorId>) -> Result<Vec<f32>> {
        let t = t.into();
        if slot == Slot::Params && self.zero.stage == 3 {
            return Ok(self.read_all(slot)?[self.layout.range(t)].to_vec());
        }
        let b = self.slot(slot)?;
        if b.len != self.layout.num_parameters {
            bail!("{slot:?} is sharded over the ranks (ZeRO stage {}): read the shard with read_all", self.zero.stage);
        }
        let b = b.slice(self.layout.range(t));
        let mut out = vec![0f32; b.len];
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// A host copy of a whole slot as this rank holds it ([`Model::slot_len`]: llm.c order, or
    /// the shard layout of [`crate::model::zero`]). The parameters come whole: under ZeRO-3 they are
    /// gathered, a collective that every rank must call.
    pub fn read_all(&mut self, slot: Slot) -> Result<Vec<f32>> {
        if slot == Slot::Params && self.zero.stage == 3 {
            return Ok(self.gather_params(self.params, true)?.expect("kept"));
        }
        let b = self.slot(slot)?;
        let mut out = crate::core::mem::zeroed(b.len);
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// ZeRO-3: every piece of `shards` (the parameters, or a bf16 run's working copy, in the
    /// shard layout) gathered from the ranks (a collective), into host memory when `keep`.
    pub(super) fn gather_params(&mut self, shards: Buf, keep: bool) -> Result<Option<Vec<f32>>> {
        let g = self.gathered.context("the parameters are not sharded")?;
        let mut out = if keep { Some(crate::core::mem::zeroed::<f32>(self.layout.num_parameters)) } else { None };
        self.forget_gathered(); // the gathering buffer is overwritten
                                // Through the gathering buffer where it has the shards' dtype; else (a bf16 run's f32
                                // master weights) through a buffer of the largest piece for the while.
        let largest = self.pieces.iter().map(|p| p.full.len()).max().unwrap_or(0);
        let staging = if g.whole.dtype == shards.dtype { None } else { Some(self.be.alloc(largest, shards.dtype)?) };
        let mut gather = || -> Result<()> {
            for p in &self.pieces {
                let dst = staging.unwrap_or(g.whole).prefix(p.full.len());
                self.comm.all_gather(&mut *self.be, shards.slice(p.shard.clone()), dst)?;
                if let Some(o) = &mut out {
                    self.be.download(dst, &mut o[p.full.clone()])?;
                }
            }
            Ok(())
        };
        let r = gather();
        if let Some(b) = staging {
            self.be.free(b);
        }
        r.map(|()| out)
    }

    /// Overwrite a whole slot from the host, in the layout [`Model::read_all`] gives. Under
    /// ZeRO-3 each rank keeps its part of the parameters.
    pub fn write_all(&mut self, slot: Slot, data: &[f32]) -> Result<()> {
        let b = self.slot(slot)?;
        let want = self.slot_len(slot)?;
        if data.len() != want {
            bail!("{} values for {slot:?}, the model has {want} here", data.len());
        }
        if slot == Slot::Params && self.zero.stage == 3 {
            for p in &self.pieces {
                self.be.upload(b.slice(p.shard.clone()), &data[p.owned.clone()]);
            }
            self.forget_gathered();
        } else {
            self.be.upload(b, data);
        }
        if let (Slot::Params, Some(work)) = (slot, self.work) {
            Ops::new(&mut *self.be).convert(work, self.params, None);
        }
        Ok(())
    }

    /// Overwrite the parameters from this rank's part of them in the shard layout (llm.c's fp32
    /// master weights in a ZeRO-1 state file); the parts are then all-gathered (a collective)
    /// unless the stage keeps parameters sharded. A bf16 run's working copy is left as it is:
    /// the checkpoint's model file holds it (exact resume).
    pub fn write_param_shard(&mut self, shard: &[f32]) -> Result<()> {
        if self.zero.stage == 0 {
            if shard.len() != self.layout.num_parameters {
                bail!("{} values for the parameters, the model has {}", shard.len(), self.layout.num_parameters);
            }
            self.be.upload(self.params, shard);
            return Ok(());
        }
        if shard.len() != self.zero.shard_len() {
            bail!("{} values for this rank's part of the parameters, expected {}", shard.len(), self.zero.shard_len());
        }
        for p in &self.pieces {
            let own = self.params.slice(if self.zero.stage == 3 { p.shard.clone() } else { p.owned.clone() });
            self.be.upload(own, &shard[p.shard.clone()]);
            if self.zero.stage < 3 {
                self.comm.all_gather(&mut *self.be, own, self.params.slice(p.full.clone()))?;
            }
        }
        self.forget_gathered();
        Ok(())
    }

    /// This rank's part of the parameters in the shard layout ([`Model::write_param_shard`]'s
    /// input): a bf16 run's master weights for its state file.
    pub fn read_param_shard(&mut self) -> Result<Vec<f32>> {
        if self.zero.stage == 0 {
            return self.read_all(Slot::Params);
        }
        let mut out = crate::core::mem::zeroed::<f32>(self.zero.shard_len());
        for p in &self.pieces {
            let own = self.params.slice(if self.zero.stage == 3 { p.shard.clone() } else { p.owned.clone() });
            self.be.download(own, &mut out[p.shard.clone()])?;
        }
        Ok(out)
    }

    /// The parameters as host [`Weights`] (for model files and export): those the passes read
    /// (a bf16 run's working copy, not its master weights); under ZeRO-3 a collective.
    pub fn weights(&mut self) -> Result<Weights> {
        let data = match self.work {
            Some(w) if self.zero.stage == 3 => self.gather_params(w, true)?.expect("kept"),
            Some(w) => {
                let mut out = crate::core::mem::zeroed(w.len);
                self.be.download(w, &mut out)?;
                out
            }
            None => self.read_all(Slot::Params)?,
        };
        Ok(Weights { config: self.config, layout: self.layout.clone(), data })
    }

    /// [`Model::weights`] on rank 0 only (None elsewhere): every rank calls it, only rank 0
    /// holds a host copy (the checkpoint's model file).
    pub fn weights_on_rank0(&mut self) -> Result<Option<Weights>> {
        let rank0 = self.comm.rank() == 0;
        if self.zero.stage == 3 {
            let data = self.gather_params(self.work.unwrap_or(self.params), rank0)?;
            return Ok(data.map(|data| Weights { config: self.config, layout: self.layout.clone(), data }));
        }
        if rank0 {
            self.weights().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Whether the parameters and the AdamW moments are finite on every rank (a collective,
    /// so that all ranks agree to write a checkpoint or not).
    pub fn state_finite(&mut self) -> Result<(bool, bool)> {
        let be = &mut *self.be;
        let finite = |be: &mut dyn Backend, b: Buf| read_host(be, b, |h| h.iter().all(|x| x.is_finite()));
        // A LoRA run's base never changes: its adapters are what could diverge.
        let params = self.lora.as_ref().map_or(self.params, |lo| lo.params);
        let mut bad = [!finite(be, params)? as u8 as f32, 0.0];
        if let Some(tr) = self.train {
            bad[1] = !(finite(be, tr.m)? && finite(be, tr.v)?) as u8 as f32;
        }
        be.upload(self.flags, &bad);
        self.comm.all_reduce(be, self.flags, Reduce::Sum)?;
        be.download(self.flags, &mut bad)?;
        Ok((bad[0] == 0.0, bad[1] == 0.0))
    }
}

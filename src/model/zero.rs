//! ZeRO stages: which part of the parameters, gradients and AdamW state each rank holds, and
//! the optimizer step that follows from it.
//!
//! As llm.c (`-z`): every piece, one layer's slice of one of the model's tensors (the whole
//! tensor for those outside the blocks: the embeddings, an untied head, the final norm), is cut
//! into `world` equal parts, and rank r owns part r of every piece. Its AdamW state is laid out
//! tensor by tensor, each tensor's layers one after another, so it is `num_parameters / world`
//! long and a state file interchanges with llm.c's ZeRO-1.
//!
//! - stage 0: every rank holds everything; gradients are all-reduced.
//! - stage 1: AdamW m and v sharded; gradients reduce-scattered after backward into the owned
//!   parts of the full gradient buffer; each rank updates its parts, then all-gathers them.
//! - stage 2: gradients sharded too: backward writes into a bucket (one block, or the tensors
//!   outside the blocks), reduce-scattered into the shard as soon as the block is done.
//! - stage 3: parameters sharded too: a block's weights are all-gathered into a buffer just
//!   before the block runs (forward and backward), the tensors outside the blocks once per pass.

use crate::backend::comm::{Collectives, Reduce};
use crate::backend::ops::Ops;
use crate::backend::{AdamWParams, Backend, Buf};
use crate::core::config::ModelConfig;
use crate::core::params::{ParamLayout, TensorId, View};
use anyhow::{bail, Result};
use std::ops::Range;

/// One piece: a layer's slice of a tensor, with this rank's part of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: TensorId,
    pub layer: usize,
    /// The whole piece, in the full layout.
    pub full: Range<usize>,
    /// This rank's part, in the full layout.
    pub owned: Range<usize>,
    /// This rank's part, in the shard layout (num_parameters / world).
    pub shard: Range<usize>,
}

/// How a run's state is split over its ranks.
#[derive(Clone, Debug)]
pub struct Sharding {
    pub stage: usize,
    pub rank: usize,
    pub world: usize,
    pub layout: ParamLayout,
    pub config: ModelConfig,
}

/// The buffers of an optimizer step, each as this rank holds it.
#[derive(Clone, Copy, Debug)]
pub struct StepBufs {
    pub params: Buf,
    pub grads: Buf,
    pub m: Buf,
    pub v: Buf,
    /// [the step's loss, the squared gradient norm].
    pub stats: Buf, // (2)
    /// The bf16 working copy of f32 params, which stages 0 and 3 write in AdamW's pass
    /// (stages 1 and 2 leave it to the caller, after the gather).
    pub work: Option<Buf>,
}

impl Sharding {
    /// Stage `stage` over `world` ranks; every piece must split evenly, as in llm.c.
    pub fn new(stage: usize, rank: usize, world: usize, config: ModelConfig) -> Result<Self> {
        if stage > 3 {
            bail!("-z {stage}: ZeRO stages are 0 (none), 1 (AdamW state), 2 (+ gradients) and 3 (+ parameters)");
        }
        // One rank has nothing to shard: every stage is stage 0.
        let stage = if world <= 1 { 0 } else { stage };
        let layout = crate::models::layout(&config);
        if stage > 0 {
            if let Some(t) = layout.ids().find(|&t| !layout.spec(t).numel_per_layer().is_multiple_of(world)) {
                bail!(
                    "-z {stage} with {world} processes: tensor {} has {} values per layer, not a multiple of {world}; \
                     use a number of processes that divides the channel count C={} (or -z 0)",
                    layout.spec(t).name,
                    layout.spec(t).numel_per_layer(),
                    config.channels
                );
            }
        }
        Ok(Sharding { stage, rank, world, layout, config })
    }

    /// Values of each sharded buffer (num_parameters / world).
    pub fn shard_len(&self) -> usize {
        self.layout.num_parameters / self.world
    }

    /// Length of the buffer that holds what is sharded at `from_stage` and above.
    pub fn len_at(&self, from_stage: usize) -> usize {
        if self.stage >= from_stage {
            self.shard_len()
        } else {
            self.layout.num_parameters
        }
    }

    /// The lengths of the pieces, in order, of the buffer that holds what is sharded at
    /// `from_stage` and above ([`Sharding::len_at`]): the parts of its allocation.
    pub fn parts_at(&self, from_stage: usize) -> Vec<usize> {
        let sharded = self.stage >= from_stage;
        self.pieces().iter().map(|p| if sharded { p.shard.len() } else { p.full.len() }).collect()
    }

    /// Every piece, tensor by tensor in the family's file order, layers in order within each
    /// (the tensors the model has: none of an empty one).
    pub fn pieces(&self) -> Vec<Piece> {
        let lay = &self.layout;
        lay.ids()
            .filter(|&t| lay.spec(t).numel_per_layer() > 0)
            .flat_map(|t| lay.layers(t).map(move |l| (t, l)))
            .map(|(t, l)| self.piece(t, l))
            .collect()
    }

    /// Layer `l` of tensor `t` (l = 0 for the tensors outside the blocks).
    pub fn piece(&self, t: TensorId, l: usize) -> Piece {
        let full = self.layout.layer(t, l);
        let part = full.len() / self.world;
        let owned = full.start + self.rank * part..full.start + (self.rank + 1) * part;
        // Tensors before t hold start/world shard values each; then l parts of this one.
        let start = self.layout.range(t).start / self.world + l * part;
        Piece { tensor: t, layer: l, full, owned, shard: start..start + part }
    }

    /// The lengths of the outer bucket's tensors, then of a one-block bucket's: the parts of
    /// an allocation that holds both, outer bucket first.
    pub fn bucket_parts(&self) -> Vec<usize> {
        let lay = &self.layout;
        let outer = lay.outer_ids().into_iter().map(|t| lay.range(t).len());
        outer.chain(lay.block_ids().into_iter().map(|t| lay.layer(t, 0).len())).collect()
    }

    /// Where each of a block's tensors sits in a one-block bucket (empty for the others), and
    /// its length.
    pub fn block_bucket(&self) -> (View<Range<usize>>, usize) {
        self.bucket(|t| if self.layout.spec(t).per_layer { self.layout.layer(t, 0).len() } else { 0 })
    }

    /// Where each tensor outside the blocks sits in the outer bucket (empty for the others),
    /// and its length.
    pub fn outer_bucket(&self) -> (View<Range<usize>>, usize) {
        self.bucket(|t| if self.layout.spec(t).per_layer { 0 } else { self.layout.range(t).len() })
    }

    fn bucket(&self, len: impl Fn(TensorId) -> usize) -> (View<Range<usize>>, usize) {
        let mut off = 0;
        let v = self
            .layout
            .ids()
            .map(|t| {
                off += len(t);
                off - len(t)..off
            })
            .collect();
        (View(v), off)
    }

    /// The optimizer step, queued without waiting on the host: average the gradients and the
    /// loss over the ranks, take the global gradient norm, then clip and apply AdamW (with
    /// `hyper` for each tensor) to everything (stage 0), or to this rank's parts, which are then
    /// all-gathered (stages 1-2) or stay sharded (stage 3).
    pub fn update(
        &self,
        be: &mut dyn Backend,
        comm: &mut dyn Collectives,
        b: StepBufs,
        hyper: impl Fn(TensorId) -> AdamWParams,
    ) -> Result<()> {
        let (stage, norm) = (self.stage, b.stats.slice(1..2));
        let pieces = self.pieces();
        comm.all_reduce(be, b.stats.prefix(1), Reduce::Mean)?;
        match stage {
            0 => {
                comm.all_reduce(be, b.grads, Reduce::Mean)?;
                Ops::new(be).global_norm_squared(norm, b.grads, false);
            }
            1 => {
                for (i, p) in pieces.iter().enumerate() {
                    let own = b.grads.slice(p.owned.clone());
                    comm.reduce_scatter(be, b.grads.slice(p.full.clone()), own, Reduce::Mean, false)?;
                    Ops::new(be).global_norm_squared(norm, own, i > 0);
                }
                comm.all_reduce(be, norm, Reduce::Sum)?;
            }
            _ => {
                Ops::new(be).global_norm_squared(norm, b.grads, false);
                comm.all_reduce(be, norm, Reduce::Sum)?;
            }
        }
        if stage == 0 {
            for t in self.layout.ids().filter(|&t| self.layout.spec(t).numel_per_layer() > 0) {
                let r = self.layout.range(t);
                let slice = |x: Buf| x.slice(r.clone());
                let (p, g, m, v, h) = (slice(b.params), slice(b.grads), slice(b.m), slice(b.v), hyper(t));
                match b.work {
                    Some(w) => Ops::new(be).adamw_update_and_copy(p, slice(w), g, m, v, b.stats, &h),
                    None => Ops::new(be).adamw_update(p, g, m, v, b.stats, &h),
                }
            }
            return Ok(());
        }
        for pc in &pieces {
            let p = b.params.slice(if stage == 3 { pc.shard.clone() } else { pc.owned.clone() });
            let g = b.grads.slice(if stage >= 2 { pc.shard.clone() } else { pc.owned.clone() });
            let (m, v) = (b.m.slice(pc.shard.clone()), b.v.slice(pc.shard.clone()));
            let mut h = hyper(pc.tensor);
            if stage == 3 {
                // A shard rounds (bf16 parameters, the working copy) with the noise of its
                // place in the whole parameters: the bits of one process.
                h.place = Some(pc.owned.start as u64);
            }
            match b.work {
                Some(w) if stage == 3 => {
                    Ops::new(be).adamw_update_and_copy(p, w.slice(pc.shard.clone()), g, m, v, b.stats, &h)
                }
                _ => Ops::new(be).adamw_update(p, g, m, v, b.stats, &h),
            }
        }
        if stage < 3 {
            for pc in &pieces {
                comm.all_gather(be, b.params.slice(pc.owned.clone()), b.params.slice(pc.full.clone()))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_parts_tile_every_piece_and_the_shards_tile_the_shard_buffer() {
        let cfg =
            ModelConfig { vocab_size: 60, padded_vocab_size: 64, ..ModelConfig::from_descriptor("3x8:2:12").unwrap() };
        for world in [1, 2, 4] {
            let mut covered = vec![0u8; crate::models::layout(&cfg).num_parameters];
            for rank in 0..world {
                let s = Sharding::new(1, rank, world, cfg).unwrap();
                let mut next = 0;
                for p in s.pieces() {
                    assert_eq!(p.shard.start, next, "rank {rank}: the shard layout is dense and in order");
                    next = p.shard.end;
                    assert_eq!(p.owned.len(), p.shard.len());
                    assert_eq!(p.owned.start - p.full.start, rank * p.full.len() / world);
                    covered[p.owned].iter_mut().for_each(|c| *c += 1);
                }
                assert_eq!(next, s.shard_len());
            }
            assert!(covered.iter().all(|&c| c == 1), "world {world}: every parameter owned exactly once");
        }
        let e = Sharding::new(2, 0, 3, cfg).unwrap_err().to_string();
        assert!(e.contains("not a multiple of 3") && e.contains("-z 0"), "{e}");
        assert_eq!(Sharding::new(3, 0, 1, cfg).unwrap().stage, 0, "one rank shards nothing");
        assert!(Sharding::new(4, 0, 2, cfg).is_err());
    }
}

//! ZeRO stages: which part of the parameters, gradients and AdamW state each rank holds.
//!
//! As llm.c (`-z`): every piece, one layer's slice of one of the model's tensors (the whole
//! tensor for those outside the blocks: wte, wpe, an untied head, the final norm), is cut into `world` equal parts, and rank r owns part r of every
//! piece. Its AdamW state is laid out tensor by tensor, each tensor's layers one after another,
//! so it is `num_parameters / world` long and a state file interchanges with llm.c's ZeRO-1.
//!
//! - stage 0: every rank holds everything; gradients are all-reduced.
//! - stage 1: AdamW m and v sharded; gradients reduce-scattered after backward into the owned
//!   parts of the full gradient buffer; each rank updates its parts, then all-gathers them.
//! - stage 2: gradients sharded too: backward writes into a bucket (one block, or the embedding
//!   tensors outside the blocks), reduce-scattered into the shard as soon as the block is done.
//! - stage 3: parameters sharded too: a block's weights are all-gathered into a buffer just
//!   before the block runs (forward and backward), the embedding tensors once per pass.

use crate::config::ModelConfig;
use crate::params::{Block, ParamLayout, Tensor, OUTER};
use anyhow::{bail, Result};
use std::ops::Range;

/// One piece: a layer's slice of a tensor, with this rank's part of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: Tensor,
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

impl Sharding {
    /// Stage `stage` over `world` ranks; every piece must split evenly, as in llm.c.
    pub fn new(stage: usize, rank: usize, world: usize, config: ModelConfig) -> Result<Self> {
        if stage > 3 {
            bail!("-z {stage}: ZeRO stages are 0 (none), 1 (AdamW state), 2 (+ gradients) and 3 (+ parameters)");
        }
        // One rank has nothing to shard: every stage is stage 0.
        let stage = if world <= 1 { 0 } else { stage };
        if stage > 0 {
            if let Some(t) = Tensor::ALL.into_iter().find(|t| !t.numel_per_layer(&config).is_multiple_of(world)) {
                bail!(
                    "-z {stage} with {world} processes: tensor {} has {} values per layer, not a multiple of {world}; \
                     use a number of processes that divides the channel count C={} (or -z 0)",
                    t.name(),
                    t.numel_per_layer(&config),
                    config.channels
                );
            }
        }
        Ok(Sharding { stage, rank, world, layout: ParamLayout::new(&config), config })
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

    /// Every piece, tensor by tensor in llm.c's order, layers in order within each (the
    /// tensors the model has).
    pub fn pieces(&self) -> Vec<Piece> {
        crate::params::tensors(&self.config)
            .into_iter()
            .flat_map(|t| self.layers(t).map(move |l| (t, l)))
            .map(|(t, l)| self.piece(t, l))
            .collect()
    }

    fn layers(&self, t: Tensor) -> Range<usize> {
        0..if t.per_layer() { self.config.num_layers } else { 1 }
    }

    /// Layer `l` of tensor `t` (l = 0 for the tensors outside the blocks).
    pub fn piece(&self, t: Tensor, l: usize) -> Piece {
        let full = self.layout.layer(t, l);
        let part = full.len() / self.world;
        let owned = full.start + self.rank * part..full.start + (self.rank + 1) * part;
        // Tensors before t hold start/world shard values each; then l parts of this one.
        let start = self.layout.range(t).start / self.world + l * part;
        Piece { tensor: t, layer: l, full, owned, shard: start..start + part }
    }

    /// The lengths of the embedding bucket's tensors, then of a one-block bucket's: the parts
    /// of an allocation that holds both, embedding bucket first.
    pub fn bucket_parts(&self) -> Vec<usize> {
        let block = self.layout.block(0).map(|r| r.len());
        let embed = self.embed_bucket().0.map(|r| r.len());
        embed.into_iter().chain(Tensor::BLOCK.iter().map(|&t| block.get(t))).collect()
    }

    /// Where each of a block's tensors sits in a one-block bucket, and its length.
    pub fn block_bucket(&self) -> (Block<Range<usize>>, usize) {
        let mut off = 0;
        let block = self.layout.block(0).map(|r| {
            off += r.len();
            off - r.len()..off
        });
        (block, off)
    }

    /// Where each of [`OUTER`] sits in the embedding bucket (empty where the model lacks
    /// it), and its length.
    pub fn embed_bucket(&self) -> ([Range<usize>; OUTER.len()], usize) {
        let mut off = 0;
        let r = OUTER.map(|t| {
            let n = self.layout.range(t).len();
            off += n;
            off - n..off
        });
        (r, off)
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
            let mut covered = vec![0u8; ParamLayout::new(&cfg).num_parameters];
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

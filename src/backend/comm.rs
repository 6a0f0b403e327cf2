//! Collectives between the processes (ranks) of a data-parallel run: the interface the training
//! step calls, a single-process implementation, and in-process ranks on threads.
//!
//! The step all-reduces the gradients and the loss after backward; ZeRO stages will
//! reduce-scatter gradients and all-gather parameters by [`shard`]. MPI (CPU) and NCCL (CUDA)
//! implement the same trait; with one process every collective is the identity.

use super::{Backend, Buf};
use anyhow::{bail, Result};
use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};

/// How values from the ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The sum divided by the number of ranks.
    Mean,
}

/// The elements of a buffer of `len` that rank `rank` of `world` owns in a reduce-scatter or
/// all-gather: equal parts of `ceil(len / world)`, the last ones shorter (possibly empty).
pub fn shard(len: usize, rank: usize, world: usize) -> Range<usize> {
    let per = len.div_ceil(world.max(1));
    (rank * per).min(len)..((rank + 1) * per).min(len)
}

/// The processes of a run, as each one sees them.
pub trait Collectives: Send {
    /// This process's index, 0..world.
    fn rank(&self) -> usize;
    /// Number of processes.
    fn world(&self) -> usize;
    /// buf = the reduction of buf over all ranks, in place, identical on every rank.
    fn all_reduce(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()>;
    /// This rank's [`shard`] of buf = the reduction of that shard over all ranks; the rest of
    /// buf is left undefined.
    fn reduce_scatter(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()>;
    /// Every rank's [`shard`] of buf, from the rank that owns it, to every rank.
    fn all_gather(&mut self, be: &mut dyn Backend, buf: Buf) -> Result<()>;
    /// Wait until every rank has got here.
    fn barrier(&mut self) -> Result<()>;
}

/// One process: rank 0 of 1, every collective the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl Collectives for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, _: &mut dyn Backend, _: Buf, _: Reduce) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter(&mut self, _: &mut dyn Backend, _: Buf, _: Reduce) -> Result<()> {
        Ok(())
    }
    fn all_gather(&mut self, _: &mut dyn Backend, _: Buf) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Ranks that are threads of one process, exchanging through host memory: for testing the
/// data-parallel logic on one machine without MPI. Every rank must make the same collective
/// calls in the same order (a rank that stops calling leaves the others waiting, as with MPI).
pub struct LocalRank {
    rank: usize,
    group: Arc<LocalGroup>,
}

struct LocalGroup {
    world: usize,
    barrier: Barrier,
    /// Each rank's contribution to the collective in progress.
    slots: Mutex<Vec<Vec<f32>>>,
}

/// `world` ranks on threads: give one to each thread.
pub fn local_group(world: usize) -> Vec<LocalRank> {
    let group = Arc::new(LocalGroup { world, barrier: Barrier::new(world), slots: Mutex::new(vec![vec![]; world]) });
    (0..world).map(|rank| LocalRank { rank, group: group.clone() }).collect()
}

impl LocalRank {
    /// Post `mine`, wait for everyone's, and return `f` of all of them (in rank order).
    fn exchange<R>(&self, mine: Vec<f32>, f: impl FnOnce(&[Vec<f32>]) -> R) -> Result<R> {
        self.group.slots.lock().map_err(|_| anyhow::anyhow!("a rank failed"))?[self.rank] = mine;
        self.group.barrier.wait();
        let r = f(&self.group.slots.lock().map_err(|_| anyhow::anyhow!("a rank failed"))?);
        // Nobody may post the next collective's data before everyone has read this one's.
        self.group.barrier.wait();
        Ok(r)
    }

    fn reduce(&self, all: &[Vec<f32>], range: Range<usize>, op: Reduce) -> Result<Vec<f32>> {
        if all.iter().any(|v| v.len() != all[self.rank].len()) {
            bail!("ranks passed buffers of different lengths to a collective");
        }
        // The same order on every rank, so every rank gets the same bits.
        let mut out = vec![0f32; range.len()];
        for v in all {
            out.iter_mut().zip(&v[range.clone()]).for_each(|(o, x)| *o += x);
        }
        if op == Reduce::Mean {
            let w = self.group.world as f32;
            out.iter_mut().for_each(|o| *o /= w);
        }
        Ok(out)
    }
}

impl Collectives for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.group.world
    }
    fn all_reduce(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()> {
        let mut host = vec![0f32; buf.len];
        be.download(buf, &mut host)?;
        let out = self.exchange(host, |all| self.reduce(all, 0..buf.len, op))??;
        be.upload(buf, &out);
        Ok(())
    }
    fn reduce_scatter(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()> {
        let mut host = vec![0f32; buf.len];
        be.download(buf, &mut host)?;
        let mine = shard(buf.len, self.rank, self.group.world);
        let out = self.exchange(host, |all| self.reduce(all, mine.clone(), op))??;
        be.upload(buf.slice(mine), &out);
        Ok(())
    }
    fn all_gather(&mut self, be: &mut dyn Backend, buf: Buf) -> Result<()> {
        let mut host = vec![0f32; buf.len];
        be.download(buf, &mut host)?;
        let world = self.group.world;
        let out = self.exchange(host, |all| {
            let mut out = vec![0f32; buf.len];
            for (r, v) in all.iter().enumerate() {
                let s = shard(buf.len, r, world);
                out[s.clone()].copy_from_slice(&v[s]);
            }
            out
        })?;
        be.upload(buf, &out);
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        self.group.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DType;
    use crate::cpu::backend::CpuBackend;

    #[test]
    fn shards_tile_the_buffer() {
        for (len, world) in [(10, 3), (1, 4), (0, 2), (12, 4), (7, 1)] {
            let mut next = 0;
            for r in 0..world {
                let s = shard(len, r, world);
                assert_eq!(s.start, next.min(len), "len {len} world {world} rank {r}");
                next = s.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn local_ranks_reduce_scatter_and_gather_like_one_buffer() {
        let world = 3;
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = local_group(world)
                .into_iter()
                .map(|mut comm| {
                    s.spawn(move || {
                        let mut be = CpuBackend::new(false);
                        let buf = be.alloc(7, DType::F32).unwrap();
                        let r = comm.rank() as f32;
                        let mine: Vec<f32> = (0..7).map(|i| r * 10.0 + i as f32).collect();
                        let mut out = vec![];
                        let read = |be: &mut CpuBackend| {
                            let mut h = vec![0f32; 7];
                            be.download(buf, &mut h).unwrap();
                            h
                        };
                        be.upload(buf, &mine);
                        comm.all_reduce(&mut be, buf, Reduce::Sum).unwrap();
                        out.push(read(&mut be));
                        be.upload(buf, &mine);
                        comm.all_reduce(&mut be, buf, Reduce::Mean).unwrap();
                        out.push(read(&mut be));
                        be.upload(buf, &mine);
                        comm.reduce_scatter(&mut be, buf, Reduce::Sum).unwrap();
                        let s = shard(7, comm.rank(), world);
                        out.push(read(&mut be)[s].to_vec());
                        be.upload(buf, &mine);
                        comm.all_gather(&mut be, buf).unwrap();
                        out.push(read(&mut be));
                        comm.barrier().unwrap();
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let sum: Vec<f32> = (0..7).map(|i| 30.0 + 3.0 * i as f32).collect();
        for (r, res) in results.iter().enumerate() {
            assert_eq!(res[0], sum, "all-reduce sum on rank {r}");
            assert_eq!(res[1], sum.iter().map(|x| x / 3.0).collect::<Vec<_>>(), "mean on rank {r}");
            assert_eq!(res[2], sum[shard(7, r, world)].to_vec(), "reduce-scatter on rank {r}");
            // Shards of 3: rank 0 owns 0..3, rank 1 3..6, rank 2 6..7.
            let gathered: Vec<f32> = (0..7).map(|i| (i / 3) as f32 * 10.0 + i as f32).collect();
            assert_eq!(res[3], gathered, "all-gather on rank {r}");
        }
    }
}

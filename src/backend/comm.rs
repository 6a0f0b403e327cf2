//! Collectives between the processes (ranks) of a data-parallel run: the interface the training
//! step calls, a single-process implementation, in-process ranks on threads (tests), and the
//! choice of one at start-up ([`open`]: MPI when launched by `mpirun`, see [`super::mpi`]).
//!
//! Stage 0 all-reduces the gradients; ZeRO stages reduce-scatter gradients into this rank's
//! [`shard`] and all-gather parameters from every rank's shard (see [`crate::model::zero`]). MPI
//! implements the trait for the CPU; a GPU backend's NCCL will implement the same trait. With one
//! process every collective is the identity.

use super::{Backend, Buf};
use anyhow::{bail, Result};
use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

/// How values from the ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The sum divided by the number of ranks.
    Mean,
}

/// The elements of a buffer of `len` that rank `rank` of `world` owns in a reduce-scatter or
/// all-gather: part `rank` of `world` equal parts. `len` must be a multiple of `world`
/// ([`crate::model::zero`] checks every sharded tensor up front).
pub fn shard(len: usize, rank: usize, world: usize) -> Range<usize> {
    let per = len / world.max(1);
    rank * per..(rank + 1) * per
}

/// The processes of a run, as each one sees them. Every rank makes the same calls with the
/// same lengths in the same order, or the run stops (a dead or stuck rank ends the job with an
/// error, see [`super::mpi`]).
pub trait Collectives: Send {
    /// This process's index, 0..world.
    fn rank(&self) -> usize;
    /// Number of processes.
    fn world(&self) -> usize;
    /// Number of ranks on this machine (this one included), for sizing thread teams.
    fn local_world(&self) -> usize {
        self.world()
    }
    /// buf = the reduction of buf over all ranks, in place, identical on every rank.
    fn all_reduce(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()>;
    /// dst (src.len / world) = the reduction over all ranks of shard `rank` of src (src.len a
    /// multiple of world), or dst += it with `accumulate`. dst may be src's own shard (in place,
    /// as NCCL allows) and must not otherwise overlap src.
    fn reduce_scatter(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf, op: Reduce, accumulate: bool) -> Result<()>;
    /// dst (world * src.len) = every rank's src, in rank order. src may be dst's shard `rank`
    /// (in place) and must not otherwise overlap dst.
    fn all_gather(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf) -> Result<()>;
    /// Wait until every rank has got here.
    fn barrier(&mut self) -> Result<()>;
    /// Wall-clock seconds spent in collectives so far (`llmrs bench`, the log).
    fn seconds(&self) -> f64;
}

/// Check the lengths of a reduce-scatter or all-gather between a full buffer and a shard.
pub(crate) fn check_shard_lens(what: &str, full: Buf, part: Buf, world: usize) -> Result<()> {
    if !full.len.is_multiple_of(world.max(1)) || part.len * world != full.len {
        bail!("{what}: {} elements cannot be split into {world} shards of {}", full.len, part.len);
    }
    Ok(())
}

/// Run `f` on the elements of an f32 buffer as host memory: in place where the backend's memory
/// is the host's, else through a download and an upload.
pub(crate) fn with_host<R>(be: &mut dyn Backend, buf: Buf, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    be.synchronize()?;
    if let Some(s) = be.host_f32(buf) {
        return Ok(f(s));
    }
    let mut h = vec![0f32; buf.len];
    be.download(buf, &mut h)?;
    let r = f(&mut h);
    be.upload(buf, &h);
    Ok(r)
}

/// f of an f32 buffer's elements on the host, read only: in place on the CPU, else a copy
/// (nothing is written back).
pub(crate) fn read_host<R>(be: &mut dyn Backend, buf: Buf, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    be.synchronize()?;
    if let Some(s) = be.host_f32(buf) {
        return Ok(f(s));
    }
    let mut h = crate::core::mem::zeroed(buf.len);
    be.download(buf, &mut h)?;
    Ok(f(&h))
}

/// A host copy of an f32 buffer.
pub(crate) fn host_copy(be: &mut dyn Backend, buf: Buf, out: &mut Vec<f32>) -> Result<()> {
    out.resize(buf.len, 0.0);
    be.download(buf, out)
}

/// dst (=|+=) vals, on the host side of the backend.
pub(crate) fn store(be: &mut dyn Backend, dst: Buf, vals: &[f32], accumulate: bool) -> Result<()> {
    if !accumulate {
        be.upload(dst, vals);
        return Ok(());
    }
    with_host(be, dst, |d| d.iter_mut().zip(vals).for_each(|(d, v)| *d += v))
}

/// Accumulated wall-clock time of collectives.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CommClock(f64);

impl CommClock {
    pub(crate) fn time<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        self.0 += t0.elapsed().as_secs_f64();
        r
    }
    pub(crate) fn seconds(&self) -> f64 {
        self.0
    }
}

/// One process: rank 0 of 1, every collective the identity (a copy where dst is not src).
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
    fn reduce_scatter(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf, _: Reduce, accumulate: bool) -> Result<()> {
        check_shard_lens("reduce_scatter", src, dst, 1)?;
        if src == dst && !accumulate {
            return Ok(());
        }
        let mut h = vec![];
        host_copy(be, src, &mut h)?;
        store(be, dst, &h, accumulate)
    }
    fn all_gather(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf) -> Result<()> {
        check_shard_lens("all_gather", dst, src, 1)?;
        if src != dst {
            let mut h = vec![];
            host_copy(be, src, &mut h)?;
            be.upload(dst, &h);
        }
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
    fn seconds(&self) -> f64 {
        0.0
    }
}

/// Ranks that are threads of one process, exchanging through host memory: for testing the
/// data-parallel logic on one machine without MPI. Every rank must make the same collective
/// calls in the same order (a rank that stops calling leaves the others waiting, as with MPI).
pub struct LocalRank {
    rank: usize,
    group: Arc<LocalGroup>,
    clock: CommClock,
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
    (0..world).map(|rank| LocalRank { rank, group: group.clone(), clock: CommClock::default() }).collect()
}

impl LocalRank {
    /// Post `mine`, wait for everyone's, and return `f` of all of them (in rank order).
    fn exchange<R>(&self, mine: Vec<f32>, f: impl FnOnce(&[Vec<f32>]) -> R) -> Result<R> {
        let lock = || self.group.slots.lock().map_err(|_| anyhow::anyhow!("a rank failed"));
        lock()?[self.rank] = mine;
        self.group.barrier.wait();
        let all = lock()?;
        let r = if all.iter().any(|v| v.len() != all[self.rank].len()) {
            Err(anyhow::anyhow!("ranks passed buffers of different lengths to a collective"))
        } else {
            Ok(f(&all))
        };
        drop(all);
        // Nobody may post the next collective's data before everyone has read this one's.
        self.group.barrier.wait();
        r
    }

    /// The reduction of elements `range` over all ranks, summed in rank order on every rank
    /// (so every rank gets the same bits).
    fn reduce(&self, all: &[Vec<f32>], range: Range<usize>, op: Reduce) -> Vec<f32> {
        let mut out = vec![0f32; range.len()];
        for v in all {
            out.iter_mut().zip(&v[range.clone()]).for_each(|(o, x)| *o += x);
        }
        if op == Reduce::Mean {
            let w = self.group.world as f32;
            out.iter_mut().for_each(|o| *o /= w);
        }
        out
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
        let mut clock = self.clock;
        let r = clock.time(|| {
            let mut host = vec![];
            host_copy(be, buf, &mut host)?;
            let out = self.exchange(host, |all| self.reduce(all, 0..buf.len, op))?;
            be.upload(buf, &out);
            Ok(())
        });
        self.clock = clock;
        r
    }
    fn reduce_scatter(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf, op: Reduce, accumulate: bool) -> Result<()> {
        check_shard_lens("reduce_scatter", src, dst, self.group.world)?;
        let mut clock = self.clock;
        let r = clock.time(|| {
            let mut host = vec![];
            host_copy(be, src, &mut host)?;
            let mine = shard(src.len, self.rank, self.group.world);
            let out = self.exchange(host, |all| self.reduce(all, mine, op))?;
            store(be, dst, &out, accumulate)
        });
        self.clock = clock;
        r
    }
    fn all_gather(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf) -> Result<()> {
        check_shard_lens("all_gather", dst, src, self.group.world)?;
        let mut clock = self.clock;
        let r = clock.time(|| {
            let mut host = vec![];
            host_copy(be, src, &mut host)?;
            let out = self.exchange(host, |all| all.concat())?;
            be.upload(dst, &out);
            Ok(())
        });
        self.clock = clock;
        r
    }
    fn barrier(&mut self) -> Result<()> {
        self.group.barrier.wait();
        Ok(())
    }
    fn seconds(&self) -> f64 {
        self.clock.seconds()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::backend::CpuBackend;
    use crate::backend::DType;

    #[test]
    fn shards_tile_the_buffer() {
        for (len, world) in [(12, 3), (4, 4), (0, 2), (12, 4), (7, 1)] {
            let mut next = 0;
            for r in 0..world {
                let s = shard(len, r, world);
                assert_eq!((s.start, s.len()), (next, len / world), "len {len} world {world} rank {r}");
                next = s.end;
            }
            assert_eq!(next, len);
        }
    }

    /// Every collective on 3 thread ranks, out of place and in place, against the same
    /// arithmetic on one buffer; and the single process's identities.
    #[test]
    fn local_ranks_reduce_scatter_and_gather_like_one_buffer() {
        let (world, n) = (3, 9);
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = local_group(world)
                .into_iter()
                .map(|mut comm| {
                    s.spawn(move || {
                        let mut be = CpuBackend::new(false);
                        let buf = be.alloc(n, DType::F32).unwrap();
                        let part = be.alloc(n / world, DType::F32).unwrap();
                        let r = comm.rank() as f32;
                        let mine: Vec<f32> = (0..n).map(|i| r * 10.0 + i as f32).collect();
                        let mut out = vec![];
                        let mut read = |be: &mut CpuBackend, b: Buf| {
                            let mut h = vec![0f32; b.len];
                            be.download(b, &mut h).unwrap();
                            out.push(h);
                        };
                        be.upload(buf, &mine);
                        comm.all_reduce(&mut be, buf, Reduce::Sum).unwrap();
                        read(&mut be, buf);
                        be.upload(buf, &mine);
                        comm.all_reduce(&mut be, buf, Reduce::Mean).unwrap();
                        read(&mut be, buf);
                        // Out of place, then accumulated onto it, then in place.
                        be.upload(buf, &mine);
                        comm.reduce_scatter(&mut be, buf, part, Reduce::Sum, false).unwrap();
                        comm.reduce_scatter(&mut be, buf, part, Reduce::Sum, true).unwrap();
                        read(&mut be, part);
                        let own = buf.slice(shard(n, comm.rank(), world));
                        comm.reduce_scatter(&mut be, buf, own, Reduce::Sum, false).unwrap();
                        read(&mut be, own);
                        be.upload(buf, &mine);
                        comm.all_gather(&mut be, own, buf).unwrap();
                        read(&mut be, buf);
                        comm.barrier().unwrap();
                        assert!(comm.seconds() > 0.0);
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let sum: Vec<f32> = (0..n).map(|i| 30.0 + 3.0 * i as f32).collect();
        for (r, res) in results.iter().enumerate() {
            let s = shard(n, r, world);
            assert_eq!(res[0], sum, "all-reduce sum on rank {r}");
            assert_eq!(res[1], sum.iter().map(|x| x / 3.0).collect::<Vec<_>>(), "mean on rank {r}");
            assert_eq!(res[2], sum[s.clone()].iter().map(|x| 2.0 * x).collect::<Vec<_>>(), "accumulated on rank {r}");
            assert_eq!(res[3], sum[s].to_vec(), "in-place reduce-scatter on rank {r}");
            // Shards of 3: rank q owns 3q..3q+3, holding q*10 + i.
            let gathered: Vec<f32> = (0..n).map(|i| (i / 3) as f32 * 10.0 + i as f32).collect();
            assert_eq!(res[4], gathered, "all-gather on rank {r}");
        }
        // One process: the identities, and copies where dst is another buffer.
        let mut be = CpuBackend::new(false);
        let (a, b) = (be.alloc(4, DType::F32).unwrap(), be.alloc(4, DType::F32).unwrap());
        be.upload(a, &[1.0, 2.0, 3.0, 4.0]);
        be.fill(b, 1.0);
        let mut one = SingleProcess;
        one.reduce_scatter(&mut be, a, b, Reduce::Mean, true).unwrap();
        let mut h = vec![0f32; 4];
        be.download(b, &mut h).unwrap();
        assert_eq!(h, [2.0, 3.0, 4.0, 5.0]);
        assert!(one.reduce_scatter(&mut be, a, b.prefix(3), Reduce::Sum, false).is_err(), "wrong shard length");
    }
}

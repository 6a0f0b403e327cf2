//! Collectives over MPI (the `mpi` feature; Open MPI from `libopenmpi-dev`): one process per
//! rank, launched by `mpirun -np N llmrs train ...` on one machine or several (a hostfile).
//!
//! Buffers whose memory the host can address (the CPU backend) are handed to MPI in place;
//! others go through host copies. The extra host memory is bounded: two staging buffers, kept
//! for the run, each at most [`CHUNK`] values (an all-reduce goes in chunks) or one shard of the
//! largest buffer a reduce-scatter or all-gather is given (a part of wte).
//!
//! A rank that dies makes `mpirun` end the others. A rank that hangs (stopped, deadlocked,
//! lost) would leave the others blocked in a collective forever, so a watchdog thread ends this
//! process with an error when one collective has waited longer than the timeout
//! (`--comm-timeout`); `mpirun` then ends the rest. A rank that fails with an error prints it
//! and exits without finalizing MPI ([`finalize`] runs only after success), which makes
//! `mpirun` end the rest at once; finalizing would wait for the other ranks, which wait in a
//! collective. Checkpoints are written whole or not at all (see [`crate::train`]), so the
//! newest complete one survives either way.
//!
//! MPI is initialized on the main thread and finalized there ([`finalize`]); in between, the
//! command runs on a worker of the thread pool, which `Threading::Serialized` allows.

use super::comm::{check_shard_lens, store, with_host, Collectives, CommClock, Reduce};
use super::{Backend, Buf};
use anyhow::{bail, Result};
use mpi::collective::SystemOperation;
use mpi::environment::{Threading, Universe};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Values per all-reduce call (4 MiB of f32): bounds the host copy of the send side.
const CHUNK: usize = 1 << 20;

/// The MPI environment, whose drop is MPI_Finalize: held here, not by a [`MpiComm`], so that
/// it is dropped on the main thread and only after success ([`finalize`]).
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

/// Finalize MPI if it was initialized: call on the main thread after the command succeeded.
pub fn finalize() {
    let u = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(u);
}

pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    local: usize,
    clock: CommClock,
    send: Vec<f32>,
    recv: Vec<f32>,
    watch: Arc<Watchdog>,
}

// SAFETY: MPI is initialized with MPI_THREAD_SERIALIZED or better (checked in `init`), so any
// one thread at a time may call it (the value moves from the main thread, which initialized
// MPI, to the pool worker that runs the command). Every call goes through `&mut self` or
// `&self` of this one value, which is not Sync (its MPI handles are raw pointers), so calls
// never overlap. The watchdog thread makes no MPI call; MPI_Finalize runs on the main thread
// after this value is gone ([`finalize`]).
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initialize MPI (once per process, on the main thread) and start the watchdog.
    pub fn init(timeout: Duration) -> Result<MpiComm> {
        let Some((universe, provided)) = mpi::initialize_with_threading(Threading::Serialized) else {
            bail!("MPI was already initialized in this process");
        };
        if provided < Threading::Serialized {
            bail!(
                "this MPI library gives thread level {provided:?}; llmrs needs Serialized (Open MPI 4 or newer has it)"
            );
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let local = world.split_shared(world.rank()).size() as usize;
        let watch = Watchdog::start(rank, timeout);
        *UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()) = Some(universe);
        Ok(MpiComm { world, rank, size, local, clock: CommClock::default(), send: vec![], recv: vec![], watch })
    }

    fn finish_mean(&self, vals: &mut [f32], op: Reduce) {
        if op == Reduce::Mean {
            let w = self.size as f32;
            vals.iter_mut().for_each(|v| *v /= w);
        }
    }
}

impl Collectives for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.size
    }
    fn local_world(&self) -> usize {
        self.local
    }
    fn all_reduce(&mut self, be: &mut dyn Backend, buf: Buf, op: Reduce) -> Result<()> {
        let _w = self.watch.enter("all-reduce");
        let mut clock = self.clock;
        let mut send = std::mem::take(&mut self.send);
        let r = clock.time(|| -> Result<()> {
            for start in (0..buf.len).step_by(CHUNK) {
                let part = buf.slice(start..(start + CHUNK).min(buf.len));
                with_host(be, part, |h| {
                    send.clear();
                    send.extend_from_slice(h);
                    self.world.all_reduce_into(&send[..], h, SystemOperation::sum());
                    self.finish_mean(h, op);
                })?;
            }
            Ok(())
        });
        (self.clock, self.send) = (clock, send);
        r
    }
    fn reduce_scatter(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf, op: Reduce, accumulate: bool) -> Result<()> {
        check_shard_lens("reduce_scatter", src, dst, self.size)?;
        let _w = self.watch.enter("reduce-scatter");
        let mut clock = self.clock;
        let mut recv = std::mem::take(&mut self.recv);
        let r = clock.time(|| -> Result<()> {
            recv.resize(dst.len, 0.0);
            with_host(be, src, |s| {
                self.world.reduce_scatter_block_into(&s[..], &mut recv[..], SystemOperation::sum())
            })?;
            self.finish_mean(&mut recv, op);
            store(be, dst, &recv, accumulate)
        });
        (self.clock, self.recv) = (clock, recv);
        r
    }
    fn all_gather(&mut self, be: &mut dyn Backend, src: Buf, dst: Buf) -> Result<()> {
        check_shard_lens("all_gather", dst, src, self.size)?;
        let _w = self.watch.enter("all-gather");
        let mut clock = self.clock;
        let mut send = std::mem::take(&mut self.send);
        let r = clock.time(|| -> Result<()> {
            send.resize(src.len, 0.0);
            be.download(src, &mut send)?;
            with_host(be, dst, |d| self.world.all_gather_into(&send[..], d))
        });
        (self.clock, self.send) = (clock, send);
        r
    }
    fn barrier(&mut self) -> Result<()> {
        let _w = self.watch.enter("barrier");
        self.clock.time(|| self.world.barrier());
        Ok(())
    }
    fn seconds(&self) -> f64 {
        self.clock.seconds()
    }
}

/// Ends the process when one collective waits longer than the timeout.
struct Watchdog {
    /// Milliseconds since `epoch` at which the collective in progress began; 0 when none is.
    since_ms: AtomicU64,
    /// Which collective (an index into [`Watchdog::NAMES`]).
    what: AtomicU64,
    epoch: Instant,
}

/// Clears the watchdog when the collective returns.
struct Watching<'a>(&'a Watchdog);

impl Drop for Watching<'_> {
    fn drop(&mut self) {
        self.0.since_ms.store(0, Relaxed);
    }
}

impl Watchdog {
    const NAMES: [&'static str; 4] = ["all-reduce", "reduce-scatter", "all-gather", "barrier"];

    fn start(rank: usize, timeout: Duration) -> Arc<Watchdog> {
        let w = Arc::new(Watchdog { since_ms: AtomicU64::new(0), what: AtomicU64::new(0), epoch: Instant::now() });
        let seen = w.clone();
        let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("llmrs-comm-watchdog".into()).spawn(move || loop {
            std::thread::sleep(tick);
            let since = seen.since_ms.load(Relaxed);
            if since == 0 {
                continue;
            }
            let waited = Duration::from_millis((seen.epoch.elapsed().as_millis() as u64).saturating_sub(since));
            if waited > timeout {
                let what = Watchdog::NAMES[seen.what.load(Relaxed) as usize % 4];
                eprintln!(
                    "error: rank {rank}: a collective ({what}) has waited {:.0} s for the other ranks (--comm-timeout): \
                     a rank died or hangs. Stopping; the newest complete checkpoint is intact, resume it with -y 1",
                    waited.as_secs_f64()
                );
                // SAFETY: _exit ends the process at once without running atexit handlers or
                // destructors, which could block on the MPI state of the stuck collective.
                unsafe { libc::_exit(3) };
            }
        });
        if let Err(e) = spawned {
            eprintln!("warning: no collective watchdog ({e}): a hung rank would stall this one");
        }
        w
    }

    fn enter(&self, what: &str) -> Watching<'_> {
        self.what.store(Self::NAMES.iter().position(|n| *n == what).unwrap_or(0) as u64, Relaxed);
        self.since_ms.store((self.epoch.elapsed().as_millis() as u64).max(1), Relaxed);
        Watching(self)
    }
}

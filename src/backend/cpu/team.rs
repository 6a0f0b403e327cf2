//! The team of threads that runs the training step's parallel loops, OpenMP style: the calling
//! thread plus `threads - 1` helpers that, between loops, spin for a while instead of going to
//! sleep at once.
//!
//! Why not rayon here: a step runs hundreds of parallel loops of a few milliseconds or less
//! each, with almost no serial work between them. Rayon's idle workers go to sleep within
//! microseconds, and on a virtual machine waking one can take tens of microseconds (an
//! interrupt through the hypervisor), paid at the start of many loops. Helpers that spin
//! through the short gaps start a loop within a microsecond or so. They park after [`SPIN`]
//! without work, so a process that is done with training (or between steps, loading data)
//! does not keep a core busy.
//!
//! The team is made on first use, sized by rayon's pool (`--threads`, `RAYON_NUM_THREADS`, or
//! all cores), and serves one loop at a time: a loop started inside another, or from a second
//! thread while the team is busy (tests run in parallel), runs on the calling thread alone.
//! Work is split by index, so results never depend on which thread ran what.

use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it parks.
const SPIN: Duration = Duration::from_millis(2);

/// Spinning threads offer their core every this many spins (a few microseconds): with more
/// threads than cores (`--threads` above the core count, or other busy processes) a spinning
/// thread would otherwise hold a core that a working one needs until its time slice ends.
const YIELD_EVERY: u32 = 64;

/// The job of the current loop: `f(worker)` for worker in 0..threads.
type Job = *const (dyn Fn(usize) + Sync);

struct Team {
    /// The caller plus the helpers that started (fewer than asked if the OS refused a thread).
    threads: AtomicUsize,
    /// Taken by the thread that leads a loop; others run their loops alone.
    busy: AtomicBool,
    /// Bumped (after `job` is written) to start a loop.
    epoch: AtomicU64,
    job: UnsafeCell<Option<Job>>,
    /// Helpers that finished the current loop.
    done: AtomicUsize,
    /// A panic payload from a helper, re-raised on the leader.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    parked: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the leader, which holds `busy`, before it publishes the new
// epoch (Release); helpers read it only after seeing that epoch (Acquire), and the leader does
// not return (so the closure stays alive and the slot unchanged) until every helper is done.
unsafe impl Sync for Team {}

thread_local! {
    /// True on a thread that is running part of a loop: a loop inside it runs inline.
    static IN_LOOP: Cell<bool> = const { Cell::new(false) };
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = rayon::current_num_threads().max(1);
        let t: &'static Team = Box::leak(Box::new(Team {
            threads: AtomicUsize::new(1),
            busy: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            parked: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for w in 1..threads {
            let started = std::thread::Builder::new().name(format!("llmrs-team-{w}")).spawn(move || helper(t, w));
            if started.is_err() {
                eprintln!("warning: could not start thread {w} of {threads}; running on {w}");
                break;
            }
            t.threads.store(w + 1, Relaxed);
        }
        t
    })
}

fn helper(t: &'static Team, w: usize) {
    IN_LOOP.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        // Spin, then park, until the epoch moves.
        let start = Instant::now();
        let mut spins = 0u32;
        while t.epoch.load(Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(YIELD_EVERY) {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                t.parked.fetch_add(1, SeqCst);
                let mut g = t.lock.lock().unwrap_or_else(|e| e.into_inner());
                while t.epoch.load(SeqCst) == seen {
                    g = t.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                drop(g);
                t.parked.fetch_sub(1, SeqCst);
            }
        }
        seen = t.epoch.load(Acquire);
        // SAFETY: see `unsafe impl Sync for Team`: the job is set and alive for this epoch.
        let job = unsafe { (*t.job.get()).expect("a loop was started without a job") };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(w) })) {
            let mut slot = t.panic.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(p);
            } else {
                // Dropping a second payload here could itself panic and kill this helper,
                // leaving the leader waiting for it forever.
                std::mem::forget(p);
            }
        }
        t.done.fetch_add(1, Release);
    }
}

/// Number of threads a loop runs on (the team's size).
pub fn threads() -> usize {
    team().threads.load(Relaxed)
}

/// Run `f(worker)` for every worker in `0..threads()`, on the team when it is free (worker 0
/// on the calling thread), else one after another on the calling thread.
pub fn broadcast(f: &(dyn Fn(usize) + Sync)) {
    let t = team();
    let threads = t.threads.load(Relaxed);
    if IN_LOOP.with(|c| c.get()) {
        (0..threads).for_each(f);
        return;
    }
    if threads == 1 || t.busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
        // Inline, and marked as inside a loop so that loops nested in `f` stay inline too.
        IN_LOOP.with(|c| c.set(true));
        let r = catch_unwind(AssertUnwindSafe(|| (0..threads).for_each(f)));
        IN_LOOP.with(|c| c.set(false));
        if let Err(p) = r {
            resume_unwind(p);
        }
        return;
    }
    // SAFETY: erasing the lifetime is sound because this function does not return before
    // every helper has finished with `f` (the wait below), and `busy` keeps others out.
    unsafe {
        let f: Job = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f);
        *t.job.get() = Some(f);
    }
    t.done.store(0, Relaxed);
    t.epoch.fetch_add(1, SeqCst);
    if t.parked.load(SeqCst) > 0 {
        let _g = t.lock.lock().unwrap_or_else(|e| e.into_inner());
        t.wake.notify_all();
    }
    IN_LOOP.with(|c| c.set(true));
    let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
    IN_LOOP.with(|c| c.set(false));
    let mut spins = 0u32;
    while t.done.load(Acquire) != threads - 1 {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(YIELD_EVERY) {
            std::thread::yield_now();
        }
    }
    let theirs = t.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    t.busy.store(false, Release);
    if let Err(p) = mine {
        resume_unwind(p);
    }
    if let Some(p) = theirs {
        resume_unwind(p);
    }
}

/// Run `f` over `0..count` split into ranges that the threads claim as they go, guided: each
/// claim takes a share of what is left (at least `min`, at most `max` items), so ranges start
/// large and end small, and a thread that falls behind (a busy neighbour on a shared machine)
/// leaves little for the others to wait on.
pub fn for_ranges(count: usize, min: usize, max: usize, f: impl Fn(Range<usize>) + Sync) {
    let min = min.max(1);
    if count <= min {
        if count > 0 {
            f(0..count);
        }
        return;
    }
    let next = AtomicUsize::new(0);
    let threads = threads();
    broadcast(&|_| loop {
        let mut start = next.load(Relaxed);
        let take = loop {
            if start >= count {
                return;
            }
            let take = ((count - start) / (2 * threads)).clamp(min, max.max(min)).min(count - start);
            match next.compare_exchange_weak(start, start + take, Relaxed, Relaxed) {
                Ok(_) => break take,
                Err(now) => start = now,
            }
        };
        f(start..start + take);
    });
}

/// `f(i, chunk)` for every `size`-element chunk of `out` (the last may be shorter), across the
/// team: the team's version of rayon's `par_chunks_mut(size).enumerate().for_each(f)`.
pub fn chunks_mut<T: Send>(out: &mut [T], size: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, size) = (out.len(), size.max(1));
    let out = Disjoint::new(out);
    for_ranges(len.div_ceil(size), 1, usize::MAX, |r| {
        for i in r {
            // SAFETY: chunk i covers [i*size, (i+1)*size) clipped to the slice, disjoint from
            // every other chunk, and each index is handed out once.
            f(i, unsafe { out.part(i * size..((i + 1) * size).min(len)) })
        }
    });
}

/// A mutable slice that the threads of one loop write in disjoint parts.
pub struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the callers of `part` promise disjoint ranges, so no element is shared.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        Disjoint { ptr: s.as_mut_ptr(), len: s.len(), _life: std::marker::PhantomData }
    }

    /// The elements in `r`.
    ///
    /// # Safety
    /// No two live results may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, r: Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.len, "part {r:?} of {}", self.len);
        // SAFETY: in bounds (checked) and, as the caller promises, not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_and_panics_reach_the_caller() {
        let count = 10_007;
        let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
        for_ranges(count, 3, 500, |r| r.for_each(|i| _ = hits[i].fetch_add(1, Relaxed)));
        assert!(hits.iter().all(|h| h.load(Relaxed) == 1));
        // A loop inside a loop runs inline and still covers everything.
        let total = AtomicUsize::new(0);
        for_ranges(8, 1, 1, |_| for_ranges(5, 1, 1, |r| _ = total.fetch_add(r.len(), Relaxed)));
        assert_eq!(total.load(Relaxed), 40);
        let r = catch_unwind(|| broadcast(&|w| assert!(w != threads() - 1, "worker {w} fails")));
        assert!(r.is_err(), "a panic in a worker must reach the caller");
        // The team still works afterwards.
        let n = AtomicUsize::new(0);
        broadcast(&|_| _ = n.fetch_add(1, Relaxed));
        assert_eq!(n.load(Relaxed), threads());
    }

    #[test]
    fn loops_from_several_threads_at_once_each_cover_their_range() {
        // Whichever thread gets the team, the others run inline; none may lose or repeat work.
        std::thread::scope(|s| {
            for id in 0..4u64 {
                s.spawn(move || {
                    for round in 0..200u64 {
                        let mut out = vec![0u64; 1000 + round as usize];
                        chunks_mut(&mut out, 7, |i, c| {
                            for (j, x) in c.iter_mut().enumerate() {
                                *x = (i * 7 + j) as u64 * id;
                            }
                        });
                        assert!(out.iter().enumerate().all(|(i, &x)| x == i as u64 * id), "thread {id} round {round}");
                    }
                });
            }
        });
    }
}

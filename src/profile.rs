//! Opt-in time accounting by layer kind, for `llmrs bench`. Off by default: each timed call then
//! costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Encoder,
    LayerNorm,
    Matmul,
    Attention,
    Gelu,
    Residual,
    /// The LM head matmul plus softmax / cross-entropy.
    Classifier,
    Optimizer,
}

pub const KINDS: [Kind; 8] = [
    Kind::Encoder,
    Kind::LayerNorm,
    Kind::Matmul,
    Kind::Attention,
    Kind::Gelu,
    Kind::Residual,
    Kind::Classifier,
    Kind::Optimizer,
];

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn reset() {
    NANOS.iter().for_each(|n| n.store(0, Ordering::Relaxed));
}

/// Seconds spent in each kind since the last reset.
pub fn totals() -> Vec<(Kind, f64)> {
    KINDS.iter().map(|&k| (k, NANOS[k as usize].load(Ordering::Relaxed) as f64 * 1e-9)).collect()
}

/// Run `f`, charging its wall time to `kind` when profiling is on.
#[inline]
pub fn timed<R>(kind: Kind, f: impl FnOnce() -> R) -> R {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    NANOS[kind as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}

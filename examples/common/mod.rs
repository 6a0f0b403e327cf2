//! What the timing examples share.

use std::time::Instant;

/// Best of five runs of `f`, in ms (this machine's noise only ever adds time).
pub fn best_ms(mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::MAX, f64::min)
}

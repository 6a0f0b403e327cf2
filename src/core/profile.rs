//! Time accounting by layer kind, for `llmrs bench`. The model brackets its calls with the
//! backend's `profile_begin(kind)` / `profile_end()`; each backend keeps its own timer (wall
//! time on the CPU, whose ops run to completion; device events on a GPU). [`WallTimer`] is the
//! host-clock one. Off by default: a bracket then costs a branch.

use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Encoder,
    LayerNorm,
    RmsNorm,
    Matmul,
    /// Rotary positions.
    Rope,
    Attention,
    Gelu,
    Swiglu,
    Residual,
    /// The LoRA adapters' terms.
    Lora,
    /// The LM head matmul plus softmax / cross-entropy.
    Classifier,
    Optimizer,
}

pub const KINDS: [Kind; 12] = [
    Kind::Encoder,
    Kind::LayerNorm,
    Kind::RmsNorm,
    Kind::Matmul,
    Kind::Rope,
    Kind::Attention,
    Kind::Gelu,
    Kind::Swiglu,
    Kind::Residual,
    Kind::Lora,
    Kind::Classifier,
    Kind::Optimizer,
];

/// Wall-clock time per kind, for backends whose ops have finished when the call returns.
#[derive(Debug, Default)]
pub struct WallTimer {
    on: bool,
    seconds: [f64; KINDS.len()],
    open: Option<(Kind, Instant)>,
}

impl WallTimer {
    pub fn set(&mut self, on: bool) {
        *self = WallTimer { on, ..Default::default() };
    }
    #[inline]
    pub fn begin(&mut self, kind: Kind) {
        if self.on {
            self.open = Some((kind, Instant::now()));
        }
    }
    #[inline]
    pub fn end(&mut self) {
        if let Some((kind, t)) = self.open.take() {
            self.seconds[kind as usize] += t.elapsed().as_secs_f64();
        }
    }
    pub fn totals(&self) -> Vec<(Kind, f64)> {
        KINDS.iter().map(|&k| (k, self.seconds[k as usize])).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_only_while_on() {
        let mut t = WallTimer::default();
        t.begin(Kind::Gelu);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.end();
        assert!(t.totals().iter().all(|x| x.1 == 0.0), "off: nothing charged");
        t.set(true);
        t.begin(Kind::Gelu);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.end();
        let tot = t.totals();
        assert!(tot[Kind::Gelu as usize].1 >= 0.002 && tot[Kind::Matmul as usize].1 == 0.0, "{tot:?}");
        t.set(true);
        assert_eq!(t.totals()[Kind::Gelu as usize].1, 0.0, "turning on clears");
    }
}

//! The optimizer's settings (AdamW, clipping) and llm.c's outlier skipping: plain data and
//! host arithmetic; the step itself is [`crate::model::Model::update`].

use crate::backend::SkipAbove;

/// Optimizer hyperparameters (defaults are llm.c train_gpt2.cu's).
#[derive(Clone, Copy, Debug)]
pub struct OptimConfig {
    pub beta1: f32,        // 0.9
    pub beta2: f32,        // 0.95
    pub eps: f32,          // 1e-8
    pub weight_decay: f32, // 0.0 (applied to 2-D weights only)
    pub grad_clip: f32,    // 1.0; 0 disables clipping
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0, grad_clip: 1.0 }
    }
}

/// llm.c's outlier detector (`llmc/outlier_detector.h`): a window of the last
/// [`OutlierDetector::WINDOW`] values, and the z-score of each new value against the window
/// that includes it. Training skips a step whose loss (`-sl`) or gradient norm (`-sg`) z-score
/// exceeds a threshold. The device decides before the host sees the value, so the detector
/// turns the threshold into the value above which the z-score would exceed it
/// ([`OutlierDetector::bound`]); every value is pushed after its step, skipped or not, as in llm.c.
#[derive(Clone, Debug, Default)]
pub struct OutlierDetector {
    window: Vec<f64>,
    /// Where the next value goes once the window is full (the oldest value).
    next: usize,
}

impl OutlierDetector {
    pub const WINDOW: usize = 128;

    pub fn push(&mut self, x: f64) {
        if self.window.len() < Self::WINDOW {
            self.window.push(x);
        } else {
            self.window[self.next] = x;
            self.next = (self.next + 1) % Self::WINDOW;
        }
    }

    /// llm.c's z-score of `x` if it were pushed now: NaN until the window is full, then
    /// (x - mean) / std over the window with the oldest value replaced by x (0 when std is 0).
    pub fn z(&self, x: f64) -> f64 {
        if self.window.len() < Self::WINDOW {
            return f64::NAN;
        }
        let n = Self::WINDOW as f64;
        let others = self.window.iter().enumerate().filter(|&(i, _)| i != self.next).map(|(_, v)| *v);
        let (sum, sum_sq) = others.fold((x, x * x), |(s, q), v| (s + v, q + v * v));
        let mean = sum / n;
        let std = (sum_sq / n - mean * mean).max(0.0).sqrt();
        if std == 0.0 {
            0.0
        } else {
            (x - mean) / std
        }
    }

    /// The largest next value whose z-score stays at most `threshold`: +inf while the window
    /// fills, for a threshold of 0 (off) and for thresholds the z-score cannot exceed
    /// (sqrt(N-1) with the value in the window of N). With m and s the mean and standard
    /// deviation of the N-1 values that stay, z(x) = d sqrt(N-1) / sqrt(N s^2 + d^2) for
    /// d = x - m, which is increasing in d and reaches the threshold z at
    /// d = z s sqrt(N / (N - 1 - z^2)).
    pub fn bound(&self, threshold: f32) -> f64 {
        let (n, z) = (Self::WINDOW as f64, threshold as f64);
        if threshold <= 0.0 || self.window.len() < Self::WINDOW || z * z >= n - 1.0 {
            return f64::INFINITY;
        }
        let others = self.window.iter().enumerate().filter(|&(i, _)| i != self.next).map(|(_, v)| *v);
        let (sum, sum_sq) = others.fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
        let m = sum / (n - 1.0);
        let s = (sum_sq / (n - 1.0) - m * m).max(0.0).sqrt();
        m + z * s * (n / (n - 1.0 - z * z)).sqrt()
    }
}

/// The step's skip limits from the two detectors and llm.c's `-sl`/`-sg` thresholds (0 = off).
pub fn skip_limits(loss: &OutlierDetector, sl: f32, norm: &OutlierDetector, sg: f32) -> SkipAbove {
    let nb = norm.bound(sg);
    SkipAbove { loss: loss.bound(sl) as f32, norm_sq: (nb * nb) as f32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_where_llmcs_z_score_crosses_the_threshold() {
        let mut d = OutlierDetector::default();
        let mut x = 1u64;
        let mut noise = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        for _ in 0..OutlierDetector::WINDOW - 1 {
            d.push(3.0 + noise());
            assert_eq!(d.bound(3.0), f64::INFINITY, "window not full yet");
            assert!(d.z(3.0).is_nan());
        }
        // Full, and then sliding: at the bound z equals the threshold; just above it exceeds it.
        for i in 0..300 {
            d.push(3.0 + noise() + (i as f64) * 1e-3);
            for thr in [1.0f32, 3.0, 6.0] {
                let b = d.bound(thr);
                assert!((d.z(b) - thr as f64).abs() < 1e-9, "z at the bound {}", d.z(b));
                assert!(d.z(b + 1e-6) > thr as f64 && d.z(b - 1e-6) < thr as f64);
            }
            assert_eq!(d.bound(0.0), f64::INFINITY, "0 = off");
            assert_eq!(d.bound(12.0), f64::INFINITY, "z can never exceed sqrt(127)");
        }
    }
}

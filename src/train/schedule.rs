//! Learning-rate schedules, as llm.c's schedulers.h (f32 arithmetic, the same formulas).

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    Cosine,
    Linear,
    Constant,
    /// Warmup, stable, decay: constant until 80% of training, then 1 - sqrt decay.
    Wsd,
}

impl std::str::FromStr for ScheduleKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "cosine" => Self::Cosine,
            "linear" => Self::Linear,
            "constant" => Self::Constant,
            "wsd" => Self::Wsd,
            _ => bail!("unknown learning rate schedule '{s}': use cosine, linear, constant or wsd"),
        })
    }
}

/// The name `from_str` reads (the CLI shows the default schedule this way).
impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cosine => "cosine",
            Self::Linear => "linear",
            Self::Constant => "constant",
            Self::Wsd => "wsd",
        })
    }
}

#[derive(Clone, Copy, Debug)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub max_lr: f32,
    pub warmup: usize,
    pub total_steps: usize,
    pub final_frac: f32,
}

impl LrSchedule {
    /// Learning rate at 0-based `step`.
    pub fn lr(&self, step: usize) -> f32 {
        let LrSchedule { kind, max_lr, warmup, total_steps, final_frac } = *self;
        let min_lr = max_lr * final_frac;
        if kind != ScheduleKind::Constant && step < warmup {
            return max_lr * (step + 1) as f32 / warmup as f32;
        }
        // Clamp so a run that goes past its planned steps stays at the final rate.
        let frac = |from: usize| {
            if total_steps <= from {
                1.0
            } else {
                ((step.saturating_sub(from)) as f32 / (total_steps - from) as f32).clamp(0.0, 1.0)
            }
        };
        match kind {
            ScheduleKind::Constant => max_lr,
            ScheduleKind::Cosine => {
                let coeff = 0.5 * (1.0 + (std::f32::consts::PI * frac(warmup)).cos());
                min_lr + coeff * (max_lr - min_lr)
            }
            ScheduleKind::Linear => max_lr - frac(warmup) * (max_lr - min_lr),
            ScheduleKind::Wsd => {
                let decay_point = (0.8f32 * total_steps as f32) as usize;
                if step < decay_point {
                    max_lr
                } else {
                    min_lr + (1.0 - frac(decay_point).sqrt()) * (max_lr - min_lr)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(kind: ScheduleKind) -> LrSchedule {
        LrSchedule { kind, max_lr: 1.0, warmup: 2, total_steps: 12, final_frac: 0.1 }
    }

    #[test]
    fn shapes() {
        let c = s(ScheduleKind::Cosine);
        assert_eq!([c.lr(0), c.lr(1), c.lr(2)], [0.5, 1.0, 1.0]);
        assert!((c.lr(7) - 0.55).abs() < 1e-6); // halfway through decay
        assert!((c.lr(12) - 0.1).abs() < 1e-6);
        assert!((c.lr(100) - 0.1).abs() < 1e-6);
        let l = s(ScheduleKind::Linear);
        assert!((l.lr(7) - 0.55).abs() < 1e-6 && (l.lr(12) - 0.1).abs() < 1e-6);
        assert_eq!(s(ScheduleKind::Constant).lr(0), 1.0);
        let w = s(ScheduleKind::Wsd);
        assert_eq!([w.lr(0), w.lr(5), w.lr(8)], [0.5, 1.0, 1.0]);
        assert!(w.lr(10) < 1.0 && (w.lr(12) - 0.1).abs() < 1e-6);
        assert!("bogus".parse::<ScheduleKind>().is_err());
    }
}

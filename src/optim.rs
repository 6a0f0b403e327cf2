//! The optimizer step as llm.c's training loop does it: global-norm clipping, then AdamW.

use crate::model::{StepStats, GPT2};
use anyhow::Result;

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

/// Clip (if the global norm exceeds `grad_clip`) and apply AdamW for 0-based `step`, then read
/// the step's loss and the gradient norm before clipping.
pub fn optimizer_step(model: &mut GPT2, o: &OptimConfig, lr: f32, step: usize) -> Result<StepStats> {
    model.update(o, lr, step)?;
    model.step_stats()
}

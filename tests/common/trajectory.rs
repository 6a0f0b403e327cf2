//! A reference training run as scripts/make_reference.py and make_llama_reference.py record it
//! (`ref_trajectory.json`, `llama/trajectory.json`): the batches, the optimizer settings and
//! schedule, and the losses, gradient norms and learning rates PyTorch saw at every step.

use llmrs::model::optim::OptimConfig;
use llmrs::model::optimizer_step;
use llmrs::model::{Model, StepStats};
use llmrs::train::schedule::{LrSchedule, ScheduleKind};
use std::path::Path;

pub struct Trajectory {
    pub b: usize,
    pub t: usize,
    pub accum: usize,
    pub steps: usize,
    pub opt: OptimConfig,
    pub sched: LrSchedule,
    inputs: Vec<Vec<u32>>,  // (steps * accum, B*T)
    targets: Vec<Vec<u32>>, // (steps * accum, B*T)
    pub losses: Vec<f32>,
    pub grad_norms: Vec<f32>,
    pub lrs: Vec<f32>,
}

impl Trajectory {
    pub fn load(path: &Path) -> Trajectory {
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let n = |v: &serde_json::Value| v.as_u64().unwrap() as usize;
        let o = &j["optimizer"];
        let f = |k: &str| o[k].as_f64().unwrap() as f32;
        let steps = n(&j["steps"]);
        let toks = |k: &str| -> Vec<Vec<u32>> {
            let rows = j[k].as_array().unwrap();
            rows.iter().map(|r| r.as_array().unwrap().iter().map(|x| n(x) as u32).collect()).collect()
        };
        let floats =
            |k: &str| -> Vec<f32> { j[k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect() };
        Trajectory {
            b: n(&j["B"]),
            t: n(&j["T"]),
            accum: n(&j["grad_accum_steps"]),
            steps,
            opt: OptimConfig {
                beta1: f("beta1"),
                beta2: f("beta2"),
                eps: f("eps"),
                weight_decay: f("weight_decay"),
                grad_clip: f("grad_clip"),
            },
            sched: LrSchedule {
                kind: o["schedule"].as_str().unwrap().parse::<ScheduleKind>().unwrap(),
                max_lr: f("lr"),
                warmup: n(&o["warmup"]),
                total_steps: steps,
                final_frac: f("final_frac"),
            },
            inputs: toks("inputs"),
            targets: toks("targets"),
            losses: floats("losses"),
            grad_norms: floats("grad_norms"),
            lrs: floats("lrs"),
        }
    }

    /// Step `step` of the run on `model`: its micro-batches forward and backward (gradients
    /// averaged over them), then AdamW at the schedule's learning rate.
    pub fn step(&self, model: &mut Model, step: usize) -> StepStats {
        model.zero_grad().unwrap();
        for micro in 0..self.accum {
            let i = step * self.accum + micro;
            model.forward(&self.inputs[i], Some(&self.targets[i]), self.b, self.t).unwrap();
            model.backward(1.0 / self.accum as f32).unwrap();
        }
        optimizer_step(model, &self.opt, self.sched.lr(step), step).unwrap()
    }
}

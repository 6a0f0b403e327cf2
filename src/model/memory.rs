//! Memory: what a model holds by part ([`Model::memory`]), and what a training run will hold,
//! planned from the shapes alone before anything is allocated ([`plan_training`],
//! [`check_fits`]).

use super::*;

/// Bytes of the model's state on this rank, by role (`llmrs bench`, the log).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryUse {
    /// The parameters the passes read (bf16 under `--precision bf16`).
    pub params: usize,
    /// The fp32 master weights of a bf16 run (llm.c's `-w 1`).
    pub master: usize,
    pub grads: usize,
    pub adamw: usize,
    /// ZeRO buckets and gathered parameters, LoRA's workspaces, and the backend's own (the
    /// CPU's f32 copies of the bf16 buffers of the largest ops so far).
    pub buffers: usize,
    pub activations: usize,
    /// Of the activations: those kept per layer from forward to backward (the residual stream
    /// and the family's kept ones, see `-r`), and the logits (see `--ce-rows`); the rest are
    /// buffers one layer at a time uses (workspace, the backward's, the head's).
    pub activations_per_layer: usize,
    pub activations_logits: usize,
}

impl MemoryUse {
    pub fn total(&self) -> usize {
        self.params + self.master + self.grads + self.adamw + self.buffers + self.activations
    }
}

/// What a training run will hold before its first step, by part, from the shapes alone:
/// [`plan_training`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlannedMemory {
    pub weights: u128,
    pub master: u128,
    pub grads: u128,
    pub adamw: u128,
    pub activations: u128,
}

impl PlannedMemory {
    pub fn total(&self) -> u128 {
        self.weights + self.master + self.grads + self.adamw + self.activations
    }
}

/// The settings of a training run that decide its memory (train's and bench's flags).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunMemory {
    /// -b, -t
    pub b: usize,
    pub t: usize,
    /// -r
    pub recompute: u8,
    /// --ce-rows (0 = all B*T rows of logits at once)
    pub ce_rows: usize,
    /// --precision, and -w (fp32 master weights under bf16)
    pub precision: Precision,
    pub master_weights: bool,
    /// --lora: adapters on a frozen base (no gradients or AdamW state for it)
    pub lora: bool,
}

/// The memory one process of a training run of `cfg` allocates (its parts as
/// [`Model::memory`] counts them, less the small workspaces and the adapters), computed before
/// anything is: the weights in their precision, fp32 master weights (bf16 with `-w 1`, not
/// under LoRA), and for a full fine-tune the gradients (in the activations' dtype) and AdamW's
/// two fp32 moments; the activations of its `-r` with its `--ce-rows` rows of logits.
/// None when B*T is beyond any machine.
pub fn plan_training(cfg: &ModelConfig, run: RunMemory) -> Option<PlannedMemory> {
    let RunMemory { b, t, recompute, ce_rows, precision, master_weights, lora } = run;
    let n = cfg.num_parameters() as u128;
    let (act, act_bytes) = match precision {
        Precision::Fp32 => (DType::F32, 4),
        Precision::Bf16 => (DType::BF16, 2),
    };
    let plan = cfg.arch().acts(cfg).with_recompute(recompute);
    let rows = if ce_rows == 0 { usize::MAX } else { ce_rows };
    let activations = crate::models::acts::planned_bytes(cfg, &plan, b, t, true, rows, act)?;
    let full = !lora;
    Some(PlannedMemory {
        weights: n * act_bytes,
        master: if precision == Precision::Bf16 && master_weights && full { 4 * n } else { 0 },
        grads: if full { n * act_bytes } else { 0 },
        adamw: if full { 8 * n } else { 0 },
        activations,
    })
}

/// Refuse, before anything is read or allocated, a training run of one process that this
/// machine cannot hold: its [`plan_training`] against the memory available, with the parts and
/// the flags that shrink the big ones. (The allocations check again as they are made; this
/// saves the wait and the memory of building a model that cannot train.)
pub fn check_fits(cfg: &ModelConfig, run: RunMemory) -> Result<()> {
    let RunMemory { b, t, recompute, ce_rows, precision, master_weights, lora } = run;
    let Some(plan) = plan_training(cfg, run) else {
        bail!("B={b} x T={t} is far more than any machine can hold activations for; lower -b or -t");
    };
    let Some(avail) = crate::core::mem::available_bytes() else { return Ok(()) };
    if plan.total() <= avail as u128 {
        return Ok(());
    }
    let gib = |x: u128| format!("{:.2} GiB", x as f64 / (1u64 << 30) as f64);
    let mut parts = vec![format!("weights {}", gib(plan.weights))];
    for (what, x) in [("master weights", plan.master), ("gradients", plan.grads), ("AdamW", plan.adamw)] {
        if x > 0 {
            parts.push(format!("{what} {}", gib(x)));
        }
    }
    parts.push(format!("activations {} at B={b} T={t}", gib(plan.activations)));
    // Each flag that would shrink the run, with what the run would need then.
    let with = |other: RunMemory| plan_training(cfg, other);
    let bf16 = Precision::Bf16;
    let mut ways: Vec<(String, Option<PlannedMemory>)> = vec![];
    if !lora {
        let what = "--lora R (adapters on frozen weights: no gradients or AdamW state)";
        ways.push((what.into(), with(RunMemory { lora: true, ..run })));
    }
    if precision == Precision::Fp32 {
        ways.push(("--precision bf16".into(), with(RunMemory { precision: bf16, ..run })));
    }
    if precision == Precision::Fp32 || master_weights {
        ways.push(("--precision bf16 -w 0".into(), with(RunMemory { precision: bf16, master_weights: false, ..run })));
    }
    if recompute < crate::models::acts::MAX_RECOMPUTE {
        ways.push(("-r 2".into(), with(RunMemory { recompute: crate::models::acts::MAX_RECOMPUTE, ..run })));
    }
    if ce_rows == 0 || ce_rows > 1024 {
        ways.push(("--ce-rows 1024".into(), with(RunMemory { ce_rows: 1024, ..run })));
    }
    // (Only those that save a tenth or more, each total once.)
    let mut seen = vec![];
    let ways: Vec<String> = ways
        .into_iter()
        .filter_map(|(what, p)| {
            let p = p.filter(|p| p.total() * 10 <= plan.total() * 9 && !seen.contains(&p.total()))?;
            seen.push(p.total());
            Some(format!("{what}: {}", gib(p.total())))
        })
        .chain(std::iter::once("a smaller -b or -t".to_string()))
        .collect();
    bail!(
        "this run needs {} before its first step ({}), but this machine has {} available; try {}",
        gib(plan.total()),
        parts.join(", "),
        gib(avail as u128),
        ways.join("; ")
    )
}

impl Model {
    /// What this rank's model state takes, by role.
    pub fn memory(&self) -> MemoryUse {
        let bytes = |b: Buf| b.len * b.dtype.bytes();
        let mut m = MemoryUse { params: bytes(self.params), ..Default::default() };
        if let Some(w) = self.work {
            (m.params, m.master) = (bytes(w), bytes(self.params));
        }
        if let Some(g) = self.gathered {
            m.buffers += bytes(g.whole);
        }
        m.buffers += self.consts_buf.map_or(0, bytes) + self.be.workspace_bytes();
        if let Some(lo) = &self.lora {
            m.params += bytes(lo.params);
            m.buffers += bytes(lo.sink) + bytes(lo.scratch) + lo.kept.map_or(0, bytes);
        }
        if let Some(tr) = self.train {
            m.grads = bytes(tr.grads);
            m.adamw = bytes(tr.m) + bytes(tr.v);
            m.buffers += tr.buckets.map_or(0, |(e, b)| bytes(e) + bytes(b));
        }
        if let Some(a) = &self.acts {
            m.activations = a.bytes();
            let (per_layer, logits) = a.bytes_by_part();
            (m.activations_per_layer, m.activations_logits) = (per_layer, logits);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory planned from the shapes alone is what a model of those settings allocates,
    /// part by part (weights, master weights, gradients, AdamW, activations), in fp32 and bf16,
    /// full and LoRA, at each recompute level and with chunked and whole logits.
    #[test]
    fn planned_memory_is_what_the_model_allocates() {
        use crate::core::config::Precision::{Bf16, Fp32};
        let (b, t) = (3, 5);
        for desc in ["2x32:2:16", "llama:2x24:4:2:40:16"] {
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            for (precision, master, lora, r, rows) in [
                (Fp32, true, false, 1, 0),
                (Fp32, true, true, 2, 4),
                (Bf16, true, false, 0, 7),
                (Bf16, false, false, 2, 0),
                (Bf16, true, true, 1, 3),
            ] {
                let mut m = Model::new(Weights::random(cfg, 1).unwrap(), Device::Cpu).unwrap();
                if lora {
                    let targets = crate::model::lora::select(&cfg, &[]).unwrap();
                    let a = crate::model::lora::Adapters::new(2, 4.0, targets, &mut crate::core::rng::Mt19937::new(1))
                        .unwrap();
                    m.set_lora(&a).unwrap();
                }
                m.set_precision(precision, master).unwrap();
                m.set_recompute(r).unwrap();
                m.set_classifier_rows(rows).unwrap();
                m.alloc_training_state().unwrap();
                m.reserve(b, t).unwrap();
                let got = m.memory();
                let settings = RunMemory { b, t, recompute: r, ce_rows: rows, precision, master_weights: master, lora };
                let plan = plan_training(&cfg, settings).unwrap();
                let what = format!("{desc} {precision} -w {master} lora {lora} -r {r} --ce-rows {rows}");
                // (A LoRA run's parameters count its adapters too; the plan leaves them out.)
                let adapters = m.lora.as_ref().map_or(0, |lo| lo.params.len * 4) as u128;
                assert_eq!(plan.weights, got.params as u128 - adapters, "{what}: weights");
                assert_eq!(plan.master, got.master as u128, "{what}: master weights");
                assert_eq!(plan.activations, got.activations as u128, "{what}: activations");
                if !lora {
                    assert_eq!((plan.grads, plan.adamw), (got.grads as u128, got.adamw as u128), "{what}");
                }
            }
        }
        let absurd = RunMemory {
            b: 1 << 20,
            t: 1 << 20,
            recompute: 0,
            ce_rows: 0,
            precision: Fp32,
            master_weights: true,
            lora: false,
        };
        assert!(plan_training(&ModelConfig::from_descriptor("2x32:2:16").unwrap(), absurd).is_none());
    }
}

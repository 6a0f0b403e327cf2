//! A model of any family ([`crate::models`]): the forward, backward and update passes as
//! llm.c's list of layer calls, on whatever backend was chosen at start-up. No autograd: every
//! layer's backward is called by hand, in reverse. The family supplies its block's calls; the
//! passes, ZeRO placement and the KV cache are the same for all. The model knows buffers only
//! as [`Buf`] handles; the rest of the crate reaches
//! parameters, gradients, optimizer state, losses and logits through the methods at the end
//! (host copies of named tensors, the step's loss, one position's logits).

mod cache;
mod io;
pub mod lora;
mod memory;
pub mod optim;
mod passes;
mod precision;
mod update;
pub mod zero;

pub use memory::{check_fits, plan_training, MemoryUse, PlannedMemory, RunMemory};
pub use passes::MIN_CLASSIFIER_ROWS;
pub use update::optimizer_step;

use crate::backend::comm::{read_host, Collectives, Reduce, SingleProcess};
use crate::backend::ops::{BlockLora, Mat, Ops, Seq, FROZEN};
use crate::backend::{self, AdamWParams, Backend, Buf, DType, Device, Noise, SkipAbove};
use crate::core::config::{ModelConfig, Precision};
use crate::core::params::{ParamLayout, TensorId, View, Weights};
use crate::core::profile::Kind;
use crate::model::optim::OptimConfig;
use crate::model::zero::{Piece, Sharding};
use crate::models::acts::{ActPlan, Acts, KvCache, NormActs};
use crate::models::family::{Arch, Attn, Consts};
use anyhow::{bail, Context, Result};

/// Which of the model's flat buffers a host copy is of: the parameter layout's, but for a LoRA
/// run's gradients and AdamW moments, which are its adapters' ([`Model::set_lora`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Params,
    Grads,
    /// AdamW's first moment.
    AdamM,
    /// AdamW's second moment.
    AdamV,
}

/// What one optimizer step reports (one host read per step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The step's mean loss over all its micro-batches (and ranks).
    pub loss: f32,
    /// The global gradient norm before clipping.
    pub grad_norm: f32,
    /// The update was skipped (a value not finite, or above the step's [`SkipAbove`]).
    pub skipped: bool,
}

/// Gradients and AdamW moments: (num_parameters) in the parameter layout, or this rank's shard
/// (num_parameters / world) in the shard layout of [`crate::model::zero`] where the stage shards them;
/// in a LoRA run the adapters' (their parameters' layout; AdamW's a 1/world shard under
/// ZeRO-1..3).
#[derive(Clone, Copy, Debug)]
struct TrainBufs {
    grads: Buf,
    /// ZeRO-2/3: backward's gradients of the tensors outside the blocks (wte, wpe, the head, the
    /// final norm) and of one block before they are reduce-scattered into `grads`.
    buckets: Option<(Buf, Buf)>,
    m: Buf,
    v: Buf,
}

/// A LoRA run ([`crate::model::lora`]): the base parameters are frozen (no gradients, no AdamW
/// state); the adapters are what trains, and the [`TrainBufs`] are theirs.
#[derive(Clone, Debug)]
struct LoraState {
    /// The adapted projections, rank and alpha (the values live in `params`).
    meta: crate::model::lora::Adapters,
    params: Buf, // (adapter parameters, padded to a multiple of the ranks): per target A (R, in) then B (out, R)
    /// Each block's adapters for the ops, with their gradients once training.
    blocks: Vec<BlockLora>,
    /// Where backward writes the frozen norms' and biases' gradients, which nothing reads:
    /// one disjoint slice per such tensor of a block (or of the outer ones).
    sink: Buf, // (the larger of a block's and the outer tensors' 1-D sizes)
    /// The workspaces of every block's adapters, h then dh, for the activations' positions or
    /// a KV cache's (N = the larger).
    scratch: Buf, // (2, N, R)
    /// Each adapter's h from a pass over the training activations, which its backward reads
    /// (allocated with them: N = their B*T).
    kept: Option<Buf>, // (targets, N, R)
}

/// ZeRO-3: the full parameters gathered for the current pass, in one allocation: the
/// tensors outside the blocks, then one block.
#[derive(Clone, Copy, Debug)]
struct Gathered {
    whole: Buf,
    embed: Buf,
    block: Buf,
    /// `embed` holds the current embedding weights.
    embed_valid: bool,
    /// `block` holds this block's current weights.
    block_held: Option<usize>,
}

impl Gathered {
    /// The buffers of the tensors outside the blocks and of one block, in `dtype` (that of
    /// the parameters the passes read), holding nothing yet.
    fn alloc(be: &mut dyn Backend, zero: &Sharding, dtype: DType) -> Result<Self> {
        let (e, b) = (zero.outer_bucket().1, zero.block_bucket().1);
        let whole = be.alloc_parts(&zero.bucket_parts(), dtype)?;
        let (embed, block) = (whole.prefix(e), whole.slice(e..e + b));
        Ok(Gathered { whole, embed, block, embed_valid: false, block_held: None })
    }
}

/// The last forward pass: its shape and what its buffers hold now.
#[derive(Clone, Copy, Debug, Default)]
struct Last {
    b: usize,
    t: usize,
    /// The logits buffer holds the forward's logits (backward turns them into their gradient).
    logits: bool,
    /// The pass had targets: the per-position losses are there.
    losses: bool,
    /// The pass had targets and backward has not run on it yet.
    backward_ready: bool,
}

pub struct Model {
    pub config: ModelConfig,
    /// The model's family: its tensors, its block's calls.
    arch: &'static dyn Arch,
    /// The activations the family's block keeps.
    plan: ActPlan,
    layout: ParamLayout,
    be: Box<dyn Backend>,
    comm: Box<dyn Collectives>,
    zero: Sharding,
    /// Every piece of the parameters with this rank's part ([`crate::model::zero`]).
    pieces: Vec<Piece>,
    params: Buf, // (num_parameters), or this rank's shard under ZeRO-3
    /// A bf16 run with master weights: the bf16 working copy that every pass reads, written
    /// from `params` (then the fp32 master weights) after each update.
    work: Option<Buf>, // bf16 (num_parameters)
    precision: Precision,
    gathered: Option<Gathered>,
    /// [loss accumulator, squared gradient norm].
    stats: Buf, // (2)
    /// Flags that the ranks agree on (checkpoint checks).
    flags: Buf, // (2)
    train: Option<TrainBufs>,
    /// What the family computes once (Llama's rotary table), and its allocation.
    consts: Consts,
    consts_buf: Option<Buf>,
    acts: Option<Acts>,
    last: Last,
    /// Set by [`Model::zero_grad`]: the next backward overwrites the GEMM-produced gradients.
    grads_overwrite: bool,
    /// The limits of the last update, for step_stats to tell whether it was skipped.
    skip: SkipAbove,
    /// Rows of logits the classifier computes at once (0: all B*T). See
    /// [`Model::set_classifier_rows`].
    ce_rows: usize,
    /// LoRA adapters ([`Model::set_lora`]).
    lora: Option<LoraState>,
}

fn check_tokens(cfg: &ModelConfig, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
    let (v, n) = (cfg.vocab_size, b * t);
    if b == 0 || t == 0 || t > cfg.max_seq_len {
        bail!("sequence length {t} must be between 1 and the model's max_seq_len {} (and B > 0)", cfg.max_seq_len);
    }
    if inputs.len() != n || targets.is_some_and(|y| y.len() != n) {
        bail!("batch holds {} inputs, expected B*T = {n}", inputs.len());
    }
    if let Some(&bad) = inputs.iter().chain(targets.unwrap_or(&[])).find(|&&x| x as usize >= v) {
        bail!("token id {bad} is out of range for vocab size {v}: the data was tokenized for another vocabulary");
    }
    Ok(())
}

impl Model {
    /// The model with these weights on `device`, as a single process.
    pub fn new(weights: Weights, device: Device) -> Result<Self> {
        Self::with_collectives(weights, backend::factory::open(device)?, Box::new(SingleProcess), 0)
    }

    /// The model on a given backend, as one rank of `comm`, with ZeRO stage `zero` (0-3).
    pub fn with_collectives(
        weights: Weights,
        mut be: Box<dyn Backend>,
        comm: Box<dyn Collectives>,
        zero: usize,
    ) -> Result<Self> {
        let Weights { config, layout, data } = weights;
        let zero = Sharding::new(zero, comm.rank(), comm.world(), config)?;
        let pieces = zero.pieces();
        let (params, data) = if zero.stage == 3 {
            (be.alloc_parts(&zero.parts_at(3), DType::F32)?, data)
        } else {
            // The backend takes the host copy as its own where it can (the CPU).
            (be.alloc_from(&zero.parts_at(3), data)?, vec![])
        };
        let mut gathered = None;
        if zero.stage == 3 {
            for p in &pieces {
                be.upload(params.slice(p.shard.clone()), &data[p.owned.clone()]);
            }
            gathered = Some(Gathered::alloc(&mut *be, &zero, DType::F32)?);
        }
        drop(data); // the host copy goes before anything else is allocated
        let stats = be.alloc(2, DType::F32)?;
        be.fill(stats, 0.0);
        let flags = be.alloc(2, DType::F32)?;
        be.fill(flags, 0.0);
        let arch = crate::models::arch(&config);
        let consts_buf = match arch.host_consts(&config) {
            Some(h) => {
                let b = be.alloc(h.len(), DType::F32)?;
                be.upload(b, &h);
                Some(b)
            }
            None => None,
        };
        Ok(Model {
            config,
            arch,
            plan: arch.acts(&config),
            layout,
            be,
            comm,
            zero,
            pieces,
            params,
            work: None,
            precision: Precision::Fp32,
            gathered,
            stats,
            flags,
            train: None,
            consts: Consts { table: consts_buf },
            consts_buf,
            acts: None,
            last: Last::default(),
            grads_overwrite: false,
            skip: SkipAbove::NON_FINITE,
            ce_rows: 0,
            lora: None,
        })
    }

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The backend in use, for logs.
    pub fn describe_backend(&self) -> String {
        self.be.describe()
    }

    /// The backend's fp32 peak (GFLOP/s, method), where it measures one.
    pub fn measure_peak(&self) -> Option<(f64, String)> {
        self.be.measure_peak()
    }

    /// This process's rank and the number of ranks.
    pub fn rank(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world())
    }

    /// Wait until every rank has got here.
    pub fn barrier(&mut self) -> Result<()> {
        self.comm.barrier()
    }

    /// The ZeRO stage in effect (0 with one rank).
    pub fn zero_stage(&self) -> usize {
        self.zero.stage
    }

    /// Ranks on this machine (this one included).
    pub fn local_world(&self) -> usize {
        self.comm.local_world()
    }

    /// Seconds this rank has spent in collectives.
    pub fn comm_seconds(&self) -> f64 {
        self.comm.seconds()
    }

    /// Make the activations again at their capacity, for a new plan or new buffers (nothing
    /// when none are allocated). What they held is gone.
    fn remake_acts(&mut self) -> Result<()> {
        if let Some(a) = self.acts.take() {
            a.free(&mut *self.be);
            self.reserve(a.cap_b, a.cap_t)?;
        }
        self.last = Last::default();
        Ok(())
    }

    /// The recompute level ([`Model::set_recompute`]).
    pub fn recompute(&self) -> u8 {
        self.plan.recompute
    }

    pub fn set_profiling(&mut self, on: bool) {
        self.be.set_profiling(on);
    }

    pub fn profile_totals(&mut self) -> Result<Vec<(crate::core::profile::Kind, f64)>> {
        self.be.profile_totals()
    }

    /// Wait for all queued work (for timing).
    pub fn synchronize(&mut self) -> Result<()> {
        self.be.synchronize()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn model(desc: &str, seed: u32) -> Model {
        Model::new(Weights::random(ModelConfig::from_descriptor(desc).unwrap(), seed).unwrap(), Device::Cpu).unwrap()
    }

    #[test]
    fn misuse_gives_errors_not_panics() {
        let mut m = model("1x16:2:8", 1);
        assert!(m.backward(1.0).is_err(), "backward before training state");
        assert!(m.logits_at(0).is_err(), "logits before a forward pass");
        m.alloc_training_state().unwrap();
        m.forward(&[1, 2], None, 1, 2).unwrap();
        assert!(m.backward(1.0).is_err(), "backward without targets");
        assert!(m.logits_at(2).is_err() && m.logits_at(1).is_ok());
        assert!(m.forward(&[1, 2, 3], None, 1, 2).is_err(), "wrong length");
        assert!(m.forward(&[1, 60000], None, 1, 2).is_err(), "token out of range");
        assert!(m.forward(&[1; 9], None, 1, 9).is_err(), "past maxT");
        assert!(m.write_all(Slot::AdamM, &[0.0; 3]).is_err(), "wrong size");
    }
}

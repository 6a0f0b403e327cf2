//! A model of any family ([`crate::models`]): the forward, backward and update passes as
//! llm.c's list of layer calls, on whatever backend was chosen at start-up. No autograd: every
//! layer's backward is called by hand, in reverse. The family supplies its block's calls; the
//! passes, ZeRO placement and the KV cache are the same for all. The model knows buffers only
//! as [`Buf`] handles; the rest of the crate reaches
//! parameters, gradients, optimizer state, losses and logits through the methods at the end
//! (host copies of named tensors, the step's loss, one position's logits).

use crate::acts::{ActPlan, Acts, KvCache, NormActs};
use crate::backend::comm::{read_host, Collectives, Reduce, SingleProcess};
use crate::backend::ops::{Adapter, BlockLora, Mat, Ops, Seq, FROZEN};
use crate::backend::{self, AdamWParams, Backend, Buf, DType, Device, Noise, SkipAbove};
use crate::config::{ModelConfig, Precision};
use crate::models::family::{Arch, Attn, Consts};
use crate::optim::OptimConfig;
use crate::params::{ParamLayout, TensorId, View, Weights};
use crate::profile::Kind;
use crate::zero::{Piece, Sharding};
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
/// (num_parameters / world) in the shard layout of [`crate::zero`] where the stage shards them;
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

/// A LoRA run ([`crate::lora`]): the base parameters are frozen (no gradients, no AdamW
/// state); the adapters are what trains, and the [`TrainBufs`] are theirs.
#[derive(Clone, Debug)]
struct LoraState {
    /// The adapted projections, rank and alpha (the values live in `params`).
    meta: crate::lora::Adapters,
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
    /// Every piece of the parameters with this rank's part ([`crate::zero`]).
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
    let activations = crate::acts::planned_bytes(cfg, &plan, b, t, true, rows, act)?;
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
    let Some(avail) = crate::mem::available_bytes() else { return Ok(()) };
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
    if recompute < crate::acts::MAX_RECOMPUTE {
        ways.push(("-r 2".into(), with(RunMemory { recompute: crate::acts::MAX_RECOMPUTE, ..run })));
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

    /// Forward pass over `inputs (b, t)`: logits (b, t, Vp), and with `targets (b, t)` the
    /// per-position losses (see [`Model::accumulate_loss`], [`Model::backward`]). Under ZeRO-3
    /// it gathers weights, a collective: every rank must make the same passes.
    pub fn forward(&mut self, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
        self.forward_impl(inputs, targets, b, t, true)
    }

    /// A training micro-step: [`Model::forward`] with targets then [`Model::backward`] with
    /// `loss_scale`, the same bits, with the classifier fused: each chunk of rows (see
    /// [`Model::set_classifier_rows`]) goes through the head, the loss, d(logits) and the head's
    /// backward at once, so its logits are computed once (a chunked forward then backward
    /// computes them twice). The per-position losses are there afterwards; the logits are not.
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
        loss_scale: f32,
    ) -> Result<()> {
        self.train.context("forward_backward needs training state: call alloc_training_state first")?;
        self.forward_impl(inputs, Some(targets), b, t, false)?;
        self.backward_impl(loss_scale, true)?;
        self.last.losses = true;
        Ok(())
    }

    /// The forward pass, and the classifier unless `head` is false (then [`Model::backward_impl`]
    /// runs it, fused).
    fn forward_impl(&mut self, inputs: &[u32], targets: Option<&[u32]>, b: usize, t: usize, head: bool) -> Result<()> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, v, vp, n, s) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, b * t, Seq { b, t });
        check_tokens(&cfg, inputs, targets, b, t)?;
        self.reserve(b, t)?;
        let a = self.acts.clone().context("no activations")?;
        let o = self.outer_weights()?;
        let (inp, tgt) = a.tokens(n);
        self.be.upload_u32(inp, inputs);
        arch.embed(&mut Ops::new(&mut *self.be), &cfg, &o, a.encoded(n), inp, s, 0);
        for l in 0..cfg.num_layers {
            let w = self.block_weights(l)?;
            let x = a.layer(l, b, t);
            let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
            arch.block_forward(
                &mut Ops::new(&mut *self.be).with_lora(lora),
                &cfg,
                &self.consts,
                &w,
                &x,
                n,
                Attn::Causal(s),
            );
        }
        let mut ops = Ops::new(&mut *self.be);
        let norm = a.norm(n);
        arch.final_norm(&mut ops, &cfg, &o, &norm, a.last_residual(&cfg, n), n);
        let head_w = o[arch.head(&cfg)];
        if let Some(y) = targets {
            ops.backend().upload_u32(tgt, y);
        }
        // The classifier, `rows` positions at a time into a logits buffer of that many rows.
        // Chunked without targets, it computes nothing here: logits_at computes the rows read.
        let rows = a.logit_rows.min(n);
        if head && (rows == n || targets.is_some()) {
            for (r0, r) in classifier_chunks(n, rows) {
                let (x, logits) = (norm.out.slice(r0 * c..(r0 + r) * c), a.logits.prefix(r * vp));
                let m = Mat { n: r, c, oc: vp };
                ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head_w, None, m));
                if targets.is_some() {
                    let (losses, lse, tgt) =
                        (a.losses.slice(r0..r0 + r), a.lse.slice(r0..r0 + r), tgt.slice(r0..r0 + r));
                    ops.crossentropy_forward(losses, lse, logits, tgt, r, v, vp);
                }
            }
        }
        let losses = head && targets.is_some();
        self.last = Last { b, t, logits: head, losses, backward_ready: targets.is_some() };
        Ok(())
    }

    /// Backward pass of the last forward (which must have had targets), for the objective
    /// `loss_scale * mean loss` (gradient accumulation over k micro-batches passes 1/k). Adds
    /// to the gradients (see [`Model::zero_grad`]) and that objective to the step's loss.
    /// Overwrites the logits with their gradient. Under ZeRO-2/3 each block's gradients are
    /// reduce-scattered into this rank's shard as soon as the block is done.
    pub fn backward(&mut self, loss_scale: f32) -> Result<()> {
        self.backward_impl(loss_scale, false)
    }

    /// The backward pass; `fused`: the forward left the classifier to it (forward_backward),
    /// so each chunk's logits and losses are computed here, just before their backward.
    fn backward_impl(&mut self, loss_scale: f32, fused: bool) -> Result<()> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, v, vp, nl) = (cfg.channels, cfg.vocab_size, cfg.padded_vocab_size, cfg.num_layers);
        self.train.context("backward needs training state: call alloc_training_state first")?;
        let Last { b, t, backward_ready: true, .. } = self.last else {
            bail!("backward needs a forward pass with targets (and runs once per pass)")
        };
        self.last = Last { logits: false, backward_ready: false, ..self.last };
        let acc = !std::mem::take(&mut self.grads_overwrite) && self.zero.stage < 2;
        let a = self.acts.clone().context("no activations")?;
        let o = self.outer_weights()?;
        let d_o = self.outer_grads();
        let (n, s) = (b * t, Seq { b, t });
        let (inp, tgt) = a.tokens(n);
        let norm = a.norm(n);
        let mut d = a.back(b, t);
        let mut ops = Ops::new(&mut *self.be);
        let (head, dhead) = (o[arch.head(&cfg)], d_o[arch.head(&cfg)]);
        // The classifier's backward, chunk by chunk as its forward: a chunked pass first
        // computes the chunk's logits again (the forward kept only the last chunk's), a fused
        // one its logits and losses. Each chunk's rows of d(lnf) are as unchunked; the head's
        // gradient adds chunk by chunk.
        let rows = a.logit_rows.min(n);
        for (r0, r) in classifier_chunks(n, rows) {
            let (x, dx) = (norm.out.slice(r0 * c..(r0 + r) * c), a.scratch.slice(r0 * c..(r0 + r) * c));
            let (logits, lse, tgt) = (a.logits.prefix(r * vp), a.lse.slice(r0..r0 + r), tgt.slice(r0..r0 + r));
            let m = Mat { n: r, c, oc: vp };
            if rows < n || fused {
                ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head, None, m));
            }
            if fused {
                ops.crossentropy_forward(a.losses.slice(r0..r0 + r), lse, logits, tgt, r, v, vp);
            }
            ops.crossentropy_backward(logits, lse, tgt, loss_scale / n as f32, r, v, vp);
            let acc = acc || r0 > 0;
            ops.charged_to(Kind::Classifier, |ops| ops.matmul_backward(Some(dx), dhead, None, logits, x, head, m, acc));
        }
        ops.accumulate_mean(self.stats.prefix(1), a.losses.prefix(n), loss_scale);
        let dnorm = a.scratch.prefix(n * c);
        ops.backend().fill(d.dres, 0.0);
        arch.final_norm_backward(&mut ops, &cfg, &o, &d_o, &norm, d.dres, dnorm, a.last_residual(&cfg, n), n);
        for l in (0..nl).rev() {
            let (w, dw) = (self.block_weights(l)?, self.block_grads(l));
            let x = a.layer(l, b, t);
            let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
            // A LoRA run's embedding is frozen: nothing reads the first block's input gradient.
            d.input_grad = l > 0 || self.lora.is_none();
            let mut ops = Ops::new(&mut *self.be).with_lora(lora);
            arch.block_backward(&mut ops, &cfg, &self.consts, &w, &dw, &x, &d, s, acc);
            self.reduce_grads(&self.layout.block_ids(), l)?;
        }
        // A frozen embedding has no gradient to scatter.
        if self.lora.is_none() {
            arch.embed_backward(&mut Ops::new(&mut *self.be), &cfg, &d_o, d.dres, inp, s);
        }
        self.reduce_grads(&self.layout.outer_ids(), 0)
    }

    /// Start a step: the step's loss to 0, and a new gradient. Like PyTorch's
    /// `zero_grad(set_to_none=True)`, the tensors that the next backward writes whole
    /// ([`crate::params::TensorSpec::whole`]) are overwritten by it instead of being cleared
    /// now, which saves a pass over all gradients and the read of every weight gradient in the
    /// backward GEMMs; the rest are zeroed here. Under ZeRO-2/3 the shard is cleared (backward
    /// adds each micro-batch's reduced gradients to it).
    pub fn zero_grad(&mut self) -> Result<()> {
        let tr = self.train.context("zero_grad needs training state: call alloc_training_state first")?;
        if self.lora.is_some() || self.zero.stage >= 2 {
            self.be.fill(tr.grads, 0.0);
        } else {
            for t in self.layout.ids().filter(|&t| !self.layout.spec(t).whole) {
                self.be.fill(tr.grads.slice(self.layout.range(t)), 0.0);
            }
        }
        self.be.fill(self.stats.prefix(1), 0.0);
        self.grads_overwrite = true;
        Ok(())
    }

    /// The optimizer step, queued without waiting on the host (see [`Sharding::update`]: AdamW
    /// with clipping, on the parts of the parameters this rank's ZeRO stage gives it). A step
    /// whose loss or norm is not finite, or above `skip`, leaves the model unchanged
    /// ([`Backend::adamw_update`]); [`Model::step_stats`] tells.
    pub fn update(&mut self, o: &OptimConfig, lr: f32, step: usize, skip: SkipAbove) -> Result<()> {
        let tr = self.train.context("update needs training state: call alloc_training_state first")?;
        self.skip = skip;
        if let Some(lo) = &self.lora {
            // The adapters: data parallel over the ranks. ZeRO-0: gradients averaged everywhere
            // and every rank's AdamW over all; ZeRO-1..3: this rank's shard of the gradients
            // (reduce-scattered), of the AdamW state and of the update, then the adapters
            // gathered whole again.
            let (be, norm) = (&mut *self.be, self.stats.slice(1..2));
            self.comm.all_reduce(be, self.stats.prefix(1), Reduce::Mean)?;
            let (params, grads) = if self.zero.stage == 0 {
                self.comm.all_reduce(be, tr.grads, Reduce::Mean)?;
                Ops::new(be).global_norm_squared(norm, tr.grads, false);
                (lo.params, tr.grads)
            } else {
                let own = tr.m.len;
                let shard = self.comm.rank() * own..(self.comm.rank() + 1) * own;
                let g = tr.grads.slice(shard.clone());
                self.comm.reduce_scatter(be, tr.grads, g, Reduce::Mean, false)?;
                Ops::new(be).global_norm_squared(norm, g, false);
                self.comm.all_reduce(be, norm, Reduce::Sum)?;
                (lo.params.slice(shard), g)
            };
            let h = AdamWParams {
                lr,
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                weight_decay: o.weight_decay,
                grad_clip: o.grad_clip,
                t: step as i32 + 1,
                skip,
                seed: rounding_seed(step),
                place: None,
            };
            Ops::new(be).adamw_update(params, grads, tr.m, tr.v, self.stats, &h);
            if self.zero.stage > 0 {
                self.comm.all_gather(be, params, lo.params)?;
            }
            return Ok(());
        }
        let (params, grads, m, v, stats, work) = (self.params, tr.grads, tr.m, tr.v, self.stats, self.work);
        let bufs = crate::zero::StepBufs { params, grads, m, v, stats, work };
        let layout = &self.layout;
        let hyper = |t: TensorId| AdamWParams {
            lr,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: if layout.spec(t).decay { o.weight_decay } else { 0.0 },
            grad_clip: o.grad_clip,
            t: step as i32 + 1,
            skip,
            seed: rounding_seed(step),
            place: None,
        };
        self.zero.update(&mut *self.be, &mut *self.comm, bufs, hyper)?;
        if let (Some(work), 1 | 2) = (self.work, self.zero.stage) {
            // The bf16 working copy from the gathered master weights, rounded stochastically
            // as llm.c's AdamW writes it (stages 0 and 3 write it in AdamW's pass); a skipped
            // step leaves it as it was (a host read of the statistics that these stages add).
            let s = self.step_stats()?;
            if !s.skipped {
                let noise = Noise::at(rounding_seed(step), work);
                Ops::new(&mut *self.be).convert(work, self.params, Some(noise));
            }
        }
        self.forget_gathered();
        Ok(())
    }

    // ---- where parameters and gradients are for a pass (ZeRO) ------------------------------

    /// The tensors outside the blocks for this pass: views of the parameters, or under ZeRO-3
    /// gathered from every rank's shard (once per update).
    fn outer_weights(&mut self) -> Result<View<Buf>> {
        let p = self.work.unwrap_or(self.params);
        let Some(mut g) = self.gathered else { return Ok(self.layout.outer().map(|r| p.slice(r.clone()))) };
        let views = self.zero.outer_bucket().0.map(|r| g.embed.slice(r.clone()));
        if !g.embed_valid {
            for t in self.layout.outer_ids().into_iter().filter(|&t| views[t].len > 0) {
                let src = p.slice(self.zero.piece(t, 0).shard);
                self.comm.all_gather(&mut *self.be, src, views[t])?;
            }
            g.embed_valid = true;
            self.gathered = Some(g);
        }
        Ok(views)
    }

    /// Block `l`'s weights: views of the parameters, or under ZeRO-3 gathered just before use
    /// into the one-block buffer (which the next block's gathering overwrites).
    fn block_weights(&mut self, l: usize) -> Result<View<Buf>> {
        let p = self.work.unwrap_or(self.params);
        let Some(mut g) = self.gathered else { return Ok(self.layout.block(l).map(|r| p.slice(r.clone()))) };
        let views = self.zero.block_bucket().0.map(|r| g.block.slice(r.clone()));
        if g.block_held != Some(l) {
            for t in self.layout.block_ids().into_iter().filter(|&t| views[t].len > 0) {
                let src = p.slice(self.zero.piece(t, l).shard);
                self.comm.all_gather(&mut *self.be, src, views[t])?;
            }
            g.block_held = Some(l);
            self.gathered = Some(g);
        }
        Ok(views)
    }

    /// The gathered parameters no longer match the shards (after an update or a write).
    fn forget_gathered(&mut self) {
        if let Some(g) = &mut self.gathered {
            g.embed_valid = false;
            g.block_held = None;
        }
    }

    /// Where backward writes the gradients of the tensors outside the blocks: the gradient
    /// buffer, or under ZeRO-2/3 the outer bucket, whose tensors that backward adds to are
    /// zeroed.
    fn outer_grads(&mut self) -> View<Buf> {
        let tr = self.train.expect("checked by the caller");
        if let Some(lo) = &self.lora {
            return frozen_grads(&self.layout, self.layout.outer(), lo.sink);
        }
        let Some((bucket, _)) = tr.buckets else { return self.layout.outer().map(|r| tr.grads.slice(r.clone())) };
        let views = self.zero.outer_bucket().0.map(|r| bucket.slice(r.clone()));
        for t in self.layout.outer_ids().into_iter().filter(|&t| !self.layout.spec(t).whole) {
            self.be.fill(views[t], 0.0);
        }
        views
    }

    /// Where backward writes block `l`'s gradients: the gradient buffer, or under ZeRO-2/3 the
    /// block bucket, with the gradients that backward adds to (the norms') zeroed.
    fn block_grads(&mut self, l: usize) -> View<Buf> {
        let tr = self.train.expect("checked by the caller");
        if let Some(lo) = &self.lora {
            return frozen_grads(&self.layout, self.layout.block(l), lo.sink);
        }
        let Some((_, bucket)) = tr.buckets else { return self.layout.block(l).map(|r| tr.grads.slice(r.clone())) };
        let views = self.zero.block_bucket().0.map(|r| bucket.slice(r.clone()));
        for t in self.layout.block_ids().into_iter().filter(|&t| !self.layout.spec(t).whole) {
            self.be.fill(views[t], 0.0);
        }
        views
    }

    /// ZeRO-2/3: reduce-scatter the bucket's gradients of `tensors` (layer `l`) into this
    /// rank's shard, averaged over the ranks and added to the micro-batches before.
    fn reduce_grads(&mut self, tensors: &[TensorId], l: usize) -> Result<()> {
        let tr = self.train.expect("checked by the caller");
        let Some((outer, block)) = tr.buckets else { return Ok(()) };
        let (or, br) = (self.zero.outer_bucket().0, self.zero.block_bucket().0);
        for &t in tensors.iter().filter(|&&t| self.layout.spec(t).numel_per_layer() > 0) {
            let src =
                if self.layout.spec(t).per_layer { block.slice(br[t].clone()) } else { outer.slice(or[t].clone()) };
            let dst = tr.grads.slice(self.zero.piece(t, l).shard);
            self.comm.reduce_scatter(&mut *self.be, src, dst, Reduce::Mean, true)?;
        }
        Ok(())
    }

    /// The last step's loss and gradient norm: the one host read of a training step.
    pub fn step_stats(&mut self) -> Result<StepStats> {
        let mut s = [0f32; 2];
        self.be.download(self.stats, &mut s)?;
        Ok(StepStats { loss: s[0], grad_norm: s[1].sqrt(), skipped: self.skip.skips(s[0], s[1]) })
    }

    // ---- set-up ---------------------------------------------------------------------------

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

    /// Allocate gradients and AdamW moments (zeroed). Call once before training.
    pub fn alloc_training_state(&mut self) -> Result<()> {
        if self.train.is_none() {
            let gdt = self.act_dtype();
            let mut z = |parts: Vec<usize>, dtype: DType| -> Result<Buf> {
                let b = self.be.alloc_parts(&parts, dtype)?;
                self.be.fill(b, 0.0);
                Ok(b)
            };
            let f32 = DType::F32;
            if let Some(len) = self.lora.as_ref().map(|lo| lo.params.len) {
                // ZeRO-1..3 shard the adapters' AdamW state; every rank's backward writes all
                // of their gradients (reduce-scattered in the update). The adapters and their
                // gradients stay f32 at every precision, as PEFT's under autocast.
                let own = if self.zero.stage > 0 { len / self.comm.world() } else { len };
                let (grads, m, v) = (z(vec![len], f32)?, z(vec![own], f32)?, z(vec![own], f32)?);
                self.train = Some(TrainBufs { grads, buckets: None, m, v });
                self.wire_lora();
                return self.remake_acts();
            }
            // Gradients in the activations' dtype (bf16 as llm.c's), AdamW's moments f32.
            let (grads, m, v) =
                (z(self.zero.parts_at(2), gdt)?, z(self.zero.parts_at(1), f32)?, z(self.zero.parts_at(1), f32)?);
            let buckets = if self.zero.stage >= 2 {
                let (e, b) = (self.zero.outer_bucket().1, self.zero.block_bucket().1);
                let whole = z(self.zero.bucket_parts(), gdt)?;
                Some((whole.prefix(e), whole.slice(e..e + b)))
            } else {
                None
            };
            self.train = Some(TrainBufs { grads, buckets, m, v });
            // Activations sized before training lack the backward buffers.
            self.remake_acts()?;
        }
        Ok(())
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

    /// Compute in `precision` ([`Precision`]). bf16: the parameters the passes read, the
    /// gradients and the activations become bf16; with `master_weights` (llm.c's `-w 1`) the
    /// f32 parameters stay as master weights that AdamW updates, and the bf16 copy is written
    /// from them after each update, rounded stochastically; without (`-w 0`) the parameters
    /// themselves are bf16 and AdamW rounds its updates into them stochastically. A LoRA
    /// run's frozen base needs no master weights. Call once, before
    /// [`Model::alloc_training_state`].
    pub fn set_precision(&mut self, precision: Precision, master_weights: bool) -> Result<()> {
        if precision == self.precision {
            return Ok(());
        }
        if self.train.is_some() || self.precision != Precision::Fp32 {
            bail!("the precision is set once, before the training state is allocated");
        }
        if !self.be.supports_bf16() {
            bail!(
                "--precision bf16 needs bf16 buffers, which this backend lacks ({}): use --precision fp32",
                self.be.describe()
            );
        }
        let keep_f32 = master_weights && self.lora.is_none();
        let bf = self.be.alloc_parts(&self.zero.parts_at(3), DType::BF16)?;
        if keep_f32 {
            Ops::new(&mut *self.be).convert(bf, self.params, None);
        } else {
            // The f32 copy goes: handed back as it is converted (a 1B model's frozen base then
            // peaks at its 5 GB of f32, not at 7.5 GB).
            Ops::new(&mut *self.be).convert_consuming(bf, self.params);
        }
        if let Some(g) = self.gathered.take() {
            // ZeRO-3 gathers the bf16 shards the passes read: a bf16 gathering buffer.
            self.be.free(g.whole);
            self.gathered = Some(Gathered::alloc(&mut *self.be, &self.zero, DType::BF16)?);
        }
        if keep_f32 {
            self.work = Some(bf);
        } else {
            self.be.free(self.params);
            self.params = bf;
        }
        self.precision = precision;
        self.remake_acts()
    }

    /// Draw the family's random init (as [`Weights::random`] with `seed`) straight into the
    /// parameters, in their precision, a piece at a time: for a model built from
    /// [`Weights::zeros`], whose zero pages were never touched, so that a bf16 model's random
    /// fp32 values never exist whole (a 1B model's frozen bf16 base then peaks at its 2.5 GB,
    /// not at the 5 GB of its fp32 values). The same values as building from
    /// `Weights::random(config, seed)`, rounded as [`Model::set_precision`] rounds them. Not
    /// under ZeRO-3, whose ranks hold shards: there, build from `Weights::random`.
    pub fn init_random(&mut self, seed: u32) -> Result<()> {
        let arch = self.arch;
        self.write_params("a random init in place", |sink| {
            arch.init(sink, &mut crate::rng::Mt19937::new(seed));
            Ok(())
        })
    }

    /// Read a Hugging Face checkpoint's weights into this model (built from zero weights of its
    /// shape, as [`Model::init_random`]), in pieces, straight into its precision: a bf16
    /// model's fp32 values never exist whole. The same values as building from
    /// [`crate::hf::load_hf`]'s weights, rounded as [`Model::set_precision`] rounds them.
    /// Returns the weights' [`crate::lora::weights_hash`] (a LoRA base's identity).
    pub fn load_hf(&mut self, ck: &mut crate::hf::HfCheckpoint) -> Result<String> {
        if !ck.config().same_shape(&self.config) {
            bail!("load_hf: a checkpoint of shape {} into a model of {}", ck.config(), self.config);
        }
        let mut hash = String::new();
        self.write_params("reading weights in place", |sink| {
            hash = ck.read_into(sink)?;
            Ok(())
        })?;
        Ok(hash)
    }

    /// Write every parameter through `f` (an [`crate::params::InitSink`] over the parameters;
    /// with master weights, the bf16 working copy is theirs, rounded to nearest after).
    fn write_params(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut dyn crate::params::InitSink) -> Result<()>,
    ) -> Result<()> {
        if self.zero.stage == 3 {
            bail!("{what} needs the whole parameters on each rank (ZeRO 0-2)");
        }
        struct Sink<'a> {
            be: &'a mut dyn Backend,
            params: Buf,
            layout: &'a ParamLayout,
            config: &'a ModelConfig,
        }
        impl crate::params::InitSink for Sink<'_> {
            fn config(&self) -> &ModelConfig {
                self.config
            }
            fn layout(&self) -> &ParamLayout {
                self.layout
            }
            fn fill(&mut self, r: std::ops::Range<usize>, value: f32) {
                self.be.fill(self.params.slice(r), value)
            }
            fn write(&mut self, at: usize, x: &[f32]) {
                self.be.upload(self.params.slice(at..at + x.len()), x)
            }
        }
        let mut sink = Sink { be: &mut *self.be, params: self.params, layout: &self.layout, config: &self.config };
        f(&mut sink)?;
        if let Some(work) = self.work {
            // Master weights: the bf16 working copy is theirs, rounded to nearest.
            Ops::new(&mut *self.be).convert(work, self.params, None);
        }
        Ok(())
    }

    /// The precision ([`Model::set_precision`]) and whether there are master weights.
    pub fn precision(&self) -> (Precision, bool) {
        (self.precision, self.work.is_some())
    }

    /// The dtype of activations and gradients.
    fn act_dtype(&self) -> DType {
        match self.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Recompute level `level` (llm.c's `-r`; [`crate::acts::MAX_RECOMPUTE`] at most): 1 keeps
    /// one MLP activation buffer for all layers instead of one per layer and recomputes it in
    /// each block's backward, 2 the norms' outputs too. Every loss and gradient is the same
    /// bits as at 0; the memory saved costs a few element-wise passes per step. Activations
    /// already sized are made again at the same capacity.
    pub fn set_recompute(&mut self, level: u8) -> Result<()> {
        if level > crate::acts::MAX_RECOMPUTE {
            bail!("-r {level}: the recompute levels are 0 (none), 1 (the MLP activation) and 2 (+ the norms' outputs)");
        }
        self.plan = self.arch.acts(&self.config).with_recompute(level);
        self.remake_acts()
    }

    /// Make this a LoRA run ([`crate::lora`]): the base parameters are frozen (no gradients,
    /// no AdamW state: backward computes only what the adapters and the inputs need) and the
    /// adapters are added to the projections they adapt in every pass. Call before
    /// [`Model::alloc_training_state`]. Every backend runs it, as one process or over ranks:
    /// the adapters and their gradients are every rank's; ZeRO-1..3 shard their AdamW state
    /// and update, and ZeRO-3 shards the frozen base as in a full run.
    pub fn set_lora(&mut self, adapters: &crate::lora::Adapters) -> Result<()> {
        if self.lora.is_some() || self.train.is_some() {
            bail!("LoRA adapters are set once, before the training state is allocated");
        }
        if let Some(work) = self.work.take() {
            // A frozen base needs no master weights: keep its bf16 copy only.
            self.be.free(self.params);
            self.params = work;
        }
        let all = crate::lora::linear_modules(&self.config);
        if let Some(t) = adapters.targets.iter().find(|t| !all.contains(t)) {
            bail!("LoRA target {} is not a projection of this model", t.module);
        }
        // Padded to a multiple of the ranks, so that ZeRO-1..3 can shard their AdamW state.
        let len = adapters.num_parameters();
        let world = self.comm.world();
        let params = self.be.alloc(len.div_ceil(world).max(1) * world, DType::F32)?;
        self.be.fill(params, 0.0);
        self.be.upload(params.prefix(len), &adapters.data);
        // The frozen tensors that backward still writes (norms, biases): disjoint slices of one
        // sink, as large as the larger of a block's and the outer tensors' sets.
        let small = |ids: Vec<TensorId>| -> usize {
            ids.into_iter()
                .filter(|&t| self.layout.spec(t).shape.len() < 2)
                .map(|t| self.layout.spec(t).numel_per_layer())
                .sum()
        };
        let sink_len = small(self.layout.block_ids()).max(small(self.layout.outer_ids())).max(1);
        let sink = self.be.alloc(sink_len, DType::F32)?;
        // Backward adds to it (the norms' weight gradients): finite, never read.
        self.be.fill(sink, 0.0);
        // Workspaces for a pass over the activations' positions or a KV cache's (at most maxT).
        let n = self.acts.as_ref().map_or(0, |a| a.cap_b * a.cap_t).max(self.config.max_seq_len);
        let scratch = self.be.alloc(2 * n * adapters.r, DType::F32)?;
        let meta = crate::lora::Adapters { data: vec![], ..adapters.clone() };
        self.lora = Some(LoraState { meta, params, blocks: vec![], sink, scratch, kept: None });
        self.wire_lora();
        self.last = Last::default();
        Ok(())
    }

    /// The LoRA run's adapters (rank, alpha, targets; no values), if any.
    pub fn lora(&self) -> Option<&crate::lora::Adapters> {
        self.lora.as_ref().map(|lo| &lo.meta)
    }

    /// A host copy of the adapters' values.
    pub fn read_adapters(&mut self) -> Result<Vec<f32>> {
        let lo = self.lora.as_ref().context("not a LoRA run")?;
        let b = lo.params.prefix(lo.meta.num_parameters());
        let mut out = vec![0f32; b.len];
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// Tell every block's ops where its adapters, their gradients and workspaces are.
    fn wire_lora(&mut self) {
        let grads = self.train.map(|tr| tr.grads);
        // The weight as the block's pass sees it: a view of the parameters, or under ZeRO-3 of
        // the one-block buffer every layer's weights are gathered into.
        let gathered = self.gathered.map(|g| self.zero.block_bucket().0.map(|r| g.block.slice(r.clone())));
        let Some(lo) = &mut self.lora else { return };
        let scratch = lo.scratch;
        let (h, dh) = (scratch.prefix(scratch.len / 2), scratch.slice(scratch.len / 2..scratch.len));
        let per_target = lo.kept.map_or(0, |k| k.len / lo.meta.targets.len().max(1));
        let mut blocks: Vec<BlockLora> =
            (0..self.config.num_layers).map(|_| BlockLora { adapters: vec![], h, dh }).collect();
        for (i, t) in lo.meta.targets.iter().enumerate() {
            let (ra, rb) = (lo.meta.a_range(i), lo.meta.b_range(i));
            blocks[t.layer].adapters.push(Adapter {
                weight: match &gathered {
                    Some(v) => v[t.tensor],
                    None => self.params.slice(self.layout.layer(t.tensor, t.layer)),
                },
                a: lo.params.slice(ra.clone()),
                b: lo.params.slice(rb.clone()),
                grads: grads.map(|g| (g.slice(ra), g.slice(rb))),
                kept_h: lo.kept.map(|k| k.slice(i * per_target..(i + 1) * per_target)),
                r: lo.meta.r,
                row0: t.row0,
                rows: t.rows,
                scale: lo.meta.scale(),
            });
        }
        lo.blocks = blocks;
    }

    /// Run the classifier (the head's GEMM, the cross-entropy and their backward) `rows`
    /// positions at a time (0: all B*T at once, the default), so that the logits buffer holds
    /// (rows, Vp) instead of (B*T, Vp): 4.2 GB less for Llama 3's 128,256 tokens at B=4,
    /// T=1024 with 256 rows. The backward computes each chunk's logits again (one more head
    /// GEMM per step). Losses and every gradient but the head's are the same bits; the head's
    /// gradient adds its chunks in another order. A forward without targets computes only the
    /// logits [`Model::logits_at`] reads.
    pub fn set_classifier_rows(&mut self, rows: usize) -> Result<()> {
        if rows > 0 && rows < MIN_CLASSIFIER_ROWS {
            bail!(
                "--ce-rows {rows}: the classifier's chunks are at least {MIN_CLASSIFIER_ROWS} rows (0 = all at once)"
            );
        }
        self.ce_rows = rows;
        self.remake_acts()
    }

    /// The recompute level ([`Model::set_recompute`]).
    pub fn recompute(&self) -> u8 {
        self.plan.recompute
    }

    /// Make sure activations can hold a pass over (b, t) (with the backward buffers once there
    /// is training state). Allocates only when they cannot.
    pub fn reserve(&mut self, b: usize, t: usize) -> Result<()> {
        let backward = self.train.is_some();
        if self.acts.as_ref().is_some_and(|a| a.fits(b, t, backward)) {
            return Ok(());
        }
        let (cb, ct) = self.acts.as_ref().map_or((b, t), |a| (a.cap_b.max(b), a.cap_t.max(t)));
        // A bound on every activation size Acts computes, so that none of them overflows.
        let cfg = &self.config;
        let widths = self.plan.fwd.iter().chain(&self.plan.back).map(|s| match s.width {
            crate::acts::Width::Pos(w) => w,
            crate::acts::Width::Heads(k) => k.saturating_mul(cfg.num_heads),
        });
        let wide = widths.fold(cfg.padded_vocab_size, usize::saturating_add);
        let per_position = wide.checked_mul(16 * (cfg.num_layers + 2));
        if per_position.and_then(|p| cb.checked_mul(ct)?.checked_mul(p)).is_none() {
            bail!("B={cb} x T={ct} is far more than any machine can hold activations for; lower -b or -t");
        }
        if let Some(a) = self.acts.take() {
            a.free(&mut *self.be);
        }
        let rows = if self.ce_rows == 0 { cb * ct } else { self.ce_rows };
        let dtype = self.act_dtype();
        let acts = Acts::new(&mut *self.be, &self.config, &self.plan, cb, ct, backward, rows, dtype);
        let hint = if self.plan.recompute < crate::acts::MAX_RECOMPUTE {
            ", or keep fewer with -r 2 (README: Memory)"
        } else {
            ""
        };
        self.acts = Some(acts.with_context(|| format!("activations for B={cb} x T={ct}: lower -b or -t{hint}"))?);
        if let Some(r) = self.lora.as_ref().map(|lo| lo.meta.r) {
            // Adapters' (N, R) workspaces for a pass over the activations' positions or a KV
            // cache's (at most maxT).
            let n = (cb * ct).max(self.config.max_seq_len);
            let old = self.lora.as_ref().expect("checked").scratch;
            if old.len < 2 * n * r {
                self.be.free(old);
                let scratch = self.be.alloc(2 * n * r, DType::F32)?;
                self.lora.as_mut().expect("checked").scratch = scratch;
                self.wire_lora();
            }
            // Each adapter's h for the backward: (B*T, R) a target.
            let targets = self.lora.as_ref().expect("checked").meta.targets.len();
            let kept = self.lora.as_ref().expect("checked").kept;
            if backward && kept.is_none_or(|k| k.len < targets * cb * ct * r) {
                if let Some(k) = kept {
                    self.be.free(k);
                }
                let k = self.be.alloc(targets * cb * ct * r, DType::F32)?;
                self.lora.as_mut().expect("checked").kept = Some(k);
                self.wire_lora();
            }
        }
        Ok(())
    }

    // ---- KV-cached inference --------------------------------------------------------------

    /// A KV cache for one sequence of up to `positions` tokens (at most maxT), fed at most
    /// `chunk` tokens per call. Release it with [`Model::free_kv_cache`] when done.
    pub fn kv_cache(&mut self, positions: usize, chunk: usize) -> Result<KvCache> {
        let max_t = self.config.max_seq_len;
        if positions == 0 || positions > max_t || chunk == 0 {
            bail!("a KV cache holds 1 to {max_t} positions (asked: {positions}, chunks of {chunk})");
        }
        let dtype = self.act_dtype();
        KvCache::new(&mut *self.be, &self.config, &self.plan, positions, chunk.min(positions), dtype)
    }

    pub fn free_kv_cache(&mut self, cache: KvCache) {
        cache.wholes.iter().for_each(|&w| self.be.free(w));
        self.be.free(cache.tokens);
    }

    /// Feed `tokens` after the cached positions (in chunks); returns the first V logits of the
    /// last one, read to the host once. Under ZeRO-3 a collective, as [`Model::forward`].
    pub fn forward_cached<'a>(&mut self, cache: &'a mut KvCache, tokens: &[u32]) -> Result<&'a [f32]> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, vp) = (cfg.channels, cfg.padded_vocab_size);
        if tokens.is_empty() {
            bail!("nothing to feed");
        }
        if cache.pos + tokens.len() > cache.capacity {
            bail!(
                "the sequence would exceed the KV cache's {} positions (the model's context is {})",
                cache.capacity,
                cfg.max_seq_len
            );
        }
        check_tokens(&cfg, tokens, None, 1, tokens.len())?;
        let mut tn = 0;
        let chunks = tokens.len().div_ceil(cache.chunk);
        for (i, chunk) in tokens.chunks(cache.chunk).enumerate() {
            let o = self.outer_weights()?;
            let pos = cache.pos;
            tn = chunk.len();
            let ids = cache.tokens.prefix(tn);
            self.be.upload_u32(ids, chunk);
            let s = Seq { b: 1, t: tn };
            arch.embed(&mut Ops::new(&mut *self.be), &cfg, &o, cache.stream.prefix(tn * c), ids, s, pos);
            for l in 0..cfg.num_layers {
                let w = self.block_weights(l)?;
                let (x, k, v) = cache.layer(l, tn);
                // Only the last position's logits are read: the last layer of the last chunk
                // computes the rest of its block for that position alone.
                let keep = if i + 1 == chunks && l + 1 == cfg.num_layers { 1 } else { tn };
                let attn = Attn::Cached { k, v, pos, cap: cache.capacity, keep };
                let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
                arch.block_forward(&mut Ops::new(&mut *self.be).with_lora(lora), &cfg, &self.consts, &w, &x, tn, attn);
            }
            cache.pos += tn;
        }
        // Only the last position's logits are needed.
        let last = cache.stream.slice((tn - 1) * c..tn * c);
        let o = self.outer_weights()?;
        let mut ops = Ops::new(&mut *self.be);
        let norm = NormActs { out: cache.lnf, mean: cache.lnf_mean, rstd: cache.lnf_rstd };
        arch.final_norm(&mut ops, &cfg, &o, &norm, last, 1);
        let (logits, head) = (cache.logits, o[arch.head(&cfg)]);
        ops.charged_to(Kind::Classifier, |ops| {
            ops.matmul_forward(logits, norm.out, head, None, Mat { n: 1, c, oc: vp })
        });
        self.be.download(cache.logits.prefix(cfg.vocab_size), &mut cache.host_logits)?;
        Ok(&cache.host_logits)
    }

    // ---- host copies ------------------------------------------------------------------------

    fn slot(&self, slot: Slot) -> Result<Buf> {
        Ok(match slot {
            Slot::Params => self.params,
            _ => {
                let tr = self.train.with_context(|| format!("{slot:?} need training state"))?;
                match slot {
                    Slot::Grads => tr.grads,
                    Slot::AdamM => tr.m,
                    _ => tr.v,
                }
            }
        })
    }

    /// Values of a slot as this rank holds it: num_parameters, or this rank's shard
    /// (num_parameters / world) where the ZeRO stage shards the slot.
    pub fn slot_len(&self, slot: Slot) -> Result<usize> {
        Ok(if slot == Slot::Params { self.layout.num_parameters } else { self.slot(slot)?.len })
    }

    /// A host copy of one tensor of a slot (llm.c order, all layers); of the parameters (under
    /// ZeRO-3 gathered: a collective), or of a slot this rank holds whole.
    pub fn read_tensor(&mut self, slot: Slot, t: impl Into<TensorId>) -> Result<Vec<f32>> {
        let t = t.into();
        if slot == Slot::Params && self.zero.stage == 3 {
            return Ok(self.read_all(slot)?[self.layout.range(t)].to_vec());
        }
        let b = self.slot(slot)?;
        if b.len != self.layout.num_parameters {
            bail!("{slot:?} is sharded over the ranks (ZeRO stage {}): read the shard with read_all", self.zero.stage);
        }
        let b = b.slice(self.layout.range(t));
        let mut out = vec![0f32; b.len];
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// A host copy of a whole slot as this rank holds it ([`Model::slot_len`]: llm.c order, or
    /// the shard layout of [`crate::zero`]). The parameters come whole: under ZeRO-3 they are
    /// gathered, a collective that every rank must call.
    pub fn read_all(&mut self, slot: Slot) -> Result<Vec<f32>> {
        if slot == Slot::Params && self.zero.stage == 3 {
            return Ok(self.gather_params(self.params, true)?.expect("kept"));
        }
        let b = self.slot(slot)?;
        let mut out = crate::mem::zeroed(b.len);
        self.be.download(b, &mut out)?;
        Ok(out)
    }

    /// ZeRO-3: every piece of `shards` (the parameters, or a bf16 run's working copy, in the
    /// shard layout) gathered from the ranks (a collective), into host memory when `keep`.
    fn gather_params(&mut self, shards: Buf, keep: bool) -> Result<Option<Vec<f32>>> {
        let g = self.gathered.context("the parameters are not sharded")?;
        let mut out = if keep { Some(crate::mem::zeroed::<f32>(self.layout.num_parameters)) } else { None };
        self.forget_gathered(); // the gathering buffer is overwritten
                                // Through the gathering buffer where it has the shards' dtype; else (a bf16 run's f32
                                // master weights) through a buffer of the largest piece for the while.
        let largest = self.pieces.iter().map(|p| p.full.len()).max().unwrap_or(0);
        let staging = if g.whole.dtype == shards.dtype { None } else { Some(self.be.alloc(largest, shards.dtype)?) };
        let mut gather = || -> Result<()> {
            for p in &self.pieces {
                let dst = staging.unwrap_or(g.whole).prefix(p.full.len());
                self.comm.all_gather(&mut *self.be, shards.slice(p.shard.clone()), dst)?;
                if let Some(o) = &mut out {
                    self.be.download(dst, &mut o[p.full.clone()])?;
                }
            }
            Ok(())
        };
        let r = gather();
        if let Some(b) = staging {
            self.be.free(b);
        }
        r.map(|()| out)
    }

    /// Overwrite a whole slot from the host, in the layout [`Model::read_all`] gives. Under
    /// ZeRO-3 each rank keeps its part of the parameters.
    pub fn write_all(&mut self, slot: Slot, data: &[f32]) -> Result<()> {
        let b = self.slot(slot)?;
        let want = self.slot_len(slot)?;
        if data.len() != want {
            bail!("{} values for {slot:?}, the model has {want} here", data.len());
        }
        if slot == Slot::Params && self.zero.stage == 3 {
            for p in &self.pieces {
                self.be.upload(b.slice(p.shard.clone()), &data[p.owned.clone()]);
            }
            self.forget_gathered();
        } else {
            self.be.upload(b, data);
        }
        if let (Slot::Params, Some(work)) = (slot, self.work) {
            Ops::new(&mut *self.be).convert(work, self.params, None);
        }
        Ok(())
    }

    /// Overwrite the parameters from this rank's part of them in the shard layout (llm.c's fp32
    /// master weights in a ZeRO-1 state file); the parts are then all-gathered (a collective)
    /// unless the stage keeps parameters sharded. A bf16 run's working copy is left as it is:
    /// the checkpoint's model file holds it (exact resume).
    pub fn write_param_shard(&mut self, shard: &[f32]) -> Result<()> {
        if self.zero.stage == 0 {
            if shard.len() != self.layout.num_parameters {
                bail!("{} values for the parameters, the model has {}", shard.len(), self.layout.num_parameters);
            }
            self.be.upload(self.params, shard);
            return Ok(());
        }
        if shard.len() != self.zero.shard_len() {
            bail!("{} values for this rank's part of the parameters, expected {}", shard.len(), self.zero.shard_len());
        }
        for p in &self.pieces {
            let own = self.params.slice(if self.zero.stage == 3 { p.shard.clone() } else { p.owned.clone() });
            self.be.upload(own, &shard[p.shard.clone()]);
            if self.zero.stage < 3 {
                self.comm.all_gather(&mut *self.be, own, self.params.slice(p.full.clone()))?;
            }
        }
        self.forget_gathered();
        Ok(())
    }

    /// This rank's part of the parameters in the shard layout ([`Model::write_param_shard`]'s
    /// input): a bf16 run's master weights for its state file.
    pub fn read_param_shard(&mut self) -> Result<Vec<f32>> {
        if self.zero.stage == 0 {
            return self.read_all(Slot::Params);
        }
        let mut out = crate::mem::zeroed::<f32>(self.zero.shard_len());
        for p in &self.pieces {
            let own = self.params.slice(if self.zero.stage == 3 { p.shard.clone() } else { p.owned.clone() });
            self.be.download(own, &mut out[p.shard.clone()])?;
        }
        Ok(out)
    }

    /// The parameters as host [`Weights`] (for model files and export): those the passes read
    /// (a bf16 run's working copy, not its master weights); under ZeRO-3 a collective.
    pub fn weights(&mut self) -> Result<Weights> {
        let data = match self.work {
            Some(w) if self.zero.stage == 3 => self.gather_params(w, true)?.expect("kept"),
            Some(w) => {
                let mut out = crate::mem::zeroed(w.len);
                self.be.download(w, &mut out)?;
                out
            }
            None => self.read_all(Slot::Params)?,
        };
        Ok(Weights { config: self.config, layout: self.layout.clone(), data })
    }

    /// [`Model::weights`] on rank 0 only (None elsewhere): every rank calls it, only rank 0
    /// holds a host copy (the checkpoint's model file).
    pub fn weights_on_rank0(&mut self) -> Result<Option<Weights>> {
        let rank0 = self.comm.rank() == 0;
        if self.zero.stage == 3 {
            let data = self.gather_params(self.work.unwrap_or(self.params), rank0)?;
            return Ok(data.map(|data| Weights { config: self.config, layout: self.layout.clone(), data }));
        }
        if rank0 {
            self.weights().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Whether the parameters and the AdamW moments are finite on every rank (a collective,
    /// so that all ranks agree to write a checkpoint or not).
    pub fn state_finite(&mut self) -> Result<(bool, bool)> {
        let be = &mut *self.be;
        let finite = |be: &mut dyn Backend, b: Buf| read_host(be, b, |h| h.iter().all(|x| x.is_finite()));
        // A LoRA run's base never changes: its adapters are what could diverge.
        let params = self.lora.as_ref().map_or(self.params, |lo| lo.params);
        let mut bad = [!finite(be, params)? as u8 as f32, 0.0];
        if let Some(tr) = self.train {
            bad[1] = !(finite(be, tr.m)? && finite(be, tr.v)?) as u8 as f32;
        }
        be.upload(self.flags, &bad);
        self.comm.all_reduce(be, self.flags, Reduce::Sum)?;
        be.download(self.flags, &mut bad)?;
        Ok((bad[0] == 0.0, bad[1] == 0.0))
    }

    /// The first V logits of position `row` (0..b*t) of the last forward pass.
    pub fn logits_at(&mut self, row: usize) -> Result<Vec<f32>> {
        let (v, vp) = (self.config.vocab_size, self.config.padded_vocab_size);
        let Last { b, t, logits: true, .. } = self.last else { bail!("no logits: run a forward pass first") };
        if row >= b * t {
            bail!("position {row} is outside the last pass's {} positions", b * t);
        }
        let a = self.acts.clone().context("no activations")?;
        let mut out = vec![0f32; v];
        if a.logit_rows >= b * t {
            self.be.download(a.logits.slice(row * vp..row * vp + v), &mut out)?;
        } else {
            // A chunked classifier keeps no pass's logits whole: compute this row's (the
            // gathered embedding is still valid after the forward: no collective here).
            let (c, cfg) = (self.config.channels, self.config);
            let head = self.outer_weights()?[self.arch.head(&cfg)];
            let x = a.norm(b * t).out.slice(row * c..(row + 1) * c);
            let mut ops = Ops::new(&mut *self.be);
            let logits = a.logits.prefix(vp);
            ops.charged_to(Kind::Classifier, |ops| ops.matmul_forward(logits, x, head, None, Mat { n: 1, c, oc: vp }));
            self.be.download(logits.prefix(v), &mut out)?;
        }
        Ok(out)
    }

    /// The per-position losses (b*t) of the last forward pass with targets.
    pub fn losses(&mut self) -> Result<Vec<f32>> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no losses: run a forward pass with targets first")
        };
        let a = self.acts.as_ref().context("no activations")?;
        let mut out = vec![0f32; b * t];
        self.be.download(a.losses.prefix(b * t), &mut out)?;
        Ok(out)
    }

    /// Add `weight * mean loss` of the last forward pass (with targets) to the loss accumulator.
    pub fn accumulate_loss(&mut self, weight: f32) -> Result<()> {
        let Last { b, t, losses: true, .. } = self.last else {
            bail!("no loss: run a forward pass with targets first")
        };
        let a = self.acts.as_ref().context("no activations")?;
        self.be.accumulate_mean(self.stats.prefix(1), a.losses.prefix(b * t), weight);
        Ok(())
    }

    /// Read the loss accumulator and set it back to 0 (one host read).
    pub fn take_loss(&mut self) -> Result<f32> {
        let mut s = [0f32];
        self.be.download(self.stats.prefix(1), &mut s)?;
        self.be.fill(self.stats.prefix(1), 0.0);
        Ok(s[0])
    }

    /// [`Model::take_loss`] of the accumulator averaged over the ranks (validation, where each
    /// rank evaluates its part of every batch).
    pub fn take_mean_loss(&mut self) -> Result<f32> {
        self.comm.all_reduce(&mut *self.be, self.stats.prefix(1), Reduce::Mean)?;
        self.take_loss()
    }

    /// The mean loss of one batch: forward, then read it (evaluation and tests).
    pub fn loss(&mut self, inputs: &[u32], targets: &[u32], b: usize, t: usize) -> Result<f32> {
        self.take_loss()?;
        self.forward(inputs, Some(targets), b, t)?;
        self.accumulate_loss(1.0)?;
        self.take_loss()
    }

    // ---- profiling --------------------------------------------------------------------------

    pub fn set_profiling(&mut self, on: bool) {
        self.be.set_profiling(on);
    }

    pub fn profile_totals(&mut self) -> Result<Vec<(crate::profile::Kind, f64)>> {
        self.be.profile_totals()
    }

    /// Wait for all queued work (for timing).
    pub fn synchronize(&mut self) -> Result<()> {
        self.be.synchronize()
    }
}

/// Clip (if the global norm exceeds `grad_clip`) and apply AdamW for 0-based `step`, then read
/// the step's loss and the gradient norm before clipping.
pub fn optimizer_step(model: &mut Model, o: &OptimConfig, lr: f32, step: usize) -> Result<StepStats> {
    model.update(o, lr, step, SkipAbove::NON_FINITE)?;
    model.step_stats()
}

/// Shapes and token ids of a batch, checked on the host before anything reaches the device.
/// The fewest rows of a classifier chunk: a single row would go through the one-row GEMV,
/// which adds its products in another order than the GEMM, so its loss would change by a
/// rounding; with 3 rows or more the chunks can always be cut with none of a single row.
pub const MIN_CLASSIFIER_ROWS: usize = 3;

/// The gradient views of a frozen model's tensors `ranges` (a block's or the outer ones): a
/// matrix's is [`FROZEN`] (its GEMM gradient is not computed), the others' disjoint slices of
/// `sink`, which nothing reads.
fn frozen_grads(layout: &ParamLayout, ranges: View<std::ops::Range<usize>>, sink: Buf) -> View<Buf> {
    let mut off = 0;
    View(
        layout
            .ids()
            .zip(&ranges.0)
            .map(|(t, r)| {
                if layout.spec(t).shape.len() >= 2 || r.is_empty() {
                    return if r.is_empty() { sink.prefix(0) } else { FROZEN };
                }
                off += r.len();
                sink.slice(off - r.len()..off)
            })
            .collect(),
    )
}

/// The seed of the stochastic rounding of step `step`'s bf16 parameters: a function of the
/// step alone, so a resumed run rounds as the uninterrupted one.
fn rounding_seed(step: usize) -> u32 {
    (step as u32).wrapping_mul(0x9E37_79B9) ^ 0x6A09_E667
}

/// The classifier's chunks over `n` positions as (first row, rows): `rows` at a time, except
/// that a last chunk of a single row (see [`MIN_CLASSIFIER_ROWS`]) takes one row from the
/// chunk before it. `rows` >= 3 or >= n.
fn classifier_chunks(n: usize, rows: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = (0..n).step_by(rows.max(1)).map(|r0| (r0, rows.min(n - r0))).collect();
    if let [.., (_, before), (last0, last)] = v.as_mut_slice() {
        if *last == 1 && *before >= MIN_CLASSIFIER_ROWS {
            *before -= 1;
            *last0 -= 1;
            *last = 2;
        }
    }
    v
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

#[cfg(test)]
mod tests {
    use super::*;

    fn model(desc: &str, seed: u32) -> Model {
        Model::new(Weights::random(ModelConfig::from_descriptor(desc).unwrap(), seed).unwrap(), Device::Cpu).unwrap()
    }

    /// A random init drawn in place (Model::init_random on zero weights) gives every family the
    /// parameters of Weights::random with the same seed: in fp32, and in bf16 with and without
    /// master weights (then rounded to nearest, as set_precision rounds them).
    #[test]
    fn random_init_in_place_equals_random_weights() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let round =
            |v: &[f32]| v.iter().map(|&x| crate::cpu::bf16::to_f32(crate::cpu::bf16::from_f32(x))).collect::<Vec<_>>();
        for desc in ["2x32:2:16", "llama:2x32:4:2", "qwen2:3x24:4:2:40:16", "qwen3:3x24:4:2:8:40:16"] {
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            let want = Weights::random(cfg, 5).unwrap();
            assert!(want.data.iter().any(|&x| x != 0.0 && x != 1.0), "{desc}: the init draws values");
            for (precision, master) in [(Precision::Fp32, true), (Precision::Bf16, true), (Precision::Bf16, false)] {
                let mut m = Model::new(Weights::zeros(cfg).unwrap(), Device::Cpu).unwrap();
                m.set_precision(precision, master).unwrap();
                m.init_random(5).unwrap();
                let w = if precision == Precision::Fp32 { want.data.clone() } else { round(&want.data) };
                assert!(bits(&m.weights().unwrap().data) == bits(&w), "{desc} {precision} -w {master}");
                if precision == Precision::Bf16 && master {
                    let p = m.read_all(Slot::Params).unwrap();
                    assert!(bits(&p) == bits(&want.data), "{desc}: the fp32 master weights");
                }
            }
        }
    }

    /// A Hugging Face checkpoint read in place (in pieces, into the model's precision) gives
    /// the parameters of the weights load_hf reads, rounded as set_precision rounds them, and
    /// their hash; tied heads (GPT-2, Qwen3 here) are checked against the embedding.
    #[test]
    fn hf_checkpoint_read_in_place_equals_load_hf() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let round =
            |v: &[f32]| v.iter().map(|&x| crate::cpu::bf16::to_f32(crate::cpu::bf16::from_f32(x))).collect::<Vec<_>>();
        for desc in ["2x32:2:16", "llama:2x32:4:2", "qwen3:3x24:4:2:8:40:16"] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            crate::hf::save_hf(&Weights::random(cfg, 5).unwrap(), dir.path(), crate::files::Dtype::F32).unwrap();
            let want = crate::hf::load_hf(dir.path()).unwrap();
            for (precision, master) in [(Precision::Fp32, true), (Precision::Bf16, true), (Precision::Bf16, false)] {
                let mut ck = crate::hf::open_hf(dir.path(), crate::files::Dtype::F32).unwrap();
                let mut m = Model::new(Weights::zeros(ck.config()).unwrap(), Device::Cpu).unwrap();
                m.set_precision(precision, master).unwrap();
                let hash = m.load_hf(&mut ck).unwrap();
                assert_eq!(hash, crate::lora::weights_hash(&want), "{desc}");
                let w = if precision == Precision::Fp32 { want.data.clone() } else { round(&want.data) };
                assert!(bits(&m.weights().unwrap().data) == bits(&w), "{desc} {precision} -w {master}");
            }
        }
    }

    /// zero_grad leaves stale values in the tensors the next backward overwrites; the gradients
    /// must come out bit-identical to clearing everything and accumulating.
    #[test]
    fn zero_grad_then_backward_equals_clearing_everything() {
        let (b, t) = (2, 5);
        let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 50257) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 50257 + 1) as u32).collect();
        let mut grads = vec![];
        for stale in [false, true] {
            let mut m = model("2x32:2:16", 3);
            m.alloc_training_state().unwrap();
            if stale {
                let junk: Vec<f32> = (0..m.num_parameters()).map(|i| (i % 7) as f32 - 3.0).collect();
                m.write_all(Slot::Grads, &junk).unwrap();
                m.zero_grad().unwrap();
            }
            for _ in 0..2 {
                m.forward(&inputs, Some(&targets), b, t).unwrap();
                m.backward(0.5).unwrap();
            }
            grads.push(m.read_all(Slot::Grads).unwrap());
        }
        assert!(grads[0] == grads[1], "gradients differ after zero_grad over stale values");
    }

    /// Recompute (-r 1, 2) refills the shared buffers with the forward's own calls: the losses
    /// and every gradient are the same bits as keeping them per layer, over two steps (the
    /// second reads the first's updated weights), with less activation memory at each level.
    #[test]
    fn recompute_gives_the_same_bits_with_less_memory() {
        let (b, t) = (2, 7);
        for desc in ["3x32:2:16", "llama:3x24:4:2:40:16", "qwen3:3x24:4:2:8:40:16", "qwen2:3x24:4:2:40:16"] {
            let runs: Vec<(Vec<f32>, Vec<f32>, usize)> = (0..=crate::acts::MAX_RECOMPUTE)
                .map(|r| {
                    let mut m = model(desc, 5);
                    m.alloc_training_state().unwrap();
                    m.set_recompute(r).unwrap();
                    let v = m.config.vocab_size;
                    let (mut losses, mut grads) = (vec![], vec![]);
                    for step in 0..2 {
                        let inputs: Vec<u32> = (0..b * t).map(|i| ((i * 7 + step) % v) as u32).collect();
                        let targets: Vec<u32> = (0..b * t).map(|i| ((i * 3 + 1) % v) as u32).collect();
                        m.zero_grad().unwrap();
                        m.forward(&inputs, Some(&targets), b, t).unwrap();
                        losses.extend(m.losses().unwrap());
                        m.backward(1.0).unwrap();
                        grads.extend(m.read_all(Slot::Grads).unwrap());
                        m.update(&OptimConfig::default(), 1e-2, step + 1, SkipAbove::NON_FINITE).unwrap();
                    }
                    (losses, grads, m.memory().activations)
                })
                .collect();
            for (r, run) in runs.iter().enumerate().skip(1) {
                let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same(&run.0, &runs[0].0), "{desc}: -r {r} changed a loss");
                assert!(same(&run.1, &runs[0].1), "{desc}: -r {r} changed a gradient");
                assert!(run.2 < runs[r - 1].2, "{desc}: -r {r} keeps {} bytes, -r {} {}", run.2, r - 1, runs[r - 1].2);
            }
        }
        let mut m = model("1x16:2:16", 1);
        assert!(m.set_recompute(3).unwrap_err().to_string().contains("-r 3"));
    }

    /// The classifier in chunks of rows (3, 5 and 13 of 14 rows: none a divisor, and 13 leaves
    /// a single row, which the chunks cut around): the
    /// same losses, logits and gradients bit for bit, except the head's gradient, whose chunks
    /// add in another order (held to 1e-6 of its largest element); the logits buffer shrinks.
    #[test]
    fn chunked_classifier_gives_the_same_results_with_less_memory() {
        let (b, t) = (2, 7);
        let fp32 = crate::config::Precision::Fp32;
        for (desc, precision) in [
            ("2x32:2:16", fp32),
            ("llama:2x24:4:2:40:16", fp32),
            ("2x32:2:16", crate::config::Precision::Bf16),
            ("llama:2x24:4:2:40:16", crate::config::Precision::Bf16),
        ] {
            let cfg = ModelConfig {
                vocab_size: 1001,
                padded_vocab_size: 1024,
                ..ModelConfig::from_descriptor(desc).unwrap()
            };
            let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 1001) as u32).collect();
            let targets: Vec<u32> = (0..b * t).map(|i| (i * 389 % 1001) as u32).collect();
            let runs: Vec<_> = [0, 3, 5, 13]
                .into_iter()
                .map(|rows| {
                    let mut m = Model::new(Weights::random(cfg, 4).unwrap(), Device::Cpu).unwrap();
                    m.set_precision(precision, true).unwrap();
                    m.alloc_training_state().unwrap();
                    m.set_classifier_rows(rows).unwrap();
                    m.forward(&inputs, None, b, t).unwrap();
                    let logits: Vec<f32> = (0..b * t).flat_map(|r| m.logits_at(r).unwrap()).collect();
                    let mut losses = vec![];
                    for _ in 0..2 {
                        m.forward(&inputs, Some(&targets), b, t).unwrap();
                        losses.extend(m.losses().unwrap());
                        m.backward(0.5).unwrap();
                    }
                    (logits, losses, m.read_all(Slot::Grads).unwrap(), m.memory().activations, m)
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let head = runs[0].4.arch.head(&cfg);
            let layout = runs[0].4.layout().clone();
            // The head's gradient adds its chunks: in fp32 the sums move by rounding; in bf16
            // the gradient is a bf16 buffer, so each chunk's share is rounded as it adds (as
            // llm.c's bf16 gradients round at each micro-batch), a few of bf16's 2^-8 steps.
            let rel = if precision == fp32 { 1e-6 } else { 1.0 / 64.0 };
            for (rows, run) in [3, 5, 13].iter().zip(&runs[1..]) {
                let tol = |x: &[f32]| rel * x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| (a - b).abs() <= tol(y));
                assert!(close(&run.0, &runs[0].0), "{desc} {precision}: logits in chunks of {rows}");
                assert!(bits(&run.1) == bits(&runs[0].1), "{desc}: losses in chunks of {rows}");
                for id in layout.ids() {
                    let (x, y) = (&run.2[layout.range(id)], &runs[0].2[layout.range(id)]);
                    if id == head {
                        assert!(close(x, y), "{desc}: head gradient in chunks of {rows}");
                    } else {
                        assert!(bits(x) == bits(y), "{desc}: {} gradient in chunks of {rows}", layout.spec(id).name);
                    }
                }
                assert!(run.3 < runs[0].3, "{desc}: chunks of {rows} use {} bytes, unchunked {}", run.3, runs[0].3);
            }
        }
        assert_eq!(classifier_chunks(14, 4), [(0, 4), (4, 4), (8, 4), (12, 2)]);
        assert_eq!(classifier_chunks(13, 4), [(0, 4), (4, 4), (8, 3), (11, 2)]);
        assert_eq!(classifier_chunks(7, 3), [(0, 3), (3, 2), (5, 2)]);
        assert_eq!(classifier_chunks(5, 5), [(0, 5)]);
        let mut m = model("1x16:2:16", 1);
        assert!(m.set_classifier_rows(2).unwrap_err().to_string().contains("at least 3 rows"));
    }

    /// The memory planned from the shapes alone is what a model of those settings allocates,
    /// part by part (weights, master weights, gradients, AdamW, activations), in fp32 and bf16,
    /// full and LoRA, at each recompute level and with chunked and whole logits.
    #[test]
    fn planned_memory_is_what_the_model_allocates() {
        use crate::config::Precision::{Bf16, Fp32};
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
                    let targets = crate::lora::select(&cfg, &[]).unwrap();
                    let a = crate::lora::Adapters::new(2, 4.0, targets, &mut crate::rng::Mt19937::new(1)).unwrap();
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

    /// The fused micro-step is the two passes: the same losses, step loss and gradients, bit
    /// for bit, whole and in chunks (where it computes each chunk's logits once, not twice).
    #[test]
    fn forward_backward_is_forward_then_backward() {
        let (b, t) = (2, 7);
        for desc in ["2x32:2:16", "llama:2x24:4:2:40:16"] {
            let cfg = ModelConfig {
                vocab_size: 1001,
                padded_vocab_size: 1024,
                ..ModelConfig::from_descriptor(desc).unwrap()
            };
            let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 1001) as u32).collect();
            let targets: Vec<u32> = (0..b * t).map(|i| (i * 389 % 1001) as u32).collect();
            for rows in [0, 3, 13] {
                let runs: Vec<_> = [false, true]
                    .into_iter()
                    .map(|fused| {
                        let mut m = Model::new(Weights::random(cfg, 4).unwrap(), Device::Cpu).unwrap();
                        m.alloc_training_state().unwrap();
                        m.set_classifier_rows(rows).unwrap();
                        m.zero_grad().unwrap();
                        let mut losses = vec![];
                        for _ in 0..2 {
                            if fused {
                                m.forward_backward(&inputs, &targets, b, t, 0.5).unwrap();
                            } else {
                                m.forward(&inputs, Some(&targets), b, t).unwrap();
                                m.backward(0.5).unwrap();
                            }
                            losses.extend(m.losses().unwrap());
                        }
                        let step = m.step_stats().unwrap();
                        losses.push(step.loss);
                        (losses, m.read_all(Slot::Grads).unwrap())
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&runs[0].0) == bits(&runs[1].0), "{desc} rows {rows}: losses");
                assert!(bits(&runs[0].1) == bits(&runs[1].1), "{desc} rows {rows}: gradients");
            }
        }
    }

    #[test]
    fn cached_logits_match_the_full_forward_pass() {
        // Both families: the last layer of a prompt's last chunk runs past attention on the
        // last position alone, which must not change that position's logits.
        for desc in ["2x24:3:600", "llama:2x24:4:2:40:600"] {
            let cfg =
                ModelConfig { vocab_size: 101, padded_vocab_size: 128, ..ModelConfig::from_descriptor(desc).unwrap() };
            let mut m = Model::new(Weights::random(cfg, 11).unwrap(), Device::Cpu).unwrap();
            // 540 tokens: 530 in chunks of 256 (two whole and one partial), then single tokens.
            let toks: Vec<u32> = (0..540).map(|i| (i * 37 % 101) as u32).collect();
            let mut cache = m.kv_cache(540, 256).unwrap();
            let mut cached = vec![m.forward_cached(&mut cache, &toks[..530]).unwrap().to_vec()];
            for &t in &toks[530..] {
                cached.push(m.forward_cached(&mut cache, &[t]).unwrap().to_vec());
            }
            m.forward(&toks, None, 1, toks.len()).unwrap();
            for (j, pos) in (529..540).enumerate() {
                let full = m.logits_at(pos).unwrap();
                for (a, b) in cached[j].iter().zip(&full) {
                    assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{desc} pos {pos}: {a} vs {b}");
                }
            }
            assert!(m.forward_cached(&mut cache, &[1]).is_err(), "past the cache's capacity");
            assert!(m.kv_cache(601, 1).is_err(), "past the model's context");
            m.free_kv_cache(cache);
        }
    }

    #[test]
    fn a_diverged_step_leaves_the_model_unchanged() {
        let mut m = model("1x16:2:8", 1);
        m.alloc_training_state().unwrap();
        let (x, y) = ([1u32, 2, 3, 4], [2u32, 3, 4, 5]);
        let before = m.read_all(Slot::Params).unwrap();
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(f32::NAN).unwrap(); // a NaN objective: NaN loss and gradients
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove::NON_FINITE).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss.is_nan() && s.skipped);
        assert!(m.read_all(Slot::Params).unwrap() == before, "parameters moved on a NaN step");
        // An outlier: finite, but above the step's limit (llm.c's -sl).
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(1.0).unwrap();
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove { loss: 0.5, norm_sq: f32::INFINITY }).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss > 0.5 && s.skipped, "{s:?}");
        assert!(m.read_all(Slot::Params).unwrap() == before, "parameters moved on a skipped step");
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 1, 4).unwrap();
        m.backward(1.0).unwrap();
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove::NON_FINITE).unwrap();
        let s = m.step_stats().unwrap();
        assert!(s.loss.is_finite() && s.grad_norm > 0.0 && !s.skipped);
        assert!(m.read_all(Slot::Params).unwrap() != before, "a good step moves the parameters");
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

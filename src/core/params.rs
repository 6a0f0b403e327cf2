//! Where every parameter lives in the one flat parameter buffer, and a model's weights in host
//! memory. Plain data: the tensors themselves (names, shapes, which decay) are each family's
//! ([`crate::models`]), handed here as a list of [`TensorSpec`].
//!
//! All parameters (and, with the same layout, their gradients and the AdamW moments) live in one
//! buffer, tensor after tensor in the family's file order, each per-layer tensor stacked over
//! the L blocks, so the optimizer, checkpoints and collectives work on one flat buffer. Code
//! reaches a tensor by its name in the family's enum (`w[Gpt2::QkvW]`, `layout.layer(id, l)`),
//! never by an offset computed at the call site. The parameter count is computed here and
//! nowhere else.

use crate::core::config::ModelConfig;
use crate::core::rng::Mt19937;
use anyhow::Result;
use std::ops::Range;

/// One tensor of a family, as the family declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// A short name (llm.c's where it has one: `wte`, `qkvw`, ...), for messages.
    pub name: &'static str,
    /// Its shape, per layer for the stacked ones; (out, in) for a projection's weight.
    pub shape: Vec<usize>,
    /// Stacked over the L blocks.
    pub per_layer: bool,
    /// AdamW applies weight decay (the 2-D weights: matrices and embeddings, as llm.c and
    /// PyTorch's `p.dim() >= 2` rule).
    pub decay: bool,
    /// A backward pass writes the whole gradient (a GEMM's weight or bias gradient, or the tied
    /// embedding through the LM head) before anything adds to it, so that the first backward
    /// after `zero_grad` may overwrite instead of add.
    pub whole: bool,
}

impl TensorSpec {
    /// A tensor of one layer's shape, stacked or not, decaying when 2-D.
    pub fn new(name: &'static str, shape: &[usize], per_layer: bool, whole: bool) -> Self {
        TensorSpec { name, shape: shape.to_vec(), per_layer, decay: shape.len() == 2, whole }
    }

    /// This tensor left out of a model (a bias or head the config does not have): it keeps its
    /// place in the family's order and takes no space.
    pub fn absent(self) -> Self {
        TensorSpec { shape: vec![0], decay: false, whole: false, ..self }
    }

    pub fn numel_per_layer(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A tensor by its place in its family's list. Families name theirs with an enum
/// (`Gpt2::QkvW`) that converts into this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorId(pub usize);

impl From<TensorId> for usize {
    fn from(t: TensorId) -> usize {
        t.0
    }
}

/// One value per tensor (or per activation) of a family, indexed by the family's names: the
/// buffers of a block's weights, of its gradients, of its activations. Entries a view does not
/// cover (the tensors outside a block in a block's view) are `T::default()` (an empty range,
/// an empty buffer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View<T>(pub Vec<T>);

impl<T, I: Into<usize>> std::ops::Index<I> for View<T> {
    type Output = T;
    fn index(&self, i: I) -> &T {
        &self.0[i.into()]
    }
}

impl<T> View<T> {
    pub fn map<U>(&self, f: impl FnMut(&T) -> U) -> View<U> {
        View(self.0.iter().map(f).collect())
    }
}

/// Name a family's tensors (or activations) with an enum whose variants are listed in the
/// family's order: `ids!(Gpt2)` lets `Gpt2::QkvW` index a [`View`] and convert into a
/// [`TensorId`].
#[macro_export]
macro_rules! ids {
    ($e:ty) => {
        impl From<$e> for usize {
            fn from(x: $e) -> usize {
                x as usize
            }
        }
        impl From<$e> for $crate::core::params::TensorId {
            fn from(x: $e) -> $crate::core::params::TensorId {
                $crate::core::params::TensorId(x as usize)
            }
        }
    };
}

/// One tensor as transformers stores it, and where its values live in the flat buffer.
pub struct HfTensor {
    /// transformers' name (GPT-2's without the optional `transformer.` prefix).
    pub name: String,
    /// Its elements in the flat parameter buffer (row-major, contiguous).
    pub range: std::ops::Range<usize>,
    /// Its shape as stored.
    pub shape: Vec<usize>,
    /// Stored as the transpose of llmrs's (out, in) (GPT-2's Conv1D weights).
    pub transposed: bool,
}

/// Where every parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    specs: Vec<TensorSpec>,
    num_layers: usize,
    /// Start of each stacked tensor, then the total.
    starts: Vec<usize>,
    pub num_parameters: usize,
}

impl ParamLayout {
    /// The layout of `specs` (a family's tensors, in file order) for `num_layers` blocks.
    pub fn new(specs: Vec<TensorSpec>, num_layers: usize) -> Self {
        let mut starts = vec![0];
        for s in &specs {
            let n = s.numel_per_layer() * if s.per_layer { num_layers } else { 1 };
            starts.push(starts.last().unwrap() + n);
        }
        let num_parameters = *starts.last().unwrap();
        ParamLayout { specs, num_layers, starts, num_parameters }
    }

    /// Every tensor, in file order.
    pub fn ids(&self) -> impl Iterator<Item = TensorId> + '_ {
        (0..self.specs.len()).map(TensorId)
    }

    /// How many tensors the family has.
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    pub fn spec(&self, t: impl Into<TensorId>) -> &TensorSpec {
        &self.specs[t.into().0]
    }

    /// The tensor named `name` (see [`TensorSpec::name`]).
    pub fn find(&self, name: &str) -> Option<TensorId> {
        self.specs.iter().position(|s| s.name == name).map(TensorId)
    }

    /// The layers of a tensor: 0..L when stacked, else 0..1.
    pub fn layers(&self, t: impl Into<TensorId>) -> Range<usize> {
        0..if self.spec(t).per_layer { self.num_layers } else { 1 }
    }

    /// The whole (stacked) tensor.
    pub fn range(&self, t: impl Into<TensorId>) -> Range<usize> {
        let i = t.into().0;
        self.starts[i]..self.starts[i + 1]
    }

    /// Layer `l` of a stacked tensor (for the others, `l` must be 0: the whole tensor).
    pub fn layer(&self, t: impl Into<TensorId>, l: usize) -> Range<usize> {
        let t = t.into();
        let (r, n) = (self.range(t), self.spec(t).numel_per_layer());
        assert!(l < self.layers(t).end, "layer {l} of {} is out of range", self.spec(t).name);
        r.start + l * n..r.start + (l + 1) * n
    }

    /// Block `l`'s tensors (the stacked ones, their layer l); the others empty.
    pub fn block(&self, l: usize) -> View<Range<usize>> {
        View(self.ids().map(|t| if self.spec(t).per_layer { self.layer(t, l) } else { 0..0 }).collect())
    }

    /// The tensors outside the blocks; the stacked ones empty.
    pub fn outer(&self) -> View<Range<usize>> {
        View(self.ids().map(|t| if self.spec(t).per_layer { 0..0 } else { self.range(t) }).collect())
    }

    /// The stacked tensors (a block's), in file order.
    pub fn block_ids(&self) -> Vec<TensorId> {
        self.ids().filter(|&t| self.spec(t).per_layer).collect()
    }

    /// The tensors outside the blocks, in file order.
    pub fn outer_ids(&self) -> Vec<TensorId> {
        self.ids().filter(|&t| !self.spec(t).per_layer).collect()
    }
}

/// Where a family's random init ([`crate::models::family::Arch::init`]) writes: host
/// [`Weights`], or a model's parameters in place, in their own precision and a piece at a time
/// (so that a bf16 model's fp32 values never exist whole). Ranges index the whole parameter
/// vector in [`InitSink::layout`]'s order.
pub trait InitSink {
    fn config(&self) -> &ModelConfig;
    fn layout(&self) -> &ParamLayout;
    /// Elements `r` set to `value`.
    fn fill(&mut self, r: Range<usize>, value: f32);
    /// Elements `at..at + x.len()` set to `x`.
    fn write(&mut self, at: usize, x: &[f32]);
    /// Elements `r` drawn from N(mean, std) by `rng`, as [`Mt19937::normal`] on that slice.
    fn normal(&mut self, r: Range<usize>, rng: &mut Mt19937, mean: f32, std: f32) {
        // Pieces of 4 MiB of f32.
        rng.normal_pieces(r.len(), mean, std, 1 << 20, |at, x| self.write(r.start + at, x));
    }
}

impl InitSink for Weights {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    fn fill(&mut self, r: Range<usize>, value: f32) {
        self.data[r].fill(value)
    }
    fn write(&mut self, at: usize, x: &[f32]) {
        self.data[at..at + x.len()].copy_from_slice(x)
    }
    fn normal(&mut self, r: Range<usize>, rng: &mut Mt19937, mean: f32, std: f32) {
        rng.normal(&mut self.data[r], mean, std)
    }
}

/// A model's parameters in host memory, fp32 in its family's file order: what model files
/// hold, what Hugging Face import and export work on, and what a model on a device is built
/// from. Made by [`crate::models`] (`Weights::zeros`, `Weights::random`), which knows the
/// family's tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub config: ModelConfig,
    pub layout: ParamLayout,
    pub data: Vec<f32>, // (num_parameters)
}

impl Weights {
    /// All parameters zero in `layout` (to be filled), after checking that the machine can
    /// hold them: a model bigger than the machine is an error here, not an abort in the
    /// allocator.
    pub fn zeros_in(config: ModelConfig, layout: ParamLayout) -> Result<Self> {
        let what = format!("the model's {} parameters (fp32, in host memory)", layout.num_parameters);
        crate::core::mem::check_available(layout.num_parameters.saturating_mul(4), &what)?;
        let data = crate::core::mem::zeroed::<f32>(layout.num_parameters);
        Ok(Weights { config, layout, data })
    }

    pub fn num_parameters(&self) -> usize {
        self.layout.num_parameters
    }

    /// The whole (stacked) tensor.
    pub fn tensor(&self, t: impl Into<TensorId>) -> &[f32] {
        &self.data[self.layout.range(t)]
    }
    pub fn tensor_mut(&mut self, t: impl Into<TensorId>) -> &mut [f32] {
        let r = self.layout.range(t);
        &mut self.data[r]
    }
    /// Layer `l` of a tensor ([`ParamLayout::layer`]).
    pub fn layer(&self, t: impl Into<TensorId>, l: usize) -> &[f32] {
        &self.data[self.layout.layer(t, l)]
    }
    pub fn layer_mut(&mut self, t: impl Into<TensorId>, l: usize) -> &mut [f32] {
        let r = self.layout.layer(t, l);
        &mut self.data[r]
    }

    /// The tensor named `name` ([`TensorSpec::name`]), for tools and tests.
    pub fn named(&self, name: &str) -> Option<TensorId> {
        self.layout.find(name)
    }

    /// Refuse weights that hold a NaN or an infinity, naming the first such tensor (and layer)
    /// and element: such a model computes nothing meaningful, so it must not be trained,
    /// sampled, scored or copied as if it could. `source` names where they came from.
    pub fn check_finite(&self, source: &str) -> Result<()> {
        use rayon::prelude::*;
        if self.data.par_chunks(1 << 20).all(|c| c.iter().all(|x| x.is_finite())) {
            return Ok(());
        }
        for t in self.layout.ids() {
            for l in self.layout.layers(t) {
                if let Some((i, x)) = self.layer(t, l).iter().enumerate().find(|(_, x)| !x.is_finite()) {
                    let layer = if self.layout.spec(t).per_layer { format!(" of layer {l}") } else { String::new() };
                    anyhow::bail!(
                        "{source}: tensor {}{layer} holds {x} at element {i}: the weights are corrupt or come from a \
                         diverged run; use another file (an earlier checkpoint)",
                        self.layout.spec(t).name
                    );
                }
            }
        }
        Ok(())
    }
}

/// A hash of the values of `w` (64-bit, over their bits), in hex.
pub fn weights_hash(w: &Weights) -> String {
    let mut h = WeightsHasher::new();
    h.feed(&w.data);
    h.finish()
}

/// [`weights_hash`] of values fed in order, in pieces (a base read straight into a model).
pub struct WeightsHasher {
    lanes: [u64; 4],
    n: u64,
}

impl Default for WeightsHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightsHasher {
    pub fn new() -> Self {
        WeightsHasher { lanes: [0xcbf29ce484222325u64; 4], n: 0 }
    }

    /// FNV-1a's constants over 32-bit words, folded from 4 lanes (value i to lane i % 4): fast
    /// on gigabytes, and any changed value changes it with overwhelming likelihood.
    pub fn feed(&mut self, x: &[f32]) {
        let mut x = x;
        while !self.n.is_multiple_of(4) && !x.is_empty() {
            self.one(x[0]);
            x = &x[1..];
        }
        let chunks = x.chunks_exact(4);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (l, v) in self.lanes.iter_mut().zip(chunk) {
                *l = (*l ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
            }
        }
        self.n += (x.len() - rest.len()) as u64;
        rest.iter().for_each(|&v| self.one(v));
    }

    fn one(&mut self, v: f32) {
        let l = &mut self.lanes[(self.n % 4) as usize];
        *l = (*l ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
        self.n += 1;
    }

    /// `n` zeros.
    pub fn zeros(&mut self, n: usize) {
        let z = [0f32; 1024];
        for i in (0..n).step_by(1024) {
            self.feed(&z[..1024.min(n - i)]);
        }
    }

    pub fn finish(&self) -> String {
        let h = self.lanes.iter().fold(self.n, |h, l| (h ^ l).wrapping_mul(0x100000001b3).rotate_left(29));
        format!("{h:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_tile_their_tensors_in_order() {
        let specs = vec![
            TensorSpec::new("emb", &[10, 4], false, false),
            TensorSpec::new("w", &[3, 4], true, true),
            TensorSpec::new("b", &[3], true, true),
            TensorSpec::new("norm", &[4], false, false),
        ];
        let lay = ParamLayout::new(specs, 2);
        assert_eq!(lay.num_parameters, 40 + 2 * 12 + 2 * 3 + 4);
        let w = lay.find("w").unwrap();
        assert_eq!(lay.layer(w, 0).start, lay.range(w).start);
        assert_eq!(lay.layer(w, 1).end, lay.range(w).end);
        assert_eq!(lay.block(1)[w], lay.layer(w, 1));
        assert_eq!(lay.block(1)[TensorId(0)], 0..0, "a block's view leaves the outer tensors empty");
        assert_eq!(lay.outer()[TensorId(3)], lay.range(TensorId(3)));
        assert_eq!(lay.block_ids(), [TensorId(1), TensorId(2)]);
        assert!(lay.spec(TensorId(0)).decay && !lay.spec(TensorId(2)).decay);
        assert!(std::panic::catch_unwind(|| lay.layer(w, 2)).is_err(), "a layer past the last is refused");
    }

    /// The hash of values fed in pieces of any lengths, and of zeros fed as a count, is the
    /// hash of the whole.
    #[test]
    fn hashing_in_pieces_is_hashing_the_whole() {
        let cfg = ModelConfig::from_descriptor("2x16:2:8").unwrap();
        let mut w = Weights::random(cfg, 3).unwrap();
        w.data[10..50].fill(0.0);
        let whole = weights_hash(&w);
        for cut in [1, 3, 7, 33, 1001] {
            let mut h = WeightsHasher::new();
            w.data.chunks(cut).for_each(|x| h.feed(x));
            assert_eq!(h.finish(), whole, "pieces of {cut}");
        }
        let mut h = WeightsHasher::new();
        h.feed(&w.data[..10]);
        h.zeros(40);
        h.feed(&w.data[50..]);
        assert_eq!(h.finish(), whole, "zeros as a count");
        w.data[3] += 1.0;
        assert_ne!(weights_hash(&w), whole);
    }
}

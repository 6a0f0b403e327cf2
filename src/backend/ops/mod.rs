//! Every layer op's contract, written once, in one file per layer (named as the devices' files
//! of that layer): its call (the buffers and shapes, one struct per op), the role of each
//! buffer (written whole, read and updated, workspace, or read), the lengths the shapes give,
//! and the profile kind its time is charged to ([`Call`]); the trait a device implements for
//! the layer (its ops on these calls, e.g. [`LayerNormOps`]); and the layer's ops in the
//! checked front a model family calls ([`Ops`]), never a device directly: every buffer's length
//! against the op's shape, that no output overlaps another buffer of the call, and in the
//! NaN-checking mode the poisoning of its outputs before and the check after (through the
//! backend's [`Backend::poison`] and [`Backend::check_written`]). A device reads the roles from
//! the call too: the CPU hands its kernels slices by them, the GPU runs an op on f32 copies of
//! its bf16 buffers by them.
//!
//! Adding an op touches four files: its call, its method in the layer's trait and its front
//! method in `ops/<layer>.rs`; its kernel and the trait's method in `cpu/<layer>.rs`; the same in
//! `gpu/<layer>.rs`, with its WGSL in `gpu/kernels/<layer>.wgsl` (and its kernels' table entries
//! in `gpu/<layer>.rs`).
//!
//! LoRA ([`crate::model::lora`]) lives here too, as PEFT's wrapped layers live outside the model's
//! code: a pass given a block's adapters ([`Ops::with_lora`]) adds each adapter's term to the
//! projection whose weight it adapts, in that projection's own matmul_forward and
//! matmul_backward, so every family's block runs LoRA unchanged.

use super::{Backend, Buf, DType};
use crate::core::profile::Kind;

/// Panic unless every named buffer has the length its shape gives.
macro_rules! lens {
    ($op:expr; $($buf:expr => $len:expr),* $(,)?) => {
        $(assert_eq!($buf.len, $len, "{}: {} has {} elements, its shape says {}", $op, stringify!($buf), $buf.len, $len);)*
    };
}

mod adamw;
mod attention;
mod bf16;
mod classifier;
mod encoder;
mod gelu;
mod layernorm;
mod lora;
mod matmul;
mod residual;
mod rmsnorm;
mod rope;
mod swiglu;

pub use adamw::{AdamwOps, AdamwUpdate, GlobalNormSquared};
pub use attention::{AttentionBackward, AttentionCached, AttentionForward, AttentionOps};
pub use bf16::{Convert, ConvertOps};
pub use classifier::{AccumulateMean, ClassifierOps, CrossentropyBackward, CrossentropyForward};
pub use encoder::{EncoderBackward, EncoderForward, EncoderOps};
pub use gelu::{GeluBackward, GeluForward, GeluOps};
pub use layernorm::{LayerNormBackward, LayerNormForward, LayerNormOps};
pub use lora::{LoraBackward, LoraForward, LoraOps, LoraShape};
pub use matmul::{MatmulBackward, MatmulForward, MatmulOps};
pub use residual::{Residual, ResidualOps};
pub use rmsnorm::{HeadNormBackward, HeadNormForward, RmsNormBackward, RmsNormForward, RmsNormOps};
pub use rope::{Rope, RopeOps};
pub use swiglu::{SwigluBackward, SwigluForward, SwigluOps};

// ---- shapes ----------------------------------------------------------------------------------

/// N rows of C values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub n: usize,
    pub c: usize,
}

/// A projection: (N, C) inputs times an (OC, C) weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mat {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
}

/// Attention's heads: NH query heads and KV key/value heads of HS channels each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hs: usize,
}

impl Heads {
    /// QD = NH * HS: the queries' width, and attention's output's.
    pub fn q(&self) -> usize {
        self.nh * self.hs
    }
    /// QKV = (NH + 2 KV) * HS.
    pub fn qkv(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs
    }
    /// KV * HS.
    pub fn kv(&self) -> usize {
        self.nkv * self.hs
    }
}

/// B sequences of T positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub b: usize,
    pub t: usize,
}

impl Seq {
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

// ---- calls -----------------------------------------------------------------------------------

/// How an op uses a buffer it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// Overwritten whole, never read.
    W(Buf),
    /// Read and updated (`+=` for gradients).
    Rw(Buf),
    /// Workspace the op may overwrite as it likes.
    Scratch(Buf),
}

impl Out {
    pub fn buf(self) -> Buf {
        match self {
            Out::W(b) | Out::Rw(b) | Out::Scratch(b) => b,
        }
    }
}
use Out::{Rw, Scratch, W};

/// One op's call: its `O` written buffers and `I` read ones, with their roles, their lengths
/// and its name and profile kind. The buffers may be of any dtype the op takes (token ids are
/// u32 inputs); an absent optional one is [`NONE`].
pub trait Call<const O: usize, const I: usize>: Copy {
    const NAME: &'static str;
    const KIND: Kind;
    /// The buffers it writes, with how, then those it reads, in the call's order.
    fn roles(&self) -> ([Out; O], [Buf; I]);
    /// The same call on other buffers, given in [`Call::roles`]' order (a device running the
    /// op on copies); an absent optional buffer stays absent.
    fn on(self, outs: [Buf; O], ins: [Buf; I]) -> Self;
    /// Panic unless every buffer has the length the shapes give (a bug in the caller).
    fn check(&self);
}

/// A zero-length handle that overlaps nothing, for an absent optional buffer.
pub const NONE: Buf = Buf { alloc: u32::MAX, off: 0, len: 0, dtype: DType::F32 };

/// An optional buffer as a buffer ([`NONE`] when absent).
pub fn opt(b: Option<Buf>) -> Buf {
    b.unwrap_or(NONE)
}

/// The optional buffer `orig` given as `b` (its copy, or itself).
fn back(orig: Option<Buf>, b: Buf) -> Option<Buf> {
    orig.map(|_| b)
}

// ---- what a device implements, layer by layer ---------------------------------------------------

/// Every layer's ops: what a device implements besides memory and transfers ([`Backend`]); a
/// device states that it has them all with an empty `impl Kernels for ... {}`.
pub trait Kernels:
    EncoderOps
    + LayerNormOps
    + RmsNormOps
    + RopeOps
    + SwigluOps
    + ResidualOps
    + MatmulOps
    + LoraOps
    + GeluOps
    + AttentionOps
    + ClassifierOps
    + AdamwOps
    + ConvertOps
{
}

// ---- the checked front --------------------------------------------------------------------------

/// The gradient "buffer" of a frozen weight: the backward computes no gradient for it (the
/// base model of a LoRA run). Only [`Ops::matmul_backward`]'s weight takes it.
pub const FROZEN: Buf = Buf { alloc: u32::MAX - 1, off: 0, len: 0, dtype: DType::F32 };

/// One LoRA adapter on rows row0..row0+ROWS of a projection's weight (OC, C): its A (R, C) and
/// B (ROWS, R), and their gradients in a training pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adapter {
    /// The adapted weight, as the family passes it to the matmul.
    pub weight: Buf,
    pub a: Buf,
    pub b: Buf,
    /// (da, db), in a training pass.
    pub grads: Option<(Buf, Buf)>,
    /// Where a pass over the training activations keeps this adapter's h (N, R) for the
    /// backward (at their capacity; None before training). Other passes use the block's h.
    pub kept_h: Option<Buf>,
    pub r: usize,
    pub row0: usize,
    pub rows: usize,
    pub scale: f32,
}

/// The adapters of one block, and the two (N, R) workspaces their ops use: h for a pass
/// whose h no backward reads (an adapter's own `kept_h` otherwise), dh for the backward.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockLora {
    pub adapters: Vec<Adapter>,
    pub h: Buf,  // (N, R) at the pass's capacity
    pub dh: Buf, // (N, R)
}

/// The ops of one pass on one backend.
pub struct Ops<'a> {
    be: &'a mut dyn Backend,
    /// Charge every op to this kind instead of its own (the LM head's matmul is the classifier's).
    kind: Option<Kind>,
    /// The block's LoRA adapters, added to the matmuls of the weights they adapt.
    lora: Option<&'a BlockLora>,
}

impl<'a> Ops<'a> {
    pub fn new(be: &'a mut dyn Backend) -> Self {
        Ops { be, kind: None, lora: None }
    }

    /// These ops with a block's LoRA adapters (none when None).
    pub fn with_lora(self, lora: Option<&'a BlockLora>) -> Self {
        Ops { lora, ..self }
    }

    /// The adapters on `w`.
    fn adapters(&self, w: Buf) -> Vec<Adapter> {
        self.lora.map_or(vec![], |l| l.adapters.iter().filter(|a| a.weight == w).copied().collect())
    }

    /// The backend, for what is not a layer op (memory, transfers, collectives).
    pub fn backend(&mut self) -> &mut dyn Backend {
        &mut *self.be
    }

    /// Run `f` with every op charged to `kind`.
    pub fn charged_to<R>(&mut self, kind: Kind, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.kind.replace(kind);
        let r = f(self);
        self.kind = before;
        r
    }

    /// One op: its call checked (lengths, and no output overlapping another buffer of it), its
    /// outputs poisoned in the NaN-checking mode, the device's op run, its outputs checked.
    fn call<const O: usize, const I: usize, C: Call<O, I>>(&mut self, a: C, f: fn(&mut dyn Backend, &C)) {
        a.check();
        let (outs, ins) = a.roles();
        for (i, o) in outs.iter().enumerate() {
            let o = o.buf();
            let others = outs.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| x.buf());
            if let Some(x) = others.chain(ins.iter().copied()).find(|x| x.overlaps(o)) {
                panic!("{}: output {o:?} overlaps {x:?}", C::NAME);
            }
        }
        for o in outs {
            if let W(b) | Scratch(b) = o {
                self.be.poison(b);
            }
        }
        self.be.profile_begin(self.kind.unwrap_or(C::KIND));
        f(&mut *self.be, &a);
        self.be.profile_end();
        for (k, o) in outs.into_iter().enumerate() {
            if let W(b) | Rw(b) = o {
                self.be.check_written(b, C::NAME, k);
            }
        }
    }
}

//! The checked front of every layer op: each op's contract written once. A model family calls
//! these, never a [`Backend`] directly: every buffer's length against the op's shape, that no
//! output overlaps another buffer of the call, the profile kind its time is charged to, and in
//! the NaN-checking mode the poisoning of its outputs before and the check after (through the
//! backend's [`Backend::poison`] and [`Backend::check_written`]). The device's raw op then runs
//! on buffers that hold to the contract. Shapes come as small structs ([`Rows`], [`Mat`],
//! [`Heads`], [`Seq`]) so that a block reads as llm.c's list of calls.
//!
//! LoRA ([`crate::model::lora`]) lives here too, as PEFT's wrapped layers live outside the model's
//! code: a pass given a block's adapters ([`Ops::with_lora`]) adds each adapter's term to the
//! projection whose weight it adapts, in that projection's own matmul_forward and
//! matmul_backward, so every family's block runs LoRA unchanged.

use super::{AdamWParams, Backend, Buf, LoraShape, Noise};
use crate::core::profile::Kind;

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

/// How an op uses a buffer it writes.
#[derive(Clone, Copy)]
enum Out {
    /// Overwritten whole, never read.
    W(Buf),
    /// Read and updated (`+=` for gradients).
    Rw(Buf),
    /// Workspace.
    Scratch(Buf),
}

impl Out {
    fn buf(self) -> Buf {
        match self {
            Out::W(b) | Out::Rw(b) | Out::Scratch(b) => b,
        }
    }
}
use Out::{Rw, Scratch, W};

/// Panic unless every named buffer has the length its shape gives (a bug in the caller).
macro_rules! lens {
    ($op:expr; $($buf:expr => $len:expr),* $(,)?) => {
        $(assert_eq!($buf.len, $len, "{}: {} has {} elements, its shape says {}", $op, stringify!($buf), $buf.len, $len);)*
    };
}

/// The gradient "buffer" of a frozen weight: the backward computes no gradient for it (the
/// base model of a LoRA run). Only [`Ops::matmul_backward`]'s weight takes it.
pub const FROZEN: Buf = Buf { alloc: u32::MAX - 1, off: 0, len: 0, dtype: super::DType::F32 };

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

    /// One op: its outputs checked against each other and its inputs, poisoned in the
    /// NaN-checking mode, run, then checked.
    fn run(&mut self, op: &'static str, kind: Kind, outs: &[Out], ins: &[Buf], f: impl FnOnce(&mut dyn Backend)) {
        for (i, o) in outs.iter().enumerate() {
            let o = o.buf();
            let others = outs.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| x.buf());
            if let Some(x) = others.chain(ins.iter().copied()).find(|x| x.overlaps(o)) {
                panic!("{op}: output {o:?} overlaps {x:?}");
            }
        }
        for o in outs {
            if let W(b) | Scratch(b) = *o {
                self.be.poison(b);
            }
        }
        self.be.profile_begin(self.kind.unwrap_or(kind));
        f(&mut *self.be);
        self.be.profile_end();
        for (k, o) in outs.iter().enumerate() {
            if let W(b) | Rw(b) = *o {
                self.be.check_written(b, op, k);
            }
        }
    }

    /// out (B, T, C) = wte (Vp, C)[ids (B, T)] [+ wpe[pos + t] (T, C) for every sequence].
    pub fn encoder_forward(&mut self, out: Buf, ids: Buf, wte: Buf, wpe: Option<Buf>, s: Seq, c: usize) {
        lens!("encoder_forward"; out => s.n() * c, ids => s.n());
        assert!(wte.len.is_multiple_of(c) && wpe.is_none_or(|p| p.len == s.t * c), "encoder_forward: table shapes");
        let ins = [ids, wte, wpe.unwrap_or(NONE)];
        self.run("encoder_forward", Kind::Encoder, &[W(out)], &ins, |be| {
            be.encoder_forward(out, ids, wte, wpe, s.b, s.t, c)
        });
    }

    /// dwte (Vp, C) [and dwpe (T, C)] (inout) += the scatter of dout (B, T, C).
    pub fn encoder_backward(&mut self, dwte: Buf, dwpe: Option<Buf>, dout: Buf, ids: Buf, s: Seq, c: usize) {
        lens!("encoder_backward"; dout => s.n() * c, ids => s.n());
        assert!(dwte.len.is_multiple_of(c) && dwpe.is_none_or(|p| p.len == s.t * c), "encoder_backward: shapes");
        let outs = [Rw(dwte), Rw(dwpe.unwrap_or(NONE))];
        self.run("encoder_backward", Kind::Encoder, &outs, &[dout, ids], |be| {
            be.encoder_backward(dwte, dwpe, dout, ids, s.b, s.t, c)
        });
    }

    /// LayerNorm: out (N, C) = (x - mean) * rstd * w + b; mean, rstd (N) kept for backward.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(&mut self, out: Buf, mean: Buf, rstd: Buf, x: Buf, w: Buf, b: Buf, r: Rows) {
        let Rows { n, c } = r;
        lens!("layernorm_forward"; out => n * c, mean => n, rstd => n, x => n * c, w => c, b => c);
        self.run("layernorm_forward", Kind::LayerNorm, &[W(out), W(mean), W(rstd)], &[x, w, b], |be| {
            be.layernorm_forward(out, mean, rstd, x, w, b, n, c)
        });
    }

    /// dx (N, C), dw (C), db (C): all inout, `+=`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &mut self,
        dx: Buf,
        dw: Buf,
        db: Buf,
        dout: Buf,
        x: Buf,
        w: Buf,
        mean: Buf,
        rstd: Buf,
        r: Rows,
    ) {
        let Rows { n, c } = r;
        lens!("layernorm_backward"; dx => n * c, dw => c, db => c, dout => n * c, x => n * c, w => c,
              mean => n, rstd => n);
        self.run("layernorm_backward", Kind::LayerNorm, &[Rw(dx), Rw(dw), Rw(db)], &[dout, x, w, mean, rstd], |be| {
            be.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, n, c)
        });
    }

    /// RMSNorm: out (N, C) = x * rstd * w, rstd (N) = 1 / sqrt(mean(x^2) + eps), kept.
    pub fn rmsnorm_forward(&mut self, out: Buf, rstd: Buf, x: Buf, w: Buf, r: Rows, eps: f32) {
        let Rows { n, c } = r;
        lens!("rmsnorm_forward"; out => n * c, rstd => n, x => n * c, w => c);
        self.run("rmsnorm_forward", Kind::RmsNorm, &[W(out), W(rstd)], &[x, w], |be| {
            be.rmsnorm_forward(out, rstd, x, w, n, c, eps)
        });
    }

    /// dx (N, C) and dw (C): both inout, `+=`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(&mut self, dx: Buf, dw: Buf, dout: Buf, x: Buf, w: Buf, rstd: Buf, r: Rows) {
        let Rows { n, c } = r;
        lens!("rmsnorm_backward"; dx => n * c, dw => c, dout => n * c, x => n * c, w => c, rstd => n);
        self.run("rmsnorm_backward", Kind::RmsNorm, &[Rw(dx), Rw(dw)], &[dout, x, w, rstd], |be| {
            be.rmsnorm_backward(dx, dw, dout, x, w, rstd, n, c)
        });
    }

    /// Qwen3's RMSNorm of each query head (weight wq (HS)) and key head (wk (HS)) of qkv
    /// (N, QKV) into out; the value heads copied; rstd (N, NH + KV) kept for backward.
    #[allow(clippy::too_many_arguments)]
    pub fn head_norm_forward(&mut self, out: Buf, rstd: Buf, x: Buf, wq: Buf, wk: Buf, n: usize, h: Heads, eps: f32) {
        lens!("head_norm_forward"; out => n * h.qkv(), rstd => n * (h.nh + h.nkv), x => n * h.qkv(), wq => h.hs, wk => h.hs);
        self.run("head_norm_forward", Kind::RmsNorm, &[W(out), W(rstd)], &[x, wq, wk], |be| {
            be.head_norm_forward(out, rstd, x, wq, wk, n, h.nh, h.nkv, h.hs, eps)
        });
    }

    /// Its backward: dx (N, QKV) (out) from dout; dwq, dwk (HS) `+=`.
    #[allow(clippy::too_many_arguments)]
    pub fn head_norm_backward(
        &mut self,
        dx: Buf,
        dwq: Buf,
        dwk: Buf,
        dout: Buf,
        x: Buf,
        wq: Buf,
        wk: Buf,
        rstd: Buf,
        n: usize,
        h: Heads,
    ) {
        lens!("head_norm_backward"; dx => n * h.qkv(), dwq => h.hs, dwk => h.hs, dout => n * h.qkv(),
              x => n * h.qkv(), wq => h.hs, wk => h.hs, rstd => n * (h.nh + h.nkv));
        let ins = [dout, x, wq, wk, rstd];
        self.run("head_norm_backward", Kind::RmsNorm, &[W(dx), Rw(dwq), Rw(dwk)], &ins, |be| {
            be.head_norm_backward(dx, dwq, dwk, dout, x, wq, wk, rstd, n, h.nh, h.nkv, h.hs)
        });
    }

    /// The rotary embedding, in place on the q and k of qkv (N, QKV): row r sits at position
    /// pos + r % t. table (maxT, HS): each position's cosines then sines.
    pub fn rope_forward(&mut self, qkv: Buf, table: Buf, n: usize, t: usize, pos: usize, h: Heads) {
        lens!("rope_forward"; qkv => n * h.qkv());
        assert!(
            t > 0 && n.is_multiple_of(t) && table.len >= (pos + t) * h.hs,
            "rope_forward: positions past the table"
        );
        self.run("rope_forward", Kind::Rope, &[Rw(qkv)], &[table], |be| {
            be.rope_forward(qkv, table, n, t, pos, h.nh, h.nkv, h.hs)
        });
    }

    /// Its backward, in place on dqkv (N, QKV).
    pub fn rope_backward(&mut self, dqkv: Buf, table: Buf, n: usize, t: usize, pos: usize, h: Heads) {
        lens!("rope_backward"; dqkv => n * h.qkv());
        assert!(
            t > 0 && n.is_multiple_of(t) && table.len >= (pos + t) * h.hs,
            "rope_backward: positions past the table"
        );
        self.run("rope_backward", Kind::Rope, &[Rw(dqkv)], &[table], |be| {
            be.rope_backward(dqkv, table, n, t, pos, h.nh, h.nkv, h.hs)
        });
    }

    /// SwiGLU: out (N, F) = up * silu(gate), from x (N, 2F) holding up then gate.
    pub fn swiglu_forward(&mut self, out: Buf, x: Buf, r: Rows) {
        let Rows { n, c: f } = r;
        lens!("swiglu_forward"; out => n * f, x => n * 2 * f);
        self.run("swiglu_forward", Kind::Swiglu, &[W(out)], &[x], |be| be.swiglu_forward(out, x, n, f));
    }

    /// dx (N, 2F) (out) from dout (N, F).
    pub fn swiglu_backward(&mut self, dx: Buf, dout: Buf, x: Buf, r: Rows) {
        let Rows { n, c: f } = r;
        lens!("swiglu_backward"; dx => n * 2 * f, dout => n * f, x => n * 2 * f);
        self.run("swiglu_backward", Kind::Swiglu, &[W(dx)], &[dout, x], |be| be.swiglu_backward(dx, dout, x, n, f));
    }

    /// out (N) = a (N) + b (N).
    pub fn residual_forward(&mut self, out: Buf, a: Buf, b: Buf) {
        lens!("residual_forward"; a => out.len, b => out.len);
        self.run("residual_forward", Kind::Residual, &[W(out)], &[a, b], |be| be.residual_forward(out, a, b));
    }

    /// out (N, OC) = x (N, C) @ w (OC, C)^T [+ bias (OC)], plus the terms of the LoRA adapters
    /// on w.
    pub fn matmul_forward(&mut self, out: Buf, x: Buf, w: Buf, bias: Option<Buf>, m: Mat) {
        let Mat { n, c, oc } = m;
        lens!("matmul_forward"; out => n * oc, x => n * c, w => oc * c);
        if let Some(b) = bias {
            lens!("matmul_forward"; b => oc);
        }
        self.run("matmul_forward", Kind::Matmul, &[W(out)], &[x, w, bias.unwrap_or(NONE)], |be| {
            be.matmul_forward(out, x, w, bias, n, c, oc)
        });
        for ad in self.adapters(w) {
            let (s, shared) = self.lora_shape(&ad, m);
            // Kept for the backward when the pass is over the training activations.
            let h = ad.kept_h.filter(|k| k.len >= n * ad.r).map_or(shared, |k| k.prefix(n * ad.r));
            lens!("lora_forward"; ad.a => ad.r * c, ad.b => ad.rows * ad.r);
            self.run("lora_forward", Kind::Lora, &[Rw(out), Scratch(h)], &[x, ad.a, ad.b], |be| {
                be.lora_forward(out, h, x, ad.a, ad.b, s)
            });
        }
    }

    /// dx (N, C) (out) = dout @ w; dw (OC, C) = dout^T @ x and db (OC) = the column sums of dout
    /// (N, OC), added to when `acc`, else overwritten; dw [`FROZEN`]: no weight gradient. The
    /// LoRA adapters on w add their terms to dx and to their gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &mut self,
        dx: Option<Buf>,
        dw: Buf,
        db: Option<Buf>,
        dout: Buf,
        x: Buf,
        w: Buf,
        m: Mat,
        acc: bool,
    ) {
        let Mat { n, c, oc } = m;
        let dw = (dw != FROZEN).then_some(dw);
        lens!("matmul_backward"; dout => n * oc, x => n * c, w => oc * c);
        if let Some(d) = dw {
            lens!("matmul_backward"; d => oc * c);
        }
        if let Some(d) = dx {
            lens!("matmul_backward"; d => n * c);
        }
        if let Some(d) = db {
            lens!("matmul_backward"; d => oc);
        }
        let grad = |b: Buf| if acc { Rw(b) } else { W(b) };
        let outs = [W(dx.unwrap_or(NONE)), grad(dw.unwrap_or(NONE)), grad(db.unwrap_or(NONE))];
        if dx.is_some() || dw.is_some() || db.is_some() {
            self.run("matmul_backward", Kind::Matmul, &outs, &[dout, x, w], |be| {
                be.matmul_backward(dx, dw, db, dout, x, w, n, c, oc, acc)
            });
        }
        for ad in self.adapters(w) {
            let Some((da, dbl)) = ad.grads else { panic!("matmul_backward: a LoRA adapter without gradients") };
            let (s, _) = self.lora_shape(&ad, m);
            let h =
                ad.kept_h.filter(|k| k.len >= n * ad.r).expect("matmul_backward: a LoRA adapter without its kept h");
            let (h, dh) = (h.prefix(n * ad.r), self.lora.expect("adapters").dh.prefix(n * ad.r));
            lens!("lora_backward"; ad.a => ad.r * c, ad.b => ad.rows * ad.r, da => ad.r * c, dbl => ad.rows * ad.r);
            let outs = [Rw(dx.unwrap_or(NONE)), Rw(da), Rw(dbl), Scratch(dh)];
            self.run("lora_backward", Kind::Lora, &outs, &[dout, x, ad.a, ad.b, h], |be| {
                be.lora_backward(dx, da, dbl, h, dh, dout, x, ad.a, ad.b, s)
            });
        }
    }

    /// The op shape of adapter `ad` on the projection `m`, and its (N, R) workspace.
    fn lora_shape(&self, ad: &Adapter, m: Mat) -> (LoraShape, Buf) {
        let Mat { n, c, oc } = m;
        assert!(ad.row0 + ad.rows <= oc, "a LoRA adapter on rows {}..{} of {oc}", ad.row0, ad.row0 + ad.rows);
        let s = LoraShape { n, c, oc, r: ad.r, row0: ad.row0, rows: ad.rows, scale: ad.scale };
        (s, self.lora.expect("adapters").h.prefix(n * ad.r))
    }

    /// out (N) = gelu(x (N)), tanh approximation.
    pub fn gelu_forward(&mut self, out: Buf, x: Buf) {
        lens!("gelu_forward"; x => out.len);
        self.run("gelu_forward", Kind::Gelu, &[W(out)], &[x], |be| be.gelu_forward(out, x));
    }

    /// d (N, inout) *= gelu'(x (N)).
    pub fn gelu_backward(&mut self, d: Buf, x: Buf) {
        lens!("gelu_backward"; x => d.len);
        self.run("gelu_backward", Kind::Gelu, &[Rw(d)], &[x], |be| be.gelu_backward(d, x));
    }

    /// Causal self-attention over B sequences of T: out (B, T, QD) and each query row's softmax
    /// statistics stats (B, NH, T, 2) from qkv (B, T, QKV); ws (B, T, QD) scratch.
    pub fn attention_forward(&mut self, out: Buf, stats: Buf, ws: Buf, qkv: Buf, s: Seq, h: Heads) {
        let n = s.n();
        assert!(h.nkv > 0 && h.nh.is_multiple_of(h.nkv), "attention_forward: {} heads, {} kv heads", h.nh, h.nkv);
        lens!("attention_forward"; out => n * h.q(), stats => n * h.nh * 2, ws => n * h.q(), qkv => n * h.qkv());
        self.run("attention_forward", Kind::Attention, &[W(out), W(stats), Scratch(ws)], &[qkv], |be| {
            be.attention_forward(out, stats, ws, qkv, s.b, s.t, h.q(), h.nh, h.nkv)
        });
    }

    /// dqkv (B, T, QKV) (out) from dout (B, T, QD), qkv and the forward's stats (B, NH, T, 2),
    /// the probabilities rebuilt as the backward goes; ws (B, T, 3 QD) scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(&mut self, dqkv: Buf, ws: Buf, dout: Buf, qkv: Buf, stats: Buf, s: Seq, h: Heads) {
        let n = s.n();
        lens!("attention_backward"; dqkv => n * h.qkv(), ws => n * 3 * h.q(),
              dout => n * h.q(), qkv => n * h.qkv(), stats => n * h.nh * 2);
        self.run("attention_backward", Kind::Attention, &[W(dqkv), Scratch(ws)], &[dout, qkv, stats], |be| {
            be.attention_backward(dqkv, ws, dout, qkv, stats, s.b, s.t, h.q(), h.nh, h.nkv)
        });
    }

    /// Attention of `tn` new positions against a KV cache of `cap` positions holding `pos`:
    /// their keys and values (in qkv (TN, QKV)) go to rows pos.. of k and v (cap, KV*HS), then
    /// out (TN, QD). ws (TN, QD): scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_cached(
        &mut self,
        out: Buf,
        ws: Buf,
        qkv: Buf,
        k: Buf,
        v: Buf,
        pos: usize,
        tn: usize,
        cap: usize,
        h: Heads,
    ) {
        assert!(tn > 0 && pos + tn <= cap, "attention_forward_cached: positions past the cache");
        lens!("attention_forward_cached"; out => tn * h.q(), ws => tn * h.q(),
              qkv => tn * h.qkv(), k => cap * h.kv(), v => cap * h.kv());
        // The cache's rows up to the new ones are what it holds (the rest is not written yet).
        let held = (pos + tn) * h.kv();
        let outs = [W(out), Scratch(ws), Rw(k.prefix(held)), Rw(v.prefix(held))];
        self.run("attention_forward_cached", Kind::Attention, &outs, &[qkv], |be| {
            be.attention_forward_cached(out, ws, qkv, k, v, pos, tn, h.q(), h.nh, h.nkv, cap)
        });
    }

    /// losses (N) = -log softmax(logits (N, Vp)[:, :V])[targets]; lse (N) kept for backward.
    #[allow(clippy::too_many_arguments)]
    pub fn crossentropy_forward(
        &mut self,
        losses: Buf,
        lse: Buf,
        logits: Buf,
        targets: Buf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        assert!(v <= vp, "crossentropy_forward: V > Vp");
        lens!("crossentropy_forward"; losses => n, lse => n, logits => n * vp, targets => n);
        self.run("crossentropy_forward", Kind::Classifier, &[W(losses), W(lse)], &[logits, targets], |be| {
            be.crossentropy_forward(losses, lse, logits, targets, n, v, vp)
        });
    }

    /// In place, logits (N, Vp) become d(loss)/d(logits), scaled by dloss.
    #[allow(clippy::too_many_arguments)]
    pub fn crossentropy_backward(
        &mut self,
        logits: Buf,
        lse: Buf,
        targets: Buf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        lens!("crossentropy_backward"; logits => n * vp, lse => n, targets => n);
        self.run("crossentropy_backward", Kind::Classifier, &[Rw(logits)], &[lse, targets], |be| {
            be.crossentropy_backward(logits, lse, targets, dloss, n, v, vp)
        });
    }

    /// acc (1) (inout) += weight * mean(x (N)).
    pub fn accumulate_mean(&mut self, acc: Buf, x: Buf, weight: f32) {
        lens!("accumulate_mean"; acc => 1);
        self.run("accumulate_mean", Kind::Classifier, &[Rw(acc)], &[x], |be| be.accumulate_mean(acc, x, weight));
    }

    /// out (1) = the sum of squares of grads (N) [+ out when `accumulate`].
    pub fn global_norm_squared(&mut self, out: Buf, grads: Buf, accumulate: bool) {
        lens!("global_norm_squared"; out => 1);
        let o = if accumulate { Rw(out) } else { W(out) };
        self.run("global_norm_squared", Kind::Optimizer, &[o], &[grads], |be| {
            be.global_norm_squared(out, grads, accumulate)
        });
    }

    /// One AdamW step on one tensor (see [`Backend::adamw_update`]).
    pub fn adamw_update(&mut self, params: Buf, grads: Buf, m: Buf, v: Buf, stats: Buf, h: &AdamWParams) {
        lens!("adamw_update"; grads => params.len, m => params.len, v => params.len, stats => 2);
        self.run("adamw_update", Kind::Optimizer, &[Rw(params), Rw(m), Rw(v)], &[grads, stats], |be| {
            be.adamw_update(params, grads, m, v, stats, h)
        });
    }

    /// One AdamW step on one tensor that also writes its bf16 working copy (see
    /// [`Backend::adamw_update_and_copy`]).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update_and_copy(
        &mut self,
        params: Buf,
        work: Buf,
        grads: Buf,
        m: Buf,
        v: Buf,
        stats: Buf,
        h: &AdamWParams,
    ) {
        lens!("adamw_update_and_copy"; work => params.len, grads => params.len, m => params.len, v => params.len, stats => 2);
        let outs = [Rw(params), Rw(m), Rw(v), Rw(work)];
        self.run("adamw_update", Kind::Optimizer, &outs, &[grads, stats], |be| {
            be.adamw_update_and_copy(params, work, grads, m, v, stats, h)
        });
    }

    /// dst (N) = src (N) in dst's dtype (see [`Backend::convert`]).
    pub fn convert(&mut self, dst: Buf, src: Buf, noise: Option<Noise>) {
        lens!("convert"; dst => src.len);
        self.run("convert", Kind::Optimizer, &[W(dst)], &[src], |be| be.convert(dst, src, noise));
    }

    /// [`Ops::convert`] to nearest of a src about to be freed (see [`Backend::convert_consuming`]).
    pub fn convert_consuming(&mut self, dst: Buf, src: Buf) {
        lens!("convert"; dst => src.len);
        self.run("convert", Kind::Optimizer, &[W(dst)], &[src], |be| be.convert_consuming(dst, src));
    }
}

/// A zero-length handle that overlaps nothing, for an absent optional buffer.
const NONE: Buf = Buf { alloc: u32::MAX, off: 0, len: 0, dtype: super::DType::F32 };

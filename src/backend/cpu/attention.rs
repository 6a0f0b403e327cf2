//! Causal multi-head self-attention on the packed qkv activations, with grouped-query attention.
//!
//! Layout: `qkv (B, T, QKV)` holds each position's NH query heads, then its KV key heads, then
//! its KV value heads (QKV = (NH + 2 KV) * HS; GPT-2: KV = NH, QKV = 3C). Query head h of
//! position t is `qkv[b, t, h*HS .. (h+1)*HS]`; it reads key and value head g = h / (NH / KV),
//! at offsets C + g*HS and C + KV*HS + g*HS.
//!
//! No (B, NH, T, T) matrix is ever held (flash attention's scheme): the forward keeps the
//! output and each query row's softmax statistics `stats (B, NH, T, 2)`, and the backward
//! rebuilds the probabilities block by block of query rows, in a per-thread tile of
//! [`ROW_BLOCK`] x T, from the same GEMM and those statistics: the same bits as the forward's.
//!
//! The activations (qkv, out, their gradients, the workspaces) are f32 or bf16 ([`Elem`]);
//! the scores, probabilities and every sum are f32, and a bf16 result is rounded once, to
//! nearest even, where it is stored. The GEMMs read bf16 operands widened as they pack them
//! (never the host's bf16 engine), so a bf16 pass gives the f32 pass's bits on the widened
//! inputs, rounded: the same numbers as before the op read bf16 itself, without f32 copies.

use super::backend::{f32_dest, f32_operand, CpuBackend, Rounding};
use super::math::{add_lanes, combine_lanes, max_lanes};
use super::sgemm::Elem;
use super::team::{self, Disjoint};
use super::wide::{Dest, Operand};
use crate::backend::ops::{AttentionBackward, AttentionCached, AttentionForward, AttentionOps, Call, Seq};
use crate::backend::DType;

impl AttentionOps for CpuBackend {
    fn attention_forward(&mut self, a: &AttentionForward) {
        let (Seq { b, t }, h) = (a.s, a.h);
        let (c, nh, nkv) = (h.q(), h.nh, h.nkv);
        // out, the workspace and qkv bf16: read and written as they are, no f32 copies.
        let native = [a.out, a.ws, a.qkv].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let r = Rounding::Nearest;
        self.run_native(AttentionForward::NAME, outs, ins, [], r, [native, false, native], [native], |o, [qkv], []| {
            let [o, st, ws] = o;
            let st = f32_dest(st);
            match (o, ws, qkv) {
                (Dest::F32(o), Dest::F32(ws), Operand::F32(x)) => attention_forward(o, st, ws, x, b, t, c, nh, nkv),
                (Dest::Bf16(o), Dest::Bf16(ws), Operand::Bf16(x)) => attention_forward(o, st, ws, x, b, t, c, nh, nkv),
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        })
    }

    fn attention_backward(&mut self, a: &AttentionBackward) {
        let (Seq { b, t }, h) = (a.s, a.h);
        let (c, nh, nkv) = (h.q(), h.nh, h.nkv);
        // dqkv, the workspace, dout and qkv bf16: read and written as they are, no f32 copies.
        let native = [a.dqkv, a.ws, a.dout, a.qkv].iter().all(|x| x.dtype == DType::BF16);
        let (outs, ins) = a.roles();
        let (native_outs, native_ins, r) = ([native; 2], [native, native, false], Rounding::Nearest);
        self.run_native(
            AttentionBackward::NAME,
            outs,
            ins,
            [],
            r,
            native_outs,
            native_ins,
            |[di, ws], [d, x, st], []| {
                let st = f32_operand(st);
                match (di, ws, d, x) {
                    (Dest::F32(di), Dest::F32(ws), Operand::F32(d), Operand::F32(x)) => {
                        attention_backward(di, ws, d, x, st, b, t, c, nh, nkv)
                    }
                    (Dest::Bf16(di), Dest::Bf16(ws), Operand::Bf16(d), Operand::Bf16(x)) => {
                        attention_backward(di, ws, d, x, st, b, t, c, nh, nkv)
                    }
                    _ => unreachable!("all bf16 or all handed over as f32"),
                }
            },
        );
    }

    fn attention_forward_cached(&mut self, a: &AttentionCached) {
        let (pos, tn, h) = (a.pos, a.tn, a.h);
        let (c, nh, nkv, qd, kv) = (h.q(), h.nh, h.nkv, h.qkv(), h.kv());
        // Only the cache rows held (its roles' prefixes) reach the op. All bf16 (a bf16 run's
        // activations and caches): read and written as they are, no f32 copies of the caches.
        let (outs, ins) = a.roles();
        let native = outs.iter().map(|o| o.buf()).chain(ins).all(|x| x.dtype == DType::BF16);
        let r = Rounding::Nearest;
        self.run_native(AttentionCached::NAME, outs, ins, [], r, [native; 4], [native], |o, [x], []| {
            /// The new positions' keys and values into the caches, then attention.
            #[allow(clippy::too_many_arguments)]
            fn run<T: Elem>(
                o: &mut [T],
                ws: &mut [T],
                kc: &mut [T],
                vc: &mut [T],
                qkv: &[T],
                (pos, tn, c, nh, nkv, qd, kv): (usize, usize, usize, usize, usize, usize, usize),
            ) {
                for (i, row) in qkv.chunks_exact(qd).enumerate() {
                    let at = (pos + i) * kv;
                    kc[at..at + kv].copy_from_slice(&row[c..c + kv]);
                    vc[at..at + kv].copy_from_slice(&row[c + kv..]);
                }
                attention_forward_cached(o, ws, qkv, kc, vc, pos, tn, c, nh, nkv)
            }
            let dims = (pos, tn, c, nh, nkv, qd, kv);
            match (o, x) {
                ([Dest::F32(o), Dest::F32(ws), Dest::F32(kc), Dest::F32(vc)], Operand::F32(x)) => {
                    run(o, ws, kc, vc, x, dims)
                }
                ([Dest::Bf16(o), Dest::Bf16(ws), Dest::Bf16(kc), Dest::Bf16(vc)], Operand::Bf16(x)) => {
                    run(o, ws, kc, vc, x, dims)
                }
                _ => unreachable!("all bf16 or all handed over as f32"),
            }
        });
    }
}

#[cfg(test)]
use rayon::prelude::*;
use std::cell::RefCell;

/// Dot product with 8 independent partial sums, so the compiler can keep them in one SIMD
/// register (a single running sum would force sequential, scalar adds).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = combine_lanes(acc);
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Where head h's key (and value) sit in a row of qkv: (k offset, v offset).
#[inline]
fn kv_offsets(h: usize, c: usize, nh: usize, nkv: usize) -> (usize, usize) {
    let hs = c / nh;
    let g = h / (nh / nkv);
    (c + g * hs, c + nkv * hs + g * hs)
}

/// Loop version of [`attention_forward`], kept as the tests' oracle.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn attention_forward_loops(
    out: &mut [f32],
    att: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = c + 2 * nkv * hs;
    // Pass 1: attention probabilities, one (b, h) plane per task.
    att[..b * nh * t * t].par_chunks_mut(t * t).enumerate().for_each(|(bh, plane)| {
        let (bi, h) = (bh / nh, bh % nh);
        let base = bi * t * c3;
        let (ko, _) = kv_offsets(h, c, nh, nkv);
        for ti in 0..t {
            let q = &qkv[base + ti * c3 + h * hs..][..hs];
            let row = &mut plane[ti * t..(ti + 1) * t];
            let mut maxv = f32::NEG_INFINITY;
            for t2 in 0..=ti {
                let k = &qkv[base + t2 * c3 + ko..][..hs];
                let s = dot(q, k) * scale;
                row[t2] = s;
                maxv = maxv.max(s);
            }
            let mut sum = 0f32;
            for x in &mut row[..=ti] {
                *x = super::math::exp(*x - maxv);
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in &mut row[..=ti] {
                *x *= inv;
            }
            row[ti + 1..].fill(0.0);
        }
    });
    // Pass 2: weighted sum of values, one output row (b, t) per task.
    let att = &att[..b * nh * t * t];
    out[..b * t * c].par_chunks_mut(c).enumerate().for_each(|(bt, o)| {
        let (bi, ti) = (bt / t, bt % t);
        o.fill(0.0);
        for h in 0..nh {
            let p = &att[(bi * nh + h) * t * t + ti * t..][..t];
            let oh = &mut o[h * hs..(h + 1) * hs];
            let (_, vo) = kv_offsets(h, c, nh, nkv);
            for t2 in 0..=ti {
                let v = &qkv[(bi * t + t2) * c3 + vo..][..hs];
                let w = p[t2];
                for i in 0..hs {
                    oh[i] += w * v[i];
                }
            }
        }
    });
}

crate::simd_fn! {
/// The causal softmax of one row of raw scores: the first `live` entries become
/// softmax(scale * x), the rest (future positions) 0. Returns the row's statistics
/// (max(scale * x), 1 / sum of the exps), from which [`probs_row`] rebuilds the same bits.
fn softmax_prefix(row: &mut [f32], live: usize, scale: f32) -> [f32; 2] {
    // Max and sum over 8 lanes, not one running value (a chain of dependent scalar ops). The
    // max of x * scale is taken as max(x) * scale: scale > 0 and rounding is monotonic, so it is
    // the same number. A NaN score still reaches the output through the exps.
    let maxv = max_lanes(&row[..live]) * scale;
    for x in &mut row[..live] {
        *x = super::math::exp(*x * scale - maxv);
    }
    let mut acc = [0f32; 8];
    add_lanes(&mut acc, &row[..live]);
    let inv = 1.0 / combine_lanes(acc);
    row[..live].iter_mut().for_each(|x| *x *= inv);
    row[live..].fill(0.0);
    [maxv, inv]
}
}

crate::simd_fn! {
/// [`softmax_prefix`] again from its statistics: the row of raw scores becomes the same
/// probabilities, bit for bit (the same two roundings per entry), without the two reductions.
fn probs_row(row: &mut [f32], live: usize, scale: f32, stats: [f32; 2]) {
    let [maxv, inv] = stats;
    for x in &mut row[..live] {
        *x = super::math::exp(*x * scale - maxv) * inv;
    }
    row[live..].fill(0.0);
}
}

crate::simd_fn! {
    /// One row of the softmax backward: row (the scores' gradient dP over the first `live`
    /// keys) becomes dS = P * (dP - <P, dP>) * scale, zero beyond.
    fn softmax_backward_row(row: &mut [f32], p: &[f32], live: usize, scale: f32) {
        let s = dot(&p[..live], &row[..live]);
        for (x, pv) in row[..live].iter_mut().zip(p) {
            *x = pv * (*x - s) * scale;
        }
        row[live..].fill(0.0);
    }
}

/// Query rows per causal block: each block of queries is multiplied only with the keys it can
/// see (those up to its last row), which halves the attention GEMMs at long T, and its scores
/// live in a tile of ROW_BLOCK x T floats, never in a (T, T) plane. At T <= 64 there is one
/// block, the full T x T.
const ROW_BLOCK: usize = 64;

thread_local! {
    /// Each thread's attention tiles (the scores, probabilities and their gradients of one
    /// block of query rows against the keys it sees): grown on first use to what the longest
    /// sequence needs (2 x ROW_BLOCK x T floats: 512 KiB at T = 1024, within a core's L2),
    /// then reused. They stand in for the (B, NH, T, T) probabilities that attention kept
    /// before: the backward rebuilds them block by block from the row statistics.
    static TILES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` on this thread's tile workspace of `len` floats (its contents are stale: every user
/// writes before it reads).
fn with_tiles<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TILES.with(|tiles| {
        let mut v = tiles.borrow_mut();
        if v.len() < len {
            // Fresh rather than resized (nothing old is worth copying), and to a power of two:
            // the KV-cached pass asks one row longer for every new token.
            *v = vec![0.0; len.next_power_of_two()];
        }
        f(&mut v[..len])
    })
}

/// out (B, T, C) and stats (B, NH, T, 2) from qkv (B, T, QKV). Per (batch, head) and block of
/// query rows, two GEMMs: scores = Q K^T over the visible keys (then the causal mask inside the
/// block), and out = softmax(scores) V, the scores in a per-thread tile. `stats` keeps each
/// query row's softmax statistics (max(scale * s), 1 / sum of exps), all the backward needs to
/// rebuild the probabilities. `heads (B, NH, T, HS)` is workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Elem>(
    out: &mut [T],
    stats: &mut [f32],
    heads: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    attention_forward_blocked(out, stats, heads, qkv, b, t, c, nh, nkv, ROW_BLOCK)
}

#[allow(clippy::too_many_arguments)]
fn attention_forward_blocked<T: Elem>(
    out: &mut [T],
    stats: &mut [f32],
    heads: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    block: usize,
) {
    use crate::backend::cpu::gemm::gemm_strided_serial as gemm;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let qd = c + 2 * nkv * hs;
    let (c3, hs_) = (qd as isize, hs as isize);
    // The Disjoint view of the heads ends with this block, before they are read below.
    {
        let heads_d = Disjoint::new(&mut heads[..b * nh * t * hs]);
        team::chunks_mut(&mut stats[..b * nh * t * 2], t * 2, |bh, st| {
            // SAFETY: plane bh of the heads is this task's alone.
            let o = unsafe { heads_d.part(bh * t * hs..(bh + 1) * t * hs) };
            let (row0, h) = ((bh / nh) * t * qd, bh % nh);
            let (ko, vo) = kv_offsets(h, c, nh, nkv);
            let (q, k, v) = (&qkv[row0 + h * hs..], &qkv[row0 + ko..], &qkv[row0 + vo..]);
            let w = block.min(t);
            with_tiles(w * t + w * hs, |tile| {
                let (tile, o_tile) = tile.split_at_mut(w * t);
                for r0 in (0..t).step_by(block) {
                    let (r1, rows) = ((r0 + block).min(t), (r0 + block).min(t) - r0);
                    // p (rows, r1): rows r0..r1 see keys 0..r1; softmax_prefix zeroes the rest.
                    let (p, ld) = (&mut tile[..rows * r1], r1 as isize);
                    gemm(rows, r1, hs, p, (ld, 1), false, &q[r0 * qd..], (c3, 1), k, (1, c3));
                    for (i, row) in p.chunks_exact_mut(r1).enumerate() {
                        let s = softmax_prefix(row, r0 + i + 1, scale);
                        st[2 * (r0 + i)..2 * (r0 + i + 1)].copy_from_slice(&s);
                    }
                    // The block's outputs (rows, HS) in f32, stored (rounded, if bf16) once.
                    let ob = &mut o_tile[..rows * hs];
                    gemm(rows, hs, r1, ob, (hs_, 1), false, &*p, (ld, 1), v, (c3, 1));
                    T::store_slice(&mut o[r0 * hs..r1 * hs], ob, false, None);
                }
            })
        });
    }
    let heads = &heads[..b * nh * t * hs];
    team::chunks_mut(&mut out[..b * t * c], c, |bt, row| {
        let (bi, ti) = (bt / t, bt % t);
        for h in 0..nh {
            row[h * hs..(h + 1) * hs].copy_from_slice(&heads[((bi * nh + h) * t + ti) * hs..][..hs]);
        }
    });
}

/// Backward of [`attention_forward`], flash attention's way: per (batch, head) and block of
/// query rows, the probabilities P again (the forward's GEMM and its statistics: the same
/// bits), dP = dO V^T, the softmax backward dS = P (dP - rowsum(P dP)) (scaled), dQ = dS K for
/// the block's rows, and the block's share of dK += dS^T Q and dV += P^T dO for the keys it saw.
/// So dK and dV sum over query blocks in order (where a version that kept the whole (T, T)
/// planes summed each key's column in one GEMM: the same sums, rounded in another order).
/// A key or value head's gradient is the sum of its query heads', in head order.
/// `dqkv (B, T, QKV)` is overwritten; `heads (B, NH, 3, T, HS)` is workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Elem>(
    dqkv: &mut [T],
    heads: &mut [T],
    dout: &[T],
    qkv: &[T],
    stats: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    attention_backward_blocked(dqkv, heads, dout, qkv, stats, b, t, c, nh, nkv, ROW_BLOCK)
}

#[allow(clippy::too_many_arguments)]
fn attention_backward_blocked<T: Elem>(
    dqkv: &mut [T],
    heads: &mut [T],
    dout: &[T],
    qkv: &[T],
    stats: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    block: usize,
) {
    use crate::backend::cpu::gemm::gemm_strided_serial as gemm;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let qd = c + 2 * nkv * hs;
    let (c_, c3, hs_) = (c as isize, qd as isize, hs as isize);
    let rep = nh / nkv;
    // Query heads per task. f32 key and value gradients of each query head wait in the
    // workspace and are summed over their group below; bf16 ones would be rounded there, so a
    // bf16 pass with grouped heads takes a whole group per task and sums it first, in f32, in
    // the same order (the same bits, rounded once).
    let per = if T::f32s(&[]).is_some() || rep == 1 { 1 } else { rep };
    let w = block.min(t);
    let group_sums = if per > 1 { 2 * t * hs } else { 0 };
    team::chunks_mut(&mut heads[..b * nh * 3 * t * hs], per * 3 * t * hs, |task, hd| {
        with_tiles(2 * w * t + 3 * t * hs + group_sums, |tiles| {
            let (p, rest) = tiles.split_at_mut(w * t);
            let (ds, rest) = rest.split_at_mut(w * t);
            let (dq, rest) = rest.split_at_mut(t * hs);
            let (dk, rest) = rest.split_at_mut(t * hs);
            let (dv, sums) = rest.split_at_mut(t * hs);
            let (dk_g, dv_g) = sums.split_at_mut(group_sums / 2);
            for j in 0..per {
                let bh = task * per + j;
                let (bi, h) = (bh / nh, bh % nh);
                let row0 = bi * t * qd;
                let (ko, vo) = kv_offsets(h, c, nh, nkv);
                let (q, k, v) = (&qkv[row0 + h * hs..], &qkv[row0 + ko..], &qkv[row0 + vo..]);
                let d = &dout[bi * t * c + h * hs..];
                let st = &stats[bh * t * 2..(bh + 1) * t * 2];
                // Every block adds to the keys it saw.
                dk.fill(0.0);
                dv.fill(0.0);
                for r0 in (0..t).step_by(block) {
                    let (r1, rows) = ((r0 + block).min(t), (r0 + block).min(t) - r0);
                    let (p, ds, ld) = (&mut p[..rows * r1], &mut ds[..rows * r1], r1 as isize);
                    let (qb, db) = (&q[r0 * qd..], &d[r0 * c..]);
                    // P (rows, r1) of query rows r0..r1 over the keys 0..r1 they saw (zero beyond).
                    gemm(rows, r1, hs, p, (ld, 1), false, qb, (c3, 1), k, (1, c3));
                    for (i, row) in p.chunks_exact_mut(r1).enumerate() {
                        let at = 2 * (r0 + i);
                        probs_row(row, r0 + i + 1, scale, [st[at], st[at + 1]]);
                    }
                    // dS (rows, r1) = softmax'(dO V^T)
                    gemm(rows, r1, hs, ds, (ld, 1), false, db, (c_, 1), v, (1, c3));
                    for (i, (row, pr)) in ds.chunks_exact_mut(r1).zip(p.chunks_exact(r1)).enumerate() {
                        softmax_backward_row(row, pr, r0 + i + 1, scale);
                    }
                    gemm(rows, hs, r1, &mut dq[r0 * hs..], (hs_, 1), false, &*ds, (ld, 1), k, (c3, 1));
                    // Keys 0..r1: dK += dS^T Q, dV += P^T dO over these query rows.
                    gemm(r1, hs, rows, &mut *dk, (hs_, 1), true, &*ds, (1, ld), qb, (c3, 1));
                    gemm(r1, hs, rows, &mut *dv, (hs_, 1), true, &*p, (1, ld), db, (c_, 1));
                }
                let part = &mut hd[j * 3 * t * hs..(j + 1) * 3 * t * hs];
                let (pq, pkv) = part.split_at_mut(t * hs);
                T::store_slice(pq, dq, false, None);
                if per == 1 {
                    let (pk, pv) = pkv.split_at_mut(t * hs);
                    T::store_slice(pk, dk, false, None);
                    T::store_slice(pv, dv, false, None);
                } else if j == 0 {
                    dk_g.copy_from_slice(dk);
                    dv_g.copy_from_slice(dv);
                } else {
                    dk_g.iter_mut().zip(&*dk).for_each(|(a, x)| *a += x);
                    dv_g.iter_mut().zip(&*dv).for_each(|(a, x)| *a += x);
                }
            }
            if per > 1 {
                // The group's sums stand in its first head's key and value parts.
                let (pk, pv) = hd[t * hs..3 * t * hs].split_at_mut(t * hs);
                T::store_slice(pk, dk_g, false, None);
                T::store_slice(pv, dv_g, false, None);
            }
        })
    });
    // dQ per head; dK and dV per key/value head: its query heads' summed in order (f32, one
    // head per task), or as the task summed them.
    let heads = &heads[..b * nh * 3 * t * hs];
    team::chunks_mut(&mut dqkv[..b * t * qd], qd, |bt, row| {
        let (bi, ti) = (bt / t, bt % t);
        let part = |h: usize, p: usize| &heads[((bi * nh + h) * 3 + p) * t * hs + ti * hs..][..hs];
        for h in 0..nh {
            row[h * hs..(h + 1) * hs].copy_from_slice(part(h, 0));
        }
        for g in 0..nkv {
            for (p, off) in [(1, c + g * hs), (2, c + (nkv + g) * hs)] {
                let dst = &mut row[off..off + hs];
                dst.copy_from_slice(part(g * rep, p));
                if per == 1 {
                    // (f32 here when rep > 1: the sums are exact f32 adds.)
                    for h in g * rep + 1..(g + 1) * rep {
                        dst.iter_mut().zip(part(h, p)).for_each(|(d, s)| *d = T::from_f32(d.to_f32() + s.to_f32()));
                    }
                }
            }
        }
    });
}

/// Attention of `tn` new positions against a KV cache (inference, one sequence).
/// `qkv (tn, QKV)` holds the new positions' q, k, v; their k and v must already be copied into
/// `k_cache`/`v_cache (maxT, KV*HS)` at rows `pos..pos+tn`. New position i sits at absolute
/// position `pos + i` and attends to cache rows `0..=pos+i`. Per head and block of
/// [`ROW_BLOCK`] new rows, two GEMMs over the keys the block can see (up to its last row):
/// scores = Q K^T and out = softmax(scores) V, the scores in a per-thread tile. The (head,
/// block) tasks are spread over the threads as they go, so a head count that does not divide
/// by the thread count (SmolLM2's 9 on 2) leaves no thread idle, and a long prompt skips the
/// keys of its later positions in its earlier rows. `head_out (NH, tn, HS)` is workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_cached<T: Elem>(
    out: &mut [T],
    head_out: &mut [T],
    qkv: &[T],
    k_cache: &[T],
    v_cache: &[T],
    pos: usize,
    tn: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    use crate::backend::cpu::gemm::gemm_strided_serial;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let (kvd, rep) = (nkv * hs, nh / nkv);
    let (kv_, c3) = (kvd as isize, (c + 2 * kvd) as isize);
    let blocks = tn.div_ceil(ROW_BLOCK);
    let head_out_d = Disjoint::new(&mut head_out[..nh * tn * hs]);
    team::for_ranges(nh * blocks, 1, 1, |tasks| {
        for task in tasks {
            let (h, r0) = (task / blocks, task % blocks * ROW_BLOCK);
            let rows = ROW_BLOCK.min(tn - r0);
            // Keys visible to the block's last row.
            let n = pos + r0 + rows;
            // SAFETY: rows r0..r0+rows of head h's outputs are this task's alone.
            let ho = unsafe { head_out_d.part((h * tn + r0) * hs..(h * tn + r0 + rows) * hs) };
            with_tiles(rows * n + rows * hs, |sc| {
                let (sc, o_tile) = sc.split_at_mut(rows * n);
                // sc (rows, n) = Q_h (rows, HS) @ K_g^T (HS, n), g = h's key/value head
                let q = &qkv[r0 * (c3 as usize) + h * hs..];
                let g = h / rep;
                let k = &k_cache[g * hs..];
                gemm_strided_serial(rows, n, hs, sc, (n as isize, 1), false, q, (c3, 1), k, (1, kv_));
                for (i, row) in sc.chunks_exact_mut(n).enumerate() {
                    softmax_prefix(row, pos + r0 + i + 1, scale);
                }
                // ho (rows, HS) = P (rows, n) @ V_g (n, HS), in f32, stored (rounded) once
                let v = &v_cache[g * hs..];
                gemm_strided_serial(rows, hs, n, o_tile, (hs as isize, 1), false, &*sc, (n as isize, 1), v, (kv_, 1));
                T::store_slice(ho, o_tile, false, None);
            })
        }
    });
    for i in 0..tn {
        for h in 0..nh {
            out[i * c + h * hs..i * c + (h + 1) * hs]
                .copy_from_slice(&head_out[(h * tn + i) * hs..(h * tn + i + 1) * hs]);
        }
    }
}

/// Loop version of [`attention_backward`], kept as the tests' oracle (one query head per
/// key/value head: GPT-2's attention).
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn attention_backward_loops(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    // Pass A: d(scores) = softmax backward of d(att), d(att)[t, t2] = v[t2] . dout[t].
    scratch[..b * nh * t * t].par_chunks_mut(t * t).enumerate().for_each(|(bh, plane)| {
        let (bi, h) = (bh / nh, bh % nh);
        let pa = &att[bh * t * t..(bh + 1) * t * t];
        for ti in 0..t {
            let d = &dout[(bi * t + ti) * c + h * hs..][..hs];
            let row = &mut plane[ti * t..(ti + 1) * t];
            let p = &pa[ti * t..(ti + 1) * t];
            let mut s = 0f32;
            for t2 in 0..=ti {
                let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                row[t2] = dot(v, d);
                s += p[t2] * row[t2];
            }
            for t2 in 0..=ti {
                row[t2] = p[t2] * (row[t2] - s);
            }
            row[ti + 1..].fill(0.0);
        }
    });
    // Pass B: dq, dk, dv for one position (b, t) per task, so every task writes only its row.
    let dpre = &scratch[..b * nh * t * t];
    dqkv[..b * t * c3].par_chunks_mut(c3).enumerate().for_each(|(bt, drow)| {
        let (bi, ti) = (bt / t, bt % t);
        drow.fill(0.0);
        for h in 0..nh {
            let plane = (bi * nh + h) * t * t;
            let (dq, rest) = drow[h * hs..].split_at_mut(c);
            let (dk, rest) = rest.split_at_mut(c);
            let dv = &mut rest[..hs];
            let (dq, dk) = (&mut dq[..hs], &mut dk[..hs]);
            // dq[t] = scale * sum_{t2 <= t} dpre[t, t2] k[t2]
            for t2 in 0..=ti {
                let g = dpre[plane + ti * t + t2] * scale;
                let k = &qkv[(bi * t + t2) * c3 + c + h * hs..][..hs];
                for i in 0..hs {
                    dq[i] += g * k[i];
                }
            }
            // dk[t] = scale * sum_{t1 >= t} dpre[t1, t] q[t1];  dv[t] = sum_{t1 >= t} att[t1, t] dout[t1]
            for t1 in ti..t {
                let g = dpre[plane + t1 * t + ti] * scale;
                let a = att[plane + t1 * t + ti];
                let q = &qkv[(bi * t + t1) * c3 + h * hs..][..hs];
                let d = &dout[(bi * t + t1) * c + h * hs..][..hs];
                for i in 0..hs {
                    dk[i] += g * q[i];
                    dv[i] += a * d[i];
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::{self, *};

    /// Straightforward f64 reference of causal attention (with grouped key/value heads).
    fn reference(qkv: &[f32], b: usize, t: usize, c: usize, nh: usize, nkv: usize) -> Vec<f32> {
        let hs = c / nh;
        let qd = c + 2 * nkv * hs;
        let mut out = vec![0f32; b * t * c];
        for bi in 0..b {
            for h in 0..nh {
                let (ko, vo) = kv_offsets(h, c, nh, nkv);
                for ti in 0..t {
                    let q = |tq: usize, i: usize| qkv[(bi * t + tq) * qd + h * hs + i] as f64;
                    let s: Vec<f64> = (0..=ti)
                        .map(|t2| {
                            (0..hs).map(|i| q(ti, i) * qkv[(bi * t + t2) * qd + ko + i] as f64).sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for i in 0..hs {
                        let mut acc = 0.0;
                        for t2 in 0..=ti {
                            acc += (s[t2] - m).exp() / z * qkv[(bi * t + t2) * qd + vo + i] as f64;
                        }
                        out[(bi * t + ti) * c + h * hs + i] = acc as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn forward_and_backward_on_odd_shapes() {
        let shapes = [
            (1, 1, 1, 1, 1),
            (1, 3, 3, 1, 1),
            (2, 7, 6, 3, 3),
            (3, 5, 8, 2, 2),
            (1, 11, 4, 2, 2),
            (2, 7, 12, 6, 2),
            (1, 9, 8, 4, 1),
        ];
        for &(b, t, c, nh, nkv) in &shapes {
            let qd = c + 2 * nkv * (c / nh);
            let mut r = TestRng((b * 1000 + t * 10 + c + nkv * 7) as u64);
            let qkv: Vec<f32> = r.vec(b * t * qd).iter().map(|x| x * 2.0).collect();
            let proj = r.vec(b * t * c);
            // Stale contents (9s, and each shape's tiles left by the one before) must not leak in.
            let fwd_blocked = |qkv: &[f32], block: usize| {
                let (mut out, mut stats, mut heads) =
                    (vec![9f32; b * t * c], vec![9f32; b * nh * t * 2], vec![9f32; b * t * c]);
                attention_forward_blocked(&mut out, &mut stats, &mut heads, qkv, b, t, c, nh, nkv, block);
                (out, stats)
            };
            let bwd_blocked = |stats: &[f32], block: usize| {
                let (mut dqkv, mut heads) = (vec![9f32; b * t * qd], vec![9f32; b * t * 3 * c]);
                attention_backward_blocked(&mut dqkv, &mut heads, &proj, &qkv, stats, b, t, c, nh, nkv, block);
                dqkv
            };
            let fwd = |qkv: &[f32]| fwd_blocked(qkv, ROW_BLOCK);
            let (out, stats) = fwd(&qkv);
            assert_close(&out, &reference(&qkv, b, t, c, nh, nkv), 1e-5, 1e-4, "attention fwd");
            let mut dqkv = vec![7f32; b * t * qd];
            let mut heads = vec![5f32; b * t * 3 * c];
            attention_backward(&mut dqkv, &mut heads, &proj, &qkv, &stats, b, t, c, nh, nkv);
            check_grad(&qkv, &dqkv, |x| testutil::dot(&fwd(x).0, &proj), "dqkv");
            // Causal blocks of 1, 2 and 3 rows (several blocks, a ragged last one) give the
            // results of one block; each block's rows are the same GEMM rows, so the forward
            // and its statistics are the same bits.
            let (full_out, full_stats) = fwd_blocked(&qkv, t.max(1));
            let full_dqkv = bwd_blocked(&full_stats, t.max(1));
            for block in [1, 2, 3] {
                let (out, stats) = fwd_blocked(&qkv, block);
                assert_close(&out, &full_out, 1e-6, 1e-5, "blocked fwd");
                assert_close(&stats, &full_stats, 1e-6, 1e-5, "blocked stats");
                assert_close(&bwd_blocked(&stats, block), &full_dqkv, 1e-5, 1e-4, "blocked bwd");
            }
            // The loop versions (which keep the whole (T, T) probabilities) agree.
            let (mut out2, mut att2) = (vec![0f32; b * t * c], vec![0f32; b * nh * t * t]);
            attention_forward_loops(&mut out2, &mut att2, &qkv, b, t, c, nh, nkv);
            assert_close(&out2, &out, 1e-6, 1e-5, "loops fwd");
            if nkv == nh {
                let mut dqkv2 = vec![0f32; b * t * qd];
                let mut scratch = vec![3f32; b * nh * t * t];
                attention_backward_loops(&mut dqkv2, &mut scratch, &proj, &qkv, &att2, b, t, c, nh);
                assert_close(&dqkv2, &dqkv, 1e-5, 1e-4, "loops bwd");
            }
        }
    }

    /// The backward's probabilities, rebuilt from a row's statistics, are the forward's bits,
    /// for rows long and short, with scores large and tiny, and past the SIMD width.
    #[test]
    fn rebuilt_probabilities_are_the_forwards_bits() {
        let mut r = TestRng(11);
        for (len, live, gain) in [(1, 1, 1.0), (7, 5, 30.0), (37, 37, 0.01), (130, 97, 3.0), (64, 1, 200.0)] {
            let raw: Vec<f32> = r.vec(len).iter().map(|x| x * gain).collect();
            let scale = 0.125;
            let mut fwd = raw.clone();
            let st = softmax_prefix(&mut fwd, live, scale);
            let mut again = raw.clone();
            probs_row(&mut again, live, scale, st);
            assert!(fwd.iter().zip(&again).all(|(x, y)| x.to_bits() == y.to_bits()), "len {len} live {live}");
            assert!(fwd[live..].iter().all(|&x| x == 0.0));
        }
    }

    /// The KV-cached pass (a prompt in pieces, then one position at a time) gives the full
    /// causal pass's outputs, with rows past ROW_BLOCK in one piece.
    #[test]
    fn cached_equals_full() {
        for &(t, c, nh, nkv, cut) in &[(5, 6, 3, 3, 2), (70, 8, 2, 1, 67), (9, 12, 6, 2, 1)] {
            let (hs, kvd) = (c / nh, nkv * (c / nh));
            let qd = c + 2 * kvd;
            let mut r = TestRng((t * 31 + c) as u64);
            let qkv = r.vec(t * qd);
            let (full, _) = {
                let (mut out, mut stats, mut heads) = (vec![0f32; t * c], vec![0f32; nh * t * 2], vec![0f32; t * c]);
                attention_forward(&mut out, &mut stats, &mut heads, &qkv, 1, t, c, nh, nkv);
                (out, stats)
            };
            let (mut kc, mut vc) = (vec![f32::NAN; t * kvd], vec![f32::NAN; t * kvd]);
            let mut got = vec![0f32; t * c];
            let mut pos = 0;
            for tn in std::iter::once(cut).chain(std::iter::repeat_n(1, t - cut)) {
                for i in pos..pos + tn {
                    kc[i * kvd..(i + 1) * kvd].copy_from_slice(&qkv[i * qd + c..][..kvd]);
                    vc[i * kvd..(i + 1) * kvd].copy_from_slice(&qkv[i * qd + c + kvd..][..kvd]);
                }
                let (mut out, mut ho) = (vec![0f32; tn * c], vec![9f32; tn * c]);
                let q = &qkv[pos * qd..(pos + tn) * qd];
                // Only the rows written so far: NaNs past them would show if read.
                let (k, v) = (&kc[..(pos + tn) * kvd], &vc[..(pos + tn) * kvd]);
                attention_forward_cached(&mut out, &mut ho, q, k, v, pos, tn, c, nh, nkv);
                got[pos * c..(pos + tn) * c].copy_from_slice(&out);
                pos += tn;
            }
            assert_eq!(hs * nh, c);
            assert_close(&got, &full, 1e-6, 1e-5, "cached");
        }
    }

    /// On bf16 activations (bits), the forward, the backward (grouped heads or not, one block
    /// or several) and the KV-cached pass give the f32 passes' bits on the widened values,
    /// rounded once; the statistics are the same f32 bits.
    #[test]
    fn bf16_gives_the_f32_bits_rounded() {
        use crate::core::bf16::{from_f32, to_f32};
        let to16 = |v: &[f32]| v.iter().map(|&x| from_f32(x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|&x| to_f32(x)).collect::<Vec<f32>>();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        #[rustfmt::skip]
        let shapes = [
            (1, 1, 1, 1, 1, 64), (2, 7, 6, 3, 3, 2), (1, 9, 8, 4, 1, 3),
            (2, 70, 12, 6, 2, 64), (1, 11, 8, 4, 2, 4), (3, 5, 10, 2, 2, 64),
        ];
        for &(b, t, c, nh, nkv, block) in &shapes {
            let (hs, what) = (c / nh, format!("b={b} t={t} c={c} nh={nh} nkv={nkv} block={block}"));
            let (qd, kvd) = (c + 2 * nkv * hs, nkv * hs);
            let mut r = TestRng((b * 1000 + t * 10 + c + nkv * 7) as u64);
            let qkv16 = to16(&r.vec(b * t * qd).iter().map(|x| x * 2.0).collect::<Vec<f32>>());
            let dout16 = to16(&r.vec(b * t * c));
            let (qkv, dout) = (wide(&qkv16), wide(&dout16));
            let (mut o, mut st, mut hd) = (vec![9f32; b * t * c], vec![9f32; b * nh * t * 2], vec![9f32; b * t * c]);
            attention_forward_blocked(&mut o, &mut st, &mut hd, &qkv, b, t, c, nh, nkv, block);
            let (mut o16, mut st16, mut hd16) =
                (vec![7u16; b * t * c], vec![9f32; b * nh * t * 2], vec![7u16; b * t * c]);
            attention_forward_blocked(&mut o16, &mut st16, &mut hd16, &qkv16, b, t, c, nh, nkv, block);
            assert_eq!(to16(&o), o16, "forward {what}");
            assert_eq!(bits(&st), bits(&st16), "stats {what}");
            let (mut dq, mut hb) = (vec![9f32; b * t * qd], vec![9f32; b * t * 3 * c]);
            attention_backward_blocked(&mut dq, &mut hb, &dout, &qkv, &st, b, t, c, nh, nkv, block);
            let (mut dq16, mut hb16) = (vec![7u16; b * t * qd], vec![7u16; b * t * 3 * c]);
            attention_backward_blocked(&mut dq16, &mut hb16, &dout16, &qkv16, &st, b, t, c, nh, nkv, block);
            assert_eq!(to16(&dq), dq16, "backward {what}");
            if b == 1 {
                // The last positions against a cache of the first ones and themselves.
                let pos = t / 2;
                let tn = t - pos;
                let cache = |x: &[u16], at: usize| {
                    (0..t).flat_map(|i| x[i * qd + at..i * qd + at + kvd].to_vec()).collect::<Vec<u16>>()
                };
                let (kc16, vc16) = (cache(&qkv16, c), cache(&qkv16, c + kvd));
                let (mut o, mut ho) = (vec![9f32; tn * c], vec![9f32; tn * c]);
                let q = &qkv[pos * qd..];
                attention_forward_cached(&mut o, &mut ho, q, &wide(&kc16), &wide(&vc16), pos, tn, c, nh, nkv);
                let (mut o16, mut ho16) = (vec![7u16; tn * c], vec![7u16; tn * c]);
                attention_forward_cached(&mut o16, &mut ho16, &qkv16[pos * qd..], &kc16, &vc16, pos, tn, c, nh, nkv);
                assert_eq!(to16(&o), o16, "cached {what}");
            }
        }
    }
}

//! Causal multi-head self-attention on the packed qkv activations, with grouped-query attention.
//!
//! Layout: `qkv (B, T, QKV)` holds each position's NH query heads, then its KV key heads, then
//! its KV value heads (QKV = (NH + 2 KV) * HS; GPT-2: KV = NH, QKV = 3C). Query head h of
//! position t is `qkv[b, t, h*HS .. (h+1)*HS]`; it reads key and value head g = h / (NH / KV),
//! at offsets C + g*HS and C + KV*HS + g*HS. The softmax output `att (B, NH, T, T)` is kept for
//! backward (entries above the diagonal are 0).

use super::math::{add_lanes, combine_lanes, max_lanes};
use super::team::{self, Disjoint};
#[cfg(test)]
use rayon::prelude::*;

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
/// softmax(scale * x), the rest (future positions) 0.
fn softmax_prefix(row: &mut [f32], live: usize, scale: f32) {
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
/// see (those up to its last row), which halves the attention GEMMs at long T. At T <= 64 there
/// is one block, the full T x T.
const ROW_BLOCK: usize = 64;

/// out (B, T, C), att (B, NH, T, T) from qkv (B, T, QKV). Per (batch, head) and block of query
/// rows, two GEMMs: scores = Q K^T over the visible keys (then the causal mask inside the
/// block), and out = softmax(scores) V. `att` is zero above the diagonal. `heads (B, NH, T, HS)`
/// is workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    out: &mut [f32],
    att: &mut [f32],
    heads: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    attention_forward_blocked(Some((out, heads)), att, qkv, b, t, c, nh, nkv, ROW_BLOCK)
}

/// att (B, NH, T, T) alone from qkv (B, T, QKV): [`attention_forward`]'s probabilities, the
/// same bits (the same calls), for a backward that did not keep them.
pub fn attention_probs(att: &mut [f32], qkv: &[f32], b: usize, t: usize, c: usize, nh: usize, nkv: usize) {
    attention_forward_blocked(None, att, qkv, b, t, c, nh, nkv, ROW_BLOCK)
}

/// `out_heads`: the output (B, T, C) and its workspace (B, NH, T, HS); None for att alone.
#[allow(clippy::too_many_arguments)]
fn attention_forward_blocked(
    out_heads: Option<(&mut [f32], &mut [f32])>,
    att: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    block: usize,
) {
    use crate::cpu::matmul::gemm_strided_serial as gemm;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let qd = c + 2 * nkv * hs;
    let (c3, ti_, hs_) = (qd as isize, t as isize, hs as isize);
    let (out, mut heads) = match out_heads {
        Some((out, heads)) => (Some(out), Some(heads)),
        None => (None, None),
    };
    // The Disjoint view of the heads ends with this block, before they are read below.
    {
        let heads_d = heads.as_deref_mut().map(|h| Disjoint::new(&mut h[..b * nh * t * hs]));
        team::chunks_mut(&mut att[..b * nh * t * t], t * t, |bh, p| {
            // SAFETY: plane bh of the heads is this task's alone.
            let mut o = heads_d.as_ref().map(|d| unsafe { d.part(bh * t * hs..(bh + 1) * t * hs) });
            let (row0, h) = ((bh / nh) * t * qd, bh % nh);
            let (ko, vo) = kv_offsets(h, c, nh, nkv);
            let (q, k, v) = (&qkv[row0 + h * hs..], &qkv[row0 + ko..], &qkv[row0 + vo..]);
            for r0 in (0..t).step_by(block) {
                let r1 = (r0 + block).min(t);
                // Rows r0..r1 see keys 0..r1; softmax_prefix zeroes the rest of each row.
                gemm(r1 - r0, r1, hs, &mut p[r0 * t..], (ti_, 1), false, &q[r0 * qd..], (c3, 1), k, (1, c3));
                for ti in r0..r1 {
                    softmax_prefix(&mut p[ti * t..(ti + 1) * t], ti + 1, scale);
                }
                if let Some(o) = o.as_deref_mut() {
                    gemm(r1 - r0, hs, r1, &mut o[r0 * hs..], (hs_, 1), false, &p[r0 * t..], (ti_, 1), v, (c3, 1));
                }
            }
        });
    }
    let (Some(out), Some(heads)) = (out, heads) else { return };
    let heads = &heads[..b * nh * t * hs];
    team::chunks_mut(&mut out[..b * t * c], c, |bt, row| {
        let (bi, ti) = (bt / t, bt % t);
        for h in 0..nh {
            row[h * hs..(h + 1) * hs].copy_from_slice(&heads[((bi * nh + h) * t + ti) * hs..][..hs]);
        }
    });
}

/// Backward of [`attention_forward`], as GEMMs per (batch, head): dP = dO V^T, the softmax
/// backward dS = P (dP - rowsum(P dP)) (scaled), dQ = dS K, dK = dS^T Q, dV = P^T dO, each
/// restricted to the causal triangle by blocks of rows (dP, dQ) or of keys (dK, dV). A key or
/// value head's gradient is the sum of its query heads', in head order.
/// `dqkv (B, T, QKV)` is overwritten; `scratch (B, NH, T, T)` and `heads (B, NH, 3, T, HS)` are
/// workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    heads: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
) {
    attention_backward_blocked(dqkv, scratch, heads, dout, qkv, att, b, t, c, nh, nkv, ROW_BLOCK)
}

#[allow(clippy::too_many_arguments)]
fn attention_backward_blocked(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    heads: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    block: usize,
) {
    use crate::cpu::matmul::gemm_strided_serial as gemm;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let qd = c + 2 * nkv * hs;
    let (c_, c3, ti_, hs_) = (c as isize, qd as isize, t as isize, hs as isize);
    let heads_d = Disjoint::new(&mut heads[..b * nh * 3 * t * hs]);
    team::chunks_mut(&mut scratch[..b * nh * t * t], t * t, |bh, ds| {
        // SAFETY: plane bh of the heads is this task's alone.
        let hd = unsafe { heads_d.part(bh * 3 * t * hs..(bh + 1) * 3 * t * hs) };
        let (bi, h) = (bh / nh, bh % nh);
        let row0 = bi * t * qd;
        let (ko, vo) = kv_offsets(h, c, nh, nkv);
        let (q, k, v) = (&qkv[row0 + h * hs..], &qkv[row0 + ko..], &qkv[row0 + vo..]);
        let d = &dout[bi * t * c + h * hs..];
        let p = &att[bh * t * t..(bh + 1) * t * t];
        let (dq, rest) = hd.split_at_mut(t * hs);
        let (dk, dv) = rest.split_at_mut(t * hs);
        for r0 in (0..t).step_by(block) {
            let r1 = (r0 + block).min(t);
            // dP and dS of query rows r0..r1 over the keys 0..r1 they saw (zero beyond).
            gemm(r1 - r0, r1, hs, &mut ds[r0 * t..], (ti_, 1), false, &d[r0 * c..], (c_, 1), v, (1, c3));
            for ti in r0..r1 {
                softmax_backward_row(&mut ds[ti * t..(ti + 1) * t], &p[ti * t..(ti + 1) * t], ti + 1, scale);
            }
            gemm(r1 - r0, hs, r1, &mut dq[r0 * hs..], (hs_, 1), false, &ds[r0 * t..], (ti_, 1), k, (c3, 1));
        }
        for k0 in (0..t).step_by(block) {
            let k1 = (k0 + block).min(t);
            // Keys k0..k1 were seen by queries k0..t only: dK = dS^T Q and dV = P^T dO over those.
            let (lhs_ds, lhs_p) = (&ds[k0 * t + k0..], &p[k0 * t + k0..]);
            gemm(k1 - k0, hs, t - k0, &mut dk[k0 * hs..], (hs_, 1), false, lhs_ds, (1, ti_), &q[k0 * qd..], (c3, 1));
            gemm(k1 - k0, hs, t - k0, &mut dv[k0 * hs..], (hs_, 1), false, lhs_p, (1, ti_), &d[k0 * c..], (c_, 1));
        }
    });
    // dQ per head; dK and dV per key/value head, summed over its query heads in order.
    let heads = &heads[..b * nh * 3 * t * hs];
    let rep = nh / nkv;
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
                for h in g * rep + 1..(g + 1) * rep {
                    dst.iter_mut().zip(part(h, p)).for_each(|(d, s)| *d += s);
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
/// scores = Q K^T and out = softmax(scores) V. The (head, block) tasks are spread over the
/// threads as they go, so a head count that does not divide by the thread count (SmolLM2's 9
/// on 2) leaves no thread idle, and a long prompt skips the keys of its later positions in
/// its earlier rows. `scores (NH, tn, maxT)` and `head_out (NH, tn, HS)` are workspace.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_cached(
    out: &mut [f32],
    scores: &mut [f32],
    head_out: &mut [f32],
    qkv: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos: usize,
    tn: usize,
    c: usize,
    nh: usize,
    nkv: usize,
    max_t: usize,
) {
    use crate::cpu::matmul::gemm_strided_serial;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let (kvd, rep) = (nkv * hs, nh / nkv);
    let (kv_, c3, mt) = (kvd as isize, (c + 2 * kvd) as isize, max_t as isize);
    let blocks = tn.div_ceil(ROW_BLOCK);
    let scores_d = Disjoint::new(&mut scores[..nh * tn * max_t]);
    let head_out_d = Disjoint::new(&mut head_out[..nh * tn * hs]);
    team::for_ranges(nh * blocks, 1, 1, |tasks| {
        for task in tasks {
            let (h, r0) = (task / blocks, task % blocks * ROW_BLOCK);
            let rows = ROW_BLOCK.min(tn - r0);
            // Keys visible to the block's last row.
            let n = pos + r0 + rows;
            // SAFETY: rows r0..r0+rows of head h, in the scores and the head outputs, are this
            // task's alone.
            let (sc, ho) = unsafe {
                let at = h * tn + r0;
                (scores_d.part(at * max_t..(at + rows) * max_t), head_out_d.part(at * hs..(at + rows) * hs))
            };
            // sc (rows, n) = Q_h (rows, HS) @ K_g^T (HS, n), g = h's key/value head
            let q = &qkv[r0 * (c3 as usize) + h * hs..];
            let g = h / rep;
            let k = &k_cache[g * hs..];
            gemm_strided_serial(rows, n, hs, sc, (mt, 1), false, q, (c3, 1), k, (1, kv_));
            for i in 0..rows {
                softmax_prefix(&mut sc[i * max_t..i * max_t + n], pos + r0 + i + 1, scale);
            }
            // ho (rows, HS) = P (rows, n) @ V_g (n, HS)
            let v = &v_cache[g * hs..];
            gemm_strided_serial(rows, hs, n, ho, (hs as isize, 1), false, sc, (mt, 1), v, (kv_, 1));
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
    use crate::cpu::testutil::{self, *};

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
            let fwd = |qkv: &[f32]| {
                let mut out = vec![0f32; b * t * c];
                let mut att = vec![0f32; b * nh * t * t];
                let mut heads = vec![0f32; b * t * c];
                attention_forward(&mut out, &mut att, &mut heads, qkv, b, t, c, nh, nkv);
                (out, att)
            };
            // Causal blocks of 1, 2 and 3 rows (several blocks, a ragged last one) give the
            // same results as one block; stale workspace contents must not leak in.
            let full = {
                let (mut out, mut att, mut heads) =
                    (vec![0f32; b * t * c], vec![0f32; b * nh * t * t], vec![0f32; b * t * c]);
                attention_forward_blocked(Some((&mut out, &mut heads)), &mut att, &qkv, b, t, c, nh, nkv, t.max(1));
                let (mut dqkv, mut scratch, mut heads) =
                    (vec![0f32; b * t * qd], vec![0f32; b * nh * t * t], vec![0f32; b * t * 3 * c]);
                let (h, s) = (&mut heads, &mut scratch);
                attention_backward_blocked(&mut dqkv, s, h, &proj, &qkv, &att, b, t, c, nh, nkv, t.max(1));
                (out, att, dqkv)
            };
            for block in [1, 2, 3] {
                let (mut out, mut att, mut heads) =
                    (vec![9f32; b * t * c], vec![9f32; b * nh * t * t], vec![9f32; b * t * c]);
                attention_forward_blocked(Some((&mut out, &mut heads)), &mut att, &qkv, b, t, c, nh, nkv, block);
                assert_close(&out, &full.0, 1e-6, 1e-5, "blocked fwd");
                assert_close(&att, &full.1, 1e-6, 1e-5, "blocked att");
                let (mut dqkv, mut scratch, mut heads) =
                    (vec![9f32; b * t * qd], vec![9f32; b * nh * t * t], vec![9f32; b * t * 3 * c]);
                let (h, s) = (&mut heads, &mut scratch);
                attention_backward_blocked(&mut dqkv, s, h, &proj, &qkv, &att, b, t, c, nh, nkv, block);
                assert_close(&dqkv, &full.2, 1e-5, 1e-4, "blocked bwd");
            }
            let (out, att) = fwd(&qkv);
            assert_close(&out, &reference(&qkv, b, t, c, nh, nkv), 1e-5, 1e-4, "attention fwd");
            // The probabilities alone (the backward's recomputation) are the forward's bits.
            let mut probs = vec![9f32; b * nh * t * t];
            attention_probs(&mut probs, &qkv, b, t, c, nh, nkv);
            assert!(probs.iter().zip(&att).all(|(x, y)| x.to_bits() == y.to_bits()), "attention_probs");
            let mut dqkv = vec![7f32; b * t * qd];
            let mut scratch = vec![3f32; b * nh * t * t];
            let mut heads = vec![5f32; b * t * 3 * c];
            attention_backward(&mut dqkv, &mut scratch, &mut heads, &proj, &qkv, &att, b, t, c, nh, nkv);
            check_grad(&qkv, &dqkv, |x| testutil::dot(&fwd(x).0, &proj), "dqkv");
            // The loop versions agree with the GEMM versions.
            let (mut out2, mut att2) = (vec![0f32; b * t * c], vec![0f32; b * nh * t * t]);
            attention_forward_loops(&mut out2, &mut att2, &qkv, b, t, c, nh, nkv);
            assert_close(&out2, &out, 1e-6, 1e-5, "loops fwd");
            assert_close(&att2, &att, 1e-6, 1e-5, "loops att");
            if nkv == nh {
                let mut dqkv2 = vec![0f32; b * t * qd];
                attention_backward_loops(&mut dqkv2, &mut scratch, &proj, &qkv, &att, b, t, c, nh);
                assert_close(&dqkv2, &dqkv, 1e-5, 1e-4, "loops bwd");
            }
        }
    }
}

//! Token (+ position) embedding on the GPU (kernels/encoder.wgsl).

use super::all_bf16;
use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, In16, Module, Out16, F, K, U32};
use super::{cut, u, GpuBackend, Threads};
use crate::backend::ops::opt;
use crate::backend::ops::{EncoderBackward, EncoderForward, EncoderOps};
use crate::backend::{Buf, DType};
use std::ops::Range;

impl GpuBackend {
    /// out (B, T, C) = wte (Vp, C)[inp (B, T)] [+ wpe (T, C)[t]], a dispatch per window of wte.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encoder_forward_(
        &mut self,
        out: Buf,
        inp: Buf,
        wte: Buf,
        wpe: Option<Buf>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        assert!(c > 0 && wte.len.is_multiple_of(c), "encoder_forward: embedding shapes");
        let ins: Vec<Buf> = [inp, wte].into_iter().chain(wpe).collect();
        Self::disjoint("encoder_forward", &[out], &ins);
        if b * t == 0 {
            return;
        }
        let pe = u(wpe.is_some() as usize);
        let kernel = FORWARD.on(out.dtype == DType::BF16);
        let wpe = match wpe {
            Some(w) => self.win(w),
            None => self.mem.dummy.clone(),
        };
        let table = self.mem.row_pieces(wte.len / c, &[(wte, c)]);
        for seqs in self.mem.row_pieces(b, &[(out, t * c), (inp, t)]) {
            let n = (seqs.end - seqs.start) * t;
            let o = self.win(out.slice(seqs.start * t * c..seqs.end * t * c));
            let i = self.win(inp.slice(seqs.start * t..seqs.end * t));
            for rows in &table {
                let w = self.win(wte.slice(rows.start * c..rows.end * c));
                let imm = [o.off, i.off, w.off, wpe.off, u(n), u(t), u(c), u(rows.start), u(rows.end), 0, pe];
                self.dispatch(kernel, &[o.clone(), i.clone(), w, wpe.clone()], &imm, Threads(n * c));
            }
        }
    }

    /// dwte (Vp, C) += the rows of dout (B, T, C) grouped by token, [dwpe (T, C) += their sum
    /// over the batch]. The positions of each token are grouped on the host, from the host's copy
    /// of the token ids, as llm.c's encoder backward does; each token's rows are then added in
    /// position order (pieces of dout that fit a binding one after another), so the result is
    /// the same on every run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encoder_backward_(
        &mut self,
        dwte: Buf,
        dwpe: Option<Buf>,
        dout: Buf,
        inp: Buf,
        b: usize,
        t: usize,
        c: usize,
    ) {
        assert!(c > 0 && dwte.len.is_multiple_of(c), "encoder_backward: embedding shapes");
        let outs: Vec<Buf> = [dwte].into_iter().chain(dwpe).collect();
        Self::disjoint("encoder_backward", &outs, &[dout, inp]);
        if b * t == 0 {
            return;
        }
        // A token's kernel loops over its positions in a piece: at most loop_rows of them.
        let per_piece = (self.cuts.loop_rows / t).max(1);
        let seqs: Vec<_> =
            self.mem.row_pieces(b, &[(dout, t * c)]).into_iter().flat_map(|r| cut(r, per_piece)).collect();
        let ids = &self.host_u32.get(&inp.alloc).expect("token ids are a u32 buffer of this backend")
            [inp.off..inp.off + b * t];
        let (data, at) = token_buckets(ids, &seqs, t);
        let Some(bk) = self.workspace(|s| &mut s.buckets, data.len(), DType::U32) else { return };
        crate::backend::Backend::upload_u32(self, bk, &data);
        let table = self.mem.row_pieces(dwte.len / c, &[(dwte, c)]);
        let (wpe, dummy) = (dwpe.map(|w| self.win(w)), self.mem.dummy.clone());
        for (s, (range, tokens)) in seqs.iter().zip(at) {
            let d = self.win(dout.slice(s.start * t * c..s.end * t * c));
            let k = self.win(bk.slice(range));
            for rows in &table {
                let w = self.win(dwte.slice(rows.start * c..rows.end * c));
                let imm = [w.off, k.off, d.off, 0, u(tokens), 0, u(c), u(rows.start), u(rows.end)];
                self.dispatch(BACKWARD_WTE, &[w, k.clone(), d.clone()], &imm, Threads(tokens * c));
            }
            if let Some(wpe) = &wpe {
                let imm = [wpe.off, 0, d.off, 0, u(t), 0, u(c), 0, 0, u(s.end - s.start)];
                self.dispatch(BACKWARD_WPE, &[wpe.clone(), dummy.clone(), d], &imm, Threads(t * c));
            }
        }
    }
}

/// The buckets of kernels/encoder.wgsl for each piece `s` of sequences (of `t` positions) of
/// the token ids: its distinct tokens (U), U + 1 starts, then its positions (counted from the
/// piece's first) grouped by token, each group in position order. All pieces in one u32 array,
/// with each piece's range in it and its U.
fn token_buckets(ids: &[u32], seqs: &[Range<usize>], t: usize) -> (Vec<u32>, Vec<(Range<usize>, usize)>) {
    let mut data: Vec<u32> = vec![];
    let mut at = vec![];
    for s in seqs {
        let ids = &ids[s.start * t..s.end * t];
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&p| (ids[p as usize], p));
        let (mut uniq, mut starts) = (vec![], vec![]);
        for (j, &p) in order.iter().enumerate() {
            if uniq.last() != Some(&ids[p as usize]) {
                uniq.push(ids[p as usize]);
                starts.push(j as u32);
            }
        }
        starts.push(order.len() as u32);
        let (first, tokens) = (data.len(), uniq.len());
        data.extend(uniq.into_iter().chain(starts).chain(order));
        at.push((first..data.len(), tokens));
    }
    (data, at)
}

impl EncoderOps for GpuBackend {
    fn encoder_forward(&mut self, a: &EncoderForward) {
        let (s, c) = (a.s, a.c);
        if all_bf16(&[a.out, a.wte, opt(a.wpe)]) {
            // The bf16 tables read and out written as they are.
            return self.encoder_forward_(a.out, a.ids, a.wte, a.wpe, s.b, s.t, c);
        }
        self.call_in_f32(a, Nearest, |g, a| g.encoder_forward_(a.out, a.ids, a.wte, a.wpe, s.b, s.t, c))
    }

    fn encoder_backward(&mut self, a: &EncoderBackward) {
        let (s, c) = (a.s, a.c);
        self.call_in_f32(a, Nearest, |g, a| g.encoder_backward_(a.dwte, a.dwpe, a.dout, a.ids, s.b, s.t, c))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// The embedding's kernels (kernels/encoder.wgsl).
pub(super) const MODULE: Module = Module {
    name: "encoder",
    src: include_str!("kernels/encoder.wgsl"),
    buffers: &[("x", F), ("ids", U32), ("y", F), ("z", F)],
    entries: &[
        Entry { name: "encoder_forward", bindings: 4, u32s: 0b10, bf16s: 0, variants: &[&[Out16, U32, In16, In16]] },
        Entry { name: "encoder_backward_wte", bindings: 3, u32s: 0b10, bf16s: 0, variants: &[] },
        Entry { name: "encoder_backward_wpe", bindings: 3, u32s: 0b10, bf16s: 0, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const FORWARD: K = K::of(&MODULE, 0);
pub(super) const BACKWARD_WTE: K = K::of(&MODULE, 1);
pub(super) const BACKWARD_WPE: K = K::of(&MODULE, 2);

#[cfg(test)]
mod tests {
    #[test]
    fn buckets_group_positions_by_token_in_order() {
        // Two pieces of one sequence each (t = 4).
        let ids = [7, 3, 7, 7, 1, 1, 2, 1];
        let (data, at) = super::token_buckets(&ids, &[0..1, 1..2], 4);
        assert_eq!(at, vec![(0..9, 2), (9..18, 2)]);
        // Piece 0: tokens [3, 7], starts [0, 1, 4], positions [1 | 0, 2, 3].
        assert_eq!(&data[0..9], &[3, 7, 0, 1, 4, 1, 0, 2, 3]);
        // Piece 1: tokens [1, 2], starts [0, 3, 4], positions [0, 1, 3 | 2].
        assert_eq!(&data[9..18], &[1, 2, 0, 3, 4, 0, 1, 3, 2]);
    }
}

//! Token + position embedding on the GPU (kernels/encoder.wgsl).

use super::{cut, grid, lens, u, GpuBackend, K, LOOP_ROWS};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// out (B, T, C) = wte (Vp, C)[inp (B, T)] + wpe (maxT, C)[t], a dispatch per window of wte.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encoder_forward_(&mut self, out: Buf, inp: Buf, wte: Buf, wpe: Buf, b: usize, t: usize, c: usize) {
        lens!("encoder_forward"; out => b * t * c, inp => b * t);
        assert!(wte.len.is_multiple_of(c) && wpe.len >= t * c, "encoder_forward: embedding shapes");
        let wpe = self.win(wpe.prefix(t * c));
        let table = self.mem.row_pieces(wte.len / c, &[(wte, c)]);
        for seqs in self.mem.row_pieces(b, &[(out, t * c), (inp, t)]) {
            let n = (seqs.end - seqs.start) * t;
            let o = self.win(out.slice(seqs.start * t * c..seqs.end * t * c));
            let i = self.win(inp.slice(seqs.start * t..seqs.end * t));
            for rows in &table {
                let w = self.win(wte.slice(rows.start * c..rows.end * c));
                let imm = [o.off, i.off, w.off, wpe.off, u(n), u(t), u(c), u(rows.start), u(rows.end)];
                self.dispatch(K::EncoderForward, &[o.clone(), i.clone(), w, wpe.clone()], &imm, grid(n * c));
            }
        }
    }

    /// dwte (Vp, C) += the rows of dout (B, T, C) grouped by token, dwpe (maxT, C) += their sum
    /// over the batch. The positions of each token are grouped on the host, from the host's copy
    /// of the token ids, as llm.c's encoder backward does; each token's rows are then added in
    /// position order (pieces of dout that fit a binding one after another), so the result is
    /// the same on every run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encoder_backward_(
        &mut self,
        dwte: Buf,
        dwpe: Buf,
        dout: Buf,
        inp: Buf,
        b: usize,
        t: usize,
        c: usize,
    ) {
        lens!("encoder_backward"; dout => b * t * c, inp => b * t);
        assert!(dwte.len.is_multiple_of(c) && dwpe.len >= t * c, "encoder_backward: embedding shapes");
        // A token's kernel loops over its positions in a piece: at most LOOP_ROWS of them.
        let seqs: Vec<_> =
            self.mem.row_pieces(b, &[(dout, t * c)]).into_iter().flat_map(|r| cut(r, (LOOP_ROWS / t).max(1))).collect();
        let host = &self.host_u32.get(&inp.alloc).expect("token ids are a u32 buffer of this backend")
            [inp.off..inp.off + b * t];
        // Per piece of dout: its distinct tokens, U + 1 starts, then its positions grouped by
        // token (counted from the piece's first), all pieces in one upload.
        let mut data: Vec<u32> = vec![];
        let mut at = vec![]; // (offset of the piece's buckets, distinct tokens)
        for s in &seqs {
            let ids = &host[s.start * t..s.end * t];
            let mut order: Vec<u32> = (0..ids.len() as u32).collect();
            order.sort_by_key(|&p| (ids[p as usize], p));
            let mut uniq: Vec<u32> = vec![];
            let mut starts: Vec<u32> = vec![];
            for (j, &p) in order.iter().enumerate() {
                if uniq.last() != Some(&ids[p as usize]) {
                    uniq.push(ids[p as usize]);
                    starts.push(j as u32);
                }
            }
            starts.push(order.len() as u32);
            at.push((data.len(), uniq.len()));
            data.extend(uniq.into_iter().chain(starts).chain(order));
        }
        let Some(bk) = self.workspace(|s| &mut s.buckets, data.len(), DType::U32) else { return };
        crate::backend::Backend::upload_u32(self, bk, &data);
        let table = self.mem.row_pieces(dwte.len / c, &[(dwte, c)]);
        for (s, &(off, tokens)) in seqs.iter().zip(&at) {
            let d = self.win(dout.slice(s.start * t * c..s.end * t * c));
            let k = self.win(bk.slice(off..data.len()));
            for rows in &table {
                let w = self.win(dwte.slice(rows.start * c..rows.end * c));
                let imm = [w.off, k.off, d.off, 0, u(tokens), 0, u(c), u(rows.start), u(rows.end)];
                self.dispatch(K::EncoderBackwardWte, &[w, k.clone(), d.clone()], &imm, grid(tokens * c));
            }
            let wpe = self.win(dwpe.prefix(t * c));
            let imm = [wpe.off, 0, d.off, 0, u(t), 0, u(c), 0, 0, u(s.end - s.start)];
            let dummy = self.mem.dummy.clone();
            self.dispatch(K::EncoderBackwardWpe, &[wpe, dummy, d], &imm, grid(t * c));
        }
    }
}

//! The rotary position embedding on the GPU (kernels/rope.wgsl).

use super::{f, u, GpuBackend, Threads, K};
use crate::backend::{Buf, DType};

impl GpuBackend {
    /// Rotate the q and k heads of qkv (N, QKV) in place by the angles of their positions
    /// (row r at pos + r % T), from rope (maxT, HS); `sign` -1 rotates back (the backward).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_(
        &mut self,
        qkv: Buf,
        table: Buf,
        n: usize,
        t: usize,
        pos: usize,
        nh: usize,
        nkv: usize,
        hs: usize,
        sign: f32,
    ) {
        let qd = (nh + 2 * nkv) * hs;
        assert!(t > 0 && n.is_multiple_of(t) && hs.is_multiple_of(2), "rope: {n} rows of T={t}, HS={hs}");
        assert!(table.len >= (pos + t) * hs, "rope: positions {pos}+{t} past the table");
        Self::disjoint("rope", &[qkv], &[table]);
        let tab = self.win(table.slice(pos * hs..(pos + t) * hs));
        for r in self.mem.row_pieces(n, &[(qkv, qd)]) {
            let rows = r.end - r.start;
            let x = self.win(qkv.slice(r.start * qd..r.end * qd));
            let imm = [x.off, tab.off, u(rows), u(r.start), u(t), u(nh + nkv), u(qd), u(hs), f(sign)];
            self.dispatch(
                K::Rope.on(qkv.dtype == DType::BF16),
                &[x, tab.clone()],
                &imm,
                Threads(rows * (nh + nkv) * hs / 2),
            );
        }
    }
}

//! The rotary position embedding on the GPU (kernels/rope.wgsl).

use super::bf16::Rounding::Nearest;
use super::kernel::{Entry, Module, Out16, F, K};
use super::{all_bf16, all_f32};
use super::{f, u, GpuBackend, Threads};
use crate::backend::ops::{Rope, RopeOps};
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
                ROPE.on(qkv.dtype == DType::BF16),
                &[x, tab.clone()],
                &imm,
                Threads(rows * (nh + nkv) * hs / 2),
            );
        }
    }
}

impl RopeOps for GpuBackend {
    fn rope(&mut self, a: &Rope) {
        let Rope { n, t, pos, h, inverse, .. } = *a;
        let sign = if inverse { -1.0 } else { 1.0 };
        if all_bf16(&[a.qkv]) && all_f32(&[a.table]) {
            return self.rope_(a.qkv, a.table, n, t, pos, h.nh, h.nkv, h.hs, sign);
        }
        self.call_in_f32(a, Nearest, |g, a| g.rope_(a.qkv, a.table, n, t, pos, h.nh, h.nkv, h.hs, sign))
    }
}

// ---- kernels -------------------------------------------------------------------------------------

/// The rotary embedding's kernel (kernels/rope.wgsl).
pub(super) const MODULE: Module = Module {
    name: "rope",
    src: include_str!("kernels/rope.wgsl"),
    buffers: &[("x", F), ("tab", F)],
    entries: &[Entry { name: "rope", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[Out16, F]] }],
    subgroup: None,
};
pub(super) const ROPE: K = K::of(&MODULE, 0);

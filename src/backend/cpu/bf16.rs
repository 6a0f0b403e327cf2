//! The convert op on the CPU: f32 <-> bf16 buffers, to nearest or stochastically (the loops
//! are [`super::wide`]'s).

use super::backend::{CpuBackend, Rounding};
use super::wide::{narrow, narrow_stochastic};
use crate::backend::ops::{Call, Convert, ConvertOps};
use crate::backend::{Backend, Buf, DType};

impl CpuBackend {
    /// A conversion to nearest of a src about to be freed, in pieces of `piece` elements, each
    /// handed back to the OS once converted. Rounding to nearest is element-wise: the pieces
    /// give the whole's bits.
    pub(super) fn convert_consuming_by(&mut self, dst: Buf, src: Buf, piece: usize) {
        for start in (0..src.len).step_by(piece.max(1)) {
            let r = start..(start + piece).min(src.len);
            self.convert(&Convert {
                dst: dst.slice(r.clone()),
                src: src.slice(r.clone()),
                noise: None,
                consuming: false,
            });
            if let Some(v) = self.host_f32(src.slice(r)) {
                crate::core::mem::release(v);
            }
        }
    }
}

impl ConvertOps for CpuBackend {
    fn convert(&mut self, a: &Convert) {
        let Convert { dst, src, noise, consuming } = *a;
        if consuming {
            return self.convert_consuming_by(dst, src, 1 << 24); // pieces of 64 MiB of f32
        }
        if dst.dtype == DType::BF16 && src.dtype == DType::F32 {
            // Straight from the f32 values: no f32 copy of the destination.
            assert!(!dst.overlaps(src) && dst.len == src.len, "convert: {dst:?} from {src:?}");
            let p = self.ptr_f32(src);
            // SAFETY: p addresses src.len floats of a live allocation (bounds checked); the
            // allocations differ (dtypes differ), so this shared slice and the bf16 slice below
            // do not alias, and `&mut self` keeps every other reference out meanwhile.
            let s = unsafe { std::slice::from_raw_parts(p, src.len) };
            let d = self.ptr_bf16(dst);
            // SAFETY: as above, for dst.len u16s of dst's allocation.
            let d = unsafe { std::slice::from_raw_parts_mut(d, dst.len) };
            match noise {
                None => narrow(d, s),
                Some(n) => narrow_stochastic(d, s, n.seed, n.first),
            }
            return;
        }
        let r = noise.map_or(Rounding::Nearest, |n| Rounding::Stochastic(n.seed, Some(n.first)));
        let (outs, ins) = a.roles();
        self.run_rounded(Convert::NAME, outs, ins, [], r, |[d], [s], []| d.copy_from_slice(s));
    }
}

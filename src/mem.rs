//! Large zeroed buffers for parameters, gradients, optimizer state and activations.
//!
//! On Linux these are backed by transparent huge pages where the kernel allows it
//! (`madvise(MADV_HUGEPAGE)`, the mode most distributions ship): a GPT-2 124M training state is
//! 2 GiB, which in 4 KiB pages is half a million page faults at first touch and a TLB miss on
//! almost every new row a GEMM packer visits. The advice is a hint: where it is refused the
//! buffer is an ordinary one and nothing else changes.

/// Buffers smaller than this gain nothing from huge pages.
const HUGE_MIN_BYTES: usize = 4 << 20;

/// A zeroed `Vec` of `len` elements, advised onto huge pages when large.
pub fn zeroed<T: Clone + Default>(len: usize) -> Vec<T> {
    let v = vec![T::default(); len];
    advise_huge(&v);
    v
}

#[cfg(target_os = "linux")]
fn advise_huge<T>(v: &[T]) {
    const HUGE: usize = 2 << 20;
    let bytes = std::mem::size_of_val(v);
    if bytes < HUGE_MIN_BYTES {
        return;
    }
    let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (v.as_ptr() as usize + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside the allocation that `v` owns; MADV_HUGEPAGE only
        // changes how the kernel backs those pages, never their contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge<T>(_: &[T]) {}

#[cfg(test)]
mod tests {
    #[test]
    fn zeroed_buffers_are_zero_and_writable() {
        for len in [0, 1, 1000, (8 << 20) / 4 + 3] {
            let mut v = super::zeroed::<f32>(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|x| *x == 0.0));
            v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(v.iter().enumerate().all(|(i, x)| *x == i as f32));
        }
    }
}

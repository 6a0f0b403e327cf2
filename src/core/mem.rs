//! Large zeroed buffers for parameters, gradients, optimizer state and activations.
//!
//! On Linux these are backed by transparent huge pages where the kernel allows it
//! (`madvise(MADV_HUGEPAGE)`, the mode most distributions ship): a GPT-2 124M training state is
//! 2 GiB, which in 4 KiB pages is half a million page faults at first touch and a TLB miss on
//! almost every new row a GEMM packer visits. The advice is a hint: where it is refused the
//! buffer is an ordinary one and nothing else changes.

/// Allocations of at least this many bytes come straight from the OS, page-aligned
/// ([`PageAligned`]).
#[cfg(target_os = "linux")]
const PAGE_ALLOC_MIN: usize = 1 << 20;

/// The `llmrs` binary's allocator (`main.rs` installs it): large blocks (parameters, activations, packing buffers, windows)
/// are whole pages mapped from the OS, so they start on a page, hence on a 64-byte cache line;
/// the rest is the system allocator's. glibc hands out a large block 16 bytes past a page (its
/// header), so that every 64-byte vector load or AMX tile row of a buffer's rows spans two
/// cache lines: an f32 window that happened to be aligned or not moved a 1B model's bf16 step
/// by 8%. Zeroed blocks stay untouched until written (fresh mappings read as zero), which
/// [`zeroed`] and an in-place random init rely on.
pub struct PageAligned;

#[cfg(target_os = "linux")]
unsafe impl std::alloc::GlobalAlloc for PageAligned {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        // SAFETY (all methods): as GlobalAlloc's contract; a block is mapped iff its layout's
        // size is at least PAGE_ALLOC_MIN and its alignment at most a page, the same test at
        // allocation and release, so each block goes back to whoever gave it.
        unsafe {
            if mapped(l) {
                map(l.size())
            } else {
                std::alloc::System.alloc(l)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        unsafe {
            if mapped(l) {
                map(l.size()) // fresh anonymous pages are zero
            } else {
                std::alloc::System.alloc_zeroed(l)
            }
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        unsafe {
            if mapped(l) {
                libc::munmap(p as *mut libc::c_void, l.size());
            } else {
                std::alloc::System.dealloc(p, l)
            }
        }
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new_size: usize) -> *mut u8 {
        unsafe {
            let new = std::alloc::Layout::from_size_align_unchecked(new_size, l.align());
            match (mapped(l), mapped(new)) {
                (true, true) => {
                    let q = libc::mremap(p as *mut libc::c_void, l.size(), new_size, libc::MREMAP_MAYMOVE);
                    if q == libc::MAP_FAILED {
                        std::ptr::null_mut()
                    } else {
                        q as *mut u8
                    }
                }
                (false, false) => std::alloc::System.realloc(p, l, new_size),
                _ => {
                    let q = self.alloc(new);
                    if !q.is_null() {
                        std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                        self.dealloc(p, l);
                    }
                    q
                }
            }
        }
    }
}

/// Whether a block of this layout is mapped from the OS.
#[cfg(target_os = "linux")]
fn mapped(l: std::alloc::Layout) -> bool {
    l.size() >= PAGE_ALLOC_MIN && l.align() <= 4096
}

/// `bytes` of fresh anonymous memory (zero), or null.
#[cfg(target_os = "linux")]
unsafe fn map(bytes: usize) -> *mut u8 {
    use libc::{MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE};
    // SAFETY: an anonymous private mapping touches no existing memory.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) };
    if p == MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p as *mut u8
    }
}

/// Buffers smaller than this gain nothing from huge pages.
const HUGE_MIN_BYTES: usize = 4 << 20;

/// Refuse an allocation of `bytes` that this machine cannot hold (more than its available
/// memory and free swap), with a message saying how much was asked for: the alternative is an
/// abort, or the OOM killer once the pages are touched. Where the OS does not say (not Linux),
/// everything is allowed.
pub fn check_available(bytes: usize, what: &str) -> anyhow::Result<()> {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    if let Some(avail) = available_bytes() {
        if bytes as u64 > avail {
            anyhow::bail!(
                "{what} needs {:.2} GiB, but this machine has {:.2} GiB of memory available",
                gib(bytes as f64),
                gib(avail as f64)
            );
        }
    }
    Ok(())
}

/// MemAvailable + SwapFree from /proc/meminfo (None where the OS does not say).
pub fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = info.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some(field("MemAvailable:")? + field("SwapFree:").unwrap_or(0))
}

/// A zeroed `Vec` of `len` elements, advised onto huge pages when large.
pub fn zeroed<T: Clone + Default>(len: usize) -> Vec<T> {
    let v = vec![T::default(); len];
    advise_huge(&v);
    v
}

/// Hand the whole pages inside `v` back to the OS: its contents are no longer needed and RSS
/// drops now, before the buffer is freed (converting a model's weights piece by piece into a
/// smaller copy then peaks at about the larger copy, not at both). The elements on those pages
/// read as zero afterwards (anonymous memory); the partial pages at the ends keep theirs.
#[cfg(target_os = "linux")]
pub fn release(v: &mut [f32]) {
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => return,
    };
    let start = (v.as_mut_ptr() as usize).next_multiple_of(page);
    let end = (v.as_mut_ptr() as usize + std::mem::size_of_val(v)) / page * page;
    if end > start {
        // SAFETY: [start, end) is whole pages inside the allocation that `v` borrows mutably,
        // so no other reference sees them change, and nothing outside `v` (allocator
        // bookkeeping included) shares those pages. MADV_DONTNEED leaves them mapped: they
        // read back as zero, a valid f32, or as what a file mapping holds, also valid.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
}

#[cfg(not(target_os = "linux"))]
pub fn release(_: &mut [f32]) {}

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
    /// Large blocks start on a page and zeroed ones read zero; growing and shrinking across the
    /// size at which blocks are mapped keeps the contents; small blocks are the system's.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_blocks_are_page_aligned_and_keep_their_contents() {
        use std::alloc::{GlobalAlloc, Layout};
        let a = super::PageAligned;
        let big = super::PAGE_ALLOC_MIN + 12;
        let lay = |n: usize| Layout::from_size_align(n, 4).unwrap();
        // SAFETY: each block is used within its size and released with its layout.
        unsafe {
            let z = a.alloc_zeroed(lay(big));
            assert_eq!(z as usize % 4096, 0, "a large block starts on a page");
            assert!(std::slice::from_raw_parts(z, big).iter().all(|&x| x == 0));
            a.dealloc(z, lay(big));
            let mut p = a.alloc(lay(1000));
            let mut len = 1000;
            std::slice::from_raw_parts_mut(p, len).iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
            for target in [big, 3 * big, 10, big / 2, 4 * big] {
                p = a.realloc(p, lay(len), target);
                assert!(!p.is_null());
                let keep = len.min(target);
                assert!(std::slice::from_raw_parts(p, keep).iter().enumerate().all(|(i, &x)| x == i as u8), "{target}");
                if target >= super::PAGE_ALLOC_MIN {
                    assert_eq!(p as usize % 4096, 0, "{target}");
                }
                len = target;
                std::slice::from_raw_parts_mut(p, len).iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
            }
            a.dealloc(p, lay(len));
        }
    }

    #[test]
    fn impossible_allocations_are_refused_with_their_size() {
        super::check_available(1 << 20, "a small buffer").unwrap();
        if super::available_bytes().is_some() {
            let e = super::check_available(usize::MAX / 2, "the activations").unwrap_err().to_string();
            assert!(e.contains("the activations needs") && e.contains("GiB"), "{e}");
        }
    }

    /// Released pages read as zero; the partial pages at the ends keep their values.
    #[test]
    fn released_pages_read_zero_and_the_ends_stay() {
        let mut v = vec![1f32; 9 * 1024 + 3];
        super::release(&mut v[5..]);
        assert!(v[..5].iter().all(|x| *x == 1.0) && *v.last().unwrap() == 1.0);
        let zeros = v.iter().filter(|x| **x == 0.0).count();
        if cfg!(target_os = "linux") {
            assert!(zeros >= 1024 && zeros < v.len() - 5, "{zeros} of {} zero", v.len());
        } else {
            assert_eq!(zeros, 0);
        }
    }

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

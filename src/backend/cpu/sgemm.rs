//! Single-precision GEMM, `C (m, n) [+]= A (m, k) @ B (k, n)`: the engine under every matmul.
//!
//! Goto's algorithm as BLIS lays it out. B is packed into `kc x NR` column panels (one stays in
//! L1 or L2 while it sweeps a block of A), A into `MC x kc` blocks of `MR`-row panels (a block
//! stays in L2), and a register tile of FMAs does the arithmetic ([`Tile`]: 6x16 with AVX2, 12
//! accumulators; 12x32 with AVX-512, 24), with 2 B loads and MR broadcasts per step of k. Both packers read rows or columns as they lie in memory
//! (an 8x8 in-register transpose for the transposed weight in `inp @ W^T`), so no operand is
//! ever copied whole.
//!
//! Every element of C sums its k products in the same order whatever the thread count, the
//! split, the order of the loops ([`Order`]) or the tile (one FMA chain per k block, the blocks
//! added in order), so results do not depend on scheduling or on the instruction set. Threads
//! split C into column (or row) ranges that are multiples of the tile (see [`parallel`]); the
//! packing buffers, thread-local and shared, are allocated once and reused: nothing is
//! allocated in the training loop.
//!
//! Without AVX2+FMA (or with a C whose columns are not contiguous) the call falls back to the
//! `gemm` crate.

use std::cell::RefCell;
use std::sync::Mutex;

use super::team;

/// The register tile: the micro-kernel computes MR rows x NR columns of C per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tile {
    /// 6x16: 12 AVX2 accumulators (two 8-lane vectors per row), 2 B loads and 6 broadcasts per
    /// step of k; a `KC_MAX x 16` B panel is 24 KiB, inside L1.
    Avx2,
    /// 12x32: 24 AVX-512 accumulators (two 16-lane vectors per row), 2 B loads and 12
    /// broadcasts per step of k, so twice the FMAs per byte of B; a `KC_MAX x 32` B panel is
    /// 48 KiB and streams from L2 at that rate.
    Avx512,
}

impl Tile {
    /// The tile for the kernels' instruction set ([`super::simd::isa`]).
    pub(crate) fn current() -> Tile {
        if super::simd::isa() == super::simd::Isa::Avx512 {
            Tile::Avx512
        } else {
            Tile::Avx2
        }
    }

    /// The tile for a GEMM of `m` rows: a C of a few rows (one token's decode step) would waste
    /// most of a 12-row tile, so it takes the 6-row one. Both tiles give the same bits.
    pub fn for_rows(m: usize) -> Tile {
        match Tile::current() {
            Tile::Avx512 if m > Tile::Avx2.mr() => Tile::Avx512,
            _ => Tile::Avx2,
        }
    }

    /// Rows of the tile.
    const fn mr(self) -> usize {
        match self {
            Tile::Avx2 => 6,
            Tile::Avx512 => 12,
        }
    }

    /// Columns of the tile.
    const fn nr(self) -> usize {
        match self {
            Tile::Avx2 => 16,
            Tile::Avx512 => 32,
        }
    }

    /// For logs and `llmrs bench`.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Tile::Avx2 => "packed 6x16 AVX2+FMA GEMM",
            Tile::Avx512 => "packed 12x32 AVX-512 GEMM",
        }
    }
}

/// Largest MR x NR of the tiles (a partial tile goes through a local one of this size).
const MAX_TILE: usize = 12 * 32;
/// Floats of slack after each packed A panel: the vector packer's last store overhangs its
/// panel by 8 - MR % 8 (2 for 6 rows, 4 for 12).
const A_SLACK: usize = 8;
/// Most depth of one packed block: `MC x KC_MAX` of A is 396 KiB of a 512 KiB L2 and a B panel
/// 24 or 48 KiB (see [`Tile`]). See [`depth`] for the depth actually used. The same for every
/// tile, so that every tile sums the same k blocks.
pub(crate) const KC_MAX: usize = 384;
/// Rows of A per packed block (a multiple of every MR).
const MC: usize = 264;
/// Columns of B per packed block (a multiple of every NR): `KC_MAX x NC` is 6 MiB, a share of L3.
const NC: usize = 4096;

/// A block of A with at most this many MR-row panels packs a row-major B wider than 4 panels a
/// group of panels at a time ([`sweep`]), [`GROUP_COLS`] columns read row by row.
const GROUP_PANELS: usize = 8;
/// Columns of row-major B packed together when the A block is short (a multiple of every NR).
const GROUP_COLS: usize = 1024;
/// Below this many multiply-adds a GEMM runs on the calling thread: splitting costs more.
const PARALLEL_MIN: usize = 1 << 18;

/// True when the packed AVX2 path can run on this CPU.
/// (AVX2 and FMA, and the kernels' instruction set, [`super::simd`], is not forced to portable.)
pub fn fast_path_available() -> bool {
    cfg!(target_arch = "x86_64") && super::simd::isa() != super::simd::Isa::Portable
}

/// An element type the packers read: f32, or bf16 held as its bits (`u16`), widened to f32
/// as it is packed (exact: a bf16 is the top half of an f32). The kernels see f32 panels
/// either way, so a GEMM of bf16 operands gives the bits of the same GEMM on their f32
/// widenings, with half the bytes read from the operands.
pub trait Elem: Copy + Send + Sync + 'static {
    /// The value as f32.
    fn to_f32(self) -> f32;

    /// Eight consecutive elements from `p`, as f32.
    ///
    /// # Safety
    /// `p` addresses 8 readable elements; the caller runs with AVX2 enabled.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;

    /// f32 rounded to this type (to nearest even for bf16).
    fn from_f32(x: f32) -> Self;

    /// The slice itself when it is f32.
    fn f32s(_: &[Self]) -> Option<&[f32]> {
        None
    }

    /// The slice itself when it is bf16.
    fn bf16s(_: &[Self]) -> Option<&[u16]> {
        None
    }

    /// The pointer itself when it points at f32 (a result the kernels may write directly).
    fn f32_ptr(_: *mut Self) -> Option<*mut f32> {
        None
    }

    /// A tile's row stored into C: `dst[j] = [dst[j] +] x[j] [+ bias[j]]`, summed in f32 and
    /// rounded once to this type (the bias only when not accumulating; [`store_row`]).
    fn store_slice(dst: &mut [Self], x: &[f32], acc: bool, bias: Option<&[f32]>);

    /// [`Elem::store_slice`] of n elements at raw pointers (the bias null for none).
    ///
    /// # Safety
    /// `dst` has n writable elements, `x` n floats, a non-null bias n floats; none overlap dst.
    #[inline(always)]
    unsafe fn store_row(dst: *mut Self, x: *const f32, n: usize, acc: bool, bias: *const f32) {
        // SAFETY: as the caller guarantees.
        unsafe {
            let (d, x) = (std::slice::from_raw_parts_mut(dst, n), std::slice::from_raw_parts(x, n));
            let bias = (!bias.is_null()).then(|| std::slice::from_raw_parts(bias, n));
            Self::store_slice(d, x, acc, bias)
        }
    }

    /// `dst[i] = src[i]` as f32 for i < n.
    ///
    /// # Safety
    /// `src` has n readable elements, `dst` room for n floats; they do not overlap.
    #[inline(always)]
    unsafe fn widen_to(src: *const Self, dst: *mut f32, n: usize) {
        // SAFETY: as the caller guarantees.
        unsafe { (0..n).for_each(|i| *dst.add(i) = (*src.add(i)).to_f32()) }
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }

    fn f32s(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }

    #[inline(always)]
    fn f32_ptr(p: *mut f32) -> Option<*mut f32> {
        Some(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: as the caller guarantees.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn widen_to(src: *const f32, dst: *mut f32, n: usize) {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
    }

    fn store_slice(dst: &mut [f32], x: &[f32], acc: bool, bias: Option<&[f32]>) {
        store_row_f32(dst, x, acc, bias)
    }
}

/// bf16, as its bit pattern.
impl Elem for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::core::bf16::to_f32(self)
    }

    fn bf16s(x: &[u16]) -> Option<&[u16]> {
        Some(x)
    }

    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        crate::core::bf16::from_f32(x)
    }

    fn store_slice(dst: &mut [u16], x: &[f32], acc: bool, bias: Option<&[f32]>) {
        store_row(dst, x, acc, bias)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: as the caller guarantees: 16 readable bytes at p; AVX2 enabled.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
        }
    }
}

/// A raw matrix view: element (i, j) is at `ptr + i*rs + j*cs`.
struct View<T> {
    ptr: *mut T,
    rs: isize,
    cs: isize,
}
impl<T> Clone for View<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<T> {}
// SAFETY: a View is only shared between threads that touch disjoint parts of C (the split below)
// or only read (A and B); the caller of `sgemm` guarantees the memory outlives the call.
unsafe impl<T> Send for View<T> {}
unsafe impl<T> Sync for View<T> {}

impl<T> View<T> {
    #[inline(always)]
    unsafe fn at(self, i: usize, j: usize) -> *mut T {
        // SAFETY: the caller keeps (i, j) inside the matrix the view was made for.
        unsafe { self.ptr.offset(i as isize * self.rs + j as isize * self.cs) }
    }
}

/// `dst (m, n) = [dst +] lhs (m, k) @ rhs (k, n) [+ bias (n)]` with register tile `t`
/// ([`Tile::for_rows`] picks the one for the CPU and the shape; every tile gives the same bits);
/// strides are (row stride, column stride) in elements and must be non-negative. `bias` (null
/// for none) is added to every row, only when not accumulating: it is fused into the first store
/// of each tile, which saves writing C once with the bias before the GEMM. `threads` > 1 splits
/// the work over the pool.
///
/// # Safety
/// Every element that the strides address for the given shapes must lie inside its buffer, and
/// `dst` must not overlap `lhs` or `rhs`. Requires [`fast_path_available`] and `dst_cs == 1`;
/// `Tile::Avx512` also needs AVX-512F.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm<TA: Elem, TB: Elem, TC: Elem>(
    t: Tile,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut TC,
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    bias: *const f32,
    lhs: *const TA,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const TB,
    (rhs_rs, rhs_cs): (isize, isize),
    threads: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        sgemm_in(
            t,
            m,
            n,
            k,
            dst,
            (dst_rs, dst_cs),
            accumulate,
            bias,
            lhs,
            (lhs_rs, lhs_cs),
            rhs,
            (rhs_rs, rhs_cs),
            threads,
            Order::for_tile(t),
        )
    }
}

/// [`sgemm`] with the shared-A GEMM's order given (tests run both on every host).
///
/// # Safety
/// As [`sgemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_in<TA: Elem, TB: Elem, TC: Elem>(
    t: Tile,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut TC,
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    bias: *const f32,
    lhs: *const TA,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const TB,
    (rhs_rs, rhs_cs): (isize, isize),
    threads: usize,
    order: Order,
) {
    let bias = if accumulate { std::ptr::null() } else { bias };
    assert!(
        TC::f32_ptr(dst).is_some() || k <= KC_MAX,
        "sgemm: a bf16 result needs k <= {KC_MAX} (one k block), not {k}"
    );
    debug_assert!(dst_cs == 1 && super::simd::Isa::Avx2.supported());
    debug_assert!(t != Tile::Avx512 || super::simd::Isa::Avx512.supported());
    let c = View { ptr: dst, rs: dst_rs, cs: dst_cs };
    let a = View { ptr: lhs as *mut TA, rs: lhs_rs, cs: lhs_cs };
    let b = View { ptr: rhs as *mut TB, rs: rhs_rs, cs: rhs_cs };
    if m == 0 || n == 0 {
        return;
    }
    if threads <= 1 || m * n * k < PARALLEL_MIN {
        // SAFETY: forwarded from the caller.
        return unsafe { serial(t, m, n, k, c, accumulate, bias, a, b) };
    }
    // SAFETY: forwarded from the caller.
    unsafe { parallel(t, m, n, k, c, accumulate, bias, a, b, threads, order) }
}

/// Buffers for the shared packed operand, taken by one threaded GEMM at a time and put back:
/// the training loop reuses one; concurrent GEMMs (tests run in parallel) get one each.
static SHARED: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// Run `f` on a 64-byte-aligned shared buffer of at least `len` floats.
fn with_shared<R>(len: usize, f: impl FnOnce(*mut f32) -> R) -> R {
    let mut v = SHARED.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
    let r = f(aligned(&mut v, len));
    SHARED.lock().unwrap_or_else(|e| e.into_inner()).push(v);
    r
}

/// Most depth of the run of k blocks whose partial sums one C tile takes back to back in the
/// shared-A GEMM's [`Order::Runs`] ([`sweep_runs`]): the run's A panel (MR x DEEP, 96 KiB at 12
/// rows) and [`GROUP_B_COLS`] columns of packed B (512 KiB) stay in a 1 MiB L2 while the tile
/// stays in L1. Block by block, every k block re-reads and re-writes all of a wide C from
/// memory, a round trip that weighs most where the kernel is fastest (two 512-bit FMA units a
/// core: see [`Order::for_tile`] for what runs gained there). The shared A buffer grows with
/// it: a run of blocks instead of one (4.2 MiB at 512 rows, k = 2048).
const DEEP: usize = 2048;
/// Columns of B a thread packs through a run and sweeps together in the shared-A GEMM: 512 KiB
/// of packed B at DEEP (a multiple of every NR).
const GROUP_B_COLS: usize = 64;

/// How the shared-A GEMM (a wide C) walks k; both give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// One k block at a time across the whole C, each B panel packed just before its first
    /// use while the next one's lines are prefetched ([`sweep`]).
    Blocks,
    /// Runs of k blocks, each C tile through a run's blocks back to back ([`sweep_runs`]).
    Runs,
}

impl Order {
    /// The order for tile `t`: `$LLMRS_SGEMM_ORDER` when set, else runs for the AVX-512 tile
    /// on Intel CPUs and blocks elsewhere. On a 2-core Intel Xeon with AMX (two 512-bit FMA
    /// units a core) runs made Llama 3.2 1B's LoRA GEMMs 8-9% faster
    /// (`cargo run --release --example llama_gemms`, README); block by block is what was
    /// measured and tuned on AMD's Zen 1 to Zen 4, and stays theirs until measured there.
    pub fn for_tile(t: Tile) -> Order {
        let forced = *ORDER.get_or_init(|| choose_order().unwrap_or(None));
        forced.unwrap_or(if t == Tile::Avx512 && !super::simd::is_amd() { Order::Runs } else { Order::Blocks })
    }

    pub fn name(self) -> &'static str {
        match self {
            Order::Blocks => "blocks",
            Order::Runs => "runs",
        }
    }
}

static ORDER: std::sync::OnceLock<Option<Order>> = std::sync::OnceLock::new();

fn choose_order() -> anyhow::Result<Option<Order>> {
    use crate::core::env::SGEMM_ORDER;
    Ok(match crate::core::env::text(SGEMM_ORDER).as_deref() {
        None => None,
        Some("blocks") => Some(Order::Blocks),
        Some("runs") => Some(Order::Runs),
        Some(s) => anyhow::bail!("{SGEMM_ORDER}={s}: use blocks or runs"),
    })
}

/// Settle [`Order::for_tile`]'s override at start-up, so that a bad `LLMRS_SGEMM_ORDER` is an
/// error, not a silent default.
pub fn init() -> anyhow::Result<()> {
    let want = choose_order()?;
    ORDER.get_or_init(|| want);
    Ok(())
}

/// Columns from which a GEMM at least as wide as tall shares its packed A.
const WIDE: usize = 2048;

/// The threaded GEMM, on the [`team`]. Three ways to split it (and two orders for the second):
/// - taller than wide: B is packed once per k block, by all threads together, into a shared
///   buffer; the threads claim guided chunks of C's rows and pack their own A blocks (the
///   weight gradients: dW = dY^T X);
/// - wide (at least [`WIDE`] columns, at most 4 MC rows): the same with the roles swapped, A
///   shared and chunks of columns (the forward and input-gradient GEMMs of the wide layers);
/// - narrow: whole column parts through all of k, each packing its own A. A shared operand
///   needs two team loops per k block, and for a narrow C with many k blocks those cost more
///   than packing A once per part.
///
/// Every element of C still sums its k blocks in order, as [`serial`] does, so the result does
/// not depend on the split or the thread count.
#[allow(clippy::too_many_arguments)]
unsafe fn parallel<TA: Elem, TB: Elem, TC: Elem>(
    t: Tile,
    m: usize,
    n: usize,
    k: usize,
    c: View<TC>,
    accumulate: bool,
    bias: *const f32,
    a: View<TA>,
    b: View<TB>,
    threads: usize,
    order: Order,
) {
    debug_assert!(k > 0, "sgemm sends k = 0 to serial");
    let (mr, nr) = (t.mr(), t.nr());
    let kcb = depth(k);
    let nb = k.div_ceil(kcb);
    let block = |pb: usize| (pb * kcb, kcb.min(k - pb * kcb));
    let bias_addr = bias as usize; // a raw pointer is not Sync; its address is
    if n >= m && (n < WIDE || m > 4 * MC) {
        // Narrow C: each thread takes whole column parts through all of k, packing its own A
        // blocks (a shared A would need a barrier per k block, which costs these more than the
        // repeated packing of A does).
        let tiles = n.div_ceil(nr);
        let parts = (n / 384).clamp(threads, 4 * threads).min(tiles);
        team::for_ranges(parts, 1, 1, |range| {
            for p in range {
                let (t0, t1) = (tiles * p / parts * nr, (tiles * (p + 1) / parts * nr).min(n));
                let bias = bias_addr as *const f32;
                let bias = if bias.is_null() { bias } else { bias.wrapping_add(t0) };
                // SAFETY: the column ranges are disjoint; the sub-views start inside the matrices.
                unsafe {
                    serial(
                        t,
                        m,
                        t1 - t0,
                        k,
                        View { ptr: c.at(0, t0), ..c },
                        accumulate,
                        bias,
                        a,
                        View { ptr: b.at(0, t0), ..b },
                    )
                }
            }
        });
    } else if n >= m && order == Order::Blocks {
        // Shared A, one k block at a time (panel r at its own stride: the vector packer's
        // overhang must not reach a panel another thread is writing). Each thread reads the
        // block into its L2 and sweeps it with the B panels of the columns it claims.
        let panels = m.div_ceil(mr);
        with_shared(panels * (mr * kcb + A_SLACK), |sa| {
            let sa_addr = sa as usize;
            for pb in 0..nb {
                let (pc, kc) = block(pb);
                let stride = mr * kc + A_SLACK;
                team::for_ranges(panels, 4, usize::MAX, |range| {
                    for r in range {
                        let dst = (sa_addr as *mut f32).wrapping_add(r * stride);
                        // SAFETY: panel r's rows and the block's columns lie inside A; the
                        // panel's slot (MR*kc + A_SLACK floats) lies inside the shared buffer.
                        unsafe { pack_a(t, mr.min(m - r * mr), kc, View { ptr: a.at(r * mr, pc), ..a }, dst) };
                    }
                });
                let acc = accumulate || pb > 0;
                let bias_addr = if pb == 0 { bias_addr } else { 0 };
                // Chunks of at least 2 tiles and at most NC columns.
                team::for_ranges(n.div_ceil(nr), 2, NC / nr, |tiles| {
                    let (j0, j1) = (tiles.start * nr, (tiles.end * nr).min(n));
                    PACKS.with(|packs| {
                        let bp = aligned(&mut packs.borrow_mut().b, KC_MAX * NC);
                        for ic in (0..m).step_by(MC) {
                            let ablock = (sa_addr as *const f32).wrapping_add(ic / mr * stride);
                            let pack = (ic == 0).then_some(b);
                            let bias = bias_addr as *const f32;
                            // SAFETY: the shared A block is packed (the loop above has ended);
                            // the chunk's B panels fit the KC_MAX x NC buffer (chunks are at
                            // most NC wide); its tiles lie inside C.
                            unsafe {
                                sweep(t, ic, MC.min(m - ic), j0, j1, kc, pc, ablock, stride, bp, pack, c, acc, bias)
                            };
                        }
                    })
                });
            }
        })
    } else if n >= m {
        // Order::Runs: shared A packed a run of k blocks at a time (about DEEP deep; panel r of
        // block s at its own stride, as above). Each thread packs GROUP_B_COLS columns of B
        // through the run's blocks and sweeps every A panel across them, the run's blocks of
        // one C tile back to back, so that the tile stays in L1 from one block to the next
        // instead of making a round trip to memory per k block (see DEEP).
        let panels = m.div_ceil(mr);
        let stride = mr * kcb + A_SLACK;
        // Runs of equal length, as few as keep each about DEEP deep (k = 2048 is one run of 6).
        let run = nb.div_ceil(k.div_ceil(DEEP));
        with_shared(run * panels * stride, |sa| {
            let sa_addr = sa as usize;
            for pb0 in (0..nb).step_by(run) {
                let blocks = run.min(nb - pb0);
                team::for_ranges(blocks * panels, 4, usize::MAX, |range| {
                    for x in range {
                        let (s, r) = (x / panels, x % panels);
                        let (pc, kc) = block(pb0 + s);
                        let dst = (sa_addr as *mut f32).wrapping_add(x * stride);
                        // SAFETY: panel r's rows and block s's columns lie inside A; the
                        // panel's slot (MR*kc + A_SLACK floats) lies inside the shared buffer.
                        unsafe { pack_a(t, mr.min(m - r * mr), kc, View { ptr: a.at(r * mr, pc), ..a }, dst) };
                    }
                });
                // Chunks of at least 2 tiles and at most NC columns.
                team::for_ranges(n.div_ceil(nr), 2, NC / nr, |tiles| {
                    let (j0, j1) = (tiles.start * nr, (tiles.end * nr).min(n));
                    PACKS.with(|packs| {
                        let bp = aligned(&mut packs.borrow_mut().b, KC_MAX * NC);
                        let a = sa_addr as *const f32;
                        // SAFETY: the shared A blocks are packed (the loop above has ended);
                        // GROUP_B_COLS columns of the run's blocks (at most DEEP + KC_MAX deep)
                        // fit the KC_MAX x NC buffer; the tiles lie inside C.
                        unsafe {
                            sweep_runs(
                                t,
                                m,
                                j0,
                                j1,
                                pb0,
                                blocks,
                                kcb,
                                k,
                                a,
                                panels,
                                stride,
                                bp,
                                b,
                                c,
                                accumulate,
                                bias_addr as *const f32,
                            )
                        };
                    })
                });
            }
        })
    } else {
        // Shared B: one (kc, nc) block at a time, panel jr at jr*kc.
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            let panels = nc.div_ceil(nr);
            with_shared(panels * nr * kcb, |sb| {
                let sb_addr = sb as usize;
                for pb in 0..nb {
                    let (pc, kc) = block(pb);
                    team::for_ranges(panels, 4, usize::MAX, |range| {
                        for p in range {
                            let dst = (sb_addr as *mut f32).wrapping_add(p * nr * kc);
                            let cols = nr.min(nc - p * nr);
                            // SAFETY: the panel's rows and columns lie inside B, its slot inside the buffer.
                            unsafe { pack_b_panel(t, kc, cols, View { ptr: b.at(pc, jc + p * nr), ..b }, dst) };
                        }
                    });
                    let acc = accumulate || pb > 0;
                    let bias_addr = if pb == 0 { bias_addr } else { 0 };
                    // Chunks of at least 16 tiles.
                    team::for_ranges(m.div_ceil(mr), 16, usize::MAX, |tiles| {
                        let (i0, i1) = (tiles.start * mr, (tiles.end * mr).min(m));
                        PACKS.with(|packs| {
                            let ap = aligned(&mut packs.borrow_mut().a, MC * KC_MAX + A_SLACK);
                            for ic in (i0..i1).step_by(MC) {
                                let mc = MC.min(i1 - ic);
                                // SAFETY: rows ic..ic+mc and block pb's columns lie inside A.
                                unsafe { pack_a(t, mc, kc, View { ptr: a.at(ic, pc), ..a }, ap) };
                                let (sb, bias) = (sb_addr as *mut f32, bias_addr as *const f32);
                                // SAFETY: the shared B block is packed (the loop above has
                                // ended), panel jr - jc at sb + (jr - jc)*kc; the tiles lie
                                // inside C.
                                unsafe {
                                    sweep(
                                        t,
                                        ic,
                                        mc,
                                        jc,
                                        jc + nc,
                                        kc,
                                        pc,
                                        ap,
                                        mr * kc,
                                        sb,
                                        None::<View<TB>>,
                                        c,
                                        acc,
                                        bias,
                                    )
                                };
                            }
                        })
                    });
                }
            })
        }
    }
}

/// One `(mr, nr)` tile of C from an A panel and a B panel: full f32 tiles straight into C,
/// partial ones and bf16 ones through a local f32 tile of which only the valid part is written
/// back (a bf16 element rounded once from the f32 the kernel would have stored: C + sum, or
/// sum + bias).
///
/// # Safety
/// `c` addresses `mr` rows of `nr` writable elements at stride `ldc`; the panels hold `kc` steps;
/// a non-null `bias` has `nr` floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile<TC: Elem>(
    t: Tile,
    mr: usize,
    nr: usize,
    kc: usize,
    ap: *const f32,
    bp: *const f32,
    c: *mut TC,
    ldc: isize,
    acc: bool,
    bias: *const f32,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let full = t.nr();
        if let Some(c) = TC::f32_ptr(c) {
            if mr == t.mr() && nr == full {
                return kernel(t, kc, ap, bp, c, ldc, acc, bias);
            }
        }
        // Not cleared first: the kernel writes the whole MR x NR tile (no accumulate, no bias),
        // and only its first mr rows and nr columns are read.
        let mut local = std::mem::MaybeUninit::<[f32; MAX_TILE]>::uninit();
        let local = local.as_mut_ptr() as *mut f32;
        kernel(t, kc, ap, bp, local, full as isize, false, std::ptr::null());
        for i in 0..mr {
            TC::store_row(c.offset(i as isize * ldc), local.add(i * full), nr, acc, bias);
        }
    }
}

/// The macro-kernel: the MR-row panels of one packed A block (rows `ic..ic+mc`, panel i at
/// `a + i*a_stride`) against the B panels of columns `j0..j1` (the panel of column jr at
/// `bp + (jr - j0)*kc`), into C; `bias` (null for none) is indexed by C's column. With `pack`
/// (B's view), each B panel is packed just before its first use, so it goes to the kernels hot
/// in L1, and while the kernels sweep it the source lines of the next one are pulled toward the
/// cache, a share per kernel call (packing reads a line from each of up to KC_MAX rows, which on
/// its own waits on memory). A short A block (at most [`GROUP_PANELS`] panels: the adapters'
/// R-row products of a LoRA step, `(8, 8192)` from 512 k) has too few kernel calls to hide
/// those reads, so a row-major B of more than 4 panels (not attention's head-wide B, whose
/// packing stays as it was) is packed [`GROUP_COLS`] columns at a time, row by
/// row, each row's 4 KiB of f32 read in one run ([`pack_b_group`]): on a 2-core Zen 1, such a
/// `(8, 8192)` product of depth 512 takes 2.8-2.9 ms instead of 5.6-5.8 (the db column of
/// `cargo run --release --example lora_time`). The panels hold the same values either way, so
/// the bits do not change.
///
/// # Safety
/// The A panels hold `kc` steps; `bp` has room for `(j1 - j0)/NR` panels (and holds them packed
/// when `pack` is None); rows `ic..ic+mc` and columns `j0..j1` lie inside C and, with `pack`,
/// columns `j0..j1` and rows `pc..pc+kc` inside B.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn sweep<TB: Elem, TC: Elem>(
    t: Tile,
    ic: usize,
    mc: usize,
    j0: usize,
    j1: usize,
    kc: usize,
    pc: usize,
    a: *const f32,
    a_stride: usize,
    bp: *mut f32,
    pack: Option<View<TB>>,
    c: View<TC>,
    acc: bool,
    bias: *const f32,
) {
    let (tmr, tnr) = (t.mr(), t.nr());
    let shares = mc.div_ceil(tmr);
    let grouped = pack.filter(|b| b.cs == 1 && shares <= GROUP_PANELS && j1 - j0 > 4 * tnr);
    let pack = if grouped.is_some() { None } else { pack };
    for jr in (j0..j1).step_by(tnr) {
        let nr = tnr.min(j1 - jr);
        let bpanel = bp.wrapping_add((jr - j0) * kc);
        if let Some(b) = grouped.filter(|_| (jr - j0).is_multiple_of(GROUP_COLS)) {
            // SAFETY: as the caller guarantees (the group's columns lie inside j0..j1).
            unsafe { pack_b_group(t, kc, GROUP_COLS.min(j1 - jr), View { ptr: b.at(pc, jr), ..b }, bpanel) };
        }
        if let Some(b) = pack {
            // SAFETY: as the caller guarantees.
            unsafe { pack_b_panel(t, kc, nr, View { ptr: b.at(pc, jr), ..b }, bpanel) };
        }
        let next = pack.filter(|_| jr + tnr < j1).map(|b| (b, jr + tnr, tnr.min(j1 - jr - tnr)));
        let bias = if bias.is_null() { bias } else { bias.wrapping_add(jr) };
        for (share, ir) in (0..mc).step_by(tmr).enumerate() {
            if let Some((b, jn, cols)) = next {
                prefetch_b_share(kc, cols, b, pc, jn, share, shares);
            }
            let apanel = a.wrapping_add(share * a_stride);
            // SAFETY: as the caller guarantees: (ic + ir, jr) is a tile inside C.
            unsafe { tile(t, tmr.min(mc - ir), nr, kc, apanel, bpanel, c.at(ic + ir, jr), c.rs, acc, bias) };
        }
    }
}

/// The shared-A macro-kernel: every A panel of a run of `blocks` k blocks (from block `pb0`,
/// each `kcb` deep but the last of k; panel r of block s at `a + (s*panels + r)*a_stride`)
/// against the B panels of columns `j0..j1`, GROUP_B_COLS columns at a time packed through the run
/// into `bp` (panel q of block s at `bp + (q*blocks + s)*NR*kcb`). For each C tile the run's
/// blocks follow one another, so the tile stays in L1 through them; each block still adds its
/// own FMA chain to C in order, as [`serial`] does, so the bits do not change. (No prefetch of
/// the next group's lines while the A panels sweep this one: tried on the Xeon that chose this
/// order, it made the GEMMs slower.)
///
/// # Safety
/// The A panels are packed as above; `bp` has room for GROUP_B_COLS columns of the run; rows `0..m`
/// and columns `j0..j1` lie inside C, and the run's rows of B with columns `j0..j1` inside B.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn sweep_runs<TB: Elem, TC: Elem>(
    t: Tile,
    m: usize,
    j0: usize,
    j1: usize,
    pb0: usize,
    blocks: usize,
    kcb: usize,
    k: usize,
    a: *const f32,
    panels: usize,
    a_stride: usize,
    bp: *mut f32,
    b: View<TB>,
    c: View<TC>,
    accumulate: bool,
    bias: *const f32,
) {
    let (tmr, tnr) = (t.mr(), t.nr());
    let block = |s: usize| {
        let pc = (pb0 + s) * kcb;
        (pc, kcb.min(k - pc))
    };
    for jg in (j0..j1).step_by(GROUP_B_COLS) {
        let jg1 = (jg + GROUP_B_COLS).min(j1);
        // SAFETY (the packing and the kernels): as the caller guarantees.
        for jr in (jg..jg1).step_by(tnr) {
            let q = (jr - jg) / tnr;
            for s in 0..blocks {
                let (pc, kc) = block(s);
                let dst = bp.wrapping_add((q * blocks + s) * tnr * kcb);
                unsafe { pack_b_panel(t, kc, tnr.min(j1 - jr), View { ptr: b.at(pc, jr), ..b }, dst) };
            }
        }
        for r in 0..panels {
            let ir = r * tmr;
            for jr in (jg..jg1).step_by(tnr) {
                let q = (jr - jg) / tnr;
                let bias = if bias.is_null() { bias } else { bias.wrapping_add(jr) };
                for s in 0..blocks {
                    let (_, kc) = block(s);
                    let pb = pb0 + s;
                    let apanel = a.wrapping_add((s * panels + r) * a_stride);
                    let bpanel = bp.wrapping_add((q * blocks + s) * tnr * kcb);
                    let bias = if pb == 0 { bias } else { std::ptr::null() };
                    let acc = accumulate || pb > 0;
                    unsafe {
                        tile(t, tmr.min(m - ir), tnr.min(j1 - jr), kc, apanel, bpanel, c.at(ir, jr), c.rs, acc, bias)
                    };
                }
            }
        }
    }
}

/// Per-thread packing buffers, grown on first use and then reused.
struct Packs {
    a: Vec<f32>,
    b: Vec<f32>,
}

thread_local! {
    static PACKS: RefCell<Packs> = const { RefCell::new(Packs { a: Vec::new(), b: Vec::new() }) };
}

/// A 64-byte-aligned window of `len` floats inside `v` (grown as needed).
fn aligned(v: &mut Vec<f32>, len: usize) -> *mut f32 {
    if v.len() < len + 16 {
        // A fresh zeroed allocation rather than `resize`: the allocator hands large ones over
        // as untouched zero pages, so a GEMM that uses a corner of the buffer (a short prompt,
        // a small model) does not first fault in and clear all of it. (The contents are never
        // read before being written: the packers fill what the kernels read.)
        *v = vec![0.0; len + 16];
    }
    let off = v.as_ptr().align_offset(64);
    // SAFETY: `off` < 16 and the vector holds len + 16 floats.
    unsafe { v.as_mut_ptr().add(off) }
}

/// The depth of the k blocks for a GEMM of depth `k`: k split into as few blocks of at most
/// KC_MAX as it takes, of equal size (a multiple of 8, which the packers' fast loop wants).
/// Each block past the first re-reads and re-writes the C tile, so fewer blocks save C
/// traffic (k = 768 runs as 2 x 384, not 3 x 256); even blocks avoid a thin last one (k = 800
/// runs as 3 x ~267, not 384 + 384 + 32). Against a fixed 256 the step's GEMMs were a little
/// faster in A/B pairs; whole steps, within this VM's noise.
fn depth(k: usize) -> usize {
    k.div_ceil(k.div_ceil(KC_MAX)).next_multiple_of(8)
}

/// The single-threaded blocked GEMM (the loops of Goto's algorithm).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn serial<TA: Elem, TB: Elem, TC: Elem>(
    t: Tile,
    m: usize,
    n: usize,
    k: usize,
    c: View<TC>,
    accumulate: bool,
    bias: *const f32,
    a: View<TA>,
    b: View<TB>,
) {
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row i of C has n contiguous elements (dst_cs == 1); bias has n.
                unsafe {
                    for j in 0..n {
                        *c.at(i, j) = TC::from_f32(if bias.is_null() { 0.0 } else { *bias.add(j) });
                    }
                }
            }
        }
        return;
    }
    PACKS.with(|packs| {
        let packs = &mut *packs.borrow_mut();
        // A panels get A_SLACK floats of slack: the vector packer's last store overhangs its panel.
        let ap = aligned(&mut packs.a, MC * KC_MAX + A_SLACK);
        let bp = aligned(&mut packs.b, KC_MAX * NC);
        let kc_block = depth(k);
        debug_assert!(kc_block <= KC_MAX);
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(kc_block) {
                let kc = kc_block.min(k - pc);
                let acc = accumulate || pc > 0;
                // The bias goes in with the first block of k only.
                let bias = if pc == 0 { bias } else { std::ptr::null() };
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    // SAFETY: the packers read only the (mc, kc) / (kc, nr) sub-blocks, which
                    // are inside A and B, and write inside the buffers sized above.
                    unsafe { pack_a(t, mc, kc, View { ptr: a.at(ic, pc), ..a }, ap) };
                    // SAFETY: the A block is packed above; panel jr of B goes to bp + jr*kc,
                    // inside the KC_MAX x NC buffer; the tiles lie inside C.
                    unsafe {
                        let pack = (ic == 0).then_some(b);
                        sweep(t, ic, mc, jc, jc + nc, kc, pc, ap, t.mr() * kc, bp, pack, c, acc, bias)
                    };
                }
            }
        }
    })
}

/// Pack `A (mc, kc)` into MR-row panels: panel r holds `A[r*MR + i][p]` at `p*MR + i`,
/// zero-padded to whole panels.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn pack_a<T: Elem>(t: Tile, mc: usize, kc: usize, a: View<T>, dst: *mut f32) {
    let mr = t.mr();
    for (r, i0) in (0..mc).step_by(mr).enumerate() {
        let rows = mr.min(mc - i0);
        // SAFETY: panel r occupies [r*MR*kc, (r+1)*MR*kc) of dst (plus slack for the overhang).
        let d = unsafe { dst.add(r * mr * kc) };
        unsafe {
            if a.cs == 1 && rows == mr {
                #[cfg(target_arch = "x86_64")]
                {
                    match t {
                        Tile::Avx2 => pack_transposed::<6, T>(kc, |i| a.at(i0 + i, 0), d),
                        Tile::Avx512 => pack_transposed::<12, T>(kc, |i| a.at(i0 + i, 0), d),
                    }
                    continue;
                }
            }
            if a.rs == 1 && rows == mr {
                // A^T is row-major: each k gives MR contiguous floats (a fixed-size copy, which
                // compiles to a few moves).
                match t {
                    Tile::Avx2 => (0..kc).for_each(|p| T::widen_to(a.at(i0, p), d.add(p * 6), 6)),
                    Tile::Avx512 => (0..kc).for_each(|p| T::widen_to(a.at(i0, p), d.add(p * 12), 12)),
                }
                continue;
            }
            if a.rs == 1 {
                for p in 0..kc {
                    let src = a.at(i0, p);
                    for i in 0..mr {
                        *d.add(p * mr + i) = if i < rows { (*src.add(i)).to_f32() } else { 0.0 };
                    }
                }
            } else {
                for p in 0..kc {
                    for i in 0..mr {
                        *d.add(p * mr + i) = if i < rows { (*a.at(i0 + i, p)).to_f32() } else { 0.0 };
                    }
                }
            }
        }
    }
}

/// Prefetch share `share` of `shares` of the lines that packing the `(kc, cols)` panel of B at
/// (p0, j0) will read. Prefetches never fault, so addresses are formed with wrapping arithmetic.
#[inline(always)]
fn prefetch_b_share<T>(kc: usize, cols: usize, b: View<T>, p0: usize, j0: usize, share: usize, shares: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let addr = |p: usize, j: usize| {
            b.ptr.wrapping_offset((p0 + p) as isize * b.rs + (j0 + j) as isize * b.cs) as *const i8
        };
        // SAFETY (both arms): prefetch is a hint; it reads nothing and cannot fault.
        if b.cs == 1 {
            // One row segment of `cols` floats per k: its first and last line.
            for p in kc * share / shares..kc * (share + 1) / shares {
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(addr(p, 0));
                    _mm_prefetch::<_MM_HINT_T0>(addr(p, cols - 1));
                }
            }
        } else if b.rs == 1 {
            // `cols` columns of kc contiguous elements, `per` elements a line.
            let per = 64 / std::mem::size_of::<T>();
            let lines = kc.div_ceil(per);
            // Walk (column, line) pairs from this share's first to its last without a division
            // per line: in perf, the integer divides were most of this function's time, more
            // than the prefetches themselves.
            let (start, end) = (cols * lines * share / shares, cols * lines * (share + 1) / shares);
            let (mut j, mut l) = (start / lines, start % lines);
            for _ in start..end {
                unsafe { _mm_prefetch::<_MM_HINT_T0>(addr(l * per, j)) };
                l += 1;
                if l == lines {
                    (j, l) = (j + 1, 0);
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kc, cols, b, p0, j0, share, shares);
}

/// Pack one `B (kc, cols)` panel (cols <= NR): `B[p][j]` goes to `p*NR + j`, zero-padded to
/// NR columns.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn pack_b_panel<T: Elem>(t: Tile, kc: usize, cols: usize, b: View<T>, d: *mut f32) {
    let nr = t.nr();
    // SAFETY: rows 0..kc and columns 0..cols of `b` are inside B; d has NR*kc floats.
    unsafe {
        if b.cs == 1 {
            #[cfg(target_arch = "x86_64")]
            if cols == nr {
                match t {
                    Tile::Avx2 => pack_b_rows::<16, T>(kc, 1, b, d),
                    Tile::Avx512 => pack_b_rows::<32, T>(kc, 1, b, d),
                }
                return;
            }
            // Rows of B are contiguous: copy `cols` floats per k.
            for p in 0..kc {
                let dp = d.add(p * nr);
                T::widen_to(b.at(p, 0), dp, cols);
                std::ptr::write_bytes(dp.add(cols), 0, nr - cols);
            }
            return;
        }
        if b.rs == 1 && cols == nr {
            #[cfg(target_arch = "x86_64")]
            {
                match t {
                    Tile::Avx2 => pack_transposed::<16, T>(kc, |j| b.at(0, j), d),
                    Tile::Avx512 => pack_transposed::<32, T>(kc, |j| b.at(0, j), d),
                }
                return;
            }
        }
        for p in 0..kc {
            for j in 0..nr {
                *d.add(p * nr + j) = if j < cols { (*b.at(p, j)).to_f32() } else { 0.0 };
            }
        }
    }
}

/// Pack `cols` columns of a row-major `B (kc, cols)` as consecutive panels (panel q at
/// `d + q*NR*kc`, laid out as [`pack_b_panel`] lays it), reading B row by row: each row's
/// columns in one run rather than one line of each of kc rows per panel.
///
/// # Safety
/// Rows 0..kc and columns 0..cols of `b` are inside B (`b.cs == 1`); d has
/// `cols.div_ceil(NR) * NR * kc` floats, 64-byte aligned.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn pack_b_group<T: Elem>(t: Tile, kc: usize, cols: usize, b: View<T>, d: *mut f32) {
    let nr = t.nr();
    let full = cols / nr;
    // SAFETY: as the caller guarantees; the last, partial panel starts at column full*NR.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        match t {
            Tile::Avx2 => pack_b_rows::<16, T>(kc, full, b, d),
            Tile::Avx512 => pack_b_rows::<32, T>(kc, full, b, d),
        }
        #[cfg(not(target_arch = "x86_64"))]
        for q in 0..full {
            pack_b_panel(t, kc, nr, View { ptr: b.at(0, q * nr), ..b }, d.add(q * nr * kc));
        }
        if full * nr < cols {
            pack_b_panel(t, kc, cols - full * nr, View { ptr: b.at(0, full * nr), ..b }, d.add(full * nr * kc));
        }
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Transpose eight 8-lane rows in registers: out[j][i] = r[i][j].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register-only AVX operations; callers are compiled with AVX2 enabled.
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }
}

/// One panel `W` wide from `W` source rows that are contiguous along k (A row-major, or a
/// transposed B such as the weight of `inp @ W^T`): `d[p*W + i] = row(i)[p]`. For each 8 k,
/// groups of eight rows are loaded, transposed in registers and stored as 8-wide columns. When
/// W is not a multiple of 8 the last group's extra lanes (copies of row W-1) overhang into the
/// next column (2 lanes for W = 6, 4 for W = 12); the groups go last to first, so group 0's
/// store of that column, which comes later, rewrites them. The panel's final overhang lands in
/// the next panel or the buffer's slack ([`A_SLACK`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_transposed<const W: usize, T: Elem>(kc: usize, row: impl Fn(usize) -> *const T, d: *mut f32) {
    const { assert!(W.is_multiple_of(8) || 8 - W % 8 <= A_SLACK) };
    // SAFETY: rows 0..W hold kc floats each; d has W*kc floats plus the slack when W % 8 != 0.
    unsafe {
        let row = |i: usize| row(i.min(W - 1));
        let mut p = 0;
        while p + 8 <= kc {
            for g in (0..W).step_by(8).rev() {
                let r = std::array::from_fn(|i| T::load8(row(g + i).add(p)));
                for (j, v) in transpose8(r).iter().enumerate() {
                    _mm256_storeu_ps(d.add((p + j) * W + g), *v);
                }
            }
            p += 8;
        }
        while p < kc {
            for i in 0..W {
                *d.add(p * W + i) = (*row(i).add(p)).to_f32();
            }
            p += 1;
        }
    }
}

/// `panels` full B panels of `W` columns each from a row-major B (panel q at `d + q*W*kc`),
/// row by row: 8-lane copies per k (a `memcpy` call per 64 bytes cost as much as a tenth of
/// the GEMM).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_b_rows<const W: usize, T: Elem>(kc: usize, panels: usize, b: View<T>, d: *mut f32) {
    // SAFETY: rows 0..kc hold panels*W contiguous floats each inside B; d has panels*W*kc
    // aligned floats (W a multiple of 8, so every store is 32-byte aligned).
    unsafe {
        for p in 0..kc {
            let src = b.at(p, 0);
            for q in 0..panels {
                for j in (0..W).step_by(8) {
                    _mm256_store_ps(d.add(q * W * kc + p * W + j), T::load8(src.add(q * W + j)));
                }
            }
        }
    }
}

/// The micro-kernel of tile `t`: `C[0..MR][0..NR] = [C +] sum_p a[p*MR + i] * b[p*NR + j] [+ bias[j]]`
/// (C when `acc`, else the bias when not null).
///
/// # Safety
/// a has MR*kc floats, b NR*kc floats (64-byte aligned), C rows 0..MR have NR writable floats
/// each at stride ldc, a non-null bias has NR floats; `Tile::Avx512` needs AVX-512F.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn kernel(
    t: Tile,
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: isize,
    acc: bool,
    bias: *const f32,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match t {
            Tile::Avx2 => kernel_6x16(kc, a, b, c, ldc, acc, bias),
            Tile::Avx512 => kernel_12x32(kc, a, b, c, ldc, acc, bias),
        }
    }
}

/// The 12x32 AVX-512 micro-kernel (see [`kernel`]): for each k, two 16-lane loads of B and
/// twelve broadcasts of A into 24 accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn kernel_12x32(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: isize, acc: bool, bias: *const f32) {
    // SAFETY: a has 12*kc floats, b has 32*kc floats (64-byte aligned), C rows 0..12 have 32
    // writable floats each at stride ldc, and a non-null bias has 32 floats.
    unsafe {
        for i in 0..12 {
            _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * ldc + 31) as *const i8);
        }
        let mut lo = [_mm512_setzero_ps(); 12];
        let mut hi = [_mm512_setzero_ps(); 12];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            let b0 = _mm512_load_ps(b);
            let b1 = _mm512_load_ps(b.add(16));
            // Fully unrolled (12 is a constant): the accumulators stay in registers.
            for i in 0..12 {
                let x = _mm512_set1_ps(*a.add(i));
                lo[i] = _mm512_fmadd_ps(x, b0, lo[i]);
                hi[i] = _mm512_fmadd_ps(x, b1, hi[i]);
            }
            a = a.add(12);
            b = b.add(32);
        }
        let z = _mm512_setzero_ps();
        let (b0, b1) = if bias.is_null() { (z, z) } else { (_mm512_loadu_ps(bias), _mm512_loadu_ps(bias.add(16))) };
        for i in 0..12 {
            let r = c.offset(i as isize * ldc);
            if acc {
                _mm512_storeu_ps(r, _mm512_add_ps(_mm512_loadu_ps(r), lo[i]));
                _mm512_storeu_ps(r.add(16), _mm512_add_ps(_mm512_loadu_ps(r.add(16)), hi[i]));
            } else {
                _mm512_storeu_ps(r, _mm512_add_ps(lo[i], b0));
                _mm512_storeu_ps(r.add(16), _mm512_add_ps(hi[i], b1));
            }
        }
    }
}

/// The 6x16 AVX2 micro-kernel (see [`kernel`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_6x16(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: isize, acc: bool, bias: *const f32) {
    // SAFETY: a has 6*kc floats, b has 16*kc floats (64-byte aligned), C rows 0..6 have 16
    // writable floats each at stride ldc, and a non-null bias has 16 floats.
    unsafe {
        for i in 0..6 {
            _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.offset(i as isize * ldc + 15) as *const i8);
        }
        let z = _mm256_setzero_ps();
        let (mut c00, mut c01, mut c10, mut c11, mut c20, mut c21) = (z, z, z, z, z, z);
        let (mut c30, mut c31, mut c40, mut c41, mut c50, mut c51) = (z, z, z, z, z, z);
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            let b0 = _mm256_load_ps(b);
            let b1 = _mm256_load_ps(b.add(8));
            let x = _mm256_broadcast_ss(&*a);
            c00 = _mm256_fmadd_ps(x, b0, c00);
            c01 = _mm256_fmadd_ps(x, b1, c01);
            let x = _mm256_broadcast_ss(&*a.add(1));
            c10 = _mm256_fmadd_ps(x, b0, c10);
            c11 = _mm256_fmadd_ps(x, b1, c11);
            let x = _mm256_broadcast_ss(&*a.add(2));
            c20 = _mm256_fmadd_ps(x, b0, c20);
            c21 = _mm256_fmadd_ps(x, b1, c21);
            let x = _mm256_broadcast_ss(&*a.add(3));
            c30 = _mm256_fmadd_ps(x, b0, c30);
            c31 = _mm256_fmadd_ps(x, b1, c31);
            let x = _mm256_broadcast_ss(&*a.add(4));
            c40 = _mm256_fmadd_ps(x, b0, c40);
            c41 = _mm256_fmadd_ps(x, b1, c41);
            let x = _mm256_broadcast_ss(&*a.add(5));
            c50 = _mm256_fmadd_ps(x, b0, c50);
            c51 = _mm256_fmadd_ps(x, b1, c51);
            a = a.add(6);
            b = b.add(16);
        }
        let rows = [(c00, c01), (c10, c11), (c20, c21), (c30, c31), (c40, c41), (c50, c51)];
        let (b0, b1) = if bias.is_null() { (z, z) } else { (_mm256_loadu_ps(bias), _mm256_loadu_ps(bias.add(8))) };
        for (i, (lo, hi)) in rows.into_iter().enumerate() {
            let r = c.offset(i as isize * ldc);
            if acc {
                _mm256_storeu_ps(r, _mm256_add_ps(_mm256_loadu_ps(r), lo));
                _mm256_storeu_ps(r.add(8), _mm256_add_ps(_mm256_loadu_ps(r.add(8)), hi));
            } else {
                _mm256_storeu_ps(r, _mm256_add_ps(lo, b0));
                _mm256_storeu_ps(r.add(8), _mm256_add_ps(hi, b1));
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(_: Tile, _: usize, _: *const f32, _: *const f32, _: *mut f32, _: isize, _: bool, _: *const f32) {
    unreachable!("the packed path runs only where fast_path_available() is true")
}

/// A GEMM tile's row into C: dst[j] = [dst[j] +] x[j] [+ bias[j]], the sum in f32 and rounded
/// once to C's type (the bias only when not accumulating).
#[inline(always)]
fn store_row_body<T: Elem>(dst: &mut [T], x: &[f32], acc: bool, bias: Option<&[f32]>) {
    let x = &x[..dst.len()];
    if acc {
        dst.iter_mut().zip(x).for_each(|(d, &v)| *d = T::from_f32(d.to_f32() + v));
    } else if let Some(b) = bias {
        dst.iter_mut().zip(x.iter().zip(&b[..x.len()])).for_each(|(d, (&v, &bj))| *d = T::from_f32(v + bj));
    } else {
        dst.iter_mut().zip(x).for_each(|(d, &v)| *d = T::from_f32(v));
    }
}

crate::simd_fn! {
    /// [`store_row_body`] into bf16.
    pub fn store_row(dst: &mut [u16], x: &[f32], acc: bool, bias: Option<&[f32]>) {
        store_row_body(dst, x, acc, bias)
    }
}

crate::simd_fn! {
    /// [`store_row_body`] into f32.
    pub fn store_row_f32(dst: &mut [f32], x: &[f32], acc: bool, bias: Option<&[f32]>) {
        store_row_body(dst, x, acc, bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::TestRng;

    /// A (rows, cols) matrix stored row-major, column-major, or with padded strides.
    fn layout(rows: usize, cols: usize, kind: usize) -> (isize, isize, usize) {
        let (r, c) = (rows as isize, cols as isize);
        match kind {
            0 => (c, 1, rows * cols),                            // row-major
            1 => (1, r, rows * cols),                            // column-major (a transpose)
            _ => (2 * c + 3, 2, (rows * (2 * cols + 3)).max(1)), // padded, non-unit column stride
        }
    }

    /// The values' bit patterns (so that -0.0 and 0.0 differ, and NaN equals itself).
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The tiles this CPU can run.
    fn tiles() -> Vec<Tile> {
        let mut t = vec![Tile::Avx2];
        if crate::backend::cpu::simd::Isa::Avx512.supported() {
            t.push(Tile::Avx512);
        } else {
            crate::testdata::skipped("sgemm 12x32 tile", "this CPU has no AVX-512F, so that tile never runs here");
        }
        t
    }

    /// [`sgemm`] on slices: C (m, n) at row stride `crs`, A and B at the given strides.
    #[allow(clippy::too_many_arguments)]
    fn run(
        tile: Tile,
        (m, n, k): (usize, usize, usize),
        c: &mut [f32],
        crs: usize,
        accumulate: bool,
        bias: Option<&[f32]>,
        a: &[f32],
        a_s: (isize, isize),
        b: &[f32],
        b_s: (isize, isize),
        threads: usize,
        order: Order,
    ) {
        let bias = bias.map_or(std::ptr::null(), |b| b.as_ptr());
        // SAFETY: every caller sizes the buffers for the shapes and strides it passes.
        unsafe {
            sgemm_in(
                tile,
                m,
                n,
                k,
                c.as_mut_ptr(),
                (crs as isize, 1),
                accumulate,
                bias,
                a.as_ptr(),
                a_s,
                b.as_ptr(),
                b_s,
                threads,
                order,
            )
        }
    }

    /// Every tile against an f64 reference, and the tiles against each other bit for bit (each
    /// element sums the same k blocks in the same order).
    fn check(m: usize, n: usize, k: usize, threads: usize) {
        let tiles = tiles();
        let mut rng = TestRng((m * 1000 + n * 10 + k) as u64);
        for a_kind in 0..3 {
            for b_kind in 0..3 {
                let (ars, acs, alen) = layout(m, k, a_kind);
                let (brs, bcs, blen) = layout(k, n, b_kind);
                let (a, b) = (rng.vec(alen), rng.vec(blen));
                // C rows padded by 5 to check that only the m x n window is written.
                let crs = n + 5;
                let c0 = rng.vec(m * crs);
                let bias = rng.vec(n);
                // C starts from zero, from its contents, or from the bias.
                for (accumulate, with_bias) in [(false, false), (true, false), (false, true)] {
                    let bias_arg = with_bias.then_some(&bias[..]);
                    let with_tile = |tile| {
                        let mut c = c0.clone();
                        run(
                            tile,
                            (m, n, k),
                            &mut c,
                            crs,
                            accumulate,
                            bias_arg,
                            &a,
                            (ars, acs),
                            &b,
                            (brs, bcs),
                            threads,
                            Order::for_tile(tile),
                        );
                        c
                    };
                    let c = with_tile(Tile::Avx2);
                    for &t in &tiles[1..] {
                        assert!(
                            bits(&c) == bits(&with_tile(t)),
                            "({m},{n},{k}) layouts {a_kind}/{b_kind}: tile {t:?} differs from 6x16"
                        );
                    }
                    for i in 0..m {
                        for j in 0..crs {
                            let got = c[i * crs + j];
                            if j >= n {
                                assert_eq!(got, c0[i * crs + j], "padding touched at ({i},{j})");
                                continue;
                            }
                            let mut want = match (accumulate, with_bias) {
                                (true, _) => c0[i * crs + j] as f64,
                                (false, true) => bias[j] as f64,
                                (false, false) => 0.0,
                            };
                            for p in 0..k {
                                let x = a[(i as isize * ars + p as isize * acs) as usize] as f64;
                                want += x * b[(p as isize * brs + j as isize * bcs) as usize] as f64;
                            }
                            let tol = 1e-5 * (k as f64).sqrt().max(1.0) * (1.0 + want.abs());
                            assert!(
                                (got as f64 - want).abs() <= tol,
                                "({m},{n},{k}) layouts {a_kind}/{b_kind} acc={accumulate} bias={with_bias} t={threads}: \
                                 C[{i}][{j}] = {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn k_blocks_are_few_even_and_bounded() {
        for k in 1..5000 {
            let d = depth(k);
            assert!(d <= KC_MAX && d.is_multiple_of(8), "k={k}: depth {d}");
            assert_eq!(k.div_ceil(d), k.div_ceil(KC_MAX), "k={k}: no more blocks than needed");
        }
        assert_eq!(depth(768), 384);
        assert_eq!(depth(256), 256);
    }

    #[test]
    fn matches_f64_reference_on_edge_shapes_and_layouts() {
        if !crate::backend::cpu::simd::Isa::Avx2.supported() {
            crate::testdata::skipped("sgemm", "this CPU has no AVX2+FMA, so the packed path never runs here");
            return;
        }
        // Tiles exact and not, k across the 8-wide pack and one to three k blocks (even and
        // not), m across MC, n across NC.
        let shapes = [
            (270, 20, 5),
            (9, 40, 1000),
            (1, 1, 1),
            (1, 1, 0),
            (6, 16, 8),
            (5, 17, 3),
            (7, 33, 9),
            (13, 47, 300),
            (150, 20, 5),
            (12, 32, 513),
            (24, 64, 17),
            (11, 31, 9),
            (25, 97, 385),
            (3, NC + 21, 2),
            // A short A block: B packed a group of panels at a time, past one group.
            (8, 2 * GROUP_COLS + 37, 513),
        ];
        for &(m, n, k) in &shapes {
            check(m, n, k, 1);
        }
        // Big enough to be split across threads (columns, then rows).
        check(40, 200, 40, 2);
        check(200, 40, 40, 3);
    }

    /// bf16 operands (as bits), in every layout and on edge shapes, serial and split over
    /// threads: the bits of the same GEMM on their f32 widenings, with and without the bias.
    #[test]
    fn bf16_operands_give_the_bits_of_their_f32_widening() {
        if !crate::backend::cpu::simd::Isa::Avx2.supported() {
            crate::testdata::skipped("sgemm", "this CPU has no AVX2+FMA, so the packed path never runs here");
            return;
        }
        let to16 = |v: Vec<f32>| v.iter().map(|x| crate::core::bf16::from_f32(*x)).collect::<Vec<u16>>();
        let wide = |v: &[u16]| v.iter().map(|x| crate::core::bf16::to_f32(*x)).collect::<Vec<f32>>();
        let shapes = [
            (1, 1, 1),
            (5, 17, 3),
            (13, 47, 300),
            (12, 32, 513),
            (25, 97, 385),
            (97, 301, 270),
            (700, 50, 40),
            (20, WIDE + 45, 600),
        ];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            let mut rng = TestRng(90 + si as u64);
            for a_kind in 0..3 {
                for b_kind in 0..3 {
                    let (ars, acs, alen) = layout(m, k, a_kind);
                    let (brs, bcs, blen) = layout(k, n, b_kind);
                    let (a, b) = (to16(rng.vec(alen)), to16(rng.vec(blen)));
                    let (af, bf) = (wide(&a), wide(&b));
                    let (c0, bias) = (rng.vec(m * n), rng.vec(n));
                    for (accumulate, with_bias) in [(false, true), (true, false)] {
                        let bias = if with_bias { bias.as_ptr() } else { std::ptr::null() };
                        for tile in tiles() {
                            for (threads, order) in [(1, Order::Blocks), (2, Order::Blocks), (2, Order::Runs)] {
                                let (mut want, mut got, mut mixed) = (c0.clone(), c0.clone(), c0.clone());
                                // SAFETY: the buffers are sized for the shapes and strides (layout).
                                unsafe {
                                    let (a_s, b_s, c_s) = ((ars, acs), (brs, bcs), (n as isize, 1));
                                    let (wp, gp, xp) = (want.as_mut_ptr(), got.as_mut_ptr(), mixed.as_mut_ptr());
                                    sgemm_in(
                                        tile,
                                        m,
                                        n,
                                        k,
                                        wp,
                                        c_s,
                                        accumulate,
                                        bias,
                                        af.as_ptr(),
                                        a_s,
                                        bf.as_ptr(),
                                        b_s,
                                        threads,
                                        order,
                                    );
                                    sgemm_in(
                                        tile,
                                        m,
                                        n,
                                        k,
                                        gp,
                                        c_s,
                                        accumulate,
                                        bias,
                                        a.as_ptr(),
                                        a_s,
                                        b.as_ptr(),
                                        b_s,
                                        threads,
                                        order,
                                    );
                                    sgemm_in(
                                        tile,
                                        m,
                                        n,
                                        k,
                                        xp,
                                        c_s,
                                        accumulate,
                                        bias,
                                        af.as_ptr(),
                                        a_s,
                                        b.as_ptr(),
                                        b_s,
                                        threads,
                                        order,
                                    );
                                }
                                let what = format!(
                                    "({m},{n},{k}) layouts {a_kind}/{b_kind} acc={accumulate} {tile:?} {order:?} t={threads}"
                                );
                                assert!(bits(&want) == bits(&got), "{what}: bf16 operands differ from their widening");
                                assert!(bits(&want) == bits(&mixed), "{what}: f32 A with bf16 B differs");
                            }
                        }
                    }
                }
            }
        }
    }

    /// A group of panels packed row by row ([`pack_b_group`]) is the panels packed one by one
    /// ([`pack_b_panel`]), zero padding included: f32 and bf16, partial panels, k not a
    /// multiple of 8, a whole group.
    #[test]
    fn grouped_b_panels_are_the_panels_packed_one_by_one() {
        if !crate::backend::cpu::simd::Isa::Avx2.supported() {
            crate::testdata::skipped("sgemm", "this CPU has no AVX2+FMA, so the packed path never runs here");
            return;
        }
        fn both<T: Elem>(t: Tile, kc: usize, cols: usize, ld: usize, b: &[T]) -> (Vec<u32>, Vec<u32>) {
            let (nr, panels) = (t.nr(), cols.div_ceil(t.nr()));
            let (mut grouped, mut single) =
                (vec![f32::NAN; panels * nr * kc + 16], vec![f32::NAN; panels * nr * kc + 16]);
            let view = |j: usize| View { ptr: b[j..].as_ptr() as *mut T, rs: ld as isize, cs: 1 };
            let (g, s) = (aligned(&mut grouped, panels * nr * kc), aligned(&mut single, panels * nr * kc));
            // SAFETY: rows 0..kc and columns 0..cols lie inside b (ld >= cols); each buffer
            // has panels*NR*kc aligned floats.
            unsafe {
                pack_b_group(t, kc, cols, view(0), g);
                for q in 0..panels {
                    pack_b_panel(t, kc, nr.min(cols - q * nr), view(q * nr), s.add(q * nr * kc));
                }
                let (g, s) =
                    (std::slice::from_raw_parts(g, panels * nr * kc), std::slice::from_raw_parts(s, panels * nr * kc));
                (bits(g), bits(s))
            }
        }
        let mut rng = TestRng(77);
        for t in tiles() {
            for (kc, cols) in [(1, 1), (7, 15), (8, 16), (9, 17), (300, 100), (13, GROUP_COLS), (17, GROUP_COLS - 3)] {
                let ld = cols + 5;
                let b = rng.vec(kc * ld);
                let (g, s) = both(t, kc, cols, ld, &b);
                assert!(g == s, "{t:?} kc={kc} cols={cols}: f32 panels differ");
                let b16: Vec<u16> = b.iter().map(|x| crate::core::bf16::from_f32(*x)).collect();
                let (g, s) = both(t, kc, cols, ld, &b16);
                assert!(g == s, "{t:?} kc={kc} cols={cols}: bf16 panels differ");
            }
        }
    }

    #[test]
    fn parallel_splits_match_the_serial_kernel() {
        // The parallel path against the serial one (threads = 1); `threads` also sets how many
        // column parts the narrow split makes. The team's own size is fixed per process:
        // tests/thread_count.rs runs processes of 1 to 4 threads against each other.
        if !crate::backend::cpu::simd::Isa::Avx2.supported() {
            crate::testdata::skipped("sgemm", "this CPU has no AVX2+FMA, so the packed path never runs here");
            return;
        }
        // Each of parallel()'s splits, with partial tiles and one to three k blocks: narrow
        // column parts, wide with a shared A (also past NC columns), tall with a shared B (also
        // past NC columns, and with more than MC rows per chunk).
        let shapes = [
            (97, 301, 270),
            (40, WIDE + 52, 800),
            (7, NC + 37, 30),
            (700, 50, 800),
            (5000, NC + 20, 3),
            (10, 2 * GROUP_COLS + 37, 600),
            // Wide with a shared A past one run of k blocks (DEEP), the last block short, a
            // partial A panel, a partial B panel and a partial group of them.
            (37, WIDE + 45, 2 * DEEP + 100),
        ];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            let mut rng = TestRng(5 + si as u64);
            let (a, b, c0, bias) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n), rng.vec(n));
            // B row-major (the input-gradient GEMMs) and transposed (the forward's W^T).
            for b_rows in [true, false] {
                let bs = if b_rows { (n as isize, 1) } else { (1, k as isize) };
                for (accumulate, with_bias) in [(false, true), (true, false)] {
                    let with_threads = |tile, threads, order| {
                        let mut c = c0.clone();
                        let bias = with_bias.then_some(&bias[..]);
                        let (a_s, m_n_k) = ((k as isize, 1), (m, n, k));
                        run(tile, m_n_k, &mut c, n, accumulate, bias, &a, a_s, &b, bs, threads, order);
                        c
                    };
                    let one = with_threads(Tile::Avx2, 1, Order::Blocks);
                    for tile in tiles() {
                        for t in [1, 2, 3] {
                            for order in [Order::Blocks, Order::Runs] {
                                assert!(
                                    bits(&one) == bits(&with_threads(tile, t, order)),
                                    "({m},{n},{k}) b_rows={b_rows} acc={accumulate}: {tile:?} {order:?} on {t} threads differs"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

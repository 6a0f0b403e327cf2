//! bf16 GEMM with fp32 accumulation, `C (m, n) f32 [+]= A (m, k) bf16 @ B (k, n) bf16`, on
//! AVX512_BF16's `vdpbf16ps`: each instruction multiplies 16 pairs of bf16 and adds both
//! products into 16 fp32 lanes, twice the multiply-adds of an fp32 FMA of the same width. The
//! building block of the bf16 precision (issue: bf16 mixed precision); the products of two bf16
//! are exact in fp32, so each step is one exact product and one fp32 add, as an FMA is.
//!
//! The layout is [`super::sgemm`]'s, with k taken in pairs: A is packed into 12-row panels
//! holding, for each pair of k, each row's two values side by side in one 32-bit lane; B into
//! 32-column panels holding, for each pair of k, each column's two values side by side; the
//! 12x32 register tile keeps 24 fp32 accumulators and does 2 B loads and 12 broadcasts per pair
//! of k. An odd k is padded with a zero. Every element of C sums its pairs of k in the same order
//! (k blocks of [`KC`], in order) whatever the thread count or split, so results do not depend on
//! scheduling. `vdpbf16ps` treats denormal inputs as zero and rounds to nearest even.
//!
//! Where the CPU has AVX512_BF16 ([`available`]) the tile is `vdpbf16ps`; elsewhere a portable
//! tile computes the same bits, one fp32 FMA per product in the instruction's order (the high
//! half of each pair first), with its denormal rules (inputs as zero, denormal results flushed):
//! slow, but results do not depend on the host.

use super::team;
use std::cell::RefCell;

/// Rows and columns of the register tile.
const MR: usize = 12;
const NR: usize = 32;
/// Values of k per packed block (even: whole pairs); as sgemm's KC_MAX.
const KC: usize = 384;
/// Rows of A per packed block (a multiple of MR).
const MC: usize = 264;
/// Columns of B per packed block (a multiple of NR).
const NC: usize = 2048;
/// Below this many multiply-adds a GEMM runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 18;

/// Whether this CPU has `vdpbf16ps` (AVX512_BF16, with AVX-512F) and the kernels may use
/// AVX-512 (`LLMRS_CPU_ISA` does not hold them to AVX2 or the portable path).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::simd::isa() == super::simd::Isa::Avx512
            && std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The tiles a bf16 GEMM runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// AMX (`tdpbf16ps`, Sapphire Rapids and later): a 16x16 fp32 tile += a 16x32 bf16 tile
    /// times a 32x16 one per instruction, on a unit beside the vector ones.
    Amx,
    /// AVX512_BF16's `vdpbf16ps`, 16 lanes of two multiply-adds.
    Dpbf16,
    /// `vdpbf16ps`'s bits in portable code (tests; slow).
    Portable,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Amx => "amx",
            Engine::Dpbf16 => "avx512bf16",
            Engine::Portable => "portable",
        }
    }
}

/// Whether AMX-BF16 can run here: the CPU has AMX-TILE and AMX-BF16, the kernels may use
/// AVX-512 (`LLMRS_CPU_ISA` holding them lower holds AMX off too), and the OS grants the
/// process the tile data state (Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once).
pub fn amx_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            if super::simd::isa() != super::simd::Isa::Avx512 {
                return false;
            }
            // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
            #[allow(unused_unsafe)]
            // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX-512 (checked above).
            let edx = unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx;
            if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a syscall with integer arguments; it changes only whether this process
            // may use the AMX tile state.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// Whether `engine` can run on this host (and under `LLMRS_CPU_ISA`).
pub fn runs(engine: Engine) -> bool {
    match engine {
        Engine::Amx => amx_available(),
        Engine::Dpbf16 => available(),
        Engine::Portable => true,
    }
}

/// The engine the model's bf16 x bf16 GEMMs use, or None where they widen bf16 to fp32 while
/// packing and run the fp32 GEMM. `LLMRS_BF16_GEMM=amx|avx512bf16|widen` forces one the host
/// runs; by default AMX where it runs, else `vdpbf16ps` on AMD CPUs (Zen 4 and later); else
/// widening. Intel's `vdpbf16ps` is not chosen: on a Sapphire Rapids host its loop measured half
/// the fp32 FMA loop's flops (README), so widening into the fp32 GEMM is faster there. Fixed for
/// the process, since the engine decides the bits of every bf16 product.
pub fn model_engine() -> Option<Engine> {
    *MODEL_ENGINE.get_or_init(|| choose_engine().unwrap_or_else(|_| default_engine()))
}

static MODEL_ENGINE: std::sync::OnceLock<Option<Engine>> = std::sync::OnceLock::new();

/// Settle [`model_engine`] at start-up, so that a bad `LLMRS_BF16_GEMM` is an error, not a
/// surprise later.
pub fn init() -> anyhow::Result<Option<Engine>> {
    let want = choose_engine()?;
    Ok(*MODEL_ENGINE.get_or_init(|| want))
}

fn default_engine() -> Option<Engine> {
    if amx_available() {
        Some(Engine::Amx)
    } else if available() && super::simd::is_amd() {
        Some(Engine::Dpbf16)
    } else {
        None
    }
}

fn choose_engine() -> anyhow::Result<Option<Engine>> {
    use crate::core::env::BF16_GEMM;
    let Some(s) = crate::core::env::text(BF16_GEMM) else { return Ok(default_engine()) };
    let engine = match s.as_str() {
        "widen" => return Ok(None),
        "amx" => Engine::Amx,
        "avx512bf16" => Engine::Dpbf16,
        _ => anyhow::bail!("{BF16_GEMM}={s}: use amx, avx512bf16 or widen"),
    };
    if !runs(engine) {
        anyhow::bail!(
            "{BF16_GEMM}={s}: this host cannot run it (it needs the CPU's {} and AVX-512 kernels{}); use widen",
            if engine == Engine::Amx { "AMX-BF16 and the OS's permission" } else { "AVX512_BF16" },
            match default_engine() {
                Some(e) => format!("; this host runs {}", e.name()),
                None => String::new(),
            }
        );
    }
    Ok(Some(engine))
}

/// A raw bf16 matrix view: element (i, j) at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct View {
    ptr: *const u16,
    rs: isize,
    cs: isize,
}
// SAFETY: views are only read, from threads that the caller's guarantees keep inside the matrix.
unsafe impl Send for View {}
unsafe impl Sync for View {}

impl View {
    /// Element (i, j), or 0 past the matrix's `rows` x `cols`.
    #[inline(always)]
    unsafe fn get(self, i: usize, j: usize, rows: usize, cols: usize) -> u32 {
        if i < rows && j < cols {
            // SAFETY: the caller's view covers (i, j) inside rows x cols.
            unsafe { *self.ptr.offset(i as isize * self.rs + j as isize * self.cs) as u32 }
        } else {
            0
        }
    }
}

/// `dst (m, n) = [dst +] lhs (m, k) @ rhs (k, n) [+ bias (n)]`, lhs and rhs bf16 (as their bit
/// patterns), dst and bias fp32; strides in elements, (row stride, column stride), non-negative;
/// dst's column stride 1. The bias (null for none) is added when not accumulating. `threads` > 1
/// splits the columns over the team.
///
/// # Safety
/// Every element the strides address for the given shapes lies inside its buffer; dst overlaps
/// neither input.
#[allow(clippy::too_many_arguments)]
pub unsafe fn bgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    bias: *const f32,
    lhs: *const u16,
    lhs_st: (isize, isize),
    rhs: *const u16,
    rhs_st: (isize, isize),
    threads: usize,
) {
    let engine = if available() { Engine::Dpbf16 } else { Engine::Portable };
    // SAFETY: as the caller guarantees; `vdpbf16ps` only where the CPU has AVX512_BF16.
    unsafe { bgemm_on(engine, m, n, k, dst, dst_rs, accumulate, bias, lhs, lhs_st, rhs, rhs_st, threads) }
}

/// A register tile's function: `pairs` pairs of k from the packed panels into C's MR x NR tile.
type Kernel = unsafe fn(usize, *const u32, *const u32, *mut f32, isize, bool, *const f32);

/// [`bgemm`] on the tiles `engine`.
///
/// # Safety
/// As [`bgemm`]'s, and the host runs `engine` ([`runs`]).
#[allow(clippy::too_many_arguments)]
pub unsafe fn bgemm_on(
    engine: Engine,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    bias: *const f32,
    lhs: *const u16,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const u16,
    (rhs_rs, rhs_cs): (isize, isize),
    threads: usize,
) {
    let bias = if accumulate { std::ptr::null() } else { bias };
    let (a, b) = (View { ptr: lhs, rs: lhs_rs, cs: lhs_cs }, View { ptr: rhs, rs: rhs_rs, cs: rhs_cs });
    if m == 0 || n == 0 {
        return;
    }
    let (c_addr, bias_addr) = (dst as usize, bias as usize);
    // A part is a block of rows i0..i1 and columns j0..j1 of C.
    let part = |(i0, i1): (usize, usize), (j0, j1): (usize, usize)| {
        let (a, b) = (a, b); // the whole (Sync) views, not their raw pointer fields
        let bias = bias_addr as *const f32;
        let (c, bias, a, b) = (
            (c_addr as *mut f32).wrapping_offset(i0 as isize * dst_rs).wrapping_add(j0),
            if bias.is_null() { bias } else { bias.wrapping_add(j0) },
            View { ptr: a.ptr.wrapping_offset(i0 as isize * a.rs), ..a },
            View { ptr: b.ptr.wrapping_offset(j0 as isize * b.cs), ..b },
        );
        let (m, n) = (i1 - i0, j1 - j0);
        // SAFETY: this block of C is this part's alone; the views stay inside A and B; the
        // caller checked that the host runs the engine.
        unsafe {
            match engine {
                Engine::Amx => serial_amx(m, n, k, c, dst_rs, accumulate, bias, a, b),
                Engine::Dpbf16 => serial(Tiles::Dpbf16, m, n, k, c, dst_rs, accumulate, bias, a, b),
                Engine::Portable => serial(Tiles::Portable, m, n, k, c, dst_rs, accumulate, bias, a, b),
            }
        }
    };
    if threads <= 1 || m * n * k < PARALLEL_MIN {
        return part((0, m), (0, n));
    }
    // Split the longer side of C, so that each part packs only its share of the larger
    // operand (the smaller one is packed by every part). Every element sums its k blocks in
    // the same order whatever the split, so the bits do not depend on it.
    let rows = if engine == Engine::Amx { MC_AMX } else { MR };
    let (long, unit) = if m > n { (m, rows) } else { (n, NR) };
    let tiles = long.div_ceil(unit);
    // AMX's tiles outrun the packing of the operand every part packs again, so AMX takes one
    // part per thread; the vdpbf16ps tiles take up to four, for balance.
    let most = if engine == Engine::Amx { threads } else { 4 * threads };
    // A whole number of parts per thread: the parts are near equal, so a remainder would leave
    // threads waiting on the last one (3 parts on 2 threads run at two thirds of the speed).
    // Parts of at least 1024 columns (or rows) where there are enough: every part packs the
    // other operand whole, and at 256 that packing cost the vdpbf16ps tiles 3-10% by shape.
    let parts = ((long / 1024).clamp(threads, most) / threads * threads).min(tiles);
    team::for_ranges(parts, 1, 1, |range| {
        for p in range {
            let (x0, x1) = (tiles * p / parts * unit, (tiles * (p + 1) / parts * unit).min(long));
            if m > n {
                part((x0, x1), (0, n))
            } else {
                part((0, m), (x0, x1))
            }
        }
    });
}

/// Per-thread packing buffers (u32: a pair of bf16 each), grown on first use and reused.
struct Packs {
    a: Vec<u32>,
    b: Vec<u32>,
}

thread_local! {
    static PACKS: RefCell<Packs> = const { RefCell::new(Packs { a: Vec::new(), b: Vec::new() }) };
}

/// A 64-byte-aligned window of `len` values inside `v` (grown as needed).
fn aligned(v: &mut Vec<u32>, len: usize) -> *mut u32 {
    if v.len() < len + 16 {
        *v = vec![0; len + 16];
    }
    let off = v.as_ptr().align_offset(64);
    // SAFETY: off < 16 and the vector holds len + 16 values.
    unsafe { v.as_mut_ptr().add(off) }
}

/// The register tiles [`serial`] runs: `vdpbf16ps`'s (which also packs on AVX-512, as the host
/// that has them has it) or the portable ones (scalar packing).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tiles {
    Dpbf16,
    Portable,
}

/// The single-threaded blocked GEMM.
#[allow(clippy::too_many_arguments)]
unsafe fn serial(
    tiles: Tiles,
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    ldc: isize,
    accumulate: bool,
    bias: *const f32,
    a: View,
    b: View,
) {
    let (kern, fast): (Kernel, bool) = match tiles {
        Tiles::Dpbf16 => (kernel, true),
        Tiles::Portable => (kernel_portable, false),
    };
    PACKS.with(|packs| {
        let packs = &mut *packs.borrow_mut();
        let ap = aligned(&mut packs.a, MC * KC / 2);
        let bp = aligned(&mut packs.b, NC * KC / 2);
        if k == 0 {
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: (i, j) lies inside C; bias has n values.
                    unsafe {
                        let x = c.offset(i as isize * ldc).add(j);
                        if !accumulate {
                            *x = if bias.is_null() { 0.0 } else { *bias.add(j) };
                        }
                    }
                }
            }
            return;
        }
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let pairs = kc.div_ceil(2);
                let acc = accumulate || pc > 0;
                let bias = if pc == 0 { bias } else { std::ptr::null() };
                let kend = pc + kc;
                for (jr, j0) in (0..nc).step_by(NR).enumerate() {
                    let (j1, d) = (n.min(jc + j0 + NR), bp.add(jr * NR * pairs));
                    // SAFETY: panel jr lies inside bp (NC x KC/2 values); the fast packers only
                    // with vdpbf16ps's tiles, whose host has AVX-512 (`available`). A panel
                    // holds the same values whichever packer made it.
                    unsafe {
                        if fast {
                            pack_b_fast(pairs, pc, kend, jc + j0, j1, b, d)
                        } else {
                            pack_b(pairs, pc, k, jc + j0, j1, b, d)
                        }
                    };
                }
                for ic in (0..m).step_by(MC) {
                    let mc = MC.min(m - ic);
                    for (ir, i0) in (0..mc).step_by(MR).enumerate() {
                        let (i1, d) = (m.min(ic + i0 + MR), ap.add(ir * MR * pairs));
                        // SAFETY: panel ir lies inside ap (MC x KC/2 values); AVX-512 as above.
                        unsafe {
                            if fast {
                                pack_a_fast(pairs, pc, kend, ic + i0, i1, a, d)
                            } else {
                                pack_a(pairs, pc, k, ic + i0, i1, a, d)
                            }
                        };
                    }
                    for (jr, j0) in (0..nc).step_by(NR).enumerate() {
                        let cols = NR.min(nc - j0);
                        let bias = if bias.is_null() { bias } else { bias.wrapping_add(jc + j0) };
                        for (ir, i0) in (0..mc).step_by(MR).enumerate() {
                            let rows = MR.min(mc - i0);
                            // SAFETY: the panels are packed; the tile lies inside C.
                            unsafe {
                                let ct = c.offset((ic + i0) as isize * ldc).add(jc + j0);
                                tile(
                                    kern,
                                    rows,
                                    cols,
                                    pairs,
                                    ap.add(ir * MR * pairs),
                                    bp.add(jr * NR * pairs),
                                    ct,
                                    ldc,
                                    acc,
                                    bias,
                                )
                            };
                        }
                    }
                }
            }
        }
    })
}

/// Pack rows `i0..i1` (at most MR) of A's k values `pc..pc+2*pairs` into a panel: pair p of row
/// i at `p*MR + i`, `A[i][2p]` in the low half, zero past the rows or past k.
unsafe fn pack_a(pairs: usize, pc: usize, k: usize, i0: usize, i1: usize, a: View, d: *mut u32) {
    for p in 0..pairs {
        for i in 0..MR {
            let (kk, row) = (pc + 2 * p, i0 + i);
            // SAFETY: get() reads only inside the matrix; d holds MR*pairs values.
            unsafe { *d.add(p * MR + i) = a.get(row, kk, i1, k) | (a.get(row, kk + 1, i1, k) << 16) };
        }
    }
}

/// [`pack_a`] on AVX-512 for whole panels (MR rows) whose pairs are adjacent in memory (A
/// row-major: a forward's input, a backward's output gradient) or whose rows are adjacent (A
/// read through a transpose: a weight gradient's output gradient); [`pack_a`] otherwise.
///
/// # Safety
/// As [`pack_a`]'s with k = kend (the view covers A's rows i0..i1 and k values pc..kend, and
/// pairs = (kend - pc).div_ceil(2)); the host has AVX-512F.
unsafe fn pack_a_fast(pairs: usize, pc: usize, kend: usize, i0: usize, i1: usize, a: View, d: *mut u32) {
    let (whole, odd) = ((kend - pc) / 2, (kend - pc) % 2 == 1);
    debug_assert_eq!(pairs, whole + odd as usize);
    // SAFETY (all blocks): reads stay inside A's rows i0..i1 and k values pc..kend; d holds
    // MR*pairs values; AVX-512F as the caller guarantees.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        let first = if i1 - i0 == MR && a.cs == 1 {
            vpack::a_rows12(whole, a.ptr.offset(i0 as isize * a.rs + pc as isize), a.rs, d)
        } else if i1 - i0 == MR && a.rs == 1 {
            vpack::a_cols12(whole, a.ptr.offset(pc as isize * a.cs + i0 as isize), a.cs, d)
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let first = 0;
        for p in first..pairs {
            for i in 0..MR {
                let (kk, row) = (pc + 2 * p, i0 + i);
                *d.add(p * MR + i) = a.get(row, kk, i1, kend) | (a.get(row, kk + 1, i1, kend) << 16);
            }
        }
    }
}

/// Pack columns `j0..j1` (at most NR) of B's k values `pc..pc+2*pairs` into a panel: pair p of
/// column j at `p*NR + j`, `B[2p][j]` in the low half, zero past the columns or past k.
unsafe fn pack_b(pairs: usize, pc: usize, k: usize, j0: usize, j1: usize, b: View, d: *mut u32) {
    for p in 0..pairs {
        for j in 0..NR {
            let (kk, col) = (pc + 2 * p, j0 + j);
            // SAFETY: get() reads only inside the matrix; d holds NR*pairs values.
            unsafe { *d.add(p * NR + j) = b.get(kk, col, k, j1) | (b.get(kk + 1, col, k, j1) << 16) };
        }
    }
}

/// One tile: full ones straight into C, partial ones through a local tile.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    kern: Kernel,
    rows: usize,
    cols: usize,
    pairs: usize,
    ap: *const u32,
    bp: *const u32,
    c: *mut f32,
    ldc: isize,
    acc: bool,
    bias: *const f32,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        if rows == MR && cols == NR {
            return kern(pairs, ap, bp, c, ldc, acc, bias);
        }
        let mut local = [0f32; MR * NR];
        kern(pairs, ap, bp, local.as_mut_ptr(), NR as isize, false, std::ptr::null());
        for i in 0..rows {
            let row = c.offset(i as isize * ldc);
            for j in 0..cols {
                let x = local[i * NR + j];
                *row.add(j) = if acc {
                    *row.add(j) + x
                } else if bias.is_null() {
                    x
                } else {
                    x + *bias.add(j)
                };
            }
        }
    }
}

/// Rows of an AMX A panel (two 16-row tiles) and of its packed block (a multiple of it).
const MR_AMX: usize = 32;
const MC_AMX: usize = 256;
/// Pairs of k per AMX tile (16 rows of B's 64-byte tile rows; 32 bf16 of an A tile row).
const TK: usize = 16;

/// The single-threaded blocked GEMM on AMX: [`serial`]'s blocking (the same k blocks, so every
/// element sums its k blocks in the same order whatever the split), with 32x32 C blocks of four
/// 16x16 tiles. A is packed row-major (each row's pairs contiguous, as a tile row loads), B as
/// [`pack_b`] packs it (a tile row is 16 columns' pairs), both padded with zero pairs to whole
/// tiles of 16 pairs. A whole 32x32 block of C is loaded into the tiles (or they start from
/// zero, for the first k block when not accumulating) and the k block's products are added to
/// it there, then stored back; a partial block, or one taking the bias, is summed from zero
/// into a local block and then added to C (or stored over it, plus the bias) as [`tile`] does.
#[allow(clippy::too_many_arguments)]
unsafe fn serial_amx(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    ldc: isize,
    accumulate: bool,
    bias: *const f32,
    a: View,
    b: View,
) {
    if k == 0 {
        // SAFETY: as the caller guarantees; with k = 0 no tile runs.
        return unsafe { serial(Tiles::Portable, m, n, k, c, ldc, accumulate, bias, a, b) };
    }
    PACKS.with(|packs| {
        let packs = &mut *packs.borrow_mut();
        let ap = aligned(&mut packs.a, MC_AMX * KC / 2);
        let bp = aligned(&mut packs.b, NC * KC / 2);
        let mut local = [0f32; MR_AMX * NR];
        // SAFETY: the caller checked that the host runs AMX (amx_available).
        unsafe { amx_config() };
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let (kc, kend) = (KC.min(k - pc), KC.min(k - pc) + pc);
                let pairs = kc.div_ceil(2).next_multiple_of(TK);
                let acc = accumulate || pc > 0;
                let bias = if pc == 0 { bias } else { std::ptr::null() };
                for (jr, j0) in (0..nc).step_by(NR).enumerate() {
                    // SAFETY: panel jr lies inside bp (NC x KC/2 values; KC/2 is whole tiles); AMX
                    // runs only where the kernels may use AVX-512 (amx_available).
                    unsafe { pack_b_fast(pairs, pc, kend, jc + j0, n.min(jc + j0 + NR), b, bp.add(jr * NR * pairs)) };
                }
                for ic in (0..m).step_by(MC_AMX) {
                    let mc = MC_AMX.min(m - ic);
                    for (ir, i0) in (0..mc).step_by(MR_AMX).enumerate() {
                        let d = ap.wrapping_add(ir * MR_AMX * pairs);
                        // SAFETY: panel ir lies inside ap (MC_AMX x KC/2 values); AVX-512 as above.
                        unsafe { pack_a_rows(pairs, pc, kend, ic + i0, m.min(ic + i0 + MR_AMX), a, d) };
                    }
                    for (jr, j0) in (0..nc).step_by(NR).enumerate() {
                        let cols = NR.min(nc - j0);
                        let bias = if bias.is_null() { bias } else { bias.wrapping_add(jc + j0) };
                        for (ir, i0) in (0..mc).step_by(MR_AMX).enumerate() {
                            let rows = MR_AMX.min(mc - i0);
                            let (a, b) = (ap.add(ir * MR_AMX * pairs), bp.add(jr * NR * pairs));
                            // SAFETY: the panels are packed (whole tiles); the block lies inside C.
                            unsafe {
                                let ct = c.offset((ic + i0) as isize * ldc).add(jc + j0);
                                if rows == MR_AMX && cols == NR && bias.is_null() {
                                    amx_block(pairs, a, b, ct, ldc as usize * 4, acc);
                                } else {
                                    amx_block(pairs, a, b, local.as_mut_ptr(), NR * 4, false);
                                    put(rows, cols, &local, ct, ldc, acc, bias);
                                }
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: tiles were configured above; release them (the OS then skips their state).
        unsafe { amx_release() };
    })
}

/// C's `rows` x `cols` block [+]= a local MR_AMX x NR block (as [`tile`]'s partial path).
///
/// # Safety
/// The block lies inside C at row stride ldc; a non-null bias has `cols` floats.
#[inline(always)]
unsafe fn put(
    rows: usize,
    cols: usize,
    local: &[f32; MR_AMX * NR],
    c: *mut f32,
    ldc: isize,
    acc: bool,
    bias: *const f32,
) {
    // SAFETY: a non-null bias has `cols` floats.
    let bias = (!bias.is_null()).then(|| unsafe { std::slice::from_raw_parts(bias, cols) });
    for i in 0..rows {
        // SAFETY: as the caller guarantees.
        let row = unsafe { std::slice::from_raw_parts_mut(c.offset(i as isize * ldc), cols) };
        super::sgemm::store_row_f32(row, &local[i * NR..i * NR + cols], acc, bias);
    }
}

/// [`pack_b`] for AMX and `vdpbf16ps` (pairs up to `kend`, zero past it up to `pairs`), with straight loops where B's pairs
/// are adjacent in memory (W^T of a forward: row stride 1) or B is row-major (column stride
/// 1: two rows interleaved), for whole panels; those run on AVX-512 ([`vpack`]).
///
/// # Safety
/// The view covers B's rows pc..kend and columns j0..j1; d holds NR*pairs values; the host
/// has AVX-512 (AMX and `vdpbf16ps` run only where the kernels may use it, [`amx_available`],
/// [`available`]).
unsafe fn pack_b_fast(pairs: usize, pc: usize, kend: usize, j0: usize, j1: usize, b: View, d: *mut u32) {
    let (whole, odd) = ((kend - pc) / 2, (kend - pc) % 2 == 1);
    // SAFETY (all blocks): reads stay inside B's rows pc..kend and columns j0..j1 (the caller's
    // view covers them); d holds NR*pairs values; the vpack functions need AVX-512F, which the
    // caller guarantees.
    unsafe {
        if j1 - j0 == NR && b.rs == 1 {
            #[cfg(target_arch = "x86_64")]
            let first = vpack::b_transposed(whole, b.ptr.offset(j0 as isize * b.cs + pc as isize), b.cs, d);
            #[cfg(not(target_arch = "x86_64"))]
            let first = 0;
            for j in 0..NR {
                let col = b.ptr.offset((j0 + j) as isize * b.cs + pc as isize);
                for p in first..whole {
                    *d.add(p * NR + j) = (col.add(2 * p) as *const u32).read_unaligned();
                }
                if odd {
                    *d.add(whole * NR + j) = *col.add(2 * whole) as u32;
                }
            }
        } else if j1 - j0 == NR && b.cs == 1 {
            #[cfg(target_arch = "x86_64")]
            let first =
                vpack::rows_interleaved::<NR>(whole, b.ptr.offset(pc as isize * b.rs + j0 as isize), b.rs, d, NR);
            #[cfg(not(target_arch = "x86_64"))]
            let first = 0;
            for p in first..whole {
                let r0 = std::slice::from_raw_parts(b.ptr.offset((pc + 2 * p) as isize * b.rs + j0 as isize), NR);
                let r1 = std::slice::from_raw_parts(b.ptr.offset((pc + 2 * p + 1) as isize * b.rs + j0 as isize), NR);
                let dp = std::slice::from_raw_parts_mut(d.add(p * NR), NR);
                for j in 0..NR {
                    dp[j] = r0[j] as u32 | (r1[j] as u32) << 16;
                }
            }
            if odd {
                let r0 = std::slice::from_raw_parts(b.ptr.offset((pc + 2 * whole) as isize * b.rs + j0 as isize), NR);
                for (j, &x) in r0.iter().enumerate() {
                    *d.add(whole * NR + j) = x as u32;
                }
            }
        } else {
            return pack_b(pairs, pc, kend, j0, j1, b, d);
        }
        let done = whole + odd as usize;
        std::ptr::write_bytes(d.add(done * NR), 0, (pairs - done) * NR);
    }
}

/// Pack rows `i0..i1` (at most MR_AMX) of A's k values `pc..kend` for AMX: pair p of row i at
/// `i*pairs + p`, `A[i][2p]` in the low half, zero past the rows or past kend; straight loops
/// where A's pairs are adjacent (column stride 1) or A is read through a transpose (row
/// stride 1: two rows interleaved), for whole panels; the latter on AVX-512 ([`vpack`]).
///
/// # Safety
/// As [`pack_b_fast`]'s, for A's rows i0..i1 and d of MR_AMX*pairs values.
unsafe fn pack_a_rows(pairs: usize, pc: usize, kend: usize, i0: usize, i1: usize, a: View, d: *mut u32) {
    let (whole, odd) = ((kend - pc) / 2, (kend - pc) % 2 == 1);
    // SAFETY (all blocks): reads stay inside A's rows i0..i1 and k values pc..kend (the
    // caller's view covers them); d holds MR_AMX*pairs values; AVX-512F as the caller guarantees.
    unsafe {
        if i1 - i0 == MR_AMX && a.cs == 1 {
            for i in 0..MR_AMX {
                let row = a.ptr.offset((i0 + i) as isize * a.rs + pc as isize);
                let di = d.add(i * pairs);
                // A row's pairs are its values as they lie: a straight copy.
                std::ptr::copy_nonoverlapping(row as *const u8, di as *mut u8, 4 * whole);
                if odd {
                    *di.add(whole) = *row.add(2 * whole) as u32;
                }
                let done = whole + odd as usize;
                std::ptr::write_bytes(di.add(done), 0, pairs - done);
            }
        } else if i1 - i0 == MR_AMX && a.rs == 1 {
            #[cfg(target_arch = "x86_64")]
            let first = vpack::a_transposed(whole, a.ptr.offset(pc as isize * a.cs + i0 as isize), a.cs, d, pairs);
            #[cfg(not(target_arch = "x86_64"))]
            let first = 0;
            let mut pair = [0u32; MR_AMX];
            for p in first..pairs {
                if p < whole {
                    let r0 =
                        std::slice::from_raw_parts(a.ptr.offset((pc + 2 * p) as isize * a.cs + i0 as isize), MR_AMX);
                    let r1 = std::slice::from_raw_parts(
                        a.ptr.offset((pc + 2 * p + 1) as isize * a.cs + i0 as isize),
                        MR_AMX,
                    );
                    for i in 0..MR_AMX {
                        pair[i] = r0[i] as u32 | (r1[i] as u32) << 16;
                    }
                } else if p == whole && odd {
                    let r0 =
                        std::slice::from_raw_parts(a.ptr.offset((pc + 2 * p) as isize * a.cs + i0 as isize), MR_AMX);
                    for i in 0..MR_AMX {
                        pair[i] = r0[i] as u32;
                    }
                } else {
                    pair = [0; MR_AMX];
                }
                for (i, &v) in pair.iter().enumerate() {
                    *d.add(i * pairs + p) = v;
                }
            }
        } else {
            for i in 0..MR_AMX {
                for p in 0..pairs {
                    let (kk, row) = (pc + 2 * p, i0 + i);
                    *d.add(i * pairs + p) = a.get(row, kk, i1, kend) | (a.get(row, kk + 1, i1, kend) << 16);
                }
            }
        }
    }
}

/// The AMX packers' straight cases on AVX-512: each moves whole 16 x 16 blocks of 32-bit pairs
/// through a register transpose, or interleaves two rows of bf16 16 columns at a time, and
/// returns how many pairs it did (the callers finish the rest as before). Pure data movement:
/// the packed panels hold the same values whichever path made them.
#[cfg(target_arch = "x86_64")]
mod vpack {
    use std::arch::x86_64::*;

    /// Transpose a 16 x 16 block of 32-bit values held as 16 rows.
    #[inline(always)]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // SAFETY: register-only AVX-512F operations; callers are compiled with it enabled.
        unsafe {
            // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved by 32 bits, within each 128-bit lane.
            let t: [__m512i; 16] = std::array::from_fn(|q| {
                let (x, y) = (r[q & !1], r[q | 1]);
                if q % 2 == 0 {
                    _mm512_unpacklo_epi32(x, y)
                } else {
                    _mm512_unpackhi_epi32(x, y)
                }
            });
            // u[4i + c], lane L: rows 4i..4i+4 of column 4L + c.
            let u: [__m512i; 16] = std::array::from_fn(|q| {
                let (i, c) = (q / 4, q % 4);
                let (x, y) = (t[4 * i + c / 2], t[4 * i + 2 + c / 2]);
                if c % 2 == 0 {
                    _mm512_unpacklo_epi64(x, y)
                } else {
                    _mm512_unpackhi_epi64(x, y)
                }
            });
            // Column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
            let mut out = [_mm512_setzero_si512(); 16];
            for c in 0..4 {
                let x0 = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
                let x1 = _mm512_shuffle_i32x4::<0xEE>(u[c], u[4 + c]);
                let y0 = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
                let y1 = _mm512_shuffle_i32x4::<0xEE>(u[8 + c], u[12 + c]);
                out[c] = _mm512_shuffle_i32x4::<0x88>(x0, y0);
                out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(x0, y0);
                out[8 + c] = _mm512_shuffle_i32x4::<0x88>(x1, y1);
                out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(x1, y1);
            }
            out
        }
    }

    /// B read through a transpose (its pairs adjacent: column j's pairs at `col0 + j*cs`):
    /// `d[p*NR + j]` = column j's pair p, for the first `whole / 16 * 16` pairs of NR columns.
    ///
    /// # Safety
    /// Columns 0..NR at `col0 + j*cs` hold `2*whole` readable bf16 each; d holds NR*whole
    /// values; the host has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn b_transposed(whole: usize, col0: *const u16, cs: isize, d: *mut u32) -> usize {
        const NR: usize = super::NR;
        let done = whole / 16 * 16;
        // SAFETY: as the caller guarantees: 16 pairs (64 bytes) of a column from pair p0 < done.
        unsafe {
            for p0 in (0..done).step_by(16) {
                for half in 0..NR / 16 {
                    let r: [__m512i; 16] = std::array::from_fn(|j| {
                        let col = col0.offset((16 * half + j) as isize * cs).add(2 * p0);
                        _mm512_loadu_si512(col as *const _)
                    });
                    for (q, v) in transpose16(r).into_iter().enumerate() {
                        _mm512_storeu_si512(d.add((p0 + q) * NR + 16 * half) as *mut _, v);
                    }
                }
            }
        }
        done
    }

    /// Two rows of bf16 interleaved into pairs, `W` columns: `d[p*ld + j]` = row 2p's value j in
    /// the low half, row 2p+1's in the high half, for p < whole (row r at `row0 + r*rs`).
    ///
    /// # Safety
    /// Rows 0..2*whole at `row0 + r*rs` hold W readable bf16 each; d holds ld*whole values
    /// (ld >= W); W is a multiple of 16; the host has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows_interleaved<const W: usize>(
        whole: usize,
        row0: *const u16,
        rs: isize,
        d: *mut u32,
        ld: usize,
    ) -> usize {
        // SAFETY: as the caller guarantees.
        unsafe {
            for p in 0..whole {
                let (r0, r1) = (row0.offset(2 * p as isize * rs), row0.offset((2 * p + 1) as isize * rs));
                for j in (0..W).step_by(16) {
                    let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r0.add(j) as *const _));
                    let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(r1.add(j) as *const _));
                    _mm512_storeu_si512(d.add(p * ld + j) as *mut _, _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi)));
                }
            }
        }
        whole
    }

    /// [`super::pack_a`]'s panel from A row-major (row i's k values at `row0 + i*rs`, its pairs
    /// adjacent): `d[p*MR + i]` = row i's pair p, for MR rows and the first `whole / 16 * 16`
    /// pairs, 16 pairs of the 12 rows at a time through the 16 x 16 transpose (4 zero rows).
    ///
    /// # Safety
    /// Rows 0..MR at `row0 + i*rs` hold `2*whole` readable bf16 each; d holds MR*whole values;
    /// the host has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn a_rows12(whole: usize, row0: *const u16, rs: isize, d: *mut u32) -> usize {
        const MR: usize = super::MR;
        let done = whole / 16 * 16;
        // SAFETY: as the caller guarantees: 16 pairs (64 bytes) of each row from pair p0 < done;
        // each store writes MR values of pair p0 + q (the mask keeps the rest).
        unsafe {
            for p0 in (0..done).step_by(16) {
                let r: [__m512i; 16] = std::array::from_fn(|i| {
                    if i < MR {
                        _mm512_loadu_si512(row0.offset(i as isize * rs).add(2 * p0) as *const _)
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                for (q, v) in transpose16(r).into_iter().enumerate() {
                    _mm512_mask_storeu_epi32(d.add((p0 + q) * MR) as *mut _, (1 << MR) - 1, v);
                }
            }
        }
        done
    }

    /// [`super::pack_a`]'s panel from A read through a transpose (k value kk of row i at
    /// `base + kk*cs + i`): `d[p*MR + i]` = row i's pair p for MR rows and the first `whole`
    /// pairs, two masked loads of MR bf16 interleaved per pair.
    ///
    /// # Safety
    /// k values 0..2*whole of rows 0..MR are readable; d holds MR*whole values; the host has
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn a_cols12(whole: usize, base: *const u16, cs: isize, d: *mut u32) -> usize {
        const MR: usize = super::MR;
        // MR bf16 are MR/2 32-bit words: the masked loads read only them.
        const WORDS: __mmask16 = (1 << (MR / 2)) - 1;
        // SAFETY: as the caller guarantees; masked-off lanes are neither read nor written.
        unsafe {
            for p in 0..whole {
                let k0 = base.offset(2 * p as isize * cs);
                let lo = _mm512_castsi512_si256(_mm512_maskz_loadu_epi32(WORDS, k0 as *const _));
                let hi = _mm512_castsi512_si256(_mm512_maskz_loadu_epi32(WORDS, k0.offset(cs) as *const _));
                let v = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
                _mm512_mask_storeu_epi32(d.add(p * MR) as *mut _, (1 << MR) - 1, v);
            }
        }
        whole
    }

    /// A read through a transpose (rows of A are columns in memory: k value kk of row i at
    /// `base + kk*cs + i`), packed row-major for AMX: `d[i*pairs + p]` = row i's pair p, for
    /// MR_AMX rows and the first `whole / 16 * 16` pairs.
    ///
    /// # Safety
    /// k values 0..2*whole of rows 0..MR_AMX are readable; d holds MR_AMX*pairs values
    /// (pairs >= whole); the host has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn a_transposed(whole: usize, base: *const u16, cs: isize, d: *mut u32, pairs: usize) -> usize {
        const MR: usize = super::MR_AMX;
        let done = whole / 16 * 16;
        // SAFETY: as the caller guarantees.
        unsafe {
            for p0 in (0..done).step_by(16) {
                for half in 0..MR / 16 {
                    // r[q]: pair p0 + q of rows 16*half..16*half + 16.
                    let r: [__m512i; 16] = std::array::from_fn(|q| {
                        let k0 = base.offset(2 * (p0 + q) as isize * cs).add(16 * half);
                        let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(k0 as *const _));
                        let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(k0.offset(cs) as *const _));
                        _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
                    });
                    for (i, v) in transpose16(r).into_iter().enumerate() {
                        _mm512_storeu_si512(d.add((16 * half + i) * pairs + p0) as *mut _, v);
                    }
                }
            }
        }
        done
    }
}

/// Load the tile configuration: eight tiles of 16 rows of 64 bytes (palette 1).
///
/// # Safety
/// The host runs AMX and the OS granted its state ([`amx_available`]).
#[cfg(target_arch = "x86_64")]
unsafe fn amx_config() {
    let mut cfg = [0u8; 64];
    cfg[0] = 1;
    for t in 0..8 {
        cfg[16 + 2 * t] = 64; // bytes per row
        cfg[48 + t] = 16; // rows
    }
    // SAFETY: as the caller guarantees; ldtilecfg reads the 64 bytes of cfg.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.as_ptr(), options(nostack, readonly)) };
}

/// Release the tiles (back to their initial state).
///
/// # Safety
/// As [`amx_config`].
#[cfg(target_arch = "x86_64")]
unsafe fn amx_release() {
    // SAFETY: as the caller guarantees.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// One 32x32 block: `out` (row-major, `so` bytes between rows) [+]= the A panel's 32 rows
/// times the B panel's 32 columns over `pairs` pairs (a multiple of 16). Tiles 0-3 hold the
/// block's quarters (loaded from `out` when accumulating, else zero), 4-5 A's two 16-row
/// halves, 6-7 B's two 16-column halves, for each 16 pairs of k in order.
///
/// # Safety
/// Tiles are configured ([`amx_config`]); the panels hold MR_AMX*pairs and NR*pairs values;
/// `out` holds 32 rows of 32 floats, `so` bytes apart.
#[cfg(target_arch = "x86_64")]
unsafe fn amx_block(pairs: usize, ap: *const u32, bp: *const u32, out: *mut f32, so: usize, acc: bool) {
    use std::arch::asm;
    let (sa, sb) = (pairs * 4, NR * 4); // bytes between tile rows
    let (o0, o1, o2, o3) =
        (out, out.wrapping_add(16), out.wrapping_byte_add(16 * so), out.wrapping_byte_add(16 * so).wrapping_add(16));
    // SAFETY: as the caller guarantees: every tile row loaded lies inside its panel or `out`;
    // the stores fill out's 32x32 floats.
    unsafe {
        if acc {
            asm!(
                "tileloadd tmm0, [{o0} + {so}*1]",
                "tileloadd tmm1, [{o1} + {so}*1]",
                "tileloadd tmm2, [{o2} + {so}*1]",
                "tileloadd tmm3, [{o3} + {so}*1]",
                o0 = in(reg) o0,
                o1 = in(reg) o1,
                o2 = in(reg) o2,
                o3 = in(reg) o3,
                so = in(reg) so,
                options(nostack, readonly),
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        }
        for q in 0..pairs / TK {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) ap.add(q * TK),
                a1 = in(reg) ap.add(16 * pairs + q * TK),
                b0 = in(reg) bp.add(q * TK * NR),
                b1 = in(reg) bp.add(q * TK * NR + 16),
                sa = in(reg) sa,
                sb = in(reg) sb,
                options(nostack, readonly),
            );
        }
        asm!(
            "tilestored [{o0} + {so}*1], tmm0",
            "tilestored [{o1} + {so}*1], tmm1",
            "tilestored [{o2} + {so}*1], tmm2",
            "tilestored [{o3} + {so}*1], tmm3",
            o0 = in(reg) o0,
            o1 = in(reg) o1,
            o2 = in(reg) o2,
            o3 = in(reg) o3,
            so = in(reg) so,
            options(nostack),
        );
    }
}

/// `iters` rounds of four independent `tdpbf16ps` (16x16 fp32 += 16x32 by 32x16 bf16 each) on
/// tiles held in registers, for the bf16 peak ([`super::peak`]); zeros in, zeros out.
///
/// # Safety
/// As [`amx_config`].
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn amx_chains(iters: usize) {
    use std::arch::asm;
    // SAFETY: as the caller guarantees; register-only tile operations between configure and release.
    unsafe {
        amx_config();
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem)
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem)
            );
        }
        amx_release();
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn amx_chains(_: usize) {
    unreachable!("AMX on a CPU without it")
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn amx_config() {
    unreachable!("AMX on a CPU without it")
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn amx_release() {}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn amx_block(_: usize, _: *const u32, _: *const u32, _: *mut f32, _: usize, _: bool) {
    unreachable!("AMX on a CPU without it")
}

/// The 12x32 register tile over `pairs` pairs of k.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(pairs: usize, ap: *const u32, bp: *const u32, c: *mut f32, ldc: isize, acc: bool, bias: *const f32) {
    use std::arch::x86_64::*;
    // SAFETY: the panels hold `pairs` pairs (MR and NR values each); C's tile is MR rows of NR
    // writable floats at stride ldc; a non-null bias has NR floats.
    unsafe {
        let mut s = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..pairs {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(p * NR) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(p * NR + 16) as *const _));
            for (i, row) in s.iter_mut().enumerate() {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(p * MR + i) as i32));
                row[0] = _mm512_dpbf16_ps(row[0], a, b0);
                row[1] = _mm512_dpbf16_ps(row[1], a, b1);
            }
        }
        for (i, row) in s.iter().enumerate() {
            let ci = c.offset(i as isize * ldc);
            for (h, v) in row.iter().enumerate() {
                let at = ci.add(16 * h);
                let v = if acc {
                    _mm512_add_ps(_mm512_loadu_ps(at), *v)
                } else if bias.is_null() {
                    *v
                } else {
                    _mm512_add_ps(*v, _mm512_loadu_ps(bias.add(16 * h)))
                };
                _mm512_storeu_ps(at, v);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: usize, _: *const u32, _: *const u32, _: *mut f32, _: isize, _: bool, _: *const f32) {
    unreachable!("bgemm's AVX512_BF16 tile on a CPU without it")
}

/// A denormal as zero of its sign (`vdpbf16ps` reads its inputs and flushes its results so).
#[inline(always)]
fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// One lane of `vdpbf16ps`: `acc` plus the products of a pair of bf16 (packed as in the panels),
/// the high half's first, each added with one rounding (an FMA: the product of two bf16 is
/// exact in fp32), denormal inputs as zero and denormal results flushed.
#[inline(always)]
fn dot_pair(acc: f32, a: u32, b: u32) -> f32 {
    let half = |x: u32, hi: bool| flush(from_bf16(if hi { (x >> 16) as u16 } else { x as u16 }));
    let acc = flush(half(a, true).mul_add(half(b, true), flush(acc)));
    flush(half(a, false).mul_add(half(b, false), acc))
}

/// The 12x32 tile in portable code, the same bits as [`kernel`].
unsafe fn kernel_portable(
    pairs: usize,
    ap: *const u32,
    bp: *const u32,
    c: *mut f32,
    ldc: isize,
    acc: bool,
    bias: *const f32,
) {
    // SAFETY: as [`kernel`]'s.
    unsafe {
        let mut s = [[0f32; NR]; MR];
        for p in 0..pairs {
            let b = std::slice::from_raw_parts(bp.add(p * NR), NR);
            for (i, row) in s.iter_mut().enumerate() {
                let a = *ap.add(p * MR + i);
                for (x, &bj) in row.iter_mut().zip(b) {
                    *x = dot_pair(*x, a, bj);
                }
            }
        }
        for (i, row) in s.iter().enumerate() {
            let ci = c.offset(i as isize * ldc);
            for (j, &v) in row.iter().enumerate() {
                *ci.add(j) = if acc {
                    *ci.add(j) + v
                } else if bias.is_null() {
                    v
                } else {
                    v + *bias.add(j)
                };
            }
        }
    }
}

/// Round fp32 to bf16 (nearest even; a NaN stays a NaN), as bit patterns.
pub fn to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Widen bf16 bits to fp32 (exact).
pub fn from_bf16(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::TestRng;

    /// The vector packers (AMX's, and vdpbf16ps's A panels: whole panels take the AVX-512
    /// paths) fill their panels exactly as element-by-element packing does: B read through a transpose and row-major, A row-major
    /// and through a transpose; k blocks with and without an odd value, shorter and longer than
    /// the 16-pair vector blocks, at odd offsets.
    #[test]
    fn vector_packers_match_element_by_element_packing() {
        if super::super::simd::isa() != super::super::simd::Isa::Avx512 {
            eprintln!("SKIPPED vector_packers_match_element_by_element_packing: the kernels are not AVX-512 here");
            return;
        }
        let (rows, cols) = (70, 69); // the stored matrix; panels start at odd offsets in it
        let mut r = TestRng(5);
        let m: Vec<u16> = r.vec(rows * cols).iter().map(|&x| to_bf16(x)).collect();
        for (pc, kend) in [(1usize, 2usize), (3, 36), (5, 38), (0, 64), (1, 66), (2, 69)] {
            let pairs = (kend - pc).div_ceil(2).next_multiple_of(TK);
            // B (k, n): k indexes the stored rows (row-major, cs = 1) or the stored columns
            // (read through a transpose, rs = 1); a panel of NR columns from j0.
            for (b, j0) in [
                (View { ptr: m.as_ptr(), rs: cols as isize, cs: 1 }, 7),
                (View { ptr: m.as_ptr(), rs: 1, cs: cols as isize }, 3),
            ] {
                let (mut got, mut want) = (vec![u32::MAX; NR * pairs], vec![u32::MAX; NR * pairs]);
                // SAFETY: the panel's k values pc..kend and columns j0..j0+NR lie inside m;
                // both buffers hold NR*pairs values; the kernels are AVX-512 (checked above).
                unsafe {
                    pack_b_fast(pairs, pc, kend, j0, j0 + NR, b, got.as_mut_ptr());
                    pack_b(pairs, pc, kend, j0, j0 + NR, b, want.as_mut_ptr());
                }
                assert!(got == want, "pack_b_fast: k {pc}..{kend}, strides ({}, {})", b.rs, b.cs);
            }
            // A (m, k): row-major (cs = 1) or read through a transpose (rs = 1); MR_AMX rows from i0.
            for (a, i0) in [
                (View { ptr: m.as_ptr(), rs: cols as isize, cs: 1 }, 5),
                (View { ptr: m.as_ptr(), rs: 1, cs: cols as isize }, 9),
            ] {
                let mut got = vec![u32::MAX; MR_AMX * pairs];
                // SAFETY: as above, for rows i0..i0+MR_AMX.
                unsafe { pack_a_rows(pairs, pc, kend, i0, i0 + MR_AMX, a, got.as_mut_ptr()) };
                for i in 0..MR_AMX {
                    for p in 0..pairs {
                        let (kk, row) = (pc + 2 * p, i0 + i);
                        // SAFETY: get() reads only inside rows ..i0+MR_AMX and k values ..kend.
                        let want = unsafe {
                            a.get(row, kk, i0 + MR_AMX, kend) | (a.get(row, kk + 1, i0 + MR_AMX, kend) << 16)
                        };
                        assert_eq!(
                            got[i * pairs + p],
                            want,
                            "pack_a_rows: k {pc}..{kend}, strides ({}, {}), row {i} pair {p}",
                            a.rs,
                            a.cs
                        );
                    }
                }
                // vdpbf16ps's A panels: MR rows, exactly the block's pairs.
                let pairs = (kend - pc).div_ceil(2);
                let (mut got, mut want) = (vec![u32::MAX; MR * pairs], vec![u32::MAX; MR * pairs]);
                // SAFETY: as above, for rows i0..i0+MR; both buffers hold MR*pairs values.
                unsafe {
                    pack_a_fast(pairs, pc, kend, i0, i0 + MR, a, got.as_mut_ptr());
                    pack_a(pairs, pc, kend, i0, i0 + MR, a, want.as_mut_ptr());
                }
                assert!(got == want, "pack_a_fast: k {pc}..{kend}, strides ({}, {})", a.rs, a.cs);
            }
        }
    }

    /// Against f64 sums of the same bf16-rounded inputs, on edge shapes (1, odd, not a multiple
    /// of the tile, past a k block, a column block), every layout of A and B, with and without
    /// accumulation and bias; and the same bits for any thread count. The bound is fp32
    /// accumulation's: k additions, each rounding at most half an ulp of the running sum, so
    /// |c - exact| <= k * 2^-24 * sum |a b| (the products are exact). Both tiles, the portable
    /// one everywhere and `vdpbf16ps` where the CPU has it, and the two give the same bits.
    #[test]
    fn matches_f64_on_bf16_inputs_and_any_thread_count() {
        let mut engines = vec![Engine::Portable];
        for (e, what) in [(Engine::Dpbf16, "AVX512_BF16"), (Engine::Amx, "AMX-BF16 (with the OS's permission)")] {
            if runs(e) {
                engines.push(e);
            } else {
                eprintln!("SKIPPED bgemm's {} tiles: this host has no {what} (or the kernels are held below AVX-512); the others are tested", e.name());
            }
        }
        for &(m, n, k) in
            &[(1, 1, 1), (1, 33, 7), (13, 31, 2), (12, 32, 385), (25, 70, 131), (300, 65, 800), (7, 2100, 9)]
        {
            let mut r = TestRng((m * 1000 + n * 10 + k) as u64);
            let a: Vec<u16> = r.vec(m * k).iter().map(|&x| to_bf16(x)).collect();
            let b: Vec<u16> = r.vec(k * n).iter().map(|&x| to_bf16(x)).collect();
            let bias = r.vec(n);
            for (a_t, b_t, accumulate, with_bias) in [
                (false, false, false, false),
                (true, false, false, true),
                (false, true, true, false),
                (true, true, false, true),
            ] {
                // A as (m, k) row-major, or read through its transpose; B likewise.
                let (a_st, b_st) = (
                    if a_t { (1, m as isize) } else { (k as isize, 1) },
                    if b_t { (1, k as isize) } else { (n as isize, 1) },
                );
                let start = r.vec(m * n);
                let mut want = vec![0f64; m * n];
                let mut scale = vec![0f64; m * n];
                for i in 0..m {
                    for j in 0..n {
                        let (mut s, mut mag) = (0f64, 0f64);
                        for p in 0..k {
                            let x = from_bf16(a[(i as isize * a_st.0 + p as isize * a_st.1) as usize]) as f64;
                            let y = from_bf16(b[(p as isize * b_st.0 + j as isize * b_st.1) as usize]) as f64;
                            s += x * y;
                            mag += (x * y).abs();
                        }
                        let base = if accumulate {
                            start[i * n + j] as f64
                        } else if with_bias {
                            bias[j] as f64
                        } else {
                            0.0
                        };
                        want[i * n + j] = s + base;
                        scale[i * n + j] = mag + base.abs();
                    }
                }
                // The first result of each engine; vdpbf16ps and the portable tiles share one.
                let mut first: [Option<Vec<f32>>; 2] = [None, None];
                for (threads, &engine) in [1, 2, 3].into_iter().flat_map(|t| engines.iter().map(move |e| (t, e))) {
                    let name = engine.name();
                    let mut c = start.clone();
                    let bp = if with_bias { bias.as_ptr() } else { std::ptr::null() };
                    // SAFETY: the strides address (m, k), (k, n) and (m, n) inside the vectors;
                    // an engine is in the list only where the host runs it.
                    unsafe {
                        bgemm_on(
                            engine,
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            n as isize,
                            accumulate,
                            bp,
                            a.as_ptr(),
                            a_st,
                            b.as_ptr(),
                            b_st,
                            threads,
                        )
                    };
                    for (idx, (&got, (&w, &s))) in c.iter().zip(want.iter().zip(&scale)).enumerate() {
                        let bound = (k + 2) as f64 * 6e-8 * s + 1e-30;
                        assert!(
                            (got as f64 - w).abs() <= bound,
                            "{name} m={m} n={n} k={k} {idx}: {got} vs {w} (bound {bound})"
                        );
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let first = &mut first[(engine == Engine::Amx) as usize];
                    match first {
                        None => *first = Some(c),
                        Some(f) => {
                            assert!(
                                bits(f) == bits(&c),
                                "m={m} n={n} k={k}: {name} on {threads} threads gave other bits"
                            )
                        }
                    }
                }
            }
        }
    }

    /// `vdpbf16ps`'s rules where they show: products that round, denormal bf16 inputs (read as
    /// zero), sums that cancel to denormals (flushed), a wide range of exponents; the portable
    /// tile must give the instruction's bits.
    #[test]
    fn portable_tile_gives_the_instructions_bits() {
        if !available() {
            eprintln!("SKIPPED portable_tile_gives_the_instructions_bits: this CPU has no AVX512_BF16 to compare with");
            return;
        }
        let (m, n, k) = (MR, NR, 301);
        let mut r = TestRng(7);
        let denormal = |x: f32| (x.to_bits() >> 16) as u16 & 0x807F | 0x0001;
        let mut cases: Vec<(&str, Vec<u16>, Vec<u16>)> = vec![];
        // Mixed: a denormal in every seventh input, tiny, huge and plain values.
        let pick = |i: usize, r: &mut TestRng| -> u16 {
            let x = r.vec(1)[0];
            match i % 7 {
                0 => denormal(x),
                1 => to_bf16(x * 1e-20),
                2 => to_bf16(x * 1e15),
                _ => to_bf16(x),
            }
        };
        let a: Vec<u16> = (0..m * k).map(|i| pick(i, &mut r)).collect();
        let b: Vec<u16> = (0..k * n).map(|i| pick(i / 3, &mut r)).collect();
        cases.push(("mixed", a, b));
        // Denormal A against huge B: read as zero, the products vanish (else ~1e-9).
        let a: Vec<u16> = r.vec(m * k).iter().map(|&x| denormal(x)).collect();
        let b: Vec<u16> = r.vec(k * n).iter().map(|&x| to_bf16(x * 1e30)).collect();
        cases.push(("denormal inputs", a, b));
        // Tiny A and B: the products and sums are fp32 denormals, flushed to zero.
        let a: Vec<u16> = r.vec(m * k).iter().map(|&x| to_bf16(x * 1e-20)).collect();
        let b: Vec<u16> = r.vec(k * n).iter().map(|&x| to_bf16(x * 1e-20)).collect();
        cases.push(("denormal results", a, b));
        for (what, a, b) in cases {
            let run = |engine: Engine| {
                let mut c = vec![0f32; m * n];
                // SAFETY: (m, k), (k, n), (m, n) row-major inside the vectors; `kernel` only here,
                // where the CPU has AVX512_BF16.
                unsafe {
                    bgemm_on(
                        engine,
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        n as isize,
                        false,
                        std::ptr::null(),
                        a.as_ptr(),
                        (k as isize, 1),
                        b.as_ptr(),
                        (n as isize, 1),
                        1,
                    )
                };
                c
            };
            let (hw, port) = (run(Engine::Dpbf16), run(Engine::Portable));
            for (i, (x, y)) in hw.iter().zip(&port).enumerate() {
                assert!(
                    x.to_bits() == y.to_bits(),
                    "{what}: element {i}: vdpbf16ps {x:e} ({:#x}), portable {y:e} ({:#x})",
                    x.to_bits(),
                    y.to_bits()
                );
            }
        }
    }
}

//! The machine's fp32 peak, measured on the CPU backend's own threads, for `llmrs bench`'s MFU.

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
/// Ten independent chains of 8-wide FMAs: enough in flight to keep both FMA units busy.
/// SAFETY: callers check that the CPU has AVX2 and FMA.
pub(crate) unsafe fn fma_chains(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); 10];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0f32; 8];
    let s = acc.iter().fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, *x));
    // SAFETY: `out` has room for 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
/// [`fma_chains`] with 16-wide FMAs and twelve chains (32 registers leave room for more in flight).
/// SAFETY: callers check that the CPU has AVX-512F.
pub(crate) unsafe fn fma_chains_512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let s = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
/// Twelve independent chains of `vdpbf16ps` (16 lanes, two multiply-adds each), as
/// [`fma_chains_512`]. SAFETY: callers check that the CPU has AVX512_BF16.
pub(crate) unsafe fn dpbf16_chains(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: register-only operations; the bf16 pairs are 1.0 (0x3F80) and a tiny 2^-20.
    unsafe {
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3F80_3F80));
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3580_3580));
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        let s = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        _mm512_reduce_add_ps(s)
    }
}

/// The machine's bf16 peak for the tiles the bf16 GEMMs run on ([`super::bgemm::model_engine`]):
/// AMX's ([`measure_amx`]) or `vdpbf16ps`'s ([`measure_dpbf16`]). Returns (GFLOP/s, method), or
/// None where the bf16 GEMMs widen to fp32 (their peak is fp32's).
pub fn measure_bf16() -> Option<(f64, String)> {
    use super::bgemm::Engine;
    match super::bgemm::model_engine()? {
        Engine::Amx => measure_amx(),
        Engine::Dpbf16 => measure_dpbf16(),
        Engine::Portable => None,
    }
}

/// AMX's bf16 peak where the host runs AMX: four independent `tdpbf16ps` per round (16x16x32
/// multiply-adds each) on every thread of the team, the best of several trials.
pub fn measure_amx() -> Option<(f64, String)> {
    if !super::bgemm::amx_available() {
        return None;
    }
    let (threads, iters) = (super::team::threads(), 200_000);
    let mut best = 0f64;
    for _ in 0..8 {
        let t0 = Instant::now();
        super::team::broadcast(&|_| {
            // SAFETY: amx_available() showed the host runs AMX.
            unsafe { super::bgemm::amx_chains(iters) };
        });
        let flops = (threads * iters * 4 * 16 * 16 * 32 * 2) as f64;
        best = best.max(flops / t0.elapsed().as_secs_f64());
    }
    Some((best / 1e9, format!("AMX tdpbf16ps loop on {threads} threads")))
}

/// The machine's `vdpbf16ps` peak where it has AVX512_BF16: a loop on every thread of the
/// team (32 multiply-adds per instruction), the best of several trials as [`measure`].
pub fn measure_dpbf16() -> Option<(f64, String)> {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")) {
            return None;
        }
        let (threads, iters) = (super::team::threads(), 20_000_000);
        let mut best = 0f64;
        for _ in 0..8 {
            let t0 = Instant::now();
            super::team::broadcast(&|_| {
                // SAFETY: AVX512_BF16 was detected above.
                std::hint::black_box(unsafe { dpbf16_chains(iters) });
            });
            let flops = (threads * iters * 12 * 32 * 2) as f64;
            best = best.max(flops / t0.elapsed().as_secs_f64());
        }
        Some((best / 1e9, format!("AVX512_BF16 vdpbf16ps loop on {threads} threads")))
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The machine's fp32 peak, measured: an FMA loop on every thread of the team where AVX2+FMA
/// exist, else the best of a few large GEMMs. Returns (GFLOP/s, method). The best of several
/// short trials: on a shared or virtual machine a trial in which one thread lost its core for a
/// moment reads as half the peak, and a low peak would flatter the MFU.
pub fn measure() -> (f64, String) {
    let threads = super::team::threads();
    // The widest FMA the CPU has, whatever the kernels were told to use: the peak is the
    // machine's, and MFU says how much of it a step uses.
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma");
        if avx512 || (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            let iters = 20_000_000;
            let (chains, lanes) = if avx512 { (12, 16) } else { (10, 8) };
            let mut best = 0f64;
            for _ in 0..8 {
                let t0 = Instant::now();
                // The same threads as the training step's loops (see cpu::team).
                super::team::broadcast(&|_| {
                    // SAFETY: the features each loop needs were detected above.
                    let r = unsafe {
                        if avx512 {
                            fma_chains_512(iters)
                        } else {
                            fma_chains(iters)
                        }
                    };
                    std::hint::black_box(r);
                });
                let flops = (threads * iters * chains * lanes * 2) as f64;
                best = best.max(flops / t0.elapsed().as_secs_f64());
            }
            let isa = if avx512 { "AVX-512" } else { "AVX2" };
            return (best / 1e9, format!("{isa} FMA loop on {threads} threads"));
        }
    }
    let n = 1024;
    let (a, b) = (vec![1.0f32; n * n], vec![0.5f32; n * n]);
    let mut c = vec![0f32; n * n];
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        super::gemm::gemm_strided(n, n, n, &mut c, (n as isize, 1), false, &a, (n as isize, 1), &b, (n as isize, 1));
        best = best.max(2.0 * (n * n * n) as f64 / t0.elapsed().as_secs_f64());
    }
    (best / 1e9, format!("{n}^3 GEMM on {threads} threads"))
}

//! The instruction set the CPU kernels run with, chosen once at start-up from what the CPU has,
//! so that one binary runs at full speed on every x86-64 host (no `target-cpu=native`).
//!
//! The GEMM has its own hand-written AVX2+FMA kernel ([`super::sgemm`]). The elementwise and
//! reduction loops (GELU, softmax, LayerNorm, cross-entropy, AdamW, the gradient norm) are
//! plain Rust written for the auto-vectoriser; [`with_isa`] compiles such a loop once per
//! instruction set and runs the version the CPU supports. Every version sums in the same order
//! (8 fixed lanes, see [`super::math`]) and uses only correctly rounded operations, so all give
//! bit-identical results; `tests/thread_count.rs` checks it on the paths the host can run.
//!
//! `LLMRS_CPU_ISA=avx512|avx2|portable` forces a path (for tests and comparisons); asking for
//! one the CPU lacks is refused at start-up. `portable` also turns the packed GEMM off (the
//! `gemm` crate runs instead), for testing the path a CPU without AVX2 takes.

use std::sync::OnceLock;

/// Environment variable that forces the kernels' instruction set.
use crate::core::env::CPU_ISA;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 (F, BW, DQ, VL) with FMA: 16-wide vectors.
    Avx512,
    /// AVX2 with FMA: 8-wide vectors.
    Avx2,
    /// Baseline x86-64 (SSE2) or another architecture's baseline.
    Portable,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Avx512 => {
                    has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has!("fma")
                }
                Isa::Avx2 => has!("avx2") && has!("fma"),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// The widest instruction set this CPU has, from the best down.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2, Isa::Portable].into_iter().find(|i| i.supported()).unwrap_or(Isa::Portable)
    }
}

impl std::str::FromStr for Isa {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Isa> {
        Ok(match s {
            "avx512" => Isa::Avx512,
            "avx2" => Isa::Avx2,
            "portable" => Isa::Portable,
            _ => anyhow::bail!("{CPU_ISA}={s}: use avx512, avx2 or portable"),
        })
    }
}

/// Whether the CPU is AMD's (some kernels choose between paths measured per vendor). Asked once.
pub fn is_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)]
            // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
            let r = unsafe { std::arch::x86_64::__cpuid(0) };
            let mut v = [0u8; 12];
            v[..4].copy_from_slice(&r.ebx.to_le_bytes());
            v[4..8].copy_from_slice(&r.edx.to_le_bytes());
            v[8..].copy_from_slice(&r.ecx.to_le_bytes());
            &v == b"AuthenticAMD"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

static CHOSEN: OnceLock<Isa> = OnceLock::new();

/// Choose the instruction set: `$LLMRS_CPU_ISA` if set (it must be one the CPU has), else the
/// widest the CPU has. Called at start-up so that a bad setting is an error, not a panic in a
/// kernel; [`isa`] falls back to detection if it was not called.
pub fn init() -> anyhow::Result<Isa> {
    let want = choose()?;
    Ok(*CHOSEN.get_or_init(|| want))
}

/// The instruction set [`init`] settles on (without touching `CHOSEN`: [`isa`] calls this
/// from inside its initialisation).
fn choose() -> anyhow::Result<Isa> {
    Ok(match crate::core::env::text(CPU_ISA) {
        Some(s) => {
            let isa: Isa = s.parse()?;
            if !isa.supported() {
                anyhow::bail!("{CPU_ISA}={s}: this CPU does not have {s} (it has {})", Isa::detect().name());
            }
            isa
        }
        _ => Isa::detect(),
    })
}

/// The instruction set the kernels use.
#[inline]
pub fn isa() -> Isa {
    *CHOSEN.get_or_init(|| choose().unwrap_or_else(|_| Isa::detect()))
}

/// Run `f` compiled for the chosen instruction set. `f` must be a closure that the compiler
/// can inline (a loop over slices, calling only `#[inline(always)]` helpers): it is compiled
/// into each of the `#[target_feature]` trampolines below and vectorised there.
#[inline(always)]
pub fn with_isa<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match isa() {
        // SAFETY: isa() only returns an instruction set the CPU supports (Isa::supported).
        Isa::Avx512 => unsafe { avx512(f) },
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2(f) },
        Isa::Portable => f(),
    }
    #[cfg(not(target_arch = "x86_64"))]
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
#[inline]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Define a function compiled once per instruction set and dispatched on [`isa`] at each call.
/// The body goes into an `#[inline(always)]` function that is inlined into `#[target_feature]`
/// copies, so the loops in it are vectorised for AVX-512 and AVX2 (a closure handed to
/// [`with_isa`] is not always inlined into the trampoline, and then runs as baseline code).
/// Arguments are plain `name: Type` pairs; keep such functions at the level of a row or a
/// chunk, where the dispatch (one load and a branch) is noise.
#[macro_export]
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            match $crate::backend::cpu::simd::isa() {
                // SAFETY: isa() returns only instruction sets this CPU has (Isa::supported).
                #[cfg(target_arch = "x86_64")]
                $crate::backend::cpu::simd::Isa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                $crate::backend::cpu::simd::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chosen_isa_is_one_the_cpu_has() {
        assert!(isa().supported());
        assert!(Isa::Portable.supported());
        assert!("avx9".parse::<Isa>().is_err());
        for i in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            assert_eq!(i.name().parse::<Isa>().unwrap(), i);
        }
        // The trampolines run their closure and return its value on every path.
        assert_eq!(with_isa(|| (1..=10).sum::<i32>()), 55);
        crate::simd_fn! {
            fn dot3(a: &[f32], b: &[f32]) -> f32 {
                a.iter().zip(b).map(|(x, y)| x * y).sum()
            }
        }
        assert_eq!(dot3(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
    }
}

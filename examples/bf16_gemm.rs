//! The bf16 GEMM (`vdpbf16ps`, src/cpu/bgemm.rs) against the fp32 GEMM (src/cpu/sgemm.rs) on
//! the training step's GEMM shapes, interleaved, on hosts with AVX512_BF16; with both peaks
//! (an FMA loop and a `vdpbf16ps` loop) measured the same way.
//! `cargo run --release --example bf16_gemm -- [ROUNDS] [THREADS]`
use llmrs::cpu::{bgemm, peak, sgemm};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map_or(Ok(5), |s| s.parse())?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    llmrs::backend::factory::init_host()?;
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    if !bgemm::available() {
        println!("SKIPPED: this CPU has no AVX512_BF16 (or LLMRS_CPU_ISA holds the kernels below AVX-512)");
        return Ok(());
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu.lines().find(|l| l.starts_with("model name")).unwrap_or("model name: ?");
    let family = cpu.lines().find(|l| l.starts_with("cpu family")).unwrap_or("cpu family: ?");
    println!("{model}; {family}; {threads} threads");
    let (fp32, how32) = peak::measure();
    let (bf16, how16) = peak::measure_bf16().expect("AVX512_BF16 detected");
    println!("peak fp32 {fp32:.1} GFLOP/s ({how32}); bf16 {bf16:.1} GFLOP/s ({how16}); ratio {:.2}", bf16 / fp32);
    // GPT-2 124M at B=4, T=64 (N = 256): the forward's shapes (out = x @ W^T).
    for &(name, m, n, k) in
        &[("qkv", 256, 2304, 768), ("fc", 256, 3072, 768), ("fcproj", 256, 768, 3072), ("head", 256, 50304, 768)]
    {
        let a32: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let w32: Vec<f32> = (0..n * k).map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5).collect();
        let (a16, w16): (Vec<u16>, Vec<u16>) =
            (a32.iter().map(|&x| bgemm::to_bf16(x)).collect(), w32.iter().map(|&x| bgemm::to_bf16(x)).collect());
        let mut c = vec![0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let tile = sgemm::Tile::for_rows(m);
        let mut time = |bf: bool| -> f64 {
            let reps = 5;
            let t0 = Instant::now();
            for _ in 0..reps {
                // SAFETY: (m, k) and (n, k) row-major inputs read through W^T, (m, n) output; the
                // CPU's features were checked above (and sgemm's by init_host).
                unsafe {
                    if bf {
                        bgemm::bgemm(
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            n as isize,
                            false,
                            std::ptr::null(),
                            a16.as_ptr(),
                            (k as isize, 1),
                            w16.as_ptr(),
                            (1, k as isize),
                            threads,
                        )
                    } else {
                        sgemm::sgemm(
                            tile,
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            (n as isize, 1),
                            false,
                            std::ptr::null(),
                            a32.as_ptr(),
                            (k as isize, 1),
                            w32.as_ptr(),
                            (1, k as isize),
                            threads,
                        )
                    }
                }
            }
            flops * reps as f64 / t0.elapsed().as_secs_f64() / 1e9
        };
        time(true);
        time(false);
        let (mut r16, mut r32) = (vec![], vec![]);
        for _ in 0..rounds {
            r16.push(time(true));
            r32.push(time(false));
        }
        let mut ratios: Vec<f64> = r16.iter().zip(&r32).map(|(a, b)| a / b).collect();
        ratios.sort_by(f64::total_cmp);
        let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
        println!(
            "{name:7} ({m}x{n}x{k}): bf16 {} GFLOP/s; fp32 {} GFLOP/s; bf16/fp32 median {:.2} ({:.2}-{:.2})",
            fmt(&r16),
            fmt(&r32),
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
    }
    Ok(())
}

//! The bf16 GEMM's engines (src/backend/cpu/bgemm.rs: AMX's `tdpbf16ps`, AVX512_BF16's `vdpbf16ps`)
//! against the fp32 GEMM (src/backend/cpu/sgemm.rs) on GPT-2 124M's training-step GEMM shapes at B=4,
//! T=64 (forward, and the backward's two layouts), interleaved, with the peaks (an FMA loop and
//! a `vdpbf16ps` loop) measured the same way. Engines the host cannot run are named and skipped.
//! `cargo run --release --example bf16_gemm -- [ROUNDS] [THREADS]`
use llmrs::backend::cpu::bgemm::{self, Engine};
use llmrs::backend::cpu::{peak, sgemm};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map_or(Ok(5), |s| s.parse())?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    llmrs::backend::factory::init_host()?;
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu.lines().find(|l| l.starts_with("model name")).unwrap_or("model name: ?");
    let family = cpu.lines().find(|l| l.starts_with("cpu family")).unwrap_or("cpu family: ?");
    println!("{model}; {family}; {threads} threads");
    let engines: Vec<Engine> = [Engine::Amx, Engine::Dpbf16].into_iter().filter(|&e| bgemm::runs(e)).collect();
    for e in [Engine::Amx, Engine::Dpbf16] {
        if !bgemm::runs(e) {
            println!("SKIPPED {}: this host cannot run it", e.name());
        }
    }
    let (fp32, how32) = peak::measure();
    match peak::measure_bf16() {
        Some((bf16, how16)) => {
            println!(
                "peak fp32 {fp32:.1} GFLOP/s ({how32}); bf16 {bf16:.1} GFLOP/s ({how16}); ratio {:.2}",
                bf16 / fp32
            )
        }
        None => println!("peak fp32 {fp32:.1} GFLOP/s ({how32}); no AVX512_BF16"),
    }
    // (name, m, n, k, A's strides, B's strides) as the matmuls call them: forward out = x @ W^T
    // (B = W^T: row stride 1), dinp = dout @ W (B row-major), dW = dout^T @ x (A transposed).
    let c = 768isize;
    type Shape = (&'static str, usize, usize, usize, (isize, isize), (isize, isize));
    let shapes: Vec<Shape> = vec![
        ("qkv fwd", 256, 2304, 768, (c, 1), (1, c)),
        ("fc fwd", 256, 3072, 768, (c, 1), (1, c)),
        ("proj fwd", 256, 768, 3072, (4 * c, 1), (1, 4 * c)),
        ("head fwd", 256, 50304, 768, (c, 1), (1, c)),
        ("qkv dinp", 256, 768, 2304, (3 * c, 1), (c, 1)),
        ("qkv dW", 2304, 768, 256, (1, 3 * c), (c, 1)),
        ("head dW", 50304, 768, 256, (1, 50304), (c, 1)),
    ];
    for (name, m, n, k, a_st, b_st) in shapes {
        let a32: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let b32: Vec<f32> = (0..n * k).map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5).collect();
        let (a16, b16): (Vec<u16>, Vec<u16>) =
            (a32.iter().map(|&x| bgemm::to_bf16(x)).collect(), b32.iter().map(|&x| bgemm::to_bf16(x)).collect());
        let mut c = vec![0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let tile = sgemm::Tile::for_rows(m);
        // None: fp32 on f32 operands; Some(e): engine e on bf16 operands.
        let mut time = |e: Option<Engine>| -> f64 {
            let reps = 3;
            let t0 = Instant::now();
            for _ in 0..reps {
                // SAFETY: the strides address (m, k), (k, n) inside the operands and (m, n) row-major
                // inside c; each engine runs on this host (checked above), sgemm's ISA by init_host.
                unsafe {
                    match e {
                        Some(e) => bgemm::bgemm_on(
                            e,
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            n as isize,
                            false,
                            std::ptr::null(),
                            a16.as_ptr(),
                            a_st,
                            b16.as_ptr(),
                            b_st,
                            threads,
                        ),
                        None => sgemm::sgemm(
                            tile,
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            (n as isize, 1),
                            false,
                            std::ptr::null(),
                            a32.as_ptr(),
                            a_st,
                            b32.as_ptr(),
                            b_st,
                            threads,
                        ),
                    }
                }
            }
            flops * reps as f64 / t0.elapsed().as_secs_f64() / 1e9
        };
        let runs: Vec<Option<Engine>> = std::iter::once(None).chain(engines.iter().map(|&e| Some(e))).collect();
        for &r in &runs {
            time(r);
        }
        let mut got = vec![vec![]; runs.len()];
        for _ in 0..rounds {
            for (i, &r) in runs.iter().enumerate() {
                got[i].push(time(r));
            }
        }
        let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
        let mut line = format!("{name:9} ({m}x{n}x{k}): fp32 {} GFLOP/s", fmt(&got[0]));
        for (i, e) in engines.iter().enumerate() {
            let mut ratios: Vec<f64> = got[i + 1].iter().zip(&got[0]).map(|(a, b)| a / b).collect();
            ratios.sort_by(f64::total_cmp);
            line += &format!("; {} {} (x{:.2} median)", e.name(), fmt(&got[i + 1]), ratios[ratios.len() / 2]);
        }
        println!("{line}");
    }
    Ok(())
}

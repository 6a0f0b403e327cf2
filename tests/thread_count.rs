//! Results depend neither on the number of threads nor on the kernels' instruction set. Both
//! are fixed per process (the team's size by `RAYON_NUM_THREADS`, the instruction set by
//! `LLMRS_CPU_ISA`), so the test runs itself again as child processes with 1, 2, 3 and 4
//! threads, and with each vector instruction set this CPU has (AVX-512, AVX2), and compares
//! bit-exact digests of: GEMMs shaped to take each of the packed GEMM's parallel splits
//! (column parts, shared A, shared B), in f32 and in bf16, and two training steps of a small
//! model in fp32 and in bf16 (every op of forward, backward and AdamW). The portable path computes its GEMMs with another library,
//! so it is checked against the references instead (CI runs the suite with it).
//! bf16 x bf16 products run on the host's bf16 tiles where it has them (AMX, or `vdpbf16ps`:
//! `LLMRS_BF16_GEMM`), which sum in another order: the bf16 digests are compared between runs
//! on the same tiles, and a child widening bf16 on the widest instruction set (where the default
//! is a tile engine) ties those to the AVX2 child's.

use llmrs::backend::cpu::simd::Isa;
use llmrs::backend::cpu::wide::{Dest, Operand};
use llmrs::backend::Device;
use llmrs::core::config::{ModelConfig, Precision};
use llmrs::core::params::Weights;
use llmrs::model::optim::OptimConfig;
use llmrs::model::optimizer_step;
use llmrs::model::{Model, Slot};
use std::process::Command;

const CHILD_ENV: &str = "LLMRS_THREAD_COUNT_CHILD";

/// FNV-1a over the values' bits.
fn digest(xs: &[f32]) -> u64 {
    xs.iter().fold(0xcbf29ce484222325u64, |h, x| (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3))
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The digests this process computes, one line each.
fn digests() -> Vec<String> {
    let mut out = vec![];
    // (m, n, k): narrow (column parts), wide with a shared A (past 2048 and 4096 columns), tall
    // with a shared B (also past 4096 columns), each with partial tiles.
    let shapes = [(97, 301, 270), (40, 2100, 800), (7, 4133, 30), (700, 50, 800), (5000, 4116, 3)];
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        let (a, w, bias) = (values(m * k, 3 * i as u64), values(n * k, 3 * i as u64 + 1), values(n, 3 * i as u64 + 2));
        // c = a @ w^T + bias (the forward's layout), then c += a @ w read as (k, n) row-major
        // (the input-gradient GEMMs' layout).
        let mut c = vec![0f32; m * n];
        llmrs::backend::cpu::matmul::matmul_forward((&mut c).into(), (&a).into(), (&w).into(), Some(&bias), m, k, n);
        let (ki, ni) = (k as isize, n as isize);
        llmrs::backend::cpu::gemm::gemm_strided(m, n, k, &mut c, (ni, 1), true, &a, (ki, 1), &w, (ni, 1));
        out.push(format!("gemm {m}x{n}x{k} {:016x}", digest(&c)));
    }
    // One position (the decode step's dot products), across the thread team's chunks.
    for (i, &(c, oc)) in [(37, 101), (768, 2304)].iter().enumerate() {
        let (x, w, bias) = (values(c, 40 + i as u64), values(oc * c, 50 + i as u64), values(oc, 60 + i as u64));
        let mut y = vec![0f32; oc];
        llmrs::backend::cpu::matmul::matmul_forward((&mut y).into(), (&x).into(), (&w).into(), Some(&bias), 1, c, oc);
        out.push(format!("gemv {c}x{oc} {:016x}", digest(&y)));
    }
    // bf16 operands and results (--precision bf16): one k block (rounded by the kernels as they
    // store) and several (through f32 windows), wide and tall.
    for (i, &(m, n, k)) in [(97, 301, 270), (40, 2100, 800), (5000, 300, 30)].iter().enumerate() {
        let (a, w) = (bf16(&values(m * k, 70 + i as u64)), bf16(&values(n * k, 80 + i as u64)));
        let mut c = bf16(&values(m * n, 90 + i as u64));
        let (x, wt) = (Operand::Bf16(&a), Operand::Bf16(&w));
        llmrs::backend::cpu::matmul::matmul_backward(None, Some(Dest::Bf16(&mut c)), None, x, wt, x, k, n, m, true);
        let c: Vec<f32> = c.iter().map(|x| f32::from_bits((*x as u32) << 16)).collect();
        out.push(format!("bf16 gemm {m}x{n}x{k} {:016x}", digest(&c)));
    }
    let cfg =
        ModelConfig { vocab_size: 1000, padded_vocab_size: 1024, ..ModelConfig::from_descriptor("2x64:4:64").unwrap() };
    let mut model = Model::new(Weights::random(cfg, 7).unwrap(), Device::Cpu).unwrap();
    model.alloc_training_state().unwrap();
    let (b, t) = (3, 37);
    let opt = OptimConfig::default();
    for step in 0..2 {
        let tokens: Vec<u32> = (0..b * t + 1).map(|i| ((i * 31 + step * 7) % 1000) as u32).collect();
        model.zero_grad().unwrap();
        model.forward(&tokens[..b * t], Some(&tokens[1..]), b, t).unwrap();
        model.backward(1.0).unwrap();
        let s = optimizer_step(&mut model, &opt, 1e-3, step).unwrap();
        out.push(format!("step {step} loss {:08x} norm {:08x}", s.loss.to_bits(), s.grad_norm.to_bits()));
    }
    for slot in [Slot::Params, Slot::Grads, Slot::AdamM, Slot::AdamV] {
        out.push(format!("{slot:?} {:016x}", digest(&model.read_all(slot).unwrap())));
    }
    // The same steps in bf16 (fp32 master weights): bf16 GEMMs, element-wise ops, stochastic
    // rounding of the working copy.
    let mut model = Model::new(Weights::random(cfg, 7).unwrap(), Device::Cpu).unwrap();
    model.set_precision(Precision::Bf16, true).unwrap();
    model.alloc_training_state().unwrap();
    for step in 0..2 {
        let tokens: Vec<u32> = (0..b * t + 1).map(|i| ((i * 31 + step * 7) % 1000) as u32).collect();
        model.zero_grad().unwrap();
        model.forward(&tokens[..b * t], Some(&tokens[1..]), b, t).unwrap();
        model.backward(1.0).unwrap();
        let s = optimizer_step(&mut model, &opt, 1e-3, step).unwrap();
        out.push(format!("bf16 step {step} loss {:08x} norm {:08x}", s.loss.to_bits(), s.grad_norm.to_bits()));
    }
    out.push(format!("bf16 working copy {:016x}", digest(&model.weights().unwrap().data)));
    out
}

/// Values rounded to bf16 (their bits).
fn bf16(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|x| llmrs::core::bf16::from_f32(*x)).collect()
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    if std::env::var_os(CHILD_ENV).is_some() {
        let threads = llmrs::backend::cpu::team::threads();
        println!("DIGEST threads={threads} isa {}", llmrs::backend::cpu::simd::init().unwrap().name());
        llmrs::backend::factory::init_host().unwrap();
        let engine = llmrs::backend::cpu::bgemm::model_engine().map_or("widen", |e| e.name());
        println!("DIGEST threads={threads} bf16 tiles {engine}");
        for d in digests() {
            println!("DIGEST threads={threads} {d}");
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut runs: Vec<(String, Vec<String>)> = vec![];
    let isas: Vec<Isa> = [Isa::Avx512, Isa::Avx2].into_iter().filter(|i| i.supported()).collect();
    if isas.len() < 2 {
        llmrs::testdata::skipped(
            "results_do_not_depend_on_the_thread_count (instruction sets)",
            &format!("this CPU has {} of AVX-512 and AVX2, so no two vector paths are compared", isas.len()),
        );
    }
    let default = isas.first().map_or("portable", |i| i.name());
    // (threads, instruction set, LLMRS_BF16_GEMM): the default tiles on 1-4 threads, the other
    // instruction set, and bf16 widened on the default one.
    let cases = [1, 2, 3, 4]
        .map(|t| (t, default, None))
        .into_iter()
        .chain(isas.iter().skip(1).map(|i| (2, i.name(), None)))
        .chain(std::iter::once((2, default, Some("widen"))));
    for (threads, isa, tiles) in cases {
        let mut cmd = Command::new(&exe);
        cmd.args(["results_do_not_depend_on_the_thread_count", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .env("RAYON_NUM_THREADS", threads.to_string())
            .env(llmrs::core::env::CPU_ISA, isa)
            .env_remove(llmrs::core::env::BF16_GEMM);
        if let Some(t) = tiles {
            cmd.env(llmrs::core::env::BF16_GEMM, t);
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "child with {threads} threads failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let prefix = format!("DIGEST threads={threads} ");
        // (The test harness prints "test ... " on the line of the first digest.)
        let lines: Vec<String> =
            text.lines().filter_map(|l| l.find(&prefix).map(|i| l[i + prefix.len()..].to_string())).collect();
        // The child really ran with its thread count, and said something about every case.
        assert_eq!(lines.len(), 2 + 5 + 2 + 3 + 2 + 4 + 2 + 1, "child with {threads} threads printed:\n{text}");
        assert_eq!(lines[0], format!("isa {isa}"), "the child did not run the instruction set asked for");
        if let Some(t) = tiles {
            assert_eq!(lines[1], format!("bf16 tiles {t}"), "the child did not run the bf16 tiles asked for");
        }
        runs.push((format!("{threads} threads, {isa}, {}", lines[1]), lines[1..].to_vec()));
    }
    // Every run against the first run on the same bf16 tiles (bf16 lines) or the first (the rest).
    for (name, lines) in &runs[1..] {
        let same_tiles = runs.iter().find(|(_, l)| l[0] == lines[0]).unwrap();
        for (i, b) in lines.iter().enumerate().skip(1) {
            let (first_name, first) = if b.starts_with("bf16") { same_tiles } else { &runs[0] };
            assert_eq!(&first[i], b, "{first_name} vs {name}");
        }
    }
    let engines: std::collections::BTreeSet<&str> = runs.iter().map(|(_, l)| l[0].as_str()).collect();
    eprintln!("thread_count: bf16 digests compared within each of {engines:?}");
}

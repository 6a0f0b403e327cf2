//! GFLOP/s of the GEMM shapes in a GPT-2 124M training step at B=4, T=64 (n = 256 rows), then
//! the forward GEMMs on one thread, alone and two side by side (one per core): what the cores
//! lose to each other through the shared cache and memory; last, the kernel on a block in
//! cache against the measured FMA peak.
//! `cargo run --release --example gemm_shapes` (`-- --json`: the first part only, as JSON, for
//! `scripts/bench_compare.py --gemm`; `-- --bf16`: each shape with f32 buffers and with bf16
//! ones, interleaved, as `--precision bf16` runs them)
use llmrs::backend::cpu::gemm::gemm_strided_serial;
use llmrs::backend::cpu::matmul::{matmul_backward, matmul_forward};
use llmrs::backend::cpu::wide::{Dest, Operand};
use std::time::Instant;

/// Best of a few runs, in seconds (this machine's noise only ever adds time).
fn best(f: &mut dyn FnMut()) -> f64 {
    f();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let n = 256;
    let shapes = [
        (768, 2304, "qkv"),
        (768, 768, "attn proj"),
        (768, 3072, "fc"),
        (3072, 768, "fc proj"),
        (768, 50304, "classifier"),
    ];
    let json = std::env::args().any(|a| a == "--json");
    if std::env::args().any(|a| a == "--bf16") {
        return bf16_vs_f32(n, &shapes);
    }
    let mut rows = vec![];
    if !json {
        println!("all threads ({}):", rayon::current_num_threads());
    }
    for (c, oc, name) in shapes {
        let inp = vec![0.01f32; n * c];
        let w = vec![0.02f32; oc * c];
        let b = vec![0.0f32; oc];
        let mut out = vec![0f32; n * oc];
        let (mut dinp, mut dw, mut db) = (vec![0f32; n * c], vec![0f32; oc * c], vec![0f32; oc]);
        let flops = 2.0 * (n * c * oc) as f64;
        let fwd = best(&mut || matmul_forward((&mut out).into(), (&inp).into(), (&w).into(), Some(&b), n, c, oc));
        let bwd = best(&mut || {
            matmul_backward(
                Some((&mut dinp).into()),
                Some((&mut dw).into()),
                Some(&mut db),
                (&out).into(),
                (&inp).into(),
                (&w).into(),
                n,
                c,
                oc,
                true,
            )
        });
        let (f, b) = (flops / fwd / 1e9, 2.0 * flops / bwd / 1e9);
        if json {
            rows.push(format!("\"{name}\": {{\"forward\": {f:.2}, \"backward\": {b:.2}}}"));
        } else {
            println!("{name:>10}: forward {f:.1} GFLOP/s, backward (dinp + dW + db) {b:.1} GFLOP/s");
        }
    }
    if json {
        println!("{{{}}}", rows.join(", "));
        return;
    }
    println!("forward on one thread: alone, and two independent GEMMs side by side (sum):");
    for (c, oc, name) in &shapes[..4] {
        let (c, oc) = (*c, *oc);
        let mk = || (vec![0.01f32; n * c], vec![0.02f32; oc * c], vec![0f32; n * oc]);
        let ((i1, w1, mut o1), (i2, w2, mut o2)) = (mk(), mk());
        let (ci, oci) = (c as isize, oc as isize);
        let run = |i: &[f32], w: &[f32], o: &mut [f32]| {
            gemm_strided_serial(n, oc, c, o, (oci, 1), false, i, (ci, 1), w, (1, ci))
        };
        let flops = 2.0 * (n * c * oc) as f64;
        let alone = best(&mut || run(&i1, &w1, &mut o1));
        let pair = best(&mut || {
            rayon::join(|| run(&i1, &w1, &mut o1), || run(&i2, &w2, &mut o2));
        });
        println!(
            "{name:>10}: alone {:.1} GFLOP/s, side by side {:.1} GFLOP/s",
            flops / alone / 1e9,
            2.0 * flops / pair / 1e9
        );
    }
    // The kernel on a block that stays in cache (one MC x KC block of A, B panels of 512
    // columns), against one thread's share of the measured FMA peak: what the micro-kernel
    // itself reaches, before packing and memory take their part.
    let (m, nn, k) = (264, 512, 384);
    let (a, b, mut c) = (vec![0.01f32; m * k], vec![0.02f32; nn * k], vec![0f32; m * nn]);
    let (ki, ni) = (k as isize, nn as isize);
    let t = best(&mut || gemm_strided_serial(m, nn, k, &mut c, (ni, 1), false, &a, (ki, 1), &b, (1, ki)));
    let (peak, how) = llmrs::backend::cpu::peak::measure();
    let (got, share) = (2.0 * (m * nn * k) as f64 / t / 1e9, peak / rayon::current_num_threads() as f64);
    println!(
        "in cache ({m}x{nn}x{k}) on one thread: {got:.1} GFLOP/s, {:.0}% of one thread's share of {peak:.1} GFLOP/s ({how})",
        100.0 * got / share
    );
}

/// Each shape's forward and backward (dinp, dW overwritten as after a zero_grad, db) with every
/// buffer f32, then bf16 (dbias f32, as the CPU backend keeps it), rounds interleaved; the
/// best time of each, in GFLOP/s, and bf16's speed over f32's.
fn bf16_vs_f32(n: usize, shapes: &[(usize, usize, &str)]) {
    println!("all threads ({}), best of 3 rounds x 5 runs; GFLOP/s f32 -> bf16 (ratio):", rayon::current_num_threads());
    for &(c, oc, name) in shapes {
        let vals =
            |len: usize, s: usize| (0..len).map(|i| ((i * s) % 1000) as f32 / 1000.0 - 0.5).collect::<Vec<f32>>();
        let (inp, w, dout) = (vals(n * c, 7919), vals(oc * c, 104729), vals(n * oc, 31));
        let to16 = |v: &[f32]| v.iter().map(|x| llmrs::core::bf16::from_f32(*x)).collect::<Vec<u16>>();
        let (inp16, w16, dout16) = (to16(&inp), to16(&w), to16(&dout));
        let b = vec![0.0f32; oc];
        let (mut out, mut dinp, mut dw, mut db) =
            (vec![0f32; n * oc], vec![0f32; n * c], vec![0f32; oc * c], vec![0f32; oc]);
        let (mut out16, mut dinp16, mut dw16) = (vec![0u16; n * oc], vec![0u16; n * c], vec![0u16; oc * c]);
        let flops = 2.0 * (n * c * oc) as f64;
        let mut t = [f64::MAX; 4];
        for _ in 0..3 {
            t[0] = t[0]
                .min(best(&mut || matmul_forward((&mut out).into(), (&inp).into(), (&w).into(), Some(&b), n, c, oc)));
            t[1] = t[1].min(best(&mut || {
                let (x, wt) = (Operand::Bf16(&inp16), Operand::Bf16(&w16));
                matmul_forward(Dest::Bf16(&mut out16), x, wt, Some(&b), n, c, oc)
            }));
            t[2] = t[2].min(best(&mut || {
                let (di, dwt) = (Some((&mut dinp).into()), Some((&mut dw).into()));
                matmul_backward(di, dwt, Some(&mut db), (&dout).into(), (&inp).into(), (&w).into(), n, c, oc, false)
            }));
            t[3] = t[3].min(best(&mut || {
                let (di, dwt) = (Some(Dest::Bf16(&mut dinp16)), Some(Dest::Bf16(&mut dw16)));
                let (d, x, wt) = (Operand::Bf16(&dout16), Operand::Bf16(&inp16), Operand::Bf16(&w16));
                matmul_backward(di, dwt, Some(&mut db), d, x, wt, n, c, oc, false)
            }));
        }
        let g = |i: usize, f: f64| f / t[i] / 1e9;
        println!(
            "{name:>10}: forward {:.1} -> {:.1} ({:.2}x), backward {:.1} -> {:.1} ({:.2}x)",
            g(0, flops),
            g(1, flops),
            t[0] / t[1],
            g(2, 2.0 * flops),
            g(3, 2.0 * flops),
            t[2] / t[3]
        );
    }
}

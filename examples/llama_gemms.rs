//! GFLOP/s of the base GEMMs of a LoRA step at Llama 3.2 1B's shapes, B=1 x T=512 (N = 512
//! rows): each projection's forward and its input gradient (the frozen base needs no weight
//! gradient), against the measured FMA peak; the last line sums a step (16 layers and the
//! 128,256-column head). Best of five, all threads.
//! `cargo run --release --example llama_gemms`
use llmrs::backend::cpu::matmul::{matmul_backward, matmul_forward};
mod common;
use common::best_ms;

fn main() {
    let n = 512;
    // (C, OC): the fused qkv, o, the fused gate and up, down, and the head.
    let shapes = [(2048, 3072, "qkv"), (2048, 2048, "o"), (2048, 16384, "gate_up"), (8192, 2048, "down")];
    let head = (2048, 128256, "head");
    let (peak, how) = llmrs::backend::cpu::peak::measure();
    println!("peak {peak:.1} GFLOP/s ({how})");
    let (mut step_ms, mut step_flops) = (0.0, 0.0);
    for (c, oc, name) in shapes.into_iter().chain([head]) {
        let vals =
            |len: usize, s: usize| (0..len).map(|i| ((i * s) % 1000) as f32 / 1000.0 - 0.5).collect::<Vec<f32>>();
        let (inp, w, dout) = (vals(n * c, 7919), vals(oc * c, 104729), vals(n * oc, 31));
        let (mut out, mut dinp) = (vec![0f32; n * oc], vec![0f32; n * c]);
        let flops = 2.0 * (n * c * oc) as f64;
        let f = best_ms(|| matmul_forward((&mut out).into(), (&inp).into(), (&w).into(), None, n, c, oc));
        let b = best_ms(|| {
            let (d, x, wt) = ((&dout).into(), (&inp).into(), (&w).into());
            matmul_backward(Some((&mut dinp).into()), None, None, d, x, wt, n, c, oc, false)
        });
        let times = if name == "head" { 1.0 } else { 16.0 };
        (step_ms, step_flops) = (step_ms + times * (f + b), step_flops + times * 2.0 * flops);
        let (gf, gb) = (flops / f / 1e6, flops / b / 1e6);
        println!(
            "{name:8} forward {f:8.2} ms {gf:6.1} GFLOP/s {:3.0}% | dinp {b:8.2} ms {gb:6.1} GFLOP/s {:3.0}%",
            100.0 * gf / peak,
            100.0 * gb / peak
        );
    }
    println!("a step's base GEMMs: {step_ms:.0} ms, {:.1} GFLOP/s", step_flops / step_ms / 1e6);
}

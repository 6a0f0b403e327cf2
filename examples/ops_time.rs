//! Time the step's elementwise ops that are not GEMMs at GPT-2 124M, B=4, T=64 (256 rows): the
//! cross-entropy forward and backward over the 50257-token vocabulary, GELU forward and
//! backward over the 12 layers' (256, 3072) activations, and the 25 LayerNorms forward and
//! backward over (256, 768), and the 12 layers' attention forward and backward (B=4, T=64 and
//! B=1, T=1024, 12 heads), then the 16 of Llama 3.2 1B's LoRA benchmark (B=1, T=512, 32 query
//! heads on 8 key heads), with the rate of their causal GEMM FLOPs. Best of five, all threads.
//! `cargo run --release --example ops_time`
use llmrs::backend::cpu::attention::{attention_backward, attention_forward};
use llmrs::backend::cpu::classifier::{crossentropy_forward, crossentropy_softmax_backward_inplace};
use llmrs::backend::cpu::gelu::{gelu_backward_inplace, gelu_forward};
use llmrs::backend::cpu::layernorm::{layernorm_backward, layernorm_forward};
mod common;
use common::best_ms;

fn main() {
    let (n, v, vp) = (256, 50257, 50304);
    let logits: Vec<f32> = (0..n * vp).map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 5.0).collect();
    let targets: Vec<u32> = (0..n).map(|i| (i * 31 % v) as u32).collect();
    let (mut losses, mut lse) = (vec![0f32; n], vec![0f32; n]);
    let mut d = logits.clone();
    let fwd = best_ms(|| crossentropy_forward(&mut losses, &mut lse, (&logits).into(), &targets, n, v, vp));
    let bwd = best_ms(|| {
        d.copy_from_slice(&logits);
        crossentropy_softmax_backward_inplace((&mut d).into(), &lse, &targets, 1.0 / n as f32, n, v, vp)
    });
    let copy = best_ms(|| d.copy_from_slice(&logits));
    println!("cross-entropy ({n} x {v}): forward {fwd:.1} ms, backward {:.1} ms", bwd - copy);

    let len = 256 * 3072;
    let x: Vec<f32> = (0..len).map(|i| ((i * 7919) % 1000) as f32 * 0.006 - 3.0).collect();
    let (mut o, mut g) = (vec![0f32; len], vec![1f32; len]);
    let fwd = best_ms(|| (0..12).for_each(|_| gelu_forward(&mut o, &x)));
    // Fresh upstream gradients each time: repeated in-place products would drift to denormals.
    let bwd = best_ms(|| {
        (0..12).for_each(|_| {
            g.fill(1.0);
            gelu_backward_inplace(&mut g, &x)
        })
    });
    let fill = best_ms(|| (0..12).for_each(|_| g.fill(1.0)));
    println!("GELU (12 x 256 x 3072): forward {fwd:.1} ms, backward {:.1} ms", bwd - fill);

    let (n, c) = (256, 768);
    let x: Vec<f32> = (0..n * c).map(|i| ((i * 7919) % 1000) as f32 * 0.004 - 2.0).collect();
    let (w, b) = (vec![1.1f32; c], vec![0.1f32; c]);
    let (mut out, mut mean, mut rstd) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
    let fwd = best_ms(|| (0..25).for_each(|_| layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, n, c)));
    let (mut dx, mut dw, mut db) = (vec![0f32; n * c], vec![0f32; c], vec![0f32; c]);
    let bwd = best_ms(|| {
        (0..25).for_each(|_| layernorm_backward(&mut dx, &mut dw, &mut db, &out, &x, &w, &mean, &rstd, n, c))
    });
    println!("LayerNorm (25 x {n} x {c}): forward {fwd:.1} ms, backward {bwd:.1} ms");

    // The step's shape, one long sequence (where the probabilities of old did not fit a cache),
    // and the 16 layers of Llama 3.2 1B's LoRA benchmark (B=1, T=512, 32 query and 8 key heads).
    for (l, b, t, c, nh, nkv) in [(12, 4, 64, 768, 12, 12), (12, 1, 1024, 768, 12, 12), (16, 1, 512, 2048, 32, 8)] {
        let qd = c + 2 * nkv * (c / nh);
        let qkv: Vec<f32> = (0..b * t * qd).map(|i| ((i * 7919) % 1000) as f32 * 0.002 - 1.0).collect();
        let (mut out, mut stats, mut heads) =
            (vec![0f32; b * t * c], vec![0f32; b * nh * t * 2], vec![0f32; b * t * c]);
        let fwd = best_ms(|| {
            (0..l).for_each(|_| attention_forward(&mut out, &mut stats, &mut heads, &qkv, b, t, c, nh, nkv))
        });
        let mut dqkv = vec![0f32; b * t * qd];
        let mut heads = vec![0f32; b * t * 3 * c]; // the model lends a (B, T, >= 3*C) buffer here
        let bwd = best_ms(|| {
            (0..l).for_each(|_| attention_backward(&mut dqkv, &mut heads, &out, &qkv, &stats, b, t, c, nh, nkv))
        });
        // Causal GEMM FLOPs: 2 (forward) and 5 (backward, P again) products of T^2/2 x HS per head.
        let flop = |g: f64| (l * b * nh) as f64 * g * 2.0 * (t * t) as f64 / 2.0 * (c / nh) as f64;
        let rate = |g: f64, ms: f64| flop(g) / ms / 1e6;
        println!(
            "attention ({l} x B={b} T={t} NH={nh} KV={nkv}): forward {fwd:.1} ms ({:.0} GFLOP/s), backward {bwd:.1} ms ({:.0} GFLOP/s)",
            rate(2.0, fwd),
            rate(5.0, bwd)
        );
    }
}

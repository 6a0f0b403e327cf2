//! GFLOP/s of the GEMM shapes in a GPT-2 124M training step at B=4, T=64 (n = 256 rows).
//! `cargo run --release --example gemm_shapes`
use llmrs::cpu::matmul::{matmul_backward, matmul_forward};
use std::time::Instant;

fn main() {
    let n = 256;
    for (c, oc, name) in [
        (768, 2304, "qkv"),
        (768, 768, "attn proj"),
        (768, 3072, "fc"),
        (3072, 768, "fc proj"),
        (768, 50304, "classifier"),
    ] {
        let inp = vec![0.01f32; n * c];
        let w = vec![0.02f32; oc * c];
        let b = vec![0.0f32; oc];
        let mut out = vec![0f32; n * oc];
        let (mut dinp, mut dw, mut db) = (vec![0f32; n * c], vec![0f32; oc * c], vec![0f32; oc]);
        let flops = 2.0 * (n * c * oc) as f64;
        let time = |f: &mut dyn FnMut()| {
            f();
            let t = Instant::now();
            for _ in 0..5 {
                f();
            }
            t.elapsed().as_secs_f64() / 5.0
        };
        let fwd = time(&mut || matmul_forward(&mut out, &inp, &w, Some(&b), n, c, oc));
        let bwd =
            time(&mut || matmul_backward(Some(&mut dinp), &mut dw, Some(&mut db), &out, &inp, &w, n, c, oc, true));
        println!(
            "{name:>10}: forward {:.1} GFLOP/s, backward (dinp + dW + db) {:.1} GFLOP/s",
            flops / fwd / 1e9,
            2.0 * flops / bwd / 1e9
        );
    }
}

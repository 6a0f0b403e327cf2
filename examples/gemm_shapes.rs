//! GFLOP/s of the GEMM shapes in a GPT-2 124M training step at B=4, T=64 (n = 256 rows), then
//! the forward GEMMs on one thread, alone and two side by side (one per core): what the cores
//! lose to each other through the shared cache and memory.
//! `cargo run --release --example gemm_shapes` (`-- --json`: the first part only, as JSON, for
//! `scripts/bench_compare.py --gemm`)
use llmrs::cpu::matmul::{gemm_strided_serial, matmul_backward, matmul_forward};
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
        let fwd = best(&mut || matmul_forward(&mut out, &inp, &w, Some(&b), n, c, oc));
        let bwd = best(&mut || {
            matmul_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &out, &inp, &w, n, c, oc, true)
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
}

//! Time a LoRA adapter's forward and backward (`cpu::lora`) and each of their skinny GEMMs at
//! Llama 3.2 1B's shapes, B=1 x T=512 (N = 512 rows) and rank 8: the adapters on q, k and v
//! (rows of the fused (N, 3072) qkv output), o, gate and up (rows of the fused (N, 16384)
//! output) and down. Best of five, all threads; the last line sums one layer and multiplies by
//! its 16 layers (`llmrs bench`'s "lora" share of a step is the same work).
//! `cargo run --release --example lora_time`
use llmrs::backend::cpu::gemm::gemm_strided_any;
use llmrs::backend::cpu::lora::{lora_backward, lora_forward};
use llmrs::backend::cpu::wide::{Dest, Operand};
use llmrs::backend::ops::LoraShape;
mod common;
use common::best_ms;

fn main() {
    let (n, r, layers) = (512usize, 8usize, 16.0);
    // (C, OC, row0, ROWS): the projection's input and output widths and the adapted rows.
    let shapes = [
        ("q", 2048, 3072, 0, 2048),
        ("k", 2048, 3072, 2048, 512),
        ("v", 2048, 3072, 2560, 512),
        ("o", 2048, 2048, 0, 2048),
        ("gate", 2048, 16384, 0, 8192),
        ("up", 2048, 16384, 8192, 8192),
        ("down", 8192, 2048, 0, 2048),
    ];
    println!(
        "{:5} {:>8} {:>8} | its GEMMs (ms): h = x a^T, out += h b^T, db, dh, da, dx += dh a",
        "", "forward", "backward"
    );
    let (mut fwd, mut bwd) = (0.0, 0.0);
    for (name, c, oc, row0, rows) in shapes {
        let val = |len: usize, m: usize| (0..len).map(|i| (i % m) as f32 * 0.01 - 0.03).collect::<Vec<f32>>();
        let (x, a, b, dout) = (val(n * c, 13), val(r * c, 7), val(rows * r, 5), val(n * oc, 11));
        let mut out = val(n * oc, 3);
        let (mut h, mut dh, mut t) = (vec![0f32; n * r], vec![0f32; n * r], vec![0f32; n * r]);
        let (mut da, mut db, mut dx) = (vec![0f32; r * c], vec![0f32; rows * r], vec![0f32; n * c]);
        let s = LoraShape { n, c, oc, r, row0, rows, scale: 2.0 };
        let f = best_ms(|| lora_forward(Dest::F32(&mut out), &mut h, Operand::F32(&x), &a, &b, s));
        let bk = best_ms(|| {
            let (g, xo) = (Operand::F32(&dout), Operand::F32(&x));
            lora_backward(Some(Dest::F32(&mut dx)), &mut da, &mut db, &h, &mut dh, g, xo, &a, &b, s)
        });
        // The GEMMs as lora_backward runs them (R-column results as their transposes).
        let (c_, oc_, r_) = (c as isize, oc as isize, r as isize);
        let (x, a, bo, g) = (Operand::F32(&x), Operand::F32(&a), Operand::F32(&b), Operand::F32(&dout[row0..]));
        let parts = [
            best_ms(|| gemm_strided_any(r, n, c, Dest::F32(&mut t), n, false, a, (c_, 1), x, (1, c_))),
            best_ms(|| {
                let hs = Operand::F32(&h);
                gemm_strided_any(n, rows, r, Dest::F32(&mut out[row0..]), oc, true, hs, (r_, 1), bo, (1, r_))
            }),
            best_ms(|| {
                let hs = Operand::F32(&h);
                gemm_strided_any(r, rows, n, Dest::F32(&mut db), rows, true, hs, (1, r_), g, (oc_, 1))
            }),
            best_ms(|| gemm_strided_any(r, n, rows, Dest::F32(&mut t), n, false, bo, (1, r_), g, (1, oc_))),
            best_ms(|| {
                let dhs = Operand::F32(&dh);
                gemm_strided_any(r, c, n, Dest::F32(&mut da), c, true, dhs, (1, r_), x, (c_, 1))
            }),
            best_ms(|| {
                let dhs = Operand::F32(&dh);
                gemm_strided_any(n, c, r, Dest::F32(&mut dx), c, true, dhs, (r_, 1), a, (c_, 1))
            }),
        ];
        let p: Vec<String> = parts.iter().map(|p| format!("{p:5.2}")).collect();
        println!("{name:5} {f:8.2} {bk:8.2} | {}", p.join(" "));
        (fwd, bwd) = (fwd + f, bwd + bk);
    }
    println!("a layer: forward {fwd:.1} ms, backward {bwd:.1} ms; x{layers}: {:.0} ms a step", layers * (fwd + bwd));
}

//! Every op of the GPU backend against the CPU backend, on random inputs: odd sizes, sizes
//! that are not a multiple of a tile, T = 1, one position. Each op runs twice: with the
//! adapter's own memory sizes, and with tiny chunks and bindings, so that its tensors sit in
//! different device buffers and every op must cut its work into pieces (the path of GPT-2
//! 124M's wte and logits on a driver that binds 128 MiB). GPU outputs are poisoned with NaN
//! before each op, so an element it fails to write fails the comparison.
//!
//! Tolerances: both backends compute in fp32 with the same formulas, but sum in different
//! orders (tiled GEMM and workgroup trees here, blocked SIMD on the CPU), so results differ
//! by rounding: |gpu - cpu| <= atol + rtol * |cpu|, rtol 1e-5 (2e-5 through the attention's
//! softmax, whose exps amplify the scores' rounding), atol 1e-5 of the output's scale.
//!
//! Needs a GPU adapter (lavapipe in CI): without one each test prints SKIPPED, unless
//! LLMRS_REQUIRE_GPU=1 makes that a failure.

mod common;

use common::gpu::{backend, random_values, Pair, Two};
use llmrs::backend::gpu::Options;
use llmrs::backend::ops::*;
use llmrs::backend::{AdamWParams, Backend, Buf, DType, Noise, SkipAbove};

/// The heads of a fused qkv of width C (of the queries) with NH query and KV key/value heads.
fn heads(c: usize, nh: usize, nkv: usize) -> Heads {
    Heads { nh, nkv, hs: c / nh }
}

/// A conversion of src into dst (a call of [`ConvertOps::convert`]).
fn convert(dst: Buf, src: Buf, noise: Option<Noise>) -> Convert {
    Convert { dst, src, noise, consuming: false }
}

/// Tiny limits: 512-byte chunks and 2 KiB bindings (rows of up to 512 floats fit), GEMM sums
/// of 16 per dispatch, kernel loops of 3 rows and grids of 8 workgroups per dimension, so that
/// every way an op cuts its work runs on these small shapes.
fn tiny() -> Options {
    Options {
        chunk_bytes: Some(512),
        max_binding: Some(2048),
        k_per_dispatch: Some(16),
        loop_rows: Some(3),
        max_groups: Some(8),
        ..Default::default()
    }
}

/// Run `f` on a pair with the adapter's sizes and on one with tiny ones, with f32 tensors and
/// with bf16 ones (`--precision bf16`: two to a 32-bit word on the GPU, each op computing on
/// f32 copies; the CPU rounds as the GPU does, so an op's results agree within the fp32
/// tolerance plus one bf16 rounding step: see `Pair::check`).
fn both(name: &str, f: impl Fn(&mut Pair)) {
    for dtype in [DType::F32, DType::BF16] {
        for (what, opts) in [("default sizes", Options::default()), ("tiny chunks", tiny())] {
            let Some(gpu) = backend(name, opts) else { return };
            let mut p = Pair::with_dtype(gpu, what, dtype);
            f(&mut p);
        }
    }
}

#[test]
fn gpu_matmul_forward_and_backward() {
    both("gpu_matmul_forward_and_backward", |p| {
        for &(n, c, oc) in &[(1, 1, 1), (3, 5, 7), (70, 33, 65), (13, 64, 128), (2, 48, 200), (64, 16, 64), (600, 3, 5)]
        {
            for bias in [true, false] {
                let [out, inp, w, b, dout, dinp, dw, db] =
                    p.parts([n * oc, n * c, oc * c, oc, n * oc, n * c, oc * c, oc]);
                p.poison(out);
                p.both(
                    |be, [out, inp, w, b]| {
                        be.matmul_forward(&MatmulForward {
                            out,
                            x: inp,
                            w,
                            bias: bias.then_some(b),
                            m: Mat { n, c, oc },
                        })
                    },
                    [out, inp, w, b],
                );
                p.check(out, 1e-5, &format!("matmul_forward n={n} c={c} oc={oc} bias={bias}"));
                for accumulate in [false, true] {
                    p.poison(dinp);
                    if !accumulate {
                        p.poison(dw);
                        p.poison(db);
                    }
                    p.both(
                        |be, [dinp, dw, db, dout, inp, w]| {
                            be.matmul_backward(&MatmulBackward {
                                dx: Some(dinp),
                                dw: Some(dw),
                                db: bias.then_some(db),
                                dout,
                                x: inp,
                                w,
                                m: Mat { n, c, oc },
                                acc: accumulate,
                            })
                        },
                        [dinp, dw, db, dout, inp, w],
                    );
                    let what = format!("matmul_backward n={n} c={c} oc={oc} acc={accumulate}");
                    p.check(dinp, 1e-5, &what);
                    p.check(dw, 1e-5, &what);
                    if bias {
                        p.check(db, 1e-5, &what);
                    }
                }
            }
        }
    });
}

/// A LoRA adapter's term on the adapted rows of a fused projection (row0 > 0, rows < OC) and on
/// a whole one, forward and backward (which adds to dinp and to the adapter's gradients).
#[test]
fn gpu_lora_forward_and_backward() {
    both("gpu_lora_forward_and_backward", |p| {
        for &(n, c, oc, r, row0, rows) in
            &[(1, 1, 1, 1, 0, 1), (5, 7, 13, 3, 4, 6), (70, 33, 60, 8, 0, 60), (600, 5, 12, 2, 9, 3)]
        {
            // A (R, C) and B (ROWS, R) fit one window (tiny: 512 floats), as any real adapter's do.
            let s = llmrs::backend::ops::LoraShape { n, c, oc, r, row0, rows, scale: 1.75 };
            let [out, h, inp, a, b, dinp, da, db, dh, dout] =
                p.parts([n * oc, n * r, n * c, r * c, rows * r, n * c, r * c, rows * r, n * r, n * oc]);
            let what = format!("lora n={n} c={c} oc={oc} r={r} rows {row0}..{}", row0 + rows);
            p.poison(h);
            p.both(
                |be, [out, h, inp, a, b]| be.lora_forward(&LoraForward { out, h, x: inp, a, b, s }),
                [out, h, inp, a, b],
            );
            p.check(out, 1e-5, &format!("{what}: out"));
            p.check(h, 1e-5, &format!("{what}: h"));
            // The backward reads the forward's h.
            p.poison(dh);
            p.both(
                |be, [dinp, da, db, h, dh, dout, inp, a, b]| {
                    be.lora_backward(&LoraBackward { dx: Some(dinp), da, db, dh, dout, x: inp, a, b, h, s })
                },
                [dinp, da, db, h, dh, dout, inp, a, b],
            );
            for (x, name) in [(dinp, "dinp"), (da, "da"), (db, "db"), (dh, "dh")] {
                p.check(x, 1e-5, &format!("{what}: {name}"));
            }
        }
    });
}

/// Grids of 4 workgroups per dimension: a GEMM of more than 4 tiles of rows or columns runs in
/// parts (on the real limit, 65535 tiles: the rows of 2 or 4 million positions, by the kernel).
#[test]
fn gpu_matmul_in_parts_of_a_grid() {
    let opts = Options { max_groups: Some(4), k_per_dispatch: Some(32), ..Default::default() };
    let Some(gpu) = backend("gpu_matmul_in_parts_of_a_grid", opts) else { return };
    let mut p = Pair::new(gpu, "grids of 4");
    // Every buffer under 4^3 workgroups of 256 (the other kernels' grids).
    for &(n, c, oc) in &[(600, 3, 5), (5, 40, 300), (300, 4, 40), (40, 4, 300)] {
        let [out, inp, w, b, dinp, dw, db] = p.parts([n * oc, n * c, oc * c, oc, n * c, oc * c, oc]);
        p.poison(out);
        p.both(
            |be, [out, inp, w, b]| {
                be.matmul_forward(&MatmulForward { out, x: inp, w, bias: Some(b), m: Mat { n, c, oc } })
            },
            [out, inp, w, b],
        );
        p.check(out, 1e-5, &format!("matmul_forward n={n} c={c} oc={oc}"));
        p.poison(dinp);
        p.both(
            |be, [dinp, dw, db, out, inp, w]| {
                be.matmul_backward(&MatmulBackward {
                    dx: Some(dinp),
                    dw: Some(dw),
                    db: Some(db),
                    dout: out,
                    x: inp,
                    w,
                    m: Mat { n, c, oc },
                    acc: false,
                })
            },
            [dinp, dw, db, out, inp, w],
        );
        for x in [dinp, dw, db] {
            p.check(x, 1e-5, &format!("matmul_backward n={n} c={c} oc={oc}"));
        }
    }
}

#[test]
fn gpu_layernorm_forward_and_backward() {
    both("gpu_layernorm_forward_and_backward", |p| {
        for &(n, c) in &[(1, 1), (1, 3), (7, 65), (17, 3), (40, 48), (3, 257), (130, 5)] {
            let [out, mean, rstd, inp, w, b, dout, dinp, dw, db] =
                p.parts([n * c, n, n, n * c, c, c, n * c, n * c, c, c]);
            p.poison(out);
            p.poison(mean);
            p.poison(rstd);
            p.both(
                |be, [out, mean, rstd, inp, w, b]| {
                    be.layernorm_forward(&LayerNormForward { out, mean, rstd, x: inp, w, b, r: Rows { n, c } })
                },
                [out, mean, rstd, inp, w, b],
            );
            let what = format!("layernorm n={n} c={c}");
            p.check(out, 1e-5, &what);
            p.check(mean, 1e-5, &what);
            p.check(rstd, 1e-5, &what);
            p.both(
                |be, [dinp, dw, db, dout, inp, w, mean, rstd]| {
                    be.layernorm_backward(&LayerNormBackward {
                        dx: dinp,
                        dw,
                        db,
                        dout,
                        x: inp,
                        w,
                        mean,
                        rstd,
                        r: Rows { n, c },
                    })
                },
                [dinp, dw, db, dout, inp, w, mean, rstd],
            );
            if c > 1 {
                p.check(dinp, 1e-4, &what); // C = 1: rstd = 1/sqrt(eps) amplifies rounding
            }
            p.check(dw, 1e-5, &what);
            p.check(db, 1e-5, &what);
        }
    });
}

#[test]
fn gpu_rmsnorm_forward_and_backward() {
    both("gpu_rmsnorm_forward_and_backward", |p| {
        for &(n, c) in &[(1, 1), (1, 3), (7, 65), (17, 3), (40, 48), (3, 257), (130, 5)] {
            let [out, rstd, inp, w, dout, dinp, dw] = p.parts([n * c, n, n * c, c, n * c, n * c, c]);
            p.poison(out);
            p.poison(rstd);
            p.both(
                |be, [out, rstd, inp, w]| {
                    be.rmsnorm_forward(&RmsNormForward { out, rstd, x: inp, w, r: Rows { n, c }, eps: 1e-5 })
                },
                [out, rstd, inp, w],
            );
            let what = format!("rmsnorm n={n} c={c}");
            p.check(out, 1e-5, &what);
            p.check(rstd, 1e-5, &what);
            p.both(
                |be, [dinp, dw, dout, inp, w, rstd]| {
                    be.rmsnorm_backward(&RmsNormBackward { dx: dinp, dw, dout, x: inp, w, rstd, r: Rows { n, c } })
                },
                [dinp, dw, dout, inp, w, rstd],
            );
            p.check(dinp, 1e-4, &what);
            p.check(dw, 1e-5, &what);
        }
    });
}

/// Qwen3's per-head RMSNorm of the query and key heads of qkv rows (the value heads copied),
/// and its backward, on odd head counts and sizes, with rows cut across chunk boundaries.
#[test]
fn gpu_head_norm_forward_and_backward() {
    both("gpu_head_norm_forward_and_backward", |p| {
        // Rows of at most 128 values: the tiny pass binds 512 bytes per chunk.
        for &(n, nh, nkv, hs) in &[(1, 1, 1, 1), (3, 4, 2, 6), (7, 3, 3, 13), (70, 2, 1, 32), (130, 1, 1, 5)] {
            let (w, normed) = ((nh + 2 * nkv) * hs, nh + nkv);
            let [out, rstd, inp, wq, wk, dout, dinp, dwq, dwk] =
                p.parts([n * w, n * normed, n * w, hs, hs, n * w, n * w, hs, hs]);
            p.poison(out);
            p.poison(rstd);
            p.both(
                |be, [out, rstd, inp, wq, wk]| {
                    be.head_norm_forward(&HeadNormForward {
                        out,
                        rstd,
                        x: inp,
                        wq,
                        wk,
                        n,
                        h: Heads { nh, nkv, hs },
                        eps: 1e-6,
                    })
                },
                [out, rstd, inp, wq, wk],
            );
            let what = format!("head_norm n={n} nh={nh} nkv={nkv} hs={hs}");
            p.check(out, 1e-5, &what);
            p.check(rstd, 1e-5, &what);
            p.poison(dinp);
            p.both(
                |be, [dinp, dwq, dwk, dout, inp, wq, wk, rstd]| {
                    be.head_norm_backward(&HeadNormBackward {
                        dx: dinp,
                        dwq,
                        dwk,
                        dout,
                        x: inp,
                        wq,
                        wk,
                        rstd,
                        n,
                        h: Heads { nh, nkv, hs },
                    })
                },
                [dinp, dwq, dwk, dout, inp, wq, wk, rstd],
            );
            p.check(dinp, 1e-4, &what);
            p.check(dwq, 1e-5, &what);
            p.check(dwk, 1e-5, &what);
        }
    });
}

#[test]
fn gpu_rope_and_swiglu() {
    both("gpu_rope_and_swiglu", |p| {
        // (B, T, pos, NH, KV, HS): rows at positions pos + t of a table of maxT = pos + T + 2.
        for &(b, t, pos, nh, nkv, hs) in
            &[(1, 1, 0, 1, 1, 2), (2, 5, 3, 4, 2, 6), (3, 7, 0, 3, 1, 16), (1, 40, 9, 2, 2, 8)]
        {
            let (n, qd, max_t) = (b * t, (nh + 2 * nkv) * hs, pos + t + 2);
            let [qkv, table] = p.parts([n * qd, max_t * hs]);
            let what = format!("rope b={b} t={t} pos={pos} nh={nh} nkv={nkv} hs={hs}");
            p.both(
                |be, [qkv, table]| be.rope(&Rope { qkv, table, n, t, pos, h: Heads { nh, nkv, hs }, inverse: false }),
                [qkv, table],
            );
            p.check(qkv, 1e-6, &what);
            p.both(
                |be, [qkv, table]| be.rope(&Rope { qkv, table, n, t, pos, h: Heads { nh, nkv, hs }, inverse: true }),
                [qkv, table],
            );
            p.check(qkv, 1e-6, &what);
        }
        for &(n, f) in &[(1, 1), (3, 5), (17, 64), (130, 7), (2, 200)] {
            let [out, inp, dout, dinp] = p.parts([n * f, n * 2 * f, n * f, n * 2 * f]);
            p.scale(inp, 4.0);
            p.poison(out);
            p.both(|be, [out, inp]| be.swiglu_forward(&SwigluForward { out, x: inp, r: Rows { n, c: f } }), [out, inp]);
            let what = format!("swiglu n={n} f={f}");
            p.check(out, 1e-5, &what);
            p.poison(dinp);
            p.both(
                |be, [dinp, dout, inp]| {
                    be.swiglu_backward(&SwigluBackward { dx: dinp, dout, x: inp, r: Rows { n, c: f } })
                },
                [dinp, dout, inp],
            );
            p.check(dinp, 1e-5, &what);
        }
    });
}

#[test]
fn gpu_encoder_forward_and_backward() {
    both("gpu_encoder_forward_and_backward", |p| {
        for &(b, t, c, v) in &[(1, 1, 1, 3), (3, 7, 5, 11), (2, 9, 48, 300), (4, 16, 8, 2)] {
            let [out, wte, wpe, dwte, dwpe] = p.parts([b * t * c, v * c, t * c, v * c, t * c]);
            let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % v) as u32).collect();
            let inp = p.tokens(&ids);
            // GPT-2's token + position embedding, and Llama's tokens alone.
            for pe in [true, false] {
                p.poison(out);
                p.both_t(
                    |be, [out, wte, wpe], [inp]| {
                        be.encoder_forward(&EncoderForward {
                            out,
                            ids: inp,
                            wte,
                            wpe: pe.then_some(wpe),
                            s: Seq { b, t },
                            c,
                        })
                    },
                    [out, wte, wpe],
                    [inp],
                );
                let what = format!("encoder b={b} t={t} c={c} v={v} positions={pe}");
                p.check(out, 1e-6, &what);
                p.both_t(
                    |be, [dwte, dwpe, out], [inp]| {
                        be.encoder_backward(&EncoderBackward {
                            dwte,
                            dwpe: pe.then_some(dwpe),
                            dout: out,
                            ids: inp,
                            s: Seq { b, t },
                            c,
                        })
                    },
                    [dwte, dwpe, out],
                    [inp],
                );
                p.check(dwte, 1e-6, &what);
                p.check(dwpe, 1e-6, &what);
            }
        }
    });
}

#[test]
fn gpu_elementwise_ops() {
    both("gpu_elementwise_ops", |p| {
        for n in [1, 3, 255, 257, 1000] {
            let [out, a, b, d] = p.parts([n, n, n, n]);
            p.poison(out);
            p.both(|be, [out, a, b]| be.residual_forward(&Residual { out, a, b }), [out, a, b]);
            p.check(out, 1e-7, &format!("residual n={n}"));
            p.poison(out);
            p.both(|be, [out, a]| be.gelu_forward(&GeluForward { out, x: a }), [out, a]);
            p.check(out, 1e-5, &format!("gelu_forward n={n}"));
            p.both(|be, [d, a]| be.gelu_backward(&GeluBackward { d, x: a }), [d, a]);
            p.check(d, 1e-5, &format!("gelu_backward n={n}"));
            p.both(|be, [out]| be.fill(out, -2.5), [out]);
            p.check(out, 0.0, &format!("fill n={n}"));
        }
    });
}

#[test]
fn gpu_attention_forward_and_backward() {
    both("gpu_attention_forward_and_backward", |p| {
        // A (b, h) plane of scores must fit one binding (a tile): up to T = 22 with tiny ones.
        // (B, T, C, NH, KV): GPT-2's (KV = NH) and grouped-query shapes (KV < NH).
        let shapes: &[_] = if p.tiny() {
            &[
                (1, 1, 4, 2, 2),
                (2, 5, 12, 3, 3),
                (3, 9, 8, 1, 1),
                (2, 20, 8, 2, 2),
                (3, 17, 6, 3, 3),
                (2, 7, 16, 4, 2),
                (2, 9, 12, 3, 1),
            ]
        } else {
            &[
                (1, 1, 4, 2, 2),
                (2, 5, 12, 3, 3),
                (1, 70, 16, 2, 2),
                (3, 9, 8, 1, 1),
                (2, 66, 8, 2, 2),
                (2, 70, 24, 6, 2),
            ]
        };
        for &(b, t, c, nh, nkv) in shapes {
            let qd = c + 2 * nkv * (c / nh);
            let [out, stats, ws, qkv, dout, dqkv, ws3] =
                p.parts([b * t * c, b * nh * t * 2, b * t * c, b * t * qd, b * t * c, b * t * qd, b * t * 3 * c]);
            p.scale(qkv, 2.0);
            p.poison(out);
            p.poison(stats);
            p.both(
                |be, [out, stats, ws, qkv]| {
                    be.attention_forward(&AttentionForward {
                        out,
                        stats,
                        ws,
                        qkv,
                        s: Seq { b, t },
                        h: heads(c, nh, nkv),
                    })
                },
                [out, stats, ws, qkv],
            );
            let what = format!("attention b={b} t={t} c={c} nh={nh} nkv={nkv}");
            p.check(out, 2e-5, &what);
            // Each row's (max, 1/sum): the backward rebuilds the probabilities from these.
            p.check(stats, 2e-5, &format!("{what}, row statistics"));
            p.poison(dqkv);
            p.both(
                |be, [dqkv, ws3, dout, qkv, stats]| {
                    be.attention_backward(&AttentionBackward {
                        dqkv,
                        ws: ws3,
                        dout,
                        qkv,
                        stats,
                        s: Seq { b, t },
                        h: heads(c, nh, nkv),
                    })
                },
                [dqkv, ws3, dout, qkv, stats],
            );
            p.check(dqkv, 5e-5, &what);
        }
    });
}

#[test]
fn gpu_cached_attention() {
    both("gpu_cached_attention", |p| {
        // One sequence's cache and scores are bound whole (far below a binding in real models).
        // (pos, TN, C, NH, KV, maxT)
        let shapes: &[_] = if p.tiny() {
            &[(0, 1, 4, 2, 2, 1), (0, 5, 12, 3, 3, 9), (4, 1, 12, 3, 3, 9), (3, 6, 8, 2, 2, 20), (2, 3, 16, 4, 2, 8)]
        } else {
            &[(0, 1, 4, 2, 2, 1), (0, 5, 12, 3, 3, 9), (4, 1, 12, 3, 3, 9), (3, 66, 8, 2, 2, 80), (5, 9, 24, 6, 3, 20)]
        };
        for &(pos, tn, c, nh, nkv, max_t) in shapes {
            let kv = nkv * (c / nh);
            let [out, ws, qkv, kc, vc] = p.parts([tn * c, tn * c, tn * (c + 2 * kv), max_t * kv, max_t * kv]);
            p.poison(out);
            p.both(
                |be, [out, ws, qkv, kc, vc]| {
                    be.attention_forward_cached(&AttentionCached {
                        out,
                        ws,
                        qkv,
                        k: kc,
                        v: vc,
                        pos,
                        tn,
                        cap: max_t,
                        h: heads(c, nh, nkv),
                    })
                },
                [out, ws, qkv, kc, vc],
            );
            let what = format!("cached attention pos={pos} tn={tn} c={c} nh={nh} nkv={nkv}");
            p.check(out, 2e-5, &what);
            p.check_prefix(kc, (pos + tn) * kv, 0.0, &what);
            p.check_prefix(vc, (pos + tn) * kv, 0.0, &what);
        }
    });
}

#[test]
fn gpu_classifier() {
    both("gpu_classifier", |p| {
        for &(n, v, vp) in &[(1, 1, 1), (3, 5, 8), (7, 13, 13), (2, 129, 256), (5, 250, 256)] {
            let [losses, lse, logits, acc] = p.parts([n, n, n * vp, 1]);
            p.scale(logits, 3.0);
            let ids: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % v) as u32).collect();
            let targets = p.tokens(&ids);
            p.poison(losses);
            p.poison(lse);
            p.both_t(
                |be, [losses, lse, logits], [tg]| {
                    be.crossentropy_forward(&CrossentropyForward { losses, lse, logits, targets: tg, n, v, vp })
                },
                [losses, lse, logits],
                [targets],
            );
            let what = format!("crossentropy n={n} v={v} vp={vp}");
            p.check(losses, 1e-5, &what);
            p.check(lse, 1e-5, &what);
            p.both(
                |be, [acc, losses]| be.accumulate_mean(&AccumulateMean { acc, x: losses, weight: 0.7 }),
                [acc, losses],
            );
            p.check(acc, 1e-5, &what);
            p.both_t(
                |be, [logits, lse], [tg]| {
                    be.crossentropy_backward(&CrossentropyBackward { logits, lse, targets: tg, dloss: 0.3, n, v, vp })
                },
                [logits, lse],
                [targets],
            );
            p.check(logits, 1e-5, &what);
        }
    });
}

#[test]
fn gpu_global_norm_and_adamw() {
    both("gpu_global_norm_and_adamw", |p| {
        for n in [1, 7, 4096, 4097, 10000] {
            let [params, grads, m, v, stats] = p.parts([n, n, n, n, 2]);
            p.poison(stats);
            p.both(
                |be, [s, g]| {
                    be.global_norm_squared(&GlobalNormSquared { out: s.prefix(1), grads: g, accumulate: false })
                },
                [stats, grads],
            );
            p.both(
                |be, [s, g]| {
                    be.global_norm_squared(&GlobalNormSquared { out: s.slice(1..2), grads: g, accumulate: false })
                },
                [stats, grads],
            );
            p.both(
                |be, [s, g]| {
                    be.global_norm_squared(&GlobalNormSquared { out: s.slice(1..2), grads: g, accumulate: true })
                },
                [stats, grads],
            );
            p.check(stats, 1e-5, &format!("global norm n={n}"));
            let mut h = AdamWParams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                t: 3,
                skip: SkipAbove::NON_FINITE,
                seed: 0,
                place: None,
            };
            // m and v must stay >= 0 for v: make them squares of the random inputs.
            p.map(v, |x| x * x);
            p.both(
                |be, [pa, g, m, v, s]| {
                    be.adamw_update(&AdamwUpdate { params: pa, work: None, grads: g, m, v, stats: s, h })
                },
                [params, grads, m, v, stats],
            );
            let what = format!("adamw n={n}");
            p.check(params, 1e-5, &what);
            p.check(m, 1e-5, &what);
            p.check(v, 1e-5, &what);
            // A limit below the step's loss: nothing moves, on either backend.
            h.skip = SkipAbove { loss: -1.0, norm_sq: f32::INFINITY };
            let before = p.read_gpu(params);
            p.both(
                |be, [pa, g, m, v, s]| {
                    be.adamw_update(&AdamwUpdate { params: pa, work: None, grads: g, m, v, stats: s, h })
                },
                [params, grads, m, v, stats],
            );
            assert_eq!(before, p.read_gpu(params), "{what}: a skipped step moved the parameters");
            p.check(params, 1e-5, &what);
        }
    });
}

#[test]
fn gpu_uploads_and_downloads_span_chunks() {
    for opts in [Options::default(), tiny()] {
        let Some(mut g) = backend("gpu_uploads_and_downloads_span_chunks", opts) else { return };
        let parts = [1, 300, 77, 1000, 3];
        let n: usize = parts.iter().sum();
        let b = g.alloc_parts(&parts, llmrs::backend::DType::F32).unwrap();
        let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        g.upload(b, &data);
        let mut out = vec![0f32; n];
        g.download(b, &mut out).unwrap();
        assert_eq!(out, data);
        // A range across several parts, and one inside a part.
        let mut part = vec![0f32; 500];
        g.download(b.slice(250..750), &mut part).unwrap();
        assert_eq!(part, data[250..750]);
        g.fill(b.slice(290..400), 1.5);
        g.download(b, &mut out).unwrap();
        assert!(out[290..400].iter().all(|&x| x == 1.5) && out[289] == data[289] && out[400] == data[400]);
    }
}

/// bf16 storage on the GPU: uploads, downloads, fills and conversions of bf16 tensors that
/// start and end in the middle of 32-bit words and across chunks, each the CPU's bits
/// (rounding to nearest even, stochastic rounding keyed by the seed and the element's place);
/// the neighbours sharing a word keep their halves.
#[test]
fn gpu_bf16_storage() {
    for opts in [Options::default(), tiny()] {
        let Some(gpu) = backend("gpu_bf16_storage", opts) else { return };
        let mut p =
            Pair::with_dtype(gpu, if opts.chunk_bytes.is_some() { "tiny chunks" } else { "default" }, DType::BF16);
        let parts = [1, 3, 300, 77, 1000, 3];
        let n: usize = parts.iter().sum();
        // Values that round (up and down, ties to even), signed zeros, tiny and huge ones.
        let mut data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 - 91.0) * 1.001f32.powi(i as i32)).collect();
        data[..6].copy_from_slice(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -0.0, 1e-40, 3.0e38, -2.5]);
        let both = |p: &mut Pair| {
            let c = p.cpu.alloc_parts(&parts, DType::BF16).unwrap();
            let g = p.gpu.alloc_parts(&parts, DType::BF16).unwrap();
            (c, g)
        };
        let x = both(&mut p);
        p.cpu.upload(x.0, &data);
        p.gpu.upload(x.1, &data);
        p.check(x, 0.0, "upload");
        // Windows at odd places: download, upload and fill, with the neighbours kept.
        let mut part = vec![0f32; 499];
        p.gpu.download(x.1.slice(251..750), &mut part).unwrap();
        let mut want = vec![0f32; 499];
        p.cpu.download(x.0.slice(251..750), &mut want).unwrap();
        assert_eq!(
            part.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        p.both(|be, [x]| be.upload(x.slice(3..10), &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]), [x]);
        p.both(|be, [x]| be.fill(x.slice(289..400), 1.0 / 3.0), [x]);
        p.both(|be, [x]| be.fill(x.slice(1000..1001), -7.0), [x]);
        p.check(x, 0.0, "uploads and fills at odd offsets");
        // Conversions: f32 into bf16 (nearest, stochastic), bf16 into f32 and into bf16, into
        // views that start at odd elements.
        let fc = p.cpu.alloc_parts(&parts, DType::F32).unwrap();
        let fg = p.gpu.alloc_parts(&parts, DType::F32).unwrap();
        let f = (fc, fg);
        let wide: Vec<f32> = data.iter().map(|v| v * 1.000_37 + 1e-3).collect();
        p.both(|be, [f]| be.upload(f, &wide), [f]);
        // Noise keyed by each element's place in its allocation, and by a place given (ZeRO-3's
        // place of a shard in the whole parameters).
        for seed in [None, Some((7, None)), Some((0xDEAD_BEEF, None)), Some((3, Some(123_457)))] {
            let noise =
                |dst: Buf| seed.map(|(s, first)| first.map_or(Noise::at(s, dst), |first| Noise { seed: s, first }));
            let y = both(&mut p);
            p.both(|be, [y, f]| be.convert(&convert(y.slice(5..n), f.slice(4..n - 1), noise(y.slice(5..n)))), [y, f]);
            p.both(|be, [y, f]| be.convert(&convert(y.prefix(5), f.slice(n - 5..n), noise(y.prefix(5)))), [y, f]);
            p.check(y, 0.0, &format!("convert f32 -> bf16, seed {seed:?}"));
            p.both(|be, [x, y]| be.convert(&convert(x.slice(1..n), y.slice(0..n - 1), noise(x.slice(1..n)))), [x, y]);
            p.check(x, 0.0, &format!("convert bf16 -> bf16, seed {seed:?}"));
            p.both(|be, [f, y]| be.convert(&convert(f.slice(3..n), y.slice(0..n - 3), None)), [f, y]);
            let (mut c, mut g) = (vec![0f32; n], vec![0f32; n]);
            p.cpu.download(f.0, &mut c).unwrap();
            p.gpu.download(f.1, &mut g).unwrap();
            assert!(c.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()), "convert bf16 -> f32");
            p.cpu.free(y.0);
            p.gpu.free(y.1);
        }
    }
}

/// AdamW on fp32 master weights that also writes their bf16 working copy (llm.c's bf16 AdamW,
/// `-w 1`) against the CPU, with bf16 gradients; a skipped step leaves both as they were.
#[test]
fn gpu_adamw_writes_the_bf16_working_copy() {
    for opts in [Options::default(), tiny()] {
        let Some(gpu) = backend("gpu_adamw_writes_the_bf16_working_copy", opts) else { return };
        let mut f = Pair::new(gpu, "master weights");
        for n in [1, 7, 4097] {
            let [params, m, v, stats] = f.parts([n, n, n, 2]);
            f.map(v, |x| x * x);
            f.map(stats, |_| 0.5);
            // The working copy and the gradients in bf16, at odd offsets of their allocations.
            let alloc = |f: &mut Pair| {
                let c = f.cpu.alloc_parts(&[1, n], DType::BF16).unwrap().slice(1..n + 1);
                let g = f.gpu.alloc_parts(&[1, n], DType::BF16).unwrap().slice(1..n + 1);
                (c, g)
            };
            let (work, grads) = (alloc(&mut f), alloc(&mut f));
            let g: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
            f.both(|be, [x]| be.upload(x, &g), [grads]);
            f.both(|be, [w, pa]| be.convert(&convert(w, pa, None)), [work, params]);
            let mut h = AdamWParams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                t: 3,
                skip: SkipAbove::NON_FINITE,
                seed: 12345,
                place: None,
            };
            let step = |f: &mut Pair, h: &AdamWParams| {
                f.both(
                    |be, [pa, w, g, m, v, s]| {
                        be.adamw_update(&AdamwUpdate { params: pa, work: Some(w), grads: g, m, v, stats: s, h: *h })
                    },
                    [params, work, grads, m, v, stats],
                )
            };
            let read = |f: &mut Pair, x: Two| {
                let (mut c, mut g) = (vec![0f32; x.0.len], vec![0f32; x.1.len]);
                f.cpu.download(x.0, &mut c).unwrap();
                f.gpu.download(x.1, &mut g).unwrap();
                (c, g)
            };
            let what = format!("adamw with a working copy n={n}");
            // lr = 0 leaves the master weights exactly as they are on both backends, so the
            // copy, their stochastic rounding, must have the CPU's bits (and differ from the
            // nearest rounding it replaced somewhere).
            let nearest = read(&mut f, work).1;
            h.lr = 0.0;
            step(&mut f, &h);
            f.check(params, 0.0, &what);
            f.check(work, 0.0, &format!("{what}: the working copy"));
            if n > 1000 {
                assert_ne!(read(&mut f, work).1, nearest, "{what}: the copy was not rounded stochastically");
            }
            // With the noise of a place given (a ZeRO-3 shard's): the CPU's bits still.
            h.place = Some(4321);
            step(&mut f, &h);
            f.check(work, 0.0, &format!("{what}: the working copy rounded at a given place"));
            h.place = None;
            // A real step: the master weights within fp32 rounding, the copy within one bf16
            // step of the CPU's (their master weights differ by rounding).
            h.lr = 1e-2;
            step(&mut f, &h);
            f.check(params, 1e-5, &what);
            f.check(m, 1e-5, &what);
            f.check(v, 1e-5, &what);
            let (c, g) = read(&mut f, work);
            for (i, (a, b)) in g.iter().zip(&c).enumerate() {
                assert!((a - b).abs() <= a.abs().max(b.abs()) / 128.0, "{what}: copy element {i}: gpu {a} vs cpu {b}");
            }
            let before = (read(&mut f, params).1, read(&mut f, work).1);
            h.skip = SkipAbove { loss: 0.25, norm_sq: f32::INFINITY };
            h.seed = 99;
            step(&mut f, &h);
            assert_eq!(before, (read(&mut f, params).1, read(&mut f, work).1), "{what}: a skipped step moved them");
        }
    }
}

/// The GEMMs of bf16 operands read them as they are (kernels/matmul.wgsl's bf16 variant):
/// the same bits as the f32 GEMM of their widened copies, rounded once, forward and backward
/// (accumulating too), with tensors starting in the middle of words and cut into pieces; and
/// no f32 copy of an input is made, only of the output.
#[test]
fn gpu_bf16_gemms_read_bf16_operands_themselves() {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut random = |n: usize| random_values(&mut seed, n);
    for opts in [Options::default(), tiny()] {
        let Some(mut g) = backend("gpu_bf16_gemms_read_bf16_operands_themselves", opts) else { return };
        for &(n, c, oc) in &[(1, 1, 1), (3, 5, 7), (70, 33, 65), (2, 48, 200), (600, 3, 5)] {
            let lens = [n * oc, n * c, oc * c, oc, n * oc, n * c, oc * c, oc];
            // Parts of odd lengths before each tensor put bf16 ones across word boundaries.
            let h = g.alloc_parts(&lens.iter().flat_map(|&l| [1, l]).collect::<Vec<_>>(), DType::BF16).unwrap();
            let f = g.alloc_parts(&lens, DType::F32).unwrap();
            let split = |x: Buf, pad: usize| -> Vec<Buf> {
                let mut at = 0;
                lens.iter()
                    .map(|&l| {
                        at += pad;
                        at += l;
                        x.slice(at - l..at)
                    })
                    .collect()
            };
            let (hs, fs) = (split(h, 1), split(f, 0));
            for (&x, &l) in hs.iter().zip(&lens) {
                let v = random(l);
                g.upload(x, &v);
            }
            for (&y, &x) in fs.iter().zip(&hs) {
                g.convert(&Convert { dst: y, src: x, noise: None, consuming: false });
            }
            let bits = |g: &mut llmrs::backend::gpu::GpuBackend, x: Buf| -> Vec<u32> {
                let mut v = vec![0f32; x.len];
                g.download(x, &mut v).unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            };
            // The f32 path's result rounded to bf16, in a scratch bf16 tensor.
            let rounded = |g: &mut llmrs::backend::gpu::GpuBackend, x: Buf| -> Vec<u32> {
                let t = g.alloc(x.len, DType::BF16).unwrap();
                g.convert(&Convert { dst: t, src: x, noise: None, consuming: false });
                let r = bits(g, t);
                g.free(t);
                r
            };
            let [out, inp, w, b, dout, dinp, dw, db] = std::array::from_fn(|i| (hs[i], fs[i]));
            let what = format!("n={n} c={c} oc={oc}, {opts:?}");
            g.matmul_forward(&MatmulForward { out: out.0, x: inp.0, w: w.0, bias: Some(b.0), m: Mat { n, c, oc } });
            g.matmul_forward(&MatmulForward { out: out.1, x: inp.1, w: w.1, bias: Some(b.1), m: Mat { n, c, oc } });
            assert_eq!(bits(&mut g, out.0), rounded(&mut g, out.1), "matmul_forward {what}");
            for accumulate in [false, true] {
                for x in [dw, db] {
                    g.convert(&Convert { dst: x.1, src: x.0, noise: None, consuming: false });
                    // the same gradients to add to
                }
                g.matmul_backward(&MatmulBackward {
                    dx: Some(dinp.0),
                    dw: Some(dw.0),
                    db: Some(db.0),
                    dout: dout.0,
                    x: inp.0,
                    w: w.0,
                    m: Mat { n, c, oc },
                    acc: accumulate,
                });
                g.matmul_backward(&MatmulBackward {
                    dx: Some(dinp.1),
                    dw: Some(dw.1),
                    db: Some(db.1),
                    dout: dout.1,
                    x: inp.1,
                    w: w.1,
                    m: Mat { n, c, oc },
                    acc: accumulate,
                });
                for (x, name) in [(dinp, "dinp"), (dw, "dweight"), (db, "dbias")] {
                    assert_eq!(
                        bits(&mut g, x.0),
                        rounded(&mut g, x.1),
                        "matmul_backward {name} acc={accumulate} {what}"
                    );
                }
            }
            g.free(h);
            g.free(f);
        }
    }
    // A fresh backend's f32 copies after bf16 GEMMs whose sums are one dispatch each: none
    // (the inputs read and the outputs written as they are); with a sum cut into dispatches,
    // the output's (summed in f32, rounded once).
    for (k_per_dispatch, copies) in [(None, 0), (Some(256), 64 * 8 * 4)] {
        let opts = Options { k_per_dispatch, ..Default::default() };
        let Some(mut g) = backend("gpu_bf16_gemms_read_bf16_operands_themselves", opts) else { return };
        let (n, c, oc) = (64, 512, 8);
        let [out, inp, w, dinp, dw] = [n * oc, n * c, oc * c, n * c, oc * c].map(|l| g.alloc(l, DType::BF16).unwrap());
        g.fill(inp, 0.5);
        g.fill(w, 0.25);
        assert_eq!(g.workspace_bytes(), 0);
        g.matmul_forward(&MatmulForward { out, x: inp, w, bias: None, m: Mat { n, c, oc } });
        assert_eq!(g.workspace_bytes(), copies, "matmul_forward, {k_per_dispatch:?} per dispatch");
        // dinp sums over OC = 8 and dweight over N = 64: one dispatch each, no copies.
        g.free_f32_copies();
        g.matmul_backward(&MatmulBackward {
            dx: Some(dinp),
            dw: Some(dw),
            db: None,
            dout: out,
            x: inp,
            w,
            m: Mat { n, c, oc },
            acc: false,
        });
        assert_eq!(g.workspace_bytes(), 0, "matmul_backward, {k_per_dispatch:?} per dispatch");
        let mut v = vec![0f32; n * oc];
        g.download(out, &mut v).unwrap();
        assert!(v.iter().all(|&x| x == 64.0), "512 * 0.5 * 0.25");
        let mut v = vec![0f32; oc * c];
        g.download(dw, &mut v).unwrap();
        assert!(v.iter().all(|&x| x == 2048.0), "64 * 64 * 0.5");
    }
}

/// The kernels with bf16 variants (the embedding, the norms, RoPE, SwiGLU, GELU, the residual
/// add, attention, cross-entropy, the global norm, AdamW, LoRA's GEMMs) read and write bf16
/// tensors themselves: no f32 copy is made but those of
/// the norms' parameter gradients (C values each, summed over every row in f32 and rounded
/// once), and the results are the bits of the f32 kernels on widened copies, rounded once to
/// nearest even; the f32 statistics they write are the same bits (with tiny bindings, within
/// rounding: see below). Every bf16 tensor starts
/// in the middle of a word (a part of one element before each), so the two threads that write
/// the halves of a word, and a word shared with another tensor, are exercised.
#[test]
fn gpu_bf16_kernels_read_and_write_bf16_themselves() {
    use llmrs::backend::gpu::GpuBackend;
    type Run = Box<dyn Fn(&mut GpuBackend, &[Buf], &[Buf])>;
    // Token ids for n rows of a vocabulary of v.
    fn targets(g: &mut GpuBackend, n: usize, v: usize) -> Buf {
        let tg = g.alloc(n, DType::U32).unwrap();
        g.upload_u32(tg, &(0..n).map(|i| ((i * 5 + 1) % v) as u32).collect::<Vec<_>>());
        tg
    }
    // (name, activation lengths, f32 stat lengths, written activations, written stats,
    // parameter-gradient lengths (their f32 copies), the op on (activations, stats))
    type Case = (&'static str, Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>, usize, Run);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for opts in [Options::default(), tiny()] {
        let Some(mut g) = backend("gpu_bf16_kernels_read_and_write_bf16_themselves", opts) else { return };
        for &(n, c) in &[(1, 2), (3, 6), (7, 34), (40, 130)] {
            // Heads for the head norms and RoPE: NH = 2, KV = 1, HS = c / 2 (even for RoPE when c % 4 == 0;
            // else HS rounds down to an even size).
            let hs = (c / 2) & !1usize;
            let (nh, nkv) = (2, 1);
            let qkv = (nh + 2 * nkv) * hs;
            // Sequences of T positions from position 1 (the table's rows 1..T+1 fit one tiny binding).
            let (t, pos) = (if n % 4 == 0 { 4 } else { n }, 1);
            // Attention: B sequences of T positions (B * T = n); a cache of `cap` positions
            // whose last `tn` are new.
            let (ab, at) = if n % 4 == 0 { (n / 4, 4) } else { (1, n) };
            let cap = n.min(12);
            let lora = llmrs::backend::ops::LoraShape { n, c, oc: c + 2, r: 3, row0: 1, rows: c, scale: 1.75 };
            let adamw = AdamWParams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                t: 3,
                skip: SkipAbove::NON_FINITE,
                seed: 0x5EED,
                place: Some(1000),
            };
            let tn = cap - cap / 2;
            #[rustfmt::skip]
            let cases: Vec<Case> = vec![
                ("layernorm_forward", vec![n * c, n * c, c, c], vec![n, n], vec![0], vec![0, 1], 0,
                 Box::new(move |g, a, s| g.layernorm_forward(&LayerNormForward { out: a[0], mean: s[0], rstd: s[1], x: a[1], w: a[2], b: a[3], r: Rows { n, c } }))),
                ("layernorm_backward", vec![n * c, c, c, n * c, n * c, c], vec![n, n], vec![0, 1, 2], vec![], 2 * c,
                 Box::new(move |g, a, s| g.layernorm_backward(&LayerNormBackward { dx: a[0], dw: a[1], db: a[2], dout: a[3], x: a[4], w: a[5], mean: s[0], rstd: s[1], r: Rows { n, c } }))),
                ("rmsnorm_forward", vec![n * c, n * c, c], vec![n], vec![0], vec![0], 0,
                 Box::new(move |g, a, s| g.rmsnorm_forward(&RmsNormForward { out: a[0], rstd: s[0], x: a[1], w: a[2], r: Rows { n, c }, eps: 1e-5 }))),
                ("rmsnorm_backward", vec![n * c, c, n * c, n * c, c], vec![n], vec![0, 1], vec![], c,
                 Box::new(move |g, a, s| g.rmsnorm_backward(&RmsNormBackward { dx: a[0], dw: a[1], dout: a[2], x: a[3], w: a[4], rstd: s[0], r: Rows { n, c } }))),
                ("head_norm_forward", vec![n * qkv, n * qkv, hs, hs], vec![n * (nh + nkv)], vec![0], vec![0], 0,
                 Box::new(move |g, a, s| g.head_norm_forward(&HeadNormForward { out: a[0], rstd: s[0], x: a[1], wq: a[2], wk: a[3], n, h: Heads { nh, nkv, hs }, eps: 1e-6 }))),
                ("head_norm_backward", vec![n * qkv, hs, hs, n * qkv, n * qkv, hs, hs], vec![n * (nh + nkv)],
                 vec![0, 1, 2], vec![], 2 * hs,
                 Box::new(move |g, a, s| {
                     g.head_norm_backward(&HeadNormBackward { dx: a[0], dwq: a[1], dwk: a[2], dout: a[3], x: a[4], wq: a[5], wk: a[6], rstd: s[0], n, h: Heads { nh, nkv, hs } })
                 })),
                ("rope_forward", vec![n * qkv], vec![(pos + t) * hs], vec![0], vec![], 0,
                 Box::new(move |g, a, s| g.rope(&Rope { qkv: a[0], table: s[0], n, t, pos, h: Heads { nh, nkv, hs }, inverse: false }))),
                ("rope_backward", vec![n * qkv], vec![(pos + t) * hs], vec![0], vec![], 0,
                 Box::new(move |g, a, s| g.rope(&Rope { qkv: a[0], table: s[0], n, t, pos, h: Heads { nh, nkv, hs }, inverse: true }))),
                ("swiglu_forward", vec![n * c, n * 2 * c], vec![], vec![0], vec![], 0,
                 Box::new(move |g, a, _| g.swiglu_forward(&SwigluForward { out: a[0], x: a[1], r: Rows { n, c } }))),
                ("swiglu_backward", vec![n * 2 * c, n * c, n * 2 * c], vec![], vec![0], vec![], 0,
                 Box::new(move |g, a, _| g.swiglu_backward(&SwigluBackward { dx: a[0], dout: a[1], x: a[2], r: Rows { n, c } }))),
                ("residual_forward", vec![n * c, n * c, n * c], vec![], vec![0], vec![], 0,
                 Box::new(|g, a, _| g.residual_forward(&Residual { out: a[0], a: a[1], b: a[2] }))),
                ("gelu_forward", vec![n * c, n * c], vec![], vec![0], vec![], 0,
                 Box::new(|g, a, _| g.gelu_forward(&GeluForward { out: a[0], x: a[1] }))),
                ("gelu_backward", vec![n * c, n * c], vec![], vec![0], vec![], 0,
                 Box::new(|g, a, _| g.gelu_backward(&GeluBackward { d: a[0], x: a[1] }))),
                // Attention of 2 heads of C/2 (B sequences of T <= 12 positions, so that each
                // sum over T is one dispatch even with the tiny options): one key/value head
                // per query head, and one for both (whose backward sums the two heads' key and
                // value gradients in an f32 copy of dqkv).
                ("attention_forward", vec![n * c, n * 3 * c, n * c], vec![n * 2 * 2], vec![0], vec![0], 0,
                 Box::new(move |g, a, s| g.attention_forward(&AttentionForward { out: a[0], stats: s[0], ws: a[2], qkv: a[1], s: Seq { b: ab, t: at }, h: heads(c, 2, 2) }))),
                ("attention_forward (grouped)", vec![n * c, n * 2 * c, n * c], vec![n * 2 * 2], vec![0], vec![0], 0,
                 Box::new(move |g, a, s| g.attention_forward(&AttentionForward { out: a[0], stats: s[0], ws: a[2], qkv: a[1], s: Seq { b: ab, t: at }, h: heads(c, 2, 1) }))),
                ("attention_backward", vec![n * 3 * c, n * 3 * c, n * c, n * 3 * c], vec![n * 2 * 2], vec![0], vec![], 0,
                 Box::new(move |g, a, s| g.attention_backward(&AttentionBackward { dqkv: a[0], ws: a[1], dout: a[2], qkv: a[3], stats: s[0], s: Seq { b: ab, t: at }, h: heads(c, 2, 2) }))),
                ("attention_backward (grouped)", vec![n * 2 * c, n * 3 * c, n * c, n * 2 * c], vec![n * 2 * 2],
                 vec![0], vec![], n * 2 * c,
                 Box::new(move |g, a, s| g.attention_backward(&AttentionBackward { dqkv: a[0], ws: a[1], dout: a[2], qkv: a[3], stats: s[0], s: Seq { b: ab, t: at }, h: heads(c, 2, 1) }))),
                // The embedding of n tokens of a vocabulary of 5 (GPT-2's, with positions).
                ("encoder_forward", vec![n * c, 5 * c, at * c], vec![], vec![0], vec![], 0,
                 Box::new(move |g, a, _| {
                     let tokens = targets(g, n, 5);
                     g.encoder_forward(&EncoderForward { out: a[0], ids: tokens, wte: a[1], wpe: Some(a[2]), s: Seq { b: ab, t: at }, c });
                     g.free(tokens);
                 })),
                // Cross-entropy over V = c of Vp = c + 3 logits (the targets uploaded in the op).
                ("crossentropy_forward", vec![n * (c + 3)], vec![n, n], vec![], vec![0, 1], 0,
                 Box::new(move |g, a, s| {
                     let tg = targets(g, n, c);
                     g.crossentropy_forward(&CrossentropyForward { losses: s[0], lse: s[1], logits: a[0], targets: tg, n, v: c, vp: c + 3 });
                     g.free(tg);
                 })),
                ("crossentropy_backward", vec![n * (c + 3)], vec![n], vec![0], vec![], 0,
                 Box::new(move |g, a, s| {
                     let tg = targets(g, n, c);
                     g.crossentropy_backward(&CrossentropyBackward { logits: a[0], lse: s[0], targets: tg, dloss: 0.3, n, v: c, vp: c + 3 });
                     g.free(tg);
                 })),
                // The global norm of bf16 gradients; AdamW from them, of f32 master weights and
                // of bf16 parameters (rounded stochastically with the noise of their places).
                ("global_norm_squared", vec![n * c], vec![1], vec![], vec![0], 0,
                 Box::new(|g, a, s| g.global_norm_squared(&GlobalNormSquared { out: s[0], grads: a[0], accumulate: false }))),
                ("adamw_update (master weights)", vec![n * c], vec![n * c, n * c, n * c, 2], vec![], vec![0, 1, 2], 0,
                 Box::new(move |g, a, s| g.adamw_update(&AdamwUpdate { params: s[0], work: None, grads: a[0], m: s[1], v: s[2], stats: s[3], h: adamw }))),
                ("adamw_update (bf16 parameters)", vec![n * c, n * c], vec![n * c, n * c, 2], vec![0], vec![0, 1], 0,
                 Box::new(move |g, a, s| g.adamw_update(&AdamwUpdate { params: a[0], work: None, grads: a[1], m: s[0], v: s[1], stats: s[2], h: adamw }))),
                // A LoRA adapter of rank 3 (fp32) on a bf16 projection of C to C + 2 outputs,
                // adapting C of them from row 1: h and dh (N, R) through f32 copies.
                ("lora_forward", vec![n * (c + 2), n * c, n * 3], vec![3 * c, c * 3], vec![0, 2], vec![], n * 3,
                 Box::new(move |g, a, s| g.lora_forward(&LoraForward { out: a[0], h: a[2], x: a[1], a: s[0], b: s[1], s: lora }))),
                ("lora_backward", vec![n * c, n * 3, n * 3, n * (c + 2), n * c], vec![3 * c, c * 3, 3 * c, c * 3],
                 vec![0, 2], vec![0, 1], 2 * n * 3,
                 Box::new(move |g, a, s| g.lora_backward(&LoraBackward { dx: Some(a[0]), da: s[0], db: s[1], h: a[1], dh: a[2], dout: a[3], x: a[4], a: s[2], b: s[3], s: lora }))),
                // The last positions of one sequence of up to 12 against a cache of the first.
                ("attention_forward_cached", vec![tn * c, tn * c, tn * 2 * c, cap * c / 2, cap * c / 2], vec![],
                 vec![0, 3, 4], vec![], 0,
                 Box::new(move |g, a, _| g.attention_forward_cached(&AttentionCached { out: a[0], ws: a[1], qkv: a[2], k: a[3], v: a[4], pos: cap - tn, tn, cap, h: heads(c, 2, 1) }))),
            ];
            for (name, lens, stat_lens, written, written_stats, grad_copies, op) in &cases {
                if hs == 0 && (name.starts_with("head") || name.starts_with("rope")) {
                    continue;
                }
                if opts.max_binding.is_some()
                    && (name.starts_with("attention") && c > 6 || name.starts_with("encoder") && c > 34)
                {
                    continue; // a sequence's qkv, and wpe, must fit one (tiny) binding
                }
                let what = format!("{name} n={n} c={c}, {opts:?}");
                let h = g.alloc_parts(&lens.iter().flat_map(|&l| [1, l]).collect::<Vec<_>>(), DType::BF16).unwrap();
                let f = g.alloc_parts(lens, DType::F32).unwrap();
                let (hs_, fs): (Vec<Buf>, Vec<Buf>) = {
                    let (mut at, mut hv, mut fv) = (0, vec![], vec![]);
                    let mut fat = 0;
                    for &l in lens {
                        hv.push(h.slice(at + 1..at + 1 + l));
                        fv.push(f.slice(fat..fat + l));
                        at += 1 + l;
                        fat += l;
                    }
                    (hv, fv)
                };
                let start = random_values(&mut seed, h.len);
                g.upload(h, &start);
                let mut before = vec![0f32; h.len];
                g.download(h, &mut before).unwrap();
                for (&y, &x) in fs.iter().zip(&hs_) {
                    g.convert(&Convert { dst: y, src: x, noise: None, consuming: false });
                }
                // The statistics: the same values for both paths (positive: rstd).
                let stat_vals: Vec<Vec<f32>> = stat_lens
                    .iter()
                    .map(|&l| random_values(&mut seed, l).iter().map(|x| x.abs() + 0.5).collect())
                    .collect();
                let stats = |g: &mut GpuBackend| -> Vec<Buf> {
                    stat_vals
                        .iter()
                        .map(|v| {
                            let b = g.alloc(v.len(), DType::F32).unwrap();
                            g.upload(b, v);
                            b
                        })
                        .collect()
                };
                let (sh, sf) = (stats(&mut g), stats(&mut g));
                g.free_f32_copies(); // those of the uploads and conversions above
                assert_eq!(g.workspace_bytes(), 0, "{what}: no f32 copies");
                op(&mut g, &hs_, &sh);
                assert_eq!(g.workspace_bytes(), 4 * grad_copies, "{what}: f32 copies only of the parameter gradients");
                op(&mut g, &fs, &sf);
                let bits = |g: &mut GpuBackend, x: Buf| -> Vec<u32> {
                    let mut v = vec![0f32; x.len];
                    g.download(x, &mut v).unwrap();
                    v.iter().map(|x| x.to_bits()).collect()
                };
                // With tiny bindings an op cuts its work into pieces of what fits a binding,
                // twice as many bf16 elements as f32 ones: its sums over pieces (a norm's or an
                // adapter's parameter gradients, the global norm) then add in another order,
                // so there the results are held to one bf16 step (f32 ones to 1e-5), and to
                // the bit with the adapter's own sizes.
                let close = |a: &[u32], b: &[u32], rel: f32, what: &str| {
                    // (Relative to each element, plus 10x of that relative to the tensor's
                    // largest: the sums cancel.)
                    let scale = b.iter().map(|x| f32::from_bits(*x).abs()).fold(0f32, f32::max);
                    for (j, (a, b)) in a.iter().zip(b).enumerate() {
                        let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
                        assert!((a - b).abs() <= (b.abs() + 10.0 * scale) * rel, "{what} element {j}: {a} vs {b}");
                    }
                };
                let tiny = opts.max_binding.is_some();
                for &i in written {
                    let t = g.alloc(lens[i], DType::BF16).unwrap();
                    // bf16 parameters are rounded stochastically, keyed by the place given.
                    let noise = name.contains("bf16 parameters").then_some(Noise { seed: adamw.seed, first: 1000 });
                    g.convert(&Convert { dst: t, src: fs[i], noise, consuming: false });
                    let (got, want) = (bits(&mut g, hs_[i]), bits(&mut g, t));
                    g.free(t);
                    if tiny {
                        close(&got, &want, 1.0 / 128.0, &format!("{what}: output {i}"));
                    } else {
                        assert_eq!(got, want, "{what}: output {i}");
                    }
                }
                for &i in written_stats {
                    let (got, want) = (bits(&mut g, sh[i]), bits(&mut g, sf[i]));
                    if tiny {
                        close(&got, &want, 1e-5, &format!("{what}: statistic {i}"));
                    } else {
                        assert_eq!(got, want, "{what}: statistic {i}");
                    }
                }
                // The pads between the tensors (other tensors' halves of shared words) are kept.
                let mut all = vec![0f32; h.len];
                g.download(h, &mut all).unwrap();
                let mut at = 0;
                for &l in lens {
                    assert_eq!(all[at].to_bits(), before[at].to_bits(), "{what}: the pad at {at}");
                    at += 1 + l;
                }
                for b in [h, f].into_iter().chain(sh).chain(sf) {
                    g.free(b);
                }
            }
        }
    }
}

/// The two GEMM kernels (kernels/matmul.wgsl's tiled one, which real GPUs run, and
/// kernels/matmul_subgroup.wgsl's, which lavapipe runs, so the tests above check it against the
/// CPU) give the same bits, through every op built on the GEMM: matmul, attention (batched,
/// causal, grouped-query) and LoRA, f32 and bf16; with the adapter's sizes, with tiny chunks
/// and bindings, and with grids of 4 workgroups and sums of 16 per dispatch (a GEMM cut into
/// parts of rows, columns and k). On the first Vulkan adapter of the CPU type that runs the
/// subgroup GEMM; none is a loud skip (a failure under LLMRS_REQUIRE_GPU=1 if a Vulkan CPU
/// adapter is there without it).
#[test]
fn gpu_gemm_kernels_give_the_same_bits() {
    let name = "gpu_gemm_kernels_give_the_same_bits";
    let soft = llmrs::backend::gpu::software_vulkan_adapters();
    let Some(&(adapter, _)) = soft.iter().find(|a| a.1) else {
        let required = std::env::var(common::gpu::REQUIRE_ENV).as_deref() == Ok("1");
        assert!(!required || soft.is_empty(), "{name}: Vulkan CPU adapters {soft:?}, none runs the subgroup GEMM");
        return llmrs::testdata::skipped(name, "no Vulkan adapter of the CPU type runs the subgroup GEMM");
    };
    let small = Options { max_groups: Some(4), k_per_dispatch: Some(16), ..Default::default() };
    for opts in [Options::default(), tiny(), small] {
        let opts = Options { adapter: Some(adapter), ..opts };
        let Some(sub) = backend(name, opts) else { return };
        let Some(tiled) = backend(name, Options { tiled_gemm: true, ..opts }) else { return };
        assert!(sub.subgroup_gemm() && !tiled.subgroup_gemm());
        let mut pair = [sub, tiled];
        for dtype in [DType::F32, DType::BF16] {
            let mut t = Twins { g: pair, rng: 0x2545_F491_4F6C_DD1D, dtype };
            let what = format!("{dtype:?}, {opts:?}");
            for &(n, c, oc) in &[(1, 1, 1), (3, 5, 7), (70, 33, 65), (33, 64, 130), (100, 17, 40)] {
                let [out, inp, w, bias, dinp, dw, db] = t.parts([n * oc, n * c, oc * c, oc, n * c, oc * c, oc]);
                let w_ = format!("matmul n={n} c={c} oc={oc}, {what}");
                t.run(
                    |g, [out, inp, w, bias]| {
                        g.matmul_forward(&MatmulForward { out, x: inp, w, bias: Some(bias), m: Mat { n, c, oc } })
                    },
                    [out, inp, w, bias],
                );
                t.same(out, &w_);
                for accumulate in [false, true] {
                    t.run(
                        |g, [dinp, dw, db, out, inp, w]| {
                            g.matmul_backward(&MatmulBackward {
                                dx: Some(dinp),
                                dw: Some(dw),
                                db: Some(db),
                                dout: out,
                                x: inp,
                                w,
                                m: Mat { n, c, oc },
                                acc: accumulate,
                            })
                        },
                        [dinp, dw, db, out, inp, w],
                    );
                    [dinp, dw, db].into_iter().for_each(|x| t.same(x, &format!("{w_} backward acc={accumulate}")));
                }
            }
            // (A plane of scores fits a tiny binding up to T = 22; the softmax's grid, one
            // workgroup per row, holds 4^3 rows in grids of 4.)
            let shapes: &[_] = match opts.max_groups {
                Some(4) => &[(1, 1, 4, 2, 2), (2, 9, 12, 3, 1)],
                Some(_) => &[(1, 1, 4, 2, 2), (2, 9, 12, 3, 1), (2, 20, 8, 2, 2)],
                None => &[(1, 1, 4, 2, 2), (2, 9, 12, 3, 1), (2, 70, 16, 2, 2), (1, 97, 24, 6, 2)],
            };
            for &(b, tt, c, nh, nkv) in shapes {
                let qd = c + 2 * nkv * (c / nh);
                let [out, stats, ws, qkv, dout, dqkv, ws3] = t.parts([
                    b * tt * c,
                    b * nh * tt * 2,
                    b * tt * c,
                    b * tt * qd,
                    b * tt * c,
                    b * tt * qd,
                    b * tt * 3 * c,
                ]);
                let w_ = format!("attention b={b} t={tt} c={c} nh={nh} nkv={nkv}, {what}");
                t.run(
                    |g, [out, stats, ws, qkv]| {
                        g.attention_forward(&AttentionForward {
                            out,
                            stats,
                            ws,
                            qkv,
                            s: Seq { b, t: tt },
                            h: heads(c, nh, nkv),
                        })
                    },
                    [out, stats, ws, qkv],
                );
                t.same(out, &w_);
                t.same(stats, &w_);
                t.run(
                    |g, [dqkv, ws3, dout, qkv, stats]| {
                        g.attention_backward(&AttentionBackward {
                            dqkv,
                            ws: ws3,
                            dout,
                            qkv,
                            stats,
                            s: Seq { b, t: tt },
                            h: heads(c, nh, nkv),
                        })
                    },
                    [dqkv, ws3, dout, qkv, stats],
                );
                t.same(dqkv, &format!("{w_} backward"));
            }
            let s = llmrs::backend::ops::LoraShape { n: 70, c: 33, oc: 60, r: 8, row0: 4, rows: 50, scale: 1.75 };
            let [out, h, inp, a, b, dinp, da, db, dh] =
                t.parts([70 * 60, 70 * 8, 70 * 33, 8 * 33, 50 * 8, 70 * 33, 8 * 33, 50 * 8, 70 * 8]);
            t.run(
                |g, [out, h, inp, a, b]| g.lora_forward(&LoraForward { out, h, x: inp, a, b, s }),
                [out, h, inp, a, b],
            );
            t.same(out, &format!("lora, {what}"));
            t.run(
                |g, [dinp, da, db, h, dh, out, inp, a, b]| {
                    g.lora_backward(&LoraBackward { dx: Some(dinp), da, db, h, dh, dout: out, x: inp, a, b, s })
                },
                [dinp, da, db, h, dh, out, inp, a, b],
            );
            [dinp, da, db, dh].into_iter().for_each(|x| t.same(x, &format!("lora backward, {what}")));
            pair = t.g;
        }
    }
}

/// Two GPU backends (the subgroup GEMM's and the tiled one's) with the same tensors.
struct Twins {
    g: [llmrs::backend::gpu::GpuBackend; 2],
    rng: u64,
    dtype: DType,
}

impl Twins {
    /// Tensors of these lengths, one allocation on each backend, with the same random values.
    fn parts<const K: usize>(&mut self, lens: [usize; K]) -> [[Buf; 2]; K] {
        let all = self.g.each_mut().map(|g| g.alloc_parts(&lens, self.dtype).unwrap());
        let data = random_values(&mut self.rng, all[0].len);
        for (g, &x) in self.g.iter_mut().zip(&all) {
            g.upload(x, &data);
        }
        let mut off = 0;
        lens.map(|n| {
            off += n;
            all.map(|x| x.slice(off - n..off))
        })
    }

    fn run<const N: usize>(&mut self, f: impl Fn(&mut dyn Backend, [Buf; N]), bufs: [[Buf; 2]; N]) {
        for (i, g) in self.g.iter_mut().enumerate() {
            f(g, bufs.map(|b| b[i]));
        }
    }

    /// x holds the same bits on both.
    fn same(&mut self, x: [Buf; 2], what: &str) {
        let [a, b] = [0, 1].map(|i| {
            let mut v = vec![0f32; x[i].len];
            self.g[i].download(x[i], &mut v).unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        });
        let first = a.iter().zip(&b).position(|(x, y)| x != y);
        assert!(first.is_none(), "{what}: element {first:?} differs (subgroup GEMM vs tiled)");
    }
}

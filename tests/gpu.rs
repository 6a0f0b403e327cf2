//! The GPU backend end to end, against the references the CPU path answers to: PyTorch's
//! fixtures (logits, loss, the 16 gradients, 10 AdamW steps), llm.c's 41-step run,
//! transformers' greedy tokens, the HellaSwag scorer; and the CPU path's guarantees: the same
//! bits on a rerun, exact resume, checkpoints that either device reads, one-line errors for a
//! lost device, too little memory, a shader that does not build, no adapter.
//!
//! Tolerances are the CPU path's (tests/pytorch_reference.rs, tests/llmc_reference.rs): the GPU
//! computes in fp32 with the same formulas and sums in other orders, which moves results by
//! rounding only (measured on lavapipe: at most 7% of those tolerances on the fixtures).
//!
//! Needs a GPU adapter (lavapipe in CI, a few minutes on 2 cores): without one each test prints
//! SKIPPED, unless LLMRS_REQUIRE_GPU=1 makes that a failure. Shapes are tiny, as lavapipe runs
//! about 1 GFLOP/s.

mod common;

use llmrs::backend::{Backend, Device, SkipAbove};
use llmrs::core::config::{ModelConfig, Precision};
use llmrs::core::files::Dtype;
use llmrs::core::params::Weights;
use llmrs::formats::llmc::{load_debug_state, load_model, save_model};
use llmrs::model::optim::OptimConfig;
use llmrs::model::{Model, Slot};
use llmrs::train::schedule::ScheduleKind;
use llmrs::train::{run, TrainConfig};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The GPU device, or None after a loud SKIPPED line.
fn gpu(test: &str) -> Option<Device> {
    common::gpu::available(test).then_some(Device::Gpu(None))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// |a - b| <= 1e-5 * max|b| + rtol * |b| everywhere (the CPU tests' comparison).
fn compare(a: &[f32], b: &[f32], rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let atol = 1e-5 * scale.max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= atol + rtol * y.abs(), "{what}: element {i}: {x} vs {y}");
    }
}

#[test]
fn gpu_logits_loss_and_all_16_gradients_match_pytorch() {
    let Some(dev) = gpu("gpu_logits_loss_and_all_16_gradients_match_pytorch") else { return };
    let weights = load_model(&fixture("ref_model.bin")).unwrap();
    let st = load_debug_state(&fixture("ref_debug_state.bin"), &weights.config).unwrap();
    let mut model = Model::new(weights, dev).unwrap();
    model.alloc_training_state().unwrap();
    model.forward(&st.inputs, Some(&st.targets), st.b, st.t).unwrap();
    let logits: Vec<f32> = (0..st.b * st.t).flat_map(|row| model.logits_at(row).unwrap()).collect();
    compare(&logits, &st.logits, 1e-5, "logits");
    model.accumulate_loss(1.0).unwrap();
    let loss = model.take_loss().unwrap();
    assert!((loss - st.loss).abs() <= 1e-5 * st.loss, "loss {loss} vs {}", st.loss);
    model.zero_grad().unwrap();
    model.backward(1.0).unwrap();
    let grads = model.read_all(Slot::Grads).unwrap();
    let layout = model.layout().clone();
    for t in layout.ids() {
        compare(&grads[layout.range(t)], &st.grads[layout.range(t)], 1e-4, layout.spec(t).name);
    }
    let stats_loss = model.step_stats().unwrap().loss;
    assert!((stats_loss - st.loss).abs() <= 1e-5 * st.loss, "step loss {stats_loss} vs {}", st.loss);
}

#[test]
fn gpu_ten_adamw_steps_follow_pytorch() {
    let Some(dev) = gpu("gpu_ten_adamw_steps_follow_pytorch") else { return };
    let tr = common::trajectory::Trajectory::load(&fixture("ref_trajectory.json"));
    let mut model = Model::new(load_model(&fixture("ref_model.bin")).unwrap(), dev).unwrap();
    model.alloc_training_state().unwrap();
    let (want_loss, want_norm) = (&tr.losses, &tr.grad_norms);
    for step in 0..tr.steps {
        let stats = tr.step(&mut model, step);
        let (loss, norm) = (stats.loss, stats.grad_norm);
        assert!(
            (loss - want_loss[step]).abs() <= 1e-5 * want_loss[step],
            "step {step} loss {loss} vs {}",
            want_loss[step]
        );
        assert!(
            (norm - want_norm[step]).abs() <= 1e-5 * want_norm[step],
            "step {step} norm {norm} vs {}",
            want_norm[step]
        );
    }
}

/// llm.c's train_gpt2.c run that tests/llmc_reference.rs checks on the CPU, on the GPU: B=4,
/// T=64, Tiny Shakespeare from the same model file; its first 4 steps and the validation at
/// step 0 (lavapipe takes 2.5-3 s a step on 2 cores of a Zen 1, most of it in the 50,304-column
/// classifier; the CPU checks all 41 in fp32 and bf16, and the GPU is held to the CPU step by
/// step elsewhere).
#[test]
fn gpu_follows_the_first_4_steps_of_llmcs_41_step_run() {
    let Some(dev) = gpu("gpu_follows_the_first_4_steps_of_llmcs_41_step_run") else { return };
    // The CPU test's bar (llm.c prints 6 decimals and rounds with -Ofast): 2e-5 absolute.
    follow_llmc(dev, Precision::Fp32, 4, 10, 2e-5);
}

/// The same run in bf16 (llm.c's bf16 build: bf16 parameters, gradients and activations,
/// fp32 master weights and AdamW) stays within 5e-3 of llm.c's fp32 losses, as on the CPU
/// (tests/llmc_reference.rs, all 41 steps): its first 11 steps and the validations at steps 0
/// and 10 (all 41 took 96 s of CI's time on lavapipe; the GPU's bf16 run is held to the CPU's
/// step by step in `gpu_bf16_resume_is_exact_and_follows_the_cpu`).
#[test]
fn gpu_bf16_stays_near_llmcs_fp32_run() {
    let Some(dev) = gpu("gpu_bf16_stays_near_llmcs_fp32_run") else { return };
    let worst = follow_llmc(dev, Precision::Bf16, 11, 10, 5e-3);
    eprintln!("gpu bf16: worst loss difference from llm.c's fp32 run {worst:.2e}");
}

/// Run llm.c's test run on `dev` for `steps` steps, validating every `val_every` steps (a
/// multiple of llm.c's 10); every loss within `tol` of llm.c's (fp32) ones. Returns the
/// largest difference.
fn follow_llmc(dev: Device, precision: Precision, steps: usize, val_every: usize, tol: f32) -> f32 {
    assert!(val_every.is_multiple_of(10), "llm.c validates every 10 steps");
    let text = std::fs::read_to_string(fixture("llmc_train_gpt2c.txt")).unwrap();
    let mut want_val = vec![];
    let mut want_train = vec![];
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        if let Some(v) = l.strip_prefix("val loss ") {
            want_val.push(v.trim().parse::<f32>().unwrap());
        } else if let Some(rest) = l.split("train loss ").nth(1) {
            want_train.push(rest.split_whitespace().next().unwrap().parse::<f32>().unwrap());
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let model = Weights::random(ModelConfig::from_descriptor("2x64:4:64").unwrap(), 42).unwrap();
    let model_path = dir.path().join("gpt2_124M.bin");
    save_model(&model, &model_path, Dtype::F32).unwrap();
    let src = llmrs::data::prepare::Source {
        file: None,
        data_dir: Some(llmrs::testdata::data_dir_with_tinyshakespeare()),
        url: "",
    };
    let (train, val) = llmrs::data::prepare::prepare_tinyshakespeare(&src, &dir.path().join("data")).unwrap();
    let cfg = TrainConfig {
        train_data: train.to_str().unwrap().into(),
        val_data: val.to_str().unwrap().into(),
        model: model_path.to_str().unwrap().into(),
        output_dir: None,
        batch_size: 4,
        seq_len: 64,
        learning_rate: 1e-4,
        warmup: 0,
        schedule: ScheduleKind::Constant,
        max_steps: Some(steps),
        val_every,
        val_max_steps: Some(5),
        sample_every: 0,
        optim: OptimConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, grad_clip: 0.0 },
        quiet: true,
        device: dev,
        precision,
        master_weights: true,
        ..TrainConfig::default()
    };
    let got = run(&cfg).unwrap();
    assert_eq!(got.train_losses.len(), steps);
    want_train.truncate(steps);
    // llm.c's at steps 0, 10, ...: those at 0, val_every, ... before the last (the run may
    // validate once more, at its end).
    let want_val: Vec<f32> = want_val.into_iter().step_by(val_every / 10).take(steps.div_ceil(val_every)).collect();
    assert!(got.val_losses.len() >= want_val.len(), "validations: {:?}", got.val_losses);
    let mut worst = 0f32;
    for (i, w) in want_train.iter().enumerate() {
        let g = got.train_losses[i].1;
        assert!((g - w).abs() < tol, "{precision} train step {i}: llmrs gpu {g} vs llm.c {w}");
        worst = worst.max((g - w).abs());
    }
    for (i, w) in want_val.iter().enumerate() {
        let (s, g) = got.val_losses[i];
        assert_eq!(s, val_every * i);
        assert!((g - w).abs() < tol, "{precision} val at step {s}: llmrs gpu {g} vs llm.c {w}");
        worst = worst.max((g - w).abs());
    }
    worst
}

/// A model file with a vocabulary of 512 (fast on lavapipe), and shards of ids below it.
fn small_setup(dir: &Path) -> (String, String, String) {
    let cfg =
        ModelConfig { vocab_size: 500, padded_vocab_size: 512, ..ModelConfig::from_descriptor("2x32:2:32").unwrap() };
    let model = dir.join("small.bin");
    save_model(&Weights::random(cfg, 7).unwrap(), &model, Dtype::F32).unwrap();
    let mut x = 99u64;
    let mut toks = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 4 == 3 {
                    (x % 500) as u32
                } else {
                    (i % 97) as u32 * 5
                }
            })
            .collect()
    };
    let (tr, va) = (dir.join("train.bin"), dir.join("val.bin"));
    llmrs::data::loader::write_shard(&tr, &toks(4000)).unwrap();
    llmrs::data::loader::write_shard(&va, &toks(700)).unwrap();
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    (s(model), s(tr), s(va))
}

fn small_run(out: &Path, setup: &(String, String, String), dev: Device) -> TrainConfig {
    TrainConfig {
        model: setup.0.clone(),
        train_data: setup.1.clone(),
        val_data: setup.2.clone(),
        output_dir: Some(out.to_path_buf()),
        batch_size: 2,
        seq_len: 16,
        total_batch_size: Some(64), // 2 micro-batches per step
        learning_rate: 3e-3,
        warmup: 2,
        max_steps: Some(10),
        val_every: 4,
        val_max_steps: Some(2),
        sample_every: 0,
        checkpoint_every: 3,
        quiet: true,
        device: dev,
        ..TrainConfig::default()
    }
}

#[test]
fn gpu_reruns_are_bit_identical_and_resume_is_exact() {
    let Some(dev) = gpu("gpu_reruns_are_bit_identical_and_resume_is_exact") else { return };
    let dir = tempfile::tempdir().unwrap();
    let setup = small_setup(dir.path());
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let first = run(&small_run(&a, &setup, dev)).unwrap();
    let second = run(&small_run(&b, &setup, dev)).unwrap();
    let bits = |s: &llmrs::train::RunSummary| s.train_losses.iter().map(|(i, l)| (*i, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&first), bits(&second), "two runs, the same losses to the bit");
    let read = |p: PathBuf| std::fs::read(p).unwrap();
    assert!(read(a.join("model_00000010.bin")) == read(b.join("model_00000010.bin")), "the same final model");
    assert!(read(a.join("state_00000010_00000.bin")) == read(b.join("state_00000010_00000.bin")), "and AdamW state");
    // Stop after the step-3 checkpoint (the later ones never happened), resume with -y 1.
    for s in [6, 9, 10] {
        for f in [format!("DONE_{s:08}"), format!("model_{s:08}.bin"), format!("state_{s:08}_00000.bin")] {
            std::fs::remove_file(b.join(f)).unwrap();
        }
    }
    let resumed = run(&TrainConfig { resume: true, ..small_run(&b, &setup, dev) }).unwrap();
    assert_eq!(bits(&resumed), bits(&first)[3..], "steps 3..9 again, the same bits");
    assert!(read(a.join("model_00000010.bin")) == read(b.join("model_00000010.bin")), "the same final model");
}

/// bf16 on the GPU (`-w 1` and `-w 0`): a run stopped after a checkpoint resumes with the
/// same losses and the same final model to the bit, and the losses follow the CPU's bf16 run.
#[test]
fn gpu_bf16_resume_is_exact_and_follows_the_cpu() {
    let Some(dev) = gpu("gpu_bf16_resume_is_exact_and_follows_the_cpu") else { return };
    let dir = tempfile::tempdir().unwrap();
    let setup = small_setup(dir.path());
    let bits = |s: &llmrs::train::RunSummary| s.train_losses.iter().map(|(i, l)| (*i, l.to_bits())).collect::<Vec<_>>();
    let read = |p: PathBuf| std::fs::read(p).unwrap();
    for master_weights in [true, false] {
        let cfg = |out: &Path, dev| TrainConfig {
            precision: Precision::Bf16,
            master_weights,
            save_dtype: Dtype::BF16, // the CLI's default for a bf16 run
            ..small_run(out, &setup, dev)
        };
        let w = format!("-w {}", master_weights as u8);
        let (a, b, c) =
            (dir.path().join(format!("{w}a")), dir.path().join(format!("{w}b")), dir.path().join(format!("{w}c")));
        let whole = run(&cfg(&a, dev)).unwrap();
        std::fs::create_dir(&b).unwrap();
        for f in ["DONE_00000006", "model_00000006.bin", "state_00000006_00000.bin", "log.jsonl"] {
            std::fs::copy(a.join(f), b.join(f)).unwrap();
        }
        let rest = run(&TrainConfig { resume: true, ..cfg(&b, dev) }).unwrap();
        assert_eq!(bits(&rest), bits(&whole)[6..], "{w}: steps 6..9 again, the same bits");
        assert!(read(a.join("model_00000010.bin")) == read(b.join("model_00000010.bin")), "{w}: the same final model");
        assert!(
            read(a.join("state_00000010_00000.bin")) == read(b.join("state_00000010_00000.bin")),
            "{w}: the same final state"
        );
        // The CPU's bf16 run: the same roundings of values that differ by fp32 rounding, so
        // the losses part by about a bf16 step at most (2^-8 relative) over these 10 steps.
        let cpu = run(&cfg(&c, Device::Cpu)).unwrap();
        for ((s, g), (_, l)) in whole.train_losses.iter().zip(&cpu.train_losses) {
            assert!((g - l).abs() <= 4e-3 * l, "{w} step {s}: gpu {g} vs cpu {l}");
        }
    }
    // LoRA on a Llama whose frozen base is bf16 only, likewise.
    let lora = |dev| TrainConfig {
        model: "llama:2x32:4:2:512".into(),
        precision: Precision::Bf16,
        lora: 4,
        max_steps: Some(4),
        output_dir: None,
        checkpoint_every: 0,
        ..small_run(dir.path(), &setup, dev)
    };
    let (g, c) = (run(&lora(dev)).unwrap(), run(&lora(Device::Cpu)).unwrap());
    assert_eq!(g.train_losses.len(), 4);
    for ((s, g), (_, l)) in g.train_losses.iter().zip(&c.train_losses) {
        assert!((g - l).abs() <= 4e-3 * l, "LoRA step {s}: gpu {g} vs cpu {l}");
    }
}

#[test]
fn gpu_checkpoints_resume_on_the_cpu_and_back() {
    let Some(dev) = gpu("gpu_checkpoints_resume_on_the_cpu_and_back") else { return };
    let dir = tempfile::tempdir().unwrap();
    let setup = small_setup(dir.path());
    for (from, to) in [(dev, Device::Cpu), (Device::Cpu, dev)] {
        let (a, b) = (dir.path().join(format!("{from}-a")), dir.path().join(format!("{from}-b")));
        let whole = run(&small_run(&a, &setup, from)).unwrap();
        // The same run stopped after its step-6 checkpoint, resumed on `to`.
        std::fs::create_dir(&b).unwrap();
        for f in ["DONE_00000006", "model_00000006.bin", "state_00000006_00000.bin", "log.jsonl"] {
            std::fs::copy(a.join(f), b.join(f)).unwrap();
        }
        let rest = run(&TrainConfig { resume: true, ..small_run(&b, &setup, to) }).unwrap();
        assert_eq!(rest.train_losses.len(), 4);
        for ((s1, l1), (s2, l2)) in whole.train_losses[6..].iter().zip(&rest.train_losses) {
            assert_eq!(s1, s2);
            assert!((l1 - l2).abs() <= 1e-5 * l1, "{from} -> {to}, step {s1}: {l1} vs {l2}");
        }
        let (wa, wb) =
            (load_model(&a.join("model_00000010.bin")).unwrap(), load_model(&b.join("model_00000010.bin")).unwrap());
        // Four AdamW steps apart in rounding only: every parameter within 1e-4 of the scale.
        compare(&wb.data, &wa.data, 1e-3, &format!("{from} -> {to} final parameters"));
    }
}

#[test]
fn gpu_greedy_generation_gives_transformers_tokens() {
    let Some(dev) = gpu("gpu_greedy_generation_gives_transformers_tokens") else { return };
    use llmrs::infer::generate::{generate, GenConfig, SamplerConfig};
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("hf/greedy.json")).unwrap()).unwrap();
    let weights = llmrs::formats::hf::load_hf(&fixture("hf/gpt2_tiny_fp32")).unwrap();
    for device in [Device::Cpu, dev] {
        let mut model = Model::new(weights.clone(), device).unwrap();
        for case in j["cases"].as_array().unwrap() {
            let ids = |k: &str| -> Vec<u32> {
                case[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
            };
            let (prompt, want) = (ids("prompt"), ids("new_tokens"));
            for use_cache in [true, false] {
                let g = GenConfig {
                    max_new_tokens: 100,
                    sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
                    stop_tokens: vec![],
                    use_cache,
                };
                let got = generate(&mut model, &prompt, &g, |_| Ok(())).unwrap();
                assert_eq!(got, want, "{device}, cache {use_cache}, prompt {prompt:?}");
            }
        }
    }
}

#[test]
fn gpu_hellaswag_matches_the_cpu_and_the_pytorch_scorer() {
    let Some(dev) = gpu("gpu_hellaswag_matches_the_cpu_and_the_pytorch_scorer") else { return };
    use llmrs::infer::hellaswag::{accuracy, score, Example};
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("hellaswag_ref.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    // The first 12 of the fixture's 300 examples (three batches: lavapipe is slow).
    let wanted = &want["examples"].as_array().unwrap()[..12];
    let ex: Vec<Example> = wanted
        .iter()
        .map(|w| Example {
            label: w["label"].as_u64().unwrap() as usize,
            ctx: ids(&w["ctx_tokens"]),
            endings: (0..4).map(|k| ids(&w["ending_tokens"][k])).collect(),
        })
        .collect();
    let weights = Weights::random(ModelConfig::from_descriptor("2x64:4:256").unwrap(), 42).unwrap();
    let mut results = vec![];
    for device in [Device::Cpu, dev] {
        let mut model = Model::new(weights.clone(), device).unwrap();
        results.push(score(&mut model, &ex, |_| {}).unwrap());
    }
    let (cpu, gpu) = (&results[0], &results[1]);
    assert_eq!(accuracy(cpu), accuracy(gpu), "the same counts on both devices");
    for (i, ((c, g), w)) in cpu.iter().zip(gpu).zip(wanted).enumerate() {
        assert_eq!((g.pred, g.pred_norm), (c.pred, c.pred_norm), "example {i}");
        assert_eq!(g.pred_norm, w["pred_norm"].as_u64().unwrap() as usize, "example {i} vs the PyTorch scorer");
        for k in 0..4 {
            let wa = w["avg_loss"][k].as_f64().unwrap() as f32;
            assert!((g.avg_loss[k] - wa).abs() <= 1e-5 * wa, "example {i} ending {k}: {} vs {wa}", g.avg_loss[k]);
        }
    }
}

#[test]
fn gpu_lost_device_is_an_error_not_a_panic() {
    let Some(_) = gpu("gpu_lost_device_is_an_error_not_a_panic") else { return };
    let mut be = llmrs::backend::gpu::GpuBackend::open(Default::default()).unwrap();
    let b = be.alloc(8, llmrs::backend::DType::F32).unwrap();
    be.upload(b, &[1.0; 8]);
    be.lose_device();
    be.fill(b, 2.0);
    let mut out = [0f32; 8];
    let e = format!("{:#}", be.download(b, &mut out).unwrap_err());
    assert!(e.contains("was lost") && e.contains("-y 1") && e.contains("--device cpu"), "{e}");
    assert!(be.synchronize().is_err());
    // A model on a device that is lost mid-step: the step's read is the error.
    let cfg =
        ModelConfig { vocab_size: 60, padded_vocab_size: 64, ..ModelConfig::from_descriptor("1x16:2:8").unwrap() };
    let opts = llmrs::backend::gpu::Options { lose_after: Some(2), ..Default::default() };
    let be = llmrs::backend::gpu::GpuBackend::open(opts).unwrap();
    let mut m = Model::with_collectives(
        Weights::random(cfg, 1).unwrap(),
        Box::new(be),
        Box::new(llmrs::backend::comm::SingleProcess),
        0,
    )
    .unwrap();
    m.alloc_training_state().unwrap();
    let (x, y) = ([1u32, 2, 3, 4], [2u32, 3, 4, 5]);
    let step = |m: &mut Model| -> anyhow::Result<()> {
        m.zero_grad()?;
        m.forward(&x, Some(&y), 1, 4)?;
        m.backward(1.0)?;
        m.update(&OptimConfig::default(), 1e-3, 0, SkipAbove::NON_FINITE)?;
        m.step_stats().map(|_| ())
    };
    let e = format!("{:#}", step(&mut m).unwrap_err());
    assert!(e.contains("was lost"), "{e}");
    assert!(step(&mut m).is_err(), "and stays an error");
}

#[test]
fn gpu_a_shader_that_does_not_build_is_a_one_line_error() {
    let Some(_) = gpu("gpu_a_shader_that_does_not_build_is_a_one_line_error") else { return };
    let be = llmrs::backend::gpu::GpuBackend::open(Default::default()).unwrap();
    let good = "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
                @compute @workgroup_size(1) fn f() { x[0] = exp_(1.0); }";
    be.build_wgsl("good", good, &[("f", 1)]).unwrap();
    let bad = "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
               @compute @workgroup_size(1) fn f() { x[0] = no_such_function(1.0); }";
    let e = format!("{:#}", be.build_wgsl("bad", bad, &[("f", 1)]).unwrap_err());
    assert!(e.contains("bad.wgsl do not build on") && e.contains("--device cpu"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    // A module that validates but whose pipeline the device refuses (more invocations per
    // workgroup than any device has): the error of the step where the backend builds its own
    // pipelines, at their first dispatch.
    let big = "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
               @compute @workgroup_size(1024, 1024) fn f() { x[0] = 1.0; }";
    let e = format!("{:#}", be.build_wgsl("big", big, &[("f", 1)]).unwrap_err());
    assert!(e.contains("big.wgsl do not build on") && e.contains("--device cpu"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

/// `LLMRS_GPU_GEMM` picks the GEMM kernel (`bench` names the subgroup one in its backend line)
/// and refuses a value it does not know in one line.
#[test]
fn gpu_gemm_kernel_is_chosen_by_llmrs_gpu_gemm() {
    let Some(_) = gpu("gpu_gemm_kernel_is_chosen_by_llmrs_gpu_gemm") else { return };
    let sub = llmrs::backend::gpu::GpuBackend::open(Default::default()).unwrap().subgroup_gemm();
    let bench = |gemm: &str| {
        let out = llmrs()
            .env("LLMRS_GPU_GEMM", gemm)
            .args([
                "--device",
                "gpu",
                "bench",
                "-e",
                "1x16:2:16",
                "-b",
                "2",
                "-t",
                "8",
                "--steps",
                "2",
                "--warmup",
                "0",
            ])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let line = |out: &str, key: &str| out.lines().find(|l| l.starts_with(key)).unwrap_or_default().to_string();
    let (ok, tiled, err) = bench("tiled");
    assert!(ok, "{err}");
    assert!(!line(&tiled, "backend").contains("subgroups"), "{tiled}");
    let (ok, auto, err) = bench("auto");
    assert!(ok, "{err}");
    assert_eq!(line(&auto, "backend").contains("the GEMM through subgroups"), sub, "{auto}");
    // `llmrs devices` says which GEMM each adapter runs.
    let devices = String::from_utf8_lossy(&llmrs().arg("devices").output().unwrap().stdout).to_string();
    let gemm = if sub { "GEMM subgroup" } else { "GEMM tiled" };
    assert!(devices.lines().nth(1).is_some_and(|l| l.contains(gemm)), "{gemm}: {devices}");
    let (ok, _, err) = bench("fast");
    assert!(!ok && err.contains("LLMRS_GPU_GEMM=fast: use tiled or auto"), "{err}");
    assert_eq!(err.lines().filter(|l| l.contains("LLMRS_GPU_GEMM")).count(), 1, "{err}");
}

fn llmrs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_llmrs"))
}

/// The whole program with `--device gpu`: -h 1, samples, validation, checkpoints, the log and
/// the plot; then a device lost mid-run (the newest complete checkpoint intact and resumable,
/// on the CPU), and too little memory (a one-line error before training).
#[test]
fn gpu_train_command_checkpoints_samples_evaluates_and_fails_cleanly() {
    let Some(_) = gpu("gpu_train_command_checkpoints_samples_evaluates_and_fails_cleanly") else { return };
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&dir.path().join("train.bin"), &toks).unwrap();
    llmrs::data::loader::write_shard(&dir.path().join("val.bin"), &toks[..400]).unwrap();
    let hs = fixture("hellaswag_val_head20.jsonl");
    let train = |out: &str, extra: &[&str]| {
        let mut c = llmrs();
        c.current_dir(dir.path()).args([
            "--device",
            "gpu",
            "train",
            "-i",
            "train.bin",
            "-j",
            "val.bin",
            "-e",
            "1x16:2:128",
        ]);
        c.args(["-b", "2", "-t", "16", "-x", "6", "-v", "3", "-m", "1", "-s", "3", "-g", "6", "-n", "2", "-o", out]);
        c.args(extra);
        c.output().unwrap()
    };
    let o = train("out", &["-h", "1", "--hellaswag-data", hs.to_str().unwrap(), "--hellaswag-limit", "2"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("device: gpu: fp32 WGSL kernels"), "{stdout}");
    assert!(stdout.contains("generating:") && stdout.contains("HellaSwag: "), "{stdout}");
    let out = dir.path().join("out");
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let count = |k: &str| lines.iter().filter(|v| v.get(k).is_some()).count();
    assert_eq!((count("train_loss"), count("val_loss"), count("hellaswag")), (6, 3, 2), "{log}");
    assert!(out.join("DONE_00000006").exists() && out.join("curves.png").exists());
    // The same in bf16: samples (the KV-cached path), validation, HellaSwag and a bf16
    // checkpoint (a version-5 model file), all on the device.
    let o = train(
        "out16",
        &["--precision", "bf16", "-h", "1", "--hellaswag-data", hs.to_str().unwrap(), "--hellaswag-limit", "2"],
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("generating:") && stdout.contains("HellaSwag: "), "{stdout}");
    let log = std::fs::read_to_string(dir.path().join("out16/log.jsonl")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains("train_loss")).count(), 6, "{log}");
    let header = std::fs::read(dir.path().join("out16/model_00000006.bin")).unwrap();
    assert_eq!(i32::from_le_bytes(header[4..8].try_into().unwrap()), 5, "a bf16 model file");
    // The device lost after 20 submissions (each step makes a few): an error naming the GPU,
    // with the checkpoints before it complete; they resume on the CPU.
    let o = Command::new(env!("CARGO_BIN_EXE_llmrs"))
        .env(llmrs::core::env::GPU_TEST_FAULT, "lose-device-after=20")
        .current_dir(dir.path())
        .args(["--device", "gpu", "train", "-i", "train.bin", "-j", "val.bin", "-e", "1x16:2:128", "-b", "2"])
        .args(["-t", "16", "-x", "12", "-v", "0", "-s", "0", "-n", "2", "-o", "lost"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    // llmrs's error: one line holding the whole message, printed once. Only llmrs's own line is
    // read: the Vulkan stack may print lines of its own (`error: XDG_RUNTIME_DIR is invalid or
    // not set in the environment.` where that variable is unset).
    let ours: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: the GPU")).collect();
    assert!(ours.len() == 1 && ours[0].contains("was lost") && ours[0].contains("-y 1"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lost = dir.path().join("lost");
    let done = llmrs::train::checkpoint::latest_checkpoint(&lost).expect("a checkpoint before the fault");
    assert!((2..12).contains(&done), "{done}");
    let o = llmrs()
        .current_dir(dir.path())
        .args(["--device", "cpu", "train", "-i", "train.bin", "-j", "val.bin", "-e", "1x16:2:128", "-b", "2"])
        .args(["-t", "16", "-x", "12", "-v", "0", "-s", "0", "-n", "2", "-o", "lost", "-y", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(llmrs::train::checkpoint::latest_checkpoint(&lost), Some(12));
    // Too little device memory: one line, before any step.
    let o = Command::new(env!("CARGO_BIN_EXE_llmrs"))
        .env(llmrs::core::env::GPU_TEST_FAULT, "memory-limit=1000000")
        .current_dir(dir.path())
        .args(["--device", "gpu", "train", "-i", "train.bin", "-j", "val.bin", "-e", "1x16:2:128", "-o", ""])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("out of GPU memory") && stderr.contains("-b") && stderr.contains("--device cpu"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("step "), "no step was taken");
}

#[test]
fn gpu_bench_reports_the_adapter_and_time_per_layer_kind() {
    let Some(dev) = gpu("gpu_bench_reports_the_adapter_and_time_per_layer_kind") else { return };
    let r = llmrs::train::bench::run(&llmrs::train::bench::BenchConfig {
        model: "1x16:2:16".into(),
        batch_size: 2,
        seq_len: 8,
        steps: 2,
        warmup: 1,
        device: dev,
        zero_stage: 0,
        recompute: 1,
        ce_rows: 0,
        lora: 0,
        lora_targets: vec![],
        precision: llmrs::core::config::Precision::Fp32,
        master_weights: true,
    })
    .unwrap();
    assert!(r.backend.starts_with("gpu: fp32 WGSL kernels"), "{}", r.backend);
    assert!(r.ms_min <= r.ms_median && r.ms_median <= r.ms_max && r.tokens_per_s > 0.0);
    assert!(r.mfu.is_none() && r.peak_gflops.is_none(), "no CPU peak for a GPU");
    let phases: f64 = r.phases.iter().map(|x| x.1).sum();
    assert!((phases - 1.0).abs() < 1e-9);
    // Timestamp queries (lavapipe has them): every kind that runs is charged some time.
    let be = llmrs::backend::gpu::GpuBackend::open(Default::default()).unwrap();
    if be.timestamps() {
        let kinds: f64 = r.kinds.iter().map(|x| x.1).sum();
        assert!(kinds > 0.05 && kinds <= 1.0 + 1e-9, "{:?}", r.kinds);
        for k in ["matmul", "attention", "classifier", "optimizer", "layernorm"] {
            assert!(r.kinds.iter().any(|(n, s)| n == k && *s > 0.0), "{k}: {:?}", r.kinds);
        }
    }
    assert!(r.to_string().contains("not measured on a GPU"));
    // In bf16: the activations in half the bytes, the f32 copies the ops computed on counted
    // as buffers, and no bf16 peak claimed for the device.
    let r16 = llmrs::train::bench::run(&llmrs::train::bench::BenchConfig {
        model: "1x16:2:16".into(),
        batch_size: 2,
        seq_len: 8,
        steps: 1,
        warmup: 1,
        device: dev,
        zero_stage: 0,
        recompute: 1,
        ce_rows: 0,
        lora: 0,
        lora_targets: vec![],
        precision: llmrs::core::config::Precision::Bf16,
        master_weights: true,
    })
    .unwrap();
    let (m32, m16) = (r.memory_per_rank, r16.memory_per_rank);
    assert_eq!(2 * m16.activations_logits, m32.activations_logits);
    assert!(m16.buffers > 0 && m32.buffers == 0, "{r16}");
    assert!(r16.to_string().contains("peak bf16   not measured on a GPU"), "{r16}");
}

/// Recompute on the GPU: -r 1 and -r 2 refill the shared buffers with the forward's own
/// kernels, so losses and gradients are the same bits as -r 0 over two steps (GPT-2 and a
/// Qwen3 block, which has every Llama-style call and the heads' norm).
#[test]
fn gpu_recompute_gives_the_same_bits() {
    let Some(dev) = gpu("gpu_recompute_gives_the_same_bits") else { return };
    let (b, t) = (2, 5);
    for desc in ["2x16:2:16", "qwen3:2x16:2:1:8:24:16"] {
        let cfg = ModelConfig { vocab_size: 61, padded_vocab_size: 64, ..ModelConfig::from_descriptor(desc).unwrap() };
        let runs: Vec<(Vec<f32>, Vec<f32>)> = (0..=2)
            .map(|r| {
                let mut m = Model::new(Weights::random(cfg, 9).unwrap(), dev).unwrap();
                m.alloc_training_state().unwrap();
                m.set_recompute(r).unwrap();
                let (mut losses, mut grads) = (vec![], vec![]);
                for step in 0..2 {
                    let inputs: Vec<u32> = (0..b * t).map(|i| ((i * 7 + step) % 61) as u32).collect();
                    let targets: Vec<u32> = (0..b * t).map(|i| ((i * 3 + 1) % 61) as u32).collect();
                    m.zero_grad().unwrap();
                    m.forward(&inputs, Some(&targets), b, t).unwrap();
                    losses.extend(m.losses().unwrap());
                    m.backward(1.0).unwrap();
                    grads.extend(m.read_all(Slot::Grads).unwrap());
                    m.update(&OptimConfig::default(), 1e-2, step + 1, SkipAbove::NON_FINITE).unwrap();
                }
                (losses, grads)
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, run) in runs.iter().enumerate().skip(1) {
            assert!(bits(&run.0) == bits(&runs[0].0), "{desc}: -r {r} changed a loss on the GPU");
            assert!(bits(&run.1) == bits(&runs[0].1), "{desc}: -r {r} changed a gradient on the GPU");
        }
    }
}

/// The chunked classifier on the GPU: chunks of 3 and 13 of 14 rows (the last cut around a
/// single row) give the unchunked losses bit for bit, its logits and gradients
/// within rounding (the head's gradient adds its chunks in another order), and follow the CPU.
#[test]
fn gpu_chunked_classifier_matches_the_whole_and_the_cpu() {
    let Some(dev) = gpu("gpu_chunked_classifier_matches_the_whole_and_the_cpu") else { return };
    let (b, t) = (2, 7);
    let cfg =
        ModelConfig { vocab_size: 301, padded_vocab_size: 320, ..ModelConfig::from_descriptor("2x16:2:16").unwrap() };
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 7 % 301) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 89 % 301) as u32).collect();
    let run = |dev: Device, rows: usize| {
        let mut m = Model::new(Weights::random(cfg, 4).unwrap(), dev).unwrap();
        m.alloc_training_state().unwrap();
        m.set_classifier_rows(rows).unwrap();
        m.forward(&inputs, None, b, t).unwrap();
        let logits: Vec<f32> = (0..b * t).flat_map(|r| m.logits_at(r).unwrap()).collect();
        m.forward(&inputs, Some(&targets), b, t).unwrap();
        let losses = m.losses().unwrap();
        m.backward(1.0).unwrap();
        (logits, losses, m.read_all(Slot::Grads).unwrap())
    };
    let whole = run(dev, 0);
    let cpu = run(Device::Cpu, 3);
    for rows in [3, 13] {
        let part = run(dev, rows);
        compare(&part.0, &whole.0, 1e-5, "logits, chunked against whole");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&part.1) == bits(&whole.1), "losses in chunks of {rows}");
        compare(&part.2, &whole.2, 1e-4, "gradients, chunked against whole");
        compare(&part.1, &cpu.1, 1e-5, "losses, GPU against CPU");
        compare(&part.2, &cpu.2, 1e-4, "gradients, GPU against CPU");
    }
}

/// A random init drawn in place on the GPU (Model::init_random into untouched zero weights)
/// gives Weights::random's parameters: in fp32 to the bit, in bf16 with and without master
/// weights rounded to nearest, as on the CPU (tensors starting mid-word included: the GPT-2
/// shape's odd-length tensors).
#[test]
fn gpu_random_init_in_place_equals_random_weights() {
    let Some(dev) = gpu("gpu_random_init_in_place_equals_random_weights") else { return };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    use llmrs::core::bf16::{from_f32, to_f32};
    let round = |v: &[f32]| v.iter().map(|&x| to_f32(from_f32(x))).collect::<Vec<_>>();
    for desc in ["2x16:2:16", "llama:2x32:4:2"] {
        let cfg = ModelConfig { vocab_size: 61, padded_vocab_size: 64, ..ModelConfig::from_descriptor(desc).unwrap() };
        let want = Weights::random(cfg, 5).unwrap();
        for (precision, master) in [(Precision::Fp32, true), (Precision::Bf16, true), (Precision::Bf16, false)] {
            let mut m = Model::new(Weights::zeros(cfg).unwrap(), dev).unwrap();
            m.set_precision(precision, master).unwrap();
            m.init_random(5).unwrap();
            let w = if precision == Precision::Fp32 { want.data.clone() } else { round(&want.data) };
            assert!(bits(&m.weights().unwrap().data) == bits(&w), "{desc} {precision} -w {master} on the GPU");
        }
    }
}

//! The default run (`llmrs train` with no flags: the tiny GPT-2, 500 steps of B=4 x T=64 on
//! Tiny Shakespeare) with `--precision bf16` ends within 1.5% of the fp32 run's last val loss.
//! The fp32 run's output is tests/fixtures/default_run_fp32.txt (made by `llmrs train`); this
//! test first checks that today's default run is still that run (its validation at step 0 and
//! its first three steps, whose learning rates do not depend on the run's length), then runs
//! the whole default run in bf16, validating at its start and end only. About a minute on 2
//! cores with AVX512_BF16, four on an AVX2-only Zen 1, so the NaN-checking and portable passes
//! of .ci/run skip it (their subjects are memory reads and kernels, which the shorter bf16
//! tests cover).

use llmrs::core::config::Precision;
use llmrs::data::prepare::{prepare_tinyshakespeare, Source};
use llmrs::train::{run, TrainConfig};

/// The default run's settings, on shards prepared in `dir`, printing nothing and sampling
/// nothing (sampling reads the model and changes nothing the losses depend on).
fn default_run(dir: &std::path::Path) -> TrainConfig {
    let src = Source { file: None, data_dir: Some(llmrs::testdata::data_dir_with_tinyshakespeare()), url: "" };
    let (train, val) = prepare_tinyshakespeare(&src, &dir.join("data")).unwrap();
    TrainConfig {
        train_data: train.to_str().unwrap().into(),
        val_data: val.to_str().unwrap().into(),
        output_dir: None,
        sample_every: 0,
        quiet: true,
        ..TrainConfig::default()
    }
}

#[test]
fn default_run_in_bf16_ends_within_1_5_percent_of_fp32() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/default_run_fp32.txt")).unwrap();
    let want_val: Vec<f32> =
        text.lines().filter_map(|l| l.strip_prefix("val loss ")).map(|v| v.trim().parse().unwrap()).collect();
    let want_train: Vec<f32> = text
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split("| loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!((want_val.len(), want_train.len()), (11, 500), "the fixture holds a whole default run");

    let dir = tempfile::tempdir().unwrap();
    let cfg = default_run(dir.path());
    assert_eq!(cfg.max_steps, Some(500), "the default run's length changed: remake the fixture");

    // Still the run of the fixture: the same first losses (to 1e-4: the fixture's host had
    // AVX-512; other kernels sum in other orders).
    let head = run(&TrainConfig { max_steps: Some(3), ..cfg.clone() }).unwrap();
    let (s0, v0) = head.val_losses[0];
    assert_eq!(s0, 0);
    assert!((v0 - want_val[0]).abs() < 1e-4, "val at step 0: {v0} vs the fixture's {}", want_val[0]);
    for (i, (&(_, g), w)) in head.train_losses.iter().zip(&want_train).enumerate() {
        assert!((g - w).abs() < 1e-4, "fp32 step {}: {g} vs the fixture's {w}: remake the fixture", i + 1);
    }
    assert_eq!(head.train_losses.len(), 3);

    // Validating only at the start and the end: the validations between read the val split
    // and change nothing the training depends on (on a Zen 1 this test took 257 s with them,
    // 234-239 s without).
    let bf16 = run(&TrainConfig { precision: Precision::Bf16, val_every: 500, ..cfg }).unwrap();
    assert_eq!(bf16.train_losses.len(), 500);
    assert_eq!(bf16.val_losses.len(), 2, "validations: {:?}", bf16.val_losses);
    let (step, got) = *bf16.val_losses.last().unwrap();
    let want = *want_val.last().unwrap();
    assert_eq!(step, 500);
    assert!(got.is_finite());
    let rel = (got - want).abs() / want;
    eprintln!("default run: last val loss bf16 {got:.6}, fp32 {want:.6} ({:.3}% apart)", 100.0 * rel);
    assert!(rel <= 0.015, "bf16 last val loss {got} is {:.2}% from fp32's {want} (bar 1.5%)", 100.0 * rel);
}

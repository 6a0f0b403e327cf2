//! End-to-end training runs on small shapes: exact resume, learning, bad input.

mod common;

use llmrs::core::config::Precision;
use llmrs::core::files::Dtype;
use llmrs::train::schedule::ScheduleKind;
use llmrs::train::{run, TrainConfig};
use std::path::Path;

/// The shards every test here trains on.
fn make_data(dir: &Path) -> (String, String) {
    common::make_data(dir, 12345, 3000, 600)
}

/// In `dir`: a model file of descriptor `desc`'s shape with a vocabulary of 600, its tokenizer
/// beside it (a byte-level BPE of 600 tokens, whose samples start from its id 1), and data
/// below 600. The same sharding, classifier and sampling paths as with GPT-2's 50,257 tokens,
/// whose classifier took most of the time of the tests that compare ranks with one process.
/// (model, train, val).
fn small_vocab(dir: &Path, desc: &str) -> (String, String, String) {
    let (train, val) = common::make_data_below(dir, 12345, 3000, 600, 600);
    let model = common::small_vocab_model(dir, desc);
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers/bytelevel.json");
    std::fs::copy(tokenizer, dir.join("tokenizer.json")).unwrap();
    (model, train, val)
}

fn small(dir: &Path, train: &str, val: &str) -> TrainConfig {
    TrainConfig {
        train_data: train.into(),
        val_data: val.into(),
        model: "2x32:2:32".into(),
        output_dir: Some(dir.to_path_buf()),
        batch_size: 2,
        seq_len: 16,
        total_batch_size: Some(64), // 2 micro-batches per step
        learning_rate: 3e-3,
        warmup: 2,
        max_steps: Some(12),
        val_every: 4,
        val_max_steps: Some(2),
        sample_every: 0,
        quiet: true,
        ..TrainConfig::default()
    }
}

#[test]
fn stopped_and_resumed_run_is_bit_identical() {
    // GPT-2 (llm.c's model file) and Qwen3 (llmrs's own model file) checkpoints alike.
    for model in ["2x32:2:32", "qwen3:2x32:4:2:16:64:32"] {
        stopped_and_resumed(model, TrainConfig::default());
    }
    // An fp32 run whose checkpoints' model files are bf16 (--save-dtype bf16): its state file
    // keeps the fp32 parameters the model file rounds.
    stopped_and_resumed("2x32:2:32", TrainConfig { save_dtype: Dtype::BF16, ..Default::default() });
}

/// bf16 runs resume bit-identically too: the model file holds the bf16 working copy (version
/// 5), the state file the fp32 master weights (or, with -w 0, nothing more: the stochastic
/// rounding's seed is the step's).
#[test]
fn stopped_and_resumed_bf16_run_is_bit_identical() {
    for (model, master_weights) in [("2x32:2:32", true), ("llama:2x32:4:2:64:32", true), ("2x32:2:32", false)] {
        let bf16 =
            TrainConfig { precision: Precision::Bf16, master_weights, save_dtype: Dtype::BF16, ..Default::default() };
        stopped_and_resumed(model, bf16);
    }
}

fn stopped_and_resumed(model: &str, how: TrainConfig) {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let out = dir.path().join("run");
    let cfg = TrainConfig {
        model: model.into(),
        checkpoint_every: 5,
        schedule: ScheduleKind::Cosine,
        precision: how.precision,
        master_weights: how.master_weights,
        save_dtype: how.save_dtype,
        ..small(&out, &train, &val)
    };
    let full = run(&cfg).unwrap();
    assert_eq!(full.train_losses.len(), 12);
    for s in [5, 10, 12] {
        assert!(out.join(format!("DONE_{s:08}")).exists(), "checkpoint {s}");
    }
    // Simulate a crash right after the step-5 checkpoint: later checkpoints never happened.
    for s in [10, 12] {
        for f in [format!("DONE_{s:08}"), format!("model_{s:08}.bin"), format!("state_{s:08}_00000.bin")] {
            std::fs::remove_file(out.join(f)).unwrap();
        }
    }
    let resumed = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap();
    assert_eq!(resumed.train_losses.len(), 7, "steps 5..11 run again");
    for ((s1, l1), (s2, l2)) in full.train_losses[5..].iter().zip(&resumed.train_losses) {
        assert_eq!(s1, s2);
        assert_eq!(l1.to_bits(), l2.to_bits(), "step {s1}: {l1} vs {l2}");
    }
    let tail: Vec<_> = full.val_losses.iter().filter(|(s, _)| *s > 5).collect();
    let rtail: Vec<_> = resumed.val_losses.iter().filter(|(s, _)| *s > 5).collect();
    assert_eq!(tail, rtail);
    // The JSON log kept steps 0..4 of the first run and has steps 5..11 once each, as the
    // uninterrupted run wrote them (the first run's later lines were dropped on resume).
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let train: Vec<(usize, f32)> = lines
        .iter()
        .filter(|v| v.get("train_loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap() as usize, v["train_loss"].as_f64().unwrap() as f32))
        .collect();
    let want = full.train_losses.clone();
    assert_eq!(train, want);
    let val_steps: Vec<u64> =
        lines.iter().filter(|v| v.get("val_loss").is_some()).map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(val_steps, [0, 4, 8, 12]);
}

#[test]
fn overfitting_one_batch_drives_the_loss_down() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let cfg = TrainConfig {
        overfit_single_batch: true,
        max_steps: Some(30),
        total_batch_size: None,
        output_dir: None,
        schedule: ScheduleKind::Constant,
        ..small(dir.path(), &train, &val)
    };
    let s = run(&cfg).unwrap();
    let (first, last) = (s.train_losses[0].1, s.train_losses.last().unwrap().1);
    assert!(first > 10.0, "random init starts near ln(50257) = 10.8, got {first}");
    assert!(last < first * 0.6, "loss {first} -> {last}");
}

#[test]
fn bad_settings_and_data_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let base = small(dir.path(), &train, &val);
    let err = |c: TrainConfig| format!("{:#}", run(&c).unwrap_err());
    assert!(err(TrainConfig { total_batch_size: Some(50), ..base.clone() }).contains("multiple of B*T"));
    assert!(err(TrainConfig { seq_len: 64, total_batch_size: None, ..base.clone() }).contains("max_seq_len"));
    assert!(err(TrainConfig { model: "d7".into(), ..base.clone() }).contains("unsupported GPT-2 depth"));
    assert!(err(TrainConfig { train_data: "/nonexistent/x*.bin".into(), ..base.clone() }).contains("no token files"));
    // A vocabulary smaller than the data's token ids.
    let m = dir.path().join("small_vocab.bin");
    let mut cfg = llmrs::core::config::ModelConfig::from_descriptor("1x8:2:16").unwrap();
    cfg.vocab_size = 50;
    cfg.padded_vocab_size = 128;
    llmrs::formats::llmc::save_model(
        &llmrs::core::params::Weights::random(cfg, 1).unwrap(),
        &m,
        llmrs::core::files::Dtype::F32,
    )
    .unwrap();
    assert!(err(TrainConfig { model: m.to_str().unwrap().into(), ..base.clone() }).contains("out of range"));
    // Data that fits that vocabulary, but samples that would start from GPT-2's <|endoftext|>
    // (id 50256, the tokenizer's as the model has no tokenizer.json): refused before the first
    // step, with nothing written, where the run used to stop at its first sample.
    let (tr50, va50) = (dir.path().join("train50.bin"), dir.path().join("val50.bin"));
    llmrs::data::loader::write_shard(&tr50, &(0..3000).map(|i| (i * 7 % 50) as u32).collect::<Vec<_>>()).unwrap();
    llmrs::data::loader::write_shard(&va50, &(0..600).map(|i| (i * 3 % 50) as u32).collect::<Vec<_>>()).unwrap();
    let out = dir.path().join("sampling");
    let fits = TrainConfig {
        model: m.to_str().unwrap().into(),
        train_data: tr50.to_str().unwrap().into(),
        val_data: va50.to_str().unwrap().into(),
        sample_every: 4,
        checkpoint_every: 2,
        output_dir: Some(out.clone()),
        ..base.clone()
    };
    let e = err(fits.clone());
    assert!(
        e.contains("-s 4") && e.contains("id 50256") && e.contains("vocabulary of 50") && e.contains("-s 0"),
        "{e}"
    );
    assert_eq!(llmrs::train::checkpoint::latest_checkpoint(&out), None, "a refused run wrote a checkpoint");
    // Without samples (or with one token, which needs no forward pass) it trains.
    for (sample_every, gen_tokens) in [(0, 64), (4, 1)] {
        let s = run(&TrainConfig { sample_every, gen_tokens, overwrite: true, ..fits.clone() }).unwrap();
        assert_eq!(s.train_losses.len(), 12);
    }
    // A learning rate that blows up is reported, not trained through.
    let e = err(TrainConfig {
        learning_rate: 1e30,
        optim: llmrs::model::optim::OptimConfig { grad_clip: 0.0, ..Default::default() },
        warmup: 0,
        max_steps: Some(5),
        ..base.clone()
    });
    assert!(e.contains("diverged") || e.contains("no longer finite"), "{e}");
    // One that explodes to huge but finite losses (1e17 seen before this check) is stopped
    // too, and the checkpoints it wrote before then are finite.
    let out = dir.path().join("exploding");
    let e = err(TrainConfig {
        learning_rate: 1e8,
        optim: llmrs::model::optim::OptimConfig { grad_clip: 0.0, ..Default::default() },
        warmup: 0,
        max_steps: Some(30),
        checkpoint_every: 1,
        output_dir: Some(out.clone()),
        ..base
    });
    assert!(e.contains("more than twice the") && e.contains("diverged"), "{e}");
    let last = llmrs::train::checkpoint::latest_checkpoint(&out).expect("checkpoints before the explosion");
    assert!(last < 30, "ran to the end");
    let w = llmrs::formats::llmc::load_model(&out.join(format!("model_{last:08}.bin"))).unwrap();
    assert!(w.data.iter().all(|x| x.is_finite()));
}

/// llm.c's -sl: after the 128-step window fills, a step whose loss is a z-score outlier is
/// skipped (logged, parameters unchanged) and the run goes on.
#[test]
fn outlier_steps_are_skipped_with_sl() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let out = dir.path().join("run");
    // A flat loss (tiny learning rate: only the batches' noise moves it) and a very low
    // threshold: once the window is full, steps above about the window's mean are skipped.
    let cfg = TrainConfig {
        learning_rate: 1e-6,
        skip_loss_z: 0.01,
        max_steps: Some(140),
        val_every: 0,
        total_batch_size: None,
        ..small(&out, &train, &val)
    };
    let s = run(&cfg).unwrap();
    assert_eq!(s.train_losses.len(), 140);
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let skipped: Vec<u64> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("skipped").is_some())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert!(skipped.len() >= 2 && skipped.iter().all(|&s| s >= 128), "{skipped:?}");
    // Off by default: the same run skips nothing.
    let s2 = run(&TrainConfig { skip_loss_z: 0.0, output_dir: None, ..cfg }).unwrap();
    assert_eq!(s2.train_losses[..128], s.train_losses[..128]);
}

#[test]
fn hellaswag_during_training_is_logged_at_validation_steps() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let ex: Vec<llmrs::infer::hellaswag::Example> = (0..6u32)
        .map(|i| llmrs::infer::hellaswag::Example {
            label: (i % 4) as usize,
            ctx: vec![i, i + 1, i + 2],
            endings: (0..4).map(|k| vec![10 + k, 20 + i]).collect(),
        })
        .collect();
    let hs = dir.path().join("hellaswag_val.bin");
    llmrs::infer::hellaswag::write_bin(&hs, &ex).unwrap();
    let out = dir.path().join("out");
    let cfg =
        TrainConfig { hellaswag: true, hellaswag_data: Some(hs), max_steps: Some(8), ..small(&out, &train, &val) };
    let s = run(&cfg).unwrap();
    assert_eq!(s.hellaswag.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 8]);
    assert!(s.hellaswag.iter().all(|(_, a)| (0.0..=1.0).contains(a) && (a * 6.0).fract() == 0.0));
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains("\"hellaswag\"")).count(), 2);
}

/// `world` ranks of a run on threads (`local_group`), each rank's summary in rank order.
fn ranks_on_threads(cfg: &TrainConfig, world: usize) -> Vec<llmrs::train::RunSummary> {
    let ranks: Vec<_> = llmrs::backend::comm::local_group(world)
        .into_iter()
        .map(|comm| {
            let cfg = cfg.clone();
            std::thread::spawn(move || llmrs::train::run_with(&cfg, Box::new(comm)).unwrap())
        })
        .collect();
    ranks.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Ranks on threads (`local_group`), each reading its part of every batch as llm.c splits it,
/// train as one process with the whole batch, at every ZeRO stage and for 2 and 4 ranks: the
/// same train and val losses at every step and the same parameters after the last, up to the
/// order of float sums (gradients are averaged over ranks and micro-batches differently). The
/// sharded AdamW state, put back together from the ranks' state files in llm.c's shard layout,
/// is the one process's. For GPT-2 and for a Llama model (grouped-query attention, no biases:
/// the families' different tensors shard alike).
#[test]
fn ranks_train_as_one_process_with_the_whole_batch_at_every_zero_stage() {
    ranks_equal_one_process("2x32:2:32", &[2, 4]);
}

#[test]
fn llama_ranks_train_as_one_process_at_every_zero_stage() {
    ranks_equal_one_process("llama:2x32:4:2:64:32", &[2]);
}

/// Qwen3's head norms (per-layer tensors of HS) and a head size of its own (QD != C) shard as
/// the rest; Qwen2's biases on q, k, v only.
#[test]
fn qwen_ranks_train_as_one_process_at_every_zero_stage() {
    ranks_equal_one_process("qwen3:2x32:4:2:16:64:32", &[2]);
    ranks_equal_one_process("qwen2:2x32:4:2:64:32", &[2]);
}

/// The memory savers under every ZeRO stage: -r 2 (the MLP activation and the norms' outputs
/// recomputed) and the fused classifier in chunks of 5 rows (the head's gradient
/// written chunk by chunk into the bucket of ZeRO-2/3, from gathered weights under ZeRO-3).
#[test]
fn ranks_with_recompute_and_a_chunked_classifier_train_as_one_process() {
    ranks_equal_one_process_with("2x32:2:32", &[2], 2, 5);
    ranks_equal_one_process_with("qwen3:2x32:4:2:16:64:32", &[2], 2, 5);
}

fn ranks_equal_one_process(model: &str, worlds: &[usize]) {
    ranks_equal_one_process_with(model, worlds, TrainConfig::default().recompute, TrainConfig::default().ce_rows)
}

fn ranks_equal_one_process_with(model: &str, worlds: &[usize], recompute: u8, ce_rows: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (file, train, val) = small_vocab(dir.path(), model);
    let base = TrainConfig {
        batch_size: 2,
        total_batch_size: Some(128), // 2 micro-batches per step with 2 ranks, 1 with 4
        max_steps: Some(20),
        val_every: 5,
        checkpoint_every: 20,
        sample_every: 10,
        gen_tokens: 6,
        model: file,
        recompute,
        ce_rows,
        ..small(dir.path(), &train, &val)
    };
    // Each rank reads B=2 rows of every batch; one process reads all B = 2 * world of them.
    let run_ranks = |world: usize, stage: usize, b: usize| {
        let out = dir.path().join(format!("w{world}z{stage}b{b}"));
        let cfg = TrainConfig { output_dir: Some(out.clone()), zero_stage: stage, batch_size: b, ..base.clone() };
        (ranks_on_threads(&cfg, world), out)
    };
    let load = |d: &Path| llmrs::formats::llmc::load_model(&d.join("model_00000020.bin")).unwrap();
    let close = |a: f32, b: f32, tol: f32| (a - b).abs() <= tol * b.abs().max(1.0);
    for &world in worlds {
        let (one, one_dir) = run_ranks(1, 0, 2 * world);
        let one = &one[0];
        assert_eq!(one.train_losses.len(), 20);
        // Training moved the loss, so agreement is not that of two untrained models.
        assert!(one.train_losses[19].1 < one.train_losses[0].1 - 0.5, "{:?}", one.train_losses);
        let one_params = load(&one_dir).data;
        let mut one_model = llmrs::model::Model::new(load(&one_dir), llmrs::backend::Device::Cpu).unwrap();
        one_model.alloc_training_state().unwrap();
        llmrs::train::checkpoint::load_state(&one_dir.join("state_00000020_00000.bin"), &mut one_model).unwrap();
        let one_m = one_model.read_all(llmrs::model::Slot::AdamM).unwrap();
        for stage in 0..=3 {
            let (runs, out) = run_ranks(world, stage, 2);
            let what = format!("{model} -r {recompute} --ce-rows {ce_rows}: {world} ranks, ZeRO-{stage}");
            for r in &runs {
                assert_eq!(r.train_losses.len(), one.train_losses.len());
                for ((s, a), (_, b)) in r.train_losses.iter().zip(&one.train_losses) {
                    assert!(close(*a, *b, 1e-5), "{what}, step {s}: train loss {a} vs {b} on one process");
                }
                // Sampling runs the KV-cached pass on every rank (gathering weights under ZeRO-3).
                assert_eq!(r.samples, one.samples, "{what}: samples");
                assert_eq!(r.val_losses.len(), one.val_losses.len());
                for ((s, a), (_, b)) in r.val_losses.iter().zip(&one.val_losses) {
                    assert!(close(*a, *b, 1e-5), "{what}, step {s}: val loss {a} vs {b} on one process");
                }
            }
            let params = load(&out).data;
            let worst = params
                .iter()
                .zip(&one_params)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, common::nan_max);
            // 20 AdamW steps at lr 3e-3 turn the gradients' rounding differences into parameter
            // differences (AdamW divides by the gradient's scale, so a parameter whose gradient
            // is near zero moves by up to lr whatever the gradient's last bits): with the
            // portable GEMM (the gemm crate, whose summation order depends on the batch size) on
            // a 2-core AVX2 host the worst is 2.3e-5, so the bar is 5e-5.
            assert!(worst <= 5e-5, "{what}: a parameter differs by {worst} after the last step");
            // AdamW's first moment: rank r's file holds part r of every piece.
            let mut m = vec![f32::NAN; one_m.len()];
            for rank in 0..world {
                let z = llmrs::model::zero::Sharding::new(stage, rank, world, load(&out).config).unwrap();
                let bytes = std::fs::read(out.join(format!("state_00000020_{rank:05}.bin"))).unwrap();
                let mine = |i: usize| f32::from_le_bytes(bytes[1024 + 4 * i..1028 + 4 * i].try_into().unwrap());
                for p in z.pieces() {
                    let (src, dst) = if stage == 0 { (p.full.clone(), p.full) } else { (p.shard, p.owned) };
                    for (d, s) in dst.zip(src) {
                        m[d] = mine(s);
                    }
                }
            }
            let worst = m.iter().zip(&one_m).map(|(a, b)| (a - b).abs()).fold(0f32, common::nan_max);
            let scale = one_m.iter().fold(0f32, |x, b| x.max(b.abs()));
            assert!(worst <= 1e-4 * scale, "{what}: AdamW m differs by {worst} (largest {scale})");
        }
    }
}

/// A fresh run does not mix with an earlier run's checkpoints, and a checkpoint whose state
/// file is another step's is refused, not resumed at the wrong step.
#[test]
fn the_output_directory_is_guarded() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let out = dir.path().join("run");
    let cfg = TrainConfig { checkpoint_every: 5, max_steps: Some(10), ..small(&out, &train, &val) };
    run(&cfg).unwrap();
    let err = |c: &TrainConfig| format!("{:#}", run(c).unwrap_err());
    let e = err(&cfg);
    assert!(e.contains("holds checkpoints of an earlier run") && e.contains("-y 1"), "{e}");
    assert!(out.join("DONE_00000010").exists(), "refusing deleted the earlier run");
    // A state file from another step in the newest checkpoint.
    std::fs::copy(out.join("state_00000005_00000.bin"), out.join("state_00000010_00000.bin")).unwrap();
    let e = err(&TrainConfig { resume: true, ..cfg.clone() });
    assert!(e.contains("holds the state of step 5, not of checkpoint 10"), "{e}");
    // --overwrite starts afresh: the old checkpoints are gone, the new ones are there.
    let again = run(&TrainConfig { overwrite: true, checkpoint_every: 3, max_steps: Some(4), ..cfg.clone() }).unwrap();
    assert_eq!(again.train_losses.len(), 4);
    assert_eq!(llmrs::train::checkpoint::latest_checkpoint(&out), Some(4));
    assert!(!out.join("model_00000005.bin").exists() && out.join("model_00000003.bin").exists());
}

/// A kill between the newest checkpoint and the `-nk` deletions after it: resuming deletes
/// what should have gone, even when there is no step left to run.
#[test]
fn resuming_finishes_the_deletions_a_kill_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let out = dir.path().join("run");
    let cfg = TrainConfig { checkpoint_every: 1, checkpoints_keep: 2, max_steps: Some(6), ..small(&out, &train, &val) };
    run(&cfg).unwrap();
    let steps = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("DONE_") || n.starts_with("model_") || n.starts_with("state_"))
            .collect();
        v.sort();
        v
    };
    let kept = steps();
    assert_eq!(kept.len(), 6, "{kept:?}"); // steps 5 and 6
                                           // Checkpoint 4 as if its deletion never happened, and a half-deleted 3 (DONE gone).
    for (from, to) in [("00000005", "00000004"), ("00000005", "00000003")] {
        for (a, b) in [("model_", ".bin"), ("state_", "_00000.bin")] {
            std::fs::copy(out.join(format!("{a}{from}{b}")), out.join(format!("{a}{to}{b}"))).unwrap();
        }
    }
    std::fs::write(out.join("DONE_00000004"), b"").unwrap();
    let resumed = run(&TrainConfig { resume: true, ..cfg }).unwrap();
    assert!(resumed.train_losses.is_empty(), "nothing left to run");
    assert_eq!(steps(), kept);
}

/// Every file of a directory with its bytes, to show that a refused run changed nothing.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

/// Resuming with -x below the checkpoint's step used to run past the end forever (step 67/2
/// and on), writing checkpoints and, with -nk, deleting the good one. It is refused in one
/// line before anything in the directory changes; -x at the checkpoint's step ends at once.
#[test]
fn resuming_past_the_last_step_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    for model in ["2x32:2:32", "llama:2x32:4:2:64:32", "qwen3:2x32:4:2:16:64:32"] {
        let out = dir.path().join(model.replace(':', "_"));
        let cfg = TrainConfig {
            model: model.into(),
            checkpoint_every: 2,
            checkpoints_keep: 1,
            max_steps: Some(4),
            ..small(&out, &train, &val)
        };
        run(&cfg).unwrap();
        let before = snapshot(&out);
        assert!(before.iter().any(|(n, _)| n == "model_00000004.bin"));
        let e = format!("{:#}", run(&TrainConfig { resume: true, max_steps: Some(2), ..cfg.clone() }).unwrap_err());
        assert!(e.contains("checkpoint 4") && e.contains("-x 4 or more") && !e.contains('\n'), "{e}");
        assert!(snapshot(&out) == before, "{model}: the refused resume changed the output directory");
        let same = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap();
        assert!(same.train_losses.is_empty(), "{model}: resumed at its last step, nothing to run");
        assert!(out.join("model_00000004.bin").exists());
    }
}

/// A LoRA run (GPT-2's, Llama's, Qwen2's and Qwen3's projections): its checkpoints hold the adapters (not the
/// base), a resume from one gives the same losses bit for bit, the base never changes, and the
/// checkpoint loads as the merged model and converts to PEFT's files.
#[test]
fn a_lora_run_trains_only_its_adapters_and_resumes_bit_identically() {
    for model in ["2x32:2:32", "llama:2x32:4:2:16", "qwen2:2x32:4:2:64:32", "qwen3:2x32:4:2:16:64:32"] {
        let dir = tempfile::tempdir().unwrap();
        let (train, val) = make_data(dir.path());
        let out = dir.path().join("run");
        let cfg = TrainConfig {
            model: model.into(),
            checkpoint_every: 5,
            lora: 4,
            lora_alpha: Some(16.0),
            learning_rate: 1e-2,
            ..small(&out, &train, &val)
        };
        let full = run(&cfg).unwrap();
        assert_eq!(full.train_losses.len(), 12);
        let mean = |r: std::ops::Range<usize>| full.train_losses[r].iter().map(|x| x.1).sum::<f32>() / 4.0;
        assert!(mean(8..12) < mean(0..4) - 0.01, "{model}: LoRA did not learn: {:?}", full.train_losses);
        let ckpt = out.join("model_00000012.bin");
        assert!(llmrs::formats::lora::is_checkpoint(&ckpt));
        let (cfg12, a12, base) = llmrs::formats::lora::load_checkpoint(&ckpt).unwrap();
        assert_eq!(base.source, model);
        let base_w = llmrs::source::load_any(model, 42).unwrap();
        assert_eq!(base.hash, llmrs::core::params::weights_hash(&base_w));
        assert!(cfg12.same_shape(&base_w.config));
        assert_eq!((a12.r, a12.alpha), (4, 16.0));
        // The file holds the adapters only: a small fraction of the model.
        let size = std::fs::metadata(&ckpt).unwrap().len() as usize;
        assert!(size < 1024 * 8 + 4 * a12.num_parameters() + 4096, "{size} bytes");
        // Loaded as a model it is the merge of base and adapters, which a run's last validation saw.
        let merged = llmrs::source::load_any(ckpt.to_str().unwrap(), 0).unwrap();
        let mut m = llmrs::model::Model::new(merged, llmrs::backend::Device::Cpu).unwrap();
        let mut v = llmrs::data::loader::DataLoader::new(&val, 2, 16, 50257, false).unwrap();
        let mut loss = 0.0;
        for _ in 0..2 {
            v.next_batch().unwrap();
            loss += m.loss(&v.inputs, &v.targets, 2, 16).unwrap() / 2.0;
        }
        let last_val = full.val_losses.last().unwrap().1;
        assert!((loss - last_val).abs() < 1e-4 * last_val, "{model}: merged {loss} vs the run's {last_val}");
        // Resume from step 5 after a crash.
        for s in [10, 12] {
            for f in [format!("DONE_{s:08}"), format!("model_{s:08}.bin"), format!("state_{s:08}_00000.bin")] {
                std::fs::remove_file(out.join(f)).unwrap();
            }
        }
        let resumed = run(&TrainConfig { resume: true, lora: 0, lora_alpha: None, ..cfg.clone() }).unwrap();
        assert_eq!(resumed.train_losses.len(), 7);
        for ((s1, l1), (s2, l2)) in full.train_losses[5..].iter().zip(&resumed.train_losses) {
            assert_eq!((s1, l1.to_bits()), (s2, l2.to_bits()), "{model} step {s1}: {l1} vs {l2}");
        }
        assert_eq!(
            llmrs::formats::lora::load_checkpoint(&ckpt).unwrap().1,
            a12,
            "{model}: the same adapters after resuming"
        );
        // A resume on another base is refused, naming both.
        for s in [12] {
            for f in [format!("DONE_{s:08}"), format!("model_{s:08}.bin"), format!("state_{s:08}_00000.bin")] {
                std::fs::remove_file(out.join(f)).unwrap();
            }
        }
        let other = dir.path().join("other.bin");
        let w7 = llmrs::source::load_any(model, 7).unwrap();
        llmrs::formats::llmc::save_model(&w7, &other, llmrs::core::files::Dtype::F32).unwrap();
        let spec = other.to_str().unwrap().to_string();
        let e = format!(
            "{:#}",
            run(&TrainConfig { resume: true, model: spec, model_given: true, ..cfg.clone() }).unwrap_err()
        );
        assert!(e.contains("not the one these adapters were trained on") && e.contains("seed 42"), "{e}");
    }
}

/// LoRA over 2 ranks at every ZeRO stage (the base sharded under ZeRO-3) trains as one
/// process with the whole batch.
#[test]
fn lora_ranks_train_as_one_process_at_every_zero_stage() {
    for model in ["2x32:2:32", "llama:2x32:4:2:16"] {
        let dir = tempfile::tempdir().unwrap();
        let (file, train, val) = small_vocab(dir.path(), model);
        let base = TrainConfig {
            model: file,
            total_batch_size: Some(128),
            max_steps: Some(10),
            checkpoint_every: 10,
            sample_every: 5,
            gen_tokens: 6,
            lora: 4,
            learning_rate: 1e-2,
            ..small(dir.path(), &train, &val)
        };
        let run_ranks = |world: usize, stage: usize, b: usize| {
            let out = dir.path().join(format!("w{world}z{stage}"));
            let cfg = TrainConfig { output_dir: Some(out.clone()), zero_stage: stage, batch_size: b, ..base.clone() };
            let runs = ranks_on_threads(&cfg, world);
            let state = std::fs::metadata(out.join("state_00000010_00000.bin")).unwrap().len() as usize;
            (runs, llmrs::formats::lora::load_checkpoint(&out.join("model_00000010.bin")).unwrap().1, state)
        };
        let (one, one_a, _) = run_ranks(1, 0, 4);
        let mut state0 = 0;
        for stage in 0..=3 {
            let (runs, a, state) = run_ranks(2, stage, 2);
            // ZeRO-1..3: each rank's state file holds half of the adapters' AdamW moments.
            let half = a.num_parameters().div_ceil(2);
            if stage == 0 {
                state0 = state;
            } else {
                assert_eq!(state0 - state, 2 * 4 * half, "{model} ZeRO-{stage}: AdamW state not sharded");
            }
            for r in &runs {
                for ((s, x), (_, y)) in r.train_losses.iter().zip(&one[0].train_losses) {
                    assert!((x - y).abs() <= 1e-5 * y, "{model} ZeRO-{stage} step {s}: {x} vs {y}");
                }
                assert_eq!(r.samples, one[0].samples, "{model} ZeRO-{stage}: samples");
            }
            let worst = a.data.iter().zip(&one_a.data).map(|(x, y)| (x - y).abs()).fold(0f32, common::nan_max);
            assert!(worst <= 1e-4, "{model} ZeRO-{stage}: adapters differ by {worst}");
        }
    }
}

#[test]
fn lora_settings_that_cannot_work_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let base = TrainConfig { model: "llama:2x32:4:2:16".into(), lora: 4, ..small(dir.path(), &train, &val) };
    let err = |c: TrainConfig| format!("{:#}", run(&c).unwrap_err());
    let e = err(TrainConfig { lora_targets: vec!["c_attn".into()], ..base.clone() });
    assert!(e.contains("\"c_attn\"") && e.contains("q_proj") && !e.contains('\n'), "{e}");
    let e = err(TrainConfig { lora: 64, ..base.clone() });
    assert!(e.contains("--lora 64") && e.contains("at most"), "{e}");
    let e = err(TrainConfig { lora: 0, lora_alpha: Some(8.0), ..base.clone() });
    assert!(e.contains("--lora R"), "{e}");
    // An adapter made for another base: its shapes differ.
    let other = llmrs::core::config::ModelConfig::from_descriptor("llama:2x48:4:2:16").unwrap();
    let targets = llmrs::model::lora::select(&other, &[]).unwrap();
    let a = llmrs::model::lora::Adapters::new(2, 4.0, targets, &mut llmrs::core::rng::Mt19937::new(1)).unwrap();
    let peft = dir.path().join("other_adapter");
    llmrs::formats::peft::save(&a, &peft, "x", &other, llmrs::core::files::Dtype::F32).unwrap();
    let e = err(TrainConfig { lora: 0, lora_from: Some(peft), ..base.clone() });
    assert!(e.contains("--lora-from") && e.contains("another base"), "{e}");
    // A PEFT config llmrs cannot honour.
    let cfg = llmrs::source::peek_config("llama:2x32:4:2:16").unwrap().unwrap();
    let dora = dir.path().join("dora");
    let a = llmrs::model::lora::Adapters::new(
        2,
        4.0,
        llmrs::model::lora::select(&cfg, &[]).unwrap(),
        &mut llmrs::core::rng::Mt19937::new(1),
    )
    .unwrap();
    llmrs::formats::peft::save(&a, &dora, "x", &cfg, llmrs::core::files::Dtype::F32).unwrap();
    let j = std::fs::read_to_string(dora.join("adapter_config.json"))
        .unwrap()
        .replace("\"use_dora\": false", "\"use_dora\": true");
    std::fs::write(dora.join("adapter_config.json"), j).unwrap();
    let e = err(TrainConfig { lora: 0, lora_from: Some(dora), ..base });
    assert!(e.contains("use_dora"), "{e}");
}

/// A bf16 checkpoint resumes in an fp32 run (from its fp32 master weights) and an fp32 one in
/// a bf16 run; both go on training, and the bf16 run stays near the fp32 one.
#[test]
fn checkpoints_cross_precisions() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let out = |n: &str| dir.path().join(n);
    let base = |o: &str, precision: Precision| TrainConfig {
        checkpoint_every: 6,
        precision,
        save_dtype: if precision == Precision::Bf16 { Dtype::BF16 } else { Dtype::F32 },
        ..small(&out(o), &train, &val)
    };
    let fp32 = run(&base("a", Precision::Fp32)).unwrap();
    let bf16 = run(&base("b", Precision::Bf16)).unwrap();
    for ((s, a), (_, b)) in fp32.train_losses.iter().zip(&bf16.train_losses) {
        assert!((a - b).abs() < 0.02, "step {s}: bf16 {b} vs fp32 {a}");
    }
    // Resume each run's step-6 checkpoint in the other precision.
    for (from, to, precision) in [("a", "a2", Precision::Bf16), ("b", "b2", Precision::Fp32)] {
        let _ = std::fs::create_dir_all(out(to));
        for f in ["model_00000006.bin", "state_00000006_00000.bin", "DONE_00000006"] {
            std::fs::copy(out(from).join(f), out(to).join(f)).unwrap();
        }
        let r = run(&TrainConfig { resume: true, ..base(to, precision) }).unwrap();
        assert_eq!(r.train_losses.len(), 6, "steps 6..11");
        let first = if from == "a" { &fp32 } else { &bf16 };
        for ((s, a), (_, b)) in first.train_losses[6..].iter().zip(&r.train_losses) {
            assert!(b.is_finite() && (a - b).abs() < 0.02, "{from} resumed in {precision}, step {s}: {b} vs {a}");
        }
    }
    // The bf16 checkpoint: a version-5 model file and master weights in its state file.
    let m = std::fs::read(out("b").join("model_00000006.bin")).unwrap();
    assert_eq!(i32::from_le_bytes(m[4..8].try_into().unwrap()), 5);
    let st = std::fs::read(out("b").join("state_00000006_00000.bin")).unwrap();
    assert_eq!(i32::from_le_bytes(st[16..20].try_into().unwrap()), 1, "use_master_weights");
}

/// Two ranks in bf16 at ZeRO 0-3, with master weights and without (`-w 0`): the same losses
/// as each other up to the order of the gradient norm's sum (1e-4; the fp32 test holds them to
/// 1e-5), and as one process with the whole batch up to bf16's rounding of the gradients (5e-3:
/// each rank's half-batch gradient is rounded to bf16 before the ranks average them). ZeRO-3
/// rounds each shard with the noise of its place in the whole parameters, so it takes ZeRO-2's
/// steps to the bit (the same reduced gradients, the same AdamW and roundings).
#[test]
fn bf16_ranks_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    for master_weights in [true, false] {
        let base = TrainConfig {
            batch_size: 2,
            total_batch_size: Some(128),
            max_steps: Some(12),
            precision: Precision::Bf16,
            master_weights,
            checkpoint_every: 6,
            save_dtype: Dtype::BF16,
            ..small(dir.path(), &train, &val)
        };
        let w = format!("-w {}", master_weights as u8);
        let run_ranks = |world: usize, stage: usize, b: usize| {
            let out = dir.path().join(format!("w{world}z{stage}{w}"));
            let cfg = TrainConfig { output_dir: Some(out), zero_stage: stage, batch_size: b, ..base.clone() };
            ranks_on_threads(&cfg, world)
        };
        let one = run_ranks(1, 0, 4).remove(0);
        assert!(one.train_losses[11].1 < one.train_losses[0].1 - 0.5, "{w}: {:?}", one.train_losses);
        let z0 = run_ranks(2, 0, 2);
        let mut z2 = vec![];
        for stage in 0..=3 {
            let runs = if stage == 0 { z0.clone() } else { run_ranks(2, stage, 2) };
            for r in &runs {
                assert_eq!(r.train_losses.len(), 12);
                for ((s, a), (_, b)) in r.train_losses.iter().zip(&z0[0].train_losses) {
                    assert!((a - b).abs() <= 1e-4 * b.abs(), "{w} ZeRO-{stage}, step {s}: {a} vs {b} at ZeRO-0");
                }
                for ((s, a), (_, b)) in r.train_losses.iter().zip(&one.train_losses) {
                    assert!((a - b).abs() <= 5e-3 * b.abs(), "{w} ZeRO-{stage}, step {s}: {a} vs {b} on one process");
                }
            }
            let bits = |r: &llmrs::train::RunSummary| r.train_losses.iter().map(|x| x.1.to_bits()).collect::<Vec<_>>();
            if stage == 2 {
                z2 = runs.iter().map(bits).collect();
            }
            if stage == 3 {
                assert_eq!(runs.iter().map(bits).collect::<Vec<_>>(), z2, "{w}: ZeRO-3 takes ZeRO-2's steps");
                // Its model file (the working copy gathered from the shards) is ZeRO-2's, and
                // the run resumes from its step-6 checkpoint to the same bits.
                let out = |n: &str| dir.path().join(n);
                let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
                let f = "model_00000012.bin";
                assert!(read(out(&format!("w2z3{w}")).join(f)) == read(out(&format!("w2z2{w}")).join(f)), "{w}: {f}");
                let again = out(&format!("w2z3{w}resumed"));
                std::fs::create_dir(&again).unwrap();
                for f in ["DONE_00000006", "model_00000006.bin", "state_00000006_00000.bin", "state_00000006_00001.bin"]
                {
                    std::fs::copy(out(&format!("w2z3{w}")).join(f), again.join(f)).unwrap();
                }
                let cfg = TrainConfig { output_dir: Some(again), zero_stage: 3, resume: true, ..base.clone() };
                for r in ranks_on_threads(&cfg, 2) {
                    assert_eq!(bits(&r), z2[0][6..], "{w}: ZeRO-3 resumed");
                }
            }
        }
    }
}

/// A LoRA base given as a Hugging Face directory is read straight into the model, in the
/// run's precision (tensor by tensor, never whole in fp32 for a bf16 base): the same run, to
/// the bit, as from the same weights in an llm.c file, the same base identity in its
/// checkpoint; a `--lora-from` checkpoint trained on another base is refused once it is read.
#[test]
fn a_hugging_face_lora_base_is_read_in_place_as_a_file_is() {
    use llmrs::core::config::ModelConfig;
    use llmrs::core::params::Weights;
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let w = Weights::random(ModelConfig::from_descriptor("llama:2x32:4:2:16").unwrap(), 9).unwrap();
    let (hf, bin) = (dir.path().join("hf"), dir.path().join("base.bin"));
    llmrs::formats::hf::save_hf(&w, &hf, Dtype::F32).unwrap();
    llmrs::formats::llmc::save_model(&w, &bin, Dtype::F32).unwrap();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let mut runs = vec![];
        for (name, model) in [("hf", &hf), ("bin", &bin)] {
            let out = dir.path().join(format!("{name}_{precision}"));
            let cfg = TrainConfig {
                model: model.to_str().unwrap().into(),
                lora: 4,
                precision,
                checkpoint_every: 12,
                ..small(&out, &train, &val)
            };
            let r = run(&cfg).unwrap();
            let (_, _, base) = llmrs::formats::lora::load_checkpoint(&out.join("model_00000012.bin")).unwrap();
            runs.push((r.train_losses, r.val_losses, base.hash));
        }
        assert!(!runs[0].0.is_empty());
        assert_eq!(runs[0], runs[1], "{precision}: from the directory and from the file");
        assert_eq!(runs[0].2, llmrs::core::params::weights_hash(&w), "{precision}: the base's hash");
    }
    // Adapters trained on another base.
    let other = dir.path().join("other.bin");
    let o = Weights::random(ModelConfig::from_descriptor("llama:2x32:4:2:16").unwrap(), 10).unwrap();
    llmrs::formats::llmc::save_model(&o, &other, Dtype::F32).unwrap();
    let out = dir.path().join("other_run");
    let cfg = TrainConfig {
        model: other.to_str().unwrap().into(),
        lora: 4,
        checkpoint_every: 12,
        ..small(&out, &train, &val)
    };
    run(&cfg).unwrap();
    let from = Some(out.join("model_00000012.bin"));
    let cfg = TrainConfig {
        model: hf.to_str().unwrap().into(),
        lora_from: from,
        ..small(&dir.path().join("x"), &train, &val)
    };
    let e = format!("{:#}", run(&cfg).unwrap_err());
    assert!(e.contains("--lora-from") && e.contains("its adapters were trained on"), "{e}");
}

/// A LoRA run on a Hugging Face base, stopped and resumed, reads its base in place again
/// (checked by hash once read): bit-identical losses; another base given with -e is refused.
#[test]
fn a_lora_run_on_a_hugging_face_base_resumes_bit_identically() {
    use llmrs::core::config::ModelConfig;
    use llmrs::core::params::Weights;
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = make_data(dir.path());
    let cfg = ModelConfig::from_descriptor("llama:2x32:4:2:16").unwrap();
    let (hf, other) = (dir.path().join("hf"), dir.path().join("other"));
    llmrs::formats::hf::save_hf(&Weights::random(cfg, 9).unwrap(), &hf, Dtype::F32).unwrap();
    llmrs::formats::hf::save_hf(&Weights::random(cfg, 10).unwrap(), &other, Dtype::F32).unwrap();
    let out = dir.path().join("run");
    let cfg = TrainConfig {
        model: hf.to_str().unwrap().into(),
        model_given: true,
        lora: 4,
        precision: Precision::Bf16,
        checkpoint_every: 5,
        schedule: ScheduleKind::Cosine,
        ..small(&out, &train, &val)
    };
    let full = run(&cfg).unwrap();
    for s in [10, 12] {
        for f in [format!("DONE_{s:08}"), format!("model_{s:08}.bin"), format!("state_{s:08}_00000.bin")] {
            std::fs::remove_file(out.join(f)).unwrap();
        }
    }
    let resumed = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap();
    assert_eq!(resumed.train_losses.len(), 7, "steps 5..11 run again");
    let bits = |v: &[(usize, f32)]| v.iter().map(|(s, l)| (*s, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&full.train_losses[5..]), bits(&resumed.train_losses));
    let bad = TrainConfig { resume: true, model: other.to_str().unwrap().into(), ..cfg.clone() };
    let e = format!("{:#}", run(&bad).unwrap_err());
    assert!(e.contains("is not the one these adapters were trained on"), "{e}");
}

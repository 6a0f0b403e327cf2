//! Kill -9 at random moments: 20 SIGKILLs of one training run (checkpointing every step, so
//! many land inside checkpoint writes), each followed by `-y 1`, must end with the same
//! per-step losses as a run that was never interrupted, bit for bit, and leave no stray files.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

fn train(dir: &Path, out: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_llmrs"));
    c.current_dir(dir)
        .args(["train", "-i", "train.bin", "-j", "val.bin", "-b", "2", "-t", "16", "-x", "30"])
        .args(["-e", "model.bin"])
        .args(extra)
        .args([
            "-v",
            "10",
            "-m",
            "2",
            "-s",
            "0",
            "-n",
            "1",
            "-nk",
            "2",
            "-l",
            "3e-3",
            "--threads",
            "1",
            "-y",
            "1",
            "-o",
            out,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// (step, loss bits) of every log line of one kind.
type Losses = Vec<(u64, u32)>;

/// The train and the val losses of a log.
fn losses(log: &Path) -> (Losses, Losses) {
    let text = std::fs::read_to_string(log).unwrap();
    let (mut tr, mut va) = (vec![], vec![]);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        let s = v["step"].as_u64().unwrap();
        if let Some(x) = v["train_loss"].as_f64() {
            tr.push((s, (x as f32).to_bits()));
        }
        if let Some(x) = v["val_loss"].as_f64() {
            va.push((s, (x as f32).to_bits()));
        }
    }
    (tr, va)
}

#[test]
fn twenty_sigkills_resume_to_the_uninterrupted_run() {
    sigkills_resume_to_the_uninterrupted_run(20, "2x32:2:32", &[]);
}

/// The same for a LoRA run (its checkpoints: the adapters and their AdamW state), 8 kills.
#[test]
fn sigkills_of_a_lora_run_resume_to_the_uninterrupted_run() {
    sigkills_resume_to_the_uninterrupted_run(8, "llama:2x32:4:2:16", &["--lora", "4"]);
}

/// The same in bf16 (a version-5 model file, fp32 master weights in the state file), 8 kills.
#[test]
fn sigkills_of_a_bf16_run_resume_to_the_uninterrupted_run() {
    sigkills_resume_to_the_uninterrupted_run(8, "2x32:2:32", &["--precision", "bf16"]);
}

/// `total_kills` kills of a run of model `desc` (from a model file of its shape with a vocabulary
/// of 600, and data below it) with flags `extra`. Its checkpoint writes, fsyncs included, are
/// about half of such a run's time (0.27 s with a checkpoint every step, 0.12 s with none, on a
/// 2-core Zen 1), so about half the kills land inside them.
fn sigkills_resume_to_the_uninterrupted_run(total_kills: usize, desc: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    common::make_data_below(dir.path(), 99, 4000, 800, 600);
    common::small_vocab_model(dir.path(), desc);
    let t0 = Instant::now();
    let o = train(dir.path(), "ref", extra).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full = t0.elapsed();
    let want = losses(&dir.path().join("ref/log.jsonl"));
    assert_eq!(want.0.len(), 30);

    // Kill times spread over one whole run's duration (start-up, steps and checkpoint writes).
    // A run that gets to the end before its kill closes an episode: it is checked, and the
    // next kills go to a fresh directory, until all the kills have landed.
    let names = |d: &str| {
        let mut v: Vec<String> = std::fs::read_dir(dir.path().join(d))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let check = |d: &str, kills: usize| {
        assert_eq!(losses(&dir.path().join(d).join("log.jsonl")), want, "{d}: losses after {kills} kills");
        // The same files as the uninterrupted run: the last 2 checkpoints, the log, the curves.
        assert_eq!(names(d), names("ref"), "{d}");
        for f in ["model_00000030.bin", "state_00000030_00000.bin"] {
            let (a, b) = (
                std::fs::read(dir.path().join(d).join(f)).unwrap(),
                std::fs::read(dir.path().join("ref").join(f)).unwrap(),
            );
            assert!(a == b, "{d}/{f} differs");
        }
    };
    let mut seed = 0x2545F4914F6CDD1Du64;
    let (mut kills, mut episode, mut in_episode) = (0, 0, 0);
    while kills < total_kills {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let at = full.mul_f64((seed % 1000) as f64 / 1000.0);
        let out = format!("crash{episode}");
        let mut child = train(dir.path(), &out, extra).spawn().unwrap();
        std::thread::sleep(at);
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
            in_episode += 1;
        }
        let status = child.wait().unwrap();
        if status.success() {
            check(&out, in_episode);
            (episode, in_episode) = (episode + 1, 0);
        } else {
            assert!(
                status.code().is_none(),
                "a resumed run failed: {}",
                std::io::read_to_string(child.stderr.take().unwrap()).unwrap()
            );
        }
    }
    let out = format!("crash{episode}");
    let o = train(dir.path(), &out, extra).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check(&out, in_episode);
}

//! Data-parallel training as several processes under `mpirun` (Open MPI): ZeRO stages 0-3
//! against one process, a killed rank, a hung rank, and resuming with the wrong world size or
//! stage. Needs llmrs built with `--features mpi` and `mpirun` on the PATH; without either,
//! each test prints a loud SKIPPED line (`.ci/run` installs Open MPI and runs these).

mod common;

use common::{make_data, nan_max};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_llmrs");

/// `mpirun -np N` with llmrs, or None (after a SKIPPED line) when this build or machine cannot.
fn mpirun(np: usize, test: &str) -> Option<Command> {
    if !cfg!(feature = "mpi") {
        llmrs::testdata::skipped(test, "llmrs built without MPI (cargo test --features mpi)");
        return None;
    }
    if Command::new("mpirun").arg("--version").output().is_err() {
        llmrs::testdata::skipped(test, "no mpirun on the PATH (apt install openmpi-bin libopenmpi-dev)");
        return None;
    }
    let mut c = Command::new("mpirun");
    // The ranks share this machine's cores (CI has 2 for up to 4 ranks); root runs in CI.
    c.args(["--oversubscribe", "-np", &np.to_string(), BIN])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    Some(c)
}

/// `train` flags of a small run writing to `out`.
fn train_args(data: &(String, String), out: &Path, b: usize, extra: &[&str]) -> Vec<String> {
    let (train, val) = data;
    let mut a: Vec<String> = ["train", "-i", train, "-j", val, "-e", "2x32:2:32", "-t", "16", "-d", "128"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["-b".into(), b.to_string(), "-o".into(), out.display().to_string()]);
    a.extend(["-l", "3e-3", "-u", "2", "-s", "0", "--overwrite"].iter().map(|s| s.to_string()));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn run_ok(mut c: Command, what: &str) {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// (step, value) of every log line with `key`.
fn log_values(out: &Path, key: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v[key].as_f64()?))
        })
        .collect()
}

fn params(out: &Path, step: usize) -> Vec<f32> {
    llmrs::formats::llmc::load_model(&out.join(format!("model_{step:08}.bin"))).unwrap().data
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs().max(1.0)
}

/// For 2 and 4 processes and every ZeRO stage, 20 steps under mpirun (B=2 per rank) give the
/// losses of one process with the whole batch (B=2*N) at every step, and the same parameters.
#[test]
fn ranks_under_mpirun_train_as_one_process_at_every_zero_stage() {
    let test = "ranks_under_mpirun_train_as_one_process_at_every_zero_stage";
    if mpirun(2, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = make_data(dir.path(), 7, 40_000, 8_000);
    let flags = ["-x", "20", "-v", "5", "-m", "2", "-n", "20"];
    for world in [2, 4] {
        let one = dir.path().join(format!("one{world}"));
        let mut c = Command::new(BIN);
        c.args(train_args(&data, &one, 2 * world, &flags));
        run_ok(c, "one process");
        let (one_train, one_val) = (log_values(&one, "train_loss"), log_values(&one, "val_loss"));
        assert_eq!(one_train.len(), 20);
        assert!(one_train[19].1 < one_train[0].1 - 0.3, "the run learned: {one_train:?}");
        let one_params = params(&one, 20);
        for stage in 0..=3 {
            let out = dir.path().join(format!("np{world}z{stage}"));
            let mut c = mpirun(world, test).unwrap();
            c.args(train_args(&data, &out, 2, &flags)).args(["-z", &stage.to_string()]);
            run_ok(c, &format!("mpirun -np {world} -z {stage}"));
            let what = format!("{world} processes, ZeRO-{stage}");
            for (key, want) in [("train_loss", &one_train), ("val_loss", &one_val)] {
                let got = log_values(&out, key);
                assert_eq!(got.len(), want.len(), "{what}: {key} count");
                for ((s, a), (_, b)) in got.iter().zip(want.iter()) {
                    assert!(close(*a, *b), "{what}, step {s}: {key} {a} vs {b} on one process");
                }
            }
            let worst = params(&out, 20)
                .iter()
                .zip(&one_params)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, nan_max);
            assert!(worst <= 1e-5, "{what}: a parameter differs by {worst} after 20 steps");
            let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
            assert!(
                log.contains("\"comm_ms\"") && log.contains("\"memory_per_rank\""),
                "{what}: per-rank figures logged"
            );
        }
    }
}

/// The llmrs processes that `parent` started.
fn children(parent: u32) -> Vec<i32> {
    let mut pids = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else { continue };
        let ppid = rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) && head.contains("(llmrs") {
            pids.push(pid);
        }
    }
    pids
}

/// Whether `pid` is gone or a zombie (it exited; nobody has reaped it yet).
fn dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// Start `c` with output to files in `dir`, wait for `DONE_{at}` in `out`, then send `signal`
/// to one of its ranks. Returns the job, the ranks, and when the signal went.
fn start_and_signal(mut c: Command, dir: &Path, out: &Path, at: usize, signal: i32) -> (Child, Vec<i32>, Instant) {
    let log = |n: &str| std::fs::File::create(dir.join(n)).unwrap();
    let mut job = c.stdout(Stdio::from(log("stdout"))).stderr(Stdio::from(log("stderr"))).spawn().unwrap();
    let t0 = Instant::now();
    let done = out.join(format!("DONE_{at:08}"));
    while !done.exists() {
        assert!(job.try_wait().unwrap().is_none(), "the job ended before checkpoint {at}");
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint {at} after 2 minutes");
        std::thread::sleep(Duration::from_millis(2));
    }
    let ranks = children(job.id());
    assert!(ranks.len() == 2, "found ranks {ranks:?} under mpirun");
    // SAFETY: kill sends a signal to a process this test started.
    assert_eq!(unsafe { libc::kill(ranks[1], signal) }, 0);
    (job, ranks, Instant::now())
}

/// Wait up to `limit` for the job; it must end, and every rank with it.
fn wait_all(job: &mut Child, ranks: &[i32], since: Instant, limit: Duration) -> ExitStatus {
    loop {
        if let Some(status) = job.try_wait().unwrap() {
            while !ranks.iter().all(|&p| dead(p)) {
                assert!(since.elapsed() < limit, "ranks {ranks:?} still run after the job ended");
                std::thread::sleep(Duration::from_millis(20));
            }
            return status;
        }
        if since.elapsed() > limit {
            for &p in ranks {
                // SAFETY: as above; cleaning up before failing.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            let _ = job.kill();
            panic!("the job still runs {limit:?} after a rank failed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// kill -9 of one rank mid-run: every rank is gone within 60 s with a failure; the newest
/// complete checkpoint resumes (-y 1) and reproduces the uninterrupted run's losses exactly.
/// Resuming with another number of processes or another stage is a one-line error.
#[test]
fn a_killed_rank_ends_the_job_and_the_run_resumes_exactly() {
    let test = "a_killed_rank_ends_the_job_and_the_run_resumes_exactly";
    if mpirun(2, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = make_data(dir.path(), 11, 40_000, 8_000);
    // Validation over 20 batches at every step makes steps slow enough to be killed mid-run.
    let flags = ["-x", "40", "-v", "1", "-m", "20", "-n", "5"];
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    let mut c = mpirun(2, test).unwrap();
    c.args(train_args(&data, &full, 2, &flags)).args(["-z", "1"]);
    run_ok(c, "the uninterrupted run");
    // An error on rank 0 alone (a fresh run over earlier checkpoints, refused before any
    // collective) ends the job at once with rank 0's message, not after the other rank's
    // collective times out.
    let mut c = mpirun(2, test).unwrap();
    c.args(train_args(&data, &full, 2, &flags).into_iter().filter(|a| a != "--overwrite")).args(["-z", "1"]);
    let t0 = Instant::now();
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("rank 0 of 2") && err.contains("earlier run"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "the refused job took {:?}", t0.elapsed());
    let mut c = mpirun(2, test).unwrap();
    c.args(train_args(&data, &cut, 2, &flags)).args(["-z", "1"]);
    let (mut job, ranks, t0) = start_and_signal(c, dir.path(), &cut, 10, libc::SIGKILL);
    let status = wait_all(&mut job, &ranks, t0, Duration::from_secs(60));
    assert!(!status.success(), "the job succeeded after a rank was killed");
    let newest = llmrs::train::checkpoint::latest_checkpoint(&cut).unwrap();
    assert!((10..40).contains(&newest), "newest complete checkpoint {newest}");
    let resume = |np: usize, extra: &[&str]| {
        let mut c = mpirun(np, test).unwrap();
        c.args(train_args(&data, &cut, 2, &flags)).args(["-y", "1"]).args(extra);
        c.output().unwrap()
    };
    // The wrong world size, then the wrong stage: refused, naming the fix.
    for (np, extra, want) in [(4, &["-z", "1"][..], "same number of processes"), (2, &["-z", "2"][..], "same -z")] {
        let o = resume(np, extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "np {np} {extra:?}: {err}");
    }
    let o = resume(2, &["-z", "1"]);
    assert!(o.status.success(), "resume failed: {}", String::from_utf8_lossy(&o.stderr));
    let (a, b) = (log_values(&full, "train_loss"), log_values(&cut, "train_loss"));
    assert_eq!(a.len(), 40);
    assert_eq!(a, b, "the resumed run's losses differ from the uninterrupted run's");
    assert_eq!(params(&full, 40), params(&cut, 40));
}

/// A rank that hangs (SIGSTOP) leaves the others waiting in a collective: the watchdog ends
/// them after --comm-timeout, mpirun ends the job, and the newest checkpoint is intact.
#[test]
fn a_hung_rank_ends_the_job_after_the_collective_timeout() {
    let test = "a_hung_rank_ends_the_job_after_the_collective_timeout";
    if mpirun(2, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = make_data(dir.path(), 13, 40_000, 8_000);
    let out: PathBuf = dir.path().join("run");
    let flags = ["-x", "2000", "-v", "1", "-m", "20", "-n", "5", "--comm-timeout", "3"];
    let mut c = mpirun(2, test).unwrap();
    c.args(train_args(&data, &out, 2, &flags));
    let (mut job, ranks, t0) = start_and_signal(c, dir.path(), &out, 5, libc::SIGSTOP);
    let status = wait_all(&mut job, &ranks, t0, Duration::from_secs(60));
    assert!(!status.success());
    let err = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert!(err.contains("a rank died or hangs") && err.contains("-y 1"), "{err}");
    let newest = llmrs::train::checkpoint::latest_checkpoint(&out).unwrap();
    assert_eq!(params(&out, newest).len(), 1_636_224, "the newest checkpoint loads whole");
}

/// Without the mpi feature, a launch as one of several processes says how to build with MPI.
#[test]
fn without_mpi_a_launch_of_several_processes_says_how_to_build() {
    if cfg!(feature = "mpi") {
        llmrs::testdata::skipped(
            "without_mpi_a_launch_of_several_processes_says_how_to_build",
            "this build has MPI (the default build is the one this checks)",
        );
        return;
    }
    let o = Command::new(BIN).args(["train", "-x", "1"]).env("OMPI_COMM_WORLD_SIZE", "2").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("cargo build --release --features mpi"), "{err}");
}

/// A LoRA run under `mpirun -np 2` at every ZeRO stage (ZeRO-1..3 shard the adapters' AdamW
/// state, ZeRO-3 the frozen base too) trains as one process with the whole batch.
#[test]
fn lora_ranks_under_mpirun_train_as_one_process_at_every_zero_stage() {
    let test = "lora_ranks_under_mpirun_train_as_one_process_at_every_zero_stage";
    if mpirun(2, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = make_data(dir.path(), 7, 40_000, 8_000);
    let flags = ["-x", "10", "-v", "5", "-m", "2", "-n", "10", "--lora", "4"];
    let adapters = |out: &Path| llmrs::formats::lora::load_checkpoint(&out.join("model_00000010.bin")).unwrap().1.data;
    let one = dir.path().join("one");
    let mut c = Command::new(BIN);
    c.args(train_args(&data, &one, 4, &flags));
    run_ok(c, "one process");
    let (one_train, one_a) = (log_values(&one, "train_loss"), adapters(&one));
    assert_eq!(one_train.len(), 10);
    for stage in 0..=3 {
        let out = dir.path().join(format!("z{stage}"));
        let mut c = mpirun(2, test).unwrap();
        c.args(train_args(&data, &out, 2, &flags)).args(["-z", &stage.to_string()]);
        run_ok(c, &format!("mpirun -np 2 -z {stage} --lora 4"));
        for ((s, a), (_, b)) in log_values(&out, "train_loss").iter().zip(&one_train) {
            assert!(close(*a, *b), "ZeRO-{stage}, step {s}: train loss {a} vs {b} on one process");
        }
        let worst = adapters(&out).iter().zip(&one_a).map(|(a, b)| (a - b).abs()).fold(0f32, nan_max);
        assert!(worst <= 1e-4, "ZeRO-{stage}: an adapter differs by {worst} after 10 steps");
    }
}

/// bf16 under `mpirun -np 2` at every ZeRO stage: the losses of one process with the whole
/// batch up to bf16's rounding of each rank's gradients (5e-3, as tests/train.rs holds ranks on
/// threads), each stage within 1e-4 of ZeRO-0, and ZeRO-3 (shards rounded with the noise of
/// their place in the whole parameters) ZeRO-2's losses and final model file to the bit.
#[test]
fn bf16_ranks_under_mpirun_train_as_one_process_at_every_zero_stage() {
    let test = "bf16_ranks_under_mpirun_train_as_one_process_at_every_zero_stage";
    if mpirun(2, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = make_data(dir.path(), 7, 40_000, 8_000);
    let flags = ["-x", "10", "-v", "5", "-m", "2", "-n", "10", "--precision", "bf16"];
    let one = dir.path().join("one");
    let mut c = Command::new(BIN);
    c.args(train_args(&data, &one, 4, &flags));
    run_ok(c, "one process");
    let one_train = log_values(&one, "train_loss");
    assert_eq!(one_train.len(), 10);
    let mut z0 = vec![];
    for stage in 0..=3 {
        let out = dir.path().join(format!("z{stage}"));
        let mut c = mpirun(2, test).unwrap();
        c.args(train_args(&data, &out, 2, &flags)).args(["-z", &stage.to_string()]);
        run_ok(c, &format!("mpirun -np 2 -z {stage} --precision bf16"));
        let got = log_values(&out, "train_loss");
        assert_eq!(got.len(), 10, "ZeRO-{stage}");
        for ((s, a), (_, b)) in got.iter().zip(&one_train) {
            assert!((a - b).abs() <= 5e-3 * b.abs(), "ZeRO-{stage}, step {s}: train loss {a} vs {b} on one process");
        }
        if stage == 0 {
            z0 = got.clone();
        }
        for ((s, a), (_, b)) in got.iter().zip(&z0) {
            assert!((a - b).abs() <= 1e-4 * b.abs(), "ZeRO-{stage}, step {s}: train loss {a} vs {b} at ZeRO-0");
        }
    }
    let (z2, z3) = (dir.path().join("z2"), dir.path().join("z3"));
    assert_eq!(log_values(&z3, "train_loss"), log_values(&z2, "train_loss"), "ZeRO-3 takes ZeRO-2's steps");
    let model = |d: &Path| std::fs::read(d.join("model_00000010.bin")).unwrap();
    assert!(model(&z3) == model(&z2), "ZeRO-3's model file is ZeRO-2's");
}

//! The `llmrs` binary: llm.c-style flags, logs, errors and exit codes.

use std::process::Command;

fn llmrs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_llmrs"))
}

#[test]
fn trains_with_llmc_flags_and_writes_a_json_log() {
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u32> = (0..2000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::write_shard(&dir.path().join("train.bin"), &toks).unwrap();
    llmrs::data::write_shard(&dir.path().join("val.bin"), &toks[..300]).unwrap();
    let out = dir.path().join("out");
    let o = llmrs()
        .current_dir(dir.path())
        .args([
            "train",
            "-i",
            "train.bin",
            "-j",
            "val.bin",
            "-e",
            "1x16:2:16",
            "-b",
            "2",
            "-t",
            "8",
            "-x",
            "4",
            "-v",
            "2",
        ])
        .args(["-m", "1", "-s", "4", "-g", "5", "-n", "2", "-nk", "1", "-f", "1", "-z", "0", "-o"])
        .arg(&out)
        .args(["--threads", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("step    4/4 | loss "), "{stdout}");
    assert!(stdout.contains("generating:"), "{stdout}");
    assert!(stderr.contains("-f 1 is a GPU setting"), "{stderr}");
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.iter().filter(|v| v.get("train_loss").is_some()).count(), 4);
    assert_eq!(lines.iter().filter(|v| v.get("val_loss").is_some()).count(), 3);
    assert!(lines.iter().all(|v| v["step"].is_u64()));
    // -nk 1: only the newest checkpoint survives.
    assert!(out.join("DONE_00000004").exists() && out.join("model_00000004.bin").exists());
    assert!(!out.join("DONE_00000002").exists() && !out.join("state_00000002_00000.bin").exists());
}

#[test]
fn bad_input_gives_a_one_line_error_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("junk.bin"), b"this is not a model").unwrap();
    let o = llmrs()
        .current_dir(dir.path())
        .args(["train", "-e", "junk.bin", "-i", "junk.bin", "-j", "junk.bin"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("error: ") && err.contains("junk.bin") && err.trim().lines().count() == 1, "{err}");
    let o = llmrs().args(["train", "-k", "bogus"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown learning rate schedule"));
    let o = llmrs().args(["train", "--help"]).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("--grad-clip"));
}

/// Flags that cannot make sense, non-UTF-8 arguments and impossible sizes: a one-line error
/// naming the flag and exit 1, before any training or allocation (never a panic or an abort).
#[test]
fn nonsense_flags_and_arguments_are_refused_at_start_up() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::write_shard(&dir.path().join("d.bin"), &toks).unwrap();
    let refused = |args: &[&std::ffi::OsStr], want: &str| {
        let o = llmrs().current_dir(dir.path()).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.trim().lines().count() == 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: wanted {want:?} in {err}");
        assert!(!dir.path().join("out/log.jsonl").exists(), "{args:?} started a run");
    };
    let train = ["train", "-i", "d.bin", "-j", "d.bin", "-e", "1x16:2:16", "-t", "8", "-s", "0"];
    let os = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
    for (flags, want) in [
        (&["-l", "-1"][..], "-l/--lr -1: must be a finite number >= 0"),
        (&["--lr=-1"], "-l/--lr -1"),
        (&["-l", "NaN"], "-l/--lr NaN"),
        (&["-q", "NaN"], "-q/--final-lr-frac NaN"),
        (&["--beta1", "2"], "--beta1 2"),
        (&["--eps", "0"], "--eps 0"),
        (&["--grad-clip", "NaN"], "--grad-clip NaN"),
        (&["-x", "-5"], "-x/--max-steps -5"),
        (&["-m", "0"], "-m 0"),
        (&["-y", "2"], "-y/--resume 2: must be 0 or 1"),
        (&["-b", "100000"], "fewer than one batch needs"),
    ] {
        let args: Vec<_> = os(&train).into_iter().chain(os(flags)).collect();
        refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), want);
    }
    for (flags, want) in [(&["--temperature", "NaN"][..], "--temperature NaN"), (&["--top-p", "1.5"], "--top-p 1.5")] {
        let args: Vec<_> = os(&["generate", "-e", "1x16:2:16", "-n", "2"]).into_iter().chain(os(flags)).collect();
        refused(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>(), want);
    }
    // A FIFO as the model: refused by name, not read forever (`timeout` guards the test).
    let fifo = dir.path().join("m.bin");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for model in ["m.bin", "./m.bin"] {
        let o = Command::new("timeout")
            .current_dir(dir.path())
            .args(["20", env!("CARGO_BIN_EXE_llmrs"), "generate", "-e", model, "-n", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("not a regular file"), "{err}");
    }
    let bad = std::ffi::OsStr::from_bytes(b"abc\xff");
    refused(
        &[
            std::ffi::OsStr::new("generate"),
            std::ffi::OsStr::new("-e"),
            std::ffi::OsStr::new("1x16:2:16"),
            std::ffi::OsStr::new("-p"),
            bad,
        ],
        "argument 5",
    );
}

#[test]
fn a_full_disk_leaves_no_half_written_shard() {
    // RLIMIT_FSIZE stands in for a full disk: writes past 64 blocks fail with EFBIG (SIGXFSZ
    // is ignored so the process sees the error instead of being killed).
    let dir = tempfile::tempdir().unwrap();
    let docs: String =
        (0..400).map(|i| format!("{{\"text\": \"document {i}: {}\"}}\n", "words and more words ".repeat(50))).collect();
    std::fs::write(dir.path().join("in.jsonl"), docs).unwrap();
    let exe = env!("CARGO_BIN_EXE_llmrs");
    let o = Command::new("sh")
        .current_dir(dir.path())
        .arg("-c")
        .arg(format!("ulimit -f 64; trap '' XFSZ; exec '{exe}' prepare docs in.jsonl -o out --shard-size 1000000"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("disk full"), "{err}");
    let left: Vec<String> = std::fs::read_dir(dir.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".bin") || n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // Killed by SIGXFSZ instead (the default action): the temporary file stays behind, and the
    // next run that writes the same shards removes it.
    let o = Command::new("sh")
        .current_dir(dir.path())
        .arg("-c")
        .arg(format!("ulimit -f 64; exec '{exe}' prepare docs in.jsonl -o out --shard-size 1000000"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), None, "not killed: {}", String::from_utf8_lossy(&o.stderr));
    let temps = || -> Vec<String> {
        std::fs::read_dir(dir.path().join("out"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp"))
            .collect()
    };
    assert!(!temps().is_empty(), "the kill left no temporary file to clean up");
    let o = llmrs().current_dir(dir.path()).args(["prepare", "docs", "in.jsonl", "-o", "out"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(temps().is_empty(), "{:?}", temps());
}

#[test]
fn generate_eval_convert_and_plot_commands() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let o = llmrs().current_dir(dir.path()).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    // A small random GPT-2 (real vocabulary) exported to both formats.
    run(&["convert", "2x32:2:64", "m.bin"]);
    run(&["convert", "m.bin", "hf_dir", "--dtype", "bf16"]);
    let (out, err) = run(&["generate", "-e", "m.bin", "-p", "To be, or not", "-n", "12", "--seed", "3", "--no-stop"]);
    assert!(out.starts_with("To be, or not") && err.contains("12 new tokens"), "{out}\n{err}");
    let (again, _) = run(&["generate", "-e", "m.bin", "-p", "To be, or not", "-n", "12", "--seed", "3", "--no-stop"]);
    assert_eq!(out, again, "same seed, same text");
    let (uncached, _) = run(&[
        "generate",
        "-e",
        "m.bin",
        "-p",
        "To be, or not",
        "-n",
        "12",
        "--temperature",
        "0",
        "--no-stop",
        "--no-cache",
    ]);
    let (cached, _) =
        run(&["generate", "-e", "m.bin", "-p", "To be, or not", "-n", "12", "--temperature", "0", "--no-stop"]);
    assert_eq!(uncached, cached);
    // HellaSwag on a few hand-made examples in JSON lines.
    let ex = r#"{"ctx": "A man is sitting on a roof. he", "label": 3, "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}"#;
    std::fs::write(dir.path().join("hs.jsonl"), format!("{ex}\n{ex}\n")).unwrap();
    let (out, _) = run(&["eval", "hellaswag", "-e", "hf_dir", "--data", "hs.jsonl"]);
    assert!(out.contains("acc_norm") && out.contains("/2 = ") && out.contains("95% CI"), "{out}");
    run(&["prepare", "hellaswag", "--input", "hs.jsonl", "-o", "hsbin"]);
    let (out2, _) = run(&["eval", "hellaswag", "-e", "hf_dir", "--data", "hsbin/hellaswag_val.bin"]);
    assert_eq!(out, out2, "JSON lines and llm.c's .bin score the same");
    // Plot a log.
    std::fs::create_dir_all(dir.path().join("r")).unwrap();
    std::fs::write(
        dir.path().join("r/log.jsonl"),
        "{\"step\":0,\"train_loss\":3.0}\n{\"step\":1,\"train_loss\":2.0}\n",
    )
    .unwrap();
    run(&["plot", "r/log.jsonl", "-o", "c"]);
    assert!(dir.path().join("c.png").exists() && dir.path().join("c.svg").exists());
}

/// `--device gpu` where wgpu finds no adapter (here: told to look only for OpenGL, which llmrs
/// is not built with): one line naming what was looked for and the way out.
#[test]
fn gpu_without_an_adapter_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::write_shard(&dir.path().join("train.bin"), &toks).unwrap();
    let o = llmrs()
        .current_dir(dir.path())
        .env("WGPU_BACKEND", "gl")
        .args([
            "--device",
            "gpu",
            "train",
            "-i",
            "train.bin",
            "-j",
            "train.bin",
            "-e",
            "1x16:2:16",
            "-t",
            "8",
            "-o",
            "",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no GPU adapter found") && err.contains("Vulkan") && err.contains("--device cpu"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let o = llmrs().env("WGPU_BACKEND", "gl").arg("devices").output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("no GPU adapters found"));
    let o = llmrs().args(["--device", "gpu:x", "devices"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("use cpu, gpu or gpu:N"));
}

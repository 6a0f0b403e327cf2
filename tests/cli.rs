//! The `llmrs` binary: llm.c-style flags, logs, errors and exit codes.

use std::process::Command;

fn llmrs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_llmrs"))
}

#[test]
fn trains_with_llmc_flags_and_writes_a_json_log() {
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u32> = (0..2000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&dir.path().join("train.bin"), &toks).unwrap();
    llmrs::data::loader::write_shard(&dir.path().join("val.bin"), &toks[..300]).unwrap();
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
        .args([
            "-m",
            "1",
            "-s",
            "4",
            "-g",
            "5",
            "-n",
            "2",
            "-nk",
            "1",
            "-f",
            "1",
            "-z",
            "0",
            "-r",
            "2",
            "--ce-rows",
            "5",
            "-o",
        ])
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
    // -r is llmrs's own (recompute), not a GPU setting to ignore.
    assert!(!stderr.contains("-r 2"), "{stderr}");
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
    llmrs::data::loader::write_shard(&dir.path().join("d.bin"), &toks).unwrap();
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
        (&["-r", "3"], "-r 3: the recompute levels are 0"),
        (&["--ce-rows", "2"], "--ce-rows 2: the classifier's chunks are at least 3 rows"),
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
    let (chunked, _) = run(&[
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
        "--ce-rows",
        "3",
    ]);
    assert_eq!(chunked, cached);
    // HellaSwag on a few hand-made examples in JSON lines.
    let ex = r#"{"ctx": "A man is sitting on a roof. he", "label": 3, "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}"#;
    std::fs::write(dir.path().join("hs.jsonl"), format!("{ex}\n{ex}\n")).unwrap();
    let (out, _) = run(&["eval", "hellaswag", "-e", "hf_dir", "--data", "hs.jsonl"]);
    assert!(out.contains("acc_norm") && out.contains("/2 = ") && out.contains("95% CI"), "{out}");
    // The classifier in chunks of 3 rows: the same losses, so the same scores.
    let (chunked, _) = run(&["eval", "hellaswag", "-e", "hf_dir", "--data", "hs.jsonl", "--ce-rows", "3"]);
    assert_eq!(chunked, out);
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
    llmrs::data::loader::write_shard(&dir.path().join("train.bin"), &toks).unwrap();
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
    // One line of llmrs's holds the whole message (a driver may print lines of its own).
    let ours: Vec<&str> =
        err.lines().filter(|l| l.starts_with("error: ")).filter(|l| l.contains("GPU adapter")).collect();
    assert!(ours.len() == 1 && ours[0].contains("Vulkan") && ours[0].contains("--device cpu"), "{err}");
    let o = llmrs().env("WGPU_BACKEND", "gl").arg("devices").output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("no GPU adapters found"));
    let o = llmrs().args(["--device", "gpu:x", "devices"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("use cpu, gpu or gpu:N"));
}

/// train.bin (3000 tokens) and val.bin (its first 400) in `d`, ids below 500.
fn tiny_shards(d: &std::path::Path) {
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&d.join("train.bin"), &toks).unwrap();
    llmrs::data::loader::write_shard(&d.join("val.bin"), &toks[..400]).unwrap();
}

/// The run of a command: exit code, stdout, stderr.
fn call(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let o = llmrs().current_dir(dir).args(args).output().unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// A one-line error (exit 1) holding every one of `want`.
fn refused_with(dir: &std::path::Path, args: &[&str], want: &[&str]) {
    let (code, out, err) = call(dir, args);
    assert_eq!(code, Some(1), "{args:?}: {out}\n{err}");
    assert!(err.starts_with("error: ") && err.trim().lines().count() == 1, "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: wanted {w:?} in {err}");
    }
}

/// A model bigger than the machine is a one-line error with the GiB needed and available, not
/// an abort in the allocator: a descriptor (about 11 TB of weights), and a Hugging Face
/// directory whose config.json describes one (refused before its files are read).
#[test]
fn a_model_bigger_than_memory_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused_with(d, &["generate", "-e", "llama:4096x8192:64:8", "-n", "1"], &["needs", "GiB", "available"]);
    let (code, _, err) = call(d, &["convert", "llama:2x64:4:2", "big"]);
    assert_eq!(code, Some(0), "{err}");
    let cfg = d.join("big/config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    (v["num_hidden_layers"], v["hidden_size"], v["num_attention_heads"]) = (4096.into(), 8192.into(), 64.into());
    (v["num_key_value_heads"], v["intermediate_size"], v["head_dim"]) = (8.into(), 28672.into(), 128.into());
    std::fs::write(&cfg, v.to_string()).unwrap();
    refused_with(d, &["generate", "-e", "big", "-n", "1"], &["loading big", "needs", "GiB", "available"]);
    // Training (and bench) a run no machine holds: refused from the shapes, before the model is
    // made (at once, where making it took a minute and most of the memory), with its parts
    // and what the flags that shrink it would leave.
    let start = std::time::Instant::now();
    let huge = ["-e", "llama:llama3.2-1b", "-b", "4096", "-t", "131072"];
    for cmd in [&["bench"][..], &["train", "-i", "none.bin", "-j", "none.bin"][..]] {
        let want =
            ["before its first step", "weights 4.60 GiB", "activations", "at B=4096 T=131072", "a smaller -b or -t"];
        refused_with(d, &[cmd, &huge[..]].concat(), &want);
    }
    assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
}

/// Weights holding a NaN or an infinity are refused where they are loaded, naming the tensor,
/// by every command: nothing is generated, scored, copied or trained from them.
#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    use llmrs::core::params::Weights;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = llmrs::core::config::ModelConfig::from_descriptor("2x32:2:64").unwrap();
    let mut w = Weights::random(cfg, 1).unwrap();
    let qkv = w.named("qkvw").unwrap();
    w.layer_mut(qkv, 1)[7] = f32::NAN;
    llmrs::formats::llmc::save_model(&w, &d.join("nan.bin"), llmrs::core::files::Dtype::F32).unwrap();
    llmrs::formats::hf::save_hf(&w, &d.join("nan_hf"), llmrs::core::files::Dtype::F32).unwrap();
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&d.join("d.bin"), &toks).unwrap();
    let want = ["tensor qkvw of layer 1", "holds NaN at element 7"];
    refused_with(d, &["generate", "-e", "nan.bin", "-n", "2"], &want);
    refused_with(d, &["convert", "nan.bin", "out.bin"], &want);
    refused_with(d, &["train", "-e", "nan.bin", "-i", "d.bin", "-j", "d.bin", "-t", "8", "-o", ""], &want);
    refused_with(d, &["generate", "-e", "nan_hf", "-n", "2"], &["h.1.attn.c_attn.weight", "holds NaN"]);
    assert!(!d.join("out.bin").exists());
    let mut inf =
        Weights::random(llmrs::core::config::ModelConfig::from_descriptor("llama:1x32:4:2:64:16").unwrap(), 1).unwrap();
    let lnf = inf.named("lnfw").unwrap();
    inf.tensor_mut(lnf)[3] = f32::INFINITY;
    llmrs::formats::llmc::save_model(&inf, &d.join("inf.bin"), llmrs::core::files::Dtype::BF16).unwrap();
    refused_with(d, &["eval", "hellaswag", "-e", "inf.bin"], &["tensor lnfw", "holds inf"]);
}

/// `-y 1` trains the checkpoint whatever `-e` says (as llm.c): a line says so when `-e` names
/// another model, and nothing is said when it names the same one.
#[test]
fn resuming_says_when_e_names_another_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&d.join("d.bin"), &toks).unwrap();
    let train = |e: &str, x: &str, extra: &[&str]| {
        let args = [
            &["train", "-e", e, "-i", "d.bin", "-j", "d.bin", "-t", "8", "-b", "2", "-v", "0", "-s", "0"][..],
            &["-n", "1", "-x", x, "-o", "run", "--threads", "1"],
            extra,
        ]
        .concat();
        let (code, out, err) = call(d, &args);
        assert_eq!(code, Some(0), "{out}\n{err}");
        err
    };
    assert!(!train("1x16:2:16", "1", &[]).contains("note: -y 1"));
    let err = train("2x32:2:16", "2", &["-y", "1"]);
    assert!(
        err.contains("note: -y 1 resumes checkpoint 1 (gpt2 L=1 C=16 NH=2") && err.contains("-e 2x32:2:16"),
        "{err}"
    );
    assert_eq!(err.matches("note: -y 1").count(), 1, "{err}");
    assert!(!train("1x16:2:16", "3", &["-y", "1"]).contains("note: -y 1"), "same model: nothing to say");
}

/// The messages of the probe's findings: each names what is wrong and the way out, in one
/// line, before anything is loaded where it can be.
#[test]
fn messages_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused_with(d, &["--threads", "10000", "devices"], &["--threads 10000", "cores"]);
    // Sampling settings are checked before a model is loaded (this one does not exist).
    refused_with(d, &["generate", "-e", "hf:no/such-model", "--temperature", "-1"], &["--temperature -1"]);
    refused_with(d, &["generate", "-e", "hf:no/such-model", "--top-p", "0"], &["--top-p 0"]);
    // -n past the model's context: said, not silently cut.
    let (code, _, err) = call(d, &["generate", "-e", "1x16:2:16", "-p", "To be", "-n", "30", "--no-stop"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("context is 16 positions") && err.contains("at most 14 new tokens"), "{err}");
    // --tokenizer naming something that is not a tokenizer.json.
    std::fs::write(d.join("notes.txt"), "hello").unwrap();
    std::fs::create_dir_all(d.join("empty")).unwrap();
    for (t, want) in
        [("notes.txt", "not a tokenizer.json"), ("empty", "has no tokenizer.json"), ("nope.json", "no such file")]
    {
        refused_with(d, &["generate", "-e", "1x16:2:16", "--tokenizer", t], &[want, "hf:owner/name"]);
    }
    // Hugging Face directories: a field that is not what it should be, a missing tensor by
    // name, a layer more than config.json says.
    let (code, _, err) = call(d, &["convert", "llama:2x64:4:2", "m"]);
    assert_eq!(code, Some(0), "{err}");
    let cfg_path = d.join("m/config.json");
    let good: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let mut v = good.clone();
    v["rope_parameters"] = "default".into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    refused_with(d, &["generate", "-e", "m"], &["rope_parameters is not a JSON object"]);
    let mut v = good.clone();
    v["num_hidden_layers"] = 3.into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    refused_with(d, &["generate", "-e", "m"], &["tensor model.layers.2.input_layernorm.weight is missing"]);
    let mut v = good.clone();
    v["num_hidden_layers"] = 1.into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    refused_with(d, &["generate", "-e", "m"], &["tensor model.layers.1.", "is not part of the model", "1 layers"]);
    // Shapes in messages read as shapes, not as Rust's debug dumps.
    let mut v = good.clone();
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let (_, _, err) = call(d, &["generate", "-e", "m"]);
    assert!(err.contains("rope_scaling llama3 (factor 0.5") && !err.contains("Llama3Scaling {"), "{err}");
    // train --help lists the Llama descriptors; a Llama run's first line names its family and KV heads.
    let (_, help, _) = call(d, &["train", "--help"]);
    assert!(help.contains("llama:smollm2-135m") && help.contains("llama:LxC:NH:KV"), "{help}");
    let toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    llmrs::data::loader::write_shard(&d.join("d.bin"), &toks).unwrap();
    let (code, out, err) = call(
        d,
        &["train", "-e", "llama:1x32:4:2", "-i", "d.bin", "-j", "d.bin", "-t", "8", "-x", "1", "-o", "", "-s", "0"],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("model: llama L=1 C=32 NH=4 KV=2 HS=8 F=128"), "{out}");
}

/// A loopback stand-in for a gated Hub repository: it serves `files` (URL path -> body) only to
/// requests carrying `Authorization: Bearer secret-token`, and 401 to others. Returns its
/// address and the requests it saw ("METHOD PATH auth=yes|no").
fn gated_hub(files: Vec<(String, Vec<u8>)>) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let (mut first, mut line, mut auth) = (String::new(), String::new(), false);
            while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if first.is_empty() {
                    first = line.trim().to_string();
                }
                auth |= line.to_ascii_lowercase().trim() == "authorization: bearer secret-token";
                line.clear();
            }
            let mut it = first.split_whitespace();
            let (method, path) = (it.next().unwrap_or("").to_string(), it.next().unwrap_or("").to_string());
            log.lock().unwrap().push(format!("{method} {path} auth={}", if auth { "yes" } else { "no" }));
            let body = files.iter().find(|(p, _)| *p == path).map(|(_, b)| b.clone());
            let _ = match (auth, body) {
                (false, _) => write!(s, "HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                (true, None) => write!(s, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
                (true, Some(b)) => {
                    let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len());
                    if method == "GET" {
                        s.write_all(&b)
                    } else {
                        Ok(())
                    }
                }
            };
        }
    });
    (base, seen)
}

/// `--tokenizer hf:owner/name` fetches the tokenizer (and the small side files), not the
/// weights; a gated repository is read with the token from HF_TOKEN or `$HF_HOME/token`, as
/// huggingface_hub sends it, and the token is never printed; without one, the error says to set it.
#[test]
fn hub_tokenizers_come_alone_and_gated_repositories_take_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers/bytelevel.json")).unwrap();
    let repo = "/meta-llama/Gated-1B/resolve/main";
    let files = vec![
        (format!("{repo}/tokenizer.json"), tok),
        (format!("{repo}/model.safetensors"), vec![0u8; 64]),
        (format!("{repo}/config.json"), b"{\"architectures\": [\"LlamaForCausalLM\"]}".to_vec()),
    ];
    let (base, seen) = gated_hub(files);
    std::fs::write(d.join("a.txt"), "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(40))
        .unwrap();
    let prepare = |env: &[(&str, String)], out: &str| {
        let mut c = llmrs();
        c.current_dir(d).env_remove("HF_TOKEN").env_remove("HUGGING_FACE_HUB_TOKEN").env_remove("HF_TOKEN_PATH");
        c.env("HF_ENDPOINT", &base)
            .env("HF_HOME", d.join("hf_home"))
            .env("HF_HUB_CACHE", d.join(format!("cache_{out}")));
        for (k, v) in env {
            c.env(k, v);
        }
        c.args(["prepare", "text", "a.txt", "--tokenizer", "hf:meta-llama/Gated-1B", "-o", out, "--val-tokens", "100"]);
        let o = c.output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr))
    };
    let (code, text) = prepare(&[], "none");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("HTTP 401") && text.contains("set HF_TOKEN"), "{text}");
    let (code, text) = prepare(&[("HF_TOKEN", "secret-token".into())], "env");
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("secret-token"), "the token was printed: {text}");
    assert!(d.join("env/train_000000.bin").is_file());
    std::fs::create_dir_all(d.join("hf_home")).unwrap();
    std::fs::write(d.join("hf_home/token"), "secret-token\n").unwrap();
    let (code, text) = prepare(&[], "file");
    assert_eq!(code, Some(0), "{text}");
    let seen = seen.lock().unwrap();
    assert!(!seen.iter().any(|r| r.contains("model.safetensors")), "the weights were fetched: {seen:?}");
    assert!(seen.iter().any(|r| r == &format!("GET {repo}/tokenizer.json auth=yes")), "{seen:?}");
}

/// `prepare text --tokenizer` streams: 8 MB of text through a tokenizer.json peaks far below
/// the ~1 GB that tokenizing it whole took (about 130 bytes per byte of input); the peak is the
/// child's own (wait4), whatever else the test process runs.
#[test]
fn prepare_text_with_a_tokenizer_json_runs_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = llmrs::testdata::tinyshakespeare_text().repeat(8);
    std::fs::write(d.join("big.txt"), &text).unwrap();
    let tok = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers/bytelevel.json");
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = llmrs()
        .current_dir(d)
        .args(["prepare", "text", "big.txt", "--tokenizer", tok, "-o", "out"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (mut status, mut usage) = (0i32, std::mem::MaybeUninit::<libc::rusage>::zeroed());
    // SAFETY: wait4 on our own child, writing into the status and the zeroed rusage we own.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, usage.as_mut_ptr()) };
    assert_eq!(pid, child.id() as i32);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status}");
    // SAFETY: wait4 filled it.
    let peak_mib = unsafe { usage.assume_init() }.ru_maxrss as f64 / 1024.0;
    let tokens = llmrs::data::loader::read_shard(&d.join("out/train_000000.bin")).unwrap().len();
    assert!(tokens > 3_000_000, "{tokens}");
    assert!(peak_mib < 450.0, "prepare text peaked at {peak_mib:.0} MiB for {} MB of text", text.len() / 1_000_000);
}

/// The LoRA commands end to end: train adapters, convert the checkpoint to PEFT's files and to
/// the merged model, generate and evaluate with `--lora` (a PEFT directory or the checkpoint),
/// which equal the merged model; and the one-line errors of LoRA flags.
#[test]
fn lora_train_convert_generate_and_eval() {
    let dir = tempfile::tempdir().unwrap();
    tiny_shards(dir.path());
    let run = |args: &[&str]| {
        let o = llmrs().current_dir(dir.path()).args(args).args(["--threads", "1"]).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    run(&["convert", "llama:2x32:4:2:16", "base", "--seed", "5"]);
    let (out, _) = run(&[
        "train",
        "-i",
        "train.bin",
        "-j",
        "val.bin",
        "-e",
        "base",
        "-b",
        "2",
        "-t",
        "16",
        "-x",
        "30",
        "-v",
        "30",
        "-m",
        "1",
        "-s",
        "0",
        "-n",
        "30",
        "-o",
        "run",
        "--lora",
        "4",
        "--lora-targets",
        "q_proj,v_proj,down_proj",
        "-l",
        "3e-2",
    ]);
    assert!(out.contains("LoRA: rank 4 alpha 8 on 6 projections (q_proj, v_proj, down_proj)"), "{out}");
    let ckpt = "run/model_00000030.bin";
    let (_, err) = run(&["convert", ckpt, "adapter"]);
    assert!(err.contains("PEFT LoRA adapter: rank 4, alpha 8, 6 projections"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["target_modules"], serde_json::json!(["q_proj", "v_proj", "down_proj"]));
    assert!(cfg["base_model_name_or_path"].as_str().unwrap().ends_with("/base"), "{cfg}");
    run(&["convert", "--merge", ckpt, "merged"]);
    run(&["convert", "base", "merged2.bin", "--lora", "adapter"]);
    let gen = |e: &str, lora: Option<&str>| {
        let mut a = vec!["generate", "-e", e, "-n", "10", "--temperature", "0", "--no-stop", "--tokenizer", "gpt2"];
        if let Some(l) = lora {
            a.extend(["--lora", l]);
        }
        run(&a).0
    };
    let merged = gen("merged", None);
    assert_eq!(gen("base", Some("adapter")), merged);
    assert_eq!(gen("base", Some(ckpt)), merged);
    assert_eq!(gen(ckpt, None), merged);
    assert_eq!(gen("merged2.bin", None), merged);
    assert_ne!(gen("base", None), merged, "the adapters change the greedy text");
    let ex = r#"{"ctx": "A man is sitting on a roof. he", "label": 3, "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}"#;
    std::fs::write(dir.path().join("hs.jsonl"), format!("{ex}\n")).unwrap();
    let (a, _) =
        run(&["eval", "hellaswag", "-e", "base", "--lora", "adapter", "--data", "hs.jsonl", "--tokenizer", "gpt2"]);
    let (b, _) = run(&["eval", "hellaswag", "-e", "merged", "--data", "hs.jsonl", "--tokenizer", "gpt2"]);
    assert_eq!(a, b);
    // Errors: a target the family lacks, a checkpoint to a .bin without --merge, --merge of a
    // plain model, adapters on another base.
    let train = ["train", "-i", "train.bin", "-j", "val.bin", "-e", "base", "-b", "2", "-t", "16", "-x", "1"];
    refused_with(dir.path(), &[&train[..], &["--lora", "4", "--lora-targets", "c_fc"]].concat(), &["c_fc", "q_proj"]);
    refused_with(dir.path(), &["convert", ckpt, "x.bin"], &["--merge"]);
    refused_with(dir.path(), &["convert", "--merge", "base", "x.bin"], &["not one"]);
    run(&["convert", "llama:2x32:4:2:16", "other", "--seed", "6"]);
    refused_with(
        dir.path(),
        &["generate", "-e", "other", "--lora", ckpt, "-n", "2", "--tokenizer", "gpt2"],
        &["not the one"],
    );
}

/// `LLMRS_BF16_GEMM` picks the tiles of the bf16 GEMMs, named on bench's backend line; a value
/// it does not know, or tiles the host cannot run, is a one-line error at start-up.
#[test]
fn bf16_gemm_tiles_are_chosen_and_named() {
    let bench =
        ["bench", "-e", "1x16:2:16", "-b", "2", "-t", "8", "--steps", "1", "--warmup", "0", "--precision", "bf16"];
    let run = |tiles: &str| llmrs().args(bench).env(llmrs::core::env::BF16_GEMM, tiles).output().unwrap();
    let o = run("bogus");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.trim().lines().count() == 1 && err.contains("LLMRS_BF16_GEMM=bogus: use amx, avx512bf16 or widen"),
        "{err}"
    );
    let o = run("widen");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("bf16 GEMMs widened to fp32"), "{out}");
    assert!(out.contains("peak bf16   none: the bf16 GEMMs widen to fp32 here"), "{out}");
    for (tiles, runs) in
        [("amx", llmrs::backend::cpu::bgemm::amx_available()), ("avx512bf16", llmrs::backend::cpu::bgemm::available())]
    {
        let o = run(tiles);
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        if runs {
            assert!(o.status.success() && out.contains(&format!("bf16 GEMMs on {tiles}")), "{out}{err}");
            assert!(out.contains("peak bf16") && out.contains("; MFU"), "{out}");
        } else {
            assert_eq!(o.status.code(), Some(1), "{err}");
            assert!(
                err.trim().lines().count() == 1 && err.contains("this host cannot run it") && err.contains("use widen"),
                "{err}"
            );
            llmrs::testdata::skipped(
                &format!("bf16 GEMMs on {tiles}"),
                "this host cannot run them (the refusal was checked)",
            );
        }
    }
}

/// `convert` never replaces what it reads or what a run still needs (the LoRA checkpoint
/// itself, its base, another checkpoint of the run) and refuses to stack two adapters; an
/// explicit `--seed` for a LoRA checkpoint's random base is checked, not ignored; adapters on
/// one layer's projection export names PEFT (and llmrs) read back as the same targets; a
/// resume from a moved base names it in later checkpoints; a damaged newest checkpoint says
/// how to resume the one before; a PEFT adapter's file given for its directory says so.
#[test]
fn lora_files_are_kept_and_named_right() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_shards(d);
    let run = |args: &[&str]| {
        let (code, out, err) = call(d, &[args, &["--threads", "1"]].concat());
        assert_eq!(code, Some(0), "{args:?}: {err}");
        (out, err)
    };
    let train = ["train", "-i", "train.bin", "-j", "val.bin", "-b", "2", "-t", "16", "-v", "100", "-s", "0"];
    run(&["convert", "llama:2x32:4:2:16", "base"]);
    run(&[&train[..], &["-e", "base", "-x", "4", "-n", "2", "-o", "run", "--lora", "4"]].concat());
    let ck = "run/model_00000004.bin";
    let before = std::fs::read(d.join(ck)).unwrap();
    refused_with(d, &["convert", "--merge", ck, ck], &["is INPUT", "another path"]);
    refused_with(d, &["convert", "--merge", ck, "base"], &["the base of those LoRA adapters"]);
    refused_with(d, &["convert", "--merge", ck, "run/model_00000002.bin"], &["checkpoint 2 of a training run"]);
    refused_with(d, &["convert", "--merge", ck, "m", "--lora", "run/model_00000002.bin"], &["--lora names more"]);
    assert_eq!(std::fs::read(d.join(ck)).unwrap(), before, "the checkpoint is untouched");
    assert!(d.join("base/model.safetensors").exists() && !d.join("m").exists());
    // A Hugging Face directory's files, as INPUT or as a LoRA base given by its file.
    refused_with(
        d,
        &["convert", "base/model.safetensors", "base"],
        &["writing base/model.safetensors would replace INPUT"],
    );
    run(&["convert", "base", "b2"]);
    run(&[&train[..], &["-e", "b2/model.safetensors", "-x", "2", "-n", "2", "-o", "rb", "--lora", "2"]].concat());
    refused_with(d, &["convert", "--merge", "rb/model_00000002.bin", "b2"], &["the base of those LoRA adapters"]);
    refused_with(d, &["generate", "-e", "base", "--lora", "b2/model.safetensors"], &["not LoRA adapters"]);

    // A random base: the checkpoint's seed unless --seed says another, which is checked.
    let desc = "llama:2x32:4:2:16";
    run(&[&train[..], &["-e", desc, "-x", "2", "-n", "2", "-o", "rd", "--lora", "2", "--seed", "7"]].concat());
    run(&["convert", desc, "m7.bin", "--lora", "rd/model_00000002.bin"]);
    run(&["convert", desc, "m7b.bin", "--lora", "rd/model_00000002.bin", "--seed", "7"]);
    assert_eq!(std::fs::read(d.join("m7.bin")).unwrap(), std::fs::read(d.join("m7b.bin")).unwrap());
    refused_with(
        d,
        &["convert", desc, "m8.bin", "--lora", "rd/model_00000002.bin", "--seed", "8"],
        &["not the one these adapters were trained on", "seed 7", "--seed 8"],
    );
    run(&["convert", "--merge", "rd/model_00000002.bin", "m7c.bin", "--seed", "7"]);
    assert_eq!(std::fs::read(d.join("m7.bin")).unwrap(), std::fs::read(d.join("m7c.bin")).unwrap());
    refused_with(d, &["convert", "--merge", "rd/model_00000002.bin", "m8.bin", "--seed", "8"], &["--seed 8", "seed 7"]);

    // One layer's q_proj and every v_proj: full module names in the PEFT config.
    let targets = "layers.1.self_attn.q_proj,v_proj";
    run(&[&train[..], &["-e", "base", "-x", "2", "-n", "2", "-o", "rl", "--lora", "2", "--lora-targets", targets]]
        .concat());
    run(&["convert", "rl/model_00000002.bin", "ad"]);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("ad/adapter_config.json")).unwrap()).unwrap();
    let names: Vec<&str> = cfg["target_modules"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(
        names.contains(&"model.layers.1.self_attn.q_proj") && !names.iter().any(|n| n.contains("layers.0.self_attn.q"))
    );
    let gen = |lora: &str| {
        run(&[
            "generate",
            "-e",
            "base",
            "--lora",
            lora,
            "-n",
            "6",
            "--temperature",
            "0",
            "--no-stop",
            "--tokenizer",
            "gpt2",
        ])
        .0
    };
    assert_eq!(gen("ad"), gen("rl/model_00000002.bin"));
    refused_with(
        d,
        &["generate", "-e", "base", "--lora", "ad/adapter_model.safetensors"],
        &["give its directory (ad)"],
    );

    // Resumed from a moved copy of the base: the next checkpoint names the copy.
    std::fs::rename(d.join("base"), d.join("moved")).unwrap();
    run(&[&train[..], &["-e", "moved", "-x", "6", "-n", "2", "-o", "run", "-y", "1"]].concat());
    let (_, _, base) = llmrs::formats::lora::load_checkpoint(&d.join("run/model_00000006.bin")).unwrap();
    assert!(base.source.ends_with("moved"), "{}", base.source);
    // The newest checkpoint damaged: which one, and how to resume the one before.
    std::fs::write(d.join("run/model_00000006.bin"), b"").unwrap();
    let resume = [&train[..], &["-e", "moved", "-x", "8", "-n", "2", "-o", "run", "-y", "1", "--lora", "4"]].concat();
    refused_with(d, &resume, &["checkpoint 6", "move DONE_00000006 out of the way to resume checkpoint 4"]);
    let (_, _, err) = call(d, &resume);
    assert!(!err.contains("full fine-tune"), "{err}");
    std::fs::rename(d.join("run/DONE_00000006"), d.join("DONE_00000006")).unwrap();
    run(&resume);
    assert!(llmrs::formats::lora::load_checkpoint(&d.join("run/model_00000008.bin")).is_ok());
}

/// Flags that were swallowed, overflowed or went unchecked: llm.c's `-w 0` reaches the bf16
/// run (it was taken for a GPU-only flag and dropped); bench's zero sizes and steps and
/// `-w 2` are one-line errors (a panic, a silent 1, a silent yes before); a batch too big for
/// any machine is refused in one line (an abort in the allocator, or an overflow, before); `-x -2`
/// says what -1 means; `eval --limit 0` is refused (it printed NaN); `-n` near 2^64 is
/// clamped with the usual note; `-z` without mpirun says it changes nothing.
#[test]
fn probed_flags_are_honoured_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_shards(d);
    let tiny = "llama:2x32:4:2:16";
    let train = ["train", "-i", "train.bin", "-j", "val.bin", "-e", tiny, "-t", "16", "-v", "100", "-s", "0"];
    let (code, out, err) = call(d, &[&train[..], &["-b", "2", "-x", "1", "--precision", "bf16", "-w", "0"]].concat());
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("no master weights (-w 0)") && !err.contains("GPU setting"), "{out}\n{err}");
    let (code, _, err) = call(d, &[&train[..], &["-b", "2", "-x", "1", "-z", "2"]].concat());
    assert!(code == Some(0) && err.contains("-z 2 shards over the processes of an mpirun launch"), "{err}");
    // (Refused from the shapes before the data is read; the loader's own check is data.rs's.)
    for b in ["4294967296", "18446744073709551615"] {
        refused_with(d, &[&train[..], &["-b", b]].concat(), &["lower -b or -t"]);
    }
    refused_with(d, &[&train[..], &["-x", "-2"]].concat(), &["-1 for one epoch"]);
    let bench = ["bench", "-e", tiny, "--threads", "1"];
    refused_with(d, &[&bench[..], &["-b", "0"]].concat(), &["-b 0", "at least 1"]);
    refused_with(d, &[&bench[..], &["-t", "0"]].concat(), &["-t 0", "at least 1"]);
    refused_with(d, &[&bench[..], &["--steps", "0"]].concat(), &["--steps 0"]);
    refused_with(d, &[&bench[..], &["-w", "2"]].concat(), &["-w 2"]);
    refused_with(d, &["eval", "hellaswag", "-e", tiny, "--limit", "0"], &["--limit 0"]);
    let (code, _, err) = call(d, &["generate", "-e", tiny, "-n", "18446744073709551615", "--tokenizer", "gpt2"]);
    assert!(code == Some(0) && err.contains("at most 1023 new tokens"), "{err}");
}

/// `convert` replaces nothing unless told to (`--overwrite`), and then leaves no file of the old
/// model beside the new one; a merged model gets its base's tokenizer and generation files;
/// `--dtype bf16` reaches a PEFT adapter's tensors; a PEFT directory given as a model points at
/// `--lora`.
#[test]
fn convert_replaces_nothing_unless_told_and_keeps_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_shards(d);
    let run = |args: &[&str]| {
        let (code, out, err) = call(d, &[args, &["--threads", "1"]].concat());
        assert_eq!(code, Some(0), "{args:?}: {err}");
        (out, err)
    };
    let names = |p: &str| {
        let mut v: Vec<String> =
            std::fs::read_dir(d.join(p)).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        v.sort();
        v
    };
    // An llm.c file.
    run(&["convert", "1x32:2:64", "m.bin"]);
    let first = std::fs::read(d.join("m.bin")).unwrap();
    refused_with(d, &["convert", "1x32:2:64", "m.bin", "--seed", "3"], &["m.bin exists", "--overwrite"]);
    assert_eq!(std::fs::read(d.join("m.bin")).unwrap(), first, "refused, untouched");
    run(&["convert", "1x32:2:64", "m.bin", "--seed", "3", "--overwrite"]);
    assert_ne!(std::fs::read(d.join("m.bin")).unwrap(), first);
    // A sharded model directory with a tokenizer and a file of the user's: refused; replaced
    // with --overwrite, its shards, index and tokenizer gone, the user's file kept.
    std::fs::create_dir(d.join("victim")).unwrap();
    for f in ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"] {
        std::fs::write(d.join("victim").join(f), b"{}").unwrap();
    }
    std::fs::write(d.join("victim/notes.txt"), b"mine").unwrap();
    refused_with(
        d,
        &["convert", "m.bin", "victim"],
        &["victim holds a model's or adapter's files", "model-00001-of-00002.safetensors", "--overwrite"],
    );
    assert_eq!(std::fs::read(d.join("victim/config.json")).unwrap(), b"{}");
    let (_, err) = run(&["convert", "m.bin", "victim", "--overwrite"]);
    assert!(err.contains("removed") && err.contains("model.safetensors.index.json"), "{err}");
    assert_eq!(names("victim"), ["config.json", "model.safetensors", "notes.txt"]);
    run(&["generate", "-e", "victim", "-n", "2", "--tokenizer", "gpt2"]);

    // A LoRA run on a base with a tokenizer and generation settings.
    run(&["convert", "llama:2x32:4:2:16", "base"]);
    let tok = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers/bytelevel.json");
    std::fs::copy(tok, d.join("base/tokenizer.json")).unwrap();
    std::fs::write(d.join("base/generation_config.json"), r#"{"eos_token_id": 3}"#).unwrap();
    let train = ["train", "-i", "train.bin", "-j", "val.bin", "-b", "2", "-t", "16", "-v", "0", "-s", "0"];
    run(&[&train[..], &["-e", "base", "-x", "2", "-n", "2", "-o", "run", "--lora", "4", "-l", "3e-2"]].concat());
    let ck = "run/model_00000002.bin";
    // --merge: the base's tokenizer and generation settings come along; generate needs no
    // --tokenizer and stops at the base's end token.
    let (_, err) = run(&["convert", "--merge", ck, "merged"]);
    assert!(err.contains("tokenizer.json") && err.contains("generation_config.json"), "{err}");
    assert_eq!(names("merged"), ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]);
    assert_eq!(std::fs::read(d.join("merged/tokenizer.json")).unwrap(), std::fs::read(tok).unwrap());
    run(&["generate", "-e", "merged", "-p", "hello", "-n", "3"]);
    // The adapters in bf16: PEFT's tensors in BF16, the same text as the merged model's once
    // rounded (a greedy text is not held to the bits here, only the dtype and the load).
    run(&["convert", ck, "adapter", "--dtype", "bf16"]);
    let st = std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + n]).unwrap();
    let dtypes: std::collections::BTreeSet<&str> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| v["dtype"].as_str().unwrap())
        .collect();
    assert_eq!(dtypes.into_iter().collect::<Vec<_>>(), ["BF16"]);
    run(&["generate", "-e", "base", "--lora", "adapter", "-n", "3"]);
    // An adapter replaces a model only when told, and then the model's files go.
    refused_with(d, &["convert", ck, "merged"], &["holds a model's or adapter's files", "--overwrite"]);
    run(&["convert", ck, "merged", "--overwrite"]);
    assert_eq!(names("merged"), ["adapter_config.json", "adapter_model.safetensors"]);
    // A PEFT directory where a model is expected: the way to merge it.
    refused_with(d, &["convert", "adapter", "out"], &["holds a PEFT adapter", "llmrs convert BASE OUT --lora adapter"]);
    refused_with(d, &["generate", "-e", "adapter"], &["holds a PEFT adapter", "--lora adapter"]);
}

/// A resume says what it resumes: nothing to resume (a mistyped or empty -o), another
/// precision than the checkpoint's (LoRA too, and a bf16 run's fp32 model file is not taken for
/// an fp32 run), --lora flags that are not used (not when they repeat the checkpoint's); and
/// checkpoint files that do not belong together are named as such.
#[test]
fn resuming_says_what_it_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_shards(d);
    let run = |args: &[&str]| {
        let (code, out, err) = call(d, &[args, &["--threads", "1"]].concat());
        assert_eq!(code, Some(0), "{args:?}: {err}");
        (out, err)
    };
    let train = ["train", "-i", "train.bin", "-j", "val.bin", "-b", "2", "-t", "16", "-v", "0", "-s", "0", "-n", "2"];
    fn t<'a>(train: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [train, more].concat()
    }
    let t = |more: &[&'static str]| t(&train, more);
    let (_, err) = run(&t(&["-e", "1x32:2:64", "-x", "1", "-o", "typo", "-y", "1"]));
    assert!(err.contains("note: -y 1: typo did not exist; starting from step 0"), "{err}");
    std::fs::create_dir(d.join("empty")).unwrap();
    let (_, err) = run(&t(&["-e", "1x32:2:64", "-x", "1", "-o", "empty", "-y", "1"]));
    assert!(err.contains("note: -y 1: empty holds no complete checkpoint"), "{err}");
    // bf16 -w 0 with fp32 model files: resumed in bf16 without a note, in fp32 with one.
    let bf16 = ["--precision", "bf16", "-w", "0", "--save-dtype", "fp32"];
    run(&t(&[&["-e", "1x32:2:64", "-x", "2", "-o", "b"], &bf16[..]].concat()));
    let (_, err) = run(&t(&[&["-e", "1x32:2:64", "-x", "4", "-o", "b", "-y", "1"], &bf16[..]].concat()));
    assert!(!err.contains("note"), "{err}");
    let (_, err) = run(&t(&["-e", "1x32:2:64", "-x", "6", "-o", "b", "-y", "1"]));
    assert!(err.contains("note: checkpoint 4 was written by a bf16 run; this run computes in fp32"), "{err}");
    // LoRA: the precision, the repeated --lora (no note), another rank (a note).
    run(&["convert", "llama:2x32:4:2:16", "base"]);
    let (out, _) = run(&t(&["-e", "base", "-x", "2", "-o", "l", "--lora", "4", "--precision", "bf16"]));
    assert!(out.contains("the frozen base needs no master weights") && !out.contains("-w 0"), "{out}");
    let (_, err) = run(&t(&["-e", "base", "-x", "4", "-o", "l", "--lora", "4", "-y", "1", "--precision", "bf16"]));
    assert!(!err.contains("note"), "{err}");
    let (_, err) = run(&t(&["-e", "base", "-x", "6", "-o", "l", "--lora", "8", "-y", "1"]));
    assert!(err.contains("note: checkpoint 4 was written by a bf16 run; this run computes in fp32"), "{err}");
    assert!(err.contains("note: -y 1 resumes the LoRA checkpoint's adapters (rank 4"), "{err}");
    // Files that do not belong together: a full model file in place of the LoRA checkpoint's,
    // a state file of another model, a base of other shapes.
    let keep = std::fs::read(d.join("l/model_00000006.bin")).unwrap();
    std::fs::copy(d.join("b/model_00000006.bin"), d.join("l/model_00000006.bin")).unwrap();
    refused_with(d, &t(&["-x", "8", "-o", "l", "-y", "1"]), &["state of a LoRA run", "full fine-tune"]);
    std::fs::write(d.join("l/model_00000006.bin"), keep).unwrap();
    run(&t(&["-e", "1x32:2:64", "-x", "2", "-o", "c", "--lora", "2"]));
    std::fs::copy(d.join("c/state_00000002_00000.bin"), d.join("l/state_00000006_00000.bin")).unwrap();
    refused_with(d, &t(&["-e", "base", "-x", "8", "-o", "l", "-y", "1"]), &["trainable values", "another model"]);
    run(&["convert", "llama:2x64:4:2:16", "wide"]);
    refused_with(
        d,
        &t(&["-e", "wide", "-x", "8", "-o", "l", "-y", "1"]),
        &["the LoRA base model wide is of shape", "were trained on a base of shape", "give that base with -e"],
    );
}

/// Training without validation (`-j ""`, or `-v 0` which does not read -j); a prompt longer
/// than the context refused before anything is printed; a config.json that is a FIFO named as
/// such; a bad token id deep in a shard found when the run starts.
#[test]
fn no_validation_long_prompts_fifos_and_bad_ids() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tiny_shards(d);
    let train = ["train", "-i", "train.bin", "-e", "1x32:2:64", "-b", "2", "-t", "16", "-x", "2", "-s", "0", "-o", ""];
    for j in [&["-j", ""][..], &["-j", "missing.bin", "-v", "0"]] {
        let (code, out, err) = call(d, &[&train[..], j].concat());
        assert_eq!(code, Some(0), "{j:?}: {err}");
        assert!(out.contains("no validation") && !out.contains("val loss"), "{j:?}: {out}");
    }
    refused_with(d, &[&train[..], &["-j", "missing.bin"]].concat(), &["-j '' or -v 0"]);
    refused_with(d, &[&train[..], &["-j", "", "-a", "1"]].concat(), &["-a 1", "give it with -j"]);

    let (code, _, err) = call(d, &["convert", "1x32:2:64", "m.bin"]);
    assert_eq!(code, Some(0), "{err}");
    let long = "word ".repeat(100);
    let (code, out, err) = call(d, &["generate", "-e", "m.bin", "-p", &long, "-n", "3"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(out.is_empty(), "the prompt was printed: {out}");
    assert!(err.contains("the prompt has 101 tokens; the model's context is 64 positions"), "{err}");

    let (code, _, err) = call(d, &["convert", "m.bin", "hf"]);
    assert_eq!(code, Some(0), "{err}");
    std::fs::remove_file(d.join("hf/config.json")).unwrap();
    let fifo = std::ffi::CString::new(d.join("hf/config.json").to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    refused_with(d, &["generate", "-e", "hf", "-n", "2"], &["hf/config.json is not a regular file"]);

    let mut toks: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    toks[2900] = 60_000;
    llmrs::data::loader::write_shard(&d.join("bad.bin"), &toks).unwrap();
    let bad = ["train", "-i", "bad.bin", "-j", "", "-e", "1x32:2:64", "-b", "2", "-t", "16", "-x", "2", "-o", ""];
    refused_with(d, &bad, &["bad.bin: token id 60000 at position 2900"]);
}

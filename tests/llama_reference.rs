//! The Llama family against Hugging Face transformers' `LlamaForCausalLM`: fixtures written by
//! scripts/make_llama_reference.py (a tiny model with grouped-query attention, Llama 3.1's
//! rope scaling, an untied head and randomised RMSNorm weights; and a tied one with attention
//! biases). Logits, loss, every gradient, 10 AdamW steps and greedy generation, at the GPT-2
//! fixtures' tolerances (tests/pytorch_reference.rs), on the CPU and on the GPU backend (lavapipe
//! in CI; SKIPPED without an adapter); the checkpoint formats both ways; and the errors for what
//! llmrs does not implement.

mod common;

use common::compare;
use llmrs::backend::Device;
use llmrs::core::config::ModelConfig;
use llmrs::core::files::Dtype;
use llmrs::core::params::Weights;
use llmrs::formats::hf::{load_hf, save_hf};
use llmrs::formats::llmc::{load_model, save_model};
use llmrs::infer::generate::{generate, GenConfig, SamplerConfig};
use llmrs::model::optim::OptimConfig;
use llmrs::model::optimizer_step;
use llmrs::model::{Model, Slot};
use safetensors::SafeTensors;
use std::path::PathBuf;

/// The CPU, and the GPU when there is an adapter (else a loud SKIPPED line for its half).
fn devices(test: &str) -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if common::gpu::available(test) {
        d.push(Device::Gpu(None));
    }
    d
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama").join(name)
}

struct Io {
    inputs: Vec<u32>,
    targets: Vec<u32>,
    bytes: Vec<u8>,
}

impl Io {
    fn load() -> Io {
        let bytes = std::fs::read(fixture("io.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let ints = |n: &str| -> Vec<u32> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
                .collect()
        };
        let (inputs, targets) = (ints("input_ids"), ints("targets"));
        Io { inputs, targets, bytes }
    }
    fn floats(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        st.tensor(name).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }
}

#[test]
fn configs_are_read_as_transformers_defines_them() {
    let g = load_hf(&fixture("gqa")).unwrap().config;
    assert_eq!(g.family.0, "llama");
    assert_eq!((g.num_layers, g.channels, g.num_heads, g.num_kv_heads, g.hidden), (2, 48, 6, 2, 128));
    assert_eq!((g.vocab_size, g.padded_vocab_size, g.max_seq_len), (199, 256, 32));
    assert!(!g.tied_head && !g.qkv_bias && !g.out_bias && g.norm_eps == 1e-5 && g.rope.theta == 500000.0);
    let s = g.rope.scaling.expect("llama3 scaling");
    assert_eq!(
        (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings),
        (8.0, 1.0, 4.0, 8192)
    );
    let t = load_hf(&fixture("tied")).unwrap().config;
    assert!(
        t.tied_head
            && t.qkv_bias
            && t.out_bias
            && t.rope.scaling.is_none()
            && t.num_kv_heads == 4
            && t.norm_eps == 1e-6
    );
}

#[test]
fn logits_loss_and_every_gradient_match_transformers() {
    let io = Io::load();
    let (b, t) = (2, io.inputs.len() / 2);
    for (dev, name) in
        devices("logits_loss_and_every_gradient_match_transformers").into_iter().flat_map(|d| [(d, "gqa"), (d, "tied")])
    {
        let w = load_hf(&fixture(name)).unwrap();
        let v = w.config.vocab_size;
        let mut model = Model::new(w, dev).unwrap();
        model.alloc_training_state().unwrap();
        model.forward(&io.inputs, Some(&io.targets), b, t).unwrap();
        let logits: Vec<f32> = (0..b * t).flat_map(|row| model.logits_at(row).unwrap()).collect();
        assert_eq!(logits.len(), b * t * v);
        compare(&logits, &io.floats(&format!("logits_{name}")), 1e-5, &format!("{dev} {name} logits"));
        model.accumulate_loss(1.0).unwrap();
        let (loss, want) = (model.take_loss().unwrap(), io.floats(&format!("loss_{name}"))[0]);
        assert!((loss - want).abs() <= 1e-5 * want, "{dev} {name} loss {loss} vs {want}");
        if name == "gqa" {
            model.zero_grad().unwrap();
            model.backward(1.0).unwrap();
            let grads = model.read_all(Slot::Grads).unwrap();
            // transformers' gradients, saved under the parameters' names: read as a checkpoint.
            let want = load_hf(&fixture("gqa_grads")).unwrap();
            let cfg = want.config;
            let _ = cfg;
            for x in want.layout.ids() {
                let r = want.layout.range(x);
                compare(
                    &grads[r.clone()],
                    &want.data[r],
                    1e-4,
                    &format!("{dev}: gradient of {}", want.layout.spec(x).name),
                );
            }
        }
    }
}

#[test]
fn ten_adamw_steps_follow_transformers() {
    for dev in devices("ten_adamw_steps_follow_transformers") {
        ten_steps(dev);
    }
}

fn ten_steps(dev: Device) {
    let tr = common::trajectory::Trajectory::load(&fixture("trajectory.json"));
    let mut model = Model::new(load_hf(&fixture("gqa")).unwrap(), dev).unwrap();
    model.alloc_training_state().unwrap();
    let (want_loss, want_norm) = (&tr.losses, &tr.grad_norms);
    for step in 0..tr.steps {
        let s = tr.step(&mut model, step);
        assert!(
            (s.loss - want_loss[step]).abs() <= 1e-5 * want_loss[step],
            "{dev} step {step} loss {} vs {}",
            s.loss,
            want_loss[step]
        );
        assert!(
            (s.grad_norm - want_norm[step]).abs() <= 1e-5 * want_norm[step],
            "{dev} step {step} norm {} vs {}",
            s.grad_norm,
            want_norm[step]
        );
    }
    // Every parameter after the ten steps.
    let after = load_hf(&fixture("gqa_after10")).unwrap();
    let ours = model.read_all(Slot::Params).unwrap();
    for x in after.layout.ids() {
        let r = after.layout.range(x);
        compare(
            &ours[r.clone()],
            &after.data[r],
            1e-4,
            &format!("{dev}: {} after 10 steps", after.layout.spec(x).name),
        );
    }
}

#[test]
fn greedy_generation_gives_transformers_tokens() {
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("greedy.json")).unwrap()).unwrap();
    for (dev, name) in
        devices("greedy_generation_gives_transformers_tokens").into_iter().flat_map(|d| [(d, "gqa"), (d, "tied")])
    {
        let mut model = Model::new(load_hf(&fixture(name)).unwrap(), dev).unwrap();
        for case in j[name].as_array().unwrap() {
            let ids = |k: &str| -> Vec<u32> {
                case[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
            };
            let (prompt, want) = (ids("prompt"), ids("new"));
            for use_cache in [true, false] {
                let g = GenConfig {
                    max_new_tokens: 100,
                    sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
                    stop_tokens: vec![],
                    use_cache,
                };
                let got = generate(&mut model, &prompt, &g, |_| Ok(())).unwrap();
                assert_eq!(got, want, "{dev} {name}, cache {use_cache}, prompt {prompt:?}");
            }
        }
    }
}

#[test]
fn sharded_bf16_and_llmc_files_hold_the_same_model() {
    let w = load_hf(&fixture("gqa")).unwrap();
    assert_eq!(load_hf(&fixture("gqa_sharded")).unwrap(), w, "the sharded checkpoint");
    let bf16 = load_hf(&fixture("gqa_bf16")).unwrap();
    for (a, b) in bf16.data.iter().zip(&w.data) {
        assert_eq!(*a, half::bf16::from_f32(*b).to_f32(), "bf16 weights are the fp32 ones rounded");
    }
    // llm.c's llama3 file (Meta's q/k layout) is the same model, and writing it back gives its bytes.
    let bin = fixture("gqa_llmc.bin");
    let from_llmc = load_model(&bin).unwrap();
    assert_eq!(from_llmc, w);
    let dir = tempfile::tempdir().unwrap();
    save_model(&from_llmc, &dir.path().join("m.bin"), Dtype::F32).unwrap();
    assert!(std::fs::read(dir.path().join("m.bin")).unwrap() == std::fs::read(&bin).unwrap(), "byte-exact round trip");
    // bf16 (version 5) round trip, and the export transformers loads (scripts/make_llama_reference.py
    // --check-export checks its logits) re-imports as the same model.
    save_model(&w, &dir.path().join("b.bin"), Dtype::BF16).unwrap();
    assert_eq!(load_model(&dir.path().join("b.bin")).unwrap(), bf16);
    for name in ["gqa", "tied"] {
        let w = load_hf(&fixture(name)).unwrap();
        save_hf(&w, &dir.path().join(name), Dtype::F32).unwrap();
        assert_eq!(load_hf(&dir.path().join(name)).unwrap(), w);
    }
}

#[test]
fn what_llmrs_does_not_implement_is_a_one_line_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("gqa");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let good = std::fs::read_to_string(src.join("config.json")).unwrap();
    let err = |text: String| -> String {
        std::fs::write(dir.path().join("config.json"), text).unwrap();
        let e = format!("{:#}", load_hf(dir.path()).map(|_| ()).expect_err("must fail"));
        assert!(!e.contains('\n'), "one line: {e}");
        e
    };
    let e = err(good.replace("LlamaForCausalLM", "MistralForCausalLM"));
    assert!(e.contains("'MistralForCausalLM' is not supported"), "{e}");
    let e = err(good.replace("\"llama3\"", "\"yarn\""));
    assert!(e.contains("rope_parameters.rope_type 'yarn' is not supported"), "{e}");
    let e = err(good.replace("\"mlp_bias\": false", "\"mlp_bias\": true"));
    assert!(e.contains("mlp_bias"), "{e}");
    let e = err(good.replace("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""));
    assert!(e.contains("hidden_act 'gelu'"), "{e}");
    let e = err(good.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"));
    assert!(e.contains("up_proj.weight has shape [128, 48], config.json implies [96, 48]"), "{e}");
    let e = err(good.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"));
    assert!(e.contains("6 attention heads cannot share 4 key/value heads"), "{e}");
    let e = err(good.replace("\"hidden_size\": 48", "\"hidden_size\": \"big\""));
    assert!(e.contains("hidden_size is missing or not a whole number"), "{e}");
    // A truncated llm.c file, and a tokenizer id past the vocabulary, are refused too.
    let bin = std::fs::read(fixture("gqa_llmc.bin")).unwrap();
    std::fs::write(dir.path().join("t.bin"), &bin[..bin.len() - 8]).unwrap();
    let e = format!("{:#}", load_model(&dir.path().join("t.bin")).unwrap_err());
    assert!(e.contains("truncated"), "{e}");
    let mut model = Model::new(load_hf(&src).unwrap(), Device::Cpu).unwrap();
    assert!(model.forward(&[1, 199], None, 1, 2).unwrap_err().to_string().contains("out of range for vocab size 199"));
}

#[test]
fn random_llama_models_by_descriptor_train() {
    // SmolLM2-135M's shape (random weights) builds, and a tiny GQA model learns one batch.
    let cfg = ModelConfig::from_descriptor("llama:smollm2-135m").unwrap();
    assert_eq!(cfg.num_parameters(), 134_515_008);
    let w = Weights::random(ModelConfig::from_descriptor("llama:2x32:4:2:64:16").unwrap(), 3).unwrap();
    let mut m = Model::new(w, Device::Cpu).unwrap();
    m.alloc_training_state().unwrap();
    let x: Vec<u32> = (0..16).map(|i| (i * 37 % 500) as u32).collect();
    let y: Vec<u32> = (0..16).map(|i| (i * 11 % 500 + 3) as u32).collect();
    let opt = OptimConfig::default();
    let mut losses = vec![];
    for step in 0..30 {
        m.zero_grad().unwrap();
        m.forward(&x, Some(&y), 2, 8).unwrap();
        m.backward(1.0).unwrap();
        losses.push(optimizer_step(&mut m, &opt, 3e-3, step).unwrap().loss);
    }
    assert!(losses[29] < losses[0] - 3.0, "{losses:?}");
}

/// README's fine-tuning flow through the binary, offline: a Llama model in a Hugging Face
/// directory with its own tokenizer.json; `prepare text --tokenizer` shards Tiny Shakespeare
/// with it (each document opening with its beginning-of-text token); `train -e DIR` checkpoints,
/// and a run resumed from its middle checkpoint gives the uninterrupted run's losses bit for bit;
/// `generate --tokenizer` continues a prompt; `convert` gives a directory holding the trained
/// model exactly.
#[test]
fn a_hugging_face_llama_directory_fine_tunes_resumes_samples_and_exports() {
    use std::process::Command;
    let exe = env!("CARGO_BIN_EXE_llmrs");
    let run = |args: &[&str], dir: &std::path::Path| {
        let o = Command::new(exe).args(args).current_dir(dir).output().unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "llmrs {args:?} failed:\n{out}\n{err}");
        out.into_owned()
    };
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    run(&["convert", "llama:2x32:4:2:64:64", "model", "--seed", "5"], dir);
    let tok = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/bytelevel.json");
    std::fs::copy(&tok, dir.join("model/tokenizer.json")).unwrap();
    let text = llmrs::testdata::tinyshakespeare_text();
    std::fs::write(dir.join("a.txt"), &text[..40_000]).unwrap();
    run(&["prepare", "text", "a.txt", "--tokenizer", "model", "-o", "shards", "--val-tokens", "2000"], dir);
    // One document: the val shard's first 2000 tokens, then the train shard's, open with the
    // tokenizer's beginning-of-text token and are the text's tokens.
    let shard = |s: &str| llmrs::data::loader::read_shard(&dir.join(format!("shards/{s}_000000.bin"))).unwrap();
    let all: Vec<u32> = [shard("val"), shard("train")].concat();
    let t = llmrs::data::tokenizer::Tokenizer::load_hf(&tok).unwrap();
    assert_eq!(all[0], t.doc_start, "a document starts with the tokenizer's beginning-of-text token");
    assert_eq!(all[1..], t.encode(&text[..40_000]).unwrap()[..]);

    let train = |out: &str, extra: &[&str]| {
        let a = "train -e model -i shards/train_* -j shards/val_* -b 2 -t 32 -v 3 -s 3 -g 8 -n 2 -o";
        run(&a.split(' ').chain([out]).chain(extra.iter().copied()).collect::<Vec<_>>(), dir)
    };
    train("whole", &["-x", "6"]);
    // A copy of the run as if killed after its checkpoint at step 4, resumed from there.
    std::fs::create_dir(dir.join("resumed")).unwrap();
    for e in std::fs::read_dir(dir.join("whole")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        if !name.contains("00000006") {
            std::fs::copy(dir.join("whole").join(&name), dir.join("resumed").join(&name)).unwrap();
        }
    }
    train("resumed", &["-x", "6", "-y", "1"]);
    let losses = |out: &str| -> Vec<(u64, f64)> {
        std::fs::read_to_string(dir.join(out).join("log.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| Some((v["step"].as_u64()?, v.get("train_loss")?.as_f64()?)))
            .collect()
    };
    let whole = losses("whole");
    assert_eq!(whole.len(), 6);
    // A random model guesses among GPT-2's 50257 ids: ln 50257 = 10.82.
    assert!(whole.iter().all(|&(_, l)| (l - 10.82).abs() < 0.3), "{whole:?}");
    assert_eq!(losses("resumed"), whole, "the resumed run's losses");

    let out =
        run(&["generate", "-e", "whole/model_00000006.bin", "--tokenizer", "model", "-p", "ROMEO:", "-n", "4"], dir);
    assert!(out.starts_with("ROMEO:"), "{out}");
    run(&["convert", "whole/model_00000006.bin", "exported"], dir);
    let (a, b) = (load_model(&dir.join("whole/model_00000006.bin")).unwrap(), load_hf(&dir.join("exported")).unwrap());
    assert_eq!((a.config, &a.data), (b.config, &b.data));
}

/// A model with its own tokenizer (600 tokens, not GPT-2's 50257) keeps it, and its end tokens,
/// wherever it goes: `generate` stops at generation_config.json's `eos_token_id`; a training
/// run keeps tokenizer.json and the generation settings beside its checkpoints, so `generate
/// -e run/model_N.bin` reads and writes the model's words without `--tokenizer`, and without
/// them it is refused rather than falling back to GPT-2's; HellaSwag's GPT-2 ids (llm.c's
/// .bin) are refused for it while its JSON lines are tokenized with its tokenizer.
#[test]
fn a_model_keeps_its_own_tokenizer_and_end_tokens() {
    use std::process::Command;
    let exe = env!("CARGO_BIN_EXE_llmrs");
    let call = |args: &[&str], dir: &std::path::Path| {
        let o = Command::new(exe).args(args).current_dir(dir).output().unwrap();
        let (out, err) =
            (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
        (o.status.code(), out, err)
    };
    let run = |args: &[&str], dir: &std::path::Path| {
        let (code, out, err) = call(args, dir);
        assert_eq!(code, Some(0), "llmrs {args:?} failed:\n{out}\n{err}");
        (out, err)
    };
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let base = ModelConfig::from_descriptor("llama:2x32:4:2:64:64").unwrap();
    let cfg = ModelConfig { vocab_size: 600, padded_vocab_size: 640, ..base };
    let w = Weights::random(cfg, 9).unwrap();
    save_hf(&w, &dir.join("model"), Dtype::F32).unwrap();
    let tok_file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/bytelevel.json");
    std::fs::copy(&tok_file, dir.join("model/tokenizer.json")).unwrap();
    let tok = llmrs::data::tokenizer::Tokenizer::load_hf(&tok_file).unwrap();

    // The greedy continuation, then the same with its third token as the model's end token.
    let prompt = tok.encode("ROMEO:").unwrap();
    let mut m = Model::new(w.clone(), Device::Cpu).unwrap();
    let g = GenConfig {
        max_new_tokens: 12,
        sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
        stop_tokens: vec![],
        use_cache: true,
    };
    let greedy = generate(&mut m, &prompt, &g, |_| Ok(())).unwrap();
    let eos = greedy[2];
    let first = greedy.iter().position(|&t| t == eos || t == 599).unwrap() + 1; // the first end token
    let gen = ["generate", "-e", "model", "-p", "ROMEO:", "-n", "12", "--temperature", "0"];
    std::fs::write(dir.join("model/generation_config.json"), format!("{{\"eos_token_id\": [599, {eos}]}}")).unwrap();
    let (out, err) = run(&gen, dir);
    assert!(err.contains(&format!(" {first} new tokens")) && err.contains("stopped at an end token"), "{err}");
    assert_eq!(out.trim_end(), format!("ROMEO:{}", tok.decode(&greedy[..first])).trim_end());
    let (_, err) = run(&[&gen[..], &["--no-stop"]].concat(), dir);
    assert!(err.contains("12 new tokens"), "{err}");

    // A training run keeps the model's tokenizer and generation settings with its checkpoints.
    let text = llmrs::testdata::tinyshakespeare_text();
    std::fs::write(dir.join("a.txt"), &text[..20_000]).unwrap();
    run(&["prepare", "text", "a.txt", "--tokenizer", "model", "-o", "shards", "--val-tokens", "1000"], dir);
    let a = "train -e model -i shards/train_* -j shards/val_* -b 2 -t 32 -v 0 -s 2 -g 4 -n 2 -x 2 -o run";
    run(&a.split(' ').collect::<Vec<_>>(), dir);
    for f in ["tokenizer.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(dir.join("run").join(f)).unwrap(),
            std::fs::read(dir.join("model").join(f)).unwrap(),
            "{f}"
        );
    }
    let ckpt = ["generate", "-e", "run/model_00000002.bin", "-p", "ROMEO:", "-n", "6", "--temperature", "0"];
    let (own, _) = run(&ckpt, dir);
    let (explicit, _) = run(&[&ckpt[..], &["--tokenizer", "model"]].concat(), dir);
    assert_eq!(own, explicit, "the checkpoint's own tokenizer");
    // Without it, a vocabulary that is not GPT-2's is refused, naming the way out.
    std::fs::remove_file(dir.join("run/tokenizer.json")).unwrap();
    let (code, _, err) = call(&ckpt, dir);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("600 tokens") && err.contains("--tokenizer") && err.trim().lines().count() == 1, "{err}");

    // HellaSwag: its JSON lines go through the model's tokenizer; llm.c's .bin (GPT-2 ids) is refused.
    let ex = r#"{"ctx": "A man is sitting on a roof. he", "label": 3, "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}"#;
    std::fs::write(dir.join("hs.jsonl"), format!("{ex}\n")).unwrap();
    let (out, _) = run(&["eval", "hellaswag", "-e", "model", "--data", "hs.jsonl"], dir);
    assert!(out.contains("/1 = "), "{out}");
    run(&["prepare", "hellaswag", "--input", "hs.jsonl", "-o", "hs"], dir);
    assert!(dir.join("hs/hellaswag_val.jsonl").is_file(), "the text is kept beside the GPT-2 ids");
    let (code, _, err) = call(&["eval", "hellaswag", "-e", "model", "--data", "hs/hellaswag_val.bin"], dir);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("holds GPT-2 token ids") && err.contains("JSON lines"), "{err}");
}

//! LoRA against Hugging Face PEFT: fixtures written by scripts/make_lora_reference.py (adapters
//! of rank 4, alpha 8, on every projection of the tiny Llama of tests/fixtures/llama/gqa and of
//! the tiny GPT-2 of tests/fixtures/hf/gpt2_tiny_fp32, with nonzero B). The adapter's logits,
//! 20 adapter-only AdamW steps (losses, gradient norms, the final adapters), the exported
//! adapter's files, and the merge against PEFT's `merge_and_unload`; on the CPU and on the GPU
//! backend (lavapipe in CI; SKIPPED without an adapter).

mod common;

use common::compare;
use llmrs::backend::Device;
use llmrs::formats::hf::load_hf;
use llmrs::model::lora::Adapters;
use llmrs::model::{Model, Slot};
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The base model directory of each family's fixtures.
fn base(family: &str) -> PathBuf {
    fixture(if family == "llama" { "llama/gqa" } else { "hf/gpt2_tiny_fp32" })
}

struct Io {
    inputs: Vec<u32>,
    targets: Vec<u32>,
    bytes: Vec<u8>,
}

impl Io {
    fn load() -> Io {
        let bytes = std::fs::read(fixture("lora/io.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let ints = |n: &str| {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect()
        };
        let (inputs, targets) = (ints("input_ids"), ints("targets"));
        Io { inputs, targets, bytes }
    }
    fn floats(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        st.tensor(name).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }
}

/// The logits of every position of io's inputs (2, 11).
fn logits(model: &mut Model, io: &Io) -> Vec<f32> {
    model.forward(&io.inputs, Some(&io.targets), 2, 11).unwrap();
    (0..22).flat_map(|i| model.logits_at(i).unwrap()).collect()
}

/// The CPU, and the GPU when there is an adapter (else a loud SKIPPED line for its half).
fn devices(test: &str) -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if common::gpu::available(test) {
        d.push(Device::Gpu(None));
    }
    d
}

fn lora_model(family: &str, adapter: &str, dev: Device) -> (Model, Adapters) {
    let w = load_hf(&base(family)).unwrap();
    let a = llmrs::formats::peft::load(&w.config, &fixture(&format!("lora/{family}_{adapter}")), true).unwrap();
    let mut model = Model::new(w, dev).unwrap();
    model.set_lora(&a).unwrap();
    (model, a)
}

#[test]
fn an_adapter_gives_pefts_logits() {
    let io = Io::load();
    for (dev, family) in devices("an_adapter_gives_pefts_logits").into_iter().flat_map(|d| [(d, "llama"), (d, "gpt2")])
    {
        for adapter in ["adapter0", "adapter20"] {
            let (mut model, _) = lora_model(family, adapter, dev);
            let want = io.floats(&format!("{family}_{}_logits", adapter.replace("adapter", "lora")));
            compare(&logits(&mut model, &io), &want, 1e-4, &format!("{dev}: {family} {adapter} logits"));
        }
        // And without the adapter the base's own logits differ (the adapter is not a no-op).
        let mut plain = Model::new(load_hf(&base(family)).unwrap(), Device::Cpu).unwrap();
        let want = io.floats(&format!("{family}_lora0_logits"));
        let got = logits(&mut plain, &io);
        assert!(got.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3), "{family}: the adapter changes nothing");
    }
}

#[test]
fn twenty_adapter_only_adamw_steps_follow_peft() {
    let devs = devices("twenty_adapter_only_adamw_steps_follow_peft");
    for (dev, family) in devs.into_iter().flat_map(|d| [(d, "llama"), (d, "gpt2")]) {
        let tr = common::trajectory::Trajectory::load(&fixture(&format!("lora/{family}_trajectory.json")));
        let (mut model, start) = lora_model(family, "adapter0", dev);
        let base_before = model.read_all(Slot::Params).unwrap();
        model.alloc_training_state().unwrap();
        let mem = model.memory();
        assert_eq!(mem.grads, 4 * start.num_parameters(), "{family}: gradients are the adapters' only");
        assert_eq!(mem.adamw, 8 * start.num_parameters(), "{family}: AdamW state is the adapters' only");
        for step in 0..tr.steps {
            let s = tr.step(&mut model, step);
            let (l, n) = (tr.losses[step], tr.grad_norms[step]);
            assert!((s.loss - l).abs() <= 1e-5 * l, "{dev}: {family} step {step} loss {} vs {l}", s.loss);
            assert!((s.grad_norm - n).abs() <= 1e-4 * n, "{dev}: {family} step {step} norm {} vs {n}", s.grad_norm);
        }
        assert_eq!(model.read_all(Slot::Params).unwrap(), base_before, "{family}: the base is frozen");
        let cfg = model.config;
        let want = llmrs::formats::peft::load(&cfg, &fixture(&format!("lora/{family}_adapter20")), true).unwrap();
        let got = model.read_adapters().unwrap();
        compare(&got, &want.data, 1e-4, &format!("{dev}: {family}: adapters after 20 steps"));
        // Exported as PEFT's files, read back: the same adapters, PEFT's names and shapes.
        let dir = std::env::temp_dir().join(format!("llmrs-lora-export-{family}-{}", std::process::id()));
        let trained = Adapters { data: got.clone(), ..start.clone() };
        llmrs::formats::peft::save(&trained, &dir, "base", &cfg, llmrs::core::files::Dtype::F32).unwrap();
        assert_eq!(llmrs::formats::peft::load(&cfg, &dir, true).unwrap().data, got);
        let names = |d: &std::path::Path| {
            let b = std::fs::read(d.join("adapter_model.safetensors")).unwrap();
            let st = SafeTensors::deserialize(&b).unwrap();
            let mut n: Vec<(String, Vec<usize>)> =
                st.tensors().into_iter().map(|(n, t)| (n.to_string(), t.shape().to_vec())).collect();
            n.sort();
            n
        };
        assert_eq!(names(&dir), names(&fixture(&format!("lora/{family}_adapter20"))), "{family}: PEFT's tensor names");
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn merging_equals_pefts_merge_and_unload() {
    let io = Io::load();
    for family in ["llama", "gpt2"] {
        let mut w = load_hf(&base(family)).unwrap();
        let a = llmrs::formats::peft::load(&w.config, &fixture(&format!("lora/{family}_adapter0")), true).unwrap();
        a.merge_into(&mut w);
        let want = load_hf(&fixture(&format!("lora/{family}_merged0"))).unwrap();
        compare(&w.data, &want.data, 1e-6, &format!("{family}: merged weights"));
        let mut model = Model::new(w, Device::Cpu).unwrap();
        compare(&logits(&mut model, &io), &io.floats(&format!("{family}_merged0_logits")), 1e-4, "merged logits");
    }
}

/// The adapters as ops (not merged) in the KV-cached pass generation uses: the last position's
/// logits equal the merged model's, fed all at once and a token at a time.
#[test]
fn cached_passes_with_adapters_equal_the_merged_model() {
    let io = Io::load();
    for family in ["llama", "gpt2"] {
        let (mut model, a) = lora_model(family, "adapter20", Device::Cpu);
        let mut w = load_hf(&base(family)).unwrap();
        a.merge_into(&mut w);
        let mut merged = Model::new(w, Device::Cpu).unwrap();
        let toks = &io.inputs[..11];
        merged.forward(toks, None, 1, 11).unwrap();
        let want = merged.logits_at(10).unwrap();
        for chunk in [11, 1] {
            let mut cache = model.kv_cache(11, chunk).unwrap();
            let got = model.forward_cached(&mut cache, toks).unwrap().to_vec();
            model.free_kv_cache(cache);
            compare(&got, &want, 1e-4, &format!("{family}: cached logits, chunks of {chunk}"));
        }
    }
}

/// LoRA steps at recompute level 2 give the level-0 losses bit for bit; in the NaN-checking
/// mode (every output poisoned before its op, checked after) the same losses again.
#[test]
fn lora_steps_are_the_same_bits_at_every_recompute_level_and_nan_checked() {
    let tr = common::trajectory::Trajectory::load(&fixture("lora/llama_trajectory.json"));
    let losses = |recompute: u8, nan_check: bool| -> Vec<u32> {
        let w = load_hf(&base("llama")).unwrap();
        let a = llmrs::formats::peft::load(&w.config, &fixture("lora/llama_adapter0"), true).unwrap();
        let be = Box::new(llmrs::backend::cpu::backend::CpuBackend::new(nan_check));
        let mut model = Model::with_collectives(w, be, Box::new(llmrs::backend::comm::SingleProcess), 0).unwrap();
        model.set_lora(&a).unwrap();
        model.alloc_training_state().unwrap();
        model.set_recompute(recompute).unwrap();
        (0..4).map(|s| tr.step(&mut model, s).loss.to_bits()).collect()
    };
    let r0 = losses(0, false);
    assert_eq!(losses(2, false), r0, "-r 2");
    assert_eq!(losses(1, true), r0, "NaN-checking mode");
}

//! Hugging Face transformers as the reference for import: a GPT2LMHeadModel saved by
//! scripts/make_hf_reference.py (fp32 and bf16 safetensors) must give transformers' logits.
//! Export is checked the other way by that script's --check-export mode (recorded in README).

use llmrs::formats::hf::{load_hf, save_hf};
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn io() -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let bytes = std::fs::read(fixtures().join("io.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| {
        st.tensor(n).unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    };
    let floats = |n: &str| {
        st.tensor(n).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    (ints("input_ids"), floats("logits_fp32"), floats("logits_bf16weights"))
}

fn logits_of(weights: llmrs::core::params::Weights, ids: &[u32]) -> Vec<f32> {
    let (b, t) = (2, ids.len() / 2);
    let mut model = llmrs::model::Model::new(weights, llmrs::backend::Device::Cpu).unwrap();
    model.forward(ids, None, b, t).unwrap();
    (0..b * t).flat_map(|row| model.logits_at(row).unwrap()).collect()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    // fp32 on both sides with different summation orders: 1e-5 of the logits' scale.
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale.max(1.0), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn transformers_fp32_and_bf16_checkpoints_give_the_same_logits() {
    let (ids, want32, want16) = io();
    let m32 = load_hf(&fixtures().join("gpt2_tiny_fp32")).unwrap();
    assert_eq!((m32.config.vocab_size, m32.config.padded_vocab_size, m32.config.num_layers), (251, 256, 2));
    assert_close(&logits_of(m32, &ids), &want32, "fp32");
    let m16 = load_hf(&fixtures().join("gpt2_tiny_bf16/model.safetensors")).unwrap();
    assert_close(&logits_of(m16, &ids), &want16, "bf16 weights");
}

#[test]
fn export_reimports_to_the_same_model_in_both_dtypes() {
    let m = load_hf(&fixtures().join("gpt2_tiny_fp32")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_hf(&m, dir.path(), llmrs::core::files::Dtype::F32).unwrap();
    assert_eq!(load_hf(dir.path()).unwrap().data, m.data);
    // bf16 export of the bf16 fixture is bit-identical to the file transformers wrote.
    let m16 = load_hf(&fixtures().join("gpt2_tiny_bf16")).unwrap();
    save_hf(&m16, dir.path(), llmrs::core::files::Dtype::BF16).unwrap();
    let ours = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let theirs = std::fs::read(fixtures().join("gpt2_tiny_bf16/model.safetensors")).unwrap();
    let (a, b) = (SafeTensors::deserialize(&ours).unwrap(), SafeTensors::deserialize(&theirs).unwrap());
    let mut names = b.names();
    names.sort();
    let mut ours_names = a.names();
    ours_names.sort();
    assert_eq!(ours_names, names);
    for n in names {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!((x.dtype(), x.shape()), (y.dtype(), y.shape()), "{n}");
        assert_eq!(x.data(), y.data(), "{n}");
    }
}

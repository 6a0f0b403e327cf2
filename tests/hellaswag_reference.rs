//! HellaSwag scoring against a PyTorch/transformers scorer (scripts/make_hellaswag_reference.py,
//! llm.c's hellaswag.py logic) on a random-init model: the same tokens, per-ending losses and
//! predictions for the first 300 validation examples. The fixture carries those examples'
//! tokens; `hellaswag_val_head20.jsonl` (the data set's first 20 lines, verbatim) checks the
//! JSON reading and tokenization, and the whole data set, where present, all 300.

use llmrs::backend::Device;
use llmrs::core::config::ModelConfig;
use llmrs::core::params::Weights;
use llmrs::data::tokenizer::Tokenizer;
use llmrs::infer::hellaswag::{accuracy, load_jsonl, score, Example};
use llmrs::model::Model;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("hellaswag_ref.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The reference's examples as the scorer takes them.
fn reference_examples(want: &serde_json::Value) -> Vec<Example> {
    let ex = want["examples"].as_array().unwrap();
    ex.iter()
        .map(|w| Example {
            label: w["label"].as_u64().unwrap() as usize,
            ctx: ids(&w["ctx_tokens"]),
            endings: (0..4).map(|k| ids(&w["ending_tokens"][k])).collect(),
        })
        .collect()
}

/// Tokens and labels read from JSON lines agree with the reference's.
fn assert_same_tokens(got: &[Example], want: &serde_json::Value) {
    for (i, (e, w)) in got.iter().zip(want["examples"].as_array().unwrap()).enumerate() {
        assert_eq!(e.ctx, ids(&w["ctx_tokens"]), "example {i} context tokens");
        for k in 0..4 {
            assert_eq!(e.endings[k], ids(&w["ending_tokens"][k]), "example {i} ending {k} tokens");
        }
        assert_eq!(e.label, w["label"].as_u64().unwrap() as usize, "example {i} label");
    }
}

#[test]
fn json_lines_tokenize_as_the_reference() {
    let want = reference();
    let ex = load_jsonl(&fixture("hellaswag_val_head20.jsonl"), &Tokenizer::gpt2().unwrap()).unwrap();
    assert_eq!(ex.len(), 20);
    assert_same_tokens(&ex, &want);
}

#[test]
fn the_whole_validation_set_tokenizes_as_the_reference() {
    let data = llmrs::testdata::data_dir().join("hellaswag/hellaswag_val.preprocessed.jsonl");
    if !data.exists() {
        llmrs::testdata::skipped(
            "the_whole_validation_set_tokenizes_as_the_reference",
            &format!(
                "{} is not here (set LLMRS_DATA_DIR to a data directory with hellaswag/); the first 20 examples \
                 are checked from the fixture",
                data.display()
            ),
        );
        return;
    }
    let want = reference();
    let mut ex = load_jsonl(&data, &Tokenizer::gpt2().unwrap()).unwrap();
    assert_eq!(ex.len(), 10042);
    ex.truncate(want["n"].as_u64().unwrap() as usize);
    assert_same_tokens(&ex, &want);
}

#[test]
fn losses_and_predictions_match_the_pytorch_scorer() {
    let want = reference();
    let n = want["n"].as_u64().unwrap() as usize;
    let ex = reference_examples(&want);
    assert_eq!(ex.len(), n);
    // The fixture's model is `llmrs convert 2x64:4:256 --seed 42`: our random init.
    let weights = Weights::random(ModelConfig::from_descriptor("2x64:4:256").unwrap(), 42).unwrap();
    let mut model = Model::new(weights, Device::Cpu).unwrap();
    let got = score(&mut model, &ex, |_| {}).unwrap();
    assert_eq!(got.len(), n);
    for (i, (w, g)) in want["examples"].as_array().unwrap().iter().zip(&got).enumerate() {
        for k in 0..4 {
            // fp32 on both sides, summed in different orders: 1e-5 relative. The closest
            // avg-loss tie in these 300 examples is 2e-5 relative, so predictions must agree.
            let (ws, wa) = (w["sum_loss"][k].as_f64().unwrap() as f32, w["avg_loss"][k].as_f64().unwrap() as f32);
            assert!((g.sum_loss[k] - ws).abs() <= 1e-5 * ws, "example {i} ending {k}: sum {} vs {ws}", g.sum_loss[k]);
            assert!((g.avg_loss[k] - wa).abs() <= 1e-5 * wa, "example {i} ending {k}: avg {} vs {wa}", g.avg_loss[k]);
        }
        assert_eq!(
            (g.pred, g.pred_norm, g.label),
            (
                w["pred"].as_u64().unwrap() as usize,
                w["pred_norm"].as_u64().unwrap() as usize,
                w["label"].as_u64().unwrap() as usize
            ),
            "example {i}"
        );
    }
    let (c, cn, total) = accuracy(&got);
    assert_eq!(
        (c, cn, total),
        (want["num_correct"].as_u64().unwrap() as usize, want["num_correct_norm"].as_u64().unwrap() as usize, n)
    );
}

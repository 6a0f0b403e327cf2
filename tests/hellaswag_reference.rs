//! HellaSwag scoring against a PyTorch/transformers scorer (scripts/make_hellaswag_reference.py,
//! llm.c's hellaswag.py logic) on a random-init model: the same tokens, per-ending losses and
//! predictions for the first 300 validation examples.

use llmrs::backend::Device;
use llmrs::config::GPT2Config;
use llmrs::hellaswag::{accuracy, load_jsonl, score};
use llmrs::model::GPT2;
use llmrs::params::Weights;
use llmrs::tokenizer::Tokenizer;

#[test]
fn losses_and_predictions_match_the_pytorch_scorer() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hellaswag_ref.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let n = want["n"].as_u64().unwrap() as usize;
    // The fixture's model is `llmrs convert 2x64:4:256 --seed 42`: our random init.
    let weights = Weights::random(GPT2Config::from_descriptor("2x64:4:256").unwrap(), 42).unwrap();
    let mut model = GPT2::new(weights, Device::Cpu).unwrap();
    let data = llmrs::testdata::data_dir().join("hellaswag/hellaswag_val.preprocessed.jsonl");
    let mut ex = load_jsonl(&data, &Tokenizer::gpt2().unwrap()).unwrap();
    assert_eq!(ex.len(), 10042);
    ex.truncate(n);
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let got = score(&mut model, &ex, |_| {}).unwrap();
    for (i, (w, (e, g))) in want["examples"].as_array().unwrap().iter().zip(ex.iter().zip(&got)).enumerate() {
        assert_eq!(e.ctx, ids(&w["ctx_tokens"]), "example {i} context tokens");
        for k in 0..4 {
            assert_eq!(e.endings[k], ids(&w["ending_tokens"][k]), "example {i} ending {k} tokens");
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

//! Helpers shared by the integration tests.

use std::path::Path;

#[allow(dead_code)] // not every test file uses it
/// `train.bin` and `val.bin` in `dir`: token shards of a repeating pattern with noise (every
/// fourth token random), so a model can learn something quickly. `seed` picks the noise.
/// Returns their paths.
pub fn make_data(dir: &Path, seed: u64, train_tokens: usize, val_tokens: usize) -> (String, String) {
    make_data_below(dir, seed, train_tokens, val_tokens, 50257)
}

/// [`make_data`] with every token id below `vocab` (above 288, the repeated pattern's largest).
#[allow(dead_code)] // not every test file uses it
pub fn make_data_below(dir: &Path, seed: u64, train_tokens: usize, val_tokens: usize, vocab: u64) -> (String, String) {
    assert!(vocab > 288, "the pattern's ids go up to 288");
    let mut x = seed;
    let mut toks = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 4 == 3 {
                    (x % vocab) as u32
                } else {
                    (i % 97) as u32 * 3
                }
            })
            .collect()
    };
    let (tr, va) = (dir.join("train.bin"), dir.join("val.bin"));
    llmrs::data::loader::write_shard(&tr, &toks(train_tokens)).unwrap();
    llmrs::data::loader::write_shard(&va, &toks(val_tokens)).unwrap();
    (tr.to_str().unwrap().into(), va.to_str().unwrap().into())
}

/// The larger of two values, NaN if either is: a fold that lets no NaN through a tolerance check.
#[allow(dead_code)] // not every test file uses it
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// |a - b| <= atol + rtol |b| elementwise, atol 1e-5 of b's largest magnitude (the reference
/// tests' tolerance: both sides fp32, summing in different orders); a NaN anywhere fails.
#[allow(dead_code)] // not every test file uses it
pub fn compare(a: &[f32], b: &[f32], rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let atol = 1e-5 * scale.max(1e-30);
    let (mut worst, mut at) = (0f32, 0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let r = (x - y).abs() / (atol + rtol * y.abs());
        if r > worst || r.is_nan() {
            (worst, at) = (if r.is_nan() { f32::INFINITY } else { r }, i);
        }
    }
    assert!(worst <= 1.0, "{what}: element {at}: {} vs {} (ratio {worst})", a[at], b[at]);
}

#[allow(dead_code)] // not every test file uses it
pub mod gpu;

#[allow(dead_code)] // not every test file uses it
pub mod trajectory;

/// A model file `dir/model.bin` of descriptor `desc`'s shape with a vocabulary of 600 (padded
/// to 640), random weights: the tests' small models without GPT-2's 50,257-token classifier,
/// which took most of their time. Returns its path.
#[allow(dead_code)] // not every test file uses it
pub fn small_vocab_model(dir: &Path, desc: &str) -> String {
    let mut mc = llmrs::core::config::ModelConfig::from_descriptor(desc).unwrap();
    (mc.vocab_size, mc.padded_vocab_size) = (600, 640);
    let model = dir.join("model.bin");
    let w = llmrs::core::params::Weights::random(mc, 42).unwrap();
    llmrs::formats::llmc::save_model(&w, &model, llmrs::core::files::Dtype::F32).unwrap();
    model.to_str().unwrap().into()
}

//! Helpers shared by the integration tests.

use std::path::Path;

#[allow(dead_code)] // not every test file uses it
/// `train.bin` and `val.bin` in `dir`: token shards of a repeating pattern with noise (every
/// fourth token random), so a model can learn something quickly. `seed` picks the noise.
/// Returns their paths.
pub fn make_data(dir: &Path, seed: u64, train_tokens: usize, val_tokens: usize) -> (String, String) {
    let mut x = seed;
    let mut toks = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 4 == 3 {
                    (x % 50257) as u32
                } else {
                    (i % 97) as u32 * 3
                }
            })
            .collect()
    };
    let (tr, va) = (dir.join("train.bin"), dir.join("val.bin"));
    llmrs::data::write_shard(&tr, &toks(train_tokens)).unwrap();
    llmrs::data::write_shard(&va, &toks(val_tokens)).unwrap();
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

#[allow(dead_code)] // not every test file uses it
pub mod gpu;

#[allow(dead_code)] // not every test file uses it
pub mod trajectory;

//! Property-based fuzzing of every file parser: random bytes, random byte mutations and
//! truncations of a valid file, and extreme header values. Each parser must return Ok or a
//! clear error, never panic, and never allocate from a header more than the file could back.
//! Cases: `cases()` per strategy (4 strategies), each case picking one of the 9 parsers at
//! random, so about cases * 4 / 9 per parser: 2000 per parser in every test run, and as many as
//! asked with `LLMRS_FUZZ_CASES` (2250000 gives a million per parser; README has the command).

use llmrs::backend::Device;
use llmrs::core::config::ModelConfig;
use llmrs::core::files::Dtype;
use llmrs::core::params::Weights;
use llmrs::formats::llmc::{load_model, save_model};
use llmrs::model::Model;
use llmrs::train::checkpoint::{load_state, save_state, TrainState};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// Cases per strategy: 4500, or `$LLMRS_FUZZ_CASES` for a long opt-in run.
fn cases() -> u32 {
    std::env::var("LLMRS_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4500)
}

/// Fail (abort) on any single allocation over 64 MiB: every valid file here is tiny, so a larger
/// request can only come from trusting a header field.
struct Capped;
const ALLOC_LIMIT: usize = 64 << 20;
// SAFETY: forwards to the system allocator unchanged, except refusing oversized requests (a
// null return is the documented way to report failure).
unsafe impl std::alloc::GlobalAlloc for Capped {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as our caller's.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: `p` came from `System.alloc` with this layout.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        if new > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as our caller's.
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}
#[global_allocator]
static ALLOC: Capped = Capped;

/// One valid file of every format, written once per test process.
struct Valid {
    _dir: tempfile::TempDir,
    model: PathBuf,
    state: PathBuf,
    shard: PathBuf,
    tokenizer: PathBuf,
    hf_dir: PathBuf,
    /// A LoRA run's checkpoint and a PEFT adapter directory, for the model above.
    lora: PathBuf,
    peft_dir: PathBuf,
}

fn valid() -> &'static Valid {
    static V: std::sync::OnceLock<Valid> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let cfg =
            ModelConfig { vocab_size: 50, padded_vocab_size: 64, ..ModelConfig::from_descriptor("1x8:2:8").unwrap() };
        let w = Weights::random(cfg, 1).unwrap();
        let model = dir.path().join("model.bin");
        save_model(&w, &model, Dtype::F32).unwrap();
        let shard = dir.path().join("shard.bin");
        llmrs::data::loader::write_shard(&shard, &(0..40).map(|i| i % 50).collect::<Vec<_>>()).unwrap();
        let mut dl = llmrs::data::loader::DataLoader::new(shard.to_str().unwrap(), 1, 4, 50, true).unwrap();
        dl.next_batch().unwrap();
        let state = dir.path().join("state.bin");
        let st = TrainState { step: 3, loader: dl.state(), should_shuffle: true };
        save_state(&state, &mut trainable(&model), &st, Dtype::F32).unwrap();
        let tokenizer = dir.path().join("tok.bin");
        llmrs::data::tokenizer::Tokenizer::gpt2().unwrap().save_llmc(&tokenizer).unwrap();
        let hf_dir = dir.path().join("hf");
        llmrs::formats::hf::save_hf(&w, &hf_dir, Dtype::F32).unwrap();
        let targets = llmrs::model::lora::select(&cfg, &[]).unwrap();
        let a = llmrs::model::lora::Adapters::new(2, 4.0, targets, &mut llmrs::core::rng::Mt19937::new(3)).unwrap();
        let lora = dir.path().join("lora.bin");
        llmrs::formats::lora::save_checkpoint(&lora, &cfg, &a, &llmrs::formats::lora::BaseId::of("1x8:2:8", 1, &w))
            .unwrap();
        let peft_dir = dir.path().join("peft");
        llmrs::formats::peft::save(&a, &peft_dir, "base", &cfg, llmrs::core::files::Dtype::F32).unwrap();
        Valid { _dir: dir, model, state, shard, tokenizer, hf_dir, lora, peft_dir }
    })
}

/// The model file on the CPU backend, ready to take a training state.
fn trainable(model: &Path) -> Model {
    let mut m = Model::new(load_model(model).unwrap(), Device::Cpu).unwrap();
    m.alloc_training_state().unwrap();
    m
}

/// Every parser, run on `bytes` in place of the valid file of its kind.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Model,
    State,
    Shard,
    Tokenizer,
    Safetensors,
    ConfigJson,
    LoraCheckpoint,
    PeftWeights,
    PeftConfig,
}

fn parse(kind: Kind, bytes: &[u8]) {
    let v = valid();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f.bin");
    std::fs::write(&p, bytes).unwrap();
    let _ = match kind {
        Kind::Model => load_model(&p).map(|_| ()),
        Kind::State => load_state(&p, &mut trainable(&v.model)).map(|_| ()),
        Kind::Shard => {
            let _ = llmrs::data::loader::read_shard(&p);
            llmrs::data::loader::DataLoader::new(p.to_str().unwrap(), 2, 3, 50, true).and_then(|mut d| d.next_batch())
        }
        Kind::Tokenizer => llmrs::data::tokenizer::Tokenizer::load_llmc(&p).map(|t| drop(t.decode(&[0, 1, 5, 49999]))),
        Kind::Safetensors => {
            std::fs::copy(v.hf_dir.join("config.json"), dir.path().join("config.json")).unwrap();
            std::fs::rename(&p, dir.path().join("model.safetensors")).unwrap();
            llmrs::formats::hf::load_hf(dir.path()).map(|_| ())
        }
        Kind::ConfigJson => {
            std::fs::copy(v.hf_dir.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
            std::fs::rename(&p, dir.path().join("config.json")).unwrap();
            llmrs::formats::hf::load_hf(dir.path()).map(|_| ())
        }
        Kind::LoraCheckpoint => llmrs::formats::lora::load_checkpoint(&p).map(|_| ()),
        Kind::PeftWeights | Kind::PeftConfig => {
            let (mine, other) = match kind {
                Kind::PeftWeights => (llmrs::formats::peft::WEIGHTS_FILE, llmrs::formats::peft::CONFIG_FILE),
                _ => (llmrs::formats::peft::CONFIG_FILE, llmrs::formats::peft::WEIGHTS_FILE),
            };
            std::fs::copy(v.peft_dir.join(other), dir.path().join(other)).unwrap();
            std::fs::rename(&p, dir.path().join(mine)).unwrap();
            let cfg = llmrs::formats::llmc::peek_config(&v.model).unwrap();
            llmrs::formats::peft::load(&cfg, dir.path(), true).map(|_| ())
        }
    };
}

fn valid_bytes(kind: Kind) -> Vec<u8> {
    let v = valid();
    let p: &Path = match kind {
        Kind::Model => &v.model,
        Kind::State => &v.state,
        Kind::Shard => &v.shard,
        Kind::Tokenizer => &v.tokenizer,
        Kind::Safetensors => return std::fs::read(v.hf_dir.join("model.safetensors")).unwrap(),
        Kind::ConfigJson => return std::fs::read(v.hf_dir.join("config.json")).unwrap(),
        Kind::LoraCheckpoint => &v.lora,
        Kind::PeftWeights => return std::fs::read(v.peft_dir.join(llmrs::formats::peft::WEIGHTS_FILE)).unwrap(),
        Kind::PeftConfig => return std::fs::read(v.peft_dir.join(llmrs::formats::peft::CONFIG_FILE)).unwrap(),
    };
    std::fs::read(p).unwrap()
}

const KINDS: [Kind; 9] = [
    Kind::Model,
    Kind::State,
    Kind::Shard,
    Kind::Tokenizer,
    Kind::Safetensors,
    Kind::ConfigJson,
    Kind::LoraCheckpoint,
    Kind::PeftWeights,
    Kind::PeftConfig,
];

fn kind() -> impl Strategy<Value = Kind> {
    (0..KINDS.len()).prop_map(|i| KINDS[i])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(k in kind(), bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        parse(k, &bytes);
    }

    #[test]
    fn mutated_valid_files(k in kind(), edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut b = valid_bytes(k);
        for (i, x) in edits {
            let at = i.index(b.len());
            b[at] = x;
        }
        parse(k, &b);
    }

    #[test]
    fn truncated_valid_files(k in kind(), cut in any::<prop::sample::Index>()) {
        let b = valid_bytes(k);
        parse(k, &b[..cut.index(b.len())]);
    }

    /// Header ints set to extreme values: huge shapes, counts and offsets must not allocate.
    #[test]
    fn extreme_header_fields(k in kind(), field in 0usize..40, value in prop_oneof![Just(i32::MAX), Just(i32::MIN), Just(-1), Just(0), Just(1 << 30), any::<i32>()]) {
        let mut b = valid_bytes(k);
        if b.len() >= 4 * (field + 1) {
            b[4 * field..4 * field + 4].copy_from_slice(&value.to_le_bytes());
        }
        parse(k, &b);
    }
}

#[test]
fn valid_files_parse() {
    // The fuzzing above starts from these; make sure they are indeed accepted.
    let v = valid();
    load_state(&v.state, &mut trainable(&v.model)).unwrap();
    llmrs::data::loader::read_shard(&v.shard).unwrap();
    llmrs::data::tokenizer::Tokenizer::load_llmc(&v.tokenizer).unwrap();
    llmrs::formats::hf::load_hf(&v.hf_dir).unwrap();
    llmrs::formats::lora::load_checkpoint(&v.lora).unwrap();
    let cfg = llmrs::formats::llmc::peek_config(&v.model).unwrap();
    llmrs::formats::peft::load(&cfg, &v.peft_dir, true).unwrap();
}

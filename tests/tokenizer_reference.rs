//! The GPT-2 tokenizer and Tiny Shakespeare preparation against OpenAI's `tiktoken` (fixtures
//! from scripts/make_tokenizer_reference.py).

use llmrs::prepare::{prepare_tinyshakespeare, Source};
use llmrs::tokenizer::Tokenizer;
use std::path::PathBuf;

fn fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn encodes_like_tiktoken_and_round_trips() {
    let tok = Tokenizer::gpt2().unwrap();
    let cases = fixture("tokenizer_cases.json");
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 40);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(tok.decode(&want), text);
    }
}

#[test]
fn tinyshakespeare_shards_are_byte_identical_to_llmc() {
    let want = fixture("tinyshakespeare_shards.json");
    let dir = tempfile::tempdir().unwrap();
    let data_dir = Some(llmrs::testdata::data_dir_with_tinyshakespeare());
    let (train, val) = prepare_tinyshakespeare(&Source { file: None, data_dir, url: "" }, dir.path()).unwrap();
    for (path, key) in [(train, "train"), (val, "val")] {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(bytes.len() as u64, want[key]["bytes"].as_u64().unwrap(), "{key} size");
        assert_eq!(llmrs::download::sha256_hex(&bytes), want[key]["sha256"].as_str().unwrap(), "{key} sha256");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, failure_persistence: None, ..Default::default() })]

    /// decode(encode(s)) == s for any Unicode string (proptest's generator covers every plane,
    /// combining marks, whitespace runs and control characters).
    #[test]
    fn decode_encode_is_identity(s in "\\PC*|[ \t\n\r]{0,20}|(\\p{M}|\\p{Emoji}|[a-z ]){0,40}|.{0,200}") {
        let tok = tokenizer();
        proptest::prop_assert_eq!(tok.decode(&tok.encode(&s).unwrap()), s);
    }
}

fn tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| Tokenizer::gpt2().unwrap())
}

//! The GPT-2 tokenizer and Tiny Shakespeare preparation against OpenAI's `tiktoken` (fixtures
//! from scripts/make_tokenizer_reference.py).

use llmrs::data::prepare::{prepare_tinyshakespeare, Source};
use llmrs::data::tokenizer::Tokenizer;
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
        assert_eq!(llmrs::hub::download::sha256_hex(&bytes), want[key]["sha256"].as_str().unwrap(), "{key} sha256");
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

/// A model's tokenizer.json through the `tokenizers` crate encodes and decodes as Python's
/// `tokenizers` (scripts/make_hf_tokenizer_reference.py): byte-level BPE (Llama 3, SmolLM2) and
/// SentencePiece-style BPE with byte fallback (Llama 2, TinyLlama). Streaming decode (the token
/// bytes `generate` prints one at a time) gives the same text.
#[test]
fn tokenizer_json_encodes_as_python_tokenizers_does() {
    use llmrs::data::tokenizer::Tokenizer;
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    // Qwen's has no beginning-of-text token: its documents start with <|endoftext|>.
    for (name, vocab, eot, start) in [("bytelevel", 600, 0, 1), ("sentencepiece", 500, 2, 1), ("qwen", 700, 0, 0)] {
        let tok = Tokenizer::load_hf(&dir.join(format!("{name}.json"))).unwrap();
        assert_eq!((tok.vocab_size(), tok.eot, tok.doc_start), (vocab, eot, start), "{name}");
        for c in cases[name].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let ids = tok.encode(text).unwrap();
            assert_eq!(ids, want, "{name}: {text:?}");
            assert_eq!(tok.decode(&ids), c["decoded"].as_str().unwrap(), "{name}: decode of {text:?}");
            let streamed: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i).to_vec()).collect();
            // SentencePiece prepends a space to non-empty text, which its decoder strips.
            let streamed = String::from_utf8(streamed).unwrap();
            let streamed = if name == "sentencepiece" {
                streamed.strip_prefix(' ').unwrap_or(&streamed).to_string()
            } else {
                streamed
            };
            // Qwen's NFC normalizer composes characters: its bytes are the normalized text's.
            let want = if name == "qwen" { c["decoded"].as_str().unwrap() } else { text };
            assert_eq!(streamed, want, "{name}: streamed bytes of {text:?}");
        }
        let e = tok.check_fits(vocab - 1).unwrap_err().to_string();
        assert!(e.contains(&format!("the tokenizer has {vocab} tokens")), "{e}");
        tok.check_fits(vocab).unwrap();
    }
    // A file that is not a tokenizer.json is a clear error.
    let bad = dir.join("cases.json");
    assert!(format!("{:#}", Tokenizer::load_hf(&bad).err().unwrap()).contains("not a tokenizer.json"));
}

//! Turn text into llm.c token shards.

use crate::data::loader::{write_shard, write_shard_as};
use crate::data::tokenizer::Tokenizer;
use crate::hub::download::{download, sha256_hex, TINY_SHAKESPEARE};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Tokenize Tiny Shakespeare exactly as llm.c's dev/data/tinyshakespeare.py: sections split on
/// blank lines, each preceded by <|endoftext|> and followed by the "\n\n" it was split on
/// (except the last); the first 32768 tokens are validation.
pub fn tokenize_tinyshakespeare(text: &str, tok: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>)> {
    let sections: Vec<&str> = text.split("\n\n").collect();
    let mut tokens = Vec::with_capacity(text.len() / 3);
    for (i, s) in sections.iter().enumerate() {
        tokens.push(tok.eot);
        if i + 1 == sections.len() {
            tokens.extend(tok.encode(s)?);
        } else {
            tokens.extend(tok.encode(&format!("{s}\n\n"))?);
        }
    }
    if tokens.len() <= 32768 {
        bail!(
            "the text gives only {} tokens; Tiny Shakespeare needs more than the 32768 validation tokens",
            tokens.len()
        );
    }
    let train = tokens.split_off(32768);
    Ok((tokens, train))
}

/// Paths of the prepared Tiny Shakespeare shards in `out_dir`.
pub fn tinyshakespeare_paths(out_dir: &Path) -> (PathBuf, PathBuf) {
    (out_dir.join("tiny_shakespeare_train.bin"), out_dir.join("tiny_shakespeare_val.bin"))
}

/// Where to get Tiny Shakespeare's text from.
pub struct Source<'a> {
    /// An explicit text file (any text; not hash-checked).
    pub file: Option<&'a Path>,
    /// A data directory (`$LLMRS_DATA_DIR`) holding `tinyshakespeare/input.txt`.
    pub data_dir: Option<PathBuf>,
    /// Where to download from when neither is given and no cached copy exists.
    pub url: &'a str,
}

impl Source<'_> {
    /// The usual source: `$LLMRS_DATA_DIR` if set, else the public URL.
    pub fn from_env(file: Option<&Path>) -> Source<'_> {
        Source { file, data_dir: crate::core::env::data_dir(), url: TINY_SHAKESPEARE.url }
    }
}

/// Find the Tiny Shakespeare text: an explicit file, the data directory's copy, a cached
/// `out_dir/input.txt`, or else download it.
pub fn tinyshakespeare_text(src: &Source, out_dir: &Path) -> Result<String> {
    let (source, url) = (src.file, src.url);
    let cached = out_dir.join("input.txt");
    let path = if let Some(p) = source {
        p.to_path_buf()
    } else if let Some(dir) = &src.data_dir {
        dir.join("tinyshakespeare/input.txt")
    } else {
        if !cached.exists() {
            download(url, &cached, Some(TINY_SHAKESPEARE.sha256))?;
        }
        cached
    };
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    if source.is_none() && sha256_hex(&bytes) != TINY_SHAKESPEARE.sha256 {
        bail!(
            "{} is not the published Tiny Shakespeare (SHA-256 differs); delete it to download a fresh copy",
            path.display()
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}

/// `llmrs prepare tinyshakespeare`: write the train/val shards into `out_dir`.
pub fn prepare_tinyshakespeare(src: &Source, out_dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let text = tinyshakespeare_text(src, out_dir)?;
    let tok = Tokenizer::gpt2()?;
    let (val, train) = tokenize_tinyshakespeare(&text, &tok)?;
    let (train_path, val_path) = tinyshakespeare_paths(out_dir);
    write_shard(&val_path, &val)?;
    write_shard(&train_path, &train)?;
    eprintln!("wrote {} val tokens to {}", val.len(), val_path.display());
    eprintln!("wrote {} train tokens to {}", train.len(), train_path.display());
    Ok((train_path, val_path))
}

/// HellaSwag's validation set (JSON lines), the file llm.c's hellaswag.py downloads.
pub const HELLASWAG_VAL_URL: &str =
    "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl";

/// Find HellaSwag's JSON lines: an explicit file, `$LLMRS_DATA_DIR/hellaswag/`'s copy, a cached
/// `out_dir/hellaswag_val.jsonl`, or else download it.
pub fn hellaswag_jsonl(input: Option<&Path>, out_dir: &Path) -> Result<PathBuf> {
    if let Some(p) = input {
        return Ok(p.to_path_buf());
    }
    if let Some(d) = crate::core::env::data_dir() {
        return Ok(d.join("hellaswag/hellaswag_val.preprocessed.jsonl"));
    }
    let cached = out_dir.join("hellaswag_val.jsonl");
    if !cached.exists() {
        // Upstream publishes no checksum for this file; its size is checked by the HTTP layer.
        download(HELLASWAG_VAL_URL, &cached, None)?;
    }
    Ok(cached)
}

/// The validation tokens `prepare text` keeps by default: llm.c's Tiny Shakespeare split.
/// An input of fewer than ten times as many keeps a tenth of its tokens.
pub const VAL_TOKENS: usize = 32768;

/// `llmrs prepare text FILE... -o DIR`: UTF-8 documents, each preceded by <|endoftext|>, the
/// first `val_tokens` tokens (default: see [`VAL_TOKENS`]) to `DIR/val_000000.bin`, the rest
/// to `DIR/train_000000.bin`.
pub fn prepare_text(files: &[PathBuf], out_dir: &Path, val_tokens: Option<usize>) -> Result<(PathBuf, PathBuf)> {
    prepare_text_with(files, out_dir, val_tokens, &Tokenizer::gpt2()?)
}

/// [`prepare_text`] with any tokenizer: documents start with its `doc_start` token, and the
/// shards are uint32 when its vocabulary needs more than 16 bits. Streams: each file is read
/// and tokenized a piece at a time ([`Tokenizer::encode_reader`]) and the train shard written
/// as it goes, so memory stays bounded whatever the size of the text.
pub fn prepare_text_with(
    files: &[PathBuf],
    out_dir: &Path,
    val_tokens: Option<usize>,
    tok: &Tokenizer,
) -> Result<(PathBuf, PathBuf)> {
    let (train_path, val_path) = (out_dir.join("train_000000.bin"), out_dir.join("val_000000.bin"));
    let wide = tok.vocab_size() > 1 << 16;
    for f in files {
        crate::core::files::check_regular(f)?;
    }
    // The val shard is the first tokens, kept in memory. How many is known from the start with
    // --val-tokens; else once 10 * VAL_TOKENS have come (then VAL_TOKENS, the rest of those
    // going to the train shard first) or the input has ended (a tenth of it).
    let mut val: Vec<u32> = Vec::with_capacity(val_tokens.unwrap_or(10 * VAL_TOKENS).min(1 << 24));
    let mut decided = val_tokens;
    let mut train = crate::data::loader::ShardWriter::create(&train_path, wide)?;
    {
        let mut push = |ids: &[u32]| -> Result<()> {
            let cap = decided.unwrap_or(10 * VAL_TOKENS);
            let k = cap.saturating_sub(val.len()).min(ids.len());
            val.extend_from_slice(&ids[..k]);
            if decided.is_none() && val.len() == cap {
                train.push(&val[VAL_TOKENS..])?;
                val.truncate(VAL_TOKENS);
                decided = Some(VAL_TOKENS);
            }
            train.push(&ids[k..])
        };
        for f in files {
            let name = f.display().to_string();
            let mut file = std::fs::File::open(f).with_context(|| format!("cannot read {name}"))?;
            push(&[tok.doc_start])?;
            let bytes = tok.encode_reader(&mut file, &name, &mut push)?;
            if bytes == 0 {
                bail!("{name} is empty");
            }
        }
    }
    let total = val.len() + train.len();
    let how = match (val_tokens, decided) {
        (Some(n), _) => {
            if total <= n + 1 {
                bail!(
                    "the input gives {total} tokens, not enough for --val-tokens {n} plus training data: give fewer \
                     validation tokens (or more text)"
                );
            }
            "--val-tokens".to_string()
        }
        (None, Some(_)) => format!("llm.c's {VAL_TOKENS}; --val-tokens N to choose"),
        (None, None) => {
            // A small input: everything is still in `val`, and the train shard empty.
            let n = total / 10;
            if n == 0 {
                bail!("the input gives {total} tokens: too few to keep some for validation and train on the rest");
            }
            train.push(&val[n..])?;
            val.truncate(n);
            format!("a tenth of the input's {total}; --val-tokens N to choose")
        }
    };
    let n_train = train.finish()?;
    if val.is_empty() {
        // --val-tokens 0: no validation shard (an old one would belong to other text).
        if val_path.exists() {
            std::fs::remove_file(&val_path).with_context(|| format!("cannot remove {}", val_path.display()))?;
        }
        eprintln!("wrote {n_train} train tokens to {} and no val shard (train with -j '')", out_dir.display());
    } else {
        write_shard_as(&val_path, &val, wide)?;
        eprintln!("wrote {} val tokens ({how}) and {n_train} train tokens to {}", val.len(), out_dir.display());
    }
    Ok((train_path, val_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tinyshakespeare_split_matches_llmc_rules() {
        let tok = Tokenizer::gpt2().unwrap();
        let text = "A: hi\n\nB: there\n\nC: end".to_string() + &"x y\n\n".repeat(20000);
        let (val, train) = tokenize_tinyshakespeare(&text, &tok).unwrap();
        assert_eq!(val.len(), 32768);
        assert_eq!(val[0], tok.eot);
        // "A: hi\n\n" then EOT then "B: there\n\n" ...
        let first_doc_end = val[1..].iter().position(|&t| t == tok.eot).unwrap() + 1;
        assert_eq!(tok.decode(&val[1..first_doc_end]), "A: hi\n\n");
        let all: Vec<u32> = val.iter().chain(&train).copied().collect();
        assert_eq!(tok.decode(&all).replace("<|endoftext|>", ""), text);
    }

    #[test]
    fn prepare_text_rejects_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin.dat");
        std::fs::write(&bin, [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
        let e = prepare_text(&[bin], dir.path(), Some(10)).unwrap_err();
        assert!(format!("{e:#}").contains("not UTF-8"));
        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        assert!(format!("{:#}", prepare_text(&[empty], dir.path(), Some(10)).unwrap_err()).contains("empty"));
        assert!(!dir.path().join("train_000000.bin").exists(), "no half-written shards");
        let good = dir.path().join("good.txt");
        std::fs::write(&good, "Now is the winter of our discontent ".repeat(20)).unwrap();
        let (tr, va) = prepare_text(std::slice::from_ref(&good), dir.path(), Some(10)).unwrap();
        assert_eq!(crate::data::loader::read_shard(&va).unwrap().len(), 10);
        assert!(crate::data::loader::read_shard(&tr).unwrap().len() > 50);
        let e = format!("{:#}", prepare_text(&[good], dir.path(), Some(1000)).unwrap_err());
        assert!(e.contains("not enough for --val-tokens 1000"), "{e}");
    }

    /// Without --val-tokens: llm.c's 32,768 for an input of ten times that or more, else a
    /// tenth of it; either way the two shards are the input's tokens in order.
    #[test]
    fn the_default_validation_split_scales_with_the_input() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::gpt2().unwrap();
        for (words, small) in [(3_000, true), (400_000, false)] {
            let f = dir.path().join("t.txt");
            let text: String = (0..words).map(|i| format!("w{} ", i % 97)).collect();
            std::fs::write(&f, &text).unwrap();
            let (tr, va) = prepare_text(&[f], dir.path(), None).unwrap();
            let (val, train) =
                (crate::data::loader::read_shard(&va).unwrap(), crate::data::loader::read_shard(&tr).unwrap());
            let total = val.len() + train.len();
            let want = if small { total / 10 } else { VAL_TOKENS };
            assert_eq!(val.len(), want, "{words} words: {total} tokens");
            assert_eq!(small, total < 10 * VAL_TOKENS, "the case tested");
            let mut all = vec![tok.doc_start];
            all.extend(tok.encode(&text).unwrap());
            assert!(val.iter().chain(&train).copied().eq(all), "{words} words: the tokens in order");
        }
    }

    /// `prepare text` tokenizes a file a piece at a time: the ids must be those of the whole
    /// text, for GPT-2's tokenizer and for both kinds of tokenizer.json (byte-level BPE, and
    /// SentencePiece-style, whose "▁" prefix belongs to the start of a document only), across
    /// several cuts and with multi-byte characters around the read blocks' edges.
    #[test]
    fn streamed_text_gives_the_ids_of_the_whole_text() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
        let text = (crate::testdata::tinyshakespeare_text() + "\nÉtude 🦀 naïve café,\n  indented\n").repeat(2);
        assert!(text.len() > 2 * crate::data::tokenizer::ENCODE_PIECE_BYTES);
        for tok in [
            Tokenizer::gpt2().unwrap(),
            Tokenizer::load_hf(&fixtures.join("bytelevel.json")).unwrap(),
            Tokenizer::load_hf(&fixtures.join("sentencepiece.json")).unwrap(),
            Tokenizer::load_hf(&fixtures.join("qwen.json")).unwrap(),
        ] {
            let whole = tok.encode(&text).unwrap();
            let (mut streamed, mut pieces) = (vec![], 0);
            let n = tok
                .encode_reader(&mut text.as_bytes(), "text", &mut |ids| {
                    pieces += 1;
                    streamed.extend_from_slice(ids);
                    Ok(())
                })
                .unwrap();
            assert_eq!(n, text.len());
            assert!(pieces >= 3, "{}: {pieces} pieces", tok.identity());
            assert!(streamed == whole, "{}: the pieces' ids differ from the whole text's", tok.identity());
        }
        // A byte that is not UTF-8, past the first piece: named with its offset.
        let mut bad = text.clone().into_bytes();
        let at = bad.len() - 100;
        bad[at] = 0xff;
        let e = Tokenizer::gpt2().unwrap().encode_reader(&mut &bad[..], "f.txt", &mut |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains(&format!("invalid byte at offset {at}")), "{e}");
    }

    #[test]
    fn downloads_tinyshakespeare_when_no_copy_is_at_hand() {
        // A local server stands in for the public URL and serves the real text (from the data
        // directory, which tests require); the download is hash-checked and cached.
        let real = crate::testdata::tinyshakespeare_text();
        let url = crate::hub::download::tests::serve(real.clone().into_bytes(), 1);
        let dir = tempfile::tempdir().unwrap();
        let src = Source { file: None, data_dir: None, url: &format!("{url}/input.txt") };
        assert_eq!(tinyshakespeare_text(&src, dir.path()).unwrap(), real);
        assert!(dir.path().join("input.txt").exists());
        // Second time: the cached copy is used (the server has stopped answering).
        assert_eq!(tinyshakespeare_text(&src, dir.path()).unwrap().len(), real.len());
        // A wrong file from the server is refused by its hash.
        let bad = crate::hub::download::tests::serve(b"not shakespeare".to_vec(), 1);
        let dir2 = tempfile::tempdir().unwrap();
        let src = Source { file: None, data_dir: None, url: &format!("{bad}/input.txt") };
        assert!(format!("{:#}", tinyshakespeare_text(&src, dir2.path()).unwrap_err()).contains("SHA-256"));
    }
}

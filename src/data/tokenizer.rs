//! Tokenizers: the GPT-2 byte-level BPE (built in, from tiktoken-rs's `r50k_base`, which equals
//! OpenAI's GPT-2 tables), llm.c's `gpt2_tokenizer.bin` (magic 20240328, versions 1 and 2,
//! decode only), and a model's own `tokenizer.json` through Hugging Face's `tokenizers` crate
//! (Llama 3, SmolLM2, TinyLlama: byte-level BPE or SentencePiece-style with byte fallback).

use crate::core::config::GPT2_EOT;
use crate::core::files::{parse_header, write_atomic, HEADER_BYTES};
use anyhow::{bail, Context, Result};
use std::path::Path;

pub const TOKENIZER_MAGIC: i32 = 20240328;
/// [`Tokenizer::identity`] of GPT-2's tokenizer.
pub const GPT2: &str = "gpt2";

/// Encoder + decoder of token ids.
pub struct Tokenizer {
    bpe: Option<tiktoken_rs::CoreBPE>,
    hf: Option<Box<tokenizers::Tokenizer>>,
    /// `hf` for text that continues a document rather than starting it: without the prefix a
    /// SentencePiece-style tokenizer puts at the start of every input (Llama 2's normalizer
    /// `Prepend("▁")`, Metaspace's `prepend_scheme`); None where that is `hf` itself.
    hf_cont: Option<Box<tokenizers::Tokenizer>>,
    /// Byte string of every token id (decode table, for streaming).
    table: Vec<Vec<u8>>,
    /// The end-of-text token (generation stops at it).
    pub eot: u32,
    /// The token that starts every document in prepared data: GPT-2's `<|endoftext|>`, or the
    /// beginning-of-text token of a tokenizer that has one (Llama 3's `<|begin_of_text|>`).
    pub doc_start: u32,
    /// What gives the same ids: `gpt2` (the built-in BPE, and llm.c's decode table of it), or
    /// `sha256:HEX` of a tokenizer.json's bytes. Prepared data records it.
    identity: String,
}

/// Text encoded at once by [`Tokenizer::encode_reader`] (about 100 MiB of the `tokenizers`
/// crate's memory).
pub const ENCODE_PIECE_BYTES: usize = 1 << 20;

/// A tokenizer.json without the prefix its normalizer or pre-tokenizer puts at the start of
/// every input (SentencePiece's "▁"), for text that continues a document; None when it puts
/// none.
fn without_start_prefix(json: &serde_json::Value) -> Option<serde_json::Value> {
    use serde_json::Value;
    let mut j = json.clone();
    let mut changed = false;
    let normalizer = &mut j["normalizer"];
    if normalizer["type"] == "Prepend" {
        *normalizer = Value::Null;
        changed = true;
    } else if let Some(list) = normalizer.get_mut("normalizers").and_then(Value::as_array_mut) {
        let before = list.len();
        list.retain(|n| n["type"] != "Prepend");
        changed |= list.len() != before;
    }
    let mut metaspace = |p: &mut Value| {
        if p["type"] == "Metaspace" {
            if p.get("prepend_scheme").is_some_and(|s| s != "never") {
                p["prepend_scheme"] = "never".into();
                changed = true;
            }
            if p.get("add_prefix_space") == Some(&Value::Bool(true)) {
                p["add_prefix_space"] = false.into();
                changed = true;
            }
        }
    };
    let pre = &mut j["pre_tokenizer"];
    match pre.get_mut("pretokenizers").and_then(Value::as_array_mut) {
        Some(list) => list.iter_mut().for_each(&mut metaspace),
        None => metaspace(pre),
    }
    changed.then_some(j)
}

/// GPT-2's byte-to-character map of byte-level BPE (every byte a printable character), inverted.
fn byte_level_decoder() -> std::collections::HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (char::from_u32(c).expect("a valid char"), b as u8)).collect()
}

impl Tokenizer {
    /// The built-in GPT-2 tokenizer.
    pub fn gpt2() -> Result<Self> {
        let bpe = tiktoken_rs::r50k_base().context("cannot build the GPT-2 tokenizer")?;
        let table = (0..GPT2_EOT)
            .map(|i| bpe.decode_bytes(&[i]).map_err(|e| anyhow::anyhow!("token {i}: {e:?}")))
            .chain(std::iter::once(Ok(b"<|endoftext|>".to_vec())))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tokenizer {
            bpe: Some(bpe),
            hf: None,
            table,
            eot: GPT2_EOT,
            doc_start: GPT2_EOT,
            identity: GPT2.into(),
            hf_cont: None,
        })
    }

    /// A model's `tokenizer.json` (Hugging Face `tokenizers`).
    pub fn load_hf(path: &Path) -> Result<Self> {
        let bytes = crate::core::files::read_file(path)?;
        let hf = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow::anyhow!("{}: not a tokenizer.json that `tokenizers` reads: {e}", path.display()))?;
        let json: serde_json::Value = serde_json::from_slice(&bytes).context("tokenizer.json is not JSON")?;
        // The decoder says how token strings map to bytes.
        let decoder = json["decoder"].to_string();
        let byte_level = decoder.contains("\"ByteLevel\"");
        let bytes_of = byte_level_decoder();
        let n = hf.get_vocab_size(true);
        let special: std::collections::HashMap<u32, String> =
            hf.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect();
        let mut table = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let Some(t) = hf.id_to_token(id) else {
                table.push(vec![]);
                continue;
            };
            // SentencePiece's byte-fallback tokens (`<0x31>`) are one byte each, even where the
            // file also lists them as added tokens.
            let byte_token = (!byte_level)
                .then(|| t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')))
                .flatten()
                .and_then(|hex| u8::from_str_radix(hex, 16).ok());
            let b = if let Some(b) = byte_token {
                vec![b]
            } else if let Some(s) = special.get(&id) {
                s.as_bytes().to_vec()
            } else if byte_level {
                t.chars().map(|c| bytes_of.get(&c).copied().unwrap_or(b'?')).collect()
            } else {
                t.replace('\u{2581}', " ").into_bytes()
            };
            table.push(b);
        }
        let find = |names: &[&str]| names.iter().find_map(|n| hf.token_to_id(n));
        let eot =
            find(&["<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>", "<|im_end|>"]).with_context(|| {
                format!("{}: no end-of-text token (<|endoftext|>, <|end_of_text|>, </s>)", path.display())
            })?;
        let doc_start = find(&["<|begin_of_text|>", "<s>"]).unwrap_or(eot);
        let identity = format!("sha256:{}", crate::hub::download::sha256_hex(&bytes));
        let hf_cont = match without_start_prefix(&json) {
            Some(j) => Some(Box::new(
                tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&j)?)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
            )),
            None => None,
        };
        Ok(Tokenizer { bpe: None, hf: Some(Box::new(hf)), table, eot, doc_start, identity, hf_cont })
    }

    /// Refuse a tokenizer whose ids reach past the model's vocabulary.
    pub fn check_fits(&self, vocab_size: usize) -> Result<()> {
        if self.vocab_size() > vocab_size {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary is {vocab_size}: they do not belong together \
                 (give the model's own tokenizer with --tokenizer)",
                self.vocab_size()
            );
        }
        Ok(())
    }

    /// Decode-only tokenizer from llm.c's `gpt2_tokenizer.bin`.
    pub fn load_llmc(path: &Path) -> Result<Self> {
        let bytes = crate::core::files::read_file(path)?;
        let h = parse_header(&bytes, path, "tokenizer")?;
        if h[0] != TOKENIZER_MAGIC {
            bail!(
                "{}: bad magic {} (expected {TOKENIZER_MAGIC}); is this llm.c's gpt2_tokenizer.bin?",
                path.display(),
                h[0]
            );
        }
        let eot = match h[1] {
            1 => GPT2_EOT,
            2 => u32::try_from(h[3]).context("negative EOT token id")?,
            v => bail!("{}: tokenizer version {v} is not supported (1 or 2)", path.display()),
        };
        let n = usize::try_from(h[2])
            .ok()
            .filter(|&n| n > 0 && n <= 1 << 24)
            .with_context(|| format!("{}: bad vocab size {}", path.display(), h[2]))?;
        let mut table = Vec::with_capacity(n.min(bytes.len())); // every token takes at least one byte
        let mut off = HEADER_BYTES;
        for i in 0..n {
            let len =
                *bytes.get(off).with_context(|| format!("{}: truncated at token {i} of {n}", path.display()))? as usize;
            let tok = bytes
                .get(off + 1..off + 1 + len)
                .with_context(|| format!("{}: truncated at token {i} of {n}", path.display()))?;
            table.push(tok.to_vec());
            off += 1 + len;
        }
        if off != bytes.len() {
            bail!("{}: {} trailing bytes after {n} tokens", path.display(), bytes.len() - off);
        }
        // llm.c writes it from GPT-2's tables; another vocabulary is another tokenizer.
        let identity = if n == 50257 && eot == GPT2_EOT { GPT2.to_string() } else { format!("llmc:{n}") };
        Ok(Tokenizer { bpe: None, hf: None, table, eot, doc_start: eot, identity, hf_cont: None })
    }

    /// Write llm.c's `gpt2_tokenizer.bin` (version 2).
    pub fn save_llmc(&self, path: &Path) -> Result<()> {
        let mut h = [0i32; 256];
        h[0] = TOKENIZER_MAGIC;
        h[1] = 2;
        h[2] = self.table.len() as i32;
        h[3] = self.eot as i32;
        let mut out: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        for t in &self.table {
            if t.len() > 255 {
                bail!("token of {} bytes does not fit llm.c's tokenizer format", t.len());
            }
            out.push(t.len() as u8);
            out.extend_from_slice(t);
        }
        write_atomic(path, &[&out])
    }

    pub fn vocab_size(&self) -> usize {
        self.table.len()
    }

    /// Which ids this tokenizer gives: `gpt2`, or `sha256:HEX` of its tokenizer.json. Two
    /// tokenizers with one identity tokenize alike.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this is GPT-2's tokenizer (the ids of llm.c's files and of `hellaswag_val.bin`).
    pub fn is_gpt2(&self) -> bool {
        self.identity == GPT2
    }

    /// Encode text with no special tokens (`encode_ordinary`; `add_special_tokens=False`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if let Some(hf) = &self.hf {
            let e = hf.encode(text, false).map_err(|e| anyhow::anyhow!("cannot tokenize: {e}"))?;
            return Ok(e.get_ids().to_vec());
        }
        let bpe = self
            .bpe
            .as_ref()
            .context("this tokenizer was loaded from a decode-only file; use the built-in GPT-2 tokenizer to encode")?;
        Ok(bpe.encode_ordinary(text))
    }

    /// Encode text that continues a document (see `hf_cont`): what follows a cut of
    /// [`Tokenizer::encode_reader`].
    fn encode_continued(&self, text: &str) -> Result<Vec<u32>> {
        match &self.hf_cont {
            Some(hf) => {
                let e = hf.encode(text, false).map_err(|e| anyhow::anyhow!("cannot tokenize: {e}"))?;
                Ok(e.get_ids().to_vec())
            }
            None => self.encode(text),
        }
    }

    /// Encode one document read from `r` (UTF-8 text), piece by piece in bounded memory, giving
    /// `sink` its ids in order: the ids [`Tokenizer::encode`] gives for the whole text, which
    /// the `tokenizers` crate builds at about 100 bytes of memory per byte of input. A piece
    /// ends after a line break followed by a character that is not white space: GPT-2's,
    /// Llama 3's and SmolLM2's pre-tokenizers start a new pre-token there, so nothing merges
    /// across it; and for any tokenizer each cut is checked on the lines around it (encoded
    /// whole and in two parts), and moved to another line when the two differ. `name` names
    /// the input in errors. Returns the bytes read.
    pub fn encode_reader(
        &self,
        r: &mut dyn std::io::Read,
        name: &str,
        sink: &mut dyn FnMut(&[u32]) -> Result<()>,
    ) -> Result<usize> {
        let mut pending: Vec<u8> = vec![]; // bytes read, not yet decoded (a character cut short)
        let mut text = String::new(); // decoded, not yet encoded
        let (mut read, mut block, mut first) = (0usize, vec![0u8; 1 << 16], true);
        loop {
            let n = r.read(&mut block).with_context(|| format!("cannot read {name}"))?;
            pending.extend_from_slice(&block[..n]);
            let valid = match std::str::from_utf8(&pending) {
                Ok(s) => s.len(),
                Err(e) if e.error_len().is_none() && n > 0 => e.valid_up_to(),
                Err(e) => bail!("{name} is not UTF-8 text (invalid byte at offset {})", read + e.valid_up_to()),
            };
            text.push_str(std::str::from_utf8(&pending[..valid]).expect("checked"));
            pending.drain(..valid);
            read += valid;
            if n == 0 {
                break;
            }
            while text.len() >= ENCODE_PIECE_BYTES {
                let Some(cut) = self.safe_cut(&text)? else { break };
                let ids = if first { self.encode(&text[..cut])? } else { self.encode_continued(&text[..cut])? };
                sink(&ids)?;
                text.drain(..cut);
                first = false;
            }
        }
        if !text.is_empty() {
            let ids = if first { self.encode(&text)? } else { self.encode_continued(&text)? };
            sink(&ids)?;
        }
        Ok(read)
    }

    /// Where `text` may be cut for [`Tokenizer::encode_reader`]: the last line start (after
    /// `\n`, before a character that is not white space) where encoding the surrounding lines
    /// whole and in two parts agree (of the last 64 tried); None when none will do.
    fn safe_cut(&self, text: &str) -> Result<Option<usize>> {
        let b = text.as_bytes();
        let mut tries = 0;
        let mut at = b.len().saturating_sub(1);
        while at > 0 && tries < 64 {
            // The last "\n" before `at` with a non-space byte after it.
            let Some(nl) = b[..at].iter().rposition(|&c| c == b'\n') else { return Ok(None) };
            at = nl;
            let cut = nl + 1;
            if cut >= b.len() || b[cut].is_ascii_whitespace() || !text.is_char_boundary(cut) {
                continue;
            }
            let next = text[cut..].chars().next().expect("cut < len");
            if next.is_whitespace() {
                continue;
            }
            tries += 1;
            // A few lines each side (at least 256 bytes of context where there are).
            let start = b[..cut.saturating_sub(256)].iter().rposition(|&c| c == b'\n').map_or(0, |i| i + 1);
            let end =
                b[(cut + 256).min(b.len())..].iter().position(|&c| c == b'\n').map_or(b.len(), |i| cut + 256 + i + 1);
            let (left, right) = (&text[start..cut], &text[cut..end]);
            let whole = self.encode_continued(&text[start..end])?;
            let mut parts = self.encode_continued(left)?;
            parts.extend(self.encode_continued(right)?);
            if whole == parts {
                return Ok(Some(cut));
            }
        }
        Ok(None)
    }

    /// Bytes of one token (empty for an unknown id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.table.get(id as usize).map_or(&[], |v| v.as_slice())
    }

    /// Decode tokens to text (invalid UTF-8 from partial sequences is replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        if let Some(hf) = &self.hf {
            if let Ok(s) = hf.decode(ids, false) {
                return s;
            }
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.token_bytes(i).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_known_ids_and_round_trip() {
        let tok = Tokenizer::gpt2().unwrap();
        assert_eq!(tok.vocab_size(), 50257);
        // "Hello world" is [15496, 995] in GPT-2.
        assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);
        for s in ["First Citizen:\nBefore we proceed", "  spaces\t\ttabs\n\n", "emoji 🦀 e\u{301}"] {
            assert_eq!(tok.decode(&tok.encode(s).unwrap()), s);
        }
        assert_eq!(tok.decode(&[tok.eot]), "<|endoftext|>");
    }

    #[test]
    fn llmc_file_round_trip_and_errors() {
        let tok = Tokenizer::gpt2().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("gpt2_tokenizer.bin");
        tok.save_llmc(&p).unwrap();
        let back = Tokenizer::load_llmc(&p).unwrap();
        assert_eq!(back.eot, 50256);
        assert_eq!(back.table, tok.table);
        let ids = tok.encode("To be, or not to be").unwrap();
        assert_eq!(back.decode(&ids), "To be, or not to be");
        assert!(back.encode("x").is_err());
        // Version 1 files (before the EOT field) have EOT 50256 implied.
        let mut v1 = std::fs::read(&p).unwrap();
        v1[4..8].copy_from_slice(&1i32.to_le_bytes());
        v1[12..16].copy_from_slice(&0i32.to_le_bytes());
        std::fs::write(&p, &v1).unwrap();
        let old = Tokenizer::load_llmc(&p).unwrap();
        assert_eq!((old.eot, old.vocab_size()), (50256, 50257));
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
        assert!(format!("{:#}", Tokenizer::load_llmc(&p).err().unwrap()).contains("truncated"));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        assert!(format!("{:#}", Tokenizer::load_llmc(&p).err().unwrap()).contains("bad magic"));
    }
}

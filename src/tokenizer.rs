//! The GPT-2 byte-level BPE (built in, from tiktoken-rs's `r50k_base`, which equals OpenAI's
//! GPT-2 tables) and llm.c's `gpt2_tokenizer.bin` (magic 20240328, versions 1 and 2).

use crate::checkpoint::{parse_header, write_atomic, HEADER_BYTES};
use crate::config::GPT2_EOT;
use anyhow::{bail, Context, Result};
use std::path::Path;

pub const TOKENIZER_MAGIC: i32 = 20240328;

/// Encoder + decoder for GPT-2 tokens.
pub struct Tokenizer {
    bpe: Option<tiktoken_rs::CoreBPE>,
    /// Byte string of every token id (decode table).
    table: Vec<Vec<u8>>,
    pub eot: u32,
}

impl Tokenizer {
    /// The built-in GPT-2 tokenizer.
    pub fn gpt2() -> Result<Self> {
        let bpe = tiktoken_rs::r50k_base().context("cannot build the GPT-2 tokenizer")?;
        let table = (0..GPT2_EOT)
            .map(|i| bpe.decode_bytes(&[i]).map_err(|e| anyhow::anyhow!("token {i}: {e:?}")))
            .chain(std::iter::once(Ok(b"<|endoftext|>".to_vec())))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tokenizer { bpe: Some(bpe), table, eot: GPT2_EOT })
    }

    /// Decode-only tokenizer from llm.c's `gpt2_tokenizer.bin`.
    pub fn load_llmc(path: &Path) -> Result<Self> {
        let bytes = crate::checkpoint::read_file(path)?;
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
        Ok(Tokenizer { bpe: None, table, eot })
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

    /// Encode text with no special tokens (`encode_ordinary`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let bpe = self
            .bpe
            .as_ref()
            .context("this tokenizer was loaded from a decode-only file; use the built-in GPT-2 tokenizer to encode")?;
        Ok(bpe.encode_ordinary(text))
    }

    /// Bytes of one token (empty for an unknown id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.table.get(id as usize).map_or(&[], |v| v.as_slice())
    }

    /// Decode tokens to text (invalid UTF-8 from partial sequences is replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
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

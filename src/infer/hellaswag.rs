//! HellaSwag, scored exactly as llm.c's dev/data/hellaswag.py: each of the 4 endings is tokenized
//! as " " + ending after the context; the model's cross-entropy over the ending's tokens gives a
//! summed loss (for `acc`) and a per-token average (for `acc_norm`); the lowest loss wins.
//!
//! Reads HellaSwag's JSON lines and llm.c's eval file (magic 20240522), and writes the latter.

use crate::core::files::{parse_header, write_atomic, HEADER_BYTES};
use crate::data::tokenizer::Tokenizer;
use crate::model::Model;
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::Path;

pub const EVAL_MAGIC: i32 = 20240522;
/// Examples scored per forward pass (4 rows each).
const EXAMPLES_PER_BATCH: usize = 4;

/// One tokenized multiple-choice example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub label: usize,
    pub ctx: Vec<u32>,
    pub endings: Vec<Vec<u32>>,
}

/// Read HellaSwag's JSON lines (`ctx`, `label`, `endings`), tokenizing as llm.c does.
pub fn load_jsonl(path: &Path, tok: &Tokenizer) -> Result<Vec<Example>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = vec![];
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}: line {} is not UTF-8 text", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = || format!("{}: line {} is not a HellaSwag example (ctx, label, endings)", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(&line).with_context(bad)?;
        let ctx = v["ctx"].as_str().with_context(bad)?;
        let label =
            v["label"].as_u64().or_else(|| v["label"].as_str().and_then(|s| s.parse().ok())).with_context(bad)?;
        let endings = v["endings"].as_array().with_context(bad)?;
        if endings.len() != 4 || label >= 4 {
            bail!("{}", bad());
        }
        let endings = endings
            .iter()
            .map(|e| tok.encode(&format!(" {}", e.as_str().with_context(bad)?)))
            .collect::<Result<Vec<_>>>()?;
        out.push(Example { label: label as usize, ctx: tok.encode(ctx)?, endings });
    }
    if out.is_empty() {
        bail!("{} holds no examples", path.display());
    }
    Ok(out)
}

/// Write llm.c's eval file: header (magic, version 1, examples, longest example in bytes), then
/// per example the uint16 stream 65535, bytes, index, label, 4, ctx, endings (each length-prefixed).
pub fn write_bin(path: &Path, examples: &[Example]) -> Result<()> {
    if examples.len() >= 1 << 16 {
        bail!("llm.c's eval format holds fewer than 65536 examples");
    }
    let mut stream: Vec<u16> = vec![];
    let mut longest = 0;
    for (i, e) in examples.iter().enumerate() {
        let mut s: Vec<u32> = vec![65535, 0, i as u32, e.label as u32, e.endings.len() as u32, e.ctx.len() as u32];
        s.extend(&e.ctx);
        for end in &e.endings {
            s.push(end.len() as u32);
            s.extend(end);
        }
        if s.iter().skip(6).any(|&t| t >= 65535) || 2 * s.len() >= 1 << 16 {
            bail!("example {i} does not fit llm.c's eval format (token id or size)");
        }
        s[1] = 2 * s.len() as u32;
        longest = longest.max(2 * s.len());
        stream.extend(s.iter().map(|&x| x as u16));
    }
    let mut h = [0i32; 256];
    (h[0], h[1], h[2], h[3]) = (EVAL_MAGIC, 1, examples.len() as i32, longest as i32);
    let header: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    let body: Vec<u8> = stream.iter().flat_map(|x| x.to_le_bytes()).collect();
    write_atomic(path, &[&header, &body])
}

/// Read llm.c's eval file.
pub fn load_bin(path: &Path) -> Result<Vec<Example>> {
    let bytes = crate::core::files::read_file(path)?;
    let h = parse_header(&bytes, path, "eval")?;
    if h[0] != EVAL_MAGIC {
        bail!("{}: bad magic {} (expected {EVAL_MAGIC}); is this llm.c's hellaswag_val.bin?", path.display(), h[0]);
    }
    if h[1] != 1 {
        bail!("{}: eval file version {} is not supported (expected 1)", path.display(), h[1]);
    }
    let n = usize::try_from(h[2])
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| format!("{}: bad example count", path.display()))?;
    let body = &bytes[HEADER_BYTES..];
    if body.len() % 2 != 0 {
        bail!("{}: truncated (odd number of bytes)", path.display());
    }
    let s: Vec<u16> = body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let bad = |i: usize, what: &str| {
        anyhow::anyhow!("{}: example {i}: {what}; the file is truncated or corrupt", path.display())
    };
    let mut out = Vec::with_capacity(n.min(s.len() / 8));
    let mut at = 0;
    for i in 0..n {
        let head = s.get(at..at + 6).ok_or_else(|| bad(i, "missing"))?;
        if head[0] != 65535 || head[2] as usize != i {
            return Err(bad(i, "bad example delimiter or index"));
        }
        let len = head[1] as usize / 2;
        if len < 6 {
            return Err(bad(i, "bad example size"));
        }
        let ex = s.get(at..at + len).ok_or_else(|| bad(i, "cut short"))?;
        let (label, nc) = (ex[3] as usize, ex[4] as usize);
        let mut p = 5;
        let mut take = || -> Result<Vec<u32>> {
            let k = *ex.get(p).ok_or_else(|| bad(i, "cut short"))? as usize;
            let t = ex.get(p + 1..p + 1 + k).ok_or_else(|| bad(i, "cut short"))?;
            p += 1 + k;
            Ok(t.iter().map(|&x| x as u32).collect())
        };
        let ctx = take()?;
        let endings = (0..nc).map(|_| take()).collect::<Result<Vec<_>>>()?;
        if nc != 4 || label >= 4 {
            return Err(bad(i, "expected 4 endings and a label below 4"));
        }
        out.push(Example { label, ctx, endings });
        at += len;
    }
    Ok(out)
}

/// Load either format by extension (`.bin` = llm.c's, otherwise JSON lines).
pub fn load(path: &Path, tok: &Tokenizer) -> Result<Vec<Example>> {
    let bin = path.extension().is_some_and(|e| e == "bin");
    if bin && !tok.is_gpt2() {
        // llm.c's eval file holds GPT-2's ids: another vocabulary would score other words.
        bail!(
            "{} holds GPT-2 token ids, but this model uses its own tokenizer: give HellaSwag's JSON lines instead \
             (--data hellaswag_val.jsonl; `llmrs prepare hellaswag` leaves them in data/hellaswag/), which are \
             tokenized with the model's tokenizer",
            path.display()
        );
    }
    let ex = if bin { load_bin(path)? } else { load_jsonl(path, tok)? };
    check(&ex).with_context(|| format!("{}", path.display()))?;
    Ok(ex)
}

/// Every example can be scored: a context and four endings, none empty (an ending is scored
/// by the losses of its tokens given everything before them, so both need a token), and a
/// label among the endings.
pub fn check(examples: &[Example]) -> Result<()> {
    for (i, e) in examples.iter().enumerate() {
        if e.ctx.is_empty() {
            bail!("HellaSwag example {i} has an empty context; every ending is scored given the context");
        }
        if e.endings.len() != 4 || e.endings.iter().any(|x| x.is_empty()) {
            bail!("HellaSwag example {i} needs 4 non-empty endings (has {})", e.endings.len());
        }
        if e.label >= 4 {
            bail!("HellaSwag example {i} has label {} (must be 0..3)", e.label);
        }
    }
    Ok(())
}

/// The model's verdict on one example.
#[derive(Clone, Debug)]
pub struct Scored {
    pub sum_loss: [f32; 4],
    pub avg_loss: [f32; 4],
    pub pred: usize,
    pub pred_norm: usize,
    pub label: usize,
}

fn argmin(x: &[f32; 4]) -> usize {
    (0..4).fold(0, |b, i| if x[i] < x[b] { i } else { b })
}

/// Score examples, several per forward pass; `on_progress(done)` after each batch.
pub fn score(model: &mut Model, examples: &[Example], mut on_progress: impl FnMut(usize)) -> Result<Vec<Scored>> {
    check(examples)?;
    let max_t = model.config.max_seq_len;
    let len = |e: &Example| e.endings.iter().map(|end| e.ctx.len() + end.len()).max().unwrap_or(1);
    let longest = examples.iter().map(len).max().unwrap_or(1);
    if let Some(i) = examples.iter().position(|e| len(e) > max_t) {
        bail!(
            "example {} of the data has {} tokens, more than the model's context of {max_t}: give a model with a \
             longer context",
            i + 1,
            len(&examples[i])
        );
    }
    model.reserve(4 * EXAMPLES_PER_BATCH, longest)?;
    let mut out = Vec::with_capacity(examples.len());
    let (mut inputs, mut targets) = (vec![], vec![]);
    for batch in examples.chunks(EXAMPLES_PER_BATCH) {
        let t = batch.iter().flat_map(|e| e.endings.iter().map(move |end| e.ctx.len() + end.len())).max().unwrap();
        let rows = 4 * batch.len();
        inputs.clear();
        targets.clear();
        inputs.resize(rows * t, 0u32);
        targets.resize(rows * t, 0u32);
        for (ei, e) in batch.iter().enumerate() {
            for (k, end) in e.endings.iter().enumerate() {
                let r = (4 * ei + k) * t;
                let row: Vec<u32> = e.ctx.iter().chain(end).copied().collect();
                inputs[r..r + row.len()].copy_from_slice(&row);
                targets[r..r + row.len() - 1].copy_from_slice(&row[1..]);
            }
        }
        model.forward(&inputs, Some(&targets), rows, t)?;
        let losses = model.losses()?; // (rows, t): one host read per batch
        for (ei, e) in batch.iter().enumerate() {
            let (mut sum_loss, mut avg_loss) = ([0f32; 4], [0f32; 4]);
            for (k, end) in e.endings.iter().enumerate() {
                // Position j predicts token j+1: the ending's tokens are predicted from
                // positions ctx-1 .. ctx+end-2.
                let r = (4 * ei + k) * t;
                let from = r + e.ctx.len() - 1;
                let s: f32 = losses[from..from + end.len()].iter().sum();
                sum_loss[k] = s;
                avg_loss[k] = s / end.len() as f32;
            }
            out.push(Scored {
                sum_loss,
                avg_loss,
                pred: argmin(&sum_loss),
                pred_norm: argmin(&avg_loss),
                label: e.label,
            });
        }
        on_progress(out.len());
    }
    Ok(out)
}

/// Wilson score interval (95%) for k successes in n trials.
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, n, p) = (1.959964f64, n as f64, k as f64 / n as f64);
    let denom = 1.0 + z * z / n;
    let center = (p + z * z / (2.0 * n)) / denom;
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / denom;
    (center - half, center + half)
}

/// Accuracy summary of scored examples: (correct, correct_norm, n).
pub fn accuracy(s: &[Scored]) -> (usize, usize, usize) {
    let c = s.iter().filter(|x| x.pred == x.label).count();
    let cn = s.iter().filter(|x| x.pred_norm == x.label).count();
    (c, cn, s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_bin_round_trip_and_errors() {
        let ex = vec![
            Example { label: 2, ctx: vec![1, 2, 3], endings: vec![vec![4], vec![5, 6], vec![7], vec![8, 9, 10]] },
            Example { label: 0, ctx: vec![11], endings: vec![vec![12], vec![13], vec![14], vec![15]] },
        ];
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h.bin");
        write_bin(&p, &ex).unwrap();
        assert_eq!(load_bin(&p).unwrap(), ex);
        let bytes = std::fs::read(&p).unwrap();
        let h = parse_header(&bytes, &p, "eval").unwrap();
        assert_eq!((h[2], h[3]), (2, 2 * (6 + 3 + 4 + 1 + 2 + 1 + 3)));
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        assert!(format!("{:#}", load_bin(&p).unwrap_err()).contains("truncated"));
        let mut m = bytes.clone();
        m[0] ^= 1;
        std::fs::write(&p, &m).unwrap();
        assert!(format!("{:#}", load_bin(&p).unwrap_err()).contains("bad magic"));
    }

    #[test]
    fn unscorable_examples_are_refused_not_panicked_on() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::gpt2().unwrap();
        let p = dir.path().join("h.jsonl");
        std::fs::write(&p, r#"{"ctx": "", "label": 0, "endings": ["a", "b", "c", "d"]}"#).unwrap();
        assert!(format!("{:#}", load(&p, &tok).unwrap_err()).contains("example 0 has an empty context"));
        let bin = dir.path().join("h.bin");
        let empty_end = Example { label: 0, ctx: vec![1], endings: vec![vec![2], vec![], vec![3], vec![4]] };
        write_bin(&bin, std::slice::from_ref(&empty_end)).unwrap();
        assert!(format!("{:#}", load(&bin, &tok).unwrap_err()).contains("4 non-empty endings"));
        let cfg = crate::core::config::ModelConfig::from_descriptor("1x16:2:32").unwrap();
        let mut m =
            Model::new(crate::core::params::Weights::random(cfg, 3).unwrap(), crate::backend::Device::Cpu).unwrap();
        let no_ctx = Example { ctx: vec![], ..empty_end.clone() };
        for e in [no_ctx, empty_end, Example { label: 4, ctx: vec![1], endings: vec![vec![2]; 4] }] {
            assert!(score(&mut m, &[e], |_| {}).is_err());
        }
    }

    #[test]
    fn wilson_interval() {
        let (lo, hi) = wilson(50, 100);
        assert!((lo - 0.4038).abs() < 1e-3 && (hi - 0.5962).abs() < 1e-3);
        let (lo, hi) = wilson(0, 10);
        assert!(lo.abs() < 1e-12 && (hi - 0.2775).abs() < 1e-3);
    }

    #[test]
    fn scoring_uses_only_the_ending_tokens() {
        // A model that has learned nothing scores every ending by its tokens alone: compare one
        // example scored in a batch with the same rows scored by hand.
        let cfg = crate::core::config::ModelConfig {
            vocab_size: 64,
            padded_vocab_size: 128,
            ..crate::core::config::ModelConfig::from_descriptor("1x16:2:32").unwrap()
        };
        let mut m =
            Model::new(crate::core::params::Weights::random(cfg, 3).unwrap(), crate::backend::Device::Cpu).unwrap();
        let e = Example { label: 1, ctx: vec![3, 4, 5], endings: vec![vec![6], vec![7, 8], vec![9, 10, 11], vec![12]] };
        let other = Example { label: 0, ctx: vec![1; 9], endings: vec![vec![2; 5], vec![3], vec![4], vec![5]] };
        let s = score(&mut m, &[other, e.clone()], |_| {}).unwrap();
        for (k, end) in e.endings.iter().enumerate() {
            let row: Vec<u32> = e.ctx.iter().chain(end).copied().collect();
            let t = row.len();
            let mut tg = row[1..].to_vec();
            tg.push(0);
            m.forward(&row, Some(&tg), 1, t).unwrap();
            let want: f32 = m.losses().unwrap()[e.ctx.len() - 1..t - 1].iter().sum();
            assert!((s[1].sum_loss[k] - want).abs() < 1e-4, "{} vs {want}", s[1].sum_loss[k]);
            assert!((s[1].avg_loss[k] - want / end.len() as f32).abs() < 1e-4);
        }
    }
}

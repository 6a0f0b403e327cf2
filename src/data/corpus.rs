//! Large document corpora (FineWeb, FineWeb-Edu, TinyStories, any JSON-lines or parquet text)
//! into llm.c shards, as llm.c's dev/data/fineweb.py: every document is `<|endoftext|>` followed
//! by its tokens; the stream is cut into shards of exactly `shard_size` tokens (a document may
//! straddle two shards); shard 0 is validation, the rest training; the last shard holds the rest.
//!
//! Documents are tokenized in parallel in batches, in order. After each shard, the position of
//! the next token (file, document, token offset) is saved in `NAME_progress.json`, so an
//! interrupted run resumes where it stopped and produces the same shards.

use crate::data::loader::write_shard_as;
use crate::data::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Documents tokenized together (in parallel) before they go to the shard writer.
const BATCH_DOCS: usize = 1024;

/// Call `f(doc_index, text)` for every document of a file, starting at document `skip`.
/// `.parquet`: column `text`. `.jsonl`: one JSON object per line with `text` (or `story`).
/// `.json`: an array of such objects (TinyStories' release format).
pub fn for_each_doc(path: &Path, skip: usize, f: &mut dyn FnMut(usize, String) -> Result<()>) -> Result<()> {
    let name = path.display();
    let field = |v: &serde_json::Value, i: usize| -> Result<String> {
        if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            return Ok(t.to_string());
        }
        // TinyStories: llm.c strips each story of surrounding whitespace.
        let t = v.get("story").and_then(|t| t.as_str()).map(str::trim);
        Ok(t.with_context(|| format!("{name}: document {i} has no \"text\" string field"))?.to_string())
    };
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "parquet" => {
            use parquet::file::reader::{FileReader, SerializedFileReader};
            use parquet::record::Field;
            let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
            let reader =
                SerializedFileReader::new(file).with_context(|| format!("{name} is not a readable parquet file"))?;
            let has_text =
                reader.metadata().file_metadata().schema_descr().columns().iter().any(|c| c.name() == "text");
            if !has_text {
                bail!("{name}: parquet file has no \"text\" column");
            }
            for (i, row) in reader.into_iter().enumerate() {
                let row = row.with_context(|| format!("{name}: cannot read row {i}"))?;
                if i < skip {
                    continue;
                }
                let text = row.get_column_iter().find(|(k, _)| k.as_str() == "text").map(|(_, v)| v);
                match text {
                    Some(Field::Str(s)) => f(i, s.clone())?,
                    Some(Field::Null) => f(i, String::new())?,
                    _ => bail!("{name}: row {i}: \"text\" is not a string"),
                }
            }
        }
        "jsonl" => {
            let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
            for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                let line = line.with_context(|| format!("{name}: line {} is not UTF-8 text", i + 1))?;
                if i < skip {
                    continue;
                }
                let v: serde_json::Value =
                    serde_json::from_str(&line).with_context(|| format!("{name}: line {} is not JSON", i + 1))?;
                f(i, field(&v, i)?)?;
            }
        }
        "json" => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {name} as UTF-8 text"))?;
            let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{name} is not JSON"))?;
            let docs = v.as_array().with_context(|| format!("{name}: expected a JSON array of documents"))?;
            for (i, d) in docs.iter().enumerate().skip(skip) {
                f(i, field(d, i)?)?;
            }
        }
        _ => bail!("{name}: unknown document format (use .parquet, .jsonl or .json)"),
    }
    Ok(())
}

/// Download the parquet files of a Hub dataset directory (e.g. FineWeb's `sample/10BT`), the
/// first `max_files` of them if given, into the cache; returns their local paths in order.
pub fn fetch_parquet_sample(
    repo: &str,
    dir: &str,
    max_files: Option<usize>,
    endpoint: &str,
    cache: &Path,
) -> Result<Vec<PathBuf>> {
    let mut list = crate::hub::list_dataset_files(repo, "main", dir, endpoint)?;
    list.retain(|f| f.ends_with(".parquet"));
    if let Some(n) = max_files {
        list.truncate(n);
    }
    if list.is_empty() {
        bail!("{repo} has no parquet files under {dir}");
    }
    eprintln!("{repo}: {} parquet file(s) from {dir}", list.len());
    crate::hub::fetch_dataset_files(repo, "main", &list, endpoint, cache)
}

/// Where the next unwritten token comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Position {
    file: usize,
    doc: usize,
    token: usize,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Progress {
    inputs: Vec<String>,
    shard_size: usize,
    /// [`Tokenizer::identity`]: the shards' ids depend on it (absent in files of older llmrs).
    #[serde(default)]
    tokenizer: Option<String>,
    shards_done: usize,
    next: Position,
    complete: bool,
}

impl Progress {
    /// Why shards made under `self` and shards of this run (`inputs`, `shard_size`,
    /// `tokenizer`) must not share a directory, or None when they are one run.
    fn mismatch(&self, inputs: &[String], shard_size: usize, tokenizer: &str) -> Option<String> {
        if self.tokenizer.as_deref() != Some(tokenizer) {
            return Some(match &self.tokenizer {
                Some(t) => format!("another tokenizer ({t}; this run: {tokenizer})"),
                None => "a tokenizer that an older llmrs did not record".into(),
            });
        }
        if self.inputs != inputs {
            return Some(format!("other input files ({})", self.inputs.join(", ")));
        }
        if self.shard_size != shard_size {
            return Some(format!("another --shard-size ({})", self.shard_size));
        }
        None
    }
}

/// What a run wrote.
#[derive(Debug)]
pub struct CorpusSummary {
    pub shards: Vec<PathBuf>,
    pub tokens: usize,
    pub tokens_per_s: f64,
}

/// Shard writer state: the current shard's tokens and where they started.
struct Writer<'a> {
    /// uint32 shards (a vocabulary past 16 bits).
    wide: bool,
    out: &'a Path,
    name: &'a str,
    shard_size: usize,
    buf: Vec<u32>,
    index: usize,
    written: Vec<PathBuf>,
    tokens: usize,
    progress: Progress,
    bar: indicatif::ProgressBar,
}

impl Writer<'_> {
    fn path(&self, index: usize) -> PathBuf {
        let split = if index == 0 { "val" } else { "train" };
        self.out.join(format!("{}_{split}_{index:06}.bin", self.name))
    }

    fn save_progress(&self) -> Result<()> {
        let p = self.out.join(format!("{}_progress.json", self.name));
        crate::core::files::write_atomic(&p, &[serde_json::to_string_pretty(&self.progress)?.as_bytes()])
    }

    /// Append one document's tokens (from `start`); `pos` is the document's place in the input.
    fn push(&mut self, toks: &[u32], start: usize, pos: (usize, usize)) -> Result<()> {
        let mut at = start;
        while at < toks.len() {
            let take = (self.shard_size - self.buf.len()).min(toks.len() - at);
            self.buf.extend_from_slice(&toks[at..at + take]);
            at += take;
            self.tokens += take;
            self.bar.inc(take as u64);
            if self.buf.len() == self.shard_size {
                self.flush(Position { file: pos.0, doc: pos.1, token: at }, false)?;
            }
        }
        Ok(())
    }

    fn flush(&mut self, next: Position, complete: bool) -> Result<()> {
        if !self.buf.is_empty() {
            let p = self.path(self.index);
            write_shard_as(&p, &self.buf, self.wide)?;
            self.written.push(p);
            self.index += 1;
            self.buf.clear();
        }
        self.progress.shards_done = self.index;
        self.progress.next = next;
        self.progress.complete = complete;
        self.save_progress()
    }
}

/// Tokenize `inputs` (in order) with GPT-2's tokenizer into `out/NAME_{val,train}_%06d.bin`,
/// resuming from `out/NAME_progress.json` when it belongs to the same inputs and shard size.
pub fn prepare_corpus(inputs: &[PathBuf], out: &Path, name: &str, shard_size: usize) -> Result<CorpusSummary> {
    prepare_corpus_with(inputs, out, name, shard_size, &Tokenizer::gpt2()?)
}

/// [`prepare_corpus`] with any tokenizer: each document starts with its `doc_start` token, and
/// the shards are uint32 when its vocabulary needs more than 16 bits.
pub fn prepare_corpus_with(
    inputs: &[PathBuf],
    out: &Path,
    name: &str,
    shard_size: usize,
    tok: &Tokenizer,
) -> Result<CorpusSummary> {
    if inputs.is_empty() {
        bail!("give one or more .parquet, .jsonl or .json files");
    }
    if shard_size == 0 || shard_size >= i32::MAX as usize {
        bail!("shard size must be between 1 and 2^31-1 tokens");
    }
    for p in inputs {
        if !p.is_file() {
            bail!("{} does not exist", p.display());
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
    let prog_path = out.join(format!("{name}_progress.json"));
    // A run picks up only its own progress: shards of other inputs, another shard size or
    // another tokenizer are never mixed with this run's, nor overwritten.
    let resume: Option<Progress> = match std::fs::read_to_string(&prog_path) {
        Err(_) => None,
        Ok(text) => {
            let old: Progress = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a progress file llmrs wrote", prog_path.display()))?;
            if let Some(why) = old.mismatch(&names, shard_size, tok.identity()) {
                bail!(
                    "{} holds {name} shards made with {why}: this run would mix the two. Give another -o or \
                     --name, or delete {} and its {name}_*.bin shards to start over",
                    out.display(),
                    prog_path.display()
                );
            }
            Some(old)
        }
    };
    if resume.as_ref().is_some_and(|p| p.complete) {
        eprintln!("{name}: already prepared in {} (delete {} to redo)", out.display(), prog_path.display());
        let n = resume.unwrap().shards_done;
        let w = |i: usize| out.join(format!("{name}_{}_{i:06}.bin", if i == 0 { "val" } else { "train" }));
        return Ok(CorpusSummary { shards: (0..n).map(w).collect(), tokens: 0, tokens_per_s: 0.0 });
    }
    let (start, shards_done) = resume.map_or((Position::default(), 0), |p| (p.next, p.shards_done));
    if shards_done > 0 {
        eprintln!("{name}: resuming after {shards_done} shard(s), at file {} document {}", start.file, start.doc);
    }
    let bar = crate::core::progress::bar(0, name);
    let mut w = Writer {
        wide: tok.vocab_size() > 1 << 16,
        out,
        name,
        shard_size,
        buf: Vec::with_capacity(shard_size.min(1 << 27)),
        index: shards_done,
        written: vec![],
        tokens: 0,
        progress: Progress {
            inputs: names,
            shard_size,
            tokenizer: Some(tok.identity().to_string()),
            shards_done,
            next: start.clone(),
            complete: false,
        },
        bar,
    };
    let t0 = Instant::now();
    let mut batch: Vec<(usize, usize, String)> = Vec::with_capacity(BATCH_DOCS);
    let tokenize_batch = |batch: &mut Vec<(usize, usize, String)>, w: &mut Writer| -> Result<()> {
        let toks: Vec<Vec<u32>> = batch
            .par_iter()
            .map(|(_, _, text)| {
                let mut t = vec![tok.doc_start];
                t.extend(tok.encode(text)?);
                Ok(t)
            })
            .collect::<Result<_>>()?;
        for ((fi, di, _), t) in batch.iter().zip(&toks) {
            let from = if (*fi, *di) == (start.file, start.doc) { start.token } else { 0 };
            w.push(t, from, (*fi, *di))?;
        }
        batch.clear();
        Ok(())
    };
    for (fi, path) in inputs.iter().enumerate().skip(start.file) {
        let skip = if fi == start.file { start.doc } else { 0 };
        let mut seen = 0usize;
        for_each_doc(path, skip, &mut |di, text| {
            seen += 1;
            batch.push((fi, di, text));
            if batch.len() == BATCH_DOCS {
                tokenize_batch(&mut batch, &mut w)?;
            }
            Ok(())
        })?;
        if seen == 0 && skip == 0 {
            bail!("{} holds no documents", path.display());
        }
        tokenize_batch(&mut batch, &mut w)?; // finish each file before reading the next
    }
    w.flush(Position { file: inputs.len(), doc: 0, token: 0 }, true)?;
    w.bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let tps = w.tokens as f64 / secs.max(1e-9);
    eprintln!("{name}: {} tokens into {} shard(s) in {secs:.1}s ({tps:.0} tokens/s)", w.tokens, w.written.len());
    Ok(CorpusSummary { shards: w.written, tokens: w.tokens, tokens_per_s: tps })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    /// Write a FineWeb-like parquet file (columns text and id), snappy-compressed.
    pub fn write_parquet(path: &Path, docs: &[String]) {
        let schema = Arc::new(
            parse_message_type("message schema { REQUIRED BYTE_ARRAY text (UTF8); REQUIRED BYTE_ARRAY id (UTF8); }")
                .unwrap(),
        );
        let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
        let mut writer = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
        let mut rg = writer.next_row_group().unwrap();
        let cols = [
            docs.iter().map(|d| ByteArray::from(d.as_str())).collect::<Vec<_>>(),
            (0..docs.len()).map(|i| ByteArray::from(format!("<urn:{i}>").as_str())).collect(),
        ];
        for vals in cols {
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>().write_batch(&vals, None, None).unwrap();
            col.close().unwrap();
        }
        rg.close().unwrap();
        writer.close().unwrap();
    }

    fn docs(n: usize, seed: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                format!(
                    "Document {} by author {}. {}",
                    i + seed,
                    i * 7 % 13,
                    "Once upon a time there was a token. ".repeat(i % 5 + 1)
                )
            })
            .collect()
    }

    /// The expected stream: EOT + tokens of every document, in order.
    fn stream(all: &[String]) -> Vec<u32> {
        let tok = Tokenizer::gpt2().unwrap();
        all.iter().flat_map(|d| std::iter::once(tok.eot).chain(tok.encode(d).unwrap())).collect()
    }

    #[test]
    fn parquet_and_jsonl_into_fixed_size_shards() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (docs(1500, 0), docs(40, 5000));
        let pq = dir.path().join("000_00000.parquet");
        write_parquet(&pq, &a);
        let jl = dir.path().join("more.jsonl");
        std::fs::write(&jl, b.iter().map(|d| serde_json::json!({"text": d}).to_string() + "\n").collect::<String>())
            .unwrap();
        let out = dir.path().join("out");
        let s = prepare_corpus(&[pq, jl], &out, "fineweb", 5000).unwrap();
        let want = stream(&[a, b].concat());
        assert_eq!(s.tokens, want.len());
        let got: Vec<u32> = s.shards.iter().flat_map(|p| crate::data::loader::read_shard(p).unwrap()).collect();
        assert_eq!(got, want);
        assert!(s.shards[0].ends_with("fineweb_val_000000.bin") && s.shards[1].ends_with("fineweb_train_000001.bin"));
        for p in &s.shards[..s.shards.len() - 1] {
            assert_eq!(crate::data::loader::read_shard(p).unwrap().len(), 5000);
        }
    }

    #[test]
    fn an_interrupted_run_resumes_to_the_same_shards() {
        let dir = tempfile::tempdir().unwrap();
        let all = docs(900, 0);
        let jsonl =
            |d: &[String]| d.iter().map(|d| serde_json::json!({"text": d}).to_string() + "\n").collect::<String>();
        let files: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("part{i}.jsonl"))).collect();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(f, jsonl(&all[i * 300..(i + 1) * 300])).unwrap();
        }
        let full = dir.path().join("full");
        let want = prepare_corpus(&files, &full, "x", 3001).unwrap();
        // The same run, interrupted: the last file breaks halfway (as if the machine stopped).
        let part = dir.path().join("part");
        let good2 = std::fs::read_to_string(&files[2]).unwrap();
        let broken: String = good2.lines().take(150).map(|l| l.to_string() + "\n").collect::<String>() + "{truncated";
        std::fs::write(&files[2], broken).unwrap();
        assert!(prepare_corpus(&files, &part, "x", 3001).is_err());
        let done = std::fs::read_dir(&part)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".bin"))
            .count();
        assert!(done >= 2 && done < want.shards.len(), "{done} complete shards before the failure");
        // Fixed input, run again: it resumes and the shards are byte-identical to the full run.
        std::fs::write(&files[2], &good2).unwrap();
        let rest = prepare_corpus(&files, &part, "x", 3001).unwrap();
        assert_eq!(rest.shards.len(), want.shards.len() - done);
        for p in &want.shards {
            let q = part.join(p.file_name().unwrap());
            assert_eq!(std::fs::read(p).unwrap(), std::fs::read(&q).unwrap(), "{}", q.display());
        }
        // A completed run is not redone.
        assert_eq!(prepare_corpus(&files, &part, "x", 3001).unwrap().tokens, 0);
        // Another tokenizer, shard size or input list over these shards is refused, finished
        // or not, and leaves every file as it was.
        let snapshot = || {
            let mut v: Vec<_> = std::fs::read_dir(&part)
                .unwrap()
                .map(|e| {
                    let p = e.unwrap().path();
                    (p.clone(), std::fs::read(&p).unwrap())
                })
                .collect();
            v.sort();
            v
        };
        let before = snapshot();
        let other = Tokenizer::load_hf(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tokenizers/bytelevel.json"
        )))
        .unwrap();
        let e = format!("{:#}", prepare_corpus_with(&files, &part, "x", 3001, &other).unwrap_err());
        assert!(e.contains("another tokenizer") && e.contains("would mix"), "{e}");
        let e = format!("{:#}", prepare_corpus(&files, &part, "x", 4000).unwrap_err());
        assert!(e.contains("--shard-size"), "{e}");
        let e = format!("{:#}", prepare_corpus(&files[..2], &part, "x", 3001).unwrap_err());
        assert!(e.contains("other input files"), "{e}");
        assert!(snapshot() == before, "a refused run changed the shards");
        // Interrupted with one tokenizer, resumed with another: refused the same way.
        let half = dir.path().join("half");
        std::fs::write(&files[2], good2.lines().take(150).map(|l| l.to_string() + "\n").collect::<String>() + "{x")
            .unwrap();
        assert!(prepare_corpus(&files, &half, "x", 3001).is_err());
        std::fs::write(&files[2], &good2).unwrap();
        let e = format!("{:#}", prepare_corpus_with(&files, &half, "x", 3001, &other).unwrap_err());
        assert!(e.contains("another tokenizer"), "{e}");
    }

    #[test]
    fn fineweb_sample_from_a_hub_server() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (docs(300, 0), docs(200, 900));
        let (pa, pb) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
        write_parquet(&pa, &a);
        write_parquet(&pb, &b);
        let listing = serde_json::json!([
            {"type": "file", "path": "sample/10BT/001_00000.parquet"},
            {"type": "file", "path": "sample/10BT/000_00000.parquet"},
            {"type": "file", "path": "sample/10BT/README.md"},
        ]);
        let d = "/datasets/HuggingFaceFW/fineweb/resolve/main/sample/10BT";
        let files = vec![
            ("/api/datasets/HuggingFaceFW/fineweb/tree/main/sample/10BT".into(), listing.to_string().into_bytes()),
            (format!("{d}/000_00000.parquet"), std::fs::read(&pa).unwrap()),
            (format!("{d}/001_00000.parquet"), std::fs::read(&pb).unwrap()),
        ];
        let (base, _) = crate::hub::tests::hub_server(files, false, 10);
        let cache = dir.path().join("cache");
        let got = fetch_parquet_sample("HuggingFaceFW/fineweb", "sample/10BT", None, &base, &cache).unwrap();
        assert_eq!(got.len(), 2);
        let s = prepare_corpus(&got, &dir.path().join("out"), "fineweb", 4000).unwrap();
        let toks: Vec<u32> = s.shards.iter().flat_map(|p| crate::data::loader::read_shard(p).unwrap()).collect();
        assert_eq!(toks, stream(&[a, b].concat()));
    }

    #[test]
    fn tinystories_json_arrays_are_stripped_like_llmc() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("data00.json");
        std::fs::write(&p, r#"[{"story": "  Once upon a time.\n"}, {"story": "The end. "}]"#).unwrap();
        let s = prepare_corpus(&[p], &dir.path().join("o"), "TinyStories", 1000).unwrap();
        let toks: Vec<u32> = crate::data::loader::read_shard(&s.shards[0]).unwrap();
        assert_eq!(toks, stream(&["Once upon a time.".into(), "The end.".into()]));
    }

    #[test]
    fn bad_documents_are_refused_without_half_written_shards() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let junk = dir.path().join("junk.parquet");
        std::fs::write(&junk, [0u8, 1, 2, 3, 0xff, 0xfe].repeat(100)).unwrap();
        assert!(
            format!("{:#}", prepare_corpus(&[junk], &out, "f", 100).unwrap_err()).contains("not a readable parquet")
        );
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, b"{\"text\": \"ok\"}\n\xff\xfe not utf8\n").unwrap();
        assert!(format!("{:#}", prepare_corpus(&[bad], &out, "f", 100).unwrap_err()).contains("not UTF-8"));
        let notext = dir.path().join("n.jsonl");
        std::fs::write(&notext, "{\"content\": \"x\"}\n").unwrap();
        assert!(format!("{:#}", prepare_corpus(&[notext], &out, "f", 100).unwrap_err()).contains("no \"text\""));
        let empty = dir.path().join("e.parquet");
        std::fs::write(&empty, b"").unwrap();
        assert!(prepare_corpus(&[empty], &out, "f", 100).is_err());
        let empty = dir.path().join("e.jsonl");
        std::fs::write(&empty, b"").unwrap();
        assert!(format!("{:#}", prepare_corpus(&[empty], &out, "f", 100).unwrap_err()).contains("no documents"));
        let leftovers: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".bin"))
            .collect();
        assert!(leftovers.is_empty(), "no shard from failed runs");
    }
}

//! `llmrs prepare`: text, corpora and HellaSwag into llm.c's files.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use llmrs::data::prepare::{prepare_tinyshakespeare, Source};
use std::path::{Path, PathBuf};

/// Where `prepare tinyshakespeare` writes by default, and where the default run's data lives.
pub const TINYSHAKESPEARE_DIR: &str = "data/tinyshakespeare";

#[derive(Subcommand)]
pub enum PrepareCmd {
    /// Tiny Shakespeare as llm.c's dev/data/tinyshakespeare.py (from --input, $LLMRS_DATA_DIR, or
    /// downloaded from its public home).
    Tinyshakespeare {
        /// A local copy of input.txt.
        #[arg(long)]
        input: Option<PathBuf>,
        #[arg(short, long, default_value = TINYSHAKESPEARE_DIR)]
        out: PathBuf,
    },
    /// UTF-8 text files, one document each, into train/val shards.
    Text {
        files: Vec<PathBuf>,
        #[arg(short, long, default_value = "data/text")]
        out: PathBuf,
        /// Tokens for the validation shard [default: 32768 (llm.c's), or a tenth of an input
        /// of fewer than ten times that].
        #[arg(long)]
        val_tokens: Option<usize>,
        /// Tokenize with this tokenizer.json (a file, a model directory, or hf:owner/name) instead
        /// of GPT-2's.
        #[arg(long)]
        tokenizer: Option<String>,
    },
    /// FineWeb or FineWeb-Edu as llm.c's dev/data/fineweb.py: local .parquet/.jsonl files, or
    /// (with none given) the sample's parquet files downloaded from the Hugging Face Hub.
    Fineweb {
        files: Vec<PathBuf>,
        /// FineWeb-Edu instead of FineWeb.
        #[arg(long)]
        edu: bool,
        /// Which sample to download: 10B or 100B.
        #[arg(long, default_value = "10B")]
        version: String,
        /// Download only the first N parquet files of the sample.
        #[arg(long)]
        max_files: Option<usize>,
        /// Output directory (default: data/fineweb10B, data/edu_fineweb10B, ...).
        #[arg(short, long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        shards: ShardArgs,
    },
    /// TinyStories: its .json files (arrays of {"story": ...}), or with none given the parquet files
    /// of roneneldan/TinyStories from the Hub (validation first).
    Tinystories {
        files: Vec<PathBuf>,
        #[arg(short, long, default_value = "data/tinystories")]
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
    },
    /// HellaSwag validation set into llm.c's eval file (from --input, $LLMRS_DATA_DIR, or downloaded).
    Hellaswag {
        /// HellaSwag JSON lines (hellaswag_val.jsonl).
        #[arg(long)]
        input: Option<PathBuf>,
        #[arg(short, long, default_value = "data/hellaswag")]
        out: PathBuf,
    },
    /// Any documents (.parquet with a text column, .jsonl or .json with "text") into shards.
    Docs {
        files: Vec<PathBuf>,
        /// Shard name prefix: NAME_val_000000.bin, NAME_train_000001.bin, ...
        #[arg(long, default_value = "docs")]
        name: String,
        #[arg(short, long, default_value = "data/docs")]
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
    },
}

#[derive(Args)]
pub struct ShardArgs {
    /// Tokens per shard (llm.c: 10^8).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_size: usize,
    /// Tokenize with this tokenizer.json (a file, a model directory, or hf:owner/name) instead of
    /// GPT-2's; a vocabulary past 16 bits writes uint32 shards (llm.c's llama3 format).
    #[arg(long)]
    pub tokenizer: Option<String>,
}

pub fn run(p: PrepareCmd) -> Result<()> {
    match p {
        PrepareCmd::Tinyshakespeare { input, out } => {
            prepare_tinyshakespeare(&Source::from_env(input.as_deref()), &out).map(|_| ())
        }
        PrepareCmd::Text { files, out, val_tokens, tokenizer } => {
            let tok = llmrs::source::choose_tokenizer(tokenizer.as_deref(), None)?;
            if files.is_empty() {
                bail!("give one or more UTF-8 text files");
            }
            llmrs::data::prepare::prepare_text_with(&files, &out, val_tokens, &tok).map(|_| ())
        }
        PrepareCmd::Fineweb { files, edu, version, max_files, out, shards } => {
            prepare_fineweb(files, edu, &version, max_files, out, &shards)
        }
        PrepareCmd::Tinystories { files, out, shards } => prepare_tinystories(files, &out, &shards),
        PrepareCmd::Hellaswag { input, out } => prepare_hellaswag(input.as_deref(), &out),
        PrepareCmd::Docs { files, name, out, shards } => shards.prepare(&files, &out, &name),
    }
}

impl ShardArgs {
    /// Tokenize `files` into `out`'s NAME_val/NAME_train shards.
    fn prepare(&self, files: &[PathBuf], out: &Path, name: &str) -> Result<()> {
        let tok = llmrs::source::choose_tokenizer(self.tokenizer.as_deref(), None)?;
        llmrs::data::corpus::prepare_corpus_with(files, out, name, self.shard_size, &tok).map(|_| ())
    }
}

pub fn prepare_fineweb(
    files: Vec<PathBuf>,
    edu: bool,
    version: &str,
    max_files: Option<usize>,
    out: Option<PathBuf>,
    shards: &ShardArgs,
) -> Result<()> {
    let (sample, size) = match version {
        "10B" => ("sample/10BT", "10B"),
        "100B" => ("sample/100BT", "100B"),
        v => bail!("unknown FineWeb version '{v}': use 10B or 100B"),
    };
    let (repo, name) =
        if edu { ("HuggingFaceFW/fineweb-edu", "edu_fineweb") } else { ("HuggingFaceFW/fineweb", "fineweb") };
    let out = out.unwrap_or_else(|| PathBuf::from(format!("data/{name}{size}")));
    let files = if files.is_empty() {
        let (ep, cache) = (llmrs::hub::endpoint(), llmrs::hub::cache_dir());
        llmrs::data::corpus::fetch_parquet_sample(repo, sample, max_files, &ep, &cache)?
    } else {
        files
    };
    shards.prepare(&files, &out, name)
}

pub fn prepare_tinystories(files: Vec<PathBuf>, out: &Path, shards: &ShardArgs) -> Result<()> {
    let files = if files.is_empty() {
        // The Hub's parquet export of roneneldan/TinyStories; validation first (shard 0).
        let (ep, cache) = (llmrs::hub::endpoint(), llmrs::hub::cache_dir());
        let mut got = llmrs::data::corpus::fetch_parquet_sample("roneneldan/TinyStories", "data", None, &ep, &cache)?;
        got.sort_by_key(|p| !p.to_string_lossy().contains("validation"));
        got
    } else {
        files
    };
    shards.prepare(&files, out, "TinyStories")
}

pub fn prepare_hellaswag(input: Option<&Path>, out: &Path) -> Result<()> {
    let tok = llmrs::data::tokenizer::Tokenizer::gpt2()?;
    let src = llmrs::data::prepare::hellaswag_jsonl(input, out)?;
    let ex = llmrs::infer::hellaswag::load_jsonl(&src, &tok)?;
    let dest = out.join("hellaswag_val.bin");
    llmrs::infer::hellaswag::write_bin(&dest, &ex)?;
    eprintln!("wrote {} examples to {}", ex.len(), dest.display());
    // The text beside the GPT-2 ids: a model with its own tokenizer scores from it.
    let text = out.join("hellaswag_val.jsonl");
    if !text.is_file() {
        llmrs::core::files::write_atomic(&text, &[&llmrs::core::files::read_file(&src)?])?;
        eprintln!("kept the examples as text in {} (for models with their own tokenizer)", text.display());
    }
    Ok(())
}

//! `llmrs eval`: HellaSwag accuracy.

use super::{model_spec, open_model, D};
use anyhow::{bail, Result};
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum EvalCmd {
    /// HellaSwag accuracy as llm.c's dev/data/hellaswag.py computes it.
    Hellaswag {
        /// Model: llm.c .bin, Hugging Face directory or .safetensors, hf:owner/name, or a descriptor.
        #[arg(short = 'e', long = "model", required_unless_present = "hf")]
        model: Option<String>,
        #[arg(long)]
        hf: Option<String>,
        /// HellaSwag JSON lines or llm.c's hellaswag_val.bin (default: data/hellaswag/hellaswag_val.bin,
        /// else $LLMRS_DATA_DIR/hellaswag/hellaswag_val.preprocessed.jsonl).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Score only the first N examples.
        #[arg(long)]
        limit: Option<usize>,
        /// The tokenizer (a tokenizer.json, a model directory, hf:owner/name, or gpt2); default: the
        /// model's own tokenizer.json, else GPT-2's. A .bin eval file is already tokenized (GPT-2).
        #[arg(long)]
        tokenizer: Option<String>,
        /// LoRA adapters on top of the model (a PEFT adapter directory or a LoRA checkpoint).
        #[arg(long)]
        lora: Option<PathBuf>,
        /// Rows of logits the classifier computes at once (as train's --ce-rows; 0 = all):
        /// the losses are the same bits, the logits buffer that much smaller.
        #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
        ce_rows: usize,
        /// fp32 or bf16 (bf16 weights and activations, ops in fp32; as train's --precision).
        #[arg(long, default_value_t = D.with(|d| d.precision))]
        precision: llmrs::core::config::Precision,
    },
}

pub fn run(e: EvalCmd, device: llmrs::backend::Device) -> Result<()> {
    let EvalCmd::Hellaswag { model, hf, data, limit, tokenizer, lora, ce_rows, precision } = e;
    if limit == Some(0) {
        bail!("--limit 0: score at least 1 example");
    }
    let spec = model_spec(hf, model)?;
    let mut model = open_model(&spec, 42, lora.as_deref(), device, precision)?;
    model.set_classifier_rows(ce_rows)?;
    let tok = llmrs::source::tokenizer_for_text(tokenizer.as_deref(), &spec, model.config.vocab_size)?;
    let data = match data {
        Some(d) => d,
        None => llmrs::train::default_hellaswag_path(tok.is_gpt2())?,
    };
    let mut ex = llmrs::infer::hellaswag::load(&data, &tok)?;
    if let Some(n) = limit {
        ex.truncate(n);
    }
    let bar = llmrs::core::progress::bar(ex.len() as u64, "hellaswag");
    let scored = llmrs::infer::hellaswag::score(&mut model, &ex, |d| bar.set_position(d as u64))?;
    bar.finish_and_clear();
    let (c, cn, n) = llmrs::infer::hellaswag::accuracy(&scored);
    for (name, k) in [("acc", c), ("acc_norm", cn)] {
        let (lo, hi) = llmrs::infer::hellaswag::wilson(k, n);
        println!("{name:8} {k}/{n} = {:.4}  (95% CI {lo:.4}..{hi:.4})", k as f64 / n as f64);
    }
    Ok(())
}

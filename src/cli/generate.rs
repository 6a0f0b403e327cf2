//! `llmrs generate`: text from a prompt, streamed as it is produced.

use super::{model_spec, open_model, D};
use anyhow::Result;
use clap::Args;
use llmrs::infer::generate::SamplerConfig;
use std::path::PathBuf;

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub struct GenArgs {
    /// Model: llm.c .bin, Hugging Face directory or .safetensors, or hf:owner/name.
    #[arg(short = 'e', long = "model", required_unless_present = "hf")]
    pub model: Option<String>,
    /// Model from the Hugging Face Hub: owner/name[@revision].
    #[arg(long)]
    pub hf: Option<String>,
    /// Text to continue ("" starts from the document-start token, <|endoftext|> for GPT-2).
    #[arg(short, long, default_value = "")]
    pub prompt: String,
    /// The tokenizer (a tokenizer.json, a model directory, hf:owner/name, or gpt2); default: the
    /// model's own tokenizer.json, else GPT-2's.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = SamplerConfig::default().temperature)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only (0 = all).
    #[arg(long, default_value_t = SamplerConfig::default().top_k)]
    pub top_k: usize,
    /// Sample among the most likely tokens that make up probability p (1 = all).
    #[arg(long, default_value_t = SamplerConfig::default().top_p)]
    pub top_p: f32,
    /// Random seed: the same seed gives the same text.
    #[arg(long, default_value_t = SamplerConfig::default().seed)]
    pub seed: u64,
    /// Recompute the whole prefix for every token instead of using the KV cache.
    #[arg(long)]
    pub no_cache: bool,
    /// Keep going after <|endoftext|>.
    #[arg(long)]
    pub no_stop: bool,
    /// LoRA adapters on top of the model: a PEFT adapter directory or a LoRA run's checkpoint
    /// (merged into the weights at load, as PEFT's merge_and_unload).
    #[arg(long)]
    pub lora: Option<PathBuf>,
    /// With --no-cache: rows of logits computed at once (as train's --ce-rows; 0 = all).
    #[arg(long = "ce-rows", default_value_t = D.with(|d| d.ce_rows))]
    pub ce_rows: usize,
    /// fp32 or bf16 (bf16 weights, KV cache and activations, ops in fp32; as train's --precision).
    #[arg(long, default_value_t = D.with(|d| d.precision))]
    pub precision: llmrs::core::config::Precision,
}

pub fn run(a: GenArgs, device: llmrs::backend::Device) -> Result<()> {
    use llmrs::infer::generate::{generate, GenConfig, Utf8Stream};
    use std::io::Write;
    let sampler = SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed };
    sampler.validate()?; // before loading (or downloading) anything
    let spec = model_spec(a.hf, a.model)?;
    let mut model = open_model(&spec, 0, a.lora.as_deref(), device, a.precision)?;
    model.set_classifier_rows(a.ce_rows)?;
    let tok = llmrs::source::tokenizer_for_text(a.tokenizer.as_deref(), &spec, model.config.vocab_size)?;
    let prompt = if a.prompt.is_empty() { vec![tok.doc_start] } else { tok.encode(&a.prompt)? };
    // The model's own end tokens (generation_config.json, config.json), else the tokenizer's.
    let stop_tokens = match llmrs::source::eos_tokens(&spec)? {
        Some(ids) => ids,
        None => match a.tokenizer.as_deref().map(llmrs::source::eos_tokens).transpose()?.flatten() {
            Some(ids) => ids,
            None => vec![tok.eot],
        },
    };
    let max_t = model.config.max_seq_len;
    llmrs::infer::generate::check_prompt(prompt.len(), max_t)?; // before the prompt is printed
    if prompt.len().saturating_add(a.max_new_tokens) > max_t {
        eprintln!(
            "note: the model's context is {max_t} positions: after the {}-token prompt, at most {} new tokens (-n {})",
            prompt.len(),
            max_t - prompt.len(),
            a.max_new_tokens
        );
    }
    let g = GenConfig {
        max_new_tokens: a.max_new_tokens,
        sampler,
        stop_tokens: if a.no_stop { vec![] } else { stop_tokens },
        use_cache: !a.no_cache,
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", a.prompt)?;
    let mut utf8 = Utf8Stream::default();
    let t0 = std::time::Instant::now();
    let mut first: Option<f64> = None;
    let new = generate(&mut model, &prompt, &g, |t| {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        write!(out, "{}", utf8.push(tok.token_bytes(t)))?;
        out.flush()?;
        Ok(())
    })?;
    writeln!(out, "{}", utf8.finish())?;
    let secs = t0.elapsed().as_secs_f64();
    let first = first.unwrap_or(secs);
    let stopped = new.last().is_some_and(|t| g.stop_tokens.contains(t));
    // The first token includes reading the prompt; the rest is one token each.
    eprintln!(
        "{} prompt + {} new tokens in {secs:.2}s ({}{}): first token after {first:.3}s, then {:.2} tokens/s",
        prompt.len(),
        new.len(),
        if g.use_cache { "KV cache" } else { "no cache" },
        if stopped { ", stopped at an end token" } else { "" },
        (new.len().saturating_sub(1)) as f64 / (secs - first).max(1e-9),
    );
    Ok(())
}

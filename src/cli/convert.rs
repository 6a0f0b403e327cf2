//! `llmrs convert`: a model between llm.c's files and Hugging Face's, a LoRA checkpoint to PEFT's
//! adapter files or merged into its base; nothing it reads is replaced, and nothing else
//! unless told to (`--overwrite`).

use super::{dtype_name, load_with_lora, parse_dtype};
use anyhow::{bail, Context, Result};
use clap::Args;
use llmrs::core::files::Dtype;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ConvertArgs {
    /// INPUT OUTPUT, or only OUTPUT with --hf. INPUT: llm.c .bin, HF directory or .safetensors,
    /// a LoRA run's checkpoint (written as PEFT's adapter files, or merged with --merge), or a
    /// descriptor such as d12 for random init. OUTPUT: *.bin for llm.c's format, else a
    /// directory (a Hugging Face model, with the tokenizer and generation files of INPUT or
    /// its base, or a PEFT adapter).
    #[arg(required = true, num_args = 1..=2, value_names = ["INPUT", "OUTPUT"])]
    pub paths: Vec<String>,
    /// Take the input from the Hugging Face Hub: owner/name[@revision].
    #[arg(long)]
    pub hf: Option<String>,
    /// Output precision: fp32 or bf16 (the weights, or a PEFT adapter's).
    #[arg(long, default_value = dtype_name(Dtype::F32))]
    pub dtype: String,
    /// Seed when the input is a descriptor for random init (e.g. d12) [default: 42; with
    /// --lora CKPT or --merge CKPT, the seed its base was drawn with].
    #[arg(long)]
    pub seed: Option<u32>,
    /// INPUT is a LoRA run's checkpoint: write the merged model (base + adapters) instead
    /// of the PEFT adapter directory.
    #[arg(long)]
    pub merge: bool,
    /// Merge these LoRA adapters (a PEFT directory or LoRA checkpoint) into INPUT.
    #[arg(long)]
    pub lora: Option<PathBuf>,
    /// Replace an existing OUTPUT (a .bin, or a directory's model or adapter files; the files
    /// of the old model that the new one lacks are removed). Without it an existing OUTPUT is
    /// refused. What the conversion reads is never replaced.
    #[arg(long)]
    pub overwrite: bool,
}

pub fn run(c: ConvertArgs) -> Result<()> {
    let ConvertArgs { paths, hf, dtype, seed, merge, lora, overwrite } = c;
    let (seed_given, seed) = (seed.is_some(), seed.unwrap_or(42));
    let dtype = parse_dtype(&dtype)?;
    let (spec, output) = match (hf, &paths[..]) {
        (Some(h), [out]) => (format!("hf:{h}"), PathBuf::from(out)),
        (None, [input, out]) => (input.clone(), PathBuf::from(out)),
        (Some(_), _) => bail!("with --hf, give only the output path: llmrs convert --hf owner/name OUT"),
        (None, _) => bail!("give the input model and the output path: llmrs convert IN OUT"),
    };
    let is_bin = output.extension().is_some_and(|e| e == "bin");
    let input = Path::new(&spec);
    let ckpt = llmrs::formats::lora::is_checkpoint(input);
    let in_dir = |names: &[&str]| names.iter().map(|n| output.join(n)).collect::<Vec<_>>();
    let written = if is_bin {
        vec![output.clone()]
    } else if ckpt && !merge {
        in_dir(&[llmrs::formats::peft::CONFIG_FILE, llmrs::formats::peft::WEIGHTS_FILE])
    } else {
        in_dir(&["model.safetensors", "config.json"])
    };
    check_convert_output(input, lora.as_deref(), &output, &written)?;
    if ckpt && lora.is_some() {
        bail!(
            "{spec} holds LoRA adapters and --lora names more: give --merge {spec} for its own merged model, \
             or its base as INPUT with --lora"
        );
    }
    if ckpt && !merge && is_bin {
        bail!("{spec} holds LoRA adapters: give a directory for PEFT's adapter files, or --merge for the merged model");
    }
    if merge && lora.is_none() && !ckpt {
        bail!("--merge merges a LoRA run's checkpoint into its base: {spec} is not one (or give --lora DIR)");
    }
    let old = old_outputs(&output, is_bin, overwrite)?;
    if ckpt && !merge {
        // A LoRA run's checkpoint: its adapters as a PEFT adapter directory.
        let (cfg, a, base) = llmrs::formats::lora::load_checkpoint(input)?;
        let name = base.source.strip_prefix("hf:").unwrap_or(&base.source);
        llmrs::formats::peft::save(&a, &output, name, &cfg, dtype)?;
        let removed = remove_old_outputs(&output, &old, &written)?;
        eprintln!(
            "wrote {} (PEFT LoRA adapter: rank {}, alpha {}, {} projections, {} parameters in {dtype}; base {name}){removed}",
            output.display(),
            a.r,
            a.alpha,
            a.targets.len(),
            a.num_parameters()
        );
        return Ok(());
    }
    // A LoRA checkpoint loads as its base with the adapters merged (llmrs::source::load_any).
    // The tokenizer and generation settings come from the base.
    let (weights, side_spec) = if merge && ckpt {
        let (_, _, base) = llmrs::formats::lora::load_checkpoint(input)?;
        // With --seed, its base drawn with the seed given, checked by hash, rather than the seed ignored.
        let w = match seed_given {
            true => llmrs::source::load_merged(&base.source, seed, true, input)?,
            false => load_with_lora(&spec, seed, false, None)?,
        };
        (w, base.source)
    } else {
        (load_with_lora(&spec, seed, seed_given, lora.as_deref())?, spec.clone())
    };
    let side = if is_bin {
        llmrs::formats::llmc::save_model(&weights, &output, dtype)?;
        vec![]
    } else {
        llmrs::formats::hf::save_hf(&weights, &output, dtype)?;
        llmrs::source::copy_side_files(&side_spec, &output, false)?
    };
    let removed = remove_old_outputs(&output, &old, &[written, side.clone()].concat())?;
    let side = match side.is_empty() {
        true => String::new(),
        false => format!("; with {} from {side_spec}", file_names(&side)),
    };
    eprintln!("wrote {} ({} parameters, {dtype}{side}){removed}", output.display(), weights.num_parameters());
    Ok(())
}

/// The files of a model or adapter directory: what `convert` writes there, and what an earlier
/// model or adapter there may have left (its shards and index, its tokenizer's files).
fn is_model_file(name: &str) -> bool {
    const NAMES: [&str; 14] = [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "adapter_config.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "added_tokens.json",
        "generation_config.json",
        "tokenizer.json",
    ];
    NAMES.contains(&name)
        || llmrs::source::SIDE_FILES.contains(&name)
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
        || (name.starts_with("pytorch_model-") && name.ends_with(".bin"))
}

/// What an existing OUTPUT holds that the conversion would replace or leave beside its own
/// files: the file OUT (an llm.c file), or a directory's model and adapter files. Refused
/// unless `overwrite`: `convert` replaces nothing without being told to.
fn old_outputs(output: &Path, is_bin: bool, overwrite: bool) -> Result<Vec<PathBuf>> {
    let o = output.display();
    let old = if is_bin {
        match std::fs::symlink_metadata(output) {
            Ok(m) if m.is_dir() => {
                bail!("OUTPUT {o} is a directory; an llm.c model file is written to a path ending in .bin")
            }
            Ok(_) => vec![output.to_path_buf()],
            Err(_) => vec![],
        }
    } else if output.is_dir() {
        let mut old: Vec<PathBuf> = std::fs::read_dir(output)
            .with_context(|| format!("cannot read the directory {o}"))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(is_model_file))
            .map(|e| e.path())
            .collect();
        old.sort();
        old
    } else if output.exists() {
        bail!("OUTPUT {o} is a file: a Hugging Face model or PEFT adapter is written to a directory (or give a path ending in .bin)")
    } else {
        vec![]
    };
    if !old.is_empty() && !overwrite {
        if is_bin {
            bail!("OUTPUT {o} exists: convert replaces nothing unless told to; pass --overwrite to replace it, or write to another path");
        }
        bail!(
            "OUTPUT {o} holds a model's or adapter's files ({}): convert replaces nothing unless told to; pass \
             --overwrite to replace them (those of the old model that the new one lacks are removed), or write to \
             another directory",
            file_names(&old)
        );
    }
    Ok(old)
}

/// After an `--overwrite` conversion: remove the files of the old model (`old`) that the new
/// one did not write, so that OUTPUT never mixes two models (an old index and shards beside
/// a new model.safetensors, another model's tokenizer). Returns a note naming them, if any.
fn remove_old_outputs(output: &Path, old: &[PathBuf], written: &[PathBuf]) -> Result<String> {
    let stale: Vec<PathBuf> = old.iter().filter(|p| !written.contains(p)).cloned().collect();
    for p in &stale {
        std::fs::remove_file(p).with_context(|| format!("cannot remove {} (of the model OUTPUT held)", p.display()))?;
    }
    Ok(match stale.is_empty() {
        true => String::new(),
        false => format!(
            "; removed what the old model in {} had and this one lacks: {}",
            output.display(),
            file_names(&stale)
        ),
    })
}

/// The file names of `paths`, comma-separated.
fn file_names(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned())).collect();
    names.join(", ")
}

/// Refuse an OUTPUT that would replace what the conversion reads or what a run still needs:
/// one of the files it writes (`written`: OUT itself, or the files it puts in the directory
/// OUT) is INPUT, the `--lora` adapters or the base of a LoRA checkpoint among them, or an
/// existing file inside one of those that is a directory (a Hugging Face model or a PEFT
/// adapter); or it is a checkpoint of a training run (`model_%08d.bin` beside its state files
/// or DONE marker). Writing is atomic, so such a file would be replaced whole and its old
/// contents lost.
fn check_convert_output(input: &Path, lora: Option<&Path>, output: &Path, written: &[PathBuf]) -> Result<()> {
    let mut read = vec![(input.to_path_buf(), "INPUT")];
    read.extend(lora.map(|l| (l.to_path_buf(), "the --lora adapters")));
    for (p, _) in read.clone() {
        if p.is_file() && llmrs::formats::lora::is_checkpoint(&p) {
            if let Ok((_, _, base)) = llmrs::formats::lora::load_checkpoint(&p) {
                read.push((PathBuf::from(base.source), "the base of those LoRA adapters"));
            }
        }
    }
    let read: Vec<_> =
        read.into_iter().filter_map(|(p, what)| Some((std::fs::canonicalize(&p).ok()?, p, what))).collect();
    for w in written {
        // (A new file replaces nothing; an existing one is compared by where it really is.)
        let Ok(abs) = std::fs::canonicalize(w) else { continue };
        let hit = read.iter().find(|(r, _, _)| if r.is_dir() { abs.parent() == Some(r.as_path()) } else { abs == *r });
        if let Some((_, p, what)) = hit {
            let o = output.display();
            match w.as_path() == output {
                true => bail!(
                    "OUTPUT {o} is {what} ({}): the conversion would replace it; write to another path",
                    p.display()
                ),
                false => bail!(
                    "OUTPUT {o}: writing {} would replace {what} ({}) or a file of it; write to another path",
                    w.display(),
                    p.display()
                ),
            }
        }
        let name = w.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let step = name.strip_prefix("model_").and_then(|n| n.strip_suffix(".bin")).filter(|n| n.len() == 8);
        if let Some(step) = step.filter(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            let dir = w.parent().map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d });
            let run_file = |f: &str| dir.is_some_and(|d| d.join(f).exists());
            if run_file(&format!("DONE_{step}")) || run_file(&format!("state_{step}_00000.bin")) {
                bail!(
                    "OUTPUT {} is checkpoint {} of a training run (its state files sit beside it): write to another path",
                    w.display(),
                    step.parse::<u64>().unwrap_or(0)
                );
            }
        }
    }
    Ok(())
}

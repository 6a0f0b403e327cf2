//! The `llmrs` command line: the commands, parsed once, each run by its file under [`cli`].

mod cli;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Large blocks page-aligned from the OS ([`llmrs::core::mem::PageAligned`]).
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: llmrs::core::mem::PageAligned = llmrs::core::mem::PageAligned;

#[derive(Parser)]
#[command(
    name = "llmrs",
    version,
    about = "GPT-2, Llama and Qwen training from scratch in pure Rust (llm.c compatible)"
)]
struct Cli {
    /// Worker threads (default: all cores; under mpirun, the cores this process may use
    /// divided among the ranks on its machine).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Under mpirun: seconds one collective may wait for the other ranks before this process
    /// stops with an error (a rank died or hangs).
    #[arg(long, global = true, default_value_t = 600)]
    comm_timeout: u64,
    /// Where the model runs: cpu, or gpu (the best adapter: Metal, Vulkan or DX12) or gpu:N
    /// (the N-th of `llmrs devices`).
    #[arg(long, global = true, default_value = "cpu")]
    device: llmrs::backend::Device,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once
enum Cmd {
    /// Train or fine-tune a GPT-2, Llama or Qwen model (llm.c train_gpt2.cu flags). With no arguments:
    /// a small GPT-2 on Tiny Shakespeare, preparing the data first if needed.
    Train(cli::train::TrainArgs),
    /// Turn text into llm.c token shards.
    #[command(subcommand)]
    Prepare(cli::prepare::PrepareCmd),
    /// Plot training curves from one or more log.jsonl files (PNG and SVG).
    Plot {
        #[arg(required = true)]
        logs: Vec<PathBuf>,
        /// Output path without extension: writes OUT.png and OUT.svg.
        #[arg(short, long, default_value = "curves")]
        out: PathBuf,
    },
    /// Time training steps (forward, backward, AdamW) on random tokens: ms/step, tokens/s, MFU
    /// against the measured fp32 peak, peak memory, and where the time goes.
    Bench(cli::bench::BenchArgs),
    /// Evaluate a model.
    #[command(subcommand)]
    Eval(cli::eval::EvalCmd),
    /// List the GPU adapters `--device gpu:N` can use (backend, name, limits).
    Devices,
    /// Generate text from a prompt, streaming it as it is produced (KV-cached).
    Generate(cli::generate::GenArgs),
    /// Convert a model between llm.c .bin and Hugging Face safetensors. OUT ending in .bin is an
    /// llm.c model file; anything else is a directory with model.safetensors + config.json.
    Convert(cli::convert::ConvertArgs),
}

fn main() {
    // std::env::args panics on an argument that is not UTF-8; say which one instead.
    let mut args = vec![];
    for (i, a) in std::env::args_os().enumerate() {
        match a.into_string() {
            Ok(a) => args.push(a),
            Err(a) => {
                eprintln!("error: argument {i} ({}) is not valid UTF-8 text", a.to_string_lossy());
                std::process::exit(1);
            }
        }
    }
    let args = cli::train::translate_llmc_args(args);
    let cli = Cli::parse_from(args);
    llmrs::backend::launch::finish(real_main(cli));
}

fn real_main(cli: Cli) -> Result<()> {
    // The processes first: under mpirun the thread team is sized by the ranks on this machine.
    let comm = llmrs::backend::launch::open(std::time::Duration::from_secs(cli.comm_timeout.max(1)))?;
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = cli.threads {
        // Many times the cores only spends time starting threads (10000 took 40 s, silently).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let most = 8 * cores.max(8);
        if n == 0 || n > most {
            bail!("--threads {n}: give 1 to {most} (this machine has {cores} cores; the default uses them all)");
        }
        pool = pool.num_threads(n);
    } else if comm.world() > 1 {
        pool = pool.num_threads(threads_per_rank(comm.local_world()));
    }
    pool.build_global().context("cannot set up the worker threads")?;
    llmrs::backend::factory::init_host()?;
    // The pool's size also sizes the host backend's thread team, made on first use. Commands run
    // on a worker of the pool: rayon's loops (data preparation) then fork from a worker that
    // takes its own share at once, instead of the main thread handing each loop to the pool and
    // sleeping until it is done.
    rayon::scope(|_| run_command(cli, comm))
}

/// Threads for one of `local` ranks on this machine: its cores shared evenly, and no more than
/// the cores this process may run on (mpirun may have bound it to some).
fn threads_per_rank(local: usize) -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: sysconf only reads a system setting.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    (online / local.max(1)).min(allowed).max(1)
}

type Comm = Box<dyn llmrs::backend::comm::Collectives>;

fn run_command(cli: Cli, comm: Comm) -> Result<()> {
    let device = cli.device;
    if comm.world() > 1 && !matches!(cli.cmd, Some(Cmd::Train(_)) | Some(Cmd::Bench(_))) {
        bail!("only `llmrs train` and `llmrs bench` run as several processes; run this command without mpirun");
    }
    match cli.cmd {
        None => cli::train::default_run(device),
        Some(Cmd::Train(a)) => cli::train::run(a, device, comm),
        Some(Cmd::Prepare(p)) => cli::prepare::run(p),
        Some(Cmd::Generate(a)) => cli::generate::run(a, device),
        Some(Cmd::Bench(a)) => cli::bench::run(a, device, comm),
        Some(Cmd::Devices) => cli::devices(),
        Some(Cmd::Plot { logs, out }) => cli::plot(&logs, &out),
        Some(Cmd::Eval(e)) => cli::eval::run(e, device),
        Some(Cmd::Convert(c)) => cli::convert::run(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cli::{dtype_name, parse_dtype};
    use llmrs::core::files::Dtype;
    use llmrs::infer::generate::SamplerConfig;
    use llmrs::train::TrainConfig;

    #[test]
    fn convert_takes_one_path_with_hf_and_two_without() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let Some(Cmd::Convert(c)) = parse(&["llmrs", "convert", "--hf", "a/b", "out.bin"]).unwrap().cmd else {
            panic!("not convert")
        };
        assert_eq!((c.paths, c.hf), (vec!["out.bin".to_string()], Some("a/b".to_string())));
        let Some(Cmd::Convert(c)) = parse(&["llmrs", "convert", "in.bin", "out_dir"]).unwrap().cmd else {
            panic!("not convert")
        };
        assert_eq!((c.paths, c.hf), (vec!["in.bin".to_string(), "out_dir".to_string()], None));
        assert!(parse(&["llmrs", "convert"]).is_err());
        assert!(parse(&["llmrs", "convert", "a", "b", "c"]).is_err());
    }

    #[test]
    fn default_flags_give_the_default_config() {
        use llmrs::train::schedule::ScheduleKind;
        for d in [Dtype::F32, Dtype::BF16] {
            assert_eq!(parse_dtype(dtype_name(d)).unwrap(), d);
        }
        for k in [ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Constant, ScheduleKind::Wsd] {
            assert_eq!(k.to_string().parse::<ScheduleKind>().unwrap(), k);
        }
        let Some(Cmd::Train(a)) = Cli::try_parse_from(["llmrs", "train"]).unwrap().cmd else { panic!("not train") };
        let (cfg, def) = (cli::train::train_config(a, llmrs::backend::Device::Cpu).unwrap(), TrainConfig::default());
        assert_eq!((cfg.schedule, cfg.save_dtype), (def.schedule, def.save_dtype));
        let Some(Cmd::Generate(g)) = Cli::try_parse_from(["llmrs", "generate", "-e", "m"]).unwrap().cmd else {
            panic!("not generate")
        };
        let s = SamplerConfig::default();
        assert_eq!((g.temperature, g.top_k, g.top_p, g.seed), (s.temperature, s.top_k, s.top_p, s.seed));
    }
}

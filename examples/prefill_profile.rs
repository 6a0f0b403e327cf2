//! Time reading a prompt (the KV-cached prefill, what the first token waits for) and split it by
//! layer kind, for a model descriptor and a prompt length (default SmolLM2-135M's shape, 512
//! tokens, random weights and token ids), on the CPU backend.
//! `cargo run --release --example prefill_profile -- [MODEL] [TOKENS] [REPS] [THREADS]`
use llmrs::backend::Device;
use llmrs::core::config::ModelConfig;
use llmrs::core::params::Weights;
use llmrs::infer::generate::PREFILL_CHUNK;
use llmrs::model::Model;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let desc = arg(1, "llama:smollm2-135m");
    let (n, reps, threads): (usize, usize, usize) =
        (arg(2, "512").parse()?, arg(3, "5").parse()?, arg(4, "2").parse()?);
    llmrs::backend::factory::init_host()?;
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    let cfg = ModelConfig::from_descriptor(&desc)?;
    let mut m = Model::new(Weights::random(cfg, 1)?, Device::Cpu)?;
    let toks: Vec<u32> = (0..n as u32).map(|i| i * 7919 % cfg.vocab_size as u32).collect();
    // One unmeasured pass (page faults, buffers), then the measured ones with the profile on.
    let mut cache = m.kv_cache(n, PREFILL_CHUNK)?;
    m.forward_cached(&mut cache, &toks)?;
    m.free_kv_cache(cache);
    m.set_profiling(true);
    let mut ms = vec![];
    for _ in 0..reps {
        let mut cache = m.kv_cache(n, PREFILL_CHUNK)?;
        let t = Instant::now();
        m.forward_cached(&mut cache, &toks)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        m.free_kv_cache(cache);
    }
    println!("{desc}, {n}-token prompt, {threads} threads: prefill ms {ms:.1?}");
    for (kind, secs) in m.profile_totals()? {
        if secs > 0.0 {
            println!("  {kind:?}: {:.1} ms per prefill", secs * 1e3 / reps as f64);
        }
    }
    Ok(())
}

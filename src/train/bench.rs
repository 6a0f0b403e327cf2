//! `llmrs bench`: time full training steps (forward, backward, AdamW) of a model on random tokens,
//! and put them against the machine's own measured peak.

use crate::backend::Device;
use crate::core::config::Precision;
use crate::model::optim::OptimConfig;
use crate::model::Model;
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Model descriptor or file (default d12, GPT-2 124M).
    pub model: String,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Measured steps.
    pub steps: usize,
    /// Steps run first and not measured (page faults, caches, thread start-up).
    pub warmup: usize,
    pub device: Device,
    /// ZeRO stage when several processes run (`mpirun -np N llmrs bench -z S`).
    pub zero_stage: usize,
    /// Recompute level (train's `-r`): 0 none, 1 the MLP activation, 2 + the norms' outputs.
    pub recompute: u8,
    /// Rows of logits the classifier computes at once (train's `--ce-rows`; 0 = all).
    pub ce_rows: usize,
    /// LoRA rank (as train's --lora; 0 = every weight trains), alpha 2R, on `lora_targets`
    /// (empty: every projection).
    pub lora: usize,
    pub lora_targets: Vec<String>,
    /// train's `--precision` and `-w` (fp32 master weights with bf16).
    pub precision: crate::core::config::Precision,
    pub master_weights: bool,
}

#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    pub model: String,
    /// The backend that ran (device, kernels, threads).
    pub backend: String,
    pub num_parameters: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub threads: usize,
    /// Processes (ranks), each stepping B*T tokens, and the ZeRO stage.
    pub processes: usize,
    pub zero_stage: usize,
    /// The recompute level (`-r`).
    pub recompute: u8,
    /// The classifier's rows at once (0 = all).
    pub ce_rows: usize,
    pub precision: crate::core::config::Precision,
    /// The rank that made this report (rank 0 prints it).
    pub rank: usize,
    /// LoRA rank (0: a full training step) and the adapters' parameters.
    pub lora: usize,
    pub trainable_parameters: usize,
    pub steps: usize,
    pub ms_median: f64,
    pub ms_min: f64,
    pub ms_max: f64,
    /// All ranks together.
    pub tokens_per_s: f64,
    pub tokens_per_s_per_rank: f64,
    /// Median time per step in collectives (this rank).
    pub comm_ms: f64,
    /// This rank's model state by role.
    pub memory_per_rank: crate::model::MemoryUse,
    /// Model FLOPs per token as llm.c and PaLM count them: 6N + 6*L*C*T.
    pub flops_per_token: f64,
    pub achieved_gflops: f64,
    /// This rank's share of the machine's fp32 peak (measured by all ranks at once); None on a
    /// GPU, whose peak llmrs does not measure.
    pub peak_gflops: Option<f64>,
    pub peak_method: String,
    pub mfu: Option<f64>,
    /// With `--precision bf16`: the machine's bf16 peak (a `vdpbf16ps` loop, this rank's
    /// share) and the MFU against it, where the CPU has AVX512_BF16.
    pub bf16_peak_gflops: Option<f64>,
    pub bf16_mfu: Option<f64>,
    /// How the bf16 peak was measured (AMX's or `vdpbf16ps`'s loop).
    pub bf16_peak_method: String,
    pub peak_rss_mib: f64,
    /// Share of step time in forward, backward and the optimizer.
    pub phases: Vec<(String, f64)>,
    /// Share of step time by layer kind (from the device's timestamps on a GPU; empty where
    /// the adapter has none).
    pub kinds: Vec<(String, f64)>,
}

/// FLOPs per token of a training step (forward + backward), llm.c's `gpt2_estimate_mfu` count:
/// 6N + 6LCT; with LoRA the frozen base costs 4N (no weight gradients) and each adapter of rank
/// R on an (out, in) projection 6R*in + 6R*out (its forward's two GEMMs, and four in the
/// backward, which reads the forward's h).
pub fn flops_per_token(model: &Model, t: usize) -> f64 {
    let c = &model.config;
    let attn = 6.0 * (c.num_layers * c.channels * t) as f64;
    match model.lora() {
        Some(a) => {
            let per = |x: &crate::model::lora::Target| (6 * a.r * (x.cols + x.rows)) as f64;
            4.0 * model.num_parameters() as f64 + a.targets.iter().map(per).sum::<f64>() + attn
        }
        None => 6.0 * model.num_parameters() as f64 + attn,
    }
}

/// Peak resident memory of this process (Linux `VmHWM`), in MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Run the benchmark as a single process.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport> {
    run_with(cfg, Box::new(crate::backend::comm::SingleProcess))
}

/// Run the benchmark as one rank of `comm` (each rank steps its own B*T random tokens).
pub fn run_with(cfg: &BenchConfig, comm: Box<dyn crate::backend::comm::Collectives>) -> Result<BenchReport> {
    // A run on the CPU that this machine cannot hold is refused from its shapes (a GPU's
    // memory is not the host's; each rank of several checks its shards as it allocates them).
    let cpu = cfg.device == crate::backend::Device::Cpu;
    if let (true, 1, Ok(Some(mc))) = (cpu, comm.world(), crate::source::peek_config(&cfg.model)) {
        let run = crate::model::RunMemory {
            b: cfg.batch_size,
            t: cfg.seq_len,
            recompute: cfg.recompute,
            ce_rows: cfg.ce_rows,
            precision: cfg.precision,
            master_weights: cfg.master_weights,
            lora: cfg.lora > 0,
        };
        crate::model::check_fits(&mc, run)?;
    }
    // Random weights are drawn, and a Hugging Face checkpoint's read, into the model once its
    // precision is set (ZeRO-3 shards them: made whole first there), so that a bf16 model's
    // fp32 values never exist whole.
    let (weights, seed) = match cfg.zero_stage {
        3 => (crate::source::load_any(&cfg.model, 42)?, None),
        _ => crate::source::load_any_deferred(&cfg.model, 42)?,
    };
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    if t > weights.config.max_seq_len {
        anyhow::bail!("-t {t} is longer than the model's context {}", weights.config.max_seq_len);
    }
    let (rank, world) = (comm.rank(), comm.world());
    let mc = weights.config;
    let mut model = Model::with_collectives(weights, crate::backend::factory::open(cfg.device)?, comm, cfg.zero_stage)?;
    if cfg.lora == 0 && !cfg.lora_targets.is_empty() {
        anyhow::bail!("--lora-targets sets up LoRA adapters: give their rank with --lora R");
    }
    if cfg.lora > 0 {
        let targets = crate::model::lora::select(&mc, &cfg.lora_targets)?;
        let a = crate::model::lora::Adapters::new(
            cfg.lora,
            2.0 * cfg.lora as f32,
            targets,
            &mut crate::core::rng::Mt19937::new(42),
        )?;
        model.set_lora(&a)?;
    }
    model.set_precision(cfg.precision, cfg.master_weights)?;
    if let Some(d) = seed {
        d.make(&mut model)?;
    }
    model.alloc_training_state()?;
    model.set_recompute(cfg.recompute)?;
    model.set_classifier_rows(cfg.ce_rows)?;
    model.reserve(b, t)?;
    let v = model.config.vocab_size as u64;
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (rank as u64) << 32;
    let tokens: Vec<u32> = (0..b * t + 1)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % v) as u32
        })
        .collect();
    let (inputs, targets) = (&tokens[..b * t], &tokens[1..]);
    let opt = OptimConfig::default();
    let (mut times, mut comm_ms) = (vec![], vec![]);
    let mut phase = [0f64; 3];
    // The backend's peak, for MFU (the CPU's is measured; a GPU's is not).
    model.barrier()?; // every rank measures its share of the machine at the same time
    let peak_before = model.measure_peak().map_or(0.0, |p| p.0);
    model.barrier()?;
    for step in 0..cfg.warmup + cfg.steps {
        if step == cfg.warmup {
            model.set_profiling(true);
            phase = [0.0; 3];
        }
        // Each phase ends with a synchronize, so its time is the device's (free on the CPU).
        let (t0, c0) = (Instant::now(), model.comm_seconds());
        model.zero_grad()?;
        // A chunked classifier steps as training does, forward and backward fused (one phase);
        // unchunked, the fused step is the same calls as the two passes.
        let t1 = if cfg.ce_rows > 0 {
            model.forward_backward(inputs, targets, b, t, 1.0)?;
            t0
        } else {
            model.forward(inputs, Some(targets), b, t)?;
            model.synchronize()?;
            let t1 = Instant::now();
            model.backward(1.0)?;
            t1
        };
        model.synchronize()?;
        let t2 = Instant::now();
        model.update(&opt, 1e-4, step, crate::backend::SkipAbove::NON_FINITE)?;
        model.synchronize()?;
        let t3 = Instant::now();
        if step >= cfg.warmup {
            times.push((t3 - t0).as_secs_f64() * 1e3);
            comm_ms.push((model.comm_seconds() - c0) * 1e3);
            phase[0] += (t1 - t0).as_secs_f64();
            phase[1] += (t2 - t1).as_secs_f64();
            phase[2] += (t3 - t2).as_secs_f64();
        }
    }
    let totals = model.profile_totals()?;
    model.set_profiling(false);
    let total: f64 = phase.iter().sum();
    let kinds = totals.into_iter().map(|(k, s)| (format!("{k:?}").to_lowercase(), s / total)).collect();
    let (ms_min, ms_max) = times.iter().fold((f64::MAX, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
    let ms_median = median(&mut times);
    let tokens_per_s_per_rank = (b * t) as f64 / (ms_median / 1e3);
    let fpt = flops_per_token(&model, t);
    let achieved = fpt * tokens_per_s_per_rank / 1e9;
    // Measured once before and once after the steps; the higher reading is the peak.
    model.barrier()?;
    let (peak, method) = match model.measure_peak() {
        Some((after, method)) => (Some(after.max(peak_before)), method),
        None => (None, "not measured on a GPU".to_string()),
    };
    // The CPU's bf16 peak, where the run is on the CPU (a GPU's peak is not measured).
    let on_cpu = peak.is_some();
    let bf16_peak =
        if cfg.precision == Precision::Bf16 && on_cpu { crate::backend::cpu::peak::measure_bf16() } else { None };
    let bf16_peak_method = bf16_peak.as_ref().map_or(String::new(), |(_, m)| m.clone());
    let bf16_peak = bf16_peak.map(|(p, _)| p / world as f64);
    model.barrier()?;
    Ok(BenchReport {
        model: cfg.model.clone(),
        backend: model.describe_backend(),
        num_parameters: model.num_parameters(),
        batch_size: b,
        seq_len: t,
        threads: crate::backend::cpu::team::threads(),
        processes: world,
        zero_stage: model.zero_stage(),
        recompute: model.recompute(),
        ce_rows: cfg.ce_rows,
        precision: cfg.precision,
        rank,
        lora: cfg.lora,
        trainable_parameters: model.lora().map_or(model.num_parameters(), |a| a.num_parameters()),
        steps: cfg.steps,
        ms_median,
        ms_min,
        ms_max,
        tokens_per_s: tokens_per_s_per_rank * world as f64,
        tokens_per_s_per_rank,
        comm_ms: median(&mut comm_ms),
        memory_per_rank: model.memory(),
        flops_per_token: fpt,
        achieved_gflops: achieved,
        peak_gflops: peak,
        peak_method: method,
        mfu: peak.map(|p| achieved / p),
        bf16_peak_gflops: bf16_peak,
        bf16_mfu: bf16_peak.map(|p| achieved / p),
        bf16_peak_method,
        peak_rss_mib: peak_rss_mib(),
        phases: if cfg.ce_rows > 0 {
            vec![("forward+backward", phase[0] + phase[1]), ("optimizer", phase[2])]
        } else {
            vec![("forward", phase[0]), ("backward", phase[1]), ("optimizer", phase[2])]
        }
        .into_iter()
        .map(|(n, s)| (n.to_string(), s / total))
        .collect(),
        kinds,
    })
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {} ({:.1}M parameters), B={} T={}, {} threads, {} steps measured",
            self.model,
            self.num_parameters as f64 / 1e6,
            self.batch_size,
            self.seq_len,
            self.threads,
            self.steps
        )?;
        writeln!(f, "backend     {}", self.backend)?;
        if self.lora > 0 {
            writeln!(
                f,
                "LoRA        rank {}: {} trainable parameters, the base frozen",
                self.lora, self.trainable_parameters
            )?;
        }
        writeln!(f, "ms/step     median {:.1} (min {:.1}, max {:.1})", self.ms_median, self.ms_min, self.ms_max)?;
        if self.processes > 1 {
            writeln!(f, "processes   {} (ZeRO stage {})", self.processes, self.zero_stage)?;
            writeln!(f, "tokens/s    {:.1} ({:.1} per rank)", self.tokens_per_s, self.tokens_per_s_per_rank)?;
            writeln!(f, "collectives {:.1} ms/step (rank {})", self.comm_ms, self.rank)?;
        } else {
            writeln!(f, "tokens/s    {:.1}", self.tokens_per_s)?;
        }
        writeln!(
            f,
            "throughput  {:.1} GFLOP/s of model FLOPs ({:.3} GFLOP/token: 6N + 6LCT)",
            self.achieved_gflops,
            self.flops_per_token / 1e9
        )?;
        match (self.peak_gflops, self.mfu) {
            (Some(peak), Some(mfu)) => {
                writeln!(f, "peak        {peak:.1} GFLOP/s fp32 ({})", self.peak_method)?;
                if self.bf16_mfu.is_some() {
                    // bf16 GEMMs on tiles faster than the FMA loop can pass 100% of its peak:
                    // the bf16 line below holds this run's MFU.
                    writeln!(f, "MFU         {:.1}% of the fp32 peak (bf16 GEMMs: see the bf16 line)", 100.0 * mfu)?;
                } else {
                    writeln!(f, "MFU         {:.1}%", 100.0 * mfu)?;
                }
            }
            _ => writeln!(f, "peak, MFU   {}", self.peak_method)?,
        }
        if self.precision == Precision::Bf16 {
            match (self.bf16_peak_gflops, self.bf16_mfu) {
                (Some(peak), Some(mfu)) => {
                    writeln!(f, "peak bf16   {peak:.1} GFLOP/s ({}); MFU {:.1}%", self.bf16_peak_method, 100.0 * mfu)?
                }
                _ if self.peak_gflops.is_none() => writeln!(f, "peak bf16   not measured on a GPU")?,
                _ => writeln!(
                    f,
                    "peak bf16   none: the bf16 GEMMs widen to fp32 here (no AMX; vdpbf16ps only on AMD) and the MFU above is against fp32's"
                )?,
            }
        }
        let m = &self.memory_per_rank;
        let mb = |x: usize| x as f64 / 1e6;
        writeln!(
            f,
            "memory      {:.1} MB ({}): parameters {:.1}, master weights {:.1}, gradients {:.1}, AdamW {:.1}, buffers {:.1}, activations {:.1} (kept per layer {:.1}, logits {:.1}; -r {}, --ce-rows {})",
            mb(m.total()),
            self.precision,
            mb(m.params),
            mb(m.master),
            mb(m.grads),
            mb(m.adamw),
            mb(m.buffers),
            mb(m.activations),
            mb(m.activations_per_layer),
            mb(m.activations_logits),
            self.recompute,
            self.ce_rows
        )?;
        writeln!(f, "peak RSS    {:.0} MiB", self.peak_rss_mib)?;
        let pct = |v: &[(String, f64)]| {
            v.iter().map(|(n, x)| format!("{n} {:.1}%", 100.0 * x)).collect::<Vec<_>>().join(", ")
        };
        writeln!(f, "phases      {}", pct(&self.phases))?;
        if self.kinds.is_empty() {
            write!(f, "layer kinds not timed (the adapter has no timestamp queries)")
        } else {
            write!(f, "layer kinds {}", pct(&self.kinds))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_bench_reports_consistent_numbers() {
        let r = run(&BenchConfig {
            model: "1x16:2:16".into(),
            batch_size: 2,
            seq_len: 8,
            steps: 3,
            warmup: 1,
            device: Device::Cpu,
            zero_stage: 0,
            recompute: 1,
            ce_rows: 5,
            lora: 0,
            lora_targets: vec![],
            precision: crate::core::config::Precision::Fp32,
            master_weights: true,
        })
        .unwrap();
        assert!(r.ms_min <= r.ms_median && r.ms_median <= r.ms_max);
        let (peak, mfu) = (r.peak_gflops.unwrap(), r.mfu.unwrap());
        assert!(peak > 0.0 && mfu > 0.0 && mfu < 1.0);
        let phases: f64 = r.phases.iter().map(|x| x.1).sum();
        assert!((phases - 1.0).abs() < 1e-9);
        // --ce-rows 5: the logits hold 5 rows of Vp; the kept activations are part of the rest.
        let m = r.memory_per_rank;
        assert_eq!(m.activations_logits, 4 * 5 * 50304);
        assert!(m.activations_per_layer > 0 && m.activations_per_layer + m.activations_logits < m.activations);
        let kinds: f64 = r.kinds.iter().map(|x| x.1).sum();
        assert!(kinds > 0.3 && kinds <= 1.0 + 1e-9, "timed layers cover most of the step: {kinds}");
        assert!(r.to_string().contains("MFU"));
        // 6N + 6LCT with N = 50304*16 + 16*16 + 12*16*16 + 13*16 + 2*16.
        let n = 50304 * 16 + 16 * 16 + 12 * 256 + 13 * 16 + 32;
        assert_eq!(r.num_parameters, n);
        assert_eq!(r.flops_per_token, 6.0 * n as f64 + 6.0 * 16.0 * 8.0);
        assert!(r.bf16_peak_gflops.is_none() && !r.to_string().contains("peak bf16"), "an fp32 run has no bf16 line");
    }

    /// In bf16: half the activations' bytes, and the bf16 peak line, with the measured
    /// `vdpbf16ps` peak where the CPU has AVX512_BF16 and saying so where it has not.
    #[test]
    fn bf16_bench_reports_its_memory_and_its_peak() {
        let cfg = |precision| BenchConfig {
            model: "1x16:2:16".into(),
            batch_size: 2,
            seq_len: 8,
            steps: 2,
            warmup: 1,
            device: Device::Cpu,
            zero_stage: 0,
            recompute: 1,
            ce_rows: 5,
            lora: 0,
            lora_targets: vec![],
            precision,
            master_weights: true,
        };
        let (r32, r16) = (run(&cfg(Precision::Fp32)).unwrap(), run(&cfg(Precision::Bf16)).unwrap());
        assert_eq!(2 * r16.memory_per_rank.activations_logits, r32.memory_per_rank.activations_logits);
        let text = r16.to_string();
        if crate::backend::cpu::peak::measure_bf16().is_some() {
            let (peak, mfu) = (r16.bf16_peak_gflops.unwrap(), r16.bf16_mfu.unwrap());
            assert!(peak > 0.0 && mfu > 0.0 && mfu < 1.0, "{text}");
            let how = if crate::backend::cpu::bgemm::model_engine() == Some(crate::backend::cpu::bgemm::Engine::Amx) {
                "AMX tdpbf16ps loop on"
            } else {
                "vdpbf16ps loop on"
            };
            assert!(text.contains(how) && text.contains("; MFU"), "{text}");
            assert!(text.contains("% of the fp32 peak (bf16 GEMMs") && !r32.to_string().contains("of the fp32 peak"));
        } else {
            crate::testdata::skipped("the bf16 peak's measurement", "the bf16 GEMMs widen to fp32 on this host");
            assert!(r16.bf16_peak_gflops.is_none() && text.contains("peak bf16   none"), "{text}");
        }
    }
}

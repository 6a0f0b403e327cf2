"""LoRA fine-tuning: llmrs against PyTorch + PEFT, same machine, same thread count, rounds
interleaved (llmrs, then PEFT), each engine in a fresh process so that its peak RSS is its own.

    cargo build --release
    pip install torch transformers peft
    python scripts/bench_lora.py --threads 2                       # Llama 3.2 1B's shape
    python scripts/bench_lora.py --model smollm2-135m -b 4 -t 256  # a smaller one
    python scripts/bench_lora.py --rounds 3 --variant LLMRS_SGEMM_ORDER=blocks --variant LLMRS_SGEMM_ORDER=runs

Model: `llama:<model>`'s shape with random weights (speed and memory do not depend on them):
llama3.2-1b (L=16, C=2048, NH=32, KV=8, F=8192, V=128256, tied head, rope 5e5 with Llama 3's
scaling) or smollm2-135m. LoRA of rank --lora (alpha 2R) on every projection of every block
(q, k, v, o, gate, up, down), the base frozen; one training step is forward, cross-entropy,
backward, global-norm clipping at 1 and AdamW over the adapters, on B x T random tokens.

PyTorch + PEFT at its best on the CPU: fp32 (or, with --precision bf16, the base made in bf16
and the step under bf16 autocast, the adapters fp32 as PEFT keeps them), SDPA attention, `get_peft_model` with
`LoraConfig(r, lora_alpha=2r, target_modules=[...], lora_dropout=0)`, torch.optim.AdamW
(foreach). llmrs: `llmrs bench -e llama:<model> --lora R --precision P` with --extra flags (e.g.
"-r 2"); in bf16 its frozen base is bf16 too and its adapters fp32.
Per round: each engine's median seconds per step over --steps after --warmup, and its peak RSS
(VmHWM of its process); the speed-up and the RSS ratio are taken per round. Each --variant
NAME=VALUE runs llmrs once more per round with that environment variable set (the GEMM's
order, say: `LLMRS_SGEMM_ORDER`), each against the same round's PEFT step, so that settings of
one binary are compared on one host in one interleaved run.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--llmrs", default="target/release/llmrs")
ap.add_argument("--model", default="llama3.2-1b", choices=["llama3.2-1b", "smollm2-135m"])
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--lora", type=int, default=8)
ap.add_argument("-b", type=int, default=1)
ap.add_argument("-t", type=int, default=512)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--warmup", type=int, default=1)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
ap.add_argument("--extra", default="", help="more llmrs bench flags, e.g. \"-r 2\"")
ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                help="run llmrs once per round per variant, with this environment variable set (repeatable)")
ap.add_argument("--peft-child", action="store_true", help=argparse.SUPPRESS)
args = ap.parse_args()


def peft_child():
    """One PEFT measurement in this (fresh) process: prints JSON."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    if args.model == "llama3.2-1b":
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    else:
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    bf16 = args.precision == "bf16"
    # In bf16 the base is made in bf16 (never an fp32 copy: its peak RSS is its own).
    torch.set_default_dtype(torch.bfloat16 if bf16 else torch.float32)
    base = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets,
                                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (args.b, args.t + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    times = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    dtypes = sorted({str(p.dtype) for p in params})
    print(json.dumps({"s_per_step": statistics.median(times), "peak_rss_mib": rss, "adapter_dtypes": dtypes,
                      "trainable": sum(p.numel() for p in params), "torch": torch.__version__,
                      "transformers": transformers.__version__}))


if args.peft_child:
    peft_child()
    sys.exit(0)

cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")][:1]
flags = open("/proc/cpuinfo").read()
isa = "AVX-512" + (" AVX512_BF16" if "avx512_bf16" in flags else "") + (" AMX-BF16" if "amx_bf16" in flags else "") \
    if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
print(f"CPU: {cpu[0] if cpu else '?'} ({isa}); {args.threads} threads; llama:{args.model}, LoRA r={args.lora}, "
      f"B={args.b} T={args.t}, {args.precision}")


def llmrs_round(variant):
    cmd = [args.llmrs, "--threads", str(args.threads), "bench", "-e", f"llama:{args.model}", "--lora", str(args.lora),
           "-b", str(args.b), "-t", str(args.t), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", args.precision, "--json"] + args.extra.split()
    env = dict(os.environ)
    if variant:
        name, value = variant.split("=", 1)
        env[name] = value
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    return r["ms_median"] / 1e3, r["peak_rss_mib"], r["trainable_parameters"]


def peft_round():
    cmd = [sys.executable, __file__, "--peft-child"] + [a for a in sys.argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["s_per_step"], r["peak_rss_mib"], f'{r["trainable"]} trainable, {"/".join(r["adapter_dtypes"])}'


for v in args.variant:
    if "=" not in v or not v.split("=", 1)[0]:
        sys.exit(f"--variant {v!r}: give NAME=VALUE, e.g. LLMRS_SGEMM_ORDER=runs")
variants = list(dict.fromkeys(args.variant)) or [""]  # (each once, in the order given)
speed, mem = {v: [] for v in variants}, {v: [] for v in variants}
for rnd in range(args.rounds):
    runs = [(v, llmrs_round(v)) for v in variants]
    b = peft_round()
    for v, a in runs:
        speed[v].append(b[0] / a[0])
        mem[v].append(a[1] / b[1])
        label = f" [{v}]" if v else ""
        print(f"round {rnd}{label}: llmrs {a[0]:.2f} s/step, peak RSS {a[1]:.0f} MiB ({a[2]} trainable) | "
              f"PyTorch+PEFT {b[0]:.2f} s/step, peak RSS {b[1]:.0f} MiB ({b[2]}) | speed-up {speed[v][-1]:.2f}x, "
              f"RSS ratio {mem[v][-1]:.2f}")
for v in variants:
    label = f" [{v}]" if v else ""
    print(f"median{label}: llmrs steps {statistics.median(speed[v]):.2f}x PyTorch+PEFT's speed at "
          f"{statistics.median(mem[v]):.2f}x its peak RSS ({args.precision}; llmrs flags: {args.extra or 'defaults'})")

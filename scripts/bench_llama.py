"""Llama speed: llmrs vs PyTorch's LlamaForCausalLM and transformers' generate, same machine,
same thread count, interleaved A B A B (ratios per round, median over rounds).

    cargo build --release
    pip install torch transformers tokenizers
    python scripts/bench_llama.py --threads 2

Model: SmolLM2-135M's shape (`llama:smollm2-135m`: L=30, C=576, NH=9, KV=3, F=1536,
V=49152, tied head), random weights (speed does not depend on them).

Training: one step at B=4, T=64 (forward, backward, global-norm clipping, AdamW), PyTorch at
its best on the CPU: SDPA attention, fp32, torch.optim.AdamW (foreach). llmrs: `llmrs bench`.
`--precision bf16`: `llmrs bench --precision bf16` against the same PyTorch step with its forward
and loss under `torch.autocast("cpu", dtype=torch.bfloat16)` (training only).

Generation: for each prompt length of --prompt-tokens (default 64, the training shape's T, and
512), a prompt of that many tokens (Tiny Shakespeare, tokenized by the small byte-level tokenizer
of tests/fixtures/tokenizers, whose ids both engines read alike), then --new greedy tokens with
the KV cache: time to the first token and decode tokens/s, against `generate(do_sample=False)`.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--llmrs", default="target/release/llmrs")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("-b", type=int, default=4)
ap.add_argument("-t", type=int, default=64)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--prompt-tokens", default="64,512", help="prompt lengths, comma-separated")
ap.add_argument("--new", type=int, default=64)
ap.add_argument("--skip-train", action="store_true")
ap.add_argument("--skip-generate", action="store_true")
ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
args = ap.parse_args()

os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ["HF_HUB_OFFLINE"] = "1"
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(args.threads)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = os.environ.get("LLMRS_DATA_DIR", os.path.join(ROOT, "data"))  # what `llmrs train` leaves there
TOK = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "bytelevel.json")

config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True, attention_bias=False)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(config).float()
print(f"SmolLM2-135M shape, {sum(p.numel() for p in model.parameters())} parameters, {args.threads} threads, "
      f"torch {torch.__version__}, transformers {transformers.__version__}")
cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")][:1]
flags = open("/proc/cpuinfo").read()
isa = "AVX-512" + (" AVX512_BF16" if "avx512_bf16" in flags else "") + (" AMX-BF16" if "amx_bf16" in flags else "") if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
print(f"CPU: {cpu[0] if cpu else '?'} ({isa})")


def train_compare():
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (args.b, args.t + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]

    def torch_round():
        times = []
        for s in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                logits = model(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if s >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def llmrs_round():
        cmd = [args.llmrs, "--threads", str(args.threads), "bench", "-e", "llama:smollm2-135m", "-b", str(args.b),
               "-t", str(args.t), "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision,
               "--json"]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    ratios = []
    for r in range(args.rounds):
        a = llmrs_round()
        ms = a["ms_median"]
        b = torch_round()
        ratios.append(b / ms)
        print(f"round {r}: llmrs {ms:.1f} ms/step | PyTorch {b:.1f} ms/step | speed-up {ratios[-1]:.2f}x")
    print(f"training step B={args.b} T={args.t} {args.precision}: median speed-up llmrs over PyTorch "
          f"{statistics.median(ratios):.2f}x")


def generate_compare(prompt_tokens):
    model.eval()
    tok = Tokenizer.from_file(TOK)
    text = open(f"{D}/tinyshakespeare/input.txt").read()
    ids = tok.encode(text[: 8 * prompt_tokens]).ids[:prompt_tokens]
    prompt = tok.decode(ids)
    ids = tok.encode(prompt).ids  # what llmrs reads from the same text
    inp = torch.tensor([ids])

    def run_llmrs():
        cmd = [args.llmrs, "--threads", str(args.threads), "generate", "-e", "llama:smollm2-135m", "--tokenizer", TOK,
               "-p", prompt, "-n", str(args.new), "--temperature", "0", "--no-stop"]
        err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        m = re.search(r"first token after ([\d.]+)s, then ([\d.]+) tokens/s", err)
        return float(m.group(1)), float(m.group(2))

    def run_hf():
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=1, min_new_tokens=1,
                           do_sample=False, pad_token_id=0)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=args.new,
                           min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            total = time.perf_counter() - t0
        return first, (args.new - 1) / max(total - first, 1e-9)

    decode, ttft = [], []
    for r in range(args.rounds):
        a, b = run_llmrs(), run_hf()
        decode.append(a[1] / b[1])
        ttft.append(b[0] / a[0])
        print(f"round {r}: llmrs first token {a[0]:.3f}s, decode {a[1]:.1f} tok/s | transformers first token "
              f"{b[0]:.3f}s, decode {b[1]:.1f} tok/s")
    print(f"prompt {len(ids)} tokens, {args.new} new: median decode speed-up {statistics.median(decode):.2f}x, "
          f"time-to-first-token speed-up {statistics.median(ttft):.2f}x (llmrs over transformers)")


if not args.skip_train:
    train_compare()
if not args.skip_generate:
    for n in [int(x) for x in args.prompt_tokens.split(",")]:
        generate_compare(n)

"""Generation speed: llmrs vs Hugging Face transformers' generate, same CPU, same thread count.

GPT-2 124M (random weights: speed does not depend on them), a long prompt (the first
--prompt-chars characters of Tiny Shakespeare, ~670 tokens), --new greedy tokens. Runs are
interleaved A B A B so machine noise hits both alike; the ratio is taken per pair.

    cargo build --release
    pip install torch transformers tiktoken
    python scripts/bench_generate.py --threads 2   # data/ as `llmrs train` leaves it, or $LLMRS_DATA_DIR

Reports, per engine: time to the first token (reading the prompt) and then decode tokens/s,
with the KV cache; and end-to-end tokens/s without it (--uncached-new tokens, fewer because it
is slow).
"""

import argparse
import os
import re
import statistics
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--llmrs", default="target/release/llmrs")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompt-chars", type=int, default=2400)
ap.add_argument("--new", type=int, default=64)
ap.add_argument("--uncached-new", type=int, default=8)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ["HF_HUB_OFFLINE"] = "1"
import torch  # noqa: E402
from gpt2_offline import gpt2_encoding  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.set_num_threads(args.threads)
D = os.environ.get("LLMRS_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "data"))
enc = gpt2_encoding(D)
prompt = open(f"{D}/tinyshakespeare/input.txt").read()[: args.prompt_chars]
ids = torch.tensor([enc.encode_ordinary(prompt)])

torch.manual_seed(0)
hf = GPT2LMHeadModel(GPT2Config()).eval()  # GPT-2 124M shape


def run_llmrs(new, cache=True):
    cmd = [args.llmrs, "--threads", str(args.threads), "generate", "-e", "d12", "-p", prompt, "-n", str(new),
           "--temperature", "0", "--no-stop"] + ([] if cache else ["--no-cache"])
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    m = re.search(r"in ([\d.]+)s .*first token after ([\d.]+)s, then ([\d.]+) tokens/s", err)
    total, first, rate = float(m.group(1)), float(m.group(2)), float(m.group(3))
    return first, rate, new / total


def run_hf(new, cache=True):
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, use_cache=cache, pad_token_id=50256)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=cache, pad_token_id=50256)
        total = time.perf_counter() - t0
    return first, (new - 1) / max(total - first, 1e-9), new / total


print(f"prompt {ids.shape[1]} tokens, {args.new} new tokens, {args.threads} threads, torch {torch.__version__}")
ratios, prefill = [], []
for r in range(args.rounds):
    a = run_llmrs(args.new)
    b = run_hf(args.new)
    ratios.append(a[1] / b[1])
    prefill.append(b[0] / a[0])
    print(f"round {r}: llmrs first token {a[0]:.2f}s, decode {a[1]:.1f} tok/s | transformers first token {b[0]:.2f}s, "
          f"decode {b[1]:.1f} tok/s | decode ratio llmrs/transformers {ratios[-1]:.2f}")
print(f"median decode ratio (KV cache) llmrs/transformers: {statistics.median(ratios):.2f}")
print(f"median prefill ratio (time to the first token, transformers/llmrs): {statistics.median(prefill):.2f}")
a = run_llmrs(args.uncached_new, cache=False)
b = run_hf(args.uncached_new, cache=False)
c = run_llmrs(args.uncached_new, cache=True)
print(f"{args.uncached_new} new tokens end to end: llmrs no cache {a[2]:.2f} tok/s, with cache {c[2]:.2f} tok/s "
      f"(x{c[2] / a[2]:.1f}); transformers no cache {b[2]:.2f} tok/s")

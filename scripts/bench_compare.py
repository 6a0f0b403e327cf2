"""Training speed: llmrs vs PyTorch (and llm.c's train_gpt2.c when given), same machine, same
thread count, same model (GPT-2, llm.c's init), batch and optimizer, interleaved A B A B.

    cargo build --release
    pip install torch
    python scripts/bench_compare.py --threads 2 --model d12 -b 4 -t 64
    python scripts/bench_compare.py ... --llmc /path/to/llm.c   # adds llm.c (see below)
    python scripts/bench_compare.py -t 1024 --extra "-r 2 --ce-rows 1024"  # llmrs's memory flags
    cargo build --release --example gemm_shapes
    python scripts/bench_compare.py --threads 2 --gemm          # the step's GEMM shapes instead
    python scripts/bench_compare.py --precision bf16            # llmrs bf16 vs PyTorch's bf16 autocast

--gemm: GFLOP/s of the GEMMs of a GPT-2 124M step at B=4, T=64 (256 rows), llmrs's matmul
(examples/gemm_shapes) against PyTorch's at the same shapes and thread count: forward
`F.linear(x, W, b)`, backward `dx = dy @ W`, `dW = dy^T @ x`, `db = dy.sum(0)`; the best of 5
timed runs of each, per round, interleaved.

PyTorch runs at its best on the CPU: nn.Linear, fused scaled_dot_product_attention, tanh GELU,
torch.optim.AdamW (foreach), fp32; with `--precision bf16`, `llmrs bench --precision bf16`
(llm.c's bf16 numerics, fp32 master weights) against the same PyTorch step with its forward
and loss under `torch.autocast("cpu", dtype=torch.bfloat16)` (PyTorch's CPU mixed precision:
bf16 matmuls on oneDNN, fp32 weights). Each side runs `--steps` steps after `--warmup`
per round; the ratio of median step times is taken per round, and the median over rounds is
reported.

llm.c: `--llmc DIR` where DIR holds llm.c's `train_gpt2` built with its Makefile, with
`gpt2_124M.bin` and dev/data/tinyshakespeare/ prepared as train_gpt2.c expects (B=4, T=64 are
fixed in its source). The median of its "took X ms" lines after the warm-up steps is used; it is
stopped after warmup + steps training steps.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--llmrs", default="target/release/llmrs")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--model", default="d12")
ap.add_argument("-b", type=int, default=4)
ap.add_argument("-t", type=int, default=64)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--llmc", default=None)
ap.add_argument("--extra", default="", help="more flags for `llmrs bench`, e.g. \"-r 2 --ce-rows 1024\"")
ap.add_argument("--gemm", action="store_true", help="compare the step's GEMM shapes instead of whole steps")
ap.add_argument("--gemm-bin", default="target/release/examples/gemm_shapes")
ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
args = ap.parse_args()

os.environ["OMP_NUM_THREADS"] = str(args.threads)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(args.threads)
DEPTHS = {"d6": (6, 6, 384), "d12": (12, 12, 768), "d24": (24, 16, 1024), "d36": (36, 20, 1280), "d48": (48, 25, 1600)}
L, NH, C = DEPTHS[args.model]
V, MAXT = 50257, 1024


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, NH, C // NH).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(MAXT, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        # llm.c's init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), zero biases.
        torch.manual_seed(42)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        for b in self.h:
            for lin, std in ((b.c_attn, 0.02), (b.c_proj, 0.02 / math.sqrt(2 * L)), (b.c_fc, 0.02), (b.mlp_proj, 0.02 / math.sqrt(2 * L))):
                nn.init.normal_(lin.weight, std=std)
                nn.init.zeros_(lin.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


model = GPT()
decay = [p for n, p in model.named_parameters() if p.dim() == 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
g = torch.Generator().manual_seed(0)
data = torch.randint(0, V, (args.b, args.t + 1), generator=g)
x, y = data[:, :-1], data[:, 1:]


def torch_round():
    times = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def llmrs_round():
    cmd = [args.llmrs, "--threads", str(args.threads), "bench", "-e", args.model, "-b", str(args.b), "-t", str(args.t),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision, "--json"] + args.extra.split()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def llmc_round():
    # train_gpt2.c runs 41 steps with validation and sampling in between; time the first
    # warmup + steps training steps and stop it there.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(["./train_gpt2"], cwd=args.llmc, stdout=subprocess.PIPE, text=True, env=env)
    took = []
    for line in proc.stdout:
        m = re.search(r"took ([\d.]+) ms", line)
        if m:
            took.append(float(m.group(1)))
            if len(took) >= args.warmup + args.steps:
                break
    proc.kill()
    proc.wait()
    return statistics.median(took[args.warmup:])


def gemm_compare():
    n = 256
    shapes = [(768, 2304, "qkv"), (768, 768, "attn proj"), (768, 3072, "fc"), (3072, 768, "fc proj"), (768, 50304, "classifier")]

    def best(f):
        f()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    def torch_shapes():
        out = {}
        with torch.no_grad():
            for c, oc, name in shapes:
                x, w, b = torch.full((n, c), 0.01), torch.full((oc, c), 0.02), torch.zeros(oc)
                dy = torch.full((n, oc), 0.01)
                flops = 2.0 * n * c * oc
                fwd = best(lambda: F.linear(x, w, b))
                bwd = best(lambda: (dy @ w, dy.t() @ x, dy.sum(0)))
                out[name] = {"forward": flops / fwd / 1e9, "backward": 2 * flops / bwd / 1e9}
        return out

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    print(f"GEMM shapes of a GPT-2 124M step (n={n} rows), {args.threads} threads, torch {torch.__version__}")
    ratios = {}
    for r in range(args.rounds):
        ours = json.loads(subprocess.run([args.gemm_bin, "--json"], capture_output=True, text=True, check=True, env=env).stdout)
        theirs = torch_shapes()
        cells = []
        for _, _, name in shapes:
            for d in ("forward", "backward"):
                q = ours[name][d] / theirs[name][d]
                ratios.setdefault((name, d), []).append(q)
                cells.append(f"{name} {d} {ours[name][d]:.0f}/{theirs[name][d]:.0f}")
        print(f"round {r} (llmrs/pytorch GFLOP/s): " + ", ".join(cells), flush=True)
    print("median llmrs/pytorch per shape: " + ", ".join(f"{n} {d} {statistics.median(v):.2f}" for (n, d), v in ratios.items()))
    print(f"lowest: {min(statistics.median(v) for v in ratios.values()):.2f}")


if args.gemm:
    gemm_compare()
    raise SystemExit(0)

print(f"model {args.model} (L={L} C={C}), B={args.b} T={args.t}, {args.threads} threads, {args.precision}, torch {torch.__version__}")
cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")][:1]
flags = open("/proc/cpuinfo").read().split()
isa = "AVX-512" + (" AVX512_BF16" if "avx512_bf16" in flags else "") + (" AMX-BF16" if "amx_bf16" in flags else "") if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
print(f"CPU: {cpu[0] if cpu else '?'} ({isa})")
ratios, llmc_ratios = [], []
for r in range(args.rounds):
    rep = llmrs_round()
    tt = torch_round()
    ratios.append(tt / rep["ms_median"])
    line = (f"round {r}: llmrs {rep['ms_median']:.1f} ms/step (MFU {100 * rep['mfu']:.1f}%, RSS {rep['peak_rss_mib']:.0f} MiB) | "
            f"pytorch {tt:.1f} ms/step | pytorch/llmrs {ratios[-1]:.2f}")
    if args.llmc:
        lc = llmc_round()
        llmc_ratios.append(lc / rep["ms_median"])
        line += f" | llm.c {lc:.1f} ms/step, llm.c/llmrs {llmc_ratios[-1]:.2f}"
    print(line, flush=True)
print(f"median speedup vs PyTorch: {statistics.median(ratios):.2f}x")
if llmc_ratios:
    print(f"median speedup vs llm.c: {statistics.median(llmc_ratios):.2f}x")
try:
    import resource
    print(f"PyTorch process peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
except Exception:
    pass

#!/usr/bin/env bash
# Scaling table for `llmrs bench`: time per token and where the time goes as B and T grow.
# Usage: scripts/bench_scaling.sh [MODEL] [THREADS]   (after cargo build --release)
# The largest settings need a lot of memory (activations grow as B*T and attention as B*T^2):
# B=16, T=1024 for d12 needs ~20 GiB; set SKIP_LARGE=1 to leave out B*T > 4096.
set -euo pipefail
model=${1:-d12}
threads=${2:-2}
bin=${LLMRS:-target/release/llmrs}
printf "| B | T | ms/step | ms/token | tokens/s | MFU | peak RSS MiB | matmul | attention | classifier | other |\n"
printf "|---|---|---|---|---|---|---|---|---|---|---|\n"
for b in 1 4 16; do
  for t in 64 256 1024; do
    if [ "${SKIP_LARGE:-0}" = 1 ] && [ $((b * t)) -gt 4096 ]; then continue; fi
    "$bin" --threads "$threads" bench -e "$model" -b "$b" -t "$t" --steps "${STEPS:-2}" --warmup 1 --json |
      python3 -c '
import json, sys
r = json.load(sys.stdin)
k = dict(r["kinds"])
b, t, ms = r["batch_size"], r["seq_len"], r["ms_median"]
mm, at, cl = (100 * k[n] for n in ("matmul", "attention", "classifier"))
tps, mfu, rss = r["tokens_per_s"], 100 * r["mfu"], r["peak_rss_mib"]
cells = [b, t, f"{ms:.0f}", f"{ms / (b * t):.2f}", f"{tps:.0f}", f"{mfu:.1f}%",
         f"{rss:.0f}", f"{mm:.0f}%", f"{at:.0f}%", f"{cl:.0f}%", f"{100 - mm - at - cl:.0f}%"]
print("| " + " | ".join(str(c) for c in cells) + " |")'
  done
done

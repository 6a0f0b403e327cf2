#!/usr/bin/env bash
# Data-parallel scaling on one machine: `llmrs bench` as 1 process and as N processes under
# mpirun at each ZeRO stage, interleaved over rounds (shared machines are noisy), one Markdown
# row per run: total and per-rank tokens/s, time in collectives, memory per rank.
# Usage: scripts/bench_ranks.sh [MODEL] [RANKS] [ROUNDS]
#   after: cargo build --release --features mpi   (Open MPI: apt install openmpi-bin libopenmpi-dev)
set -euo pipefail
model=${1:-d12}
np=${2:-2}
rounds=${3:-2}
bin=${LLMRS:-target/release/llmrs}
flags=(bench -e "$model" -b "${B:-4}" -t "${T:-64}" --steps "${STEPS:-10}" --warmup 2 --json)
mpi=(mpirun --oversubscribe --allow-run-as-root -np "$np")
grep -m1 'model name' /proc/cpuinfo | sed 's/.*: /host: /'
printf "| round | processes | ZeRO | ms/step | tokens/s | per rank | collectives ms/step | params MB | grads MB | AdamW MB | ZeRO buffers MB | activations MB | peak RSS MiB |\n"
printf "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
row() {
  python3 -c '
import json, sys
r = json.loads(sys.stdin.read().strip().splitlines()[-1])
m = r["memory_per_rank"]
mb = lambda k: f"{m[k] / 1e6:.1f}"
ms, tps, tpr, cm, rss = (r[k] for k in ("ms_median", "tokens_per_s", "tokens_per_s_per_rank", "comm_ms", "peak_rss_mib"))
cells = [sys.argv[1], r["processes"], r["zero_stage"] if r["processes"] > 1 else "-", f"{ms:.0f}", f"{tps:.0f}",
         f"{tpr:.0f}", f"{cm:.1f}", mb("params"), mb("grads"), mb("adamw"), mb("buffers"), mb("activations"), f"{rss:.0f}"]
print("| " + " | ".join(str(c) for c in cells) + " |")' "$1"
}
for round in $(seq 1 "$rounds"); do
  "$bin" "${flags[@]}" | row "$round"
  for z in 0 1 2 3; do
    "${mpi[@]}" "$bin" "${flags[@]}" -z "$z" | row "$round"
  done
done

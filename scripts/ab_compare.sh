#!/usr/bin/env bash
# Interleaved A/B of two llmrs binaries on this machine: `llmrs bench -e d12 -b 4 -t 64`
# (median ms/step) and KV-cached generation from a 674-token prompt (first token, decode
# tokens/s), PAIRS times each, A then B, so the machine's drift hits both alike.
#
#   scripts/ab_compare.sh OLD_LLMRS NEW_LLMRS [PAIRS]    (needs data/tinyshakespeare/input.txt
#                                                       or $LLMRS_DATA_DIR for the prompt)
set -euo pipefail
a=$1 b=$2 pairs=${3:-4}
text="${LLMRS_DATA_DIR:-data}/tinyshakespeare/input.txt"
prompt=$(head -c 2400 "$text")
grep -m1 "model name" /proc/cpuinfo
grep -o -w -m1 -E 'avx512f' /proc/cpuinfo >/dev/null && echo "ISA: AVX-512 present" || echo "ISA: AVX2 (no AVX-512)"
echo "pair bin bench_ms_per_step | generate"
for i in $(seq 1 "$pairs"); do
  for who in A B; do
    bin=$a; [ "$who" = B ] && bin=$b
    ms=$("$bin" bench -e d12 -b 4 -t 64 2>&1 | awk '/ms\/step/ {print $3}')
    gen=$("$bin" generate -e d12 -p "$prompt" -n 64 --temperature 0 --no-stop 2>&1 >/dev/null | grep "prompt +")
    echo "$i $who $ms | $gen"
  done
done

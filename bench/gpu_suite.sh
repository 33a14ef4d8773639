#!/usr/bin/env bash
# One device call on a CUDA GPU: the kernel tests compiled for the GPU (SDPA_VARLEN_NATIVE=1), in shards
# side by side. The suite is bound by Triton compiles (each kernel variant ~10-20 s of one core: a test
# compiles the plan, attention and merge kernels for its own heads, dtype and Tuning), so it runs as
# SHARDS processes; each stops at LIMIT seconds. Writes $OUT/shard*.log (pytest -v, durations) and
# $OUT/summary.txt: every test id with PASSED / FAILED / SKIPPED / ERROR or NOT-RUN (its shard stopped first:
# at the limit, exit 124, or a crash; each shard's exit status is printed).
#   SHARDS=8 LIMIT=540 bash bench/gpu_suite.sh [-k EXPRESSION]
# Exit status: 0 only when every collected test ran and none failed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite_out}; mkdir -p "$OUT"
SHARDS=${SHARDS:-8}; LIMIT=${LIMIT:-540}
. bench/device_env.sh
export SDPA_VARLEN_NATIVE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

TESTS=tests/kernels/test_sdpa_varlen.py
python3 -m pytest "$TESTS" --co -q -o addopts="" -p no:cacheprovider "$@" 2>/dev/null | grep '::' > "$OUT/ids.txt"
n=$(wc -l < "$OUT/ids.txt")
[ "$n" -gt 0 ] || { echo "no tests collected (is CUDA visible?)"; exit 1; }
echo "$n tests in $SHARDS shards, $LIMIT s each"
# Round-robin: a test's parametrizations (similar compile cost) spread over the shards.
for ((i = 0; i < SHARDS; i++)); do
  mapfile -t ids < <(awk -v i="$i" -v s="$SHARDS" '(NR - 1) % s == i' "$OUT/ids.txt")
  [ ${#ids[@]} -gt 0 ] || continue
  (timeout -k 10 "$LIMIT" python3 -m pytest -o addopts="" -v -p no:cacheprovider --durations=0 "${ids[@]}" \
     > "$OUT/shard$i.log" 2>&1; echo "exit $?" >> "$OUT/shard$i.log") &
done
wait

: > "$OUT/summary.txt"
while read -r id; do
  result=$(cat "$OUT"/shard*.log | awk -v id="$id" '$1 == id && $2 ~ /^(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)$/ {print $2; exit}')
  echo "${result:-NOT-RUN} $id" >> "$OUT/summary.txt"
done < "$OUT/ids.txt"
grep -hE "^[0-9.]+s (call|setup)" "$OUT"/shard*.log | sort -rn | head -12
for f in "$OUT"/shard*.log; do echo "$(basename "$f" .log): $(tail -1 "$f")"; done
awk '{print $1}' "$OUT/summary.txt" | sort | uniq -c
grep -vE "^(PASSED|SKIPPED)" "$OUT/summary.txt" || true
! grep -qvE "^(PASSED|SKIPPED)" "$OUT/summary.txt"

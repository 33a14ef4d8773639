#!/usr/bin/env bash
# One device call on a CUDA GPU: the kernel tests compiled for the GPU (SDPA_VARLEN_NATIVE=1), in shards
# side by side. The suite is bound by Triton compiles (each kernel specialisation ~10-20 s of one core), so
# every kernel test declares how many specialisations it launches (@pytest.mark.compiles(n), checked by the
# suite itself: tests/kernels/compile_budget.py) and the tests are dealt to SHARDS processes by those
# budgets, the largest first, each to the shard with the least so far. Each shard stops at LIMIT seconds.
# Writes $OUT/shard*.log (pytest -v, durations) and $OUT/summary.txt: every test id with PASSED / FAILED /
# SKIPPED / ERROR or NOT-RUN (its shard stopped first: at the limit, exit 124, or a crash; each shard's
# exit status is printed).
#   SHARDS=16 LIMIT=420 bash bench/gpu_suite.sh [-k EXPRESSION]
# Exit status: 0 only when every collected test ran and none failed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite_out}; mkdir -p "$OUT"
SHARDS=${SHARDS:-$(nproc)}; LIMIT=${LIMIT:-420}
. bench/device_env.sh
export SDPA_VARLEN_NATIVE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)

TESTS=tests/kernels/test_sdpa_varlen.py
SDPA_VARLEN_BUDGETS_OUT="$OUT/budgets.txt" python3 -m pytest "$TESTS" --co -q -o addopts="" -p no:cacheprovider "$@" \
  > /dev/null 2>&1
grep '::' "$OUT/budgets.txt" > "$OUT/budgets_ids.txt" 2>/dev/null; awk '{print $2}' "$OUT/budgets_ids.txt" > "$OUT/ids.txt"
n=$(wc -l < "$OUT/ids.txt")
[ "$n" -gt 0 ] || { echo "no tests collected (is CUDA visible?)"; exit 1; }
# Largest budget first, each to the least-loaded shard (a test's own budget counted at least 1).
sort -k1,1nr -k2 "$OUT/budgets_ids.txt" | awk -v s="$SHARDS" '
  { best = 0; for (i = 1; i < s; i++) if (load[i] < load[best]) best = i
    load[best] += ($1 > 0 ? $1 : 1); print best, $2 }
  END { for (i = 0; i < s; i++) printf "shard%d: %d specialisations\n", i, load[i] > "/dev/stderr" }' \
  > "$OUT/assign.txt" 2> "$OUT/loads.txt"
echo "$n tests, $(awk '{s += $1} END {print s}' "$OUT/budgets_ids.txt") specialisations budgeted, in $SHARDS shards of $LIMIT s"
for ((i = 0; i < SHARDS; i++)); do
  mapfile -t ids < <(awk -v i="$i" '$1 == i {print $2}' "$OUT/assign.txt")
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
echo "wall: $(( $(date +%s) - start )) s for the whole suite (collection, $SHARDS shards side by side, summary)"
grep -vE "^(PASSED|SKIPPED)" "$OUT/summary.txt" || true
! grep -qvE "^(PASSED|SKIPPED)" "$OUT/summary.txt"

#!/usr/bin/env bash
# One device call on a CUDA GPU: every model family's tiny preset built and validated on the CUDA backend
# in both layouts (experiment=cuda_batched8: kv=sequence, 8 sequences; experiment=cuda_cell4: kv=cell), bf16,
# validated on the GPU against the fp32 eager model; the summary feeds docs/models.md's CUDA column.
#   bash bench/cuda_families.sh [preset ...]      (default: every family preset)
# Needs the carried wheels in .whl/ (bench/device_env.sh).
set -uo pipefail
OUT=${OUT:-/tmp/cuda_families_out}; mkdir -p "$OUT"
. bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
presets=("$@"); [ ${#presets[@]} -gt 0 ] || presets=(llama3_tiny qwen25_tiny gemma3_tiny phi4_mini_tiny smollm3_tiny mistral_tiny muse_glimmer_tiny)

build() {  # preset, experiment: exit code, seconds and the validation line in $OUT/$1.$2.rc
  local name="$1.$2" start; start=$(date +%s)
  python3 -m pipeline model="$1" experiment="$2" experiment_name="$name" output_root=/tmp/outputs > "$OUT/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" > "$OUT/$name.rc"
}
for p in "${presets[@]}"; do for e in cuda_batched8 cuda_cell4; do build "$p" "$e" & done; done
wait

status=0
printf "| preset | layout | exit | s | validation |\n|---|---|---|---|---|\n" | tee "$OUT/summary.md"
for p in "${presets[@]}"; do for e in cuda_batched8 cuda_cell4; do
  read -r rc seconds < "$OUT/$p.$e.rc"
  [ "$rc" -eq 0 ] || status=1
  line=$(grep -E "validation: |^error" "$OUT/$p.$e.log" | tail -1)
  printf "| %s | %s | %s | %s | %s |\n" "$p" "$e" "$rc" "$seconds" "$line" | tee -a "$OUT/summary.md"
done; done
exit $status

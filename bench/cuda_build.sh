#!/usr/bin/env bash
# One device call on a CUDA GPU: build and validate the CUDA artifacts (batched-sequence and cell),
# the experiments side by side, collecting logs, manifests, validation reports and build records under $OUT.
#   bash bench/cuda_build.sh [experiment ...]     (default: cuda_batched8 cuda_cell4)
# Needs the carried wheels in .whl/ (executorch 1.5.1, hydra-core, omegaconf, antlr4, hydra-joblib-launcher
# and joblib: the config names the sweep launcher, filelock: the stage cache, ...): README "GPU".
set -uo pipefail
OUT=${OUT:-/tmp/cuda_build_out}; mkdir -p "$OUT"
. bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
experiments=("$@"); [ ${#experiments[@]} -gt 0 ] || experiments=(cuda_batched8 cuda_cell4)

build() {  # one experiment; its exit code and time in $OUT/$1.rc
  local exp=$1 start; start=$(date +%s)
  python3 -m pipeline experiment="$exp" output_root=/tmp/outputs > "$OUT/$exp.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" > "$OUT/$exp.rc"
}
for exp in "${experiments[@]}"; do build "$exp" & done
wait

status=0
for exp in "${experiments[@]}"; do
  read -r rc seconds < "$OUT/$exp.rc"
  [ "$rc" -eq 0 ] || status=1
  echo "== $exp: exit $rc, $seconds s"
  grep -vE "Warning|warn|cpuinfo|copyreg|return cls|W11|W12|AUTOTUNE|triton_mm|strides:|dtypes:|Autotune|best_kernel|^\s*$" "$OUT/$exp.log" | tail -25
  version=$(ls -d /tmp/outputs/"$exp"/v* 2>/dev/null | tail -1)
  [ -n "$version" ] || version=$(ls -d /tmp/outputs/"$exp"/.failed/* 2>/dev/null | tail -1)
  [ -n "$version" ] && ls -la "$version" >> "$OUT/$exp.log"
  for f in manifest.json validation.json build.json; do
    [ -n "$version" ] && [ -f "$version/$f" ] && cp "$version/$f" "$OUT/$exp.$f"
  done
done
exit $status

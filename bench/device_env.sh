# Sourced by the device-call scripts (bench/cuda_build.sh, bench/gpu_suite.sh): installs the wheels
# carried in .whl/ (ignored by git; README "CUDA") into /tmp/site and puts them and the repository on
# PYTHONPATH. SKIP_WHEELS=1: they are already there (an earlier call on the same machine).
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md) on a machine with one NVIDIA GPU, against the packages of
# $PYTHON (default python3; `make test-gpu` passes .venv's after `make setup-gpu`):
#   bash tools/gpu_check.sh REPORT_DIR [--stages preflight,install,kernels,...] [--batches ...]
# Works in $GPU_CHECK_DIR (default /tmp/gpu_check; the tree is never written to) and writes the
# report files (gpu_check.json, gpu_check.md, logs) to REPORT_DIR after every stage. No make needed.
# The maintainers' offline path (tools/README.md) sets WHEELS (a folder of wheels to install, with
# pip kept off the network) and GPU_CHECK_BUDGET_S (seconds for the whole command).
set -uo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: bash tools/gpu_check.sh REPORT_DIR [--stages ...] [--batches ...]" >&2
  exit 2
fi
mkdir -p "$1" && REPORT=$(cd "$1" && pwd) && shift || exit 2
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/gpu_check}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
[ -n "${WHEELS:-}" ] && export PIP_NO_INDEX=1
# CMake's check_language(CUDA) looks on PATH and $CUDA_PATH/bin only, not /usr/local/cuda/bin.
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
if [ -z "${CUDACXX:-}" ] && command -v nvcc >/dev/null; then
  export CUDACXX=$(command -v nvcc)
fi
exec > >(tee "$WORK/console.log") 2>&1
echo "gpu_check: $(date -u +%FT%TZ) work=$WORK report=$REPORT python=$("$PYTHON" -c 'import sys; print(sys.executable)') CUDACXX=${CUDACXX:-none}"
"$PYTHON" tools/gpu_check.py check --work "$WORK" --report "$REPORT" \
  ${WHEELS:+--wheels "$WHEELS"} \
  ${GPU_CHECK_BUDGET_S:+--budget $((GPU_CHECK_BUDGET_S - SECONDS))} "$@"
code=$?
sleep 0.2  # let tee write the last lines
exit $code

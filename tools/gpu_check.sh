#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md) on a machine with one GPU; no network needed:
#   bash tools/gpu_check.sh REPORT_DIR [--stages preflight,install,kernels,...] [--batches ...]
# Works in $GPU_CHECK_DIR (default /tmp/gpu_check; the tree may be read-only and is never
# written to), installs wheels/ and builds this package there, then runs every stage of
# tools/gpu_check.py within GPU_CHECK_BUDGET_S seconds (default 420) counted from this script's
# start. The report files (gpu_check.json, gpu_check.md, logs) are written to REPORT_DIR after
# every stage. No make needed.
set -uo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: bash tools/gpu_check.sh REPORT_DIR [--stages ...] [--batches ...]" >&2
  exit 2
fi
mkdir -p "$1" && REPORT=$(cd "$1" && pwd) && shift || exit 2
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
# CMake's check_language(CUDA) looks on PATH and $CUDA_PATH/bin only, not /usr/local/cuda/bin.
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
if [ -z "${CUDACXX:-}" ] && command -v nvcc >/dev/null; then
  export CUDACXX=$(command -v nvcc)
fi
exec > >(tee "$WORK/console.log") 2>&1
echo "gpu_check: $(date -u +%FT%TZ) work=$WORK report=$REPORT python=$("$PYTHON" -c 'import sys; print(sys.executable)') CUDACXX=${CUDACXX:-none}"
"$PYTHON" tools/gpu_check.py check --work "$WORK" --report "$REPORT" --budget $((BUDGET - SECONDS)) \
  ${WHEELS:+--wheels "$WHEELS"} "$@"
code=$?
sleep 0.2  # let tee write the last lines
exit $code

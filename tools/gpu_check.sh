#!/usr/bin/env bash
# On the lent GPU machine (no network): install the wheels of WHEELS (default wheels/, made by
# `make gpu-wheels`) into OUT/site with --no-deps --no-index (the machine's torch is never
# touched), build this package there with nvcc, then run the kernel suite, the kernel benchmark
# and 3 trainer steps. Writes OUT/gpu_check.json and OUT/gpu_check.md (OUT default gpu_check/).
# PYTHON picks the interpreter (default python3); extra arguments go to `gpu_check.py run`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-gpu_check}
"$PYTHON" tools/gpu_check.py install --wheels "$WHEELS" --out "$OUT"
exec "$PYTHON" tools/gpu_check.py run --out "$OUT" "$@"

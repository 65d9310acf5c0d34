#!/usr/bin/env bash
# On a machine with PyPI: the wheels a lent GPU machine needs for `make test-gpu` (what it lacks
# beside torch, triton, transformers, accelerate and pytest), for CPython 3.12 manylinux x86_64,
# plus this package's sdist, into DEST (default wheels/). Prints every file's size and fails if
# the total is over 64 MiB. The list and its reasons: WHEELS in tools/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python tools/gpu_check.py wheels --dest "${1:-wheels}"

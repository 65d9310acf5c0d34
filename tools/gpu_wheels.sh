#!/usr/bin/env bash
# On a machine with PyPI: the wheels a lent GPU machine lacks for tools/gpu_check.sh (WHEELS in
# tools/gpu_check.py: only what KINDS.md's image does not have), for CPython 3.12 manylinux
# x86_64, into DEST (default wheels/, ignored by git: the device call carries it). Prints each
# file's size and what a call would send; fails if a size strays from the recorded one or the
# call would be over the travel budget.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python tools/gpu_check.py wheels --dest "${1:-wheels}"

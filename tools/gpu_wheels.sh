#!/usr/bin/env bash
# On a machine with PyPI: the wheels a single-GPU machine with no network lacks for tools/gpu_check.sh (WHEELS in
# tools/gpu_check.py: only what its image does not have), for CPython 3.12 manylinux
# x86_64, into DEST (default wheels/, ignored by git, copied to the machine with the tree). Prints each
# file's size and the size of the whole copy; fails if a size strays from the recorded one or the
# copy would be over its budget.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python tools/gpu_check.py wheels --dest "${1:-wheels}"

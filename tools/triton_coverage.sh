#!/usr/bin/env bash
# Line coverage of the Triton kernel modules while the interpreter runs them.
# Kernels run as Python under TRITON_INTERPRET=1, so coverage.py sees every executed line of the
# @triton.jit functions too. Extra arguments go to pytest, e.g.
#   tools/triton_coverage.sh tests/test_backends.py -k triton
# (default: the triton cases of tests/test_backends.py and tests/test_triton_aot.py, whose
# launch-shape test runs the wrappers' GPU branches).
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
if [ "$#" -eq 0 ]; then
  set -- tests/test_backends.py tests/test_triton_aot.py -k triton
fi
data_file="$(mktemp -d)/triton.coverage"
python -m coverage run --data-file="$data_file" --include='lze_kernels/triton_kernels/*' \
  -m pytest -q "$@"
python -m coverage report --data-file="$data_file" --show-missing

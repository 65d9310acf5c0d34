#!/usr/bin/env bash
# The Triton tests under the newest Triton release as well as under the venv's pinned one
# (requirements/constraints-*.txt pin 3.7.1, what torch 2.13's CUDA build requires).
#
# Installs triton==$TRITON_LATEST without dependencies into .venv-triton-latest/ (once: kept while
# it holds that version) and runs every Triton test with that directory first on PYTHONPATH: the
# interpreter backend tests, the wrappers' input checks and launch shapes, and the ahead-of-time
# sm_80/sm_90 compiles (their subprocess inherits PYTHONPATH). tests/conftest.py fails the run
# unless the imported triton is $TRITON_LATEST. Extra arguments go to pytest.
# Usage (from anywhere): bash tools/test_triton_latest.sh [-x ...]
set -euo pipefail
cd "$(dirname "$0")/.."

TRITON_LATEST=3.9.0
target=.venv-triton-latest

installed="$(PYTHONPATH="$target" python -c \
  'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || true)"
if [ "$installed" != "$TRITON_LATEST" ]; then
  rm -rf "$target"
  python -m pip install --disable-pip-version-check -q --no-compile --no-deps --target "$target" \
    "triton==$TRITON_LATEST"
fi

export PYTHONPATH="$PWD/$target${PYTHONPATH:+:$PYTHONPATH}"
export LZE_EXPECT_TRITON="$TRITON_LATEST"
python -m pytest -q tests/test_backends.py tests/test_selector.py tests/test_triton_aot.py \
  -k triton "$@"

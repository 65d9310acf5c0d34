#!/usr/bin/env bash
# Line coverage (gcov) of the CUDA kernel sources and the emulator, in fiber mode: builds the
# package's _lze_cuda_emu module with --coverage (CMake, separate build directory), runs the
# cuda_emulated cases of tests/test_backends.py against it (LZE_EXTENSION_DIR), then the
# emulator's own driver (csrc/emu/tsan_driver.cpp, fiber mode), and prints a per-file summary.
# Annotated sources (*.gcov, '#####' = never run) stay in the build directory.
#   usage: tools/emu_gcov.sh [build_dir]        (default: build-emu-gcov)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/build-emu-gcov}" && cd "${1:-$root/build-emu-gcov}" && pwd)"
find "$out" -name '*.gcda' -delete
rm -f "$out"/*.gcov

cmake -S "$root" -B "$out/cmake" -DCMAKE_BUILD_TYPE=Debug -DLZE_BUILD_CUDA=OFF \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$out/modules" -DPython_EXECUTABLE="$(command -v python)" \
  -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" "-DLZE_EMU_EXTRA_FLAGS=--coverage;-O0" \
  >/dev/null
cmake --build "$out/cmake" --target _lze_cuda_emu -j "$(nproc)" >/dev/null
LZE_EXTENSION_DIR="$out/modules" python -m pytest -q -p no:cacheprovider \
  "$root/tests/test_backends.py" -k cuda_emulated

printf '#include "emu/emu_kernels.cpp"\n#include "emu/tsan_driver.cpp"\n' >"$out/driver.cpp"
g++ -std=c++20 -pthread -O0 -g --coverage -ffp-contract=off -DLZE_CUDA_EMULATION \
  -I"$root/csrc" "$out/driver.cpp" -o "$out/driver"
(cd "$out" && ./driver)

report() {  # gcov of the objects in one directory; keep our kernel sources and the emulator
  (cd "$1" && gcov --preserve-paths "$2"/*.gcda 2>/dev/null |
    grep -A1 -E "^File '.*(lze_select\.cu|lze_step\.cu|lze_topk\.cu|cuda_emu\.h|emu_[a-z]+\.h)'" | grep -v -- '--')
}
echo "== cuda_emulated cases of tests/test_backends.py"
report "$out" "$(dirname "$(find "$out/cmake" -name 'emu_kernels.cpp.gcda' | head -1)")"
echo "== csrc/emu/tsan_driver.cpp (fiber mode)"
report "$out" "$out"
echo "annotated sources: $out/*.gcov"

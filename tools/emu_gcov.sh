#!/usr/bin/env bash
# Line coverage (gcov) of the CUDA kernel sources and the emulator, in fiber mode, while the
# emulated-kernel tests of tests/test_cuda_sources.py and csrc/emu/tsan_driver.cpp run them.
# (OS-thread mode is exercised by tools/emu_tsan.sh.) Prints a per-file summary and leaves the
# annotated sources (*.gcov) in the build directory.
#   usage: tools/emu_gcov.sh [build_dir]        (default: build-emu-gcov)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/build-emu-gcov}" && cd "${1:-$root/build-emu-gcov}" && pwd)"
rm -f "$out"/*.gcda "$out"/*.gcov "$out"/pytest/*.gcda "$out"/pytest/*.gcov
flags=(-std=c++20 -pthread -O0 -g --coverage -ffp-contract=off -DLZE_CUDA_EMULATION -I"$root/csrc")

# The tests build their ctypes library (one object) in $out/pytest with coverage flags.
LZE_EMU_BUILD_DIR="$out/pytest" LZE_EMU_CXXFLAGS="-O0 --coverage" \
  python -m pytest -q "$root/tests/test_cuda_sources.py" -k emulated
# The driver (kernels and the emulator's own intrinsics check) as one translation unit, so
# that all its emulator counters land in one object.
printf '#include "emu/emu_kernels.cpp"\n#include "emu/tsan_driver.cpp"\n' >"$out/driver.cpp"
g++ "${flags[@]}" "$out/driver.cpp" -o "$out/driver"
"$out/driver"

report() {  # gcov of one object's data, run in its directory; keep our sources only
  cd "$1"
  gcov --preserve-paths "$2" 2>/dev/null |
    grep -A1 -E "^File '.*(lze_step\.cu|lze_topk\.cu|cuda_emu\.h)'" | grep -v -- '--'
  find . -maxdepth 1 -name '*.gcov' ! -name '*csrc#*' -delete  # system headers
}
echo "== pytest emulated tests (tests/test_cuda_sources.py)"
report "$out/pytest" "$(cd "$out/pytest" && ls *.gcda | head -1)"
echo "== tsan_driver.cpp in fiber mode"
report "$out" driver.gcda
echo "annotated sources ('#####': never run): $out/pytest/*.gcov, $out/*.gcov"

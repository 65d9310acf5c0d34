#!/usr/bin/env bash
# Runs the CUDA kernel sources on the CPU emulator with one OS thread per CUDA thread under
# ThreadSanitizer (csrc/emu/tsan_driver.cpp checks the results too). Exits non-zero on a race
# report or a failed check.
#   usage: tools/emu_tsan.sh [build_dir]        (default: build-emu-tsan)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build-emu-tsan}"
mkdir -p "$out"
# -Wno-tsan: TSan does not model atomic_thread_fence (__threadfence); it then sees fewer
# happens-before edges, so it can only report more races, never hide one.
# LZE_EMU_SMALL_PLANS: the selection's plans with 256-thread blocks and limits that a few
# thousand rows cross (csrc/cuda/selection_plan.h), as every CUDA thread is an OS thread here.
g++ -std=c++20 -pthread -O1 -g -fno-omit-frame-pointer -fsanitize=thread -ffp-contract=off \
    -Wall -Wextra -Werror -Wno-tsan -DLZE_CUDA_EMULATION -DLZE_EMU_OS_THREADS \
    -DLZE_EMU_SMALL_PLANS -I"$root/csrc" \
    "$root/csrc/emu/tsan_driver.cpp" "$root/csrc/emu/emu_kernels.cpp" -o "$out/tsan_driver"
# halt_on_error: the first race fails the run; exitcode makes a report fail it even if the
# driver's own checks pass.
TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}" "$out/tsan_driver"

// The CUDA kernel sources, built with g++ against the CPU emulator (cuda_emu.h, through
// cuda_compat.h). Compile with -std=c++20 -pthread -ffp-contract=off -DLZE_CUDA_EMULATION, and
// add -DLZE_EMU_OS_THREADS for the one-OS-thread-per-CUDA-thread mode used under TSan. Exports
// the same C ABI as the nvcc build (csrc/cuda/lze_cuda.h); the emulator's controls and counts are
// bound by csrc/emu/emu_bindings.h.
#ifndef LZE_CUDA_EMULATION
#error "emu_kernels.cpp: build with -DLZE_CUDA_EMULATION"
#endif

#define LZE_EMU_DEFINE_FIBER_SWITCH  // emu_block.h: the fibers' context switch, once
#include "../cuda/lze_select.cu"
#include "../cuda/lze_step.cu"
#include "../cuda/lze_topk.cu"

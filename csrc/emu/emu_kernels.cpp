// The CUDA kernel sources, built with g++ against the CPU emulator (cuda_emu.h, through
// cuda_compat.h). Compile with -std=c++20 -pthread -ffp-contract=off -DLZE_CUDA_EMULATION, and
// add -DLZE_EMU_OS_THREADS for the one-OS-thread-per-CUDA-thread mode used under TSan. Exports
// the same C ABI as the nvcc build (csrc/cuda/lze_cuda.h).
#ifndef LZE_CUDA_EMULATION
#error "emu_kernels.cpp: build with -DLZE_CUDA_EMULATION"
#endif

#include "../cuda/lze_step.cu"
#include "../cuda/lze_topk.cu"

// The emulator's count of per-row reads (LZE_COUNT_ROW_READS), for the work-count tests.
extern "C" uint64_t lze_emu_take_row_reads() { return emu::take_row_reads(); }

// The CUDA kernel sources, built with g++ against the CPU emulator (cuda_emu.h, through
// cuda_compat.h). Compile with -std=c++20 -pthread -ffp-contract=off -DLZE_CUDA_EMULATION, and
// add -DLZE_EMU_OS_THREADS for the one-OS-thread-per-CUDA-thread mode used under TSan. Exports
// the same C ABI as the nvcc build (csrc/cuda/lze_cuda.h).
#ifndef LZE_CUDA_EMULATION
#error "emu_kernels.cpp: build with -DLZE_CUDA_EMULATION"
#endif

#include "../cuda/lze_select.cu"
#include "../cuda/lze_step.cu"
#include "../cuda/lze_topk.cu"

// The emulator's counts, for the work-count tests: reads of per-row input
// (LZE_COUNT_ROW_READS), kernel launches, and state accesses with their distinct 32-byte sectors
// (LZE_NOTE_STATE_ACCESS); each call returns the count since the last one.
extern "C" uint64_t lze_emu_take_row_reads() { return emu::take_row_reads(); }
extern "C" uint64_t lze_emu_take_launches() { return emu::take_launches(); }
extern "C" void lze_emu_take_state_sectors(uint64_t* accesses, uint64_t* sectors) {
  const auto counts = emu::take_state_sectors();
  *accesses = counts.first;
  *sectors = counts.second;
}

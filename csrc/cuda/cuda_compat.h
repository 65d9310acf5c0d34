// The one compatibility header of the CUDA kernel sources. Under nvcc it is the CUDA runtime;
// under g++ (with -DLZE_CUDA_EMULATION, -std=c++20 -pthread) it is the CPU emulator
// csrc/emu/cuda_emu.h, which runs the same sources on CPU threads for the tests.
//
// Rules for kernel sources, so that both builds work and agree:
//  1. Launch through LZE_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...), never
//     with <<<...>>>.
//  2. Declare dynamic shared memory with LZE_DYNAMIC_SHARED(type, name) at the top of the
//     kernel (`extern __shared__` cannot be emulated), and static shared variables, in kernels
//     and __device__ functions, with LZE_SHARED(type, name) (the emulator places them in the
//     running block's shared memory, poisoned). After each kernel, LZE_KERNEL_RESOURCES(kernel,
//     max_threads, static_shared_bytes) declares its __launch_bounds__ and the static shared
//     memory ptxas -v reports for it (tests/test_cuda_sources.py checks the figure): the
//     emulator's driver checks launches and cudaFuncSetAttribute against them.
//  3. Only the _sync warp intrinsics, with the mask of the lanes that really call them; no
//     implicit warp-synchronous code (lanes exchanging data through shared memory need
//     __syncwarp or __syncthreads in between).
//  4. No spin-waits inside a block: emulated threads of a block are fibers that switch only at
//     barriers and warp intrinsics, so a thread spinning on another thread's flag never yields.
//     Between blocks, wait only on a block that took an earlier ticket from an atomic counter
//     (decoupled look-back): it has started, so it finishes, whether blocks run concurrently
//     (a GPU, the emulator's workers) or one after another (one worker, OS-thread mode). Spin
//     on atomics, not on plain loads. Otherwise use last-block-done with an atomic counter.
//  5. Device code uses the C math functions (sqrtf, logf, fmaxf, ...) and the atomics and bit
//     intrinsics cuda_emu.h provides, not CUDA-only ones (min/max overloads, __fdividef, ...).
//  6. Launches are asynchronous under CUDA and, when a test asks, in the emulator too (its worker
//     and held modes): launchers report cudaGetLastError() right after the launch, make every
//     check and opt-in before the first launch of a call, and never rely on either behaviour.
//  8. Vector accesses (float4, int4) go through LZE_LOAD_VECTOR(pointer) and
//     LZE_STORE_VECTOR(pointer, value): the emulator traps a misaligned one as the hardware does
//     (cudaErrorMisalignedAddress, sticky) instead of crashing the process.
//  7. LZE_COUNT_ROW_READS(n) marks n reads of per-row input (an energy, a score): a no-op under
//     nvcc, a process-wide count in the emulator, which the tests read to check that a kernel's
//     work grows linearly with the batch (lze_kernels._lze_cuda_emu.row_reads()).
//     LZE_NOTE_STATE_ACCESS(pointer, bytes) marks an access to the per-prompt state: a no-op
//     under nvcc, a count of accesses and of the distinct 32-byte sectors touched in the
//     emulator (lze_kernels._lze_cuda_emu.state_sectors()).
#pragma once

#ifdef __CUDACC__

#include <cuda_runtime.h>

template <typename T>
using lze_shared_type = T;  // so that LZE_SHARED(uint32_t[256], name) declares an array

#define LZE_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>
#define LZE_DYNAMIC_SHARED(type, name)                                   \
  extern __shared__ __align__(16) unsigned char lze_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(lze_dynamic_shared_)
#define LZE_SHARED(type, name) __shared__ lze_shared_type<type> name
#define LZE_KERNEL_RESOURCES(kernel, max_threads, static_shared_bytes) static_assert(true, "")
#define LZE_LOAD_VECTOR(pointer) (*(pointer))
#define LZE_STORE_VECTOR(pointer, value) (*(pointer) = (value))
#define LZE_COUNT_ROW_READS(n) ((void)0)
#define LZE_NOTE_STATE_ACCESS(pointer, bytes) ((void)0)

#else

#include "../emu/cuda_emu.h"

#define LZE_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::emu::Launcher((kernel), (grid), (block), (shared_bytes), (stream))
#define LZE_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::emu::dynamic_shared_memory())
#define LZE_SHARED(type, name)                          \
  static constexpr char lze_shared_site_##name = 0;     \
  ::emu::shared_type<type>& name =                      \
      ::emu::static_shared<::emu::shared_type<type>>(&lze_shared_site_##name)
#define LZE_KERNEL_RESOURCES(kernel, max_threads, static_shared_bytes)              \
  [[maybe_unused]] inline const bool lze_kernel_registered_##kernel =                \
      ::emu::register_kernel(&kernel, #kernel, (max_threads), (static_shared_bytes))
#define LZE_LOAD_VECTOR(pointer) ::emu::load_vector(pointer)
#define LZE_STORE_VECTOR(pointer, value) ::emu::store_vector((pointer), (value))
#define LZE_COUNT_ROW_READS(n) ::emu::count_row_reads(n)
#define LZE_NOTE_STATE_ACCESS(pointer, bytes) ::emu::note_state_access((pointer), (bytes))

#endif

// Block-wide scans and reductions, the last-block-done ticket and the candidates' energy extent,
// shared by the step kernel (lze_step.cu) and the top-k kernels (lze_topk.cu). Every function with
// a barrier must be called by every thread of the block. blockDim.x is a multiple of 32.
#pragma once
#include <stdint.h>

#include "cuda_compat.h"
#include "selection_plan.h"

namespace lze::cuda_select {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t value) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const uint32_t other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Exclusive prefix sum of one value per thread, in thread order; `total` gets the block's sum.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t value, uint32_t& total) {
  LZE_SHARED(uint32_t[kWarpSize], warp_sums);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const uint32_t inclusive = warp_inclusive_scan(value);
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t scanned = warp_inclusive_scan(lane < warps ? warp_sums[lane] : 0u);
    if (lane < warps) warp_sums[lane] = scanned;  // inclusive over the warps
  }
  __syncthreads();
  const uint32_t before = (warp == 0 ? 0u : warp_sums[warp - 1]) + inclusive - value;
  total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next scan
  return before;
}

__device__ __forceinline__ uint32_t block_sum(uint32_t value) {
  uint32_t total;
  block_exclusive_scan(value, total);
  return total;
}

__device__ __forceinline__ Extent merge_extents(Extent a, Extent b) {
  return {fmaxf(a.high, b.high), fminf(a.low, b.low)};
}

// The block's extent, in every thread.
__device__ __forceinline__ Extent block_extent(Extent e) {
  LZE_SHARED(Extent[kWarpSize], warp_extents);
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    e.high = fmaxf(e.high, __shfl_xor_sync(kFullMask, e.high, offset));
    e.low = fminf(e.low, __shfl_xor_sync(kFullMask, e.low, offset));
  }
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warp_extents[threadIdx.x / kWarpSize] = e;
  __syncthreads();
  Extent total = warp_extents[0];
  for (int w = 1; w < warps; ++w) total = merge_extents(total, warp_extents[w]);
  __syncthreads();
  return total;
}

__device__ __forceinline__ Extent no_extent() { return {-INFINITY, INFINITY}; }

// A candidate's energy (> 0) widens the extent; others leave it.
__device__ __forceinline__ Extent with_energy(Extent e, float energy) {
  if (!(energy > 0.0f)) return e;
  return {fmaxf(e.high, energy), fminf(e.low, energy)};
}

// Last-block-done (the threadFenceReduction pattern): true, in every thread, of the block that
// takes the last ticket of `counter`; every other block's writes before its ticket are then
// visible to it (read them past the L1 cache: volatile, or atomics). Nothing waits.
template <typename Counter>
__device__ __forceinline__ bool is_last_block(Counter* counter) {
  LZE_SHARED(bool, last);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, Counter{1}) == static_cast<Counter>(gridDim.x - 1);
  __syncthreads();
  const bool result = last;
  if (result) __threadfence();
  __syncthreads();  // `last` is read before any later write to it
  return result;
}

// The extent of per-block extents [0, blocks), written by other blocks before their tickets, in
// every thread of the last block.
__device__ __forceinline__ Extent reduce_block_extents(const Extent* block_extents, int64_t blocks) {
  const volatile float* words = reinterpret_cast<const volatile float*>(block_extents);
  Extent e = no_extent();
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) {
    e = merge_extents(e, Extent{words[2 * b], words[2 * b + 1]});
  }
  return block_extent(e);
}

}  // namespace lze::cuda_select

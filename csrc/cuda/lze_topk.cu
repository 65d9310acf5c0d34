// Top-k selection of rows by energy (docs/spec.md §4) in one launch, identical to
// lze_kernels/reference.topk_select(energy, k, noise_scale, seed, step=step_counter[0]).
//
// Candidates are rows with energy > 0. Each candidate gets a 64-bit key (lze::selection_key of
// its score lze::noisy_score, Gumbel noise keyed by (seed, step_counter[0], row)); keys are
// distinct and order rows by descending score, ties to the smaller row. Non-candidates get key
// 0, below every candidate key. The rank of a candidate is the number of keys larger than its
// own, so the kept rows are the candidates of rank < k and kept_indices[rank] = row.
//
// Launch math: blocks of 128 threads, one row per thread, ceil(B / 128) blocks (one block for
// B <= 128). Every block first reduces all B energies (candidate count, and max / min for the
// Gumbel scale when noise_scale > 0), then streams all B keys through a 128-key shared-memory
// tile (dynamic shared memory, 1 KiB); each thread counts the tile keys above its own. Keys
// are recomputed per block, which is cheap next to the comparisons.
//
// Why rank by counting rather than a radix select: it is one launch with no grid-wide sync and
// no scratch memory, yields the descending order for free (the rank is the output slot), and
// does O(B^2) comparisons spread over B threads, i.e. O(B^2 / P) time, streaming shared memory
// by broadcast. For the batch sizes of a training step (B up to ~16K groups) that is a few tens
// of microseconds; a radix select would need several passes with grid-wide histograms (extra
// launches or a cooperative grid) plus a separate ordering step for kept_indices.
//
// Block 0 also writes num_kept[0] = min(k, #candidates) and pads kept_indices[#candidates, k)
// with -1; the other slots are written by the blocks owning the kept rows.
#include <stdint.h>

#include "cuda_compat.h"
#include "lze_cuda.h"

namespace lze::cuda_topk {

constexpr int kThreadsPerBlock = 128;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;

struct TopkArgs {
  const float* energy;
  int64_t B;
  int64_t k;
  float noise_scale;
  uint32_t seed;
  const int64_t* step_counter;
  uint8_t* keep_mask;
  int64_t* kept_indices;
  int64_t* num_kept;
};

struct Sum {
  __device__ long long operator()(long long x, long long y) const { return x + y; }
};
struct Max {
  __device__ float operator()(float x, float y) const { return fmaxf(x, y); }
};
struct Min {
  __device__ float operator()(float x, float y) const { return fminf(x, y); }
};

// Reduction over the block (kThreadsPerBlock threads): butterflies inside each warp, then every
// thread combines the per-warp partials from shared memory. All threads get the result.
template <typename T, typename Op>
__device__ T block_reduce(T value, Op op) {
  __shared__ T partials[kWarpsPerBlock];
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  if (threadIdx.x % kWarpSize == 0) partials[threadIdx.x / kWarpSize] = value;
  __syncthreads();
  T total = partials[0];
  for (int w = 1; w < kWarpsPerBlock; ++w) total = op(total, partials[w]);
  __syncthreads();  // the partials are reused by the next reduction
  return total;
}

struct CandidateSummary {
  long long count;
  float max_energy;
  float min_energy;
};

// Number of candidates and the range of their energies, over the whole batch.
__device__ CandidateSummary summarize_candidates(const TopkArgs& a) {
  long long count = 0;
  float high = -INFINITY;
  float low = INFINITY;
  for (int64_t i = threadIdx.x; i < a.B; i += blockDim.x) {
    const float e = a.energy[i];
    if (!(e > 0.0f)) continue;
    count += 1;
    high = fmaxf(high, e);
    low = fminf(low, e);
  }
  return {block_reduce(count, Sum{}), block_reduce(high, Max{}), block_reduce(low, Min{})};
}

__device__ __forceinline__ uint64_t candidate_key(const TopkArgs& a, int64_t row, float scale,
                                                  uint32_t step) {
  const float e = a.energy[row];
  if (!(e > 0.0f)) return 0;
  const float score = noisy_score(e, scale, a.seed, step, static_cast<uint32_t>(row));
  return selection_key(score, row);
}

// Number of keys in the batch larger than `key`, streaming all keys through the shared tile.
__device__ unsigned count_larger_keys(const TopkArgs& a, uint64_t key, float scale,
                                      uint32_t step, uint64_t* tile) {
  unsigned larger = 0;
  for (int64_t base = 0; base < a.B; base += kThreadsPerBlock) {
    const int64_t j = base + threadIdx.x;
    tile[threadIdx.x] = j < a.B ? candidate_key(a, j, scale, step) : 0;
    __syncthreads();
    if (key != 0) {
      for (int t = 0; t < kThreadsPerBlock; ++t) larger += tile[t] > key ? 1u : 0u;
    }
    __syncthreads();
  }
  return larger;
}

__device__ void write_count_and_padding(const TopkArgs& a, long long candidates) {
  const int64_t kept = candidates < a.k ? candidates : a.k;
  for (int64_t i = kept + threadIdx.x; i < a.k; i += blockDim.x) a.kept_indices[i] = -1;
  if (threadIdx.x == 0) *a.num_kept = kept;
}

__global__ void __launch_bounds__(kThreadsPerBlock) lze_topk_kernel(const TopkArgs a) {
  LZE_DYNAMIC_SHARED(uint64_t, tile);
  const uint32_t step = static_cast<uint32_t>(a.step_counter[0]);
  const bool noisy = a.noise_scale > 0.0f;
  float scale = 0.0f;
  if (noisy || blockIdx.x == 0) {  // uniform per block, so the barriers inside are safe
    const CandidateSummary summary = summarize_candidates(a);
    if (noisy) scale = gumbel_scale(a.noise_scale, summary.max_energy, summary.min_energy);
    if (blockIdx.x == 0) write_count_and_padding(a, summary.count);
  }
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  const uint64_t key = row < a.B ? candidate_key(a, row, scale, step) : 0;
  const unsigned rank = count_larger_keys(a, key, scale, step, tile);
  if (row >= a.B) return;
  const bool keep = key != 0 && rank < a.k;
  a.keep_mask[row] = keep ? 1 : 0;
  if (keep) a.kept_indices[rank] = row;
}

}  // namespace lze::cuda_topk

extern "C" int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale,
                             uint32_t seed, const int64_t* step_counter, uint8_t* keep_mask,
                             int64_t* kept_indices, int64_t* num_kept, void* stream) {
  using namespace lze::cuda_topk;
  if (B == 0) return cudaSuccess;
  // Ranks are 32-bit counts and rows 32-bit Philox counters.
  if (B < 0 || B > 0x7fffffff || k < 1 || k > B) return cudaErrorInvalidValue;
  const int64_t blocks = (B + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const TopkArgs args{energy, B, k, noise_scale, seed, step_counter, keep_mask, kept_indices,
                      num_kept};
  LZE_LAUNCH(lze_topk_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock),
             kThreadsPerBlock * sizeof(uint64_t), static_cast<cudaStream_t>(stream))(args);
  return static_cast<int>(cudaGetLastError());
}

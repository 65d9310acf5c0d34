// C++ CPU kernel of the fixed-shape top-k selection (SPEC 4), matching
// lze_kernels/reference.py::topk_select: candidates are rows with energy > 0, scored with
// optional Gumbel noise, ordered by lze::selection_key (unique, so the result is the reference's
// stable descending sort: ties go to the smaller batch position).
#include <algorithm>
#include <functional>
#include <limits>
#include <memory>

#include "cpu/parallel.h"
#include "lze_kernels.h"

namespace {

// Rows scored per batch of Philox draws: the draws stay in L1 between the two loops.
constexpr int64_t kNoiseBlock = 256;

struct CandidateExtent {
  float max_energy;
  float min_energy;
  int64_t count;
};

CandidateExtent candidate_extent(const float* energy, int64_t B) {
  float hi = -std::numeric_limits<float>::infinity();
  float lo = std::numeric_limits<float>::infinity();
  int64_t count = 0;
#pragma omp parallel for simd if (B >= lze_cpu::kParallelMinRows) \
    reduction(max : hi) reduction(min : lo) reduction(+ : count)
  for (int64_t row = 0; row < B; ++row) {
    const float e = energy[row];
    const bool candidate = e > 0.0f;
    hi = std::max(hi, candidate ? e : -std::numeric_limits<float>::infinity());
    lo = std::min(lo, candidate ? e : std::numeric_limits<float>::infinity());
    count += candidate ? 1 : 0;
  }
  return CandidateExtent{hi, lo, count};
}

// First Philox words of rows [first_row, first_row + n). Cloned per ISA: the 32x32->64-bit
// multiplies vectorise well with AVX2/AVX-512, and integer results do not depend on the clone.
__attribute__((target_clones("avx512f", "avx2", "default"))) void philox_draws(
    uint32_t seed, uint32_t step, int64_t first_row, int64_t n, uint32_t* bits) {
  for (int64_t j = 0; j < n; ++j) {
    bits[j] = lze::philox_4x32_10(seed, step, static_cast<uint32_t>(first_row + j));
  }
}

// Selection keys of rows [first_row, first_row + n): 0 for non-candidates (below every
// candidate key). The score is lze::noisy_score with its Philox draw hoisted into
// philox_draws(), since the draws vectorise and logf does not.
void block_keys(const float* energy, float scale, uint32_t seed, uint32_t step,
                int64_t first_row, int64_t n, uint64_t* keys) {
  uint32_t bits[kNoiseBlock];
  if (scale != 0.0f) philox_draws(seed, step, first_row, n, bits);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = first_row + j;
    const float e = energy[row];
    if (!(e > 0.0f)) {
      keys[row] = 0;
      continue;
    }
    const float score =
        scale != 0.0f ? e + scale * lze::standard_gumbel(lze::uniform_from_bits(bits[j])) : e;
    keys[row] = lze::selection_key(score, row);
  }
}

void selection_keys(const float* energy, int64_t B, float scale, uint32_t seed, uint32_t step,
                    uint64_t* keys) {
#pragma omp parallel for schedule(static) if (B >= lze_cpu::kParallelMinRows)
  for (int64_t first_row = 0; first_row < B; first_row += kNoiseBlock) {
    block_keys(energy, scale, seed, step, first_row, std::min(kNoiseBlock, B - first_row), keys);
  }
}

inline int64_t row_of_key(uint64_t key) {
  return static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

}  // namespace

extern "C" int lze_topk_cpu(const float* energy, int64_t B, int64_t k, float noise_scale,
                            uint32_t seed, const int64_t* step_counter, uint8_t* keep_mask,
                            int64_t* kept_indices, int64_t* num_kept) {
  if (k < 1 || k > B) return 1;
  const CandidateExtent extent = candidate_extent(energy, B);
  const int64_t kept = std::min(k, extent.count);
  std::fill_n(keep_mask, B, uint8_t{0});
  std::fill_n(kept_indices + kept, k - kept, int64_t{-1});
  num_kept[0] = kept;
  if (kept == 0) return 0;

  const float scale = noise_scale > 0.0f
                          ? lze::gumbel_scale(noise_scale, extent.max_energy, extent.min_energy)
                          : 0.0f;
  std::unique_ptr<uint64_t[]> keys(new uint64_t[B]);
  selection_keys(energy, B, scale, seed, static_cast<uint32_t>(step_counter[0]), keys.get());
  // kept <= #candidates, so the `kept` largest keys are all candidates.
  std::nth_element(keys.get(), keys.get() + (kept - 1), keys.get() + B, std::greater<>());
  std::sort(keys.get(), keys.get() + kept, std::greater<>());
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t row = row_of_key(keys[j]);
    kept_indices[j] = row;
    keep_mask[row] = 1;
  }
  return 0;
}

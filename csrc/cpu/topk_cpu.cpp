// C++ CPU kernel of the fixed-shape top-k selection (docs/spec.md §4), matching
// lze_kernels/reference.py::topk_select: candidates are rows with energy > 0, scored with
// optional Gumbel noise and ordered by lze::selection_key (unique, so ties go to the smaller
// batch position); kept_indices lists the kept rows in ascending row order.
//
// Selection: a radix select on the top 16 score bits finds the bucket of the k-th best key,
// std::nth_element finds that key among the bucket's, and one pass over the rows keeps every key
// at or above it, in row order. Linear in B.
#include <algorithm>
#include <limits>
#include <vector>

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

// A single streaming pass: too little work per row to share between threads.
CandidateExtent candidate_extent(const float* energy, int64_t B) {
  float hi = -std::numeric_limits<float>::infinity();
  float lo = std::numeric_limits<float>::infinity();
  int64_t count = 0;
#pragma omp simd reduction(max : hi) reduction(min : lo) reduction(+ : count)
  for (int64_t row = 0; row < B; ++row) {
    const float e = energy[row];
    const bool candidate = e > 0.0f;
    hi = std::max(hi, candidate ? e : -std::numeric_limits<float>::infinity());
    lo = std::min(lo, candidate ? e : std::numeric_limits<float>::infinity());
    count += candidate ? 1 : 0;
  }
  return CandidateExtent{hi, lo, count};
}

// Rows per task of the parallel key loop: a few tasks per thread (see cpu/parallel.h).
constexpr int64_t kTaskRows = 4096;

// Standard Gumbel draws of rows [first_row, first_row + n), n <= kNoiseBlock. Cloned per ISA:
// Philox's 32x32->64-bit multiplies and lze::log_nonnegative vectorise well with AVX2/AVX-512,
// and the clones round alike (IEEE +-*/ only, no FMA contraction), so the draws do not depend
// on the clone the CPU picks.
__attribute__((target_clones("avx512f", "avx2", "default"))) void gumbel_draws(
    uint32_t seed, uint32_t step, int64_t first_row, int64_t n, float* draws) {
  uint32_t bits[kNoiseBlock];
  for (int64_t j = 0; j < n; ++j) {
    bits[j] = lze::philox_4x32_10(seed, step, static_cast<uint32_t>(first_row + j));
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) draws[j] = lze::standard_gumbel(lze::uniform_from_bits(bits[j]));
}

// Selection keys of rows [first_row, first_row + n): 0 for non-candidates (below every
// candidate key). The score is lze::noisy_score with its draw hoisted into gumbel_draws(), which
// draws for every row so that its loops stay branch-free (and vectorise).
void block_keys(const float* energy, float scale, uint32_t seed, uint32_t step,
                int64_t first_row, int64_t n, uint64_t* keys) {
  float draws[kNoiseBlock];
  if (scale != 0.0f) gumbel_draws(seed, step, first_row, n, draws);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = first_row + j;
    const float e = energy[row];
    const float score = scale != 0.0f ? lze::score_with_draw(e, scale, draws[j]) : e;
    keys[row] = e > 0.0f ? lze::selection_key(score, row) : 0;
  }
}

void selection_keys(const float* energy, int64_t B, float scale, uint32_t seed, uint32_t step,
                    uint64_t* keys, int threads) {
  const int64_t tasks = threads > 1 ? (B + kTaskRows - 1) / kTaskRows : 1;
  lze_cpu::parallel_tasks(tasks, threads, [&](int64_t task) {
    const lze_cpu::Range rows = lze_cpu::task_range(B, task, tasks, kNoiseBlock);
    for (int64_t first_row = rows.begin; first_row < rows.end; first_row += kNoiseBlock) {
      block_keys(energy, scale, seed, step, first_row,
                 std::min(kNoiseBlock, rows.end - first_row), keys);
    }
  });
}

// Complemented keys of the candidates, in row order.
int64_t gather_candidates(const uint64_t* keys, int64_t B, uint64_t* out) {
  int64_t n = 0;
  for (int64_t row = 0; row < B; ++row) {
    if (keys[row] != 0) out[n++] = ~keys[row];
  }
  return n;
}

// The kept-th smallest of the distinct keys[0, n) (1 <= kept <= n), by a radix select on their
// top 16 bits (sign, exponent and 7 significand bits of the score): a histogram finds the
// kept-th's bucket, and nth_element runs only on that bucket's keys, moved to the front of
// `keys`. 16 bits keep a bucket small; 8 to 11 would be little more than the exponent, which most
// candidates share. The move is branch-free: its condition is a coin flip for the branch
// predictor.
uint64_t kth_smallest(uint64_t* keys, int64_t n, int64_t kept) {
  constexpr int kSelectBits = 16, kShift = 64 - kSelectBits;
  // Kept across calls (256 KiB), all zeros between calls: each call clears the buckets it used,
  // a narrow range (the candidates' scores span few exponents), not the whole table.
  thread_local std::vector<int32_t> histogram(size_t{1} << kSelectBits, 0);
  // Through a local pointer: a thread_local's address is a call in a shared library
  // (__tls_get_addr), which the compiler may not hoist out of a loop that stores through it.
  int32_t* counts = histogram.data();
  uint64_t first = uint64_t{1} << kSelectBits, last = 0;  // the buckets in use
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t bucket = keys[j] >> kShift;
    ++counts[bucket];
    first = std::min(first, bucket);
    last = std::max(last, bucket);
  }
  uint64_t limit = first;  // the kept-th smallest key's bucket
  int64_t below = 0;       // keys in the buckets before `limit`
  while (below + counts[limit] < kept) below += counts[limit++];
  std::fill(counts + first, counts + last + 1, 0);
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t key = keys[j];
    keys[m] = key;
    m += (key >> kShift) == limit;
  }
  const int64_t rank = kept - below;  // among the keys of bucket `limit`, 1-based
  std::nth_element(keys, keys + rank - 1, keys + m);
  return keys[rank - 1];
}

// keep_mask of every row and the kept rows, in row order, into kept_indices: the rows whose key
// is at least `cutoff`. The rows are written to `scratch` (B slots) without a branch, since
// whether a row is kept is a coin flip for the branch predictor, then copied.
void write_kept(const uint64_t* keys, int64_t B, uint64_t cutoff, uint8_t* keep_mask,
                int64_t* kept_indices, int64_t* scratch) {
  int64_t slot = 0;
  for (int64_t row = 0; row < B; ++row) {
    const int64_t keep = keys[row] >= cutoff;
    keep_mask[row] = static_cast<uint8_t>(keep);
    scratch[slot] = row;
    slot += keep;
  }
  std::copy_n(scratch, slot, kept_indices);
}

// The whole selection on up to `threads` threads.
void select_top_k(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                  const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                  int64_t* num_kept, int threads) {
  const CandidateExtent extent = candidate_extent(energy, B);
  const int64_t kept = std::min(k, extent.count);
  std::fill_n(kept_indices + kept, k - kept, int64_t{-1});
  num_kept[0] = kept;
  if (kept == 0) {
    std::fill_n(keep_mask, B, uint8_t{0});
    return;
  }

  const float scale = noise_scale > 0.0f
                          ? lze::gumbel_scale(noise_scale, extent.max_energy, extent.min_energy)
                          : 0.0f;
  // Kept across calls: fresh buffers of this size come from mmap, and their page faults cost
  // as much as the selection.
  thread_local std::vector<uint64_t> keys, spare;
  keys.resize(B);
  spare.resize(B);
  selection_keys(energy, B, scale, seed, static_cast<uint32_t>(step_counter[0]), keys.data(),
                 threads);
  const int64_t n = gather_candidates(keys.data(), B, spare.data());
  // The kept-th largest key: exactly `kept` keys are at or above it (keys are distinct, and a
  // non-candidate's key 0 is below every candidate's).
  const uint64_t cutoff = ~kth_smallest(spare.data(), n, kept);
  write_kept(keys.data(), B, cutoff, keep_mask, kept_indices,
             reinterpret_cast<int64_t*>(spare.data()));
}

}  // namespace

extern "C" int lze_topk_cpu(const float* energy, int64_t B, int64_t k, float noise_scale,
                            uint32_t seed, const int64_t* step_counter, uint8_t* keep_mask,
                            int64_t* kept_indices, int64_t* num_kept,
                            lze::ThreadBudget threads) {
  if (k < 1 || k > B) return 1;
  static lze_cpu::ThreadChoice choice;
  choice.run(threads, B, B, [&](int team) {
    select_top_k(energy, B, k, noise_scale, seed, step_counter, keep_mask, kept_indices,
                 num_kept, team);
  });
  return 0;
}

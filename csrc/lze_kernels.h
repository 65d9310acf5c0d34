// C ABI of the compiled backends. The same two entry points exist for the C++ CPU kernels
// (suffix _cpu) and the CUDA kernels (suffix _cuda, also built with g++ against the CUDA
// emulator for the tests). No torch headers: callers pass raw pointers, sizes and a stream,
// and lze_kernels/native.py wraps them as torch custom ops.
//
// Semantics: docs/spec.md §2-5.
#pragma once
#include <stdint.h>

#include "lze_math.h"

namespace lze {

// How many threads a CPU kernel may use (cpu/parallel.h); it uses fewer for small batches.
struct ThreadBudget {
  int32_t max_threads;  // the most threads, the calling one included
  int32_t adaptive;     // nonzero: each call runs on max_threads or on the caller alone,
                        // whichever has been faster lately (lze_cpu::ThreadChoice)
};

}  // namespace lze

#ifdef __cplusplus
extern "C" {
#endif

// Fused per-step update. For each row i of the batch (B rows, G rollouts):
//  - rewards [B, G] (dtype lze::RewardDType, row-major contiguous), valid [B, G] uint8 or null;
//  - prompt_ids [B] int64 index rows of fstate [N, 4] float32 and istate [N, 4] int32;
//  - writes advantages [B, G] fp32, pass_rate/energy/momentum [B] fp32;
//  - updates the state rows of its prompt, and sets fault bits for rows it had to skip;
//  - advances step_counter[0] by one (step_counter[1] is scratch, 0 between calls).
// Returns 0 on success, or a nonzero launch/runtime error code.
int lze_step_cpu(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                 const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N, float* fstate,
                 int32_t* istate, int64_t* step_counter, float* advantages, float* pass_rate,
                 float* energy, float* momentum, int32_t* fault, lze::Params params,
                 lze::ThreadBudget threads);

// Top-k of rows by energy (docs/spec.md §4). Candidates are rows with energy > 0. With noise_scale > 0
// each candidate's score gets Gumbel noise keyed by (seed, step_counter[0], row).
// Writes keep_mask [B] (uint8 0/1), kept_indices [k] int64 (ascending row order, -1 padded) and
// num_kept [1] int64 = min(k, #candidates). Requires 1 <= k <= B.
int lze_topk_cpu(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                 const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                 int64_t* num_kept, lze::ThreadBudget threads);

// DOTS pass-rate prediction (docs/spec.md §8): out[q] = sum_j softmax_j(scale <queries[q], refs[j]>)
// labels[j] for queries [N, d], refs [K, d], labels [K], out [N] (fp32, row-major), one pass
// with an online softmax. Requires K >= 1 and d >= 1.
int lze_dots_predict_cpu(const float* queries, const float* refs, const float* labels, int64_t N,
                         int64_t K, int64_t d, float scale, float* out,
                         lze::ThreadBudget threads);

#ifdef __cplusplus
}
#endif

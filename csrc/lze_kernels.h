// C ABI of the compiled backends. The same entry points exist for the C++ CPU kernels (suffix
// _cpu) and the CUDA kernels (suffix _cuda, csrc/cuda/lze_cuda.h, also built with g++ against
// the CUDA emulator for the tests). No torch headers: callers pass raw pointers, sizes and a
// stream, and lze_kernels/native.py wraps them.
//
// Semantics: docs/spec.md §2-5. The per-prompt state is one table of 32-byte records,
// records [N + 1, 8] (lze_math.h: four fp32 fields, then four int32 fields); row N is a write
// sink of the torch reference that no kernel touches.
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

// Everything one selection step reads and writes (lze_select_step_*): the fused step over the
// batch, then the top-k of its energies, in one call. Pointers marked "or null" are optional.
struct SelectStep {
  // Inputs: rewards [B, G] (dtype lze::RewardDType, row-major), valid [B, G] uint8 or null,
  // prompt_ids [B] int64; keep the k best (1 <= k <= B).
  const void* rewards;
  const uint8_t* valid;
  const int64_t* prompt_ids;
  int32_t rewards_dtype;
  int64_t B, G, N, k;
  // State: records [N + 1, 8], step_counter [2] (step_counter[1] scratch, 0 between calls),
  // the fault word [1].
  int32_t* records;
  int64_t* step_counter;
  int32_t* fault;
  // A host-visible copy of the fault word, or null: written once the step's faults are in (on
  // a GPU through host-mapped pinned memory, so the host reads it without a copy or a sync).
  int32_t* fault_mirror;
  // [B, 8] or null: the records of clamp(prompt_ids, 0, N) as they were before the step, for
  // the caller to undo the step.
  int32_t* undo;
  // Outputs: advantages [B, G], pass_rate / energy / momentum [B] fp32, keep_mask [B] uint8,
  // kept_indices [k] int64 (ascending rows, -1 padded), num_kept [1] int64.
  float* advantages;
  float* pass_rate;
  float* energy;
  float* momentum;
  uint8_t* keep_mask;
  int64_t* kept_indices;
  int64_t* num_kept;
  // Device scratch of lze_select_step_cuda_workspace_bytes(B, G) bytes (CUDA only), any
  // contents; null elsewhere.
  void* workspace;
  Params params;
  float noise_scale;  // Gumbel exploration noise (docs/spec.md §4), 0 = off
  uint32_t seed;
};

}  // namespace lze

#ifdef __cplusplus
extern "C" {
#endif

// Fused per-step update. For each row i of the batch (B rows, G rollouts):
//  - rewards [B, G] (dtype lze::RewardDType, row-major contiguous), valid [B, G] uint8 or null;
//  - prompt_ids [B] int64 index the records [N + 1, 8] of the state;
//  - writes advantages [B, G] fp32, pass_rate/energy/momentum [B] fp32;
//  - updates the record of its prompt, and sets fault bits for rows it had to skip;
//  - advances step_counter[0] by one (step_counter[1] is scratch, 0 between calls).
// Returns 0 on success, or a nonzero launch/runtime error code.
int lze_step_cpu(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                 const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N, int32_t* records,
                 int64_t* step_counter, float* advantages, float* pass_rate, float* energy,
                 float* momentum, int32_t* fault, lze::Params params, lze::ThreadBudget threads);

// Top-k of rows by energy (docs/spec.md §4). Candidates are rows with energy > 0. With noise_scale > 0
// each candidate's score gets Gumbel noise keyed by (seed, step_counter[0], row).
// Writes keep_mask [B] (uint8 0/1), kept_indices [k] int64 (ascending row order, -1 padded) and
// num_kept [1] int64 = min(k, #candidates). Requires 1 <= k <= B.
int lze_topk_cpu(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                 const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                 int64_t* num_kept, lze::ThreadBudget threads);

// One selection step in one call (lze::SelectStep): checks the sizes, copies the undo records
// when asked, runs the step, writes the fault mirror, runs the top-k. Returns 0, or 1 for a bad
// size or dtype (nothing is written then).
int lze_select_step_cpu(const lze::SelectStep* call, lze::ThreadBudget threads);

// DOTS pass-rate prediction (docs/spec.md §8): out[q] = sum_j softmax_j(scale <queries[q], refs[j]>)
// labels[j] for queries [N, d], refs [K, d], labels [K], out [N] (fp32, row-major), one pass
// with an online softmax. Requires K >= 1 and d >= 1.
int lze_dots_predict_cpu(const float* queries, const float* refs, const float* labels, int64_t N,
                         int64_t K, int64_t d, float scale, float* out,
                         lze::ThreadBudget threads);

#ifdef __cplusplus
}
#endif

namespace lze {

// The sizes a selection step accepts (shared by every backend's lze_select_step_*).
inline bool select_step_sizes_ok(const SelectStep& s) {
  const bool dtype_ok = s.rewards_dtype == kF32 || s.rewards_dtype == kBF16 ||
                        s.rewards_dtype == kF16;
  return dtype_ok && s.B >= 1 && s.G >= 1 && s.N >= 1 && s.k >= 1 && s.k <= s.B &&
         s.B <= 0x7fffffff && s.rewards != nullptr && s.prompt_ids != nullptr &&
         s.records != nullptr && s.step_counter != nullptr && s.fault != nullptr &&
         s.advantages != nullptr && s.pass_rate != nullptr && s.energy != nullptr &&
         s.momentum != nullptr && s.keep_mask != nullptr && s.kept_indices != nullptr &&
         s.num_kept != nullptr;
}

}  // namespace lze

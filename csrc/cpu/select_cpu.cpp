// One selection step of the C++ CPU backend in one call (lze::SelectStep): what
// LZESelector.step runs, so that the host crosses into native code once per step. The step and
// the top-k are the kernels of step_cpu.cpp and topk_cpu.cpp; this file adds the undo copy and
// the fault mirror, the same contract as the CUDA backend's lze_select_step_cuda.
#include <algorithm>
#include <cstring>

#include "lze_kernels.h"

namespace {

// The records of clamp(prompt_ids, 0, N) before the step (a checked step restores them on a
// fault; rows with a bad id read the sink row N, or row 0 for a negative id, as the torch side's
// clamp does).
void copy_undo_records(const lze::SelectStep& s) {
  for (int64_t row = 0; row < s.B; ++row) {
    const int64_t id = std::min(std::max<int64_t>(s.prompt_ids[row], 0), s.N);
    std::memcpy(s.undo + row * lze::kRecordWords, s.records + id * lze::kRecordWords,
                lze::kRecordWords * sizeof(int32_t));
  }
}

}  // namespace

extern "C" int lze_select_step_cpu(const lze::SelectStep* call, lze::ThreadBudget threads) {
  const lze::SelectStep& s = *call;
  if (!lze::select_step_sizes_ok(s)) return 1;
  if (s.undo != nullptr) copy_undo_records(s);
  int status = lze_step_cpu(s.rewards, s.rewards_dtype, s.valid, s.prompt_ids, s.B, s.G, s.N,
                            s.records, s.step_counter, s.advantages, s.pass_rate, s.energy,
                            s.momentum, s.fault, s.params, threads);
  if (status != 0) return status;
  // The step's faults are in (its threads have joined): the host's copy is the word itself.
  if (s.fault_mirror != nullptr) *s.fault_mirror = *s.fault;
  return lze_topk_cpu(s.energy, s.B, s.k, s.noise_scale, s.seed, s.step_counter, s.keep_mask,
                      s.kept_indices, s.num_kept, threads);
}

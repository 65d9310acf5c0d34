// One selection step of the CUDA backend in one call (lze::SelectStep): what LZESelector.step
// runs, so that the host crosses into native code once a step and makes no allocation of its
// own. Launches, in stream order, no host sync:
//  * (a checked step only) undo_kernel: the records of clamp(prompt_ids, 0, N) to `undo`;
//  * the step kernel (lze_step.cu), which also draws the selection's Gumbel noise, reduces the
//    candidates' extent, zeroes the top-k's workspace header and copies the fault word to the
//    host-mapped mirror;
//  * the top-k (lze_topk.cu): one block up to 16,384 rows, three launches above.
// Two launches a step up to 16,384 rows, four above (lze_select_step_cuda_launches).
#include <stdint.h>

#include "cuda_compat.h"
#include "launchers.h"
#include "lze_cuda.h"

namespace lze::cuda_select {

constexpr int kUndoThreads = 256;

// One thread a row: the row's prompt record (clamped into [0, N]) copied as two 16-byte halves.
__global__ void __launch_bounds__(kUndoThreads) undo_kernel(const SelectStep s) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= s.B) return;
  int64_t id = s.prompt_ids[row];
  id = id < 0 ? 0 : (id > s.N ? s.N : id);
  const int4* from = reinterpret_cast<const int4*>(s.records) + 2 * id;
  int4* to = reinterpret_cast<int4*>(s.undo) + 2 * row;
  to[0] = from[0];
  to[1] = from[1];
}

cuda_step::StepArgs step_args(const SelectStep& s, const Workspace& w) {
  const bool noise = s.noise_scale > 0.0f;
  const cuda_step::SelectionPrep prep{noise ? w.draws : nullptr, s.seed,
                                      noise ? w.block_extents : nullptr, w.extent,
                                      w.header, header_words(s.B), s.fault_mirror};
  return {s.rewards,   s.rewards_dtype, s.valid,      s.prompt_ids, s.B,      s.G,
          s.N,         s.records,       s.step_counter, s.advantages, s.pass_rate, s.energy,
          s.momentum,  s.fault,         s.params,     prep};
}

}  // namespace lze::cuda_select

extern "C" int64_t lze_select_step_cuda_workspace_bytes(int64_t B, int64_t G) {
  using namespace lze::cuda_select;
  return workspace_layout(B, step_blocks(B, G)).total;
}

extern "C" int32_t lze_select_step_cuda_launches(int64_t B, int32_t with_undo) {
  return (with_undo ? 1 : 0) + 1 + (lze::cuda_select::one_block(B) ? 1 : 3);
}

extern "C" int lze_select_step_cuda(const lze::SelectStep* call, void* stream_ptr) {
  using namespace lze::cuda_select;
  const lze::SelectStep& s = *call;
  if (!lze::select_step_sizes_ok(s) || s.workspace == nullptr) return 1;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (s.undo != nullptr) {
    const dim3 grid(static_cast<unsigned>((s.B + kUndoThreads - 1) / kUndoThreads));
    LZE_LAUNCH(undo_kernel, grid, dim3(kUndoThreads), 0, stream)(s);
  }
  const int64_t extent_blocks = step_blocks(s.B, s.G);
  const Workspace w = carve(s.workspace, s.B, extent_blocks);
  int status = lze::cuda_step::launch_step(step_args(s, w), stream);
  if (status != 0) return status;
  const lze::cuda_topk::TopkArgs topk{s.energy,       s.B,         s.k,         s.noise_scale,
                                      s.seed,         s.step_counter, s.keep_mask,
                                      s.kept_indices, s.num_kept};
  return lze::cuda_topk::launch_topk(topk, s.workspace, extent_blocks, true, stream);
}

// One selection step of the CUDA backend in one call (lze::SelectStep): what LZESelector.step
// runs, so that the host crosses into native code once a step and makes no allocation of its
// own. Launches, in stream order, no host sync:
//  * (a checked step only) undo_kernel: the records of clamp(prompt_ids, 0, N) to `undo`;
//  * the step kernel (lze_step.cu), which also draws the selection's Gumbel noise, reduces the
//    candidates' extent, zeroes the top-k's workspace header and copies the fault word to the
//    host-mapped mirror;
//  * the top-k (lze_topk.cu): one block up to 16,384 rows; above, a histogram launch a digit
//    (two on sm_80 and sm_90, three on sm_86 and sm_89) and the write.
// Two launches a step up to 16,384 rows, four or five above (lze_select_step_cuda_launches).
// The plan (lze_select_step_cuda_plan) is made before the first step over a batch size, with its
// opt-ins: a step checks its inputs' sizes, the plan and any error still pending on the device
// before it queues anything, so a step that cannot run leaves the state as it was.
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
  LZE_STORE_VECTOR(to, LZE_LOAD_VECTOR(from));
  LZE_STORE_VECTOR(to + 1, LZE_LOAD_VECTOR(from + 1));
}
LZE_KERNEL_RESOURCES(undo_kernel, kUndoThreads, 0);

cuda_step::StepArgs step_args(const SelectStep& s, const TopkPlan& plan, const Workspace& w) {
  const bool noise = s.noise_scale > 0.0f;
  const cuda_step::SelectionPrep prep{noise ? w.draws : nullptr, s.seed,
                                      noise ? w.block_extents : nullptr, w.extent,
                                      w.header, header_words(plan), s.fault_mirror};
  return {s.rewards,   s.rewards_dtype, s.valid,      s.prompt_ids, s.B,      s.G,
          s.N,         s.records,       s.step_counter, s.advantages, s.pass_rate, s.energy,
          s.momentum,  s.fault,         s.params,     prep};
}

}  // namespace lze::cuda_select

extern "C" int lze_select_step_cuda_plan(int64_t B, int32_t device,
                                         lze::cuda_select::TopkPlan* plan) {
  if (B < 1 || B > 0x7fffffff) return cudaErrorInvalidValue;
  return lze::cuda_topk::plan_topk(B, device, plan);
}

extern "C" int64_t lze_select_step_cuda_workspace_bytes(const lze::cuda_select::TopkPlan* plan,
                                                        int64_t G) {
  using namespace lze::cuda_select;
  return workspace_layout(*plan, step_blocks(plan->B, G)).total;
}

extern "C" int32_t lze_select_step_cuda_launches(const lze::cuda_select::TopkPlan* plan,
                                                 int32_t with_undo) {
  return (with_undo ? 1 : 0) + 1 + plan->launches;
}

extern "C" int lze_select_step_cuda(const lze::SelectStep* call,
                                    const lze::cuda_select::TopkPlan* plan, int32_t device,
                                    void* stream_ptr) {
  using namespace lze::cuda_select;
  const lze::SelectStep& s = *call;
  if (!lze::select_step_sizes_ok(s) || s.workspace == nullptr || plan->B != s.B) return 1;
  const lze::cuda::DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  // An error still pending (a sticky fault of an earlier kernel): nothing is queued.
  if (const cudaError_t pending = cudaPeekAtLastError(); pending != cudaSuccess) return pending;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (s.undo != nullptr) {
    const dim3 grid(static_cast<unsigned>((s.B + kUndoThreads - 1) / kUndoThreads));
    LZE_LAUNCH(undo_kernel, grid, dim3(kUndoThreads), 0, stream)(s);
  }
  const int64_t extent_blocks = step_blocks(s.B, s.G);
  const Workspace w = carve(s.workspace, *plan, extent_blocks);
  int status = lze::cuda_step::launch_step(step_args(s, *plan, w), stream);
  if (status != 0) return status;
  const lze::cuda_topk::TopkArgs topk{s.energy,       s.B,         s.k,         s.noise_scale,
                                      s.seed,         s.step_counter, s.keep_mask,
                                      s.kept_indices, s.num_kept};
  return lze::cuda_topk::launch_topk(topk, *plan, s.workspace, extent_blocks, true, stream);
}

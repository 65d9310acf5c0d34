// The kernels' argument blocks and host-side launchers, shared by the C entry points of
// lze_step.cu and lze_topk.cu and by the selection step (lze_select.cu), which launches both.
#pragma once
#include <stdint.h>

#include "../lze_math.h"
#include "cuda_compat.h"
#include "lze_cuda.h"
#include "selection_plan.h"

namespace lze::cuda {

constexpr int kNoPlan = LZE_CUDA_NO_PLAN;  // lze_cuda.h

// Sets the current device for the scope of a call (the tensors' device, which need not be the
// current one: a launch on another device's stream fails, and kernel attributes are per device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != device) error_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_;
};

}  // namespace lze::cuda

namespace lze::cuda_step {

// What a selection step's kernel prepares for the top-k (all null outside a selection step).
struct SelectionPrep {
  float* draws;                        // [B] standard Gumbel draws, or null (no noise)
  uint32_t seed;
  cuda_select::Extent* block_extents;  // [gridDim.x], or null (no noise: no extent needed)
  cuda_select::Extent* extent;         // the blocks' extent, written by the last block
  uint32_t* zero_words;                // the top-k workspace header, zeroed here (or null)
  int64_t zero_count;
  int32_t* fault_mirror;               // the host's copy of the fault word, or null
};

struct StepArgs {
  const void* rewards;
  int32_t rewards_dtype;
  const uint8_t* valid;
  const int64_t* prompt_ids;
  int64_t B, G, N;
  int32_t* records;  // [N + 1, 8]
  int64_t* step_counter;
  float* advantages;
  float* pass_rate;
  float* energy;
  float* momentum;
  int32_t* fault;
  Params params;
  SelectionPrep prep;
};

// The step kernel for B >= 0 rows (cuda_select::step_blocks(B, G) blocks).
int launch_step(const StepArgs& args, cudaStream_t stream);

}  // namespace lze::cuda_step

namespace lze::cuda_topk {

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

// The selection's launches after its inputs are ready, by plan `p` (plan_topk, made on the
// current device). `prepared`: the draws, the extent and the zeroed header are in the workspace
// (a selection step's step kernel made them); otherwise the one-block kernel computes them
// itself, and the large plan first runs prepare_kernel. Returns the first launch error.
int launch_topk(const TopkArgs& a, const cuda_select::TopkPlan& p, void* workspace,
                int64_t extent_blocks, bool prepared, cudaStream_t stream);

// The plan of a top-k over B rows on `device`, every opt-in made; cuda::kNoPlan when none fits.
int plan_topk(int64_t B, int device, cuda_select::TopkPlan* plan);

}  // namespace lze::cuda_topk

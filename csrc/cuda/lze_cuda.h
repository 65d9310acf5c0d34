// C ABI of the CUDA kernels: the same contract as csrc/lze_kernels.h, plus the stream the
// kernels are launched on (a cudaStream_t passed as void* so this header needs no CUDA headers).
#pragma once
#include <stdint.h>

#include "../lze_kernels.h"
#include "selection_plan.h"

// The status of a call whose batch no launch plan fits on the device.
#define LZE_CUDA_NO_PLAN 10001

#ifdef __cplusplus
extern "C" {
#endif

// Every entry point takes the device of its pointers (`device`): the call runs with it as the
// current device (a launch on another device's stream fails; kernel attributes are per device)
// and restores the caller's.
int lze_step_cuda(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                  const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N, int32_t* records,
                  int64_t* step_counter, float* advantages, float* pass_rate, float* energy,
                  float* momentum, int32_t* fault, lze::Params params, int32_t device,
                  void* stream);

// What `device` offers the top-k (its SMs, shared memory with the opt-in, the one-block plan's
// limit, the large plan's digits), with every opt-in made (csrc/cuda/lze_topk.cu).
int lze_cuda_device_shape(int32_t device, lze::cuda_select::DeviceShape* shape);

// Every device's shape made again at its next plan (after the emulator's devices change).
void lze_cuda_forget_device_shapes(void);

// The launch plan of a top-k over B rows on `device` (selection_plan.h), made before anything is
// queued: 0, or LZE_CUDA_NO_PLAN when no plan fits the device.
int lze_topk_cuda_plan(int64_t B, int32_t device, lze::cuda_select::TopkPlan* plan);

// kept_indices in ascending row order (csrc/cuda/lze_topk.cu). `workspace`: a device buffer of
// lze_topk_cuda_workspace_bytes(plan) bytes (none, may be null, for the one-block plan), any
// contents.
int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                  const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                  int64_t* num_kept, void* workspace, const lze::cuda_select::TopkPlan* plan,
                  int32_t device, void* stream);

int64_t lze_topk_cuda_workspace_bytes(const lze::cuda_select::TopkPlan* plan);

// One selection step in one call (lze::SelectStep, csrc/cuda/lze_select.cu): the undo copy when
// asked, the step kernel (which also draws the selection's Gumbel noise, reduces the energies'
// extent and writes the fault mirror), then the top-k, by the plan of lze_select_step_cuda_plan.
// call->workspace: a device buffer of lze_select_step_cuda_workspace_bytes(plan, G) bytes, any
// contents. Returns 0, 1 for a bad size or dtype, or the first error (one still pending on the
// device, then nothing is queued, or a launch's).
int lze_select_step_cuda(const lze::SelectStep* call, const lze::cuda_select::TopkPlan* plan,
                         int32_t device, void* stream);

int lze_select_step_cuda_plan(int64_t B, int32_t device, lze::cuda_select::TopkPlan* plan);

int64_t lze_select_step_cuda_workspace_bytes(const lze::cuda_select::TopkPlan* plan, int64_t G);

// Kernel launches made by lze_select_step_cuda by `plan` (docs/kernels.md).
int32_t lze_select_step_cuda_launches(const lze::cuda_select::TopkPlan* plan, int32_t with_undo);

#ifdef __cplusplus
}
#endif

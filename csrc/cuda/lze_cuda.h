// C ABI of the CUDA kernels: the same contract as csrc/lze_kernels.h, plus the stream the
// kernels are launched on (a cudaStream_t passed as void* so this header needs no CUDA headers).
#pragma once
#include <stdint.h>

#include "../lze_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

int lze_step_cuda(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                  const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N, int32_t* records,
                  int64_t* step_counter, float* advantages, float* pass_rate, float* energy,
                  float* momentum, int32_t* fault, lze::Params params, void* stream);

// kept_indices in ascending row order (csrc/cuda/lze_topk.cu). `workspace`: a device buffer of
// lze_topk_cuda_workspace_bytes(B) bytes (none, may be null, for small B), any contents.
int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                  const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                  int64_t* num_kept, void* workspace, void* stream);

int64_t lze_topk_cuda_workspace_bytes(int64_t B);

// One selection step in one call (lze::SelectStep, csrc/cuda/lze_select.cu): the undo copy when
// asked, the step kernel (which also draws the selection's Gumbel noise, reduces the energies'
// extent and writes the fault mirror), then the top-k. call->workspace: a device buffer of
// lze_select_step_cuda_workspace_bytes(B, G) bytes, any contents. Returns 0, 1 for a bad size
// or dtype, or the first launch error.
int lze_select_step_cuda(const lze::SelectStep* call, void* stream);

int64_t lze_select_step_cuda_workspace_bytes(int64_t B, int64_t G);

// Kernel launches made by lze_select_step_cuda for a batch of B rows (docs/kernels.md).
int32_t lze_select_step_cuda_launches(int64_t B, int32_t with_undo);

#ifdef __cplusplus
}
#endif

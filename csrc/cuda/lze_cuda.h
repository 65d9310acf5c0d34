// C ABI of the CUDA kernels: the same contract as csrc/lze_kernels.h, plus the stream the
// kernels are launched on (a cudaStream_t passed as void* so this header needs no CUDA headers).
#pragma once
#include <stdint.h>

#include "../lze_math.h"

#ifdef __cplusplus
extern "C" {
#endif

int lze_step_cuda(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                  const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N, float* fstate,
                  int32_t* istate, int64_t* step_counter, float* advantages, float* pass_rate,
                  float* energy, float* momentum, int32_t* fault, lze::Params params,
                  void* stream);

// kept_indices in ascending row order (csrc/cuda/lze_topk.cu). `workspace`: a device buffer of
// lze_topk_cuda_workspace_bytes(B) bytes (none, may be null, for small B), any contents.
int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
                  const int64_t* step_counter, uint8_t* keep_mask, int64_t* kept_indices,
                  int64_t* num_kept, void* workspace, void* stream);

int64_t lze_topk_cuda_workspace_bytes(int64_t B);

#ifdef __cplusplus
}
#endif

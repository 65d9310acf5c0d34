// Fused LZE step (docs/spec.md §2, §3, §5) in one launch: per-row statistics, GRPO advantages, energy and
// the update of the per-prompt state, bit-identical to lze_kernels/reference.lze_step for binary
// rewards (the scalar math is lze_math.h; build with --fmad=false / -ffp-contract=off).
//
// Launch math. Each row (prompt group of G rollouts) belongs to a segment of W lanes of one
// warp, W = the smallest power of two >= G, at most 32:
//  * G <= 32: a warp handles 32 / W consecutive rows, lane l of a segment holds rollout l, so
//    a warp reads 32 / W * G consecutive rewards (coalesced) and the row reductions are
//    log2(W) butterfly shuffles inside the segment;
//  * G > 32: W = 32, one warp per row, each lane strides over the row by 32 (coalesced).
// Blocks of 256 threads (8 warps) cover 8 * 32 / W rows; the grid is ceil(B / rows per block)
// blocks and every index is bounds-checked (lanes past B still join the shuffles). Rewards are
// read up to three times per row (sums, squared deviations, advantages); after the first pass
// they come from L1.
//
// Per row: count / mean / unbiased std over the valid rewards; row faults (id outside [0, N),
// non-finite or out-of-range valid reward) skip the row. The segment's first lane loads the row's
// prompt id together with the rewards, and gathers the prompt's state (one float4, one int4)
// while the rewards are reduced; a fault-free row with n > 0 then claims the prompt with
// atomicMax(claim, stamp), stamp = step_counter[0] + 1: a row that finds the stamp already
// there carries a duplicate id within this step and is skipped (which of the duplicate rows wins
// is unspecified; the reference keeps the first). The winner computes energy and the new state
// and scatters it back. (The winner's int4 store touches the claim word a losing duplicate may
// atomicMax at the same time; both write the same stamp, so this race is benign.) Skipped rows
// output zeros and OR their fault bits into fault[0].
//
// Step counter: every block reads step_counter[0] at the start; the last block to finish (an
// atomic count in step_counter[1]) writes step_counter[0] + 1 and resets step_counter[1] to 0.
// Nothing waits for another block.
#include <stdint.h>

#include "cuda_compat.h"
#include "lze_cuda.h"

namespace lze::cuda_step {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

static_assert(kDInit == 0 && kEma == 1 && kLastPassRate == 2 && kLastEnergy == 3,
              "the float4 gather below assumes this field order");
static_assert(kSeen == 0 && kSolvedStreak == 1 && kFlags == 2 && kClaim == 3,
              "the int4 gather below assumes this field order");

struct StepArgs {
  const void* rewards;
  int32_t rewards_dtype;
  const uint8_t* valid;
  const int64_t* prompt_ids;
  int64_t B, G, N;
  float* fstate;
  int32_t* istate;
  int64_t* step_counter;
  float* advantages;
  float* pass_rate;
  float* energy;
  float* momentum;
  int32_t* fault;
  Params params;
  int segment_width;  // lanes per row: a power of two <= 32
};

// The lanes of one row: a power-of-two segment of a warp.
struct Segment {
  int lane;   // position in the segment; it handles rollouts lane, lane + width, ...
  int width;
};

// Per-lane partial sums of one row.
struct Partial {
  int count;
  float sum;
  int32_t fault;
};

// Outputs of an updated row (all zero for a skipped row).
struct RowOutputs {
  float pass_rate;
  float energy;
  float momentum;
};

// Butterfly reductions over a segment: every lane of the segment gets the result, and since
// each level adds two equal-size halves, every lane computes the same floating-point value.
template <typename T>
__device__ __forceinline__ T segment_sum(T value, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

__device__ __forceinline__ int32_t segment_or(int32_t bits, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    bits |= __shfl_xor_sync(kFullMask, bits, offset);
  }
  return bits;
}

__device__ __forceinline__ bool is_valid(const StepArgs& a, int64_t index) {
  return a.valid == nullptr || a.valid[index] != 0;
}

// The reward and its validity are both loaded, then combined without a branch, so that their
// loads are in flight together (behind the branch, the reward's waited for the mask's).
__device__ Partial sum_valid_rewards(const StepArgs& a, int64_t first, Segment s) {
  Partial p{0, 0.0f, 0};
  for (int64_t j = s.lane; j < a.G; j += s.width) {
    const float r = load_reward(a.rewards, first + j, a.rewards_dtype);
    const bool valid = is_valid(a, first + j);
    p.count += valid ? 1 : 0;
    p.sum += valid ? r : 0.0f;
    p.fault |= valid ? reward_fault(r) : 0;
  }
  return p;
}

__device__ float sum_squared_deviations(const StepArgs& a, int64_t first, Segment s, float mean) {
  float total = 0.0f;
  for (int64_t j = s.lane; j < a.G; j += s.width) {
    if (!is_valid(a, first + j)) continue;
    const float centred = load_reward(a.rewards, first + j, a.rewards_dtype) - mean;
    total += centred * centred;
  }
  return total;
}

__device__ void write_advantages(const StepArgs& a, int64_t first, Segment s, bool active,
                                 float mean, float stddev, int count) {
  for (int64_t j = s.lane; j < a.G; j += s.width) {
    float advantage = 0.0f;
    if (active && is_valid(a, first + j)) {
      const float r = load_reward(a.rewards, first + j, a.rewards_dtype);
      advantage = grpo_advantage(r, mean, stddev, count, a.params);
    }
    a.advantages[first + j] = advantage;
  }
}

// A row's prompt: its id and, when the id is in [0, N), its state as the step found it.
struct PromptRow {
  int64_t id;
  bool in_range;
  float4 f;
  int4 s;
};

__device__ __forceinline__ PromptRow gather_prompt(const StepArgs& a, int64_t id) {
  PromptRow p{id, id >= 0 && id < a.N, make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_int4(0, 0, 0, 0)};
  if (p.in_range) {
    p.f = reinterpret_cast<const float4*>(a.fstate)[id];
    p.s = reinterpret_cast<const int4*>(a.istate)[id];
  }
  return p;
}

// docs/spec.md §3 and §5 for one claimed prompt: its new state from the gathered one, scattered
// back. (The claim word in `s` is stale; the new state carries this step's stamp.)
__device__ RowOutputs update_prompt_state(const StepArgs& a, const PromptRow& prompt, float p,
                                          int32_t stamp) {
  const float4 f = prompt.f;
  const int4 s = prompt.s;
  const int64_t id = prompt.id;
  const PromptStep u =
      advance_prompt(PromptState{f.x, f.y, f.z, f.w, s.x, s.y, s.z, s.w}, p, stamp, a.params);
  const PromptState& n = u.next;
  reinterpret_cast<float4*>(a.fstate)[id] = make_float4(n.d_init, n.ema, n.last_pass_rate,
                                                        n.last_energy);
  reinterpret_cast<int4*>(a.istate)[id] = make_int4(n.seen, n.solved_streak, n.flags, n.claim);
  return {p, n.last_energy, u.momentum};
}

// Run by the first lane of a row's segment: fault checks, the claim, the state update and the
// per-row outputs. Returns whether the row updated its prompt (its advantages are then kept).
// Only the claim's winner writes the prompt in this step, after its own loads, so every row
// that gathered it read its state before the step; a losing duplicate drops what it read.
__device__ bool finish_row(const StepArgs& a, int64_t row, const PromptRow& prompt, int count,
                           float mean, int32_t fault, int32_t stamp) {
  if (!prompt.in_range) fault |= kFaultIdOutOfRange;
  RowOutputs out{0.0f, 0.0f, 0.0f};
  bool active = false;
  if (fault == 0 && count > 0) {
    if (atomicMax(&a.istate[prompt.id * kNumIntFields + kClaim], stamp) >= stamp) {
      fault = kFaultDuplicateId;
    } else {
      out = update_prompt_state(a, prompt, mean, stamp);
      active = true;
    }
  }
  if (fault != 0) atomicOr(a.fault, fault);
  a.pass_rate[row] = out.pass_rate;
  a.energy[row] = out.energy;
  a.momentum[row] = out.momentum;
  return active;
}

// One row per segment. Every lane of the warp runs the shuffles, including lanes whose row is
// past the batch (in_batch false), so the full-mask intrinsics always see all 32 lanes.
//
// Order of the memory round trips (the step is latency-bound: with a state table past the L2
// cache, 4M prompts = 128 MB, each is a DRAM access; in sequence, rewards -> id -> state and
// claim, they were most of the step, 0.52 ms at B = 1M on an H200): the first lane's id load is
// issued with the reward loads; the state gather is issued once the id is in, before the
// reductions' shuffles; the claim's atomic needs the row's faults and count, so it follows the
// reductions, while the gather is still in flight. Two round trips in sequence instead of three.
__device__ void process_row(const StepArgs& a, int64_t row, bool in_batch, Segment s,
                            int32_t stamp) {
  const int64_t first = row * a.G;
  const bool owner = in_batch && s.lane == 0;
  const int64_t id = owner ? a.prompt_ids[row] : -1;
  const Partial partial = in_batch ? sum_valid_rewards(a, first, s) : Partial{0, 0.0f, 0};
  const PromptRow prompt = gather_prompt(a, id);  // in range only for the owner lane
  const int count = segment_sum(partial.count, s.width);
  const float sum = segment_sum(partial.sum, s.width);
  const int32_t fault = segment_or(partial.fault, s.width);
  const float mean = count > 0 ? sum / static_cast<float>(count) : 0.0f;
  const float sq_dev = in_batch ? sum_squared_deviations(a, first, s, mean) : 0.0f;
  const float stddev = unbiased_std(segment_sum(sq_dev, s.width), count);
  bool active = false;
  if (owner) active = finish_row(a, row, prompt, count, mean, fault, stamp);
  active = __shfl_sync(kFullMask, active, 0, s.width);
  if (in_batch) write_advantages(a, first, s, active, mean, stddev, count);
}

// Last-block-done: the last block to finish advances the step counter and resets the scratch
// count. The fence orders this block's reads of step_counter[0] and its writes before the count.
__device__ void advance_step_if_last(int64_t* step_counter, int64_t step) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  auto* finished = reinterpret_cast<unsigned long long*>(step_counter + 1);
  if (atomicAdd(finished, 1ull) == gridDim.x - 1ull) {
    step_counter[0] = step + 1;
    *finished = 0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock) lze_step_kernel(const StepArgs a) {
  const int64_t step = a.step_counter[0];
  const int lane_in_warp = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const Segment s{lane_in_warp & (a.segment_width - 1), a.segment_width};
  const int64_t row = warp * (kWarpSize / a.segment_width) + lane_in_warp / a.segment_width;
  process_row(a, row, row < a.B, s, static_cast<int32_t>(step + 1));
  advance_step_if_last(a.step_counter, step);
}

int segment_width(int64_t G) {
  int width = 1;
  while (width < G && width < kWarpSize) width *= 2;
  return width;
}

}  // namespace lze::cuda_step

extern "C" int lze_step_cuda(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                             const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N,
                             float* fstate, int32_t* istate, int64_t* step_counter,
                             float* advantages, float* pass_rate, float* energy, float* momentum,
                             int32_t* fault, lze::Params params, void* stream) {
  using namespace lze::cuda_step;
  if (B < 0 || G < 0) return cudaErrorInvalidValue;
  const int width = segment_width(G);
  const int64_t rows_per_block = (kThreadsPerBlock / kWarpSize) * (kWarpSize / width);
  // B == 0 still launches one block: the step counter advances as in the reference.
  const int64_t blocks = B == 0 ? 1 : (B + rows_per_block - 1) / rows_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const StepArgs args{rewards,  rewards_dtype, valid,     prompt_ids, B,      G,
                      N,        fstate,        istate,    step_counter, advantages, pass_rate,
                      energy,   momentum,      fault,     params,     width};
  LZE_LAUNCH(lze_step_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock), 0,
             static_cast<cudaStream_t>(stream))(args);
  return static_cast<int>(cudaGetLastError());
}

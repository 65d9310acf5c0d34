// Fused LZE step (docs/spec.md §2, §3, §5) in one launch: per-row statistics, GRPO advantages, energy and
// the update of the per-prompt state, bit-identical to lze_kernels/reference.lze_step for binary
// rewards (the scalar math is lze_math.h; build with --fmad=false / -ffp-contract=off).
//
// Launch math: blocks of 256 threads, every index bounds-checked, two kernels by G.
//  * G <= 32 (lze_step_tile_kernel, "row tiles" below): a block takes 256 consecutive rows, one
//    per thread; the rewards pass through shared memory, read and written coalesced; the grid
//    is ceil(B / 256) blocks.
//  * G > 32 (lze_step_kernel): one warp per row, each lane striding over the row by 32
//    (coalesced), the row reductions butterfly shuffles; 8 rows per block, ceil(B / 8) blocks.
//    Rewards are read up to three times per row (sums, squared deviations, advantages); after
//    the first pass they come from L1.
// Both kernels are latency-bound where the state table is past the L2 cache: per row the id, the
// state record and the claim are DRAM round trips. The record of a prompt is one 32-byte sector
// (lze_math.h): its gather (two 16-byte loads), claim and scatter touch one random sector a row,
// read once and written once. The tile kernel has 256 rows' round trips in flight per block where
// a segment-per-row block had 16 (G = 16).
//
// Per row: count / mean / unbiased std over the valid rewards; row faults (id outside [0, N),
// non-finite or out-of-range valid reward) skip the row. The row's owner (its thread in a tile,
// its warp's first lane for G > 32) loads the row's prompt id together with the rewards, and
// gathers the prompt's record while the rewards are reduced; a fault-free row with n > 0 then
// claims the prompt with atomicMax(claim, stamp), stamp = step_counter[0] + 1: a row that finds
// the stamp already there carries a duplicate id within this step and is skipped (which of the
// duplicate rows wins is unspecified; the reference keeps the first). The winner computes energy
// and the new state and scatters it back. (The winner's store of the int half touches the claim
// word a losing duplicate may atomicMax at the same time; both write the same stamp, so this race
// is benign.) Skipped rows output zeros and OR their fault bits into fault[0].
//
// In a selection step (lze_select.cu, SelectionPrep) the kernel also prepares the top-k: every
// row's standard Gumbel draw for the selection's noise, keyed by (seed, step + 1, row) as the
// top-k keys it (the step counter has advanced by then), each block's extent of its candidates'
// energies (E > 0), and it zeroes the top-k's workspace header. The draws (Philox and two logs
// in float64 a row) run here on every SM instead of in the one-block top-k.
//
// Step counter: every block reads step_counter[0] at the start; the last block to finish (an
// atomic count in step_counter[1]) writes step_counter[0] + 1, resets step_counter[1] to 0,
// copies the fault word to the host's mirror when there is one (host-mapped memory: the host
// reads it without a copy launch or an event) and reduces the blocks' extents. Nothing waits
// for another block.
#include <stdint.h>

#include "block_reduce.h"
#include "cuda_compat.h"
#include "launchers.h"
#include "lze_cuda.h"

namespace lze::cuda_step {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

using cuda_select::Extent;

static_assert(kDInit == 0 && kEma == 1 && kLastPassRate == 2 && kLastEnergy == 3,
              "the float4 gather below assumes this field order");
static_assert(kSeen == 0 && kSolvedStreak == 1 && kFlags == 2 && kClaim == 3,
              "the int4 gather below assumes this field order");
static_assert(kRecordWords == 8 && kIntFieldsAt == 4, "a record is a float4 then an int4");
static_assert(cuda_select::kStepTileRows == kThreadsPerBlock &&
              cuda_select::kStepWarpRows * kWarpSize == kThreadsPerBlock &&
              cuda_select::kStepTileMaxGroup == 32, "selection_plan.h's step grid");

// The lanes of one row (G > 32: a whole warp, width 32).
struct Segment {
  int lane;   // it handles rollouts lane, lane + width, ...
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

// The per-element arithmetic both kernels share, in the same order: a row's sums, its mean, its
// squared deviations and an element's advantage.
__device__ __forceinline__ void add_reward(Partial& p, float r, bool valid) {
  p.count += valid ? 1 : 0;
  p.sum += valid ? r : 0.0f;
  p.fault |= valid ? reward_fault(r) : 0;
}

__device__ __forceinline__ float mean_of(int count, float sum) {
  return count > 0 ? sum / static_cast<float>(count) : 0.0f;
}

__device__ __forceinline__ void add_squared_deviation(float& total, float r, float mean,
                                                      bool valid) {
  const float centred = r - mean;
  total += valid ? centred * centred : 0.0f;
}

// The reward and its validity are both loaded, then combined without a branch, so that their
// loads are in flight together (behind the branch, the reward's waited for the mask's).
__device__ Partial sum_valid_rewards(const StepArgs& a, int64_t first, Segment s) {
  Partial p{0, 0.0f, 0};
  for (int64_t j = s.lane; j < a.G; j += s.width) {
    add_reward(p, load_reward(a.rewards, first + j, a.rewards_dtype), is_valid(a, first + j));
  }
  return p;
}

// A row's statistics, in every lane of its segment.
struct RowStats {
  int count;
  float mean;
  float stddev;
  int32_t fault;  // reward faults (the id is checked by finish_row)
};

// Count, sum and fault bits of the segment's partials, and the mean; the std is added by
// with_stddev once the lanes' squared deviations from that mean are in.
__device__ RowStats reduce_partials(Partial partial, int width) {
  RowStats st;
  st.count = segment_sum(partial.count, width);
  const float sum = segment_sum(partial.sum, width);
  st.fault = segment_or(partial.fault, width);
  st.mean = mean_of(st.count, sum);
  st.stddev = 0.0f;
  return st;
}

__device__ __forceinline__ RowStats with_stddev(RowStats st, float sq_dev, int width) {
  st.stddev = unbiased_std(segment_sum(sq_dev, width), st.count);
  return st;
}

__device__ float sum_squared_deviations(const StepArgs& a, int64_t first, Segment s, float mean) {
  float total = 0.0f;
  for (int64_t j = s.lane; j < a.G; j += s.width) {
    add_squared_deviation(total, load_reward(a.rewards, first + j, a.rewards_dtype), mean,
                          is_valid(a, first + j));
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
  if (p.in_range) {  // the record's two 16-byte halves: one 32-byte sector
    p.f = LZE_LOAD_VECTOR(reinterpret_cast<const float4*>(a.records) + 2 * id);
    p.s = LZE_LOAD_VECTOR(reinterpret_cast<const int4*>(a.records) + 2 * id + 1);
    LZE_NOTE_STATE_ACCESS(a.records + id * kRecordWords, 16);
    LZE_NOTE_STATE_ACCESS(a.records + id * kRecordWords + kIntFieldsAt, 16);
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
  LZE_STORE_VECTOR(reinterpret_cast<float4*>(a.records) + 2 * id,
                   make_float4(n.d_init, n.ema, n.last_pass_rate, n.last_energy));
  LZE_STORE_VECTOR(reinterpret_cast<int4*>(a.records) + 2 * id + 1,
                   make_int4(n.seen, n.solved_streak, n.flags, n.claim));
  LZE_NOTE_STATE_ACCESS(a.records + id * kRecordWords, 16);
  LZE_NOTE_STATE_ACCESS(a.records + id * kRecordWords + kIntFieldsAt, 16);
  return {p, n.last_energy, u.momentum};
}

// What the owner of a row learnt: whether it updated its prompt (its advantages are then kept)
// and the row's energy (0 when skipped).
struct RowResult {
  bool active;
  float energy;
};

// Run by the row's owner (its thread in a tile, its warp's first lane for G > 32): fault checks,
// the claim, the state update and the per-row outputs. Only the claim's winner writes the prompt
// in this step, after its own loads, so every row that gathered it read its state before the
// step; a losing duplicate drops what it read.
__device__ __forceinline__ RowResult finish_row(const StepArgs& a, int64_t row,
                                                const PromptRow& prompt, const RowStats& st,
                                                int32_t stamp) {
  int32_t fault = st.fault;
  if (!prompt.in_range) fault |= kFaultIdOutOfRange;
  RowOutputs out{0.0f, 0.0f, 0.0f};
  bool active = false;
  if (fault == 0 && st.count > 0) {
    int32_t* claim = &a.records[prompt.id * kRecordWords + kIntFieldsAt + kClaim];
    LZE_NOTE_STATE_ACCESS(claim, 4);
    if (atomicMax(claim, stamp) >= stamp) {
      fault = kFaultDuplicateId;
    } else {
      out = update_prompt_state(a, prompt, st.mean, stamp);
      active = true;
    }
  }
  if (fault != 0) atomicOr(a.fault, fault);
  a.pass_rate[row] = out.pass_rate;
  a.energy[row] = out.energy;
  a.momentum[row] = out.momentum;
  return {active, out.energy};
}

// A selection step's per-row preparation of the top-k, by the row's owner: the row's Gumbel
// draw (keyed by the step the top-k sees, step + 1), and its energy for the block's extent.
__device__ __forceinline__ Extent prepare_row_selection(const StepArgs& a, int64_t row,
                                                        float energy, int64_t step) {
  if (a.prep.draws != nullptr) {
    a.prep.draws[row] = standard_gumbel(uniform_from_bits(
        philox_4x32_10(a.prep.seed, static_cast<uint32_t>(step + 1), static_cast<uint32_t>(row))));
  }
  return cuda_select::with_energy(cuda_select::no_extent(), energy);
}

// The top-k workspace header zeroed by the whole grid (a selection step on the large plan).
__device__ __forceinline__ void zero_selection_header(const StepArgs& a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < a.prep.zero_count; i += stride) {
    a.prep.zero_words[i] = 0;
  }
}

// One row per segment. Every lane of the warp runs the shuffles, including lanes whose row is
// past the batch (in_batch false), so the full-mask intrinsics always see all 32 lanes. Returns
// the row's extent contribution in the owner lane (no candidate elsewhere).
//
// Order of the memory round trips (the step is latency-bound: with a state table past the L2
// cache, 4M prompts = 128 MB, each is a DRAM access; in sequence, rewards -> id -> state and
// claim, they were most of the step, 0.52 ms at B = 1M on an H200): the first lane's id load is
// issued with the reward loads; the state gather is issued once the id is in, before the
// reductions' shuffles; the claim's atomic needs the row's faults and count, so it follows the
// reductions, while the gather is still in flight. Two round trips in sequence instead of three.
__device__ Extent process_row(const StepArgs& a, int64_t row, bool in_batch, Segment s,
                              int64_t step) {
  const int64_t first = row * a.G;
  const bool owner = in_batch && s.lane == 0;
  const int64_t id = owner ? a.prompt_ids[row] : -1;
  const Partial partial = in_batch ? sum_valid_rewards(a, first, s) : Partial{0, 0.0f, 0};
  const PromptRow prompt = gather_prompt(a, id);  // in range only for the owner lane
  RowStats st = reduce_partials(partial, s.width);
  const float sq_dev = in_batch ? sum_squared_deviations(a, first, s, st.mean) : 0.0f;
  st = with_stddev(st, sq_dev, s.width);
  RowResult result{false, 0.0f};
  Extent extent = cuda_select::no_extent();
  if (owner) {
    result = finish_row(a, row, prompt, st, static_cast<int32_t>(step + 1));
    extent = prepare_row_selection(a, row, result.energy, step);
  }
  const bool active = __shfl_sync(kFullMask, result.active, 0, s.width);
  if (in_batch) write_advantages(a, first, s, active, st.mean, st.stddev, st.count);
  return extent;
}

// The end of every block: its extent to the selection's workspace, then last-block-done. The
// last block to finish advances the step counter, resets the scratch count (atomically: a count
// is an atomic word, and a plain store beside another launch's tickets could leave it non-zero
// for good), copies the fault word to the host's mirror and reduces the blocks' extents. The
// fence in is_last_block orders this block's reads of step_counter[0], its fault bits and its
// extent before its ticket. The mirror's store needs no system-scope fence: the host reads it
// at a later step or after a sync, and it is the last block's last store to it; a fence there
// would hold the top-k behind a round trip to host memory.
__device__ void finish_block(const StepArgs& a, int64_t step, Extent row_extent) {
  const bool extents = a.prep.block_extents != nullptr;
  if (extents) {
    const Extent e = cuda_select::block_extent(row_extent);
    if (threadIdx.x == 0) a.prep.block_extents[blockIdx.x] = e;
  }
  auto* finished = reinterpret_cast<unsigned long long*>(a.step_counter + 1);
  if (!cuda_select::is_last_block(finished)) return;
  if (threadIdx.x == 0) {
    a.step_counter[0] = step + 1;
    atomicExch(finished, 0ull);
    if (a.prep.fault_mirror != nullptr) {
      *reinterpret_cast<volatile int32_t*>(a.prep.fault_mirror) = atomicOr(a.fault, 0);
    }
  }
  if (extents) {
    const Extent e = cuda_select::reduce_block_extents(a.prep.block_extents, gridDim.x);
    if (threadIdx.x == 0) *a.prep.extent = e;
  }
}

// At least 4 blocks an SM (at most 64 registers): with the block size alone, ptxas 13 kept this
// kernel to 32 registers on sm_90 and spilled one.
__global__ void __launch_bounds__(kThreadsPerBlock, 4) lze_step_kernel(const StepArgs a) {
  const int64_t step = a.step_counter[0];
  zero_selection_header(a);
  const Segment s{static_cast<int>(threadIdx.x) % kWarpSize, kWarpSize};
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const Extent extent = process_row(a, row, row < a.B, s, step);
  finish_block(a, step, extent);
}
LZE_KERNEL_RESOURCES(lze_step_kernel, kThreadsPerBlock, 272);

// ----------------------------------------------------------------------------- row tiles
//
// Groups of at most kTileMaxGroup rollouts (the common G = 8 or 16): a block takes a tile of
// kTileRows rows, one per thread, so that every thread has a prompt's state in flight, not one
// lane of each segment (16x the rows in flight per block at G = 16, where the step waits on DRAM
// round trips at random state rows). Global memory stays coalesced through shared memory:
//  1. the block loads the tile's rewards (rows * G consecutive elements) with consecutive
//     threads on consecutive elements, and stores them as a [kTileRows, stride] float tile
//     (stride = G rounded up to odd: thread t reading row t hits 32 distinct banks);
//  2. thread t reduces row t in rollout order, claims and updates its prompt (it loaded the id
//     first and gathered the state before the barrier), writes the per-row outputs (coalesced)
//     and overwrites its row of the tile with its advantages;
//  3. the block stores the tile's advantages, coalesced.
// Shared memory: 256 x 33 x 4 B of rewards + 256 x 32 B of validity (41.8 KiB, static; five
// blocks an SM). Index math is 32-bit inside a tile (at most 8,192 elements).
constexpr int kTileMaxGroup = 32;
constexpr int kTileRows = kThreadsPerBlock;
constexpr int kTileStride = kTileMaxGroup + 1;

struct RewardTile {
  float reward[kTileRows * kTileStride];
  uint8_t valid[kTileRows * kTileMaxGroup];
};

// Phase 1: the tile's rewards (and validity) from global memory into the shared tile. Each thread
// issues kTileLoadsInFlight loads before storing any (the dtype is a template argument, so the
// loads are not behind a branch each): G / 8 round trips, 8 loads of a thread in each.
constexpr int kTileLoadsInFlight = 8;

template <int32_t kDType>
__device__ void load_tile_as(const StepArgs& a, int64_t base, int elements, int stride,
                             RewardTile& tile) {
  const bool masked = a.valid != nullptr;
  const int group = static_cast<int>(a.G);
  for (int first = static_cast<int>(threadIdx.x); first < elements;
       first += kTileLoadsInFlight * kThreadsPerBlock) {
    float reward[kTileLoadsInFlight];
    uint8_t valid[kTileLoadsInFlight];
    for (int i = 0; i < kTileLoadsInFlight; ++i) {
      const int e = first + i * kThreadsPerBlock;
      const bool in = e < elements;
      reward[i] = in ? load_reward(a.rewards, base + e, kDType) : 0.0f;
      valid[i] = in ? (masked ? a.valid[base + e] : uint8_t{1}) : uint8_t{0};
    }
    for (int i = 0; i < kTileLoadsInFlight; ++i) {
      const int e = first + i * kThreadsPerBlock;
      if (e >= elements) break;
      const int row = e / group, rollout = e - row * group;
      tile.reward[row * stride + rollout] = reward[i];
      tile.valid[row * kTileMaxGroup + rollout] = valid[i] != 0 ? 1 : 0;
    }
  }
}

__device__ void load_tile(const StepArgs& a, int64_t first_row, int rows, int stride,
                          RewardTile& tile) {
  const int elements = rows * static_cast<int>(a.G);
  const int64_t base = first_row * a.G;
  switch (a.rewards_dtype) {
    case kF32: load_tile_as<kF32>(a, base, elements, stride, tile); break;
    case kBF16: load_tile_as<kBF16>(a, base, elements, stride, tile); break;
    default: load_tile_as<kF16>(a, base, elements, stride, tile); break;
  }
}

// Phase 2's statistics of the tile's row `t`, in rollout order.
__device__ RowStats tile_row_stats(const StepArgs& a, const RewardTile& tile, int t, int stride) {
  Partial p{0, 0.0f, 0};
  for (int j = 0; j < a.G; ++j) {
    add_reward(p, tile.reward[t * stride + j], tile.valid[t * kTileMaxGroup + j] != 0);
  }
  RowStats st{p.count, mean_of(p.count, p.sum), 0.0f, p.fault};
  float sq_dev = 0.0f;
  for (int j = 0; j < a.G; ++j) {
    add_squared_deviation(sq_dev, tile.reward[t * stride + j], st.mean,
                          tile.valid[t * kTileMaxGroup + j] != 0);
  }
  st.stddev = unbiased_std(sq_dev, st.count);
  return st;
}

// Phase 2's advantages of row `t`, written over its rewards in the tile.
__device__ void tile_row_advantages(const StepArgs& a, RewardTile& tile, int t, int stride,
                                    const RowStats& st, bool active) {
  for (int j = 0; j < a.G; ++j) {
    float& slot = tile.reward[t * stride + j];
    const bool keep = active && tile.valid[t * kTileMaxGroup + j] != 0;
    slot = keep ? grpo_advantage(slot, st.mean, st.stddev, st.count, a.params) : 0.0f;
  }
}

// Phase 3: the tile's advantages to global memory, coalesced.
__device__ void store_tile(const StepArgs& a, int64_t first_row, int rows, int stride,
                           const RewardTile& tile) {
  const int elements = rows * static_cast<int>(a.G);
  float* out = a.advantages + first_row * a.G;
  for (int e = static_cast<int>(threadIdx.x); e < elements; e += kThreadsPerBlock) {
    const int row = e / static_cast<int>(a.G), rollout = e - row * static_cast<int>(a.G);
    out[e] = tile.reward[row * stride + rollout];
  }
}

// At least two blocks an SM (its 41 KiB of shared memory allows two on sm_86 and sm_89, 100 KB an
// SM): without it ptxas 13 gave 65 registers on sm_86 and sm_89.
__global__ void __launch_bounds__(kThreadsPerBlock, 2) lze_step_tile_kernel(const StepArgs a) {
  LZE_SHARED(RewardTile, tile);
  const int64_t step = a.step_counter[0];
  zero_selection_header(a);
  const int t = static_cast<int>(threadIdx.x);
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t left = a.B - first_row;
  const int rows = left < kTileRows ? static_cast<int>(left > 0 ? left : 0) : kTileRows;
  const int stride = static_cast<int>(a.G) | 1;
  const bool in_batch = t < rows;
  const int64_t id = in_batch ? a.prompt_ids[first_row + t] : -1;  // in flight with phase 1's
  load_tile(a, first_row, rows, stride, tile);
  const PromptRow prompt = gather_prompt(a, id);
  __syncthreads();
  Extent extent = cuda_select::no_extent();
  if (in_batch) {
    const RowStats st = tile_row_stats(a, tile, t, stride);
    const RowResult result = finish_row(a, first_row + t, prompt, st,
                                        static_cast<int32_t>(step + 1));
    extent = prepare_row_selection(a, first_row + t, result.energy, step);
    tile_row_advantages(a, tile, t, stride, st, result.active);
  }
  __syncthreads();
  store_tile(a, first_row, rows, stride, tile);
  finish_block(a, step, extent);
}
LZE_KERNEL_RESOURCES(lze_step_tile_kernel, kThreadsPerBlock, 42256);

}  // namespace lze::cuda_step

namespace lze::cuda_step {

// Launches the step kernel for B rows (any B >= 0: an empty batch still advances the counter).
int launch_step(const StepArgs& args, cudaStream_t stream) {
  if (args.B < 0 || args.G < 0) return cudaErrorInvalidValue;
  const int64_t blocks = cuda_select::step_blocks(args.B, args.G);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks)), block(kThreadsPerBlock);
  if (args.G <= kTileMaxGroup) {
    LZE_LAUNCH(lze_step_tile_kernel, grid, block, 0, stream)(args);
  } else {
    LZE_LAUNCH(lze_step_kernel, grid, block, 0, stream)(args);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace lze::cuda_step

extern "C" int lze_step_cuda(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                             const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N,
                             int32_t* records, int64_t* step_counter, float* advantages,
                             float* pass_rate, float* energy, float* momentum, int32_t* fault,
                             lze::Params params, int32_t device, void* stream) {
  using namespace lze::cuda_step;
  const lze::cuda::DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  const StepArgs args{rewards,    rewards_dtype, valid,  prompt_ids, B,        G,
                      N,          records,       step_counter, advantages, pass_rate, energy,
                      momentum,   fault,         params, SelectionPrep{}};
  return launch_step(args, static_cast<cudaStream_t>(stream));
}

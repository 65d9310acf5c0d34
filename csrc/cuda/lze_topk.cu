// Top-k selection of rows by energy (docs/spec.md §4), identical to
// lze_kernels/reference.topk_select(energy, k, noise_scale, seed, step=step_counter[0]): the
// same candidates (energy > 0), scores (lze::noisy_score: Gumbel noise keyed by (seed,
// step_counter[0], row)) and order (descending score, ties to the smaller row); kept_indices in
// ascending row order, -1 padded.
//
// Algorithm: a radix select of the k-th best score, linear in B. Each candidate's score becomes
// its 32-bit ordered bits s (lze::ordered_score_bits; 0 marks a non-candidate). Three histogram
// passes over digits of 11, 11 and 10 bits, from the top, find the k-th largest s, T, and
// `need`, how many rows with s == T are kept; every row with s > T is kept, and of the rows with
// s == T the `need` first in row order (the tie rule). A prefix sum over rows then gives each
// kept row its slot, so kept_indices comes out in row order with no sort.
//
// Two launch plans, both with no host sync and capturable in a CUDA graph:
//  * B <= kOneBlockMaxRows (65,536): one launch of one block of kSmallThreads threads. The
//    scores live in dynamic shared memory up to kSmallMaxRows (4 B per row: 32 KiB at 8,192
//    rows, under the 48 KiB default), above that in a workspace of 4 B per row (256 KiB at most:
//    the block's own writes, read back from L2); the histogram in 8 KiB of static shared memory.
//    Each pass is 16 strips of 4,096 rows at most, which should take less time than the five
//    launches it saves (each some 10 us of host time on the H200 run's host and a few
//    microseconds of device gap, docs/gpu-results.md); not yet timed on a GPU.
//  * larger B: six launches over ceil(B / tile) blocks of kThreads threads, tile = 1,024 rows
//    (more for B > 1M, so that there are at most kMaxBlocks blocks): prepare (zero the
//    workspace header; per-block energy extents for the noise scale), score (scores to the
//    workspace, digit 1 histogram), refine twice (digits 2 and 3 of the rows still tied with
//    the k-th best), count (per block: rows above T and rows equal to T) and write (each block's
//    slots from the prefix of the block counts, then a block-wide prefix sum over its rows). The
//    last block to finish each of score, refine and count (last-block-done: a fence and an
//    atomic ticket, no waiting) narrows the cutoff or turns the block counts into block offsets.
//    Bytes per row: 4 read (energy), 4 written and 16 read (scores: four later passes), 1 + 8 k/B
//    written (mask, indices); the header is 24 KiB of histograms. Workspace: header + 24 B per
//    block + 4 B per row (lze_topk_cuda_workspace_bytes).
//
// Every pass takes a block's rows in strips, each thread four consecutive rows whose loads it
// issues together (one 16-byte load of four scores): the passes are latency-bound at moderate B,
// where a thread's rows one after another spent a DRAM round trip each (an H200 profile at
// B = 65,536 with 4,096-row tiles: 13-18 us per pass, about the same at 1M).
//
// Bounds: rows and positions are int64 in the loops; counts are uint32 (B < 2^31, checked by the
// launcher); every store to kept_indices is guarded by its position < k.
#include <stdint.h>

#include "cuda_compat.h"
#include "lze_cuda.h"

namespace lze::cuda_topk {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;          // threads per block of the multi-launch plan
constexpr int kSmallThreads = 1024;    // threads of the one-block plan
constexpr int kRowsPerThread = 4;      // consecutive rows per thread in each strip of a block
constexpr int64_t kStripRows = static_cast<int64_t>(kRowsPerThread) * kThreads;
constexpr int64_t kMinTileRows = kStripRows;  // rows per block of the multi-launch plan, at least
constexpr int64_t kMaxBlocks = 1024;    // blocks of the multi-launch plan, at most
constexpr int64_t kSmallMaxRows = 8192;       // one block, scores in shared memory
constexpr int64_t kOneBlockMaxRows = 65536;   // one block, scores in the workspace
constexpr int kPasses = 3;
constexpr int kBins = 2048;  // 2^11, the widest digit
constexpr uint32_t kNoThreshold = 0xffffffffu;  // above every candidate's s: nothing kept

// Digits of the 32-bit ordered score, from the top: bits [21, 32), [10, 21), [0, 10).
__device__ __forceinline__ int digit_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__device__ __forceinline__ int digit_bits(int pass) { return pass == 2 ? 10 : 11; }

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

// The radix select's progress: the bits of the k-th best score found so far and its rank
// (1-based) among the candidates that share them. After the last pass, threshold is T and rank
// is `need`; rank 0 means nothing is kept (threshold kNoThreshold).
struct Cutoff {
  uint32_t threshold;
  uint32_t rank;
  uint32_t kept;  // min(k, number of candidates)
  uint32_t unused;
};

struct Extent {
  float high;  // largest candidate energy, -inf without candidates
  float low;   // smallest, +inf without candidates
};

// Workspace of the multi-launch plan, carved from one device buffer (workspace_layout).
// The header (histograms, tickets, cutoff) is zeroed by the first launch.
constexpr int kTickets = 4;  // score, refine 1, refine 2, count
constexpr int64_t kHeaderWords = kPasses * kBins + kTickets + sizeof(Cutoff) / 4;

struct Workspace {
  uint32_t* header;        // [kHeaderWords]: the three fields below
  uint32_t* histograms;    // [kPasses][kBins]
  uint32_t* tickets;       // [kTickets] last-block-done counters
  Cutoff* cutoff;
  Extent* extents;         // [blocks]
  uint32_t* block_counts;  // [blocks][2]: rows with s > T, rows with s == T
  uint32_t* block_slots;   // [blocks][2]: kept rows before the block, rows with s == T before it
  uint32_t* scores;        // [B]
};

struct Plan {
  int64_t blocks;
  int64_t tile_rows;
};

Plan plan_for(int64_t B) {
  int64_t tile = kMinTileRows;  // whole strips, so every strip starts at a multiple of 4 rows
  if (B > tile * kMaxBlocks) tile = ((B + kMaxBlocks - 1) / kMaxBlocks + kStripRows - 1) / kStripRows * kStripRows;
  return {(B + tile - 1) / tile, tile};
}

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Byte offsets of the workspace fields; the last is the total size.
struct WorkspaceLayout {
  int64_t extents, block_counts, block_slots, scores, total;
};

WorkspaceLayout workspace_layout(int64_t B, int64_t blocks) {
  WorkspaceLayout l{};
  l.extents = align16(kHeaderWords * 4);
  l.block_counts = l.extents + align16(blocks * static_cast<int64_t>(sizeof(Extent)));
  l.block_slots = l.block_counts + align16(blocks * 8);
  l.scores = l.block_slots + align16(blocks * 8);
  l.total = l.scores + align16(B * 4);
  return l;
}

Workspace carve(void* base, int64_t B, int64_t blocks) {
  const WorkspaceLayout l = workspace_layout(B, blocks);
  auto* bytes = static_cast<unsigned char*>(base);
  auto* header = reinterpret_cast<uint32_t*>(bytes);
  return {header,
          header,
          header + kPasses * kBins,
          reinterpret_cast<Cutoff*>(header + kPasses * kBins + kTickets),
          reinterpret_cast<Extent*>(bytes + l.extents),
          reinterpret_cast<uint32_t*>(bytes + l.block_counts),
          reinterpret_cast<uint32_t*>(bytes + l.block_slots),
          reinterpret_cast<uint32_t*>(bytes + l.scores)};
}

// ----------------------------------------------------------------------------- block primitives

__device__ uint32_t warp_inclusive_scan(uint32_t value) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const uint32_t other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Exclusive prefix sum of one value per thread, in thread order; `total` gets the block's sum.
// Every thread of the block must call it (it has barriers).
__device__ uint32_t block_exclusive_scan(uint32_t value, uint32_t& total) {
  __shared__ uint32_t warp_sums[kWarpSize];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const uint32_t inclusive = warp_inclusive_scan(value);
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t scanned = warp_inclusive_scan(lane < warps ? warp_sums[lane] : 0u);
    if (lane < warps) warp_sums[lane] = scanned;  // inclusive over the warps
  }
  __syncthreads();
  const uint32_t before = (warp == 0 ? 0u : warp_sums[warp - 1]) + inclusive - value;
  total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next scan
  return before;
}

__device__ uint32_t block_sum(uint32_t value) {
  uint32_t total;
  block_exclusive_scan(value, total);
  return total;
}

__device__ Extent block_extent(Extent e) {
  __shared__ Extent warp_extents[kWarpSize];
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    e.high = fmaxf(e.high, __shfl_xor_sync(kFullMask, e.high, offset));
    e.low = fminf(e.low, __shfl_xor_sync(kFullMask, e.low, offset));
  }
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warp_extents[threadIdx.x / kWarpSize] = e;
  __syncthreads();
  Extent total = warp_extents[0];
  for (int w = 1; w < warps; ++w) {
    total.high = fmaxf(total.high, warp_extents[w].high);
    total.low = fminf(total.low, warp_extents[w].low);
  }
  __syncthreads();
  return total;
}

// Last-block-done (the threadFenceReduction pattern): true, in every thread, of the block that
// takes the last ticket; every other block's writes before its ticket are then visible to it
// (read them through volatile pointers, past the L1 cache). Nothing waits for another block.
__device__ bool is_last_block(uint32_t* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1u;
  __syncthreads();
  const bool result = last;
  if (result) __threadfence();
  __syncthreads();  // `last` is read before any later write to it
  return result;
}

// ----------------------------------------------------------------------------- rows

// Rows are taken in strips of kRowsPerThread * blockDim.x: thread t owns the kRowsPerThread
// consecutive rows from strip start + kRowsPerThread * t, whose loads it issues together before
// using any (one 16-byte load for four scores). A strip starts at a multiple of 4 rows.
__device__ __forceinline__ int64_t first_row_of_thread(int64_t strip) {
  return strip + static_cast<int64_t>(kRowsPerThread) * threadIdx.x;
}

__device__ __forceinline__ uint32_t candidate_score(const TopkArgs& a, int64_t row, float scale,
                                                    uint32_t step, float e) {
  if (!(e > 0.0f)) return 0;
  return ordered_score_bits(noisy_score(e, scale, a.seed, step, static_cast<uint32_t>(row)));
}

// Energies of rows [row0, row0 + 4), 0 past `last` (a user's tensor: no alignment assumed).
__device__ __forceinline__ void load_four_energies(const float* energy, int64_t row0, int64_t last,
                                                   float out[kRowsPerThread]) {
  for (int i = 0; i < kRowsPerThread; ++i) out[i] = row0 + i < last ? energy[row0 + i] : 0.0f;
  LZE_COUNT_ROW_READS(row0 >= last ? 0 : (last - row0 < kRowsPerThread ? last - row0 : kRowsPerThread));
}

// Scores of rows [row0, row0 + 4), 0 past `last`: one 16-byte load when all four are in (the
// workspace and shared memory are 16-byte aligned, and row0 a multiple of 4).
__device__ __forceinline__ void load_four_scores(const uint32_t* scores, int64_t row0, int64_t last,
                                                 uint32_t out[kRowsPerThread]) {
  if (row0 + kRowsPerThread <= last) {
    const int4 v = *reinterpret_cast<const int4*>(scores + row0);
    out[0] = static_cast<uint32_t>(v.x), out[1] = static_cast<uint32_t>(v.y);
    out[2] = static_cast<uint32_t>(v.z), out[3] = static_cast<uint32_t>(v.w);
    LZE_COUNT_ROW_READS(kRowsPerThread);
    return;
  }
  for (int i = 0; i < kRowsPerThread; ++i) out[i] = row0 + i < last ? scores[row0 + i] : 0u;
  LZE_COUNT_ROW_READS(row0 >= last ? 0 : last - row0);
}

// Largest and smallest candidate energy of rows [first, last), in every thread.
__device__ Extent rows_extent(const TopkArgs& a, int64_t first, int64_t last) {
  Extent e{-INFINITY, INFINITY};
  for (int64_t strip = first; strip < last; strip += kRowsPerThread * blockDim.x) {
    float energy[kRowsPerThread];
    load_four_energies(a.energy, first_row_of_thread(strip), last, energy);
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (!(energy[i] > 0.0f)) continue;
      e.high = fmaxf(e.high, energy[i]);
      e.low = fminf(e.low, energy[i]);
    }
  }
  return block_extent(e);
}

__device__ float noise_scale_of(const TopkArgs& a, Extent e) {
  return a.noise_scale > 0.0f ? gumbel_scale(a.noise_scale, e.high, e.low) : 0.0f;
}

__device__ __forceinline__ bool shares_prefix(uint32_t s, uint32_t prefix, int pass) {
  if (pass == 0) return true;
  const int chosen_from = digit_shift(pass) + digit_bits(pass);  // bits [chosen_from, 32) are set
  return (s >> chosen_from) == (prefix >> chosen_from);
}

__device__ __forceinline__ void count_digit(uint32_t s, int pass, uint32_t* histogram) {
  atomicAdd(&histogram[(s >> digit_shift(pass)) & ((1u << digit_bits(pass)) - 1u)], 1u);
}

// Scores of rows [first, last) into scores[row], each candidate counted in the histogram of the
// first digit.
__device__ void score_rows(const TopkArgs& a, int64_t first, int64_t last, float scale,
                           uint32_t* scores, uint32_t* histogram) {
  const uint32_t step = static_cast<uint32_t>(a.step_counter[0]);
  for (int64_t strip = first; strip < last; strip += kRowsPerThread * blockDim.x) {
    const int64_t row0 = first_row_of_thread(strip);
    float energy[kRowsPerThread];
    load_four_energies(a.energy, row0, last, energy);
    for (int i = 0; i < kRowsPerThread && row0 + i < last; ++i) {
      const uint32_t s = candidate_score(a, row0 + i, scale, step, energy[i]);
      scores[row0 + i] = s;
      if (s != 0) count_digit(s, 0, histogram);
    }
  }
}

// Counts the digit of `pass` of the candidates of rows [first, last) still tied with the cutoff.
__device__ void count_tied_rows(const uint32_t* scores, int64_t first, int64_t last, int pass,
                                uint32_t prefix, uint32_t* histogram) {
  for (int64_t strip = first; strip < last; strip += kRowsPerThread * blockDim.x) {
    uint32_t s[kRowsPerThread];
    load_four_scores(scores, first_row_of_thread(strip), last, s);
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (s[i] != 0 && shares_prefix(s[i], prefix, pass)) count_digit(s[i], pass, histogram);
    }
  }
}

__device__ void zero(uint32_t* words, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) words[i] = 0;
}

// ----------------------------------------------------------------------------- the cutoff

struct DigitChoice {
  uint32_t digit;
  uint32_t rank;
};

// Thread t of the block owns bins [high - per_thread, high), high = bins - t per_thread: thread
// 0 the highest.
struct BinRange {
  int low, high;
};

__device__ BinRange owned_bins(int bins) {
  const int per_thread = (bins + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int high = bins - static_cast<int>(threadIdx.x) * per_thread;
  const int low = high - per_thread;
  return {low < 0 ? 0 : low, high < 0 ? 0 : high};
}

__device__ uint32_t histogram_total(const volatile uint32_t* histogram, int bins) {
  const BinRange mine = owned_bins(bins);
  uint32_t count = 0;
  for (int b = mine.low; b < mine.high; ++b) count += histogram[b];
  return block_sum(count);
}

// The digit of the rank-th largest key counted in histogram[bins] (1 <= rank <= the total) and
// its rank among the keys with that digit, in every thread.
__device__ DigitChoice choose_digit(const volatile uint32_t* histogram, int bins, uint32_t rank) {
  __shared__ DigitChoice choice;
  const BinRange mine = owned_bins(bins);
  uint32_t count = 0;
  for (int b = mine.low; b < mine.high; ++b) count += histogram[b];
  uint32_t total;
  uint32_t above = block_exclusive_scan(count, total);  // keys in the bins of lower threads
  for (int b = mine.high - 1; b >= mine.low; --b) {
    const uint32_t h = histogram[b];
    if (above < rank && rank <= above + h) choice = {static_cast<uint32_t>(b), rank - above};
    above += h;
  }
  __syncthreads();
  const DigitChoice result = choice;
  __syncthreads();
  return result;
}

// The cutoff after the first digit's histogram (which counts every candidate).
__device__ Cutoff first_cutoff(const volatile uint32_t* histogram, int64_t k) {
  const uint32_t candidates = histogram_total(histogram, kBins);
  const uint32_t kept = candidates < k ? candidates : static_cast<uint32_t>(k);
  if (kept == 0) return {kNoThreshold, 0, 0, 0};
  const DigitChoice d = choose_digit(histogram, kBins, kept);
  return {d.digit << digit_shift(0), d.rank, kept, 0};
}

// The cutoff narrowed by the histogram of pass `pass` (1 or 2) of the rows tied with it.
__device__ Cutoff narrowed_cutoff(Cutoff c, const volatile uint32_t* histogram, int pass) {
  if (c.rank == 0) return c;  // uniform: nothing to keep
  const DigitChoice d = choose_digit(histogram, 1 << digit_bits(pass), c.rank);
  c.threshold |= d.digit << digit_shift(pass);
  c.rank = d.rank;
  return c;
}

// ----------------------------------------------------------------------------- outputs

// Slots before a range of rows: kept rows, and rows with s == T (which decide the tie rule).
struct Slots {
  uint32_t kept;
  uint32_t tied;
};

// keep_mask of rows [first, last) and kept_indices[slot] = row for the kept ones, in row order
// from `before`. All threads run the same number of strips (the scans have barriers); within its
// four rows a thread counts on from the scans' prefixes.
__device__ void write_rows(const TopkArgs& a, const uint32_t* scores, int64_t first, int64_t last,
                           Cutoff c, Slots before) {
  for (int64_t strip = first; strip < last; strip += kRowsPerThread * blockDim.x) {
    const int64_t row0 = first_row_of_thread(strip);
    uint32_t s[kRowsPerThread];
    load_four_scores(scores, row0, last, s);
    uint32_t tied_mine = 0;
    for (int i = 0; i < kRowsPerThread; ++i) tied_mine += s[i] != 0 && s[i] == c.threshold;
    uint32_t tied_here;
    uint32_t tie_rank = before.tied + block_exclusive_scan(tied_mine, tied_here);
    bool keep[kRowsPerThread];
    uint32_t kept_mine = 0;
    for (int i = 0; i < kRowsPerThread; ++i) {
      const bool tied = s[i] != 0 && s[i] == c.threshold;
      keep[i] = s[i] > c.threshold || (tied && tie_rank < c.rank);
      tie_rank += tied ? 1u : 0u;
      kept_mine += keep[i] ? 1u : 0u;
    }
    uint32_t kept_here;
    uint32_t slot = before.kept + block_exclusive_scan(kept_mine, kept_here);
    for (int i = 0; i < kRowsPerThread && row0 + i < last; ++i) {
      a.keep_mask[row0 + i] = keep[i] ? 1 : 0;
      if (keep[i] && slot < a.k) a.kept_indices[slot] = row0 + i;
      slot += keep[i] ? 1u : 0u;
    }
    before.kept += kept_here;
    before.tied += tied_here;
  }
}

// num_kept and the -1 padding of kept_indices[kept, k), spread over the whole grid.
__device__ void write_count_and_padding(const TopkArgs& a, uint32_t kept) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = kept + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < a.k;
       i += stride) {
    a.kept_indices[i] = -1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.num_kept = kept;
}

// ----------------------------------------------------------------------------- one block

// `workspace_scores`: B words of global memory for the scores, or null to keep them in dynamic
// shared memory. (A block's global writes are visible to its own threads after a barrier.)
__global__ void __launch_bounds__(kSmallThreads) small_topk_kernel(const TopkArgs a,
                                                                   uint32_t* workspace_scores) {
  LZE_DYNAMIC_SHARED(uint32_t, shared_scores);
  uint32_t* scores = workspace_scores != nullptr ? workspace_scores : shared_scores;
  __shared__ uint32_t histogram[kBins];
  const float scale = a.noise_scale > 0.0f ? noise_scale_of(a, rows_extent(a, 0, a.B)) : 0.0f;
  zero(histogram, kBins);
  __syncthreads();
  score_rows(a, 0, a.B, scale, scores, histogram);
  __syncthreads();
  Cutoff c = first_cutoff(histogram, a.k);
  for (int pass = 1; pass < kPasses; ++pass) {
    zero(histogram, kBins);
    __syncthreads();
    if (c.rank != 0) count_tied_rows(scores, 0, a.B, pass, c.threshold, histogram);
    __syncthreads();
    c = narrowed_cutoff(c, histogram, pass);
  }
  write_rows(a, scores, 0, a.B, c, Slots{0, 0});
  write_count_and_padding(a, c.kept);
}

// ----------------------------------------------------------------------------- many blocks

struct Tile {
  int64_t first, last;
};

__device__ Tile block_tile(const TopkArgs& a, int64_t tile_rows) {
  const int64_t first = blockIdx.x * tile_rows;
  return {first, first + tile_rows < a.B ? first + tile_rows : a.B};
}

// The last block's copy of the global histogram in its shared memory: one coalesced pass past
// L1 (volatile), so that the digit choice's several passes over the bins read shared memory.
__device__ void stage_histogram(const volatile uint32_t* global, uint32_t* shared) {
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) shared[b] = global[b];
  __syncthreads();
}

// Adds a block's shared histogram to the global one (only the bins it counted).
__device__ void merge_histogram(const uint32_t* shared, uint32_t* global) {
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    if (shared[b] != 0) atomicAdd(&global[b], shared[b]);
  }
}

__global__ void __launch_bounds__(kThreads) prepare_kernel(const TopkArgs a, Workspace w,
                                                           int64_t tile_rows) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < kHeaderWords;
       i += stride) {
    w.header[i] = 0;
  }
  if (a.noise_scale > 0.0f) {
    const Tile t = block_tile(a, tile_rows);
    const Extent e = rows_extent(a, t.first, t.last);
    if (threadIdx.x == 0) w.extents[blockIdx.x] = e;
  }
}

// The noise scale from every block's extent (at most kMaxBlocks of them).
__device__ float grid_noise_scale(const TopkArgs& a, const Workspace& w) {
  if (!(a.noise_scale > 0.0f)) return 0.0f;
  Extent e{-INFINITY, INFINITY};
  for (int64_t b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    e.high = fmaxf(e.high, w.extents[b].high);
    e.low = fminf(e.low, w.extents[b].low);
  }
  return noise_scale_of(a, block_extent(e));
}

__global__ void __launch_bounds__(kThreads) score_kernel(const TopkArgs a, Workspace w,
                                                         int64_t tile_rows) {
  __shared__ uint32_t histogram[kBins];
  const float scale = grid_noise_scale(a, w);
  const Tile t = block_tile(a, tile_rows);
  zero(histogram, kBins);
  __syncthreads();
  score_rows(a, t.first, t.last, scale, w.scores, histogram);
  __syncthreads();
  merge_histogram(histogram, w.histograms);
  if (!is_last_block(&w.tickets[0])) return;
  stage_histogram(w.histograms, histogram);
  const Cutoff c = first_cutoff(histogram, a.k);
  if (threadIdx.x == 0) *w.cutoff = c;
}

__global__ void __launch_bounds__(kThreads) refine_kernel(const TopkArgs a, Workspace w,
                                                          int64_t tile_rows, int pass) {
  __shared__ uint32_t histogram[kBins];
  const Cutoff c = *w.cutoff;
  if (c.rank == 0) return;  // uniform over the grid: nothing is kept
  const Tile t = block_tile(a, tile_rows);
  zero(histogram, kBins);
  __syncthreads();
  count_tied_rows(w.scores, t.first, t.last, pass, c.threshold, histogram);
  __syncthreads();
  uint32_t* global = w.histograms + pass * kBins;
  merge_histogram(histogram, global);
  if (!is_last_block(&w.tickets[pass])) return;
  stage_histogram(global, histogram);
  const Cutoff narrowed = narrowed_cutoff(c, histogram, pass);
  if (threadIdx.x == 0) *w.cutoff = narrowed;
}

// Rows of [first, last) above the cutoff and tied with it.
__device__ void count_block_rows(const Workspace& w, Tile t, Cutoff c) {
  uint32_t above = 0, tied = 0;
  for (int64_t strip = t.first; strip < t.last; strip += kRowsPerThread * blockDim.x) {
    uint32_t s[kRowsPerThread];
    load_four_scores(w.scores, first_row_of_thread(strip), t.last, s);
    for (int i = 0; i < kRowsPerThread; ++i) {
      above += s[i] > c.threshold ? 1u : 0u;
      tied += s[i] != 0 && s[i] == c.threshold ? 1u : 0u;
    }
  }
  above = block_sum(above);
  tied = block_sum(tied);
  if (threadIdx.x == 0) {
    w.block_counts[2 * blockIdx.x] = above;
    w.block_counts[2 * blockIdx.x + 1] = tied;
  }
}

// Each block's slots: prefix sums over the blocks of kept rows (above + the tied ones the tie
// rule keeps) and of tied rows. Run by one block.
__device__ void slots_from_counts(const Workspace& w, Cutoff c) {
  const volatile uint32_t* counts = w.block_counts;
  Slots before{0, 0};
  for (int64_t base = 0; base < gridDim.x; base += blockDim.x) {
    const int64_t b = base + threadIdx.x;
    const uint32_t above = b < gridDim.x ? counts[2 * b] : 0u;
    const uint32_t tied = b < gridDim.x ? counts[2 * b + 1] : 0u;
    uint32_t tied_here;
    const uint32_t tied_before = before.tied + block_exclusive_scan(tied, tied_here);
    const uint32_t room = c.rank > tied_before ? c.rank - tied_before : 0u;
    const uint32_t kept = above + (tied < room ? tied : room);
    uint32_t kept_here;
    const uint32_t kept_before = before.kept + block_exclusive_scan(kept, kept_here);
    if (b < gridDim.x) {
      w.block_slots[2 * b] = kept_before;
      w.block_slots[2 * b + 1] = tied_before;
    }
    before.kept += kept_here;
    before.tied += tied_here;
  }
}

__global__ void __launch_bounds__(kThreads) count_kernel(const TopkArgs a, Workspace w,
                                                         int64_t tile_rows) {
  const Cutoff c = *w.cutoff;
  count_block_rows(w, block_tile(a, tile_rows), c);
  if (is_last_block(&w.tickets[kPasses])) slots_from_counts(w, c);
}

__global__ void __launch_bounds__(kThreads) write_kernel(const TopkArgs a, Workspace w,
                                                         int64_t tile_rows) {
  const Cutoff c = *w.cutoff;
  const Slots before{w.block_slots[2 * blockIdx.x], w.block_slots[2 * blockIdx.x + 1]};
  const Tile t = block_tile(a, tile_rows);
  write_rows(a, w.scores, t.first, t.last, c, before);
  write_count_and_padding(a, c.kept);
}

}  // namespace lze::cuda_topk

extern "C" int64_t lze_topk_cuda_workspace_bytes(int64_t B) {
  using namespace lze::cuda_topk;
  if (B <= kSmallMaxRows) return 0;
  if (B <= kOneBlockMaxRows) return align16(B * static_cast<int64_t>(sizeof(uint32_t)));
  return workspace_layout(B, plan_for(B).blocks).total;
}

extern "C" int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale,
                             uint32_t seed, const int64_t* step_counter, uint8_t* keep_mask,
                             int64_t* kept_indices, int64_t* num_kept, void* workspace,
                             void* stream_ptr) {
  using namespace lze::cuda_topk;
  if (B == 0) return cudaSuccess;
  // Counts are uint32 and rows 32-bit Philox counters.
  if (B < 0 || B > 0x7fffffff || k < 1 || k > B) return cudaErrorInvalidValue;
  const TopkArgs a{energy, B, k, noise_scale, seed, step_counter, keep_mask, kept_indices,
                   num_kept};
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (B > kSmallMaxRows && workspace == nullptr) return cudaErrorInvalidValue;
  if (B <= kOneBlockMaxRows) {
    const bool in_shared = B <= kSmallMaxRows;
    LZE_LAUNCH(small_topk_kernel, dim3(1), dim3(kSmallThreads),
               in_shared ? B * sizeof(uint32_t) : 0, stream)(
        a, in_shared ? nullptr : static_cast<uint32_t*>(workspace));
    return static_cast<int>(cudaGetLastError());
  }
  const Plan p = plan_for(B);
  const Workspace w = carve(workspace, B, p.blocks);
  const dim3 grid(static_cast<unsigned>(p.blocks)), block(kThreads);
  LZE_LAUNCH(prepare_kernel, grid, block, 0, stream)(a, w, p.tile_rows);
  LZE_LAUNCH(score_kernel, grid, block, 0, stream)(a, w, p.tile_rows);
  for (int pass = 1; pass < kPasses; ++pass) {
    LZE_LAUNCH(refine_kernel, grid, block, 0, stream)(a, w, p.tile_rows, pass);
  }
  LZE_LAUNCH(count_kernel, grid, block, 0, stream)(a, w, p.tile_rows);
  LZE_LAUNCH(write_kernel, grid, block, 0, stream)(a, w, p.tile_rows);
  // A launch error is sticky until read: one check covers the six launches.
  return static_cast<int>(cudaGetLastError());
}

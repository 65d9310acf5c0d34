// Top-k selection of rows by energy (docs/spec.md §4), identical to
// lze_kernels/reference.topk_select(energy, k, noise_scale, seed, step=step_counter[0]): the
// same candidates (energy > 0), scores (Gumbel noise keyed by (seed, step_counter[0], row)) and
// order (descending score, ties to the smaller row); kept_indices in ascending row order, -1
// padded.
//
// Algorithm: a radix select of the k-th best score, linear in B. Each candidate's score becomes
// its 32-bit ordered bits s (lze::ordered_score_bits; 0 marks a non-candidate). Histogram passes
// over digits of s from the top find the k-th largest s, T, and `need`, how many rows with
// s == T are kept; every row with s > T is kept, and of the rows with s == T the `need` first in
// row order (the tie rule). A prefix count over rows then gives each kept row its slot, so
// kept_indices comes out in row order with no sort.
//
// Launch plans (selection_plan.h, made per batch size and device before anything is queued),
// both with no host sync and capturable in a CUDA graph:
//  * B <= 16,384: one block of 1,024 threads, one launch: the scores in dynamic shared memory
//    (4 B a row, 64 KiB at most), three passes of 11-, 11- and 10-bit digits over them with a
//    2,048-bin shared histogram, then the write (a block scan a strip). Above that size the
//    passes' strips, each a round trip on one SM, cost more than launches over all SMs: an H100
//    measured 196 us at 65,536 rows in one block against 134 us at 262,144 in six launches
//    (416255b's plans, docs/gpu-results.md).
//  * larger B: one block an SM (tiles of at least 4,096 and below 65,536 rows), two histogram
//    launches of 16-bit digits (128 KiB of packed counters a block) where the device allows it,
//    three of 11-, 11- and 10-bit digits otherwise (sm_86, sm_89), then the write launch.
//    Per row: energy read once (and the draw with noise), the score written once and read once
//    a later launch, the mask written once. The draws, the extent and the zeroed header come
//    from the selection step's step kernel (lze_select.cu) or, for a top-k alone
//    (ops.topk_mask), from prepare_kernel: one more launch.
// Histogram increments are warp-aggregated (__match_any_sync): binary rewards give a handful of
// distinct energies, whose bins the lanes of a warp would otherwise hit one after another.
//
// Every pass takes a block's rows in strips, each thread four consecutive rows whose loads it
// issues together (one 16-byte load of four scores): the passes are latency-bound at moderate B.
//
// Bounds: rows and positions are int64 in the loops; counts are uint32 (B < 2^31, checked by the
// launcher); every store to kept_indices is guarded by its position < k; a packed 16-bit counter
// counts at most a tile's rows (< 65,536). Shared memory: the one-block kernel 8,592 B static
// plus 4 B a row dynamic (72.6 KB at 16,384 rows: within sm_86/sm_89's 99 KB); the histogram
// kernels a few hundred bytes static plus 128 KiB (16-bit digits) or 4 KiB (11-bit) dynamic.
#include <stdint.h>

#include <mutex>

#include "block_reduce.h"
#include "cuda_compat.h"
#include "launchers.h"
#include "lze_cuda.h"

namespace lze::cuda_topk {

using cuda_select::Cutoff;
using cuda_select::Digit;
using cuda_select::digit_of;
using cuda_select::Extent;
using cuda_select::kFullMask;
using cuda_select::kNoThreshold;
using cuda_select::kRowsPerThread;
using cuda_select::kTicketWrite;
using cuda_select::kWarpSize;
using cuda_select::TopkPlan;
using cuda_select::Workspace;

constexpr int kSmallPasses = 3;  // the one-block plan's digits: 11, 11 and 10 bits
constexpr int kSmallBins = 1 << 11;

// The noise inputs of the scores: the Gumbel scale and, when prepared, the rows' draws.
struct Noise {
  float scale;         // 0: no noise
  const float* draws;  // [B] or null: draw each row's Gumbel noise here
};

// ----------------------------------------------------------------------------- rows

// Rows are taken in strips of kRowsPerThread * blockDim.x: thread t owns the kRowsPerThread
// consecutive rows from strip start + kRowsPerThread * t, whose loads it issues together before
// using any (one 16-byte load for four scores). A strip starts at a multiple of 4 rows.
__device__ __forceinline__ int64_t first_row_of_thread(int64_t strip) {
  return strip + static_cast<int64_t>(kRowsPerThread) * threadIdx.x;
}

__device__ __forceinline__ int64_t strip_rows() {
  return static_cast<int64_t>(kRowsPerThread) * blockDim.x;
}

__device__ __forceinline__ uint32_t candidate_score(const TopkArgs& a, int64_t row, Noise noise,
                                                    uint32_t step, float e) {
  if (!(e > 0.0f)) return 0;
  if (noise.draws != nullptr) return ordered_score_bits(score_with_draw(e, noise.scale, noise.draws[row]));
  return ordered_score_bits(noisy_score(e, noise.scale, a.seed, step, static_cast<uint32_t>(row)));
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
    const int4 v = LZE_LOAD_VECTOR(reinterpret_cast<const int4*>(scores + row0));
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
  Extent e = cuda_select::no_extent();
  for (int64_t strip = first; strip < last; strip += strip_rows()) {
    float energy[kRowsPerThread];
    load_four_energies(a.energy, first_row_of_thread(strip), last, energy);
    for (int i = 0; i < kRowsPerThread; ++i) e = cuda_select::with_energy(e, energy[i]);
  }
  return cuda_select::block_extent(e);
}

__device__ __forceinline__ float noise_scale_of(const TopkArgs& a, Extent e) {
  return a.noise_scale > 0.0f ? gumbel_scale(a.noise_scale, e.high, e.low) : 0.0f;
}

// Standard Gumbel draws of rows [first, last) into draws[row] (keyed as the top-k keys them).
__device__ void draw_rows(const TopkArgs& a, int64_t first, int64_t last, float* draws) {
  const uint32_t step = static_cast<uint32_t>(a.step_counter[0]);
  for (int64_t row = first + threadIdx.x; row < last; row += blockDim.x) {
    draws[row] = standard_gumbel(
        uniform_from_bits(philox_4x32_10(a.seed, step, static_cast<uint32_t>(row))));
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
  return cuda_select::block_sum(count);
}

// The digit of the rank-th largest key counted in histogram[bins] (1 <= rank <= the total) and
// its rank among the keys with that digit, in every thread.
__device__ DigitChoice choose_digit(const volatile uint32_t* histogram, int bins, uint32_t rank) {
  LZE_SHARED(DigitChoice, choice);
  const BinRange mine = owned_bins(bins);
  uint32_t count = 0;
  for (int b = mine.low; b < mine.high; ++b) count += histogram[b];
  uint32_t total;
  uint32_t above = cuda_select::block_exclusive_scan(count, total);  // keys in higher bins
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

// The cutoff after the first digit's histogram (which counts every candidate): the digit's bits
// at `shift`.
__device__ Cutoff first_cutoff(const volatile uint32_t* histogram, int bins, int shift, int64_t k) {
  const uint32_t candidates = histogram_total(histogram, bins);
  const uint32_t kept = candidates < k ? candidates : static_cast<uint32_t>(k);
  if (kept == 0) return {kNoThreshold, 0, 0, 0};
  const DigitChoice d = choose_digit(histogram, bins, kept);
  return {d.digit << shift, d.rank, kept, 0};
}

// The cutoff narrowed by the histogram of the next digit (at `shift`) of the rows tied with it.
__device__ Cutoff narrowed_cutoff(Cutoff c, const volatile uint32_t* histogram, int bins,
                                  int shift) {
  if (c.rank == 0) return c;  // uniform: nothing to keep
  const DigitChoice d = choose_digit(histogram, bins, c.rank);
  c.threshold |= d.digit << shift;
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
  for (int64_t strip = first; strip < last; strip += strip_rows()) {
    const int64_t row0 = first_row_of_thread(strip);
    uint32_t s[kRowsPerThread];
    load_four_scores(scores, row0, last, s);
    uint32_t tied_mine = 0;
    for (int i = 0; i < kRowsPerThread; ++i) tied_mine += s[i] != 0 && s[i] == c.threshold;
    uint32_t tied_here;
    uint32_t tie_rank = before.tied + cuda_select::block_exclusive_scan(tied_mine, tied_here);
    bool keep[kRowsPerThread];
    uint32_t kept_mine = 0;
    for (int i = 0; i < kRowsPerThread; ++i) {
      const bool tied = s[i] != 0 && s[i] == c.threshold;
      keep[i] = s[i] > c.threshold || (tied && tie_rank < c.rank);
      tie_rank += tied ? 1u : 0u;
      kept_mine += keep[i] ? 1u : 0u;
    }
    uint32_t kept_here;
    uint32_t slot = before.kept + cuda_select::block_exclusive_scan(kept_mine, kept_here);
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

// ----------------------------------------------------------------------------- counting

// The lanes of the calling warp that count the same digit as this lane, and whether this lane
// adds for them (the lowest). Called by every lane of the warp, counting or not.
struct Peers {
  uint32_t count;
  bool leader;
};

__device__ __forceinline__ Peers digit_peers(uint32_t digit, bool counting) {
  const unsigned counting_lanes = __ballot_sync(kFullMask, counting);
  if (!counting) return {0, false};
  const unsigned peers = __match_any_sync(counting_lanes, digit);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  return {static_cast<uint32_t>(__popc(peers)), lane == __ffs(static_cast<int>(peers)) - 1};
}

// One more in bin `digit` of a histogram of 32-bit counters for every lane that counts it.
__device__ __forceinline__ void count_digit(uint32_t* histogram, uint32_t digit, bool counting) {
  const Peers p = digit_peers(digit, counting);
  if (p.leader) atomicAdd(&histogram[digit], p.count);
}

// The same for packed 16-bit counters, two to a word (a tile never counts 65,536 rows).
__device__ __forceinline__ void count_packed(uint32_t* packed, uint32_t digit, bool counting) {
  const Peers p = digit_peers(digit, counting);
  if (p.leader) atomicAdd(&packed[digit >> 1], p.count << ((digit & 1u) * 16));
}

__device__ __forceinline__ uint32_t digit_value(uint32_t s, Digit d) {
  return (s >> d.shift) & ((1u << d.bits) - 1u);
}

// Whether score bits `s` share the digits above `d` with the cutoff's threshold.
__device__ __forceinline__ bool shares_prefix(uint32_t s, uint32_t threshold, Digit d) {
  const int above = d.shift + d.bits;
  return above >= 32 || (s >> above) == (threshold >> above);
}

// ----------------------------------------------------------------------------- one block

// `draws`/`extent`: prepared by the selection step's step kernel, or null (noise drawn here).
__global__ void __launch_bounds__(cuda_select::kSmallThreads) small_topk_kernel(
    const TopkArgs a, const float* draws, const Extent* extent) {
  LZE_DYNAMIC_SHARED(uint32_t, scores);
  LZE_SHARED(uint32_t[kSmallBins], histogram);
  Noise noise{0.0f, draws};
  if (a.noise_scale > 0.0f) {
    noise.scale = noise_scale_of(a, extent != nullptr ? *extent : rows_extent(a, 0, a.B));
  }
  const uint32_t step = static_cast<uint32_t>(a.step_counter[0]);
  const Digit top = digit_of(kSmallPasses, 0);
  zero(histogram, kSmallBins);
  __syncthreads();
  for (int64_t strip = 0; strip < a.B; strip += strip_rows()) {
    const int64_t row0 = first_row_of_thread(strip);
    float energy[kRowsPerThread];
    load_four_energies(a.energy, row0, a.B, energy);
    for (int i = 0; i < kRowsPerThread; ++i) {  // every lane, for the warp's counting
      const bool in = row0 + i < a.B;
      const uint32_t s = in ? candidate_score(a, row0 + i, noise, step, energy[i]) : 0u;
      if (in) scores[row0 + i] = s;
      count_digit(histogram, digit_value(s, top), s != 0);
    }
  }
  __syncthreads();
  Cutoff c = first_cutoff(histogram, kSmallBins, top.shift, a.k);
  for (int pass = 1; pass < kSmallPasses; ++pass) {
    const Digit d = digit_of(kSmallPasses, pass);
    zero(histogram, kSmallBins);
    __syncthreads();
    for (int64_t strip = 0; c.rank != 0 && strip < a.B; strip += strip_rows()) {
      uint32_t s[kRowsPerThread];
      load_four_scores(scores, first_row_of_thread(strip), a.B, s);
      for (int i = 0; i < kRowsPerThread; ++i) {
        count_digit(histogram, digit_value(s[i], d),
                    s[i] != 0 && shares_prefix(s[i], c.threshold, d));
      }
    }
    __syncthreads();
    c = narrowed_cutoff(c, histogram, 1 << d.bits, d.shift);
  }
  write_rows(a, scores, 0, a.B, c, Slots{0, 0});
  write_count_and_padding(a, c.kept);
}
LZE_KERNEL_RESOURCES(small_topk_kernel, cuda_select::kSmallThreads, 8592);

// ----------------------------------------------------------------------------- large plan

struct Tile {
  int64_t first, last;
};

__device__ __forceinline__ Tile tile_of(const TopkArgs& a, int64_t block, int64_t tile_rows) {
  const int64_t first = block * tile_rows;
  return {first, first + tile_rows < a.B ? first + tile_rows : a.B};
}

// Adds the block's packed counters of `bins` bins to the global histogram (only the bins it
// counted).
__device__ void merge_packed(const uint32_t* packed, uint32_t* global, int bins) {
  for (int w = threadIdx.x; w < bins / 2; w += blockDim.x) {
    const uint32_t v = packed[w];
    if ((v & 0xffffu) != 0) atomicAdd(&global[2 * w], v & 0xffffu);
    if ((v >> 16) != 0) atomicAdd(&global[2 * w + 1], v >> 16);
  }
}

// A top-k alone: zeroes the header, draws the rows' noise and writes each block's extent (in a
// selection step the step kernel does this). No last block reduces the extents: the header's
// tickets are being zeroed by this launch; score_kernel reduces them instead.
__global__ void __launch_bounds__(cuda_select::kLargeThreads) prepare_kernel(
    const TopkArgs a, Workspace w, int64_t header_words, int64_t tile_rows) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < header_words;
       i += stride) {
    w.header[i] = 0;
  }
  if (!(a.noise_scale > 0.0f)) return;
  const Tile t = tile_of(a, blockIdx.x, tile_rows);
  draw_rows(a, t.first, t.last, w.draws);
  const Extent e = rows_extent(a, t.first, t.last);
  if (threadIdx.x == 0) w.block_extents[blockIdx.x] = e;
}
LZE_KERNEL_RESOURCES(prepare_kernel, cuda_select::kLargeThreads, 256);

// The candidates' extent: reduced by the step kernel's last block, or (a top-k alone) from
// prepare_kernel's per-block extents, in every block (8 bytes a block, from L2).
__device__ Extent selection_extent(const Workspace& w, int64_t extent_blocks) {
  if (extent_blocks == 0) return *w.extent;
  return cuda_select::reduce_block_extents(w.block_extents, extent_blocks);
}

// (A) Scores of the tile into the workspace, their top digit counted; the last block picks the
// top digit of the k-th best score. `extent_blocks`: see selection_extent.
__global__ void __launch_bounds__(cuda_select::kLargeThreads) score_kernel(
    const TopkArgs a, Workspace w, int64_t tile_rows, int64_t extent_blocks, int passes) {
  LZE_DYNAMIC_SHARED(uint32_t, packed);
  const bool noisy = a.noise_scale > 0.0f;
  const Noise noise{noisy ? noise_scale_of(a, selection_extent(w, extent_blocks)) : 0.0f,
                    noisy ? w.draws : nullptr};
  const Digit top = digit_of(passes, 0);
  const int bins = 1 << top.bits;
  const Tile t = tile_of(a, blockIdx.x, tile_rows);
  zero(packed, bins / 2);
  __syncthreads();
  for (int64_t strip = t.first; strip < t.last; strip += strip_rows()) {
    const int64_t row0 = first_row_of_thread(strip);
    float energy[kRowsPerThread];
    load_four_energies(a.energy, row0, t.last, energy);
    for (int i = 0; i < kRowsPerThread; ++i) {  // every lane, for the warp's counting
      const bool in = row0 + i < t.last;
      const uint32_t s = in ? candidate_score(a, row0 + i, noise, 0, energy[i]) : 0u;  // draws given
      if (in) w.scores[row0 + i] = s;
      count_packed(packed, digit_value(s, top), s != 0);
    }
  }
  __syncthreads();
  merge_packed(packed, w.histograms[0], bins);
  if (!cuda_select::is_last_block(&w.tickets[0])) return;
  const Cutoff c = first_cutoff(w.histograms[0], bins, top.shift, a.k);
  if (threadIdx.x == 0) *w.cutoff = c;
}
LZE_KERNEL_RESOURCES(score_kernel, cuda_select::kLargeThreads, 400);

// (B) The rows tied with the digits chosen so far count their digit of pass `pass` (the filter
// fused into the histogram, `global`: the pass's global histogram); the last block narrows the
// cutoff by it (after the last pass: T and `need`).
__global__ void __launch_bounds__(cuda_select::kLargeThreads) refine_kernel(
    const TopkArgs a, Workspace w, int64_t tile_rows, int passes, int pass, uint32_t* global) {
  LZE_DYNAMIC_SHARED(uint32_t, packed);
  const Cutoff c = *w.cutoff;
  if (c.rank == 0) return;  // uniform over the grid: nothing is kept
  const Digit d = digit_of(passes, pass);
  const int bins = 1 << d.bits;
  const Tile t = tile_of(a, blockIdx.x, tile_rows);
  zero(packed, bins / 2);
  __syncthreads();
  for (int64_t strip = t.first; strip < t.last; strip += strip_rows()) {
    uint32_t s[kRowsPerThread];
    load_four_scores(w.scores, first_row_of_thread(strip), t.last, s);
    for (int i = 0; i < kRowsPerThread; ++i) {
      count_packed(packed, digit_value(s[i], d), s[i] != 0 && shares_prefix(s[i], c.threshold, d));
    }
  }
  __syncthreads();
  merge_packed(packed, global, bins);
  if (!cuda_select::is_last_block(&w.tickets[pass])) return;
  const Cutoff narrowed = narrowed_cutoff(c, global, bins, d.shift);
  if (threadIdx.x == 0) *w.cutoff = narrowed;
}
LZE_KERNEL_RESOURCES(refine_kernel, cuda_select::kLargeThreads, 144);

// Decoupled look-back words: a block's counts of rows above and tied with T (31 bits each) and
// whether they are its own (aggregate) or of it and every block before it (inclusive). 0: not
// yet published.
constexpr unsigned long long kAggregate = 1ull << 63, kInclusive = 1ull << 62;
constexpr unsigned long long kCountMask = (1ull << 31) - 1;

__device__ __forceinline__ unsigned long long pack_counts(Slots s, unsigned long long flag) {
  return flag | (static_cast<unsigned long long>(s.tied) << 31) | s.kept;
}

__device__ __forceinline__ Slots unpack_counts(unsigned long long word) {
  return {static_cast<uint32_t>(word & kCountMask), static_cast<uint32_t>((word >> 31) & kCountMask)};
}

// Rows above and tied with the cutoff among rows [first, last) (in .kept and .tied).
__device__ Slots count_tile(const uint32_t* scores, Tile t, Cutoff c) {
  uint32_t above = 0, tied = 0;
  for (int64_t strip = t.first; strip < t.last; strip += strip_rows()) {
    uint32_t s[kRowsPerThread];
    load_four_scores(scores, first_row_of_thread(strip), t.last, s);
    for (int i = 0; i < kRowsPerThread; ++i) {
      above += s[i] > c.threshold ? 1u : 0u;
      tied += s[i] != 0 && s[i] == c.threshold ? 1u : 0u;
    }
  }
  return {cuda_select::block_sum(above), cuda_select::block_sum(tied)};
}

// Counts of every block before `block` (logical order), by thread 0: publishes the block's own
// counts, walks back over the earlier blocks' words (waiting on those not yet published: each
// took an earlier ticket, so it has started and will publish) until one is inclusive, then
// publishes its inclusive counts.
__device__ Slots look_back(unsigned long long* words, int64_t block, Slots mine) {
  if (block == 0) {
    atomicExch(&words[0], pack_counts(mine, kInclusive));
    return {0, 0};
  }
  atomicExch(&words[block], pack_counts(mine, kAggregate));
  Slots before{0, 0};
  for (int64_t j = block - 1; j >= 0; --j) {
    unsigned long long word;
    while ((word = atomicAdd(&words[j], 0ull)) == 0) {
    }
    const Slots counts = unpack_counts(word);
    before.kept += counts.kept;
    before.tied += counts.tied;
    if (word & kInclusive) break;
  }
  atomicExch(&words[block], pack_counts(Slots{before.kept + mine.kept, before.tied + mine.tied},
                                        kInclusive));
  return before;
}

// (C) Each block, in the order its ticket gives, counts its tile's rows above and tied with T,
// takes the counts of the blocks before it (look_back) and writes its rows' mask and slots.
__global__ void __launch_bounds__(cuda_select::kLargeThreads) write_kernel(
    const TopkArgs a, Workspace w, int64_t tile_rows) {
  LZE_SHARED(int64_t, logical_block);
  LZE_SHARED(Slots, before);
  if (threadIdx.x == 0) logical_block = atomicAdd(&w.tickets[kTicketWrite], 1u);
  __syncthreads();
  const Cutoff c = *w.cutoff;
  const Tile t = tile_of(a, logical_block, tile_rows);
  const Slots mine = count_tile(w.scores, t, c);  // .kept holds the rows above T here
  if (threadIdx.x == 0) {
    const Slots earlier = look_back(w.lookback, logical_block, mine);
    // Kept before the tile: every row above T, and the first `need` rows tied with it.
    before = {earlier.kept + (earlier.tied < c.rank ? earlier.tied : c.rank), earlier.tied};
  }
  __syncthreads();
  write_rows(a, w.scores, t.first, t.last, c, before);
  write_count_and_padding(a, c.kept);
}
LZE_KERNEL_RESOURCES(write_kernel, cuda_select::kLargeThreads, 144);

// ----------------------------------------------------------------------------- plans

// Raises a kernel's dynamic shared memory limit on the current device to `bytes` when it is
// below (the opt-in).
template <typename Kernel>
cudaError_t allow_shared_bytes(Kernel kernel, int bytes) {
  cudaFuncAttributes attributes{};
  cudaError_t error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess || attributes.maxDynamicSharedSizeBytes >= bytes) return error;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename Kernel>
int static_shared_bytes(Kernel kernel) {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess
             ? static_cast<int>(attributes.sharedSizeBytes) : 0;
}

// What the current device offers the top-k, with every kernel's opt-in made: the one-block plan
// up to kOneBlockMaxRows where its static shared memory and 4 B a row fit the device's opt-in
// limit, and the widest histogram digits whose counters fit it too.
cudaError_t make_device_shape(cuda_select::DeviceShape* shape) {
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&shape->sms, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&shape->shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (error != cudaSuccess) return error;
  const int64_t room = shape->shared_optin - static_shared_bytes(small_topk_kernel);
  int64_t rows = room / 16 * 4;  // whole 16-byte groups of four rows
  shape->one_block_max_rows = rows < cuda_select::kOneBlockMaxRows ? (rows > 0 ? rows : 0)
                                                                   : cuda_select::kOneBlockMaxRows;
  if (shape->one_block_max_rows > 0) {
    error = allow_shared_bytes(small_topk_kernel, static_cast<int>(shape->one_block_max_rows * 4));
    if (error != cudaSuccess) return error;
  }
  shape->passes = 0;
  const int statics = static_shared_bytes(score_kernel) > static_shared_bytes(refine_kernel)
                          ? static_shared_bytes(score_kernel) : static_shared_bytes(refine_kernel);
  for (int passes : {2, 3}) {
    const int bytes = cuda_select::packed_histogram_bytes(digit_of(passes, 0).bits);
    if (statics + bytes > shape->shared_optin) continue;
    error = allow_shared_bytes(score_kernel, bytes);
    if (error == cudaSuccess) error = allow_shared_bytes(refine_kernel, bytes);
    if (error != cudaSuccess) return error;
    shape->passes = passes;
    break;
  }
  return cudaSuccess;
}

// The devices' shapes, each made once (the first plan on a device makes its opt-ins).
class DeviceShapes {
 public:
  static DeviceShapes& get() {
    static DeviceShapes shapes;
    return shapes;
  }

  cudaError_t shape(int device, cuda_select::DeviceShape* shape) {
    if (device < 0 || device >= kDevices) return cudaErrorInvalidDevice;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!known_[device]) {
      const cuda::DeviceGuard guard(device);
      if (guard.error() != cudaSuccess) return guard.error();
      const cudaError_t error = make_device_shape(&shapes_[device]);
      if (error != cudaSuccess) return error;
      known_[device] = true;
    }
    *shape = shapes_[device];
    return cudaSuccess;
  }

  // After the devices change (the emulator's tests): every shape made again.
  void forget() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (bool& k : known_) k = false;
  }

 private:
  static constexpr int kDevices = 64;
  std::mutex mutex_;
  cuda_select::DeviceShape shapes_[kDevices] = {};
  bool known_[kDevices] = {};
};

cudaError_t device_shape(int device, cuda_select::DeviceShape* shape) {
  return DeviceShapes::get().shape(device, shape);
}

// ----------------------------------------------------------------------------- launch

void launch_small(const TopkArgs& a, const TopkPlan& p, const float* draws, const Extent* extent,
                  cudaStream_t stream) {
  LZE_LAUNCH(small_topk_kernel, dim3(1), dim3(cuda_select::kSmallThreads), p.shared_bytes,
             stream)(a, draws, extent);
}

void launch_large(const TopkArgs& a, const TopkPlan& p, const Workspace& w, bool prepared,
                  cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.blocks)), block(cuda_select::kLargeThreads);
  if (!prepared) {
    LZE_LAUNCH(prepare_kernel, grid, block, 0, stream)(a, w, cuda_select::header_words(p),
                                                        p.tile_rows);
  }
  LZE_LAUNCH(score_kernel, grid, block, p.shared_bytes, stream)(
      a, w, p.tile_rows, prepared ? 0 : p.blocks, p.passes);
  for (int pass = 1; pass < p.passes; ++pass) {
    const int bytes = cuda_select::packed_histogram_bytes(digit_of(p.passes, pass).bits);
    LZE_LAUNCH(refine_kernel, grid, block, bytes, stream)(a, w, p.tile_rows, p.passes, pass,
                                                          w.histograms[pass]);
  }
  LZE_LAUNCH(write_kernel, grid, block, 0, stream)(a, w, p.tile_rows);
}

int launch_topk(const TopkArgs& a, const TopkPlan& p, void* workspace, int64_t extent_blocks,
                bool prepared, cudaStream_t stream) {
  if (p.one_block && !prepared) {
    launch_small(a, p, nullptr, nullptr, stream);
  } else {
    const Workspace w = cuda_select::carve(workspace, p, extent_blocks);
    const bool noise = a.noise_scale > 0.0f;
    if (p.one_block) {
      launch_small(a, p, noise ? w.draws : nullptr, noise ? w.extent : nullptr, stream);
    } else {
      launch_large(a, p, w, prepared, stream);
    }
  }
  // A launch error is sticky until read: one check covers the launches.
  return static_cast<int>(cudaGetLastError());
}

int plan_topk(int64_t B, int device, TopkPlan* plan) {
  cuda_select::DeviceShape shape{};
  const cudaError_t error = device_shape(device, &shape);
  if (error != cudaSuccess) return error;
  return cuda_select::make_topk_plan(B, shape, plan) ? 0 : cuda::kNoPlan;
}

}  // namespace lze::cuda_topk

extern "C" int lze_cuda_device_shape(int32_t device, lze::cuda_select::DeviceShape* shape) {
  return lze::cuda_topk::device_shape(device, shape);
}

extern "C" void lze_cuda_forget_device_shapes() { lze::cuda_topk::DeviceShapes::get().forget(); }

extern "C" int lze_topk_cuda_plan(int64_t B, int32_t device, lze::cuda_select::TopkPlan* plan) {
  if (B < 1 || B > 0x7fffffff) return cudaErrorInvalidValue;
  return lze::cuda_topk::plan_topk(B, device, plan);
}

extern "C" int64_t lze_topk_cuda_workspace_bytes(const lze::cuda_select::TopkPlan* plan) {
  using namespace lze::cuda_select;
  if (plan->one_block) return 0;
  return workspace_layout(*plan, plan->blocks).total;
}

extern "C" int lze_topk_cuda(const float* energy, int64_t B, int64_t k, float noise_scale,
                             uint32_t seed, const int64_t* step_counter, uint8_t* keep_mask,
                             int64_t* kept_indices, int64_t* num_kept, void* workspace,
                             const lze::cuda_select::TopkPlan* plan, int32_t device,
                             void* stream_ptr) {
  using namespace lze::cuda_topk;
  // Counts are uint32 and rows 32-bit Philox counters.
  if (B < 1 || B > 0x7fffffff || k < 1 || k > B || plan->B != B) return cudaErrorInvalidValue;
  if (!plan->one_block && workspace == nullptr) return cudaErrorInvalidValue;
  const lze::cuda::DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  const TopkArgs a{energy, B, k, noise_scale, seed, step_counter, keep_mask, kept_indices,
                   num_kept};
  return launch_topk(a, *plan, workspace, plan->blocks, false,
                     static_cast<cudaStream_t>(stream_ptr));
}

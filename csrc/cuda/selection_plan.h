// Launch plans and workspace of the top-k selection (csrc/cuda/lze_topk.cu), shared with the step
// kernel (csrc/cuda/lze_step.cu), which prepares the selection's inputs in a selection step
// (csrc/cuda/lze_select.cu): the Gumbel draws, the energies' extent and a zeroed header.
//
// A plan is made on the host for a batch size and a device, from the device's limits (SM count,
// shared memory a block may use with the opt-in) and the kernels' static shared memory, before
// anything is queued: every opt-in happens then, and a batch no plan fits is refused then
// (lze_topk.cu: device_shape, make_topk_plan). Plans (B rows, k kept):
//  * B <= one_block_max_rows (16,384 on every architecture users run): one block of
//    kSmallThreads threads, the scores in dynamic shared memory (4 B a row: 64 KiB at 16,384
//    rows, with the opt-in above 48 KiB minus the kernel's static shared memory), three histogram
//    passes of 11-, 11- and 10-bit digits over them. One launch.
//  * larger B: blocks of kLargeThreads threads, each a tile of consecutive rows, as many blocks
//    as the device has SMs once B fills them (tiles of at least one strip, kLargeMinTileRows, and
//    below 65,536 rows, so that 16-bit counters never carry), over `passes` histogram launches
//    and a write launch: (A) score the tile's rows into the workspace and count the top digit of
//    each score in a per-block histogram of packed 16-bit counters in shared memory, merged into
//    a global one; the last block (a ticket) picks the digit of the k-th best score; (B) the
//    rows still tied with the digits chosen so far count their next digit the same way (the
//    filter fused into the next histogram, as AIR top-k, Zhang et al. 2023, does), and the last
//    block narrows the cutoff; after the last digit it is the k-th best score T and how many
//    rows equal to it are kept; (C) each block counts its rows above and tied with T, takes the
//    prefix of the earlier blocks' counts by decoupled look-back (Merrill and Garland 2016: a
//    block waits only on blocks that took an earlier ticket, which have started and so finish),
//    and writes its rows' mask and slots in row order. Two 16-bit digits (128 KiB of counters a
//    block) where the device allows that much shared memory a block (sm_80: 163 KB, sm_90:
//    227 KB), else three digits of 11, 11 and 10 bits (4 KiB a block; sm_86 and sm_89: 99 KB).
//    Before (A), something must have zeroed the header and produced the draws and the extent:
//    the step kernel of a selection step, or prepare_kernel (one more launch) for a top-k alone.
//
// Workspace (one device buffer, any contents; offsets 16-byte aligned): the header (the passes'
// global histograms, a ticket a pass and one for the write, the cutoff, the P look-back words),
// the extent, per-block extents of whoever computed them, the draws [B] fp32 (noise only) and the
// scores [B] (large plan only). At B = 1M on an H100, G <= 32: 512 KiB + 16 B + 32 KiB + 4 MiB +
// 4 MiB.
#pragma once
#include <stdint.h>

#include "../lze_math.h"  // LZE_HD

namespace lze::cuda_select {

#if defined(LZE_EMU_SMALL_PLANS)
// The same plans with a quarter of the threads and smaller limits, so that a few thousand rows
// span every plan and tile boundary: the emulator under ThreadSanitizer runs a CUDA thread on an
// OS thread and pays for every barrier by the thread (tools/emu_tsan.sh). The code is the same
// for any block size that is a multiple of 32.
constexpr int kSmallThreads = 256;
constexpr int kLargeThreads = 256;
constexpr int64_t kOneBlockMaxRows = 2048;
#else
constexpr int kSmallThreads = 1024;
constexpr int kLargeThreads = 1024;
constexpr int64_t kOneBlockMaxRows = 16384;
#endif
constexpr int kRowsPerThread = 4;  // consecutive rows a thread takes in each strip of a block
constexpr int64_t kStripRows = static_cast<int64_t>(kRowsPerThread) * kLargeThreads;
constexpr int64_t kLargeMinTileRows = kStripRows;  // a block's rows, at least
constexpr int64_t kLargeMaxTileRows = 61440;       // 16-bit counters: a tile below 65,536 rows
constexpr int kMaxPasses = 3;
constexpr int kTickets = kMaxPasses + 1;  // a pass's last block, then the write's order
constexpr int kTicketWrite = kMaxPasses;

// Rows a block of the step kernel takes (lze_step.cu): a tile of 256 rows for G <= 32, one
// warp a row (8 a block) above.
constexpr int64_t kStepTileRows = 256;
constexpr int64_t kStepWarpRows = 8;
constexpr int64_t kStepTileMaxGroup = 32;

// Digits of a score, from the top: two of 16 bits, or three of 11, 11 and 10 (the one-block
// plan's, and the large plan's where 128 KiB of counters do not fit a block).
struct Digit {
  int shift;
  int bits;
};
LZE_HD constexpr Digit digit_of(int passes, int pass) {
  return passes == 2 ? Digit{pass == 0 ? 16 : 0, 16}
                     : Digit{pass == 0 ? 21 : pass == 1 ? 10 : 0, pass == 2 ? 10 : 11};
}
// Shared memory of a histogram of a digit of `bits` in packed 16-bit counters.
LZE_HD constexpr int packed_histogram_bytes(int bits) { return (1 << bits) / 2 * 4; }

// What a device offers the top-k: its SMs, the shared memory a block may use with the opt-in,
// and what fits in it (lze_topk.cu: device_shape). passes 0: no large plan fits.
struct DeviceShape {
  int sms;
  int shared_optin;
  int64_t one_block_max_rows;
  int passes;
};

struct TopkPlan {
  int64_t B;
  int32_t one_block;     // 1: the one-block plan
  int32_t passes;        // histogram launches of the large plan
  int64_t blocks;        // of each launch (1: one block)
  int64_t tile_rows;
  int32_t shared_bytes;  // dynamic shared memory a block asks for (static comes on top)
  int32_t launches;      // of a selection step's top-k (a top-k alone adds prepare_kernel)
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The plan of B rows on a device of `shape`; false when none fits (B above the one-block plan's
// limit on a device without a large plan).
inline bool make_topk_plan(int64_t B, const DeviceShape& shape, TopkPlan* plan) {
  *plan = TopkPlan{B, 1, 0, 1, B, static_cast<int32_t>(B * 4), 1};
  if (B <= shape.one_block_max_rows) return true;
  if (shape.passes == 0) return false;
  int64_t tile = ceil_div(ceil_div(B, shape.sms), kRowsPerThread) * kRowsPerThread;
  tile = tile < kLargeMinTileRows ? kLargeMinTileRows : tile;
  tile = tile > kLargeMaxTileRows ? kLargeMaxTileRows : tile;
  const int first_bits = digit_of(shape.passes, 0).bits;
  *plan = TopkPlan{B, 0, shape.passes, ceil_div(B, tile), tile,
                   packed_histogram_bytes(first_bits), shape.passes + 1};
  return true;
}

// Blocks of the step kernel for B rows and G rollouts (at least one: the step counter advances).
inline int64_t step_blocks(int64_t B, int64_t G) {
  const int64_t rows = G <= kStepTileMaxGroup ? kStepTileRows : kStepWarpRows;
  return B == 0 ? 1 : ceil_div(B, rows);
}

inline int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

struct Extent {
  float high;  // largest candidate energy, -inf without candidates
  float low;   // smallest, +inf without candidates
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

constexpr uint32_t kNoThreshold = 0xffffffffu;  // above every candidate's s: nothing kept

// The workspace's fields. `extent_blocks` is the grid that computes the per-block extents (the
// step kernel's, or prepare_kernel's for a top-k alone).
struct Workspace {
  uint32_t* header;        // [header_words]: the fields below, zeroed before the large plan
  uint32_t* histograms[kMaxPasses];  // [1 << bits of the pass]
  uint32_t* tickets;       // [kTickets]
  Cutoff* cutoff;
  unsigned long long* lookback;  // [P]: a block's published counts (lze_topk.cu)
  Extent* extent;          // the candidates' extent, reduced by the last block of its grid
  Extent* block_extents;   // [extent_blocks]
  float* draws;            // [B] standard Gumbel draws of the rows (noise only)
  uint32_t* scores;        // [B] (large plan only)
};

struct WorkspaceLayout {
  int64_t header_words, extent, block_extents, draws, scores, total;
};

inline int64_t histogram_words(const TopkPlan& p) {
  int64_t words = 0;
  for (int pass = 0; pass < p.passes; ++pass) words += int64_t{1} << digit_of(p.passes, pass).bits;
  return words;
}

inline int64_t header_words(const TopkPlan& p) {
  if (p.one_block) return 0;
  return histogram_words(p) + kTickets + int64_t{sizeof(Cutoff) / 4} + 2 * p.blocks;
}

inline WorkspaceLayout workspace_layout(const TopkPlan& p, int64_t extent_blocks) {
  WorkspaceLayout l{};
  l.header_words = header_words(p);
  l.extent = align16(l.header_words * 4);
  l.block_extents = l.extent + align16(sizeof(Extent));
  l.draws = l.block_extents + align16(extent_blocks * int64_t{sizeof(Extent)});
  l.scores = l.draws + align16(p.B * 4);
  l.total = l.scores + (p.one_block ? 0 : align16(p.B * 4));
  return l;
}

inline Workspace carve(void* base, const TopkPlan& p, int64_t extent_blocks) {
  const WorkspaceLayout l = workspace_layout(p, extent_blocks);
  auto* bytes = static_cast<unsigned char*>(base);
  auto* header = reinterpret_cast<uint32_t*>(bytes);
  Workspace w{};
  w.header = header;
  uint32_t* next = header;
  for (int pass = 0; pass < p.passes; ++pass) {
    w.histograms[pass] = next;
    next += uint32_t{1} << digit_of(p.passes, pass).bits;
  }
  w.tickets = next;
  w.cutoff = reinterpret_cast<Cutoff*>(next + kTickets);
  w.lookback = reinterpret_cast<unsigned long long*>(next + kTickets + 4);
  w.extent = reinterpret_cast<Extent*>(bytes + l.extent);
  w.block_extents = reinterpret_cast<Extent*>(bytes + l.block_extents);
  w.draws = reinterpret_cast<float*>(bytes + l.draws);
  w.scores = p.one_block ? nullptr : reinterpret_cast<uint32_t*>(bytes + l.scores);
  return w;
}

}  // namespace lze::cuda_select

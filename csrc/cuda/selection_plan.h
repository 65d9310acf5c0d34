// Launch plans and workspace of the top-k selection (csrc/cuda/lze_topk.cu), shared with the step
// kernel (csrc/cuda/lze_step.cu), which prepares the selection's inputs in a selection step
// (csrc/cuda/lze_select.cu): the Gumbel draws, the energies' extent and a zeroed header.
//
// Plans (B rows, k kept):
//  * B <= kOneBlockMaxRows (16,384): one block of kSmallThreads threads, the scores in dynamic
//    shared memory (4 B a row: 64 KiB at 16,384 rows, with the opt-in above the 48 KiB default;
//    H100 allows 227 KiB a block, A100 163 KiB), three histogram passes of 11-bit digits over
//    them. One launch.
//  * larger B: three launches over P blocks of kLargeThreads threads, each block a tile of
//    tile_rows consecutive rows (LargePlan): (A) score the rows into the workspace and count
//    the top 16 bits of each score in a per-block histogram of 65,536 packed 16-bit counters in
//    shared memory (128 KiB), merged into a global one; the last block (a ticket) picks the 16
//    top bits of the k-th best score; (B) the rows still tied with them count their low 16 bits
//    the same way (the filter fused into the next histogram, as AIR top-k, Zhang et al. 2023,
//    does), and the last block completes the k-th best score T and how many rows equal to it
//    are kept; (C) each block counts its rows above and tied with T, takes the prefix of the
//    earlier blocks' counts by decoupled look-back (Merrill and Garland 2016: a block waits
//    only on blocks that took an earlier ticket, which have started and so finish), and writes
//    its rows' mask and slots in row order.
//    Before (A), something must have zeroed the header and produced the draws and the extent:
//    the step kernel of a selection step, or prepare_kernel (a fourth launch) for a top-k alone.
//
// Workspace (one device buffer, any contents; offsets 16-byte aligned): the header (two global
// histograms of 65,536 words, 4 tickets, the cutoff, the P look-back words: 512 KiB + 8 B P),
// the extent, per-block extents of whoever computed them, the draws [B] fp32 (noise only) and
// the scores [B] (large plan only). At B = 1M, G <= 32: 512 KiB + 16 KiB + 32 KiB + 4 MiB + 4 MiB.
#pragma once
#include <stdint.h>

namespace lze::cuda_select {

#if defined(LZE_EMU_SMALL_PLANS)
// The same plans with a quarter of the threads and smaller limits, so that a few thousand rows
// span every plan and tile boundary: the emulator under ThreadSanitizer runs a CUDA thread on an
// OS thread and pays for every barrier by the thread (tools/emu_tsan.sh). The code is the same
// for any block size that is a multiple of 32.
constexpr int kSmallThreads = 256;
constexpr int kLargeThreads = 256;
constexpr int64_t kOneBlockMaxRows = 2048;
constexpr int64_t kLargeTileRows = 1024;
#else
constexpr int kSmallThreads = 1024;
constexpr int kLargeThreads = 1024;
constexpr int64_t kOneBlockMaxRows = 16384;
constexpr int64_t kLargeTileRows = 16384;      // rows a block of the large plan, at least
#endif
constexpr int kRowsPerThread = 4;  // consecutive rows a thread takes in each strip of a block
constexpr int64_t kStripRows = static_cast<int64_t>(kRowsPerThread) * kLargeThreads;
constexpr int64_t kLargeMaxBlocks = 1024;      // blocks of the large plan, up to 16M rows
constexpr int64_t kLargeMaxTileRows = 61440;   // 16-bit counters: a tile below 65,536 rows
constexpr int kDigitBits = 16;
constexpr int kBins = 1 << kDigitBits;
constexpr int kTickets = 4;  // score, refine, write (logical block ids), spare

// Rows a block of the step kernel takes (lze_step.cu): a tile of 256 rows for G <= 32, one
// warp a row (8 a block) above.
constexpr int64_t kStepTileRows = 256;
constexpr int64_t kStepWarpRows = 8;
constexpr int64_t kStepTileMaxGroup = 32;

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

struct LargePlan {
  int64_t blocks;
  int64_t tile_rows;
};

inline LargePlan large_plan(int64_t B) {
  int64_t tile = kLargeTileRows;
  if (B > tile * kLargeMaxBlocks) {
    tile = ((B + kLargeMaxBlocks - 1) / kLargeMaxBlocks + kStripRows - 1) / kStripRows * kStripRows;
    if (tile > kLargeMaxTileRows) tile = kLargeMaxTileRows;
  }
  return {(B + tile - 1) / tile, tile};
}

inline bool one_block(int64_t B) { return B <= kOneBlockMaxRows; }

// Blocks of the step kernel for B rows and G rollouts (at least one: the step counter advances).
inline int64_t step_blocks(int64_t B, int64_t G) {
  const int64_t rows = G <= kStepTileMaxGroup ? kStepTileRows : kStepWarpRows;
  return B == 0 ? 1 : (B + rows - 1) / rows;
}

inline int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The workspace's fields. `extent_blocks` is the grid that computes the per-block extents (the
// step kernel's, or prepare_kernel's for a top-k alone).
struct Workspace {
  uint32_t* header;        // [header_words]: the five fields below, zeroed before the large plan
  uint32_t* histograms;    // [2][kBins]
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

inline int64_t header_words(int64_t B) {
  if (one_block(B)) return 0;
  return 2 * int64_t{kBins} + kTickets + int64_t{sizeof(Cutoff) / 4} + 2 * large_plan(B).blocks;
}

inline WorkspaceLayout workspace_layout(int64_t B, int64_t extent_blocks) {
  WorkspaceLayout l{};
  l.header_words = header_words(B);
  l.extent = align16(l.header_words * 4);
  l.block_extents = l.extent + align16(sizeof(Extent));
  l.draws = l.block_extents + align16(extent_blocks * int64_t{sizeof(Extent)});
  l.scores = l.draws + align16(B * 4);
  l.total = l.scores + (one_block(B) ? 0 : align16(B * 4));
  return l;
}

inline Workspace carve(void* base, int64_t B, int64_t extent_blocks) {
  const WorkspaceLayout l = workspace_layout(B, extent_blocks);
  auto* bytes = static_cast<unsigned char*>(base);
  auto* header = reinterpret_cast<uint32_t*>(bytes);
  Workspace w{};
  w.header = header;
  w.histograms = header;
  w.tickets = header + 2 * kBins;
  w.cutoff = reinterpret_cast<Cutoff*>(header + 2 * kBins + kTickets);
  w.lookback = reinterpret_cast<unsigned long long*>(header + 2 * kBins + kTickets + 4);
  w.extent = reinterpret_cast<Extent*>(bytes + l.extent);
  w.block_extents = reinterpret_cast<Extent*>(bytes + l.block_extents);
  w.draws = reinterpret_cast<float*>(bytes + l.draws);
  w.scores = one_block(B) ? nullptr : reinterpret_cast<uint32_t*>(bytes + l.scores);
  return w;
}

}  // namespace lze::cuda_select

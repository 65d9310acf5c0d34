// One running block of the emulator (part of csrc/emu/cuda_emu.h): its CUDA threads, their
// barriers and warp collectives, its shared memory, and the spin watch.
//
// Two execution modes, chosen at compile time:
//  * Fibers (default). The CUDA threads of a block are fibers on one worker OS thread, switched
//    by a small hand-written x86-64 context switch only where a thread must wait for others:
//    __syncthreads and the _sync warp intrinsics. A fiber never moves to another worker.
//  * OS threads (-DLZE_EMU_OS_THREADS). Every CUDA thread of a block runs on an OS thread of its
//    own, so ThreadSanitizer sees every CUDA thread and reports races between threads of a block
//    (e.g. warp-synchronous shared-memory code without __syncwarp).
//
// Shared memory. Both kinds live with the block, as on a GPU, and start poisoned, never zeroed
// (a byte pattern that changes from launch to launch): a kernel that reads shared memory before
// writing it reads garbage here as it would on a GPU. Static variables are declared with
// LZE_SHARED (cuda_compat.h); the first thread of the block to reach a declaration places it in
// the block's static area, which holds the kernel's declared static shared memory: a kernel
// whose variables need more than it declared stops the process.
//
// Spin watch. An atomic that leaves its word unchanged (atomicAdd(p, 0), a failed atomicCAS, ...)
// and returns the value the thread's previous atomic on that word returned is a poll; a write,
// another word or a new value seen is progress. A thread that polls on and on while other threads
// of its block could run is a spin-wait inside a block (rule 4 of cuda_compat.h): in fiber mode
// it would never yield, on a GPU it is a hang or a race. The grid (emu_grid.h) is told of long
// spins to judge forward progress between blocks, on what memory holds, not on how long a thread
// spun: a worker the OS has descheduled is slow, not stuck.
#pragma once

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef LZE_EMU_OS_THREADS
#include <condition_variable>
#else
#if !defined(__x86_64__)
#error "cuda_emu.h: the fiber mode has an x86-64 context switch only; build with -DLZE_EMU_OS_THREADS"
#endif
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "emu_device.h"

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;
// Polls without progress after which a thread's spin is reported to the grid (which stops the
// process only when every resident block waits on a word that still holds what it saw), and
// after which it is a hang whatever else runs (minutes of polling: not a descheduled peer).
constexpr uint64_t kLongSpin = uint64_t{1} << 16;
constexpr uint64_t kHopelessSpin = uint64_t{1} << 34;

enum class WarpOp : uint8_t { kSync, kBallot, kMatchAny, kShflIdx, kShflUp, kShflDown, kShflXor };

// What one lane brought to a warp collective.
struct LaneRequest {
  WarpOp op;
  unsigned mask;
  uint64_t value;  // the lane's operand (shuffled bits, vote predicate, matched value)
  unsigned arg;    // source lane, delta or xor mask of a shuffle
  unsigned width;  // shuffle segment width
};

struct Block;
struct Grid;

struct Thread {
  uint3 idx{};
  unsigned lane = 0;
  unsigned warp = 0;
  Block* block = nullptr;
  bool waiting = false;     // blocked in a barrier or warp collective until released
  bool at_barrier = false;  // waiting in __syncthreads
  bool done = false;
  uint64_t polls = 0;       // atomics in a row that changed nothing and saw the same value
  const void* polled = nullptr;   // their word,
  uint64_t polled_value = 0;      // the value they returned (its bytes, zero-extended)
  unsigned polled_size = 0;       // and its size in bytes
  LaneRequest request{};
  uint64_t result = 0;
#ifdef LZE_EMU_OS_THREADS
  std::condition_variable wakeup;
#else
  void* stack_pointer = nullptr;  // saved context while switched out
#endif
};

struct Warp {
  unsigned present = 0;  // lanes that exist (the last warp of a block may be partial)
  unsigned arrived = 0;  // lanes waiting in a collective
};

// A static shared variable placed in the block's static area.
struct SharedSite {
  const void* site;
  size_t offset;
};

struct Block {
  uint3 idx;
  dim3 dim;
  Grid* grid;
  void* dynamic_shared;
  unsigned char* static_area;
  size_t static_capacity;
  size_t static_used = 0;
  std::vector<SharedSite> sites;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  unsigned live;            // threads that have not exited
  unsigned at_barrier = 0;  // threads waiting in __syncthreads
#ifdef LZE_EMU_OS_THREADS
  std::mutex mutex;
#else
  void* scheduler_sp = nullptr;  // the worker's context while a fiber runs
#endif

  Block(uint3 idx_, dim3 dim_, Grid* grid_, void* dynamic, unsigned char* static_area_,
        size_t static_capacity_)
      : idx(idx_), dim(dim_), grid(grid_), dynamic_shared(dynamic), static_area(static_area_),
        static_capacity(static_capacity_), threads(dim_.x * dim_.y * dim_.z),
        warps((threads.size() + kWarpSize - 1) / kWarpSize),
        live(static_cast<unsigned>(threads.size())) {
    for (unsigned i = 0; i < threads.size(); ++i) {
      Thread& t = threads[i];
      t.idx = {i % dim.x, (i / dim.x) % dim.y, i / (dim.x * dim.y)};
      t.lane = i % kWarpSize;
      t.warp = i / kWarpSize;
      t.block = this;
      warps[t.warp].present |= 1u << t.lane;
    }
  }
};

// The CUDA thread running on this OS thread (in fiber mode: the fiber switched in last).
inline thread_local Thread* tls_thread = nullptr;

inline Thread& current() { return *tls_thread; }

inline void* dynamic_shared_memory() { return current().block->dynamic_shared; }

// "block (x, y, z)" for messages.
inline std::string block_name(const uint3& b) {
  return "block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ", " +
         std::to_string(b.z) + ")";
}

// ----------------------------------------------------------------------------- spin watch

// The grid's side of the watch (emu_grid.h): a thread has polled kLongSpin more times; a thread
// that had made kLongSpin polls made progress.
void report_long_spin(Thread& t);
void end_long_spin(Thread& t);

inline void reset_polls(Thread& t) {
  if (t.polls >= kLongSpin) end_long_spin(t);
  t.polls = 0;
}

// The bytes of an atomic's value, zero-extended (atomics are 4 or 8 bytes wide).
template <typename T>
uint64_t value_bits(T value) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

// Whether a polled word still holds the value its poller last saw.
inline bool still_holds(const Thread& t) {
  auto* word = const_cast<void*>(t.polled);
  switch (t.polled_size) {
    case 4: return std::atomic_ref(*static_cast<uint32_t*>(word)).load() == t.polled_value;
    case 8: return std::atomic_ref(*static_cast<uint64_t*>(word)).load() == t.polled_value;
    default: return true;  // no other width is polled; cannot tell, so it counts as unchanged
  }
}

// An atomic on `address` by the current thread that returned `seen`; `changed`: whether it
// wrote a new value.
template <typename T>
void note_atomic(const T* address, T seen, bool changed) {
  if (tls_thread == nullptr) return;  // host code
  Thread& t = current();
  const uint64_t bits = value_bits(seen);
  if (changed || t.polled != address || t.polled_value != bits) {
    reset_polls(t);
    t.polled = address;
    t.polled_value = bits;
    t.polled_size = sizeof(T);
    return;
  }
  if (++t.polls % kLongSpin == 0) report_long_spin(t);
}

// ----------------------------------------------------------------------------- waiting

#ifdef LZE_EMU_OS_THREADS

using BlockLock = std::unique_lock<std::mutex>;
inline BlockLock lock_block(Block& b) { return BlockLock(b.mutex); }
inline void release(Thread& t) {
  t.waiting = false;
  t.wakeup.notify_one();
}
inline void wait_until_released(Thread& t, BlockLock& lock) {
  t.wakeup.wait(lock, [&t] { return !t.waiting; });
}

#else

// Fibers of a block share one OS thread: no lock needed, waiting is a switch to the scheduler.
struct BlockLock {};
inline BlockLock lock_block(Block&) { return {}; }
inline void release(Thread& t) { t.waiting = false; }

// Saves the callee-saved registers, MXCSR and the x87 control word of the running context on its
// stack, stores the stack pointer in *save_sp, and resumes the context saved at load_sp.
extern "C" void lze_emu_switch_stack(void** save_sp, void* load_sp);
// First code of a new fiber: calls r13(r12) with the stack 16-byte aligned; it never returns.
extern "C" void lze_emu_fiber_start();
// Defined in the one translation unit that defines LZE_EMU_DEFINE_FIBER_SWITCH (emu_kernels.cpp):
// other units of the same module (the bindings) only declare them, as link-time optimisation
// merges their assembly.
#ifdef LZE_EMU_DEFINE_FIBER_SWITCH
asm(R"(
  .pushsection .text
  .weak lze_emu_switch_stack
  .hidden lze_emu_switch_stack
  .type lze_emu_switch_stack, @function
lze_emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lze_emu_switch_stack, .-lze_emu_switch_stack

  .weak lze_emu_fiber_start
  .hidden lze_emu_fiber_start
  .type lze_emu_fiber_start, @function
lze_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size lze_emu_fiber_start, .-lze_emu_fiber_start
  .popsection
)");
#endif

inline void switch_to_scheduler(Thread& t) {
  lze_emu_switch_stack(&t.stack_pointer, t.block->scheduler_sp);
}

inline void wait_until_released(Thread& t, BlockLock&) {
  while (t.waiting) switch_to_scheduler(t);  // the scheduler resumes only released fibers
}

#endif

// ----------------------------------------------------------------------------- barriers

inline void release_barrier(Block& b) {
  for (Thread& t : b.threads) {
    if (t.at_barrier) {
      t.at_barrier = false;
      release(t);
    }
  }
  b.at_barrier = 0;
}

inline void sync_threads() {
  Thread& t = current();
  Block& b = *t.block;
  BlockLock lock = lock_block(b);
  reset_polls(t);
  t.waiting = t.at_barrier = true;
  if (++b.at_barrier == b.live) release_barrier(b);
  wait_until_released(t, lock);
}

// Called when a CUDA thread returns from the kernel: exited threads no longer hold up barriers.
inline void exit_thread(Thread& t) {
  Block& b = *t.block;
  [[maybe_unused]] BlockLock lock = lock_block(b);
  reset_polls(t);
  t.done = true;
  --b.live;
  if (b.at_barrier > 0 && b.at_barrier == b.live) release_barrier(b);
}

// ----------------------------------------------------------------------------- warp collectives

// Source lane of a shuffle by the PTX rules of shfl.sync with the clamp values the CUDA
// intrinsics pass (c = ((32 - width) << 8) | 0x1f, or without the 0x1f for shfl.up).
inline unsigned shuffle_source(WarpOp op, unsigned lane, unsigned arg, unsigned width) {
  const unsigned segment_mask = (kWarpSize - width) & 31u;
  const unsigned min_lane = lane & segment_mask;
  const unsigned max_lane = min_lane | (31u & ~segment_mask);
  const unsigned b = arg & 31u;
  unsigned source = lane;
  switch (op) {
    case WarpOp::kShflUp: source = lane >= min_lane + b ? lane - b : lane; break;
    case WarpOp::kShflDown: source = lane + b <= max_lane ? lane + b : lane; break;
    case WarpOp::kShflXor: source = (lane ^ b) <= max_lane ? lane ^ b : lane; break;
    case WarpOp::kShflIdx: source = min_lane | (b & ~segment_mask); break;
    default: break;
  }
  return source;
}

// The lanes of `mask` whose request carries `value` (match.any).
inline unsigned matching_lanes(const Thread* lanes, unsigned mask, uint64_t value) {
  unsigned same = 0;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const unsigned lane = std::countr_zero(m);
    same |= static_cast<unsigned>(lanes[lane].request.value == value) << lane;
  }
  return same;
}

// Runs when the last lane of `mask` arrives: computes every member's result and releases them.
inline void complete_collective(Block& b, unsigned warp, unsigned mask) {
  Thread* lanes = &b.threads[warp * kWarpSize];
  const LaneRequest& first = lanes[std::countr_zero(mask)].request;
  unsigned ballot = 0;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const unsigned lane = std::countr_zero(m);
    const LaneRequest& r = lanes[lane].request;
    if (r.op != first.op || r.mask != mask) fail("lanes of a warp collective disagree on operation or mask");
    ballot |= static_cast<unsigned>(r.value != 0) << lane;
  }
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const unsigned lane = std::countr_zero(m);
    const LaneRequest& r = lanes[lane].request;
    if (r.op == WarpOp::kBallot) {
      lanes[lane].result = ballot;
    } else if (r.op == WarpOp::kMatchAny) {
      lanes[lane].result = matching_lanes(lanes, mask, r.value);
    } else if (r.op != WarpOp::kSync) {
      const unsigned source = shuffle_source(r.op, lane, r.arg, r.width);
      lanes[lane].result = (mask >> source & 1u) ? lanes[source].request.value : r.value;
    }
  }
  b.warps[warp].arrived &= ~mask;
  for (unsigned m = mask; m != 0; m &= m - 1) release(lanes[std::countr_zero(m)]);
}

inline uint64_t warp_collective(LaneRequest request) {
  Thread& t = current();
  Block& b = *t.block;
  BlockLock lock = lock_block(b);
  Warp& warp = b.warps[t.warp];
  request.mask &= warp.present;
  if (!(request.mask >> t.lane & 1u)) fail("warp intrinsic called by a lane outside its mask");
  reset_polls(t);
  t.request = request;
  t.waiting = true;
  warp.arrived |= 1u << t.lane;
  if ((warp.arrived & request.mask) == request.mask) complete_collective(b, t.warp, request.mask);
  wait_until_released(t, lock);
  return t.result;
}

template <typename T>
T shuffle(WarpOp op, unsigned mask, T value, unsigned arg, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  if (width < 1 || width > 32 || !std::has_single_bit(static_cast<unsigned>(width))) {
    fail("shuffle width must be a power of two in [1, 32]");
  }
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_collective({op, mask, bits, arg, static_cast<unsigned>(width)});
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ----------------------------------------------------------------------------- shared memory

template <typename T>
using shared_type = T;  // so that LZE_SHARED(uint32_t[256], name) declares an array

// The block's copy of the static shared variable declared at `site` (LZE_SHARED).
template <typename T>
T& static_shared(const void* site) {
  Block& b = *current().block;
  [[maybe_unused]] BlockLock lock = lock_block(b);
  for (const SharedSite& s : b.sites) {
    if (s.site == site) return *reinterpret_cast<T*>(b.static_area + s.offset);
  }
  const size_t offset = (b.static_used + alignof(T) - 1) / alignof(T) * alignof(T);
  if (offset + sizeof(T) > b.static_capacity) {
    fail("a kernel's static __shared__ variables need " + std::to_string(offset + sizeof(T)) +
         " bytes or more, past the " + std::to_string(b.static_capacity) +
         " it declares (LZE_KERNEL_RESOURCES): declare what ptxas -v reports");
  }
  b.static_used = offset + sizeof(T);
  b.sites.push_back({site, offset});
  return *reinterpret_cast<T*>(b.static_area + offset);
}

}  // namespace emu

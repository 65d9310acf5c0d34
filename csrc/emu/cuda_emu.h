// CPU emulator of the CUDA kernel subset used by csrc/cuda/*.cu, so that the unchanged kernel
// sources build with g++ (-std=c++20 -pthread, through csrc/cuda/cuda_compat.h) and run in the
// tests on machines without a GPU. Test support, not a simulator of GPU performance.
//
// Two execution modes, chosen at compile time:
//  * Fibers (default). A launch spreads its blocks over a few worker OS threads (environment
//    variable LZE_CUDA_EMU_WORKERS, default: hardware concurrency). A worker runs one block at a
//    time; the CUDA threads of that block are fibers on the worker's stack pool, switched by a
//    small hand-written x86-64 context switch only where a thread must wait for others:
//    __syncthreads and the _sync warp intrinsics. A fiber never moves to another worker.
//  * OS threads (-DLZE_EMU_OS_THREADS). Every CUDA thread of a block runs on an OS thread of its
//    own (from a team kept for the process, ThreadTeam) and blocks run one after another. Slow,
//    but ThreadSanitizer sees every CUDA thread, so it reports races between threads of a block
//    (e.g. warp-synchronous shared-memory code without __syncwarp).
//
// Static __shared__ variables must exist once per running block:
//  * fibers: `__shared__` expands to `static thread_local`. All CUDA threads of a block run on
//    one worker and a worker runs one block at a time, so one copy per worker is one copy per
//    running block.
//  * OS threads: `__shared__` expands to `static`. One copy per process is one copy per running
//    block because blocks run one at a time (and launches are serialized, see below).
// Dynamic shared memory is a per-block buffer reached through dynamic_shared_memory(); kernel
// sources declare it with LZE_DYNAMIC_SHARED (cuda_compat.h), since `extern __shared__` cannot be
// emulated.
//
// Semantics and limits:
//  * Launches are synchronous and serialized process-wide; stream arguments are ignored.
//  * Warp intrinsics follow PTX: a collective completes when every lane of its member mask has
//    arrived; shuffles use the PTX source-lane rules (segments of `width` lanes, out-of-range
//    sources read the caller's own value). Lanes past blockDim count as exited and are dropped
//    from masks. A lane calling with a mask that excludes itself, lanes of one collective
//    disagreeing on the operation or mask, and (fibers) a block in which every live thread waits
//    forever abort the process with a message.
//  * __syncthreads waits for all threads of the block that have not exited.
//  * Memory model: plain loads/stores are plain C++; atomics are sequentially consistent
//    std::atomic_ref operations and __threadfence is a seq_cst fence. This is stronger than a
//    GPU's memory model, so a missing __threadfence does not fail here.
//  * In OS-thread mode the rendezvous of a warp collective goes through a mutex, so TSan sees
//    a happens-before edge between its lanes (real shuffles do not order memory).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#ifndef LZE_EMU_OS_THREADS
#if !defined(__x86_64__)
#error "cuda_emu.h: the fiber mode has an x86-64 context switch only; build with -DLZE_EMU_OS_THREADS"
#endif
#include <sys/mman.h>
#include <unistd.h>
#endif

// ----------------------------------------------------------------------------- CUDA language

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#ifdef LZE_EMU_OS_THREADS
#define __shared__ static
#else
#define __shared__ static thread_local
#endif

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

constexpr int warpSize = 32;

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};
using cudaStream_t = struct CUstream_st*;
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

namespace emu {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;

[[noreturn]] inline void fail(const char* message) {
  std::fprintf(stderr, "cuda_emu: %s\n", message);
  std::abort();
}

// ----------------------------------------------------------------------------- block state

enum class WarpOp : uint8_t { kSync, kBallot, kShflIdx, kShflUp, kShflDown, kShflXor };

// What one lane brought to a warp collective.
struct LaneRequest {
  WarpOp op;
  unsigned mask;
  uint64_t value;  // the lane's operand (shuffled bits or vote predicate)
  unsigned arg;    // source lane, delta or xor mask of a shuffle
  unsigned width;  // shuffle segment width
};

struct Block;

struct Thread {
  uint3 idx{};
  unsigned lane = 0;
  unsigned warp = 0;
  Block* block = nullptr;
  bool waiting = false;     // blocked in a barrier or warp collective until released
  bool at_barrier = false;  // waiting in __syncthreads
  bool done = false;
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

struct Block {
  uint3 idx;
  dim3 dim;
  dim3 grid;
  const std::function<void()>* body;
  void* dynamic_shared;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  unsigned live;            // threads that have not exited
  unsigned at_barrier = 0;  // threads waiting in __syncthreads
#ifdef LZE_EMU_OS_THREADS
  std::mutex mutex;
#else
  void* scheduler_sp = nullptr;  // the worker's context while a fiber runs
#endif

  Block(uint3 idx_, dim3 dim_, dim3 grid_, const std::function<void()>* body_, void* shared)
      : idx(idx_), dim(dim_), grid(grid_), body(body_), dynamic_shared(shared),
        threads(dim_.x * dim_.y * dim_.z), warps((threads.size() + kWarpSize - 1) / kWarpSize),
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
  t.waiting = t.at_barrier = true;
  if (++b.at_barrier == b.live) release_barrier(b);
  wait_until_released(t, lock);
}

// Called when a CUDA thread returns from the kernel: exited threads no longer hold up barriers.
inline void exit_thread(Thread& t) {
  Block& b = *t.block;
  [[maybe_unused]] BlockLock lock = lock_block(b);
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

// ----------------------------------------------------------------------------- launches

inline cudaError_t& last_error() {
  thread_local cudaError_t error = cudaSuccess;
  return error;
}

struct GridLaunch {
  dim3 grid;
  dim3 block;
  size_t shared_bytes;
  const std::function<void()>* body;

  uint64_t num_blocks() const { return uint64_t{grid.x} * grid.y * grid.z; }
  uint3 block_index(uint64_t i) const {
    return {static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
            static_cast<unsigned>(i / (uint64_t{grid.x} * grid.y))};
  }
};

// A byte buffer with 16-byte alignment for dynamic shared memory.
inline std::vector<std::max_align_t> shared_buffer(size_t bytes) {
  return std::vector<std::max_align_t>((bytes + sizeof(std::max_align_t) - 1) /
                                       sizeof(std::max_align_t));
}

#ifdef LZE_EMU_OS_THREADS

// OS threads that run the CUDA threads of one block at a time, kept for the process: starting
// a thread under ThreadSanitizer costs milliseconds, and a launch may run thousands of CUDA
// threads. run(n, fn) runs fn(0..n-1) on n of them concurrently and returns when all have
// returned; the hand-over through the mutex orders each block after the one before, as joining
// fresh threads did.
class ThreadTeam {
 public:
  ~ThreadTeam() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  void run(size_t n, const std::function<void(size_t)>& fn) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (threads_.size() < n) {
      const size_t index = threads_.size();
      threads_.emplace_back([this, index] { serve(index); });
    }
    job_ = &fn;
    active_ = n;
    remaining_ = n;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [this] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  void serve(size_t index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return stopping_ || (generation_ != seen && index < active_); });
      if (stopping_) return;
      seen = generation_;
      const std::function<void(size_t)>* job = job_;
      lock.unlock();
      (*job)(index);
      lock.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(size_t)>* job_ = nullptr;
  uint64_t generation_ = 0;
  size_t active_ = 0, remaining_ = 0;
  bool stopping_ = false;
};

inline void run_grid(const GridLaunch& launch) {
  static ThreadTeam team;  // launches are serialized (launch()), so one team serves them all
  std::vector<std::max_align_t> shared = shared_buffer(launch.shared_bytes);
  for (uint64_t i = 0; i < launch.num_blocks(); ++i) {
    Block b(launch.block_index(i), launch.block, launch.grid, launch.body, shared.data());
    team.run(b.threads.size(), [&b](size_t index) {
      Thread& t = b.threads[index];
      tls_thread = &t;
      (*t.block->body)();
      exit_thread(t);
    });
  }
}

#else

// Fiber stacks of one worker, each above a guard page so an overflow faults instead of
// corrupting a neighbour.
class FiberStacks {
 public:
  static constexpr size_t kStackBytes = 128 * 1024;

  explicit FiberStacks(size_t count) : count_(count), slot_(kStackBytes + page()) {
    base_ = static_cast<char*>(mmap(nullptr, count_ * slot_, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base_ == MAP_FAILED) fail("cannot map fiber stacks");
    for (size_t i = 0; i < count_; ++i) mprotect(base_ + i * slot_, page(), PROT_NONE);
  }
  FiberStacks(const FiberStacks&) = delete;
  FiberStacks& operator=(const FiberStacks&) = delete;
  ~FiberStacks() { munmap(base_, count_ * slot_); }

  char* top(size_t i) const { return base_ + (i + 1) * slot_; }

 private:
  static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
  size_t count_;
  size_t slot_;
  char* base_;
};

inline void fiber_main(Thread* t) {
  (*t->block->body)();
  exit_thread(*t);
  switch_to_scheduler(*t);  // never resumed: the scheduler skips finished fibers
  __builtin_unreachable();
}

// An initial context for lze_emu_switch_stack that "returns" into lze_emu_fiber_start, which
// calls fiber_main(t). Slots from the stack pointer up: MXCSR and x87 control word, r15, r14,
// r13 (entry), r12 (argument), rbx, rbp, return address.
inline void* initial_context(char* stack_top, Thread* t) {
  uint32_t control[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  auto* slots = reinterpret_cast<uint64_t*>(stack_top) - 8;
  slots[0] = control[0] | uint64_t{control[1] & 0xffffu} << 32;
  slots[1] = slots[2] = slots[5] = slots[6] = 0;
  slots[3] = reinterpret_cast<uint64_t>(&fiber_main);
  slots[4] = reinterpret_cast<uint64_t>(t);
  slots[7] = reinterpret_cast<uint64_t>(&lze_emu_fiber_start);
  return slots;
}

// Round-robin over the fibers of one block: each released fiber runs until it waits again or
// exits. A pass in which no fiber could run while some are alive is a deadlock.
inline void run_block_fibers(Block& b, const FiberStacks& stacks) {
  for (size_t i = 0; i < b.threads.size(); ++i) {
    b.threads[i].stack_pointer = initial_context(stacks.top(i), &b.threads[i]);
  }
  while (b.live > 0) {
    bool ran = false;
    for (Thread& t : b.threads) {
      if (t.done || t.waiting) continue;
      tls_thread = &t;
      lze_emu_switch_stack(&b.scheduler_sp, t.stack_pointer);
      ran = true;
    }
    if (!ran) fail("deadlock: every live thread of a block waits (divergent barrier or warp mask?)");
  }
  tls_thread = nullptr;
}

inline unsigned worker_count(uint64_t num_blocks) {
  unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("LZE_CUDA_EMU_WORKERS")) workers = std::max(1, std::atoi(env));
  return static_cast<unsigned>(std::min<uint64_t>(workers, num_blocks));
}

inline void run_grid(const GridLaunch& launch) {
  std::atomic<uint64_t> next_block{0};
  auto work = [&] {
    const size_t threads = size_t{launch.block.x} * launch.block.y * launch.block.z;
    const FiberStacks stacks(threads);
    std::vector<std::max_align_t> shared = shared_buffer(launch.shared_bytes);
    for (uint64_t i; (i = next_block.fetch_add(1)) < launch.num_blocks();) {
      Block b(launch.block_index(i), launch.block, launch.grid, launch.body, shared.data());
      run_block_fibers(b, stacks);
    }
  };
  std::vector<std::thread> helpers(worker_count(launch.num_blocks()) - 1);
  for (std::thread& helper : helpers) helper = std::thread(work);
  work();  // the launching thread is a worker too
  for (std::thread& helper : helpers) helper.join();
}

#endif

inline cudaError_t check_config(const dim3& grid, const dim3& block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  return cudaSuccess;
}

// Kernel launches since the last take_launches() (the launch-count tests).
inline std::atomic<uint64_t>& launches() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline uint64_t take_launches() { return launches().exchange(0); }

inline void launch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body) {
  launches().fetch_add(1, std::memory_order_relaxed);
  const cudaError_t error = check_config(grid, block);
  if (error != cudaSuccess) {
    last_error() = error;
    return;
  }
  static std::mutex launch_mutex;  // one launch at a time: static __shared__ storage is reused
  const std::lock_guard<std::mutex> lock(launch_mutex);
  run_grid({grid, block, shared_bytes, &body});
}

// The emulated `kernel<<<grid, block, shared_bytes, stream>>>(args...)`: the arguments convert
// to the kernel's parameter types as in CUDA, and every CUDA thread calls the kernel with them.
template <typename... Params>
class Launcher {
 public:
  Launcher(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t)
      : kernel_(kernel), grid_(grid), block_(block), shared_bytes_(shared_bytes) {}

  void operator()(Params... args) const {
    launch(grid_, block_, shared_bytes_, [&] { kernel_(args...); });
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_;
  dim3 block_;
  size_t shared_bytes_;
};

}  // namespace emu

// ----------------------------------------------------------------------------- CUDA API

#define threadIdx (::emu::current().idx)
#define blockIdx (::emu::current().block->idx)
#define blockDim (::emu::current().block->dim)
#define gridDim (::emu::current().block->grid)

namespace emu {
// Reads of per-row input counted by the kernels (LZE_COUNT_ROW_READS in cuda_compat.h), summed
// over every thread since the last take_row_reads().
inline std::atomic<uint64_t>& row_reads() {
  static std::atomic<uint64_t> count{0};
  return count;
}
inline void count_row_reads(uint64_t n) { row_reads().fetch_add(n, std::memory_order_relaxed); }
inline uint64_t take_row_reads() { return row_reads().exchange(0); }

// Accesses to the per-prompt state (LZE_NOTE_STATE_ACCESS) and the distinct 32-byte sectors
// they touched, since the last take_state_sectors(): the tests check one sector a row.
struct StateSectors {
  std::mutex mutex;
  uint64_t accesses = 0;
  std::unordered_set<uintptr_t> sectors;
};
inline StateSectors& state_sectors() {
  static StateSectors s;
  return s;
}
inline void note_state_access(const void* address, size_t bytes) {
  StateSectors& s = state_sectors();
  const std::lock_guard<std::mutex> lock(s.mutex);
  const uintptr_t first = reinterpret_cast<uintptr_t>(address);
  s.accesses += 1;
  for (uintptr_t sector = first / 32; sector <= (first + bytes - 1) / 32; ++sector) {
    s.sectors.insert(sector);
  }
}
// (accesses, distinct sectors), then reset.
inline std::pair<uint64_t, uint64_t> take_state_sectors() {
  StateSectors& s = state_sectors();
  const std::lock_guard<std::mutex> lock(s.mutex);
  const std::pair<uint64_t, uint64_t> out{s.accesses, s.sectors.size()};
  s.accesses = 0;
  s.sectors.clear();
  return out;
}
}  // namespace emu

inline cudaError_t cudaGetLastError() { return std::exchange(emu::last_error(), cudaSuccess); }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// Shared memory is a host buffer here: any size is allowed.
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) {
  return cudaSuccess;
}
inline cudaError_t cudaPeekAtLastError() { return emu::last_error(); }

inline void __syncthreads() { emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::warp_collective({emu::WarpOp::kSync, mask, 0, 0, 0});
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(
      emu::warp_collective({emu::WarpOp::kBallot, mask, predicate != 0, 0, 0}));
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, !predicate) == 0; }

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return emu::shuffle(emu::WarpOp::kShflIdx, mask, var, static_cast<unsigned>(src_lane), width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return emu::shuffle(emu::WarpOp::kShflUp, mask, var, delta, width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return emu::shuffle(emu::WarpOp::kShflDown, mask, var, delta, width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return emu::shuffle(emu::WarpOp::kShflXor, mask, var, static_cast<unsigned>(lane_mask), width);
}

// Atomics return the old value, like CUDA's. The second operand is not deduced, so
// atomicAdd(&u64, 1) converts 1 as CUDA's overloads do.
template <typename T>
T atomicAdd(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
template <typename T>
T atomicOr(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).fetch_or(value);
}
template <typename T>
T atomicMax(T* address, std::type_identity_t<T> value) {
  std::atomic_ref<T> target(*address);
  T old = target.load();
  while (old < value && !target.compare_exchange_weak(old, value)) {
  }
  return old;
}
template <typename T>
T atomicExch(T* address, std::type_identity_t<T> value) {
  return std::atomic_ref<T>(*address).exchange(value);
}
template <typename T>
T atomicCAS(T* address, std::type_identity_t<T> compare, std::type_identity_t<T> value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;
}

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}

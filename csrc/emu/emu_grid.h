// One kernel launch's blocks on CPU threads (part of csrc/emu/cuda_emu.h): the order blocks
// start in, how many are resident at once, their shared memory, and the forward-progress watch.
//
// A GPU starts a grid's blocks in no promised order and holds only as many at once as its SMs
// fit; a kernel that depends on either is wrong. The emulator starts them in the order a test
// asks for (forward, reverse, or a seeded shuffle: set_block_order) with at most W resident at
// once (W workers, set_workers): a worker runs one block to its end, then takes the next.
// A block that spins on another block's word while every worker spins and blocks have not
// started can never be released (it waits on a block that is not resident): the watch names it
// and stops the process instead of hanging, as a GPU would hang.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "emu_block.h"

namespace emu {

enum class BlockOrder { kForward, kReverse, kRandom };

struct GridPolicy {
  BlockOrder order = BlockOrder::kForward;
  uint64_t seed = 0;
  unsigned workers = 0;  // 0: LZE_CUDA_EMU_WORKERS, else the hardware's threads
};

inline std::mutex& policy_mutex() {
  static std::mutex mutex;
  return mutex;
}
inline GridPolicy& grid_policy() {
  static GridPolicy policy;
  return policy;
}
inline GridPolicy current_policy() {
  const std::lock_guard<std::mutex> lock(policy_mutex());
  return grid_policy();
}

// What a launch asks for: kept by a queued launch and by a captured graph, which runs it again
// at every replay.
struct GridSpec {
  std::string kernel;
  dim3 grid;
  dim3 block;
  size_t dynamic_bytes;
  size_t static_bytes;
  std::function<void()> body;
  uint8_t poison;
  int device = 0;
  uint64_t num_blocks;
  std::vector<uint64_t> shuffled;  // start order (random order only)
  BlockOrder order;
};

// One run of a launch: its spec and the blocks' progress.
struct Grid : GridSpec {
  explicit Grid(const GridSpec& spec) : GridSpec(spec) {}
  std::atomic<uint64_t> next{0};   // blocks started
  unsigned workers = 1;
  std::atomic<unsigned> running{1};   // workers that have not run out of blocks
  std::mutex spin_mutex;
  std::vector<const Thread*> spinners;  // threads past kLongSpin polls (under spin_mutex)

  uint64_t block_at(uint64_t position) const {
    switch (order) {
      case BlockOrder::kReverse: return num_blocks - 1 - position;
      case BlockOrder::kRandom: return shuffled[position];
      default: return position;
    }
  }
  uint3 block_index(uint64_t i) const {
    return {static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
            static_cast<unsigned>(i / (uint64_t{grid.x} * grid.y))};
  }
};

inline uint64_t threads_of(const dim3& d) { return uint64_t{d.x} * d.y * d.z; }

// A worker's shared memory: the dynamic buffer and the static area, 16-byte aligned, poisoned
// before each block.
struct SharedArena {
  std::vector<std::max_align_t> dynamic, statics;
  SharedArena(size_t dynamic_bytes, size_t static_bytes)
      : dynamic(words(dynamic_bytes)), statics(words(static_bytes)) {}
  static size_t words(size_t bytes) { return (bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t); }
  void poison(uint8_t byte) {
    std::memset(dynamic.data(), byte, dynamic.size() * sizeof(std::max_align_t));
    std::memset(statics.data(), byte, statics.size() * sizeof(std::max_align_t));
  }
};

inline Block make_block(Grid& g, uint64_t position, SharedArena& arena) {
  arena.poison(g.poison);
  return Block(g.block_index(g.block_at(position)), g.block, &g, arena.dynamic.data(),
               reinterpret_cast<unsigned char*>(arena.statics.data()), g.static_bytes);
}

// Whether another thread of `t`'s block could run (fiber mode: not while `t` spins).
inline bool sibling_runnable(const Thread& t) {
#ifdef LZE_EMU_OS_THREADS
  (void)t;
  return false;
#else
  for (const Thread& other : t.block->threads) {
    if (!other.done && !other.waiting && &other != &t) return true;
  }
  return false;
#endif
}

// Blocks with a thread whose polled word still holds what it saw: a thread that has seen its
// word change but not yet polled again (descheduled between the two) is on its way, not stuck.
inline unsigned stuck_blocks(const Grid& g) {
  std::vector<const Block*> stuck;
  for (const Thread* t : g.spinners) {
    if (still_holds(*t) && std::find(stuck.begin(), stuck.end(), t->block) == stuck.end()) {
      stuck.push_back(t->block);
    }
  }
  return static_cast<unsigned>(stuck.size());
}

// The spin watch (emu_block.h): a thread has polled kLongSpin more times without progress. When
// the block of every worker still running waits on a word that still holds what it saw, nothing
// can release them: a block waits on one that has not started (no worker is free to start it),
// on a sibling thread that cannot run while it spins (fiber mode), or the blocks wait on each
// other. The verdict reads memory, not time: a worker the OS has descheduled, or one that has
// just finished the block another waits on, never makes it.
inline void report_long_spin(Thread& t) {
  Block& b = *t.block;
  Grid& g = *b.grid;
  const std::lock_guard<std::mutex> lock(g.spin_mutex);
  if (t.polls == kLongSpin) g.spinners.push_back(&t);
  const std::string who = g.kernel + ": " + block_name(b.idx) + ", thread " +
                          std::to_string(t.idx.x) + ", spins on an atomic";
  if (stuck_blocks(g) >= g.running.load()) {
    const uint64_t started = g.next.load();
    if (started < g.num_blocks) {
      fail(who + " while every one of the " + std::to_string(g.running.load()) +
           " resident blocks spins and " + std::to_string(g.num_blocks - started) + " of the " +
           std::to_string(g.num_blocks) + " blocks have not started: it waits on a block that "
           "is not resident (forward progress: wait only on blocks that took an earlier ticket, "
           "cuda_compat.h rule 4)");
    }
    if (sibling_runnable(t)) {
      fail(who + " while other threads of its block wait to run: a spin-wait inside a block "
           "(cuda_compat.h rule 4)");
    }
    fail(who + " while every resident block spins: the blocks wait on each other");
  }
  if (t.polls >= kHopelessSpin) fail(who + " " + std::to_string(t.polls) + " times without progress");
}

// A thread that had spun long made progress: it is no longer a spinner.
inline void end_long_spin(Thread& t) {
  Grid& g = *t.block->grid;
  const std::lock_guard<std::mutex> lock(g.spin_mutex);
  g.spinners.erase(std::find(g.spinners.begin(), g.spinners.end(), &t));
}

inline unsigned worker_count(const GridPolicy& policy, uint64_t num_blocks) {
  unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  if (const char* env = std::getenv("LZE_CUDA_EMU_WORKERS")) workers = std::max(1, std::atoi(env));
  if (policy.workers > 0) workers = policy.workers;
  return static_cast<unsigned>(std::min<uint64_t>(workers, num_blocks));
}

inline void plan_order(GridSpec& g, const GridPolicy& policy) {
  g.order = policy.order;
  if (g.order != BlockOrder::kRandom) return;
  g.shuffled.resize(g.num_blocks);
  std::iota(g.shuffled.begin(), g.shuffled.end(), uint64_t{0});
  std::mt19937_64 random(policy.seed);
  std::shuffle(g.shuffled.begin(), g.shuffled.end(), random);
}

#ifdef LZE_EMU_OS_THREADS

// OS threads that run the CUDA threads of one block at a time, kept for the process: starting
// a thread under ThreadSanitizer costs milliseconds, and a launch may run thousands of CUDA
// threads. run(n, fn) runs fn(0..n-1) on n of them concurrently and returns when all have
// returned; the hand-over through the mutex orders each block after the one before.
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

// Blocks one after another, each on a team of OS threads (one resident block).
inline void run_grid(Grid& g) {
  static std::mutex team_mutex;  // one block of the process at a time on the team
  static ThreadTeam team;
  const std::lock_guard<std::mutex> lock(team_mutex);
  g.workers = 1;
  SharedArena arena(g.dynamic_bytes, g.static_bytes);
  for (uint64_t position; (position = g.next.fetch_add(1)) < g.num_blocks;) {
    Block b = make_block(g, position, arena);
    team.run(b.threads.size(), [&b](size_t index) {
      Thread& t = b.threads[index];
      tls_thread = &t;
      b.grid->body();
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
  t->block->grid->body();
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
    if (!ran) fail(b.grid->kernel + ": deadlock: every live thread of " + block_name(b.idx) +
                   " waits (divergent barrier or warp mask?)");
  }
  tls_thread = nullptr;
}

// Blocks on W workers, each running one block at a time to its end.
inline void run_grid(Grid& g) {
  g.workers = worker_count(current_policy(), g.num_blocks);
  g.running = g.workers;
  auto work = [&g] {
    const FiberStacks stacks(threads_of(g.block));
    SharedArena arena(g.dynamic_bytes, g.static_bytes);
    for (uint64_t position; (position = g.next.fetch_add(1)) < g.num_blocks;) {
      Block b = make_block(g, position, arena);
      run_block_fibers(b, stacks);
    }
    g.running.fetch_sub(1);
  };
  std::vector<std::thread> helpers(g.workers - 1);
  for (std::thread& helper : helpers) helper = std::thread(work);
  work();  // the thread that runs the launch is a worker too
  for (std::thread& helper : helpers) helper.join();
}

#endif

}  // namespace emu

// Fork-join parallelism of the C++ CPU kernels, built to degrade gracefully when the cores are
// shared (a trainer's rollout engine, optimizer and data workers, other jobs on the machine).
//
// Why not OpenMP: the module would share libgomp with torch, whose idle workers spin for
// milliseconds after every parallel region unless OMP_WAIT_POLICY=passive was set before torch
// started, and whose fixed teams pass a barrier only once every member has been scheduled. With
// the other cores busy, that turned a 1 ms step into 50 ms (2 threads on 2 busy cores).
//
// Here a job is a number of tasks, claimed one at a time from an atomic counter by the calling
// thread and by helper threads that sleep on a condition variable between jobs (no spinning).
// A helper the OS has not scheduled yet claims nothing and delays nothing: the caller runs the
// tasks left over itself and waits only for tasks a helper has started. That still loses when
// a started helper is preempted, or shares its core with a spinning worker of torch's, so each
// kernel also measures its calls (ThreadChoice) and runs on the calling thread alone while
// that has been faster.
#pragma once
#include <stdint.h>

#include <chrono>
#include <functional>
#include <mutex>

#include "lze_kernels.h"

namespace lze_cpu {

// Rows below which one more thread does not pay for its wake-up (a few microseconds, and more
// on a busy machine): a kernel over B rows uses at most B / kRowsPerThread threads.
constexpr int64_t kRowsPerThread = 4096;

// Threads for a kernel over `rows` rows: one per kRowsPerThread rows, at least 1, at most
// `max_threads`.
inline int threads_for(int64_t rows, int max_threads) {
  const int64_t by_work = rows / kRowsPerThread;
  const int64_t threads = by_work < max_threads ? by_work : max_threads;
  return threads > 1 ? static_cast<int>(threads) : 1;
}

// Chooses, per kernel, whether a call runs on a team of threads or on the calling thread alone,
// from the measured time per unit of work of each. On a quiet machine the team wins; when the
// cores are busy (a helper wakes late, or shares its core with other work and the caller waits
// for its task) the caller alone does, and the kernel degrades to its single-thread time. The
// choice that lost is measured again every kProbeInterval calls, so it follows the load.
// Outputs never depend on the thread count (every kernel here is deterministic), only speed.
class ThreadChoice {
 public:
  // Runs kernel(threads) for a kernel over `rows` rows and `work` units of work, within
  // `budget`: threads = threads_for(rows, budget.max_threads), or 1 when the budget is adaptive
  // and the caller alone has been faster.
  template <class Kernel>
  void run(const lze::ThreadBudget& budget, int64_t rows, int64_t work, Kernel&& kernel) {
    const int team = threads_for(rows, budget.max_threads);
    if (team <= 1 || !budget.adaptive) {
      kernel(team);
      return;
    }
    const bool use_team = pick();
    const auto start = std::chrono::steady_clock::now();
    kernel(use_team ? team : 1);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    record(use_team, elapsed.count() / static_cast<double>(work));
  }

 private:
  // Per choice: the mean of the last kSamples calls. Not the median: on busy cores a team call
  // either runs at full speed or stalls for a scheduler slice on a preempted helper, and a step
  // runs several kernels, so stalls in a minority of each kernel's calls (which a median hides)
  // still slow most steps down. The mean charges the team for them.
  static constexpr int kSamples = 8;
  static constexpr int64_t kProbeInterval = 16;

  struct History {
    double cost[kSamples];
    int count = 0;
    int next = 0;
    double mean() const;  // of a full history
  };

  bool pick();
  void record(bool team, double cost);

  std::mutex mutex_;
  History history_[2];  // [0] the calling thread alone, [1] the team
  int64_t calls_ = 0;
};

// Runs task(0), ..., task(tasks - 1) on the calling thread and up to threads - 1 helpers,
// concurrently and in any order; returns when all have finished. With threads <= 1, or while
// another thread's job holds the pool, the tasks run in order on the calling thread.
void parallel_tasks(int64_t tasks, int threads, const std::function<void(int64_t)>& task);

// Half-open range [begin, end) of `total` items that task `index` of `count` owns, aligned to
// `granule` items so that no two tasks write the same cache line.
struct Range {
  int64_t begin;
  int64_t end;
};

inline Range task_range(int64_t total, int64_t index, int64_t count, int64_t granule) {
  const int64_t granules = (total + granule - 1) / granule;
  const int64_t lo = granules * index / count * granule;
  const int64_t hi = granules * (index + 1) / count * granule;
  return Range{lo < total ? lo : total, hi < total ? hi : total};
}

}  // namespace lze_cpu

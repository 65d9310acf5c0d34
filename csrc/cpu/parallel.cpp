// The helper pool behind lze_cpu::parallel_tasks (parallel.h).
//
// Claiming: `next_` packs (job generation << 32 | next task index). A thread claims a task with a
// compare-and-swap that also checks the generation, so a helper waking up late from an earlier
// job can never claim (or run) a task of a later one; only after a successful claim does it read
// the job's task function, which stays alive until the caller has seen every task finish.
// Helpers hold no reference to a job they have not claimed from, so the caller never waits for
// a helper that is not running.
#include "cpu/parallel.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>

namespace lze_cpu {
namespace {

using Task = std::function<void(int64_t)>;

class Pool;

// The pool of a forked child (see Pool::instance); stays null in the process that made the pool.
Pool* forked_child_pool = nullptr;

class Pool {
 public:
  // Never destroyed: helpers sleep in it until the process exits (joining them from a static
  // destructor could hang at exit). A forked child gets a fresh pool: it has none of the
  // parent's helpers, and the parent's copy may hold mutexes some parent thread held at the
  // fork (it is leaked, never touched again).
  static Pool& instance() {
    static Pool* const first = [] {
      pthread_atfork(nullptr, nullptr, [] { forked_child_pool = new Pool(); });
      return new Pool();
    }();
    return forked_child_pool != nullptr ? *forked_child_pool : *first;
  }

  void run(int64_t tasks, int threads, const Task& task) {
    std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
    // Task indices are the low 32 bits of next_ and job_.
    const bool poolable = job.owns_lock() && tasks > 1 && tasks <= int64_t{0xFFFFFFFF};
    const int helpers = poolable ? start_helpers(threads - 1) : 0;
    if (helpers == 0) {
      for (int64_t i = 0; i < tasks; ++i) task(i);
      return;
    }
    uint32_t generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation = ++generation_;
      joining_ = helpers;
      task_.store(&task, std::memory_order_relaxed);
      job_.store(uint64_t{generation} << 32 | static_cast<uint64_t>(tasks),
                 std::memory_order_relaxed);
      finished_.store(0, std::memory_order_relaxed);
      next_.store(uint64_t{generation} << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work(generation);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return finished_.load(std::memory_order_acquire) == tasks; });
  }

 private:
  Pool() = default;

  // Starts helpers up to `wanted` (kept for later jobs); returns how many take part.
  int start_helpers(int wanted) {
    for (; num_helpers_ < wanted; ++num_helpers_) {
      try {
        std::thread([this, index = num_helpers_] { helper_loop(index); }).detach();
      } catch (const std::system_error&) {
        break;  // no more threads to be had: run with the helpers there are
      }
    }
    return wanted < num_helpers_ ? wanted : num_helpers_;
  }

  void helper_loop(int index) {
    uint32_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= joining_) continue;  // this job wants fewer helpers
      lock.unlock();
      work(seen);
      lock.lock();
    }
  }

  // Claims and runs tasks of job `generation` until none is left.
  void work(uint32_t generation) {
    uint64_t state = next_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(state >> 32) != generation) return;
      const int64_t index = static_cast<int64_t>(state & 0xFFFFFFFFu);
      // The task count and its generation in one word: a helper whose job has just ended may
      // read the next job's count before that job resets next_, and must not take it for its
      // own (it would claim an index past its job's end and run the next job's task early).
      const uint64_t job = job_.load(std::memory_order_relaxed);
      if (static_cast<uint32_t>(job >> 32) != generation) return;
      const int64_t tasks = static_cast<int64_t>(job & 0xFFFFFFFFu);
      if (index >= tasks) return;
      if (!next_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) continue;
      (*task_.load(std::memory_order_relaxed))(index);
      if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == tasks) {
        std::lock_guard<std::mutex> lock(mutex_);  // the caller checks under this lock
        done_.notify_one();
      }
      state = next_.load(std::memory_order_acquire);
    }
  }

  std::mutex job_mutex_;  // one job at a time; held by its caller
  std::mutex mutex_;      // guards generation_ and joining_, and the two condition variables
  std::condition_variable wake_;
  std::condition_variable done_;
  uint32_t generation_ = 0;
  int joining_ = 0;  // helpers 0 .. joining_ - 1 take part in the current job
  std::atomic<uint64_t> next_{0};
  std::atomic<const Task*> task_{nullptr};
  std::atomic<uint64_t> job_{0};  // generation << 32 | number of tasks
  std::atomic<int64_t> finished_{0};
  int num_helpers_ = 0;  // started (detached) helpers; guarded by job_mutex_
};

}  // namespace

double ThreadChoice::History::mean() const {
  return std::accumulate(cost, cost + kSamples, 0.0) / kSamples;
}

bool ThreadChoice::pick() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++calls_;
  // Measure both first: the team, then the caller alone.
  if (history_[1].count < kSamples) return true;
  if (history_[0].count < kSamples) return false;
  const bool team_is_faster = history_[1].mean() <= history_[0].mean();
  return calls_ % kProbeInterval == 0 ? !team_is_faster : team_is_faster;
}

void ThreadChoice::record(bool team, double cost) {
  std::lock_guard<std::mutex> lock(mutex_);
  History& h = history_[team ? 1 : 0];
  h.cost[h.next] = cost;
  h.next = (h.next + 1) % kSamples;
  if (h.count < kSamples) ++h.count;
}

void parallel_tasks(int64_t tasks, int threads, const std::function<void(int64_t)>& task) {
  if (threads <= 1 || tasks <= 1) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  Pool::instance().run(tasks, threads, task);
}

}  // namespace lze_cpu

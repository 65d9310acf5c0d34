// C++ CPU kernel of the fused LZE step (docs/spec.md §2, §3, §5): per-row statistics, GRPO advantages,
// Learning-Zone Energy and the per-prompt state update, matching lze_kernels/reference.py.
//
// The step runs as two jobs of tasks (cpu/parallel.h), the second after the first has finished:
//  1. row tasks, each a range of batch positions: statistics, advantages, fault bits, and the
//     energy each claimable row would get from the state as it was before the step (state is
//     only read);
//  2. owner tasks, each a range of prompt ids: phase 1 hands each claimable row to the owner of
//     its id (a list per row task and owner), and each owner commits its rows in batch order.
//     The first row carrying an id claims it (claim = stamp); a later row with the same id finds
//     the stamp and is a duplicate, exactly the reference's "earlier row wins", with no atomics
//     and no two tasks writing the same state row. Duplicates are rare (a caller bug); their
//     outputs, written by phase 1, are zeroed by the owner, the only task that reads them.
// On one thread (small batches, or busy cores: cpu/parallel.h) the two phases are one pass in
// batch order, each claimable row committing as soon as it is processed: the same claims, with
// no lists and no second visit of each state row (a quarter of the single-thread step).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"
#include "lze_kernels.h"

namespace {

using lze_cpu::Range;

// Rows per cache line of the [B] fp32 outputs: task boundaries on multiples of this keep
// tasks off each other's lines. Also a multiple of the 4 state rows in a 64-byte line.
constexpr int64_t kLineRows = 16;

struct RowStats {
  int64_t count;  // valid rollouts
  float mean;
  float std;
  int32_t fault;  // reward fault bits of the row (ids are checked separately)
};

struct StepArgs {
  const void* rewards;
  const uint8_t* valid;
  const int64_t* prompt_ids;
  int64_t B, G, N;
  int32_t* records;  // [N + 1, 8]: one 32-byte lze::PromptState per prompt
  float* advantages;
  float* pass_rate;
  float* energy;
  float* momentum;
  int32_t stamp;
  lze::Params params;
};

// One row of rewards with its validity mask, read through locals so that the compiler sees no
// aliasing with the outputs and vectorises the loops over G.
template <int32_t kDType, bool kMasked>
struct RowView {
  const void* rewards;
  const uint8_t* valid;
  int64_t base;  // flat index of the row's first element

  float reward(int64_t g) const { return lze::load_reward(rewards, base + g, kDType); }
  bool is_valid(int64_t g) const { return !kMasked || valid[base + g] != 0; }
};

// Exact fault bits of a row already known to hold a valid reward outside [0, 1] (or a NaN).
template <int32_t kDType, bool kMasked>
int32_t reward_faults(const RowView<kDType, kMasked>& row, int64_t G) {
  int32_t fault = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (row.is_valid(g)) fault |= lze::reward_fault(row.reward(g));
  }
  return fault;
}

// Count, mean and unbiased std of the valid rewards of a row, fp32 accumulation. The simd
// reductions reorder the sums, which is exact for binary rewards. Bitwise & and | rather than
// && and || keep the loop bodies free of branches, so they vectorise.
template <int32_t kDType, bool kMasked>
RowStats row_stats(const RowView<kDType, kMasked> row, int64_t G) {
  int32_t count = 0, outside = 0;
  float sum = 0.0f;
#pragma omp simd reduction(+ : count, sum, outside)
  for (int64_t g = 0; g < G; ++g) {
    const float r = row.reward(g);
    const bool v = row.is_valid(g);
    count += v;
    sum += v ? r : 0.0f;
    // One comparison pair catches NaN, infinities and out-of-range values alike.
    outside += v & !((r >= 0.0f) & (r <= 1.0f));
  }
  const int32_t fault = outside == 0 ? 0 : reward_faults(row, G);
  const float mean = count > 0 ? sum / static_cast<float>(count) : 0.0f;
  float sum_sq_dev = 0.0f;
#pragma omp simd reduction(+ : sum_sq_dev)
  for (int64_t g = 0; g < G; ++g) {
    const float centred = row.reward(g) - mean;
    sum_sq_dev += row.is_valid(g) ? centred * centred : 0.0f;
  }
  return RowStats{count, mean, lze::unbiased_std(sum_sq_dev, count), fault};
}

template <int32_t kDType, bool kMasked>
void write_advantages(const RowView<kDType, kMasked> row, int64_t G, const RowStats s,
                      const lze::Params prm, float* out) {
  if (s.count < 2) {  // grpo_advantage() would give 0 everywhere; hoisted so the loop vectorises
    std::fill_n(out, G, 0.0f);
    return;
  }
#pragma omp simd
  for (int64_t g = 0; g < G; ++g) {
    const float adv = lze::grpo_advantage(row.reward(g), s.mean, s.std, s.count, prm);
    out[g] = row.is_valid(g) ? adv : 0.0f;
  }
}

inline void zero_row(const StepArgs& a, int64_t row) {
  std::fill_n(a.advantages + row * a.G, a.G, 0.0f);
  a.pass_rate[row] = 0.0f;
  a.energy[row] = 0.0f;
  a.momentum[row] = 0.0f;
}

// The state tables are large and read at random ids: without prefetching, each row waits for
// its own cache (and TLB) miss, as a row carries too many instructions for the out-of-order
// window to reach the next row's loads.
constexpr int64_t kPrefetchRows = 16;

inline void prefetch_state(const StepArgs& a, int64_t row, Range ids) {
  if (row >= a.B) return;
  const int64_t id = a.prompt_ids[row];
  if (id < ids.begin || id >= ids.end) return;
  __builtin_prefetch(a.records + id * lze::kRecordWords, 1);
}

// A record is a PromptState (lze_math.h): 32 bytes, half a cache line.
static_assert(sizeof(lze::PromptState) == lze::kRecordWords * 4, "PromptState is one record");

inline lze::PromptState load_state(const StepArgs& a, int64_t id) {
  lze::PromptState s;
  std::memcpy(&s, a.records + id * lze::kRecordWords, sizeof(s));
  return s;
}

inline void store_state(const StepArgs& a, int64_t id, const lze::PromptState& s) {
  std::memcpy(a.records + id * lze::kRecordWords, &s, sizeof(s));
}

// docs/spec.md §3 and §5 for the prompt of `row`, from its state before the step.
inline lze::PromptStep next_state_of(const StepArgs& a, int64_t row) {
  return lze::advance_prompt(load_state(a, a.prompt_ids[row]), a.pass_rate[row], a.stamp,
                             a.params);
}

constexpr int32_t kClaimable = -1;

// Phase 1's verdict on a row: its fault bits, or kClaimable (no fault, n > 0) with the state its
// prompt gets if the row claims it.
struct RowResult {
  int32_t fault;
  lze::PromptState next;
};

// Phase 1 for one row.
template <int32_t kDType, bool kMasked>
RowResult process_row(const StepArgs& a, int64_t row, int64_t G) {
  const RowView<kDType, kMasked> view{a.rewards, a.valid, row * G};
  const RowStats s = row_stats(view, G);
  const int64_t id = a.prompt_ids[row];
  const int32_t fault = s.fault | (id < 0 || id >= a.N ? lze::kFaultIdOutOfRange : 0);
  if (fault != 0 || s.count == 0) {
    zero_row(a, row);
    return {fault, {}};
  }
  write_advantages(view, G, s, a.params, a.advantages + row * G);
  a.pass_rate[row] = s.mean;
  const lze::PromptStep u = next_state_of(a, row);
  a.energy[row] = u.next.last_energy;
  a.momentum[row] = u.momentum;
  return {kClaimable, u.next};
}

// Whether `row`'s prompt was already claimed in this step (by an earlier row: a duplicate id).
// >= rather than ==: the claim protocol the backends share (an atomic max of the stamp on a
// GPU) also refuses a prompt stamped by a later step (a state restored under an older step
// counter).
inline bool already_claimed(const StepArgs& a, int64_t row) {
  return a.records[a.prompt_ids[row] * lze::kRecordWords + lze::kIntFieldsAt + lze::kClaim] >=
         a.stamp;
}

// Rows per phase-1 task when threads share the step: small enough that a thread the OS
// schedules late leaves little for the others to wait on, large enough to amortise a claim.
constexpr int64_t kTaskRows = 1024;
// Phase-2 tasks per thread: ids are random, so equal id ranges carry about equal work.
constexpr int64_t kOwnersPerThread = 4;

// Claimable rows found by each row task, one list per owner of their prompt ids:
// lists[row_task * owners + owner], each in batch order.
using RowLists = std::vector<std::vector<int64_t>>;

struct TaskSplit {
  int64_t row_tasks;
  int64_t owners;
  std::vector<int64_t> owner_ends;  // owner o holds the ids [owner_ends[o - 1], owner_ends[o])

  TaskSplit(int64_t B, int64_t N, int threads)
      : row_tasks(threads > 1 ? std::max<int64_t>(1, B / kTaskRows) : 1),
        owners(threads > 1 ? threads * kOwnersPerThread : 1),
        owner_ends(owners) {
    for (int64_t o = 0; o < owners; ++o) {
      owner_ends[o] = lze_cpu::task_range(N, o, owners, kLineRows).end;
    }
  }

  // The owner of the in-range prompt `id`.
  int64_t owner_of(int64_t id) const {
    return std::upper_bound(owner_ends.begin(), owner_ends.end(), id) - owner_ends.begin();
  }
};

// Phase 1 on rows [r.begin, r.end); returns the fault bits seen and appends each claimable row
// to `lists[owner]`. kG > 0 fixes G at compile time (the common G = 16), which lets the
// compiler unroll the loops over a row completely.
template <int32_t kDType, bool kMasked, int64_t kG>
int32_t process_rows(const StepArgs& a, Range r, const TaskSplit& split,
                     std::vector<int64_t>* lists) {
  const int64_t G = kG > 0 ? kG : a.G;
  int32_t faults = 0;
  for (int64_t row = r.begin; row < r.end; ++row) {
    prefetch_state(a, row + kPrefetchRows, Range{0, a.N});
    const int32_t fault = process_row<kDType, kMasked>(a, row, G).fault;
    if (fault == kClaimable) {
      lists[split.owner_of(a.prompt_ids[row])].push_back(row);
    } else {
      faults |= fault;
    }
  }
  return faults;
}

// Both phases in one pass, on the calling thread alone: each claimable row commits its prompt
// as soon as it is processed, in batch order (so an earlier row wins, as in phase 2), with the
// state phase 1 computed. Returns the fault bits seen.
template <int32_t kDType, bool kMasked, int64_t kG>
int32_t process_and_commit_rows(const StepArgs& a) {
  const int64_t G = kG > 0 ? kG : a.G;
  int32_t faults = 0;
  for (int64_t row = 0; row < a.B; ++row) {
    prefetch_state(a, row + kPrefetchRows, Range{0, a.N});
    const RowResult result = process_row<kDType, kMasked>(a, row, G);
    if (result.fault != kClaimable) {
      faults |= result.fault;
    } else if (already_claimed(a, row)) {
      zero_row(a, row);
      faults |= lze::kFaultDuplicateId;
    } else {
      store_state(a, a.prompt_ids[row], result.next);
    }
  }
  return faults;
}

// Phase 2 on the claimable rows of one owner, in batch order: commits the first row of each id
// and zeroes the outputs of later rows with the same id; returns whether there were any.
bool commit_states(const StepArgs& a, const std::vector<int64_t>& rows) {
  bool duplicates = false;
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_state(a, rows[j + kPrefetchRows], Range{0, a.N});
    const int64_t row = rows[j];
    if (already_claimed(a, row)) {
      zero_row(a, row);
      duplicates = true;
      continue;
    }
    store_state(a, a.prompt_ids[row], next_state_of(a, row).next);
  }
  return duplicates;
}

inline void record_faults(int32_t* fault, int32_t faults) {
  if (faults != 0) __atomic_fetch_or(fault, faults, __ATOMIC_RELAXED);
}

template <int32_t kDType, bool kMasked, int64_t kG>
void run_step(const StepArgs& a, int threads, RowLists& lists, int32_t* fault) {
  if (threads <= 1) {
    record_faults(fault, process_and_commit_rows<kDType, kMasked, kG>(a));
    return;
  }
  const TaskSplit split(a.B, a.N, threads);
  lists.resize(static_cast<size_t>(split.row_tasks * split.owners));
  for (auto& list : lists) list.clear();  // keeps the capacity of earlier calls
  lze_cpu::parallel_tasks(split.row_tasks, threads, [&](int64_t task) {
    const Range rows = lze_cpu::task_range(a.B, task, split.row_tasks, kLineRows);
    record_faults(fault, process_rows<kDType, kMasked, kG>(a, rows, split,
                                                           &lists[task * split.owners]));
  });
  // Row tasks in order hold ascending row ranges, so each owner commits in batch order.
  lze_cpu::parallel_tasks(split.owners, threads, [&](int64_t owner) {
    bool duplicates = false;
    for (int64_t task = 0; task < split.row_tasks; ++task) {
      duplicates |= commit_states(a, lists[task * split.owners + owner]);
    }
    record_faults(fault, duplicates ? lze::kFaultDuplicateId : 0);
  });
}

template <int32_t kDType>
void run_step_dtype(const StepArgs& a, int threads, RowLists& lists, int32_t* fault) {
  if (a.valid != nullptr) {
    run_step<kDType, true, 0>(a, threads, lists, fault);
  } else if (a.G == 16) {
    run_step<kDType, false, 16>(a, threads, lists, fault);
  } else {
    run_step<kDType, false, 0>(a, threads, lists, fault);
  }
}

}  // namespace

extern "C" int lze_step_cpu(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                            const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N,
                            int32_t* records, int64_t* step_counter, float* advantages,
                            float* pass_rate, float* energy, float* momentum, int32_t* fault,
                            lze::Params params, lze::ThreadBudget threads) {
  if (rewards_dtype != lze::kF32 && rewards_dtype != lze::kBF16 && rewards_dtype != lze::kF16) {
    return 1;
  }
  // Owned by the calling thread and kept across calls, so that the lists reach their size once.
  thread_local RowLists lists;
  static lze_cpu::ThreadChoice choice;
  const StepArgs args{rewards,   valid,     prompt_ids, B,        G,
                      N,         records,   advantages, pass_rate, energy,
                      momentum,  static_cast<int32_t>(step_counter[0] + 1), params};
  choice.run(threads, B, B * G + 1, [&](int team) {
    switch (rewards_dtype) {
      case lze::kF32: run_step_dtype<lze::kF32>(args, team, lists, fault); break;
      case lze::kBF16: run_step_dtype<lze::kBF16>(args, team, lists, fault); break;
      default: run_step_dtype<lze::kF16>(args, team, lists, fault); break;
    }
  });
  step_counter[0] += 1;
  return 0;
}

// C++ CPU kernel of the fused LZE step (SPEC 2, 3, 5): per-row statistics, GRPO advantages,
// Learning-Zone Energy and the per-prompt state update, matching lze_kernels/reference.py.
//
// The step runs in two phases inside one OpenMP region:
//  1. rows, split by batch position: statistics, advantages, fault bits, and the energy each
//     claimable row would get from the state as it was before the step (state is only read);
//  2. state, split by prompt id: phase 1 hands each claimable row to the thread that owns its id
//     (a list per pair of threads), and each owner commits its rows in batch order. The first
//     row carrying an id claims it (claim = stamp); a later row with the same id finds the stamp
//     and is a duplicate, exactly the reference's "earlier row wins", with no atomics and no two
//     threads writing the same state row.
// Duplicates are rare (a caller bug), so their outputs are zeroed afterwards.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"
#include "lze_kernels.h"

namespace {

using lze_cpu::Range;

// Rows per cache line of the [B] fp32 outputs: thread boundaries on multiples of this keep
// threads off each other's lines. Also a multiple of the 4 state rows in a 64-byte line.
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
  float* fstate;
  int32_t* istate;
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
  __builtin_prefetch(a.fstate + id * lze::kNumFloatFields, 1);
  __builtin_prefetch(a.istate + id * lze::kNumIntFields, 1);
}

// The state rows are a PromptState laid out as two 16-byte table rows (lze_math.h).
static_assert(sizeof(lze::PromptState) == 2 * 16, "PromptState must mirror the two rows");

inline lze::PromptState load_state(const StepArgs& a, int64_t id) {
  lze::PromptState s;
  std::memcpy(&s, a.fstate + id * lze::kNumFloatFields, 16);
  std::memcpy(reinterpret_cast<char*>(&s) + 16, a.istate + id * lze::kNumIntFields, 16);
  return s;
}

inline void store_state(const StepArgs& a, int64_t id, const lze::PromptState& s) {
  std::memcpy(a.fstate + id * lze::kNumFloatFields, &s, 16);
  std::memcpy(a.istate + id * lze::kNumIntFields, reinterpret_cast<const char*>(&s) + 16, 16);
}

// SPEC 3 and 5 for the prompt of `row`, from its state before the step.
inline lze::PromptStep next_state_of(const StepArgs& a, int64_t row) {
  return lze::advance_prompt(load_state(a, a.prompt_ids[row]), a.pass_rate[row], a.stamp,
                             a.params);
}

constexpr int32_t kClaimable = -1;

// Phase 1 for one row; returns its fault bits, or kClaimable (no fault, n > 0).
template <int32_t kDType, bool kMasked>
int32_t process_row(const StepArgs& a, int64_t row, int64_t G) {
  const RowView<kDType, kMasked> view{a.rewards, a.valid, row * G};
  const RowStats s = row_stats(view, G);
  const int64_t id = a.prompt_ids[row];
  const int32_t fault = s.fault | (id < 0 || id >= a.N ? lze::kFaultIdOutOfRange : 0);
  if (fault != 0 || s.count == 0) {
    zero_row(a, row);
    return fault;
  }
  write_advantages(view, G, s, a.params, a.advantages + row * G);
  a.pass_rate[row] = s.mean;
  const lze::PromptStep u = next_state_of(a, row);
  a.energy[row] = u.next.last_energy;
  a.momentum[row] = u.momentum;
  return kClaimable;
}

// Claimable rows found by each phase-1 thread, one list per owner of their prompt ids:
// lists[finder * threads + owner], each in batch order.
using RowLists = std::vector<std::vector<int64_t>>;

// The phase-2 threads split the ids [0, N) by thread_range; ends[t] is where thread t's stop.
std::vector<int64_t> owner_ends(int64_t N, int threads) {
  std::vector<int64_t> ends(threads);
  for (int t = 0; t < threads; ++t) ends[t] = lze_cpu::thread_range(N, t, threads, kLineRows).end;
  return ends;
}

// The phase-2 thread that owns the in-range prompt `id`.
inline int owner_of(int64_t id, const std::vector<int64_t>& ends) {
  int owner = 0;
  while (id >= ends[owner]) ++owner;
  return owner;
}

// Phase 1 on rows [r.begin, r.end); returns the fault bits seen and appends each claimable row
// to `lists[owner]`. kG > 0 fixes G at compile time (the common G = 16), which lets the
// compiler unroll the loops over a row completely.
template <int32_t kDType, bool kMasked, int64_t kG>
int32_t process_rows(const StepArgs& a, Range r, int threads, std::vector<int64_t>* lists) {
  const int64_t G = kG > 0 ? kG : a.G;
  const std::vector<int64_t> ends = owner_ends(a.N, threads);
  int32_t faults = 0;
  for (int64_t row = r.begin; row < r.end; ++row) {
    prefetch_state(a, row + kPrefetchRows, Range{0, a.N});
    const int32_t fault = process_row<kDType, kMasked>(a, row, G);
    if (fault == kClaimable) {
      lists[owner_of(a.prompt_ids[row], ends)].push_back(row);
    } else {
      faults |= fault;
    }
  }
  return faults;
}

// Phase 2 on the claimable rows of one owner, in batch order: commits the first row of each id
// and appends later rows with the same id to `duplicates`.
void commit_states(const StepArgs& a, const std::vector<int64_t>& rows,
                   std::vector<int64_t>& duplicates) {
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_state(a, rows[j + kPrefetchRows], Range{0, a.N});
    const int64_t row = rows[j];
    const int64_t id = a.prompt_ids[row];
    int32_t* is = a.istate + id * lze::kNumIntFields;
    // >= rather than ==: the claim protocol the backends share (an atomic max of the stamp on
    // a GPU) also refuses a prompt stamped by a later step (a state restored under an older
    // step counter).
    if (is[lze::kClaim] >= a.stamp) {
      duplicates.push_back(row);
      continue;
    }
    store_state(a, id, next_state_of(a, row).next);
  }
}

template <int32_t kDType, bool kMasked, int64_t kG>
void run_step(const StepArgs& a, RowLists& lists, int32_t* fault) {
#pragma omp parallel if (a.B >= lze_cpu::kParallelMinRows)
  {
    const int threads = lze_cpu::thread_count(), index = lze_cpu::thread_index();
#pragma omp single
    {
      lists.resize(static_cast<size_t>(threads) * threads);
      for (auto& list : lists) list.clear();  // keeps the capacity of earlier calls
    }
    const Range rows = lze_cpu::thread_range(a.B, index, threads, kLineRows);
    int32_t faults = process_rows<kDType, kMasked, kG>(a, rows, threads, &lists[index * threads]);
#pragma omp barrier
    // Finders in thread order hold ascending row ranges, so this is batch order.
    std::vector<int64_t> duplicates;
    for (int finder = 0; finder < threads; ++finder) {
      commit_states(a, lists[finder * threads + index], duplicates);
    }
#pragma omp barrier
    // Phase 1 wrote these rows' outputs; every thread is past it, so zeroing them is race-free.
    for (const int64_t row : duplicates) zero_row(a, row);
    if (!duplicates.empty()) faults |= lze::kFaultDuplicateId;
    if (faults != 0) __atomic_fetch_or(fault, faults, __ATOMIC_RELAXED);
  }
}

template <int32_t kDType>
void run_step_dtype(const StepArgs& a, RowLists& lists, int32_t* fault) {
  if (a.valid != nullptr) {
    run_step<kDType, true, 0>(a, lists, fault);
  } else if (a.G == 16) {
    run_step<kDType, false, 16>(a, lists, fault);
  } else {
    run_step<kDType, false, 0>(a, lists, fault);
  }
}

}  // namespace

extern "C" int lze_step_cpu(const void* rewards, int32_t rewards_dtype, const uint8_t* valid,
                            const int64_t* prompt_ids, int64_t B, int64_t G, int64_t N,
                            float* fstate, int32_t* istate, int64_t* step_counter,
                            float* advantages, float* pass_rate, float* energy, float* momentum,
                            int32_t* fault, lze::Params params) {
  // Owned by the calling thread and kept across calls, so that the lists reach their size once.
  thread_local RowLists lists;
  const StepArgs args{rewards,    valid,     prompt_ids, B,      G,        N,
                      fstate,     istate,    advantages, pass_rate, energy, momentum,
                      static_cast<int32_t>(step_counter[0] + 1), params};
  switch (rewards_dtype) {
    case lze::kF32: run_step_dtype<lze::kF32>(args, lists, fault); break;
    case lze::kBF16: run_step_dtype<lze::kBF16>(args, lists, fault); break;
    case lze::kF16: run_step_dtype<lze::kF16>(args, lists, fault); break;
    default: return 1;
  }
  step_counter[0] += 1;
  return 0;
}

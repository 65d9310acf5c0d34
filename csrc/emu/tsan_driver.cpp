// Standalone driver of the emulated CUDA kernels: runs lze_step_cuda, lze_topk_cuda and
// lze_select_step_cuda on small inputs (single- and multi-block grids, sub-warp and whole-warp
// rows, ragged groups, two steps over the same prompts, both top-k plans, the undo copy and the
// fault mirror) and checks them against a serial recomputation with lze_math.h; and
// checks the emulator's intrinsics (PTX shuffle rules, votes, partial warps, barriers with
// exited threads, dynamic shared memory, atomics, launch errors) with a kernel of its own.
// Built with emu_kernels.cpp in OS-thread mode under ThreadSanitizer by tools/emu_tsan.sh, and
// in fiber mode with coverage by tools/emu_gcov.sh. Prints "all checks passed" and exits 0 when
// every check holds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../cuda/cuda_compat.h"
#include "../cuda/lze_cuda.h"

namespace {

int failures = 0;

void check(bool ok, const char* what, int64_t index) {
  if (ok) return;
  ++failures;
  std::printf("FAILED: %s at %lld\n", what, static_cast<long long>(index));
}

constexpr lze::Params kParams{0.9f, static_cast<float>(1.0 - 0.9), 0.05f, 0.3f, 1e-6f, 1, 2};

// Deterministic pseudo-random bits for the inputs.
uint32_t input_bits(uint32_t i, uint32_t salt) { return lze::philox_4x32_10(salt, 7u, i); }

struct StepCase {
  int64_t B, G, N;
  std::vector<float> rewards;
  std::vector<uint8_t> valid;
  std::vector<int64_t> ids;
};

StepCase make_step_case(int64_t B, int64_t G, uint32_t salt) {
  StepCase c{B, G, 2 * B, {}, {}, {}};
  for (int64_t i = 0; i < B * G; ++i) {
    const uint32_t bits = input_bits(static_cast<uint32_t>(i), salt);
    c.rewards.push_back(static_cast<float>(bits & 1u));
    c.valid.push_back(static_cast<uint8_t>((i % G) < 1 + (i / G) % G));  // ragged, never empty
  }
  for (int64_t i = 0; i < B; ++i) c.ids.push_back((i * 7) % c.N);  // distinct ids
  return c;
}

struct State {
  std::vector<int32_t> records;  // [N + 1, 8]
  int64_t step_counter[2] = {0, 0};
  int32_t fault = 0;
  explicit State(int64_t N) : records(lze::kRecordWords * (N + 1), 0) {
    for (int64_t i = 0; i <= N; ++i) set_float(i, lze::kDInit, -1.0f);
  }
  float get_float(int64_t id, int field) const {
    float v;
    std::memcpy(&v, &records[lze::kRecordWords * id + field], 4);
    return v;
  }
  void set_float(int64_t id, int field, float v) {
    std::memcpy(&records[lze::kRecordWords * id + field], &v, 4);
  }
  int32_t& integer(int64_t id, int field) {
    return records[lze::kRecordWords * id + lze::kIntFieldsAt + field];
  }
};

// Serial model of one step for the rows of a fault-free, duplicate-free batch.
void expected_step(const StepCase& c, State& st, std::vector<float>& adv, std::vector<float>& p,
                   std::vector<float>& e, std::vector<float>& m) {
  const int32_t stamp = static_cast<int32_t>(st.step_counter[0] + 1);
  for (int64_t row = 0; row < c.B; ++row) {
    int count = 0;
    float sum = 0.0f, sq = 0.0f;
    for (int64_t j = 0; j < c.G; ++j) {
      if (c.valid[row * c.G + j]) count += 1, sum += c.rewards[row * c.G + j];
    }
    const float mean = sum / static_cast<float>(count);
    for (int64_t j = 0; j < c.G; ++j) {
      const float d = c.rewards[row * c.G + j] - mean;
      if (c.valid[row * c.G + j]) sq += d * d;
    }
    const float sd = lze::unbiased_std(sq, count);
    for (int64_t j = 0; j < c.G; ++j) {
      const int64_t at = row * c.G + j;
      adv[at] = c.valid[at] ? lze::grpo_advantage(c.rewards[at], mean, sd, count, kParams) : 0.0f;
    }
    const int64_t id = c.ids[row];
    const bool first = st.integer(id, lze::kSeen) == 0;
    const float d_init = first ? lze::anchor_difficulty(mean, kParams) : st.get_float(id, lze::kDInit);
    m[row] = first ? 0.0f : lze::momentum(mean, st.get_float(id, lze::kEma));
    e[row] = lze::energy(d_init, lze::uncertainty(mean), m[row], kParams);
    p[row] = mean;
    const float ema = first ? mean : lze::ema_update(st.get_float(id, lze::kEma), mean, kParams);
    const int32_t streak =
        mean >= lze::kSolvedThreshold ? st.integer(id, lze::kSolvedStreak) + 1 : 0;
    st.set_float(id, lze::kDInit, d_init);
    st.set_float(id, lze::kEma, ema);
    st.set_float(id, lze::kLastPassRate, mean);
    st.set_float(id, lze::kLastEnergy, e[row]);
    st.integer(id, lze::kSeen) += 1;
    st.integer(id, lze::kSolvedStreak) = streak;
    st.integer(id, lze::kFlags) = streak >= kParams.prune_after ? lze::kFlagPruned : 0;
    st.integer(id, lze::kClaim) = stamp;
  }
  st.step_counter[0] += 1;
}

void run_step_case(int64_t B, int64_t G, uint32_t salt) {
  const StepCase c = make_step_case(B, G, salt);
  State got(c.N), want(c.N);
  std::vector<float> adv(B * G), p(B), e(B), m(B), adv_w(B * G), p_w(B), e_w(B), m_w(B);
  for (int step = 0; step < 2; ++step) {
    const int rc = lze_step_cuda(c.rewards.data(), lze::kF32, c.valid.data(), c.ids.data(), B, G,
                                 c.N, got.records.data(), got.step_counter, adv.data(), p.data(),
                                 e.data(), m.data(), &got.fault, kParams, 0, nullptr);
    check(rc == 0, "step launch", step);
    expected_step(c, want, adv_w, p_w, e_w, m_w);
    for (int64_t i = 0; i < B; ++i) {
      check(p[i] == p_w[i] && e[i] == e_w[i] && m[i] == m_w[i], "step row outputs", i);
    }
    for (int64_t i = 0; i < B * G; ++i) {
      check(std::fabs(adv[i] - adv_w[i]) <= 1e-6f * (1.0f + std::fabs(adv_w[i])), "advantage", i);
    }
    check(got.records == want.records, "state records", step);
    check(got.step_counter[0] == want.step_counter[0] && got.step_counter[1] == 0, "counter", step);
    check(got.fault == 0, "fault word", step);
  }
}

// Checks a selection against a serial one: keep the k best candidates (E > 0) by noisy score
// keyed by (seed, step), ties to the smaller row; kept_indices in row order, -1 padded.
void check_selection(const std::vector<float>& energy, int64_t k, float noise_scale,
                     uint32_t seed, uint32_t step, const std::vector<uint8_t>& keep,
                     const std::vector<int64_t>& kept, int64_t num_kept) {
  const int64_t B = static_cast<int64_t>(energy.size());
  float high = -INFINITY, low = INFINITY;
  std::vector<int64_t> order;
  for (int64_t i = 0; i < B; ++i) {
    if (energy[i] > 0.0f) high = std::max(high, energy[i]), low = std::min(low, energy[i]);
    if (energy[i] > 0.0f) order.push_back(i);
  }
  const float scale = noise_scale > 0.0f ? lze::gumbel_scale(noise_scale, high, low) : 0.0f;
  auto key = [&](int64_t i) {
    return lze::selection_key(lze::noisy_score(energy[i], scale, seed, step, uint32_t(i)), i);
  };
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key(x) > key(y); });
  const int64_t want_kept = std::min<int64_t>(k, static_cast<int64_t>(order.size()));
  check(num_kept == want_kept, "num_kept", B);
  std::vector<uint8_t> want_keep(B, 0);
  for (int64_t r = 0; r < want_kept; ++r) want_keep[order[r]] = 1;
  check(keep == want_keep, "keep_mask", B);
  int64_t slot = 0;  // kept_indices: the kept rows in row order, then -1
  for (int64_t i = 0; i < B; ++i) {
    if (want_keep[i]) check(kept[slot++] == i, "kept", i);
  }
  for (; slot < k; ++slot) check(kept[slot] == -1, "padding", slot);
}

void run_topk_case(int64_t B, float noise_scale) {
  std::vector<float> energy(B);
  for (int64_t i = 0; i < B; ++i) {
    energy[i] = static_cast<float>(input_bits(static_cast<uint32_t>(i), 3u) % 5u) / 8.0f;
  }
  const int64_t k = std::max<int64_t>(1, B * 2 / 5);
  const int64_t step_counter[2] = {3, 0};
  std::vector<uint8_t> keep(B);
  std::vector<int64_t> kept(k);
  lze::cuda_select::TopkPlan plan{};
  check(lze_topk_cuda_plan(B, 0, &plan) == 0, "topk plan", B);
  std::vector<unsigned char> workspace(lze_topk_cuda_workspace_bytes(&plan) + 1);
  int64_t num_kept = -1;
  const int rc = lze_topk_cuda(energy.data(), B, k, noise_scale, 42u, step_counter, keep.data(),
                               kept.data(), &num_kept, workspace.data(), &plan, 0, nullptr);
  check(rc == 0, "topk launch", B);
  check_selection(energy, k, noise_scale, 42u, 3u, keep, kept, num_kept);
}

// Two selection steps in one call each (lze_select_step_cuda): the step, the Gumbel draws and
// the extent in the step kernel, the top-k plan of B, the undo copy and the fault mirror (a
// bad id in the second step).
void run_select_case(int64_t B, int64_t G, float noise_scale, uint32_t salt) {
  StepCase c = make_step_case(B, G, salt);
  State got(c.N), want(c.N);
  const int64_t k = std::max<int64_t>(1, B * 2 / 5);
  std::vector<float> adv(B * G), p(B), e(B), m(B), adv_w(B * G), p_w(B), e_w(B), m_w(B);
  std::vector<uint8_t> keep(B);
  std::vector<int64_t> kept(k);
  std::vector<int32_t> undo(B * lze::kRecordWords);
  lze::cuda_select::TopkPlan plan{};
  check(lze_select_step_cuda_plan(B, 0, &plan) == 0, "select plan", B);
  std::vector<unsigned char> workspace(lze_select_step_cuda_workspace_bytes(&plan, G));
  int64_t num_kept = -1;
  int32_t mirror = -1;
  for (int step = 0; step < 2; ++step) {
    const std::vector<int32_t> before = got.records;
    if (step == 1) c.ids[B / 2] = c.N + 5;  // out of range: skipped, fault bit 1
    lze::SelectStep s{};
    s.rewards = c.rewards.data(), s.valid = c.valid.data(), s.prompt_ids = c.ids.data();
    s.rewards_dtype = lze::kF32, s.B = B, s.G = G, s.N = c.N, s.k = k;
    s.records = got.records.data(), s.step_counter = got.step_counter, s.fault = &got.fault;
    s.fault_mirror = &mirror, s.undo = undo.data();
    s.advantages = adv.data(), s.pass_rate = p.data(), s.energy = e.data();
    s.momentum = m.data(), s.keep_mask = keep.data(), s.kept_indices = kept.data();
    s.num_kept = &num_kept, s.workspace = workspace.data();
    s.params = kParams, s.noise_scale = noise_scale, s.seed = 11u;
    check(lze_select_step_cuda(&s, &plan, 0, nullptr) == 0, "select step launch", B);
    for (int64_t row = 0; row < B; ++row) {
      const int64_t id = std::min(std::max<int64_t>(c.ids[row], 0), c.N);
      check(std::equal(undo.begin() + row * lze::kRecordWords,
                       undo.begin() + (row + 1) * lze::kRecordWords,
                       before.begin() + id * lze::kRecordWords), "undo records", row);
    }
    if (step == 0) {
      expected_step(c, want, adv_w, p_w, e_w, m_w);
      check(got.records == want.records, "select step records", B);
      check(e == e_w && p == p_w && m == m_w, "select step rows", B);
    }
    check(mirror == got.fault && got.fault == (step == 0 ? 0 : lze::kFaultIdOutOfRange),
          "fault mirror", step);
    check(got.step_counter[0] == step + 1 && got.step_counter[1] == 0, "select counter", step);
    check_selection(e, k, noise_scale, 11u, static_cast<uint32_t>(step + 1), keep, kept,
                    num_kept);
  }
}

// Emulator self-check: 48 threads per block, one full warp and one half warp.
constexpr unsigned kCheckThreads = 48;
constexpr unsigned kCheckAlive = 40;  // threads past this exit before the barrier
constexpr unsigned kCheckBlocks = 2;
constexpr int kCheckOutputs = 7;

__global__ void intrinsics_kernel(unsigned* out, unsigned* counters, float* sum) {
  LZE_DYNAMIC_SHARED(unsigned, slots);
  const unsigned t = threadIdx.x;
  const unsigned present = __ballot_sync(0xffffffffu, 1);
  const unsigned v = blockIdx.x * 1000u + t;
  unsigned* o = out + (blockIdx.x * blockDim.x + t) * kCheckOutputs;
  o[0] = __shfl_up_sync(present, v, 3, 8);
  o[1] = __shfl_down_sync(present, v, 5, 16);
  o[2] = __shfl_xor_sync(present, v, 9);
  o[3] = __shfl_sync(present, v, 37, 8);
  o[4] = __ballot_sync(present, t % 3 == 0);
  o[5] = 2u * __any_sync(present, t == kCheckAlive) + __all_sync(present, t < kCheckAlive);
  atomicAdd(&counters[0], 1u);
  atomicMax(&counters[1], v);
  atomicOr(&counters[2], 1u << (t % 32));
  atomicCAS(&counters[3], 0u, t + 1);
  atomicAdd(sum, 0.5f);
  if (t >= kCheckAlive) return;
  slots[t] = v;
  __syncthreads();  // the exited threads do not hold the barrier up
  o[6] = slots[(t + 1) % kCheckAlive];
  __syncwarp(t < 32 ? 0xffffffffu : 0xffu);
}
LZE_KERNEL_RESOURCES(intrinsics_kernel, 1024, 0);

unsigned expected_intrinsic(unsigned block, unsigned t, int output) {
  const unsigned lane = t % 32, v = block * 1000u + t, base = v - lane;
  switch (output) {
    case 0: return lane % 8 >= 3 ? v - 3 : v;
    case 1: return lane % 16 + 5 < 16 ? v + 5 : v;
    case 2: return base + (lane ^ 9u);
    case 3: return base + ((lane & ~7u) | 5u);
    case 4: {
      unsigned ballot = 0;
      for (unsigned u = t - lane; u < std::min(t - lane + 32, kCheckThreads); ++u) {
        ballot |= (u % 3 == 0 ? 1u : 0u) << (u % 32);
      }
      return ballot;
    }
    case 5: return t < 32 ? 1u : 2u;
    default: return block * 1000u + (t + 1) % kCheckAlive;
  }
}

void run_intrinsics_check() {
  std::vector<unsigned> out(kCheckBlocks * kCheckThreads * kCheckOutputs, 0);
  unsigned counters[4] = {0, 0, 0, 0};
  float sum = 0.0f;
  LZE_LAUNCH(intrinsics_kernel, dim3(kCheckBlocks), dim3(kCheckThreads),
             kCheckAlive * sizeof(unsigned), nullptr)(out.data(), counters, &sum);
  check(cudaGetLastError() == cudaSuccess, "intrinsics launch", 0);
  for (unsigned b = 0; b < kCheckBlocks; ++b) {
    for (unsigned t = 0; t < kCheckThreads; ++t) {
      for (int o = 0; o < (t < kCheckAlive ? kCheckOutputs : kCheckOutputs - 1); ++o) {
        const unsigned got = out[(b * kCheckThreads + t) * kCheckOutputs + o];
        check(got == expected_intrinsic(b, t, o), "intrinsic output", o * 1000 + t);
      }
    }
  }
  check(counters[0] == kCheckBlocks * kCheckThreads && counters[1] == 1047u &&
            counters[2] == 0xffffffffu && counters[3] >= 1 && counters[3] <= kCheckThreads &&
            sum == 48.0f, "atomics", 0);
  check(__popc(0xF0F0u) == 8 && __popcll(~0ull) == 64 && __clz(1) == 31 && __clzll(1) == 63 &&
            __ffs(8) == 4 && __ffs(0) == 0 && __ffsll(1ll << 40) == 41, "bit intrinsics", 0);
  LZE_LAUNCH(intrinsics_kernel, dim3(1), dim3(2000), 0, nullptr)(out.data(), counters, &sum);
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch error", 0);
  check(cudaGetLastError() == cudaSuccess, "launch error is cleared", 0);
}

}  // namespace

// The devices of one architecture's limits, blocks started in `order`.
void use_architecture(int sm, emu::BlockOrder order) {
  emu::Devices::get().set({emu::architecture(sm)});
  emu::Registry::get().reset_attributes();
  lze_cuda_forget_device_shapes();
  const std::lock_guard<std::mutex> lock(emu::policy_mutex());
  emu::grid_policy() = emu::GridPolicy{order, static_cast<uint64_t>(sm), 0};
}

int main() {
  run_intrinsics_check();
  // Every architecture's limits (and its plans: two 16-bit digits on sm_80 and sm_90, three of
  // 11, 11 and 10 bits on sm_86 and sm_89), blocks in forward, reverse and random order.
  const std::pair<int, emu::BlockOrder> runs[] = {{80, emu::BlockOrder::kForward},
                                                  {86, emu::BlockOrder::kReverse},
                                                  {89, emu::BlockOrder::kRandom},
                                                  {90, emu::BlockOrder::kForward}};
  // The step kernel and the one-block plan do not change with the architecture (under
  // LZE_EMU_SMALL_PLANS the one-block plan takes up to 2,048 rows everywhere): their cases once;
  // the large plan's (two 16-bit digits on sm_80 and sm_90, three of 11, 11 and 10 bits on sm_86
  // and sm_89, tiles of at least 1,024 rows here) under every architecture.
  use_architecture(runs[0].first, runs[0].second);
  run_step_case(600, 8, 1);  // tiles of 256 rows (G <= 32): 3 blocks, the last partial
  run_step_case(12, 40, 2);  // one warp per row, 8 rows per block: 2 blocks
  run_step_case(6, 3, 3);    // one tile, partial warp of rows
  run_topk_case(50, 0.0f);   // one block
  run_topk_case(300, 0.05f);
  run_select_case(600, 8, 0.05f, 4);  // one block, the draws and extent from the step kernel
  run_select_case(40, 40, 0.05f, 6);  // the warp-per-row step kernel's extents and draws
  for (const auto& [sm, order] : runs) {
    use_architecture(sm, order);
    run_topk_case(2100, 0.05f);          // prepare + the large plan, the last tile 52 rows
    run_select_case(2500, 4, 0.05f, 5);  // the large plan over three tiles
  }
  if (failures != 0) {
    std::printf("%d checks failed\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}

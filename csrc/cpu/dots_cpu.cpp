// C++ CPU kernel of the DOTS pass-rate prediction (docs/spec.md §8), matching
// lze_kernels/dots.py::predict_pass_rates_reference:
//   p_hat_q = sum_j softmax_j(scale <z_q, z_j>) y_j.
//
// One pass over the queries, in blocks of kQueryBlock rows, with no [N, K] matrix: for each tile
// of kRefTile references the block's [kQueryBlock, kRefTile] scores are formed in registers (a
// register-blocked micro-kernel over a transposed copy of the references, [d, K'] with K' = K
// rounded up to the tile), reduced per query to an lze::OnlineSoftmax state and merged into the
// query's running state (lze_math.h). Threads take blocks of queries (cpu/parallel.h); outputs
// do not depend on the thread count.
//
// Work: 2 N K d flops (the score products dominate), N K exponentials; memory: the queries are
// read once, the references (K d floats, L2-resident for K = 256, d = 384) once per block.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/parallel.h"
#include "lze_kernels.h"

#define LZE_ALWAYS_INLINE __attribute__((always_inline)) inline

namespace {

constexpr int64_t kQueryBlock = 4;  // query rows per micro-kernel call
constexpr int64_t kRefTile = 32;    // references per micro-kernel call (2 AVX-512 vectors)
constexpr int64_t kTaskQueries = 512;  // queries per task of the thread pool

// refs_t[k * padded_refs + j] = refs[j * dim + k]; columns j >= n_refs are zero.
void transpose_refs(const float* refs, int64_t n_refs, int64_t dim, int64_t padded_refs,
                    float* refs_t) {
  std::fill_n(refs_t, dim * padded_refs, 0.0f);
  for (int64_t j = 0; j < n_refs; ++j) {
    for (int64_t k = 0; k < dim; ++k) refs_t[k * padded_refs + j] = refs[j * dim + k];
  }
}

// scores[i][t] = <query_i, ref_(first_ref + t)> for the kQueryBlock rows `rows` and kRefTile
// references, in kQueryBlock x kRefTile accumulators (8 zmm registers with AVX-512). kFused:
// explicit fmaf, one vfmadd per product (the build turns contraction off, and fmaf is a slow
// libm call where the ISA has no FMA, hence the unfused variant).
template <bool kFused>
LZE_ALWAYS_INLINE void score_tile(const float* const* rows, const float* refs_t,
                                  int64_t padded_refs, int64_t dim, int64_t first_ref,
                                  float scores[kQueryBlock][kRefTile]) {
  float acc[kQueryBlock][kRefTile] = {};
  for (int64_t k = 0; k < dim; ++k) {
    const float* column = refs_t + k * padded_refs + first_ref;
    for (int64_t i = 0; i < kQueryBlock; ++i) {
      const float q = rows[i][k];
#pragma omp simd
      for (int64_t t = 0; t < kRefTile; ++t) {
        acc[i][t] = kFused ? fmaf(q, column[t], acc[i][t]) : acc[i][t] + q * column[t];
      }
    }
  }
  std::copy(&acc[0][0], &acc[0][0] + kQueryBlock * kRefTile, &scores[0][0]);
}

// The online-softmax state of one query's scaled scores over references
// [first_ref, first_ref + count), count <= kRefTile.
LZE_ALWAYS_INLINE lze::OnlineSoftmax tile_state(const float* scores, const float* labels, int64_t count,
                              float scale) {
  float s[kRefTile];
  float max = -INFINITY;
  for (int64_t t = 0; t < count; ++t) {
    s[t] = scores[t] * scale;
    max = std::max(max, s[t]);
  }
  float sum = 0.0f, weighted = 0.0f;
#pragma omp simd reduction(+ : sum, weighted)
  for (int64_t t = 0; t < count; ++t) {
    const float w = lze::exp_nonpositive(s[t] - max);
    sum += w;
    weighted += w * labels[t];
  }
  return lze::OnlineSoftmax{max, sum, weighted};
}

struct Problem {
  const float* queries;
  const float* refs_t;
  const float* labels;
  int64_t n_refs, padded_refs, dim;
  float scale;
  float* out;
};

// Predictions of queries [begin, end).
template <bool kFused>
LZE_ALWAYS_INLINE void predict_range(const Problem& p, int64_t begin, int64_t end) {
  float scores[kQueryBlock][kRefTile];
  for (int64_t q0 = begin; q0 < end; q0 += kQueryBlock) {
    // A short last block repeats its last row; only real rows are written.
    const float* rows[kQueryBlock];
    for (int64_t i = 0; i < kQueryBlock; ++i) {
      rows[i] = p.queries + std::min(q0 + i, end - 1) * p.dim;
    }
    lze::OnlineSoftmax state[kQueryBlock];
    std::fill_n(state, kQueryBlock, lze::online_softmax_empty());
    for (int64_t j0 = 0; j0 < p.n_refs; j0 += kRefTile) {
      score_tile<kFused>(rows, p.refs_t, p.padded_refs, p.dim, j0, scores);
      const int64_t count = std::min(kRefTile, p.n_refs - j0);
      for (int64_t i = 0; i < kQueryBlock; ++i) {
        state[i] = lze::online_softmax_merge(
            state[i], tile_state(scores[i], p.labels + j0, count, p.scale));
      }
    }
    for (int64_t i = 0; i < kQueryBlock && q0 + i < end; ++i) {
      p.out[q0 + i] = lze::online_softmax_mean(state[i]);
    }
  }
}

// predict_range compiled per ISA (everything above is inlined into each), chosen once by CPU
// features. Results differ between the fused and unfused variants in the last bits only.
__attribute__((target("avx512f"))) void predict_range_avx512(const Problem& p, int64_t begin,
                                                              int64_t end) {
  predict_range<true>(p, begin, end);
}

__attribute__((target("avx2,fma"))) void predict_range_avx2(const Problem& p, int64_t begin,
                                                            int64_t end) {
  predict_range<true>(p, begin, end);
}

void predict_range_baseline(const Problem& p, int64_t begin, int64_t end) {
  predict_range<false>(p, begin, end);
}

using RangeKernel = void (*)(const Problem&, int64_t, int64_t);

RangeKernel range_kernel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return predict_range_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return predict_range_avx2;
  return predict_range_baseline;
}

void predict(const Problem& p, int64_t n_queries, int threads) {
  static const RangeKernel kernel = range_kernel();
  const int64_t tasks = threads > 1 ? (n_queries + kTaskQueries - 1) / kTaskQueries : 1;
  lze_cpu::parallel_tasks(tasks, threads, [&](int64_t task) {
    // 16-query granules: no two tasks write one cache line of the output.
    const lze_cpu::Range rows = lze_cpu::task_range(n_queries, task, tasks, 16);
    if (rows.begin < rows.end) kernel(p, rows.begin, rows.end);
  });
}

}  // namespace

extern "C" int lze_dots_predict_cpu(const float* queries, const float* refs, const float* labels,
                                    int64_t N, int64_t K, int64_t d, float scale, float* out,
                                    lze::ThreadBudget threads) {
  if (K < 1 || d < 1 || N < 0) return 1;
  if (N == 0) return 0;
  const int64_t padded_refs = (K + kRefTile - 1) / kRefTile * kRefTile;
  // Kept across calls: a fresh buffer of this size comes from mmap and its page faults.
  thread_local std::vector<float> refs_t;
  refs_t.resize(d * padded_refs);
  transpose_refs(refs, K, d, padded_refs, refs_t.data());
  const Problem problem{queries, refs_t.data(), labels, K, padded_refs, d, scale, out};
  static lze_cpu::ThreadChoice choice;
  // Team size by work, not rows: one thread per kRowsPerThread x 4096 multiply-adds (~2 ms).
  const int64_t work = N * K * d / 4096 + 1;
  choice.run(threads, work, work, [&](int team) { predict(problem, N, team); });
  return 0;
}

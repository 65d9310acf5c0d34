// OpenMP helpers shared by the C++ CPU kernels. The kernels also build without OpenMP (the
// pragmas are then ignored and these helpers report a single thread).
#pragma once
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace lze_cpu {

// Below this many rows a kernel stays on the calling thread: waking the OpenMP team costs a few
// microseconds, about as much as the whole kernel at that size.
constexpr int64_t kParallelMinRows = 8192;

inline int thread_count() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Half-open range [begin, end) of `total` items that thread `index` of `count` owns, aligned to
// `granule` items so that no two threads write the same cache line.
struct Range {
  int64_t begin;
  int64_t end;
};

inline Range thread_range(int64_t total, int index, int count, int64_t granule) {
  const int64_t granules = (total + granule - 1) / granule;
  const int64_t lo = granules * index / count * granule;
  const int64_t hi = granules * (index + 1) / count * granule;
  return Range{lo < total ? lo : total, hi < total ? hi : total};
}

}  // namespace lze_cpu

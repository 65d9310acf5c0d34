// CPU emulator of the CUDA subset used by csrc/cuda/*.cu, so that the unchanged kernel sources
// build with g++ (-std=c++20 -pthread, through csrc/cuda/cuda_compat.h) and run in the tests on
// machines without a GPU, under the rules a GPU and its driver enforce. Test support, not a model
// of GPU performance.
//
// Parts:
//  * emu_device.h: the devices (the limits of sm_80, sm_86, sm_89 and sm_90, chosen per test) and
//    the kernels' declared resources; cudaFuncSetAttribute and a launch fail where the driver
//    fails them, with its error code;
//  * emu_block.h: a running block: CUDA threads as fibers (or OS threads, -DLZE_EMU_OS_THREADS,
//    for ThreadSanitizer), barriers and warp collectives by the PTX rules, shared memory that
//    starts poisoned, the spin watch;
//  * emu_grid.h: a launch's blocks in the order a test asks for (forward, reverse, seeded
//    random) with a bounded number resident, and the forward-progress watch;
//  * emu_runtime.h: streams, events, graph capture and host-mapped memory, with launches queued
//    and run after the call returns when a test asks (worker or held mode), sticky errors;
//  * this file: the CUDA language, the runtime API the kernels and bindings call, the device
//    intrinsics (atomics count their polls for the spin watch; 16-byte vector accesses, through
//    cuda_compat.h's LZE_LOAD_VECTOR / LZE_STORE_VECTOR, trap when misaligned, as the hardware
//    does with "misaligned address", instead of crashing the process).
//
// Memory model: plain loads and stores are plain C++; atomics are sequentially consistent
// std::atomic_ref operations and __threadfence is a seq_cst fence. This is stronger than a GPU's
// memory model, so a missing __threadfence does not fail here.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "emu_runtime.h"

// ----------------------------------------------------------------------------- CUDA language

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared memory is declared with LZE_SHARED (cuda_compat.h), which the emulator places in
// the running block's shared memory; a bare __shared__ does not compile here.
#define __shared__ static_assert(false, "declare static shared memory with LZE_SHARED");

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

constexpr int warpSize = 32;

using cudaStream_t = struct CUstream_st*;
using cudaEvent_t = struct CUevent_st*;
using cudaGraph_t = struct CUgraph_st*;
using cudaGraphExec_t = struct CUgraphExec_st*;
#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))
constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
constexpr unsigned cudaHostAllocMapped = 2, cudaHostRegisterMapped = 2;

enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrMaxBlocksPerMultiprocessor = 106,
  cudaDevAttrReservedSharedMemoryPerBlock = 111,
};
enum cudaStreamCaptureMode : int { cudaStreamCaptureModeGlobal = 0 };
enum cudaStreamCaptureStatus : int {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
};
enum cudaMemcpyKind : int { cudaMemcpyDefault = 4 };

// The subset of the driver's per-kernel attributes the launchers read.
struct cudaFuncAttributes {
  size_t sharedSizeBytes;  // static shared memory
  int maxThreadsPerBlock;
  int maxDynamicSharedSizeBytes;
};

#define threadIdx (::emu::current().idx)
#define blockIdx (::emu::current().block->idx)
#define blockDim (::emu::current().block->dim)
#define gridDim (::emu::current().block->grid->grid)

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

namespace emu {

// Declared next to each kernel (LZE_KERNEL_RESOURCES): its launch bound and static shared memory.
template <typename Kernel>
bool register_kernel(Kernel kernel, const char* name, int max_threads, int static_shared_bytes) {
  return Registry::get().add(reinterpret_cast<const void*>(kernel), name, max_threads,
                             static_shared_bytes);
}

template <typename Kernel>
KernelInfo& kernel_info(Kernel kernel) {
  KernelInfo* k = Registry::get().find(reinterpret_cast<const void*>(kernel));
  if (k == nullptr) fail("a kernel without LZE_KERNEL_RESOURCES (cuda_compat.h)");
  return *k;
}

// The emulated `kernel<<<grid, block, shared_bytes, stream>>>(args...)`: the arguments convert
// to the kernel's parameter types as in CUDA and are kept with the queued launch; every CUDA
// thread calls the kernel with them.
template <typename... Params>
class Launcher {
 public:
  Launcher(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
           cudaStream_t stream)
      : kernel_(kernel), grid_(grid), block_(block), shared_bytes_(shared_bytes),
        stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    auto bound = std::make_shared<std::tuple<std::decay_t<Params>...>>(
        std::forward<Args>(args)...);
    void (*kernel)(Params...) = kernel_;
    launch(reinterpret_cast<const void*>(kernel_), grid_, block_, shared_bytes_, stream_,
           [kernel, bound] { std::apply(kernel, *bound); });
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_;
  dim3 block_;
  size_t shared_bytes_;
  cudaStream_t stream_;
};

// A 16-byte (or any vector) access at `p`: a misaligned one faults the kernel (sticky
// cudaErrorMisalignedAddress) and reads or writes through memcpy instead of crashing.
template <typename T>
bool aligned_for(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) == 0) return true;
  trap(cudaErrorMisalignedAddress,
       "misaligned address: a " + std::to_string(sizeof(T)) + "-byte vector access at " +
           std::to_string(reinterpret_cast<uintptr_t>(p)) + ", which is not " +
           std::to_string(alignof(T)) + "-byte aligned");
  return false;
}

template <typename T>
T load_vector(const T* p) {
  if (aligned_for(p)) return *p;
  T out;
  std::memcpy(&out, p, sizeof(T));
  return out;
}

template <typename T>
void store_vector(T* p, const T& value) {
  if (aligned_for(p)) {
    *p = value;
  } else {
    std::memcpy(p, &value, sizeof(T));
  }
}

inline Stream* stream_of(cudaStream_t handle) { return Runtime::get().stream(handle); }

}  // namespace emu

// ----------------------------------------------------------------------------- CUDA runtime API

inline cudaError_t cudaGetLastError() {
  const cudaError_t sticky = emu::Runtime::get().sticky(emu::Devices::current());
  const cudaError_t error = std::exchange(emu::last_error(), cudaSuccess);
  return sticky != cudaSuccess ? sticky : error;
}
inline cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky = emu::Runtime::get().sticky(emu::Devices::current());
  return sticky != cudaSuccess ? sticky : emu::last_error();
}

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = emu::Devices::get().count();
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = emu::Devices::current();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= emu::Devices::get().count()) return cudaErrorInvalidDevice;
  emu::Devices::current() = device;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= emu::Devices::get().count()) return cudaErrorInvalidDevice;
  const emu::DeviceLimits d = emu::Devices::get().limits(device);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = d.max_threads_per_block; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = d.shared_per_block; break;
    case cudaDevAttrMultiProcessorCount: *value = d.sms; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = d.max_threads_per_sm; break;
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = d.shared_per_sm; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.shared_per_block_optin; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = d.max_blocks_per_sm; break;
    case cudaDevAttrReservedSharedMemoryPerBlock: *value = d.reserved_shared_per_block; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// The driver's check: the kernel's static shared memory plus the dynamic it may ask for within
// the current device's opt-in limit.
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  emu::KernelInfo& k = emu::kernel_info(kernel);
  const int device = emu::Devices::current();
  const emu::DeviceLimits d = emu::Devices::get().limits(device);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value + k.static_shared_bytes > d.shared_per_block_optin) {
    return cudaErrorInvalidValue;
  }
  emu::Registry::get().set_max_dynamic_shared(k, device, value);
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Kernel kernel) {
  emu::KernelInfo& k = emu::kernel_info(kernel);
  attributes->sharedSizeBytes = static_cast<size_t>(k.static_shared_bytes);
  attributes->maxThreadsPerBlock = k.max_threads;
  attributes->maxDynamicSharedSizeBytes =
      emu::Registry::get().max_dynamic_shared(k, emu::Devices::current());
  return cudaSuccess;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  *stream = reinterpret_cast<cudaStream_t>(
      emu::Runtime::get().create_stream(emu::Devices::current()));
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  emu::Stream* s = emu::stream_of(stream);
  return s == nullptr ? cudaErrorInvalidResourceHandle : emu::Runtime::get().synchronize(s);
}
inline cudaError_t cudaDeviceSynchronize() {
  return emu::Runtime::get().synchronize_device(emu::Devices::current());
}

inline cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new emu::Event());
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<emu::Event*>(event);
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  emu::Runtime::get().record(*reinterpret_cast<emu::Event*>(event), s);
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) {
  return emu::Runtime::get().event_done(*reinterpret_cast<emu::Event*>(event)) ? cudaSuccess
                                                                              : cudaErrorNotReady;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return emu::Runtime::get().synchronize(*reinterpret_cast<emu::Event*>(event));
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                       unsigned flags = 0) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr || flags != 0) return cudaErrorInvalidValue;
  return emu::Runtime::get().wait(s, *reinterpret_cast<emu::Event*>(event));
}

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  return emu::Runtime::get().enqueue(s, emu::Item{[p, value, bytes] { std::memset(p, value, bytes); }});
}
inline cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t stream = nullptr) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  return emu::Runtime::get().enqueue(s, emu::Item{[to, from, bytes] { std::memmove(to, from, bytes); }});
}

inline cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  emu::Stream* s = emu::stream_of(stream);
  return s == nullptr ? cudaErrorInvalidResourceHandle : emu::Runtime::get().begin_capture(s);
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  emu::Graph* g = nullptr;
  const cudaError_t error = emu::Runtime::get().end_capture(s, &g);
  *graph = reinterpret_cast<cudaGraph_t>(g);
  return error;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  *status = emu::Runtime::get().capturing(s) ? cudaStreamCaptureStatusActive
                                             : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
// An instantiated graph is the recorded graph itself here.
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                        unsigned long long = 0) {
  *exec = reinterpret_cast<cudaGraphExec_t>(graph);
  return graph == nullptr ? cudaErrorInvalidValue : cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  emu::Stream* s = emu::stream_of(stream);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  return emu::Runtime::get().launch_graph(*reinterpret_cast<const emu::Graph*>(exec), s);
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return cudaSuccess; }
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<emu::Graph*>(graph);
  return cudaSuccess;
}

inline cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
  emu::MappedHost::get().add(p, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaHostUnregister(void* p) {
  return emu::MappedHost::get().remove(p) ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  emu::MappedHost::get().add(*p, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  emu::MappedHost::get().remove(p);
  std::free(p);
  return cudaSuccess;
}
// Host memory is addressed by the device at its own address (unified addressing), but only
// pinned, mapped memory: other memory is cudaErrorInvalidValue, as the driver says.
inline cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned) {
  if (!emu::MappedHost::get().contains(host)) return cudaErrorInvalidValue;
  *device = host;
  return cudaSuccess;
}

// ----------------------------------------------------------------------------- device intrinsics

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

// The lanes of `mask` whose `value` equals the caller's (sm_70 and newer).
template <typename T>
unsigned __match_any_sync(unsigned mask, T value) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= sizeof(uint64_t));
  return static_cast<unsigned>(emu::warp_collective(
      {emu::WarpOp::kMatchAny, mask, static_cast<uint64_t>(value), 0, 0}));
}

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
// atomicAdd(&u64, 1) converts 1 as CUDA's overloads do. Each tells the spin watch what it saw
// and whether it changed its word (emu_block.h): one that changes nothing and sees what the
// thread saw there last is a poll.
template <typename T>
T atomicAdd(T* address, std::type_identity_t<T> value) {
  const T old = std::atomic_ref<T>(*address).fetch_add(value);
  emu::note_atomic(address, old, value != T{0});
  return old;
}
template <typename T>
T atomicOr(T* address, std::type_identity_t<T> value) {
  const T old = std::atomic_ref<T>(*address).fetch_or(value);
  emu::note_atomic(address, old, (old | value) != old);
  return old;
}
template <typename T>
T atomicMax(T* address, std::type_identity_t<T> value) {
  std::atomic_ref<T> target(*address);
  T old = target.load();
  while (old < value && !target.compare_exchange_weak(old, value)) {
  }
  emu::note_atomic(address, old, old < value);
  return old;
}
template <typename T>
T atomicExch(T* address, std::type_identity_t<T> value) {
  const T old = std::atomic_ref<T>(*address).exchange(value);
  emu::note_atomic(address, old, old != value);
  return old;
}
template <typename T>
T atomicCAS(T* address, std::type_identity_t<T> compare, std::type_identity_t<T> value) {
  const T expected = compare;
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  emu::note_atomic(address, compare, compare == expected && expected != value);
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

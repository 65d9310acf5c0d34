// The emulated devices and kernels (part of csrc/emu/cuda_emu.h): what a driver knows about a
// GPU and about each kernel, and the checks it makes when a kernel's attribute is set or a
// kernel is launched.
//
// Devices. Each emulated device has the limits of one architecture users train on, chosen per
// test (set_devices): the shared memory a block may use without the opt-in (48 KiB, static and
// dynamic together) and with it (cudaFuncAttributeMaxDynamicSharedMemorySize), per SM, the SM
// count, threads and blocks an SM holds. Figures: the CUDA C++ Programming Guide's "Technical
// Specifications per Compute Capability" table (shared memory per block with the opt-in: 163 KB
// on 8.0, 99 KB on 8.6 and 8.9, 227 KB on 9.0) and the cards' data sheets for the SM counts.
//
// Kernels. A kernel's static shared memory and launch bound are declared next to it
// (LZE_KERNEL_RESOURCES in cuda_compat.h; tests/test_cuda_sources.py checks the figure against
// ptxas -v), so the emulator knows them before a launch, as the driver does. The dynamic shared
// memory a launch may ask for is the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize on that
// device: 48 KiB minus its static shared memory unless raised, and raising it past the device's
// opt-in limit minus the static part fails. A launch asking for more fails with
// cudaErrorInvalidValue, as the driver's does ("invalid argument").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace emu {

// A broken rule the driver would not report as an error code (a deadlock, a spin that cannot
// end, a kernel the emulator does not know): the process stops with the message.
[[noreturn]] inline void fail(const std::string& message) {
  std::fprintf(stderr, "cuda_emu: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

constexpr int kMaxDevices = 8;
constexpr int kDefaultSharedPerBlock = 48 * 1024;

struct DeviceLimits {
  const char* name;
  int major, minor;
  int sms;
  int max_threads_per_block;
  int max_threads_per_sm;
  int max_blocks_per_sm;
  int shared_per_block;        // without the opt-in, static + dynamic
  int shared_per_block_optin;  // with it
  int shared_per_sm;
  int reserved_shared_per_block;  // the driver's own, per resident block
};

// The architectures users train on. SM counts: A100 SXM4 108, A40 84, L40S 142, H100 SXM5 132.
inline const std::vector<DeviceLimits>& known_architectures() {
  static const std::vector<DeviceLimits> archs = {
      {"A100-SXM4 (sm_80, emulated)", 8, 0, 108, 1024, 2048, 32, 49152, 166912, 167936, 1024},
      {"A40 (sm_86, emulated)", 8, 6, 84, 1024, 1536, 16, 49152, 101376, 102400, 1024},
      {"L40S (sm_89, emulated)", 8, 9, 142, 1024, 1536, 24, 49152, 101376, 102400, 1024},
      {"H100-SXM5 (sm_90, emulated)", 9, 0, 132, 1024, 2048, 32, 49152, 232448, 233472, 1024},
  };
  return archs;
}

// The limits of sm_<sm> (80, 86, 89 or 90); fails for others.
inline const DeviceLimits& architecture(int sm) {
  for (const DeviceLimits& d : known_architectures()) {
    if (d.major * 10 + d.minor == sm) return d;
  }
  fail("no emulated architecture sm_" + std::to_string(sm) + " (known: 80, 86, 89, 90)");
}

// The process's devices (one sm_90 unless a test sets others) and the current one of each host
// thread (cudaSetDevice is per thread).
class Devices {
 public:
  static Devices& get() {
    static Devices devices;
    return devices;
  }

  void set(std::vector<DeviceLimits> limits) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (limits.empty() || limits.size() > kMaxDevices) fail("set_devices: 1 to 8 devices");
    limits_ = std::move(limits);
  }

  int count() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(limits_.size());
  }

  DeviceLimits limits(int device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return limits_.at(static_cast<size_t>(device));
  }

  static int& current() {
    thread_local int device = 0;
    return device;
  }

 private:
  std::mutex mutex_;
  std::vector<DeviceLimits> limits_{architecture(90)};
};

// A kernel as the driver knows it.
struct KernelInfo {
  std::string name;
  int max_threads;            // __launch_bounds__
  int static_shared_bytes;    // ptxas -v's "bytes smem"
  std::array<int, kMaxDevices> max_dynamic_shared;  // the attribute per device, -1: default
};

class Registry {
 public:
  static Registry& get() {
    static Registry registry;
    return registry;
  }

  bool add(const void* kernel, const char* name, int max_threads, int static_shared_bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    KernelInfo info{name, max_threads, static_shared_bytes, {}};
    info.max_dynamic_shared.fill(-1);
    kernels_.emplace(kernel, info);
    return true;
  }

  // The kernel's entry, or null for a kernel declared without LZE_KERNEL_RESOURCES.
  KernelInfo* find(const void* kernel) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = kernels_.find(kernel);
    return it == kernels_.end() ? nullptr : &it->second;
  }

  // The dynamic shared memory a launch of `k` on `device` may ask for.
  int max_dynamic_shared(const KernelInfo& k, int device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const int set = k.max_dynamic_shared[device];
    return set >= 0 ? set : kDefaultSharedPerBlock - k.static_shared_bytes;
  }

  void set_max_dynamic_shared(KernelInfo& k, int device, int bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    k.max_dynamic_shared[device] = bytes;
  }

  // Every attribute back to the driver's default (a fresh process, for the tests).
  void reset_attributes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [kernel, info] : kernels_) info.max_dynamic_shared.fill(-1);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const void*, KernelInfo> kernels_;
};

}  // namespace emu

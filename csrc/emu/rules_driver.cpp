// Kernels written to break a GPU's rules, one case a command-line argument, each showing that the
// emulator (cuda_emu.h) enforces the rule as a GPU and its driver do: an error code where the
// driver returns one, a stopped process with the emulator's message where a GPU would hang or
// compute garbage. tests/test_emulator_rules.py builds this file with emu_kernels.cpp and runs
// every case in a process of its own; each prints "<case>: <what it saw>" (or the emulator
// stops the process with its message). Built alone: it defines the fibers' context switch.
//   usage: rules_driver CASE
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#define LZE_EMU_DEFINE_FIBER_SWITCH
#include "../cuda/cuda_compat.h"
#include "../lze_math.h"

namespace {

int report(const char* name, bool ok, const std::string& saw) {
  std::printf("%s: %s%s\n", name, ok ? "" : "WRONG: ", saw.c_str());
  return ok ? 0 : 1;
}

std::string code(cudaError_t e) { return "error code " + std::to_string(static_cast<int>(e)); }

void use_architecture(int sm) {
  emu::Devices::get().set({emu::architecture(sm)});
  emu::Registry::get().reset_attributes();
}

// 8 KiB of static shared memory plus the dynamic a launch asks for, one word written.
__global__ void shared_kernel(uint32_t* out) {
  LZE_DYNAMIC_SHARED(uint32_t, dynamic);
  LZE_SHARED(uint32_t[2048], fixed);
  fixed[threadIdx.x] = threadIdx.x;
  dynamic[threadIdx.x] = 1;
  __syncthreads();
  if (threadIdx.x == 0) *out = fixed[1] + dynamic[0];
}
LZE_KERNEL_RESOURCES(shared_kernel, 256, 8192);

// Declares 4 bytes of static shared memory but uses 8.
__global__ void undeclared_shared_kernel(uint32_t* out) {
  LZE_SHARED(uint64_t, wide);
  if (threadIdx.x == 0) wide = 1;
  __syncthreads();
  *out = static_cast<uint32_t>(wide);
}
LZE_KERNEL_RESOURCES(undeclared_shared_kernel, 32, 4);

// Reads a shared counter it never zeroed.
__global__ void uninitialised_kernel(uint32_t* out) {
  LZE_SHARED(uint32_t, count);
  __syncthreads();
  atomicAdd(&count, 1u);
  __syncthreads();
  if (threadIdx.x == 0) *out = count;
}
LZE_KERNEL_RESOURCES(uninitialised_kernel, 64, 4);

// Block 0 publishes a value every block reads, with no wait: right only if block 0 runs first.
__global__ void block_order_kernel(uint32_t* value, uint32_t* out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicExch(value, 7u);
  if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(value, 0u);
}
LZE_KERNEL_RESOURCES(block_order_kernel, 32, 0);

// Block b waits for block b + 1's flag (by blockIdx, not by ticket): with fewer resident blocks
// than the grid, the first blocks wait on blocks that never start.
__global__ void waits_on_later_block_kernel(uint32_t* flags, int blocks) {
  if (threadIdx.x != 0) return;
  if (static_cast<int>(blockIdx.x) + 1 < blocks) {
    while (atomicAdd(&flags[blockIdx.x + 1], 0u) == 0) {
    }
  }
  atomicExch(&flags[blockIdx.x], 1u);
}
LZE_KERNEL_RESOURCES(waits_on_later_block_kernel, 32, 0);

// A correct look-back whose blocks are slow, as a descheduled worker is: by ticket, block 0
// computes long before it publishes; block 1 waits on it long (a long spin), then computes long
// before it publishes, while block 2, on the worker block 0 left, waits on block 1 long. No
// block ever waits on one that has not started; the process must run to its end.
__device__ void compute_long() {
  volatile uint64_t sink = 0;
  for (uint64_t i = 0; i < (uint64_t{1} << 26); ++i) sink = sink + i;
}

__global__ void slow_look_back_kernel(uint32_t* ticket, uint32_t* flags) {
  if (threadIdx.x != 0) return;
  const uint32_t mine = atomicAdd(ticket, 1u);
  if (mine > 0) {
    while (atomicAdd(&flags[mine - 1], 0u) == 0) {
    }
  }
  if (mine < 2) compute_long();
  atomicExch(&flags[mine], 1u);
}
LZE_KERNEL_RESOURCES(slow_look_back_kernel, 32, 0);

// Thread 0 spins on a shared flag thread 1 sets: a spin-wait inside a block.
__global__ void spins_in_block_kernel(uint32_t* out) {
  constexpr uint32_t kSet = 12345;  // no poison pattern (a repeated byte) equals it
  LZE_SHARED(uint32_t, flag);
  if (threadIdx.x == 1) atomicExch(&flag, kSet);
  if (threadIdx.x == 0) {
    while (atomicAdd(&flag, 0u) != kSet) {
    }
    *out = 1;
  }
}
LZE_KERNEL_RESOURCES(spins_in_block_kernel, 32, 4);

// A 16-byte load from an address 4 bytes past a 16-byte boundary.
__global__ void misaligned_kernel(const int32_t* words, int32_t* out) {
  const int4 v = LZE_LOAD_VECTOR(reinterpret_cast<const int4*>(words + 1));
  if (threadIdx.x == 0) *out = v.x;
}
LZE_KERNEL_RESOURCES(misaligned_kernel, 32, 0);

// Writes host-mapped memory (the fault mirror's way).
__global__ void write_host_kernel(int32_t* mapped, int32_t value) {
  if (threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(mapped) = value;
}
LZE_KERNEL_RESOURCES(write_host_kernel, 32, 0);

// A NaN score formed as the kernels form it: +inf energy, +inf Gumbel scale, a negative draw.
__global__ void nan_score_kernel(float* out) {
  if (threadIdx.x == 0) *out = lze::score_with_draw(INFINITY, INFINITY, -1.0f);
}
LZE_KERNEL_RESOURCES(nan_score_kernel, 32, 0);

// --- cases ------------------------------------------------------------------------------------

// Without the opt-in a block may use 48 KiB, static included: 8 KiB static leaves 40 KiB.
int dynamic_past_default() {
  uint32_t out = 0;
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(256), 40 * 1024 + 4, nullptr)(&out);
  const cudaError_t e = cudaGetLastError();
  return report("dynamic_past_default", e == cudaErrorInvalidValue, code(e));
}

// With the opt-in: up to the architecture's limit less the static part, and no further.
int opt_in_limits(int sm) {
  use_architecture(sm);
  const int optin = emu::architecture(sm).shared_per_block_optin;
  const cudaError_t past = cudaFuncSetAttribute(shared_kernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                optin - 8192 + 4);
  const cudaError_t at = cudaFuncSetAttribute(shared_kernel,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              optin - 8192);
  uint32_t out = 0;
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(256), optin - 8192, nullptr)(&out);
  const cudaError_t launch = cudaGetLastError();
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(256), optin - 8192 + 4, nullptr)(&out);
  const cudaError_t beyond = cudaGetLastError();
  const bool ok = past == cudaErrorInvalidValue && at == cudaSuccess && launch == cudaSuccess &&
                  out == 2 && beyond == cudaErrorInvalidValue;
  return report("opt_in_limits", ok, "sm_" + std::to_string(sm) + ": " + code(past) + ", " +
                                         code(at) + ", " + code(launch) + ", " + code(beyond));
}

// The opt-in is per device: raised on device 1, device 0 keeps the default.
int opt_in_per_device() {
  emu::Devices::get().set({emu::architecture(90), emu::architecture(90)});
  emu::Registry::get().reset_attributes();
  cudaSetDevice(1);
  cudaFuncSetAttribute(shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
  cudaSetDevice(0);
  uint32_t out = 0;
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(256), 64 * 1024, nullptr)(&out);
  const cudaError_t e = cudaGetLastError();
  return report("opt_in_per_device", e == cudaErrorInvalidValue, code(e));
}

int launch_bounds() {
  uint32_t out = 0;
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(512), 0, nullptr)(&out);
  const cudaError_t bound = cudaGetLastError();
  LZE_LAUNCH(shared_kernel, dim3(1), dim3(2048), 0, nullptr)(&out);
  const cudaError_t block = cudaGetLastError();
  return report("launch_bounds",
                bound == cudaErrorLaunchOutOfResources && block == cudaErrorInvalidConfiguration,
                code(bound) + ", " + code(block));
}

int undeclared_static_shared() {
  uint32_t out = 0;
  LZE_LAUNCH(undeclared_shared_kernel, dim3(1), dim3(32), 0, nullptr)(&out);
  return report("undeclared_static_shared", false, "ran to its end");
}

int uninitialised_shared() {
  uint32_t out = 0;
  LZE_LAUNCH(uninitialised_kernel, dim3(1), dim3(64), 0, nullptr)(&out);
  return report("uninitialised_shared", out != 64, "count " + std::to_string(out));
}

int block_order() {
  std::vector<uint32_t> out(64);
  uint32_t value = 0;
  {
    const std::lock_guard<std::mutex> lock(emu::policy_mutex());
    emu::grid_policy() = emu::GridPolicy{emu::BlockOrder::kReverse, 0, 1};
  }
  LZE_LAUNCH(block_order_kernel, dim3(64), dim3(32), 0, nullptr)(&value, out.data());
  int zeros = 0;
  for (uint32_t v : out) zeros += v == 0;
  return report("block_order", zeros > 0, std::to_string(zeros) + " blocks read 0");
}

int forward_progress() {
  constexpr int kBlocks = 8;
  std::vector<uint32_t> flags(kBlocks, 0);
  {
    const std::lock_guard<std::mutex> lock(emu::policy_mutex());
    emu::grid_policy() = emu::GridPolicy{emu::BlockOrder::kForward, 0, 2};
  }
  LZE_LAUNCH(waits_on_later_block_kernel, dim3(kBlocks), dim3(32), 0, nullptr)(flags.data(),
                                                                                kBlocks);
  return report("forward_progress", false, "ran to its end");
}

int slow_look_back() {
  uint32_t ticket = 0;
  std::vector<uint32_t> flags(3, 0);
  {
    const std::lock_guard<std::mutex> lock(emu::policy_mutex());
    emu::grid_policy() = emu::GridPolicy{emu::BlockOrder::kForward, 0, 2};
  }
  LZE_LAUNCH(slow_look_back_kernel, dim3(3), dim3(32), 0, nullptr)(&ticket, flags.data());
  const cudaError_t e = cudaDeviceSynchronize();
  const int published = static_cast<int>(flags[0] + flags[1] + flags[2]);
  return report("slow_look_back", e == cudaSuccess && published == 3,
                std::to_string(published) + " of 3 blocks published, " + code(e));
}

int spin_in_block() {
  uint32_t out = 0;
  LZE_LAUNCH(spins_in_block_kernel, dim3(1), dim3(32), 0, nullptr)(&out);
  return report("spin_in_block", false, "ran to its end");
}

int misaligned_vector() {
  alignas(16) int32_t words[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int32_t out = 0;
  LZE_LAUNCH(misaligned_kernel, dim3(1), dim3(32), 0, nullptr)(words, &out);
  const cudaError_t first = cudaGetLastError(), again = cudaGetLastError();
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, nullptr)(&out, 9);
  const bool ok = first == cudaErrorMisalignedAddress && again == cudaErrorMisalignedAddress &&
                  out == 2;  // sticky; later launches do not run
  return report("misaligned_vector", ok, code(first) + ", " + code(again) + ", then " +
                                             std::to_string(out));
}

// Held mode: the kernel's store to host-mapped memory happens at the sync, not at the launch.
int asynchronous_host_write() {
  emu::Runtime::get().set_mode(emu::Mode::kHeld);
  int32_t* mapped = nullptr;
  cudaHostAlloc(reinterpret_cast<void**>(&mapped), 4, cudaHostAllocMapped);
  *mapped = 0;
  int32_t* device = nullptr;
  const cudaError_t pointer = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), mapped, 0);
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, nullptr)(device, 5);
  const int32_t before = *mapped;
  cudaDeviceSynchronize();
  const int32_t after = *mapped;
  int32_t pageable = 0;
  void* refused = nullptr;
  const cudaError_t unmapped = cudaHostGetDevicePointer(&refused, &pageable, 0);
  emu::Runtime::get().set_mode(emu::Mode::kImmediate);
  const bool ok = pointer == cudaSuccess && before == 0 && after == 5 &&
                  unmapped == cudaErrorInvalidValue;
  return report("asynchronous_host_write", ok, std::to_string(before) + " at launch, " +
                                                   std::to_string(after) + " after the sync, " +
                                                   code(unmapped) + " for pageable memory");
}

// Worker mode: stream B's kernel waits on an event recorded after stream A's.
int event_order() {
  emu::Runtime::get().set_mode(emu::Mode::kHeld);
  cudaStream_t a = nullptr, b = nullptr;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  cudaEvent_t done = nullptr;
  cudaEventCreate(&done);
  int32_t word = 0;
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, a)(&word, 1);
  cudaEventRecord(done, a);
  cudaStreamWaitEvent(b, done);
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, b)(&word, 2);
  const int32_t queued = word;
  cudaStreamSynchronize(b);
  const int32_t after = word;
  emu::Runtime::get().set_mode(emu::Mode::kImmediate);
  return report("event_order", queued == 0 && after == 2,
                std::to_string(queued) + " queued, " + std::to_string(after) + " after B");
}

// A synchronisation inside a capture fails and invalidates it; the capture records, not runs.
int capture_rules() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int32_t word = 0;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, s)(&word, 3);
  const int32_t during = word;
  const cudaError_t sync = cudaStreamSynchronize(s);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, s)(&word, 4);
  cudaStreamEndCapture(s, &graph);
  cudaGraphExec_t exec = nullptr;
  cudaGraphInstantiate(&exec, graph);
  cudaGraphLaunch(exec, s);
  cudaGraphLaunch(exec, s);
  const bool ok = during == 0 && sync == cudaErrorStreamCaptureUnsupported &&
                  end == cudaErrorStreamCaptureInvalidated && word == 4;
  return report("capture_rules", ok, code(sync) + ", " + code(end) + ", replayed " +
                                         std::to_string(word));
}

// A launch on a stream of another device than the current one fails.
int stream_of_another_device() {
  emu::Devices::get().set({emu::architecture(90), emu::architecture(90)});
  cudaSetDevice(1);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaSetDevice(0);
  int32_t word = 0;
  LZE_LAUNCH(write_host_kernel, dim3(1), dim3(32), 0, s)(&word, 1);
  const cudaError_t e = cudaGetLastError();
  return report("stream_of_another_device", e == cudaErrorInvalidResourceHandle && word == 0,
                code(e));
}

int nan_bits() {
  float score = 0.0f;
  LZE_LAUNCH(nan_score_kernel, dim3(1), dim3(32), 0, nullptr)(&score);
  uint32_t bits = 0;
  std::memcpy(&bits, &score, 4);
  char hex[16];
  std::snprintf(hex, sizeof hex, "%#010x", bits);
  return report("nan_bits", bits == 0x7fffffffu, hex);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string c = argc > 1 ? argv[1] : "";
  if (c == "dynamic_past_default") return dynamic_past_default();
  if (c.rfind("opt_in_limits_", 0) == 0) return opt_in_limits(std::stoi(c.substr(14)));
  if (c == "opt_in_per_device") return opt_in_per_device();
  if (c == "launch_bounds") return launch_bounds();
  if (c == "undeclared_static_shared") return undeclared_static_shared();
  if (c == "uninitialised_shared") return uninitialised_shared();
  if (c == "block_order") return block_order();
  if (c == "forward_progress") return forward_progress();
  if (c == "spin_in_block") return spin_in_block();
  if (c == "slow_look_back") return slow_look_back();
  if (c == "misaligned_vector") return misaligned_vector();
  if (c == "asynchronous_host_write") return asynchronous_host_write();
  if (c == "event_order") return event_order();
  if (c == "capture_rules") return capture_rules();
  if (c == "stream_of_another_device") return stream_of_another_device();
  if (c == "nan_bits") return nan_bits();
  std::fprintf(stderr, "unknown case '%s'\n", c.c_str());
  return 2;
}

// The emulated CUDA runtime's host side (part of csrc/emu/cuda_emu.h): streams, events, graph
// capture, host-mapped memory, the launch checks a driver makes and the errors it keeps.
//
// Asynchrony. Work (kernel launches, memsets, copies, event records and waits) goes to its
// stream in order. What happens to it depends on the mode (set_mode), process-wide:
//  * immediate (default): each item runs inside the call that queues it, as the emulator always
//    did: the tests that compare results need no synchronisation;
//  * worker: a stream's items run on a thread of the stream's own, after the call returns, in
//    stream order; items of different streams run concurrently unless an event orders them;
//  * held: as worker, but nothing runs until the host synchronises (a stream, an event, the
//    device), and then only what that synchronisation waits for (the stream's items and the
//    items of other streams they wait on through events): the widest window a GPU's
//    asynchrony can open, for tests of host-side and cross-stream ordering.
// Host-mapped memory a kernel writes is written when the kernel runs, not when it is queued.
// A stream being captured (cudaStreamBeginCapture) records its items into a graph instead; a
// synchronisation while capturing fails and invalidates the capture, as on a GPU.
//
// Errors. Launch errors (bad configuration, too much shared memory, a stream of another device)
// are returned at the launch by cudaGetLastError, per host thread. A fault inside a kernel (a
// misaligned vector access) is sticky: every later call on that device returns it, as a GPU's
// context is lost.
//
// The default stream (0) of a device does not synchronise with other streams here (as torch's
// side streams, created non-blocking, do not).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "emu_grid.h"

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorMisalignedAddress = 716,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureIsolation = 905,
};

namespace emu {

enum class Mode { kImmediate, kWorker, kHeld };

struct Stream;

// An event: the work queued on `stream` up to `target` items, once recorded.
struct Event {
  Stream* stream = nullptr;
  uint64_t target = 0;
};

// An item of a stream's queue: work to run, or a wait on an event.
struct Item {
  std::function<void()> run;
  Stream* wait_stream = nullptr;
  uint64_t wait_target = 0;
};

struct Graph {
  int device;
  std::vector<Item> items;
};

struct Stream {
  int device;
  std::deque<std::pair<uint64_t, Item>> queue;  // (the item's number on this stream, the item)
  uint64_t queued = 0, completed = 0;           // items of this stream
  uint64_t released = 0;                        // held mode: items that may run
  Graph* capture = nullptr;                     // while capturing
  bool capture_invalidated = false;
  std::thread worker;
};

class Runtime {
 public:
  static Runtime& get() {
    static Runtime runtime;
    return runtime;
  }

  ~Runtime() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    for (auto& s : streams_) {
      if (s->worker.joinable()) s->worker.join();
    }
  }

  // --- streams ------------------------------------------------------------------------------

  // The stream a handle names (0, cudaStreamLegacy, cudaStreamPerThread: the current device's
  // default stream), or null for a handle that is not a live stream.
  Stream* stream(const void* handle) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return find_stream(handle);
  }

  Stream* create_stream(int device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    streams_.push_back(std::make_unique<Stream>());
    streams_.back()->device = device;
    return streams_.back().get();
  }

  // Queues `item` on `s` (or records it into the capture); in immediate mode runs it now.
  cudaError_t enqueue(Stream* s, Item item) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (s->capture != nullptr) {
      if (item.wait_stream != nullptr && item.wait_stream != s) {
        s->capture_invalidated = true;
        return cudaErrorStreamCaptureIsolation;  // an event recorded outside the capture
      }
      s->capture->items.push_back(std::move(item));
      return cudaSuccess;
    }
    if (mode_ == Mode::kImmediate) {
      lock.unlock();
      if (item.run) item.run();
      lock.lock();
      ++s->queued;
      ++s->completed;
      changed_.notify_all();
      return cudaSuccess;
    }
    s->queue.emplace_back(++s->queued, std::move(item));
    if (!s->worker.joinable()) s->worker = std::thread([this, s] { serve(s); });
    changed_.notify_all();
    return cudaSuccess;
  }

  // Waits until every item queued on `s` has run (releasing held work first).
  cudaError_t synchronize(Stream* s) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (s->capture != nullptr) {
      s->capture_invalidated = true;
      return cudaErrorStreamCaptureUnsupported;
    }
    if (any_capturing()) return cudaErrorStreamCaptureUnsupported;
    release(s, s->queued);
    changed_.notify_all();
    changed_.wait(lock, [s] { return s->completed == s->queued; });
    return sticky_[s->device];
  }

  cudaError_t synchronize_device(int device) {
    std::vector<Stream*> of_device;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      for (auto& s : streams_) {
        if (s->device == device) of_device.push_back(s.get());
      }
    }
    for (Stream* s : of_device) {
      if (const cudaError_t error = synchronize(s); error != cudaSuccess) return error;
    }
    return sticky(device);
  }

  // --- events -------------------------------------------------------------------------------

  void record(Event& e, Stream* s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    e.stream = s;
    e.target = s->capture != nullptr ? 0 : s->queued;  // in a capture: ordered by the graph
  }

  cudaError_t wait(Stream* s, const Event& e) {
    if (e.stream == nullptr || e.stream == s) return cudaSuccess;
    return enqueue(s, Item{{}, e.stream, e.target});
  }

  bool event_done(const Event& e) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return e.stream == nullptr || e.stream->completed >= e.target;
  }

  cudaError_t synchronize(const Event& e) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (any_capturing()) return cudaErrorStreamCaptureUnsupported;
    if (e.stream == nullptr) return cudaSuccess;
    release(e.stream, e.target);
    changed_.notify_all();
    changed_.wait(lock, [&e] { return e.stream->completed >= e.target; });
    return sticky_[e.stream->device];
  }

  // --- capture ------------------------------------------------------------------------------

  cudaError_t begin_capture(Stream* s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (s->capture != nullptr) return cudaErrorIllegalState;
    s->capture = new Graph{s->device, {}};
    s->capture_invalidated = false;
    return cudaSuccess;
  }

  cudaError_t end_capture(Stream* s, Graph** graph) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (s->capture == nullptr) return cudaErrorIllegalState;
    Graph* g = std::exchange(s->capture, nullptr);
    if (s->capture_invalidated) {
      delete g;
      *graph = nullptr;
      return cudaErrorStreamCaptureInvalidated;
    }
    *graph = g;
    return cudaSuccess;
  }

  bool capturing(Stream* s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return s->capture != nullptr;
  }

  cudaError_t launch_graph(const Graph& g, Stream* s) {
    for (const Item& item : g.items) {
      if (const cudaError_t error = enqueue(s, item); error != cudaSuccess) return error;
    }
    return cudaSuccess;
  }

  // --- modes, errors ------------------------------------------------------------------------

  void set_mode(Mode mode) {
    for (int d = 0; d < kMaxDevices; ++d) synchronize_device(d);
    const std::lock_guard<std::mutex> lock(mutex_);
    mode_ = mode;
  }

  Mode mode() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return mode_;
  }

  // Items queued and not yet run, over every stream.
  uint64_t pending() {
    const std::lock_guard<std::mutex> lock(mutex_);
    uint64_t n = 0;
    for (auto& s : streams_) n += s->queued - s->completed;
    return n;
  }

  cudaError_t sticky(int device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return sticky_[device];
  }

  // A fault inside a kernel on `device`: kept until reset (the context is lost).
  void fault(int device, cudaError_t error, const std::string& message) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (sticky_[device] == cudaSuccess) {
      sticky_[device] = error;
      fault_message_ = message;
    }
  }

  std::string fault_message() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return fault_message_;
  }

  // A new context on every device (the tests' fresh process): no sticky error.
  void reset_faults() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (cudaError_t& e : sticky_) e = cudaSuccess;
    fault_message_.clear();
  }

 private:
  Stream* find_stream(const void* handle) {
    const auto value = reinterpret_cast<uintptr_t>(handle);
    if (value <= 2) return default_stream(Devices::current());
    for (auto& s : streams_) {
      if (s.get() == handle) return s.get();
    }
    return nullptr;
  }

  Stream* default_stream(int device) {
    if (defaults_[device] == nullptr) {
      streams_.push_back(std::make_unique<Stream>());
      streams_.back()->device = device;
      defaults_[device] = streams_.back().get();
    }
    return defaults_[device];
  }

  // Held mode: the items of `s` up to number `upto` may run, and what they wait on.
  void release(Stream* s, uint64_t upto) {
    if (upto <= s->released) return;
    s->released = upto;
    for (const auto& [number, item] : s->queue) {
      if (number <= upto && item.wait_stream != nullptr) release(item.wait_stream, item.wait_target);
    }
  }

  bool any_capturing() const {
    for (const auto& s : streams_) {
      if (s->capture != nullptr) return true;
    }
    return false;
  }

  // A stream's worker: runs its items in order, each once released (held mode) and once the
  // event it waits on has completed.
  void serve(Stream* s) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [this, s] { return stopping_ || ready(s); });
      if (stopping_) return;
      Item item = std::move(s->queue.front().second);
      s->queue.pop_front();
      lock.unlock();
      if (item.run) item.run();
      lock.lock();
      ++s->completed;
      changed_.notify_all();
    }
  }

  bool ready(Stream* s) const {
    if (s->queue.empty()) return false;
    const auto& [number, item] = s->queue.front();
    if (mode_ == Mode::kHeld && number > s->released) return false;
    return item.wait_stream == nullptr || item.wait_stream->completed >= item.wait_target;
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::array<Stream*, kMaxDevices> defaults_{};
  std::array<cudaError_t, kMaxDevices> sticky_{};
  std::string fault_message_;
  Mode mode_ = Mode::kImmediate;
  bool stopping_ = false;
};

// --- host memory the device may address ------------------------------------------------------

// Pinned, mapped host ranges (cudaHostAlloc with cudaHostAllocMapped, cudaHostRegister): the
// only host memory a kernel may be handed (cudaHostGetDevicePointer fails for other memory).
class MappedHost {
 public:
  static MappedHost& get() {
    static MappedHost mapped;
    return mapped;
  }
  void add(const void* p, size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ranges_[reinterpret_cast<uintptr_t>(p)] = bytes;
  }
  bool remove(const void* p) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return ranges_.erase(reinterpret_cast<uintptr_t>(p)) == 1;
  }
  bool contains(const void* p) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto address = reinterpret_cast<uintptr_t>(p);
    auto it = ranges_.upper_bound(address);
    if (it == ranges_.begin()) return false;
    --it;
    return address < it->first + it->second;
  }

 private:
  std::mutex mutex_;
  std::map<uintptr_t, size_t> ranges_;
};

// --- launches -------------------------------------------------------------------------------

// The launch gate, for tests of host threads racing: while closed, a host thread that launches
// waits inside the launch call (a native call that released the GIL stays in it).
class LaunchGate {
 public:
  static LaunchGate& get() {
    static LaunchGate gate;
    return gate;
  }
  void close() {
    const std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  void open() {
    const std::lock_guard<std::mutex> lock(mutex_);
    closed_ = false;
    opened_.notify_all();
  }
  int waiters() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return waiting_;
  }
  void pass() {
    std::unique_lock<std::mutex> lock(mutex_);
    ++waiting_;
    opened_.wait(lock, [this] { return !closed_; });
    --waiting_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool closed_ = false;
  int waiting_ = 0;
};

inline cudaError_t& last_error() {
  thread_local cudaError_t error = cudaSuccess;
  return error;
}

// Kernel launches since the last take_launches() (the launch-count tests), and the blocks they
// asked for.
struct LaunchCounts {
  std::atomic<uint64_t> launches{0}, blocks{0};
};
inline LaunchCounts& launch_counts() {
  static LaunchCounts counts;
  return counts;
}

inline cudaError_t check_config(const dim3& grid, const dim3& block, const DeviceLimits& d) {
  const uint64_t threads = threads_of(block);
  if (threads == 0 || threads > static_cast<uint64_t>(d.max_threads_per_block) || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  return cudaSuccess;
}

// What the driver checks of a kernel's resources at a launch on `device`.
inline cudaError_t check_resources(const KernelInfo& k, int device, const dim3& block,
                                   size_t dynamic_bytes) {
  if (threads_of(block) > static_cast<uint64_t>(k.max_threads)) {
    return cudaErrorLaunchOutOfResources;  // past __launch_bounds__
  }
  const int allowed = Registry::get().max_dynamic_shared(k, device);
  if (dynamic_bytes > static_cast<size_t>(allowed < 0 ? 0 : allowed)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

inline uint8_t poison_byte(uint64_t launch) {
  const auto byte = static_cast<uint8_t>(0xA5u ^ (launch * 0x3Bu));
  return byte == 0 ? 0xA5u : byte;
}

// The emulated `kernel<<<grid, block, dynamic_bytes, stream>>>`: checks, then queues the grid.
inline void launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_bytes,
                   const void* stream_handle, std::function<void()> body) {
  LaunchGate::get().pass();
  const uint64_t launch_number = launch_counts().launches.fetch_add(1) + 1;
  const KernelInfo* k = Registry::get().find(kernel);
  if (k == nullptr) fail("a kernel launched without LZE_KERNEL_RESOURCES (cuda_compat.h)");
  Runtime& rt = Runtime::get();
  Stream* s = rt.stream(stream_handle);
  const int device = Devices::current();
  cudaError_t error = s == nullptr || s->device != device ? cudaErrorInvalidResourceHandle
                                                          : rt.sticky(device);
  if (error == cudaSuccess) error = check_config(grid, block, Devices::get().limits(device));
  if (error == cudaSuccess) error = check_resources(*k, device, block, dynamic_bytes);
  if (error != cudaSuccess) {
    last_error() = error;
    return;
  }
  launch_counts().blocks.fetch_add(threads_of(grid));
  auto spec = std::make_shared<GridSpec>();
  spec->kernel = k->name;
  spec->grid = grid;
  spec->block = block;
  spec->dynamic_bytes = dynamic_bytes;
  spec->static_bytes = static_cast<size_t>(k->static_shared_bytes);
  spec->body = std::move(body);
  spec->poison = poison_byte(launch_number);
  spec->num_blocks = threads_of(grid);
  spec->device = device;
  plan_order(*spec, current_policy());
  last_error() = rt.enqueue(s, Item{[spec, device] {
    Devices::current() = device;  // a stream's worker runs for the stream's device
    Grid g(*spec);
    run_grid(g);
  }});
}

// A kernel's fault on the device it runs on (the sticky error), with a message for the tests.
inline void trap(cudaError_t error, const std::string& message) {
  const int device = tls_thread != nullptr ? tls_thread->block->grid->device : Devices::current();
  Runtime::get().fault(device, error, message);
}

}  // namespace emu

// The emulator's controls as functions of the emulated module (_lze_cuda_emu), for the tests and
// lze_kernels/emulated.py: which architectures the devices have, how launches run (immediate,
// worker, held), block order and residency, streams, events, graph capture, host-mapped memory,
// sticky faults, and the counts the work tests read. Included by csrc/bindings.cpp in the
// emulated build only; handles cross as ints.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../cuda/cuda_compat.h"
#include "../cuda/lze_cuda.h"

namespace lze_emu_bindings {

namespace py = pybind11;

template <typename Handle>
Handle handle(std::uintptr_t value) {
  return reinterpret_cast<Handle>(value);
}
template <typename Handle>
std::uintptr_t value(Handle h) {
  return reinterpret_cast<std::uintptr_t>(h);
}

emu::Mode mode_named(const std::string& name) {
  if (name == "immediate") return emu::Mode::kImmediate;
  if (name == "worker") return emu::Mode::kWorker;
  if (name == "held") return emu::Mode::kHeld;
  throw py::value_error("mode: expected 'immediate', 'worker' or 'held', got '" + name + "'");
}

const char* mode_name(emu::Mode mode) {
  switch (mode) {
    case emu::Mode::kWorker: return "worker";
    case emu::Mode::kHeld: return "held";
    default: return "immediate";
  }
}

void set_devices(const std::vector<int>& archs) {
  std::vector<emu::DeviceLimits> limits;
  for (int sm : archs) limits.push_back(emu::architecture(sm));
  emu::Devices::get().set(limits);
  emu::Registry::get().reset_attributes();
  lze_cuda_forget_device_shapes();
}

// One device with sm_90's limits but `optin` bytes of shared memory a block with the opt-in
// (a device smaller than any users run, to test the refusal of a plan that cannot run).
void set_device_optin(int optin) {
  emu::DeviceLimits d = emu::architecture(90);
  d.name = "small-shared-memory device (emulated)";
  d.shared_per_block_optin = optin;
  d.shared_per_block = optin < d.shared_per_block ? optin : d.shared_per_block;
  emu::Devices::get().set({d});
  emu::Registry::get().reset_attributes();
  lze_cuda_forget_device_shapes();
}

void set_block_order(const std::string& order, uint64_t seed) {
  const std::lock_guard<std::mutex> lock(emu::policy_mutex());
  emu::GridPolicy& p = emu::grid_policy();
  if (order == "forward") {
    p.order = emu::BlockOrder::kForward;
  } else if (order == "reverse") {
    p.order = emu::BlockOrder::kReverse;
  } else if (order == "random") {
    p.order = emu::BlockOrder::kRandom;
  } else {
    throw py::value_error("order: expected 'forward', 'reverse' or 'random', got '" + order + "'");
  }
  p.seed = seed;
}

void set_workers(unsigned workers) {
  const std::lock_guard<std::mutex> lock(emu::policy_mutex());
  emu::grid_policy().workers = workers;
}

int check(cudaError_t error) { return static_cast<int>(error); }

void bind_emulator(py::module_& m) {
  m.def("set_devices", &set_devices, py::arg("archs"),
        "Emulated devices with the limits of these architectures (80, 86, 89, 90): one per "
        "entry; every kernel attribute back to its default.");
  m.def("set_device_optin", &set_device_optin,
        "One device like sm_90 but allowing this many bytes of shared memory a block.");
  m.def("device_names", [] {
    std::vector<std::string> names;
    for (int d = 0; d < emu::Devices::get().count(); ++d) names.push_back(emu::Devices::get().limits(d).name);
    return names;
  });
  m.def("set_device", [](int d) { return check(cudaSetDevice(d)); });
  m.def("current_device", [] { return emu::Devices::current(); });
  m.def("set_mode", [](const std::string& name) {
    py::gil_scoped_release release;
    emu::Runtime::get().set_mode(mode_named(name));
  }, "How launches run: 'immediate' (in the call), 'worker' (after it, on the stream's "
     "thread) or 'held' (only at a synchronisation).");
  m.def("mode", [] { return mode_name(emu::Runtime::get().mode()); });
  m.def("pending", [] { return emu::Runtime::get().pending(); }, "Queued items not yet run.");
  m.def("synchronize", [] {
    py::gil_scoped_release release;
    return check(cudaDeviceSynchronize());
  }, "cudaDeviceSynchronize on the current device.");
  m.def("set_block_order", &set_block_order, py::arg("order"), py::arg("seed") = 0);
  m.def("set_workers", &set_workers, "Blocks resident at once (0: the default).");
  m.def("stream_create", [] {
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return value(s);
  });
  m.def("stream_synchronize", [](std::uintptr_t s) {
    py::gil_scoped_release release;
    return check(cudaStreamSynchronize(handle<cudaStream_t>(s)));
  });
  m.def("event_create", [] {
    cudaEvent_t e = nullptr;
    cudaEventCreate(&e);
    return value(e);
  });
  m.def("event_record", [](std::uintptr_t e, std::uintptr_t s) {
    return check(cudaEventRecord(handle<cudaEvent_t>(e), handle<cudaStream_t>(s)));
  });
  m.def("stream_wait_event", [](std::uintptr_t s, std::uintptr_t e) {
    return check(cudaStreamWaitEvent(handle<cudaStream_t>(s), handle<cudaEvent_t>(e)));
  });
  m.def("event_synchronize", [](std::uintptr_t e) {
    py::gil_scoped_release release;
    return check(cudaEventSynchronize(handle<cudaEvent_t>(e)));
  });
  m.def("memset_async", [](std::uintptr_t p, int v, size_t bytes, std::uintptr_t s) {
    return check(cudaMemsetAsync(handle<void*>(p), v, bytes, handle<cudaStream_t>(s)));
  });
  m.def("memcpy_async", [](std::uintptr_t to, std::uintptr_t from, size_t bytes, std::uintptr_t s) {
    return check(cudaMemcpyAsync(handle<void*>(to), handle<const void*>(from), bytes,
                                 cudaMemcpyDefault, handle<cudaStream_t>(s)));
  });
  m.def("begin_capture", [](std::uintptr_t s) {
    return check(cudaStreamBeginCapture(handle<cudaStream_t>(s), cudaStreamCaptureModeGlobal));
  });
  m.def("end_capture", [](std::uintptr_t s) {
    cudaGraph_t g = nullptr;
    const int status = check(cudaStreamEndCapture(handle<cudaStream_t>(s), &g));
    return std::make_pair(status, value(g));
  }, "(status, graph) of the capture on the stream.");
  m.def("is_capturing", [](std::uintptr_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(handle<cudaStream_t>(s), &status);
    return status == cudaStreamCaptureStatusActive;
  });
  m.def("graph_launch", [](std::uintptr_t g, std::uintptr_t s) {
    return check(cudaGraphLaunch(handle<cudaGraphExec_t>(g), handle<cudaStream_t>(s)));
  });
  m.def("graph_destroy", [](std::uintptr_t g) { return check(cudaGraphDestroy(handle<cudaGraph_t>(g))); });
  m.def("host_register", [](std::uintptr_t p, size_t bytes) {
    return check(cudaHostRegister(handle<void*>(p), bytes, cudaHostRegisterMapped));
  }, "Pins and maps host memory (as torch's pinned memory is).");
  m.def("host_unregister", [](std::uintptr_t p) { return check(cudaHostUnregister(handle<void*>(p))); });
  m.def("fault", [] {
    return std::make_pair(static_cast<int>(emu::Runtime::get().sticky(emu::Devices::current())),
                          emu::Runtime::get().fault_message());
  }, "(sticky error code of the current device, its message).");
  m.def("reset", [] {
    py::gil_scoped_release release;
    emu::Runtime::get().set_mode(emu::Mode::kImmediate);
    emu::Runtime::get().reset_faults();
    set_devices({90});
    set_block_order("forward", 0);
    set_workers(0);
  }, "A fresh process's emulator: one sm_90 device, immediate launches, forward order.");
  m.def("launches", [] { return emu::launch_counts().launches.exchange(0); },
        "Kernel launches since the last call.");
  m.def("blocks", [] { return emu::launch_counts().blocks.exchange(0); },
        "Blocks of the kernel launches since the last call.");
  m.def("row_reads", [] { return emu::take_row_reads(); },
        "Reads of per-row input the kernels counted since the last call (then reset to 0).");
  m.def("state_sectors", [] { return emu::take_state_sectors(); },
        "(accesses to the per-prompt state, distinct 32-byte sectors touched) since the last call.");
  m.def("close_launch_gate", [] { emu::LaunchGate::get().close(); },
        "Host threads that launch wait in the launch call until the gate opens.");
  m.def("open_launch_gate", [] { emu::LaunchGate::get().open(); });
  m.def("launch_gate_waiters", [] { return emu::LaunchGate::get().waiters(); });
}

}  // namespace lze_emu_bindings

using lze_emu_bindings::bind_emulator;

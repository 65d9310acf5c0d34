// pybind11 bindings of the C ABI (csrc/lze_kernels.h, csrc/cuda/lze_cuda.h). Compiled once per
// backend module: LZE_BIND_CPU for the C++ CPU kernels, LZE_BIND_CUDA for the CUDA kernels
// (built by nvcc, or by g++ against the CUDA emulator). Tensors cross as data pointers (ints) so
// the build needs no torch; lze_kernels/native.py owns the torch side (shapes, dtypes, streams,
// thread counts, output buffers).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <utility>

#if defined(LZE_BIND_CPU)
#include "lze_kernels.h"
#elif defined(LZE_BIND_CUDA)
#include "cuda/lze_cuda.h"
#if !defined(LZE_CUDA_EMULATION)
#include <cuda_runtime.h>
#endif
#else
#error "define LZE_BIND_CPU or LZE_BIND_CUDA"
#endif

#if defined(LZE_CUDA_EMULATION)
#include "emu/emu_bindings.h"
#endif

namespace py = pybind11;

namespace {

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The launchers' last argument: the CPU kernels' thread budget, as a (max_threads, adaptive)
// tuple, or the CUDA (stream, device) of the tensors.
#if defined(LZE_BIND_CPU)
using LaunchArg = std::pair<int32_t, bool>;
lze::ThreadBudget launch_arg(LaunchArg budget) {
  return lze::ThreadBudget{budget.first, budget.second ? 1 : 0};
}
#else
using LaunchArg = std::pair<std::uintptr_t, int32_t>;
using lze::cuda_select::TopkPlan;
#endif

lze::Params make_params(float beta, float one_minus_beta, float d_min, float alpha, float eps,
                        bool norm_by_std, int32_t prune_after) {
  return lze::Params{beta, one_minus_beta, d_min, alpha, eps, norm_by_std ? 1 : 0, prune_after};
}

int step(std::uintptr_t rewards, int32_t rewards_dtype, std::uintptr_t valid,
         std::uintptr_t prompt_ids, int64_t B, int64_t G, int64_t N, std::uintptr_t records,
         std::uintptr_t step_counter, std::uintptr_t advantages, std::uintptr_t pass_rate,
         std::uintptr_t energy, std::uintptr_t momentum, std::uintptr_t fault, float beta,
         float one_minus_beta, float d_min, float alpha, float eps, bool norm_by_std,
         int32_t prune_after, LaunchArg launch) {
  const lze::Params params =
      make_params(beta, one_minus_beta, d_min, alpha, eps, norm_by_std, prune_after);
#if defined(LZE_BIND_CPU)
  return lze_step_cpu(as_ptr<const void>(rewards), rewards_dtype, as_ptr<const uint8_t>(valid),
                      as_ptr<const int64_t>(prompt_ids), B, G, N, as_ptr<int32_t>(records),
                      as_ptr<int64_t>(step_counter), as_ptr<float>(advantages),
                      as_ptr<float>(pass_rate), as_ptr<float>(energy), as_ptr<float>(momentum),
                      as_ptr<int32_t>(fault), params, launch_arg(launch));
#else
  return lze_step_cuda(as_ptr<const void>(rewards), rewards_dtype, as_ptr<const uint8_t>(valid),
                       as_ptr<const int64_t>(prompt_ids), B, G, N, as_ptr<int32_t>(records),
                       as_ptr<int64_t>(step_counter), as_ptr<float>(advantages),
                       as_ptr<float>(pass_rate), as_ptr<float>(energy), as_ptr<float>(momentum),
                       as_ptr<int32_t>(fault), params, launch.second, as_ptr<void>(launch.first));
#endif
}

#if defined(LZE_BIND_CPU)
int topk(std::uintptr_t energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
         std::uintptr_t step_counter, std::uintptr_t keep_mask, std::uintptr_t kept_indices,
         std::uintptr_t num_kept, LaunchArg launch) {
  return lze_topk_cpu(as_ptr<const float>(energy), B, k, noise_scale, seed,
                      as_ptr<const int64_t>(step_counter), as_ptr<uint8_t>(keep_mask),
                      as_ptr<int64_t>(kept_indices), as_ptr<int64_t>(num_kept),
                      launch_arg(launch));
}
#else
int topk(std::uintptr_t energy, int64_t B, int64_t k, float noise_scale, uint32_t seed,
         std::uintptr_t step_counter, std::uintptr_t keep_mask, std::uintptr_t kept_indices,
         std::uintptr_t num_kept, std::uintptr_t workspace, const TopkPlan& plan,
         LaunchArg launch) {
  return lze_topk_cuda(as_ptr<const float>(energy), B, k, noise_scale, seed,
                       as_ptr<const int64_t>(step_counter), as_ptr<uint8_t>(keep_mask),
                       as_ptr<int64_t>(kept_indices), as_ptr<int64_t>(num_kept),
                       as_ptr<void>(workspace), &plan, launch.second, as_ptr<void>(launch.first));
}

// (status, plan) of a top-k over B rows on `device` (lze_topk_cuda_plan).
std::pair<int, TopkPlan> plan_topk(int64_t B, int32_t device) {
  TopkPlan plan{};
  const int status = lze_topk_cuda_plan(B, device, &plan);
  return {status, plan};
}

std::pair<int, lze::cuda_select::DeviceShape> device_shape(int32_t device) {
  lze::cuda_select::DeviceShape shape{};
  const int status = lze_cuda_device_shape(device, &shape);
  return {status, shape};
}
#endif

// A selection step's arguments that stay put from step to step (the state, the outputs, the
// workspace, the parameters, the CUDA plan), held on the C++ side so that a step passes only what
// changes: the inputs, the undo buffer and the stream or thread budget (lze_kernels/runners.py).
struct SelectStepCall {
  lze::SelectStep call{};
#if defined(LZE_BIND_CUDA)
  TopkPlan plan{};
#endif

  int run(std::uintptr_t rewards, int32_t rewards_dtype, std::uintptr_t valid,
          std::uintptr_t prompt_ids, std::uintptr_t undo, LaunchArg launch) const {
    lze::SelectStep s = call;
    s.rewards = as_ptr<const void>(rewards);
    s.rewards_dtype = rewards_dtype;
    s.valid = as_ptr<const uint8_t>(valid);
    s.prompt_ids = as_ptr<const int64_t>(prompt_ids);
    s.undo = as_ptr<int32_t>(undo);
#if defined(LZE_BIND_CPU)
    return lze_select_step_cpu(&s, launch_arg(launch));
#else
    return lze_select_step_cuda(&s, &plan, launch.second, as_ptr<void>(launch.first));
#endif
  }
};

SelectStepCall make_select_step(int64_t B, int64_t G, int64_t N, int64_t k,
                                std::uintptr_t records, std::uintptr_t step_counter,
                                std::uintptr_t fault, std::uintptr_t fault_mirror,
                                std::uintptr_t advantages, std::uintptr_t pass_rate,
                                std::uintptr_t energy, std::uintptr_t momentum,
                                std::uintptr_t keep_mask, std::uintptr_t kept_indices,
                                std::uintptr_t num_kept, std::uintptr_t workspace, float beta,
                                float one_minus_beta, float d_min, float alpha, float eps,
                                bool norm_by_std, int32_t prune_after, float noise_scale,
                                uint32_t seed
#if defined(LZE_BIND_CUDA)
                                , const TopkPlan& plan
#endif
                                ) {
  SelectStepCall c;
#if defined(LZE_BIND_CUDA)
  c.plan = plan;
#endif
  lze::SelectStep& s = c.call;
  s.B = B, s.G = G, s.N = N, s.k = k;
  s.records = as_ptr<int32_t>(records);
  s.step_counter = as_ptr<int64_t>(step_counter);
  s.fault = as_ptr<int32_t>(fault);
  s.fault_mirror = as_ptr<int32_t>(fault_mirror);
  s.advantages = as_ptr<float>(advantages);
  s.pass_rate = as_ptr<float>(pass_rate);
  s.energy = as_ptr<float>(energy);
  s.momentum = as_ptr<float>(momentum);
  s.keep_mask = as_ptr<uint8_t>(keep_mask);
  s.kept_indices = as_ptr<int64_t>(kept_indices);
  s.num_kept = as_ptr<int64_t>(num_kept);
  s.workspace = as_ptr<void>(workspace);
  s.params = make_params(beta, one_minus_beta, d_min, alpha, eps, norm_by_std, prune_after);
  s.noise_scale = noise_scale;
  s.seed = seed;
  return c;
}

#if defined(LZE_BIND_CPU)
int predict(std::uintptr_t queries, std::uintptr_t refs, std::uintptr_t labels, int64_t N,
            int64_t K, int64_t d, float scale, std::uintptr_t out, LaunchArg launch) {
  return lze_dots_predict_cpu(as_ptr<const float>(queries), as_ptr<const float>(refs),
                              as_ptr<const float>(labels), N, K, d, scale, as_ptr<float>(out),
                              launch_arg(launch));
}
#endif

// The address kernels use for host memory: under CUDA (and the emulator), the device pointer of
// pinned, mapped host memory (cudaHostGetDevicePointer), or 0 when the memory is not that (a
// kernel must never store to pageable host memory); for the CPU kernels the address itself.
std::uintptr_t mapped_pointer(std::uintptr_t host) {
#if defined(LZE_BIND_CUDA)
  void* device = nullptr;
  if (cudaHostGetDevicePointer(&device, as_ptr<void>(host), 0) == cudaSuccess) {
    return reinterpret_cast<std::uintptr_t>(device);
  }
  cudaGetLastError();  // not sticky: clear it for the next launch's check
  return 0;
#else
  return host;
#endif
}

}  // namespace

PYBIND11_MODULE(LZE_MODULE_NAME, m) {
  m.doc() = "lze-kernels compiled backend: fused LZE step and top-k selection (raw pointers).";
  m.def("step", &step, py::call_guard<py::gil_scoped_release>(),
        "Fused statistics, advantages, energy and state update; returns an error code.");
  m.def("topk", &topk, py::call_guard<py::gil_scoped_release>(),
        "Fixed-shape top-k selection by energy with optional Gumbel noise; returns an error code.");
  py::class_<SelectStepCall>(m, "SelectStep",
                             "A selection step's fixed arguments; run() is one step.")
      .def("run", &SelectStepCall::run, py::call_guard<py::gil_scoped_release>(),
           "One selection step (step and top-k) on these inputs; returns an error code.");
  m.def("select_step", &make_select_step,
        "The fixed arguments of selection steps over one (B, G): state, outputs, parameters.");
  m.def("mapped_pointer", &mapped_pointer,
        "The address kernels use for a host buffer (CUDA: its mapped device pointer, or 0).");
#if defined(LZE_BIND_CUDA)
  using lze::cuda_select::DeviceShape;
  py::class_<TopkPlan>(m, "TopkPlan", py::module_local(),
                       "A top-k's launch plan on one device (selection_plan.h).")
      .def_readonly("B", &TopkPlan::B)
      .def_readonly("one_block", &TopkPlan::one_block)
      .def_readonly("passes", &TopkPlan::passes)
      .def_readonly("blocks", &TopkPlan::blocks)
      .def_readonly("tile_rows", &TopkPlan::tile_rows)
      .def_readonly("shared_bytes", &TopkPlan::shared_bytes)
      .def_readonly("launches", &TopkPlan::launches);
  py::class_<DeviceShape>(m, "DeviceShape", py::module_local(),
                          "What a device offers the top-k (selection_plan.h).")
      .def_readonly("sms", &DeviceShape::sms)
      .def_readonly("shared_optin", &DeviceShape::shared_optin)
      .def_readonly("one_block_max_rows", &DeviceShape::one_block_max_rows)
      .def_readonly("passes", &DeviceShape::passes);
  m.attr("NO_PLAN") = LZE_CUDA_NO_PLAN;
  m.def("plan_topk", &plan_topk, py::call_guard<py::gil_scoped_release>(),
        "(status, plan) of a top-k over B rows on a device, its opt-ins made (NO_PLAN: none fits).");
  m.def("device_shape", &device_shape, py::call_guard<py::gil_scoped_release>(),
        "(status, shape): what a device offers the top-k.");
  m.def("topk_workspace_bytes", &lze_topk_cuda_workspace_bytes,
        "Bytes of the device workspace a top-k by this plan needs (0: none).");
  m.def("select_step_workspace_bytes", &lze_select_step_cuda_workspace_bytes,
        "Bytes of the device workspace a selection step by this plan over G rollouts needs.");
  m.def("select_step_launches", &lze_select_step_cuda_launches,
        "Kernel launches of one selection step by this plan (with_undo: a checked step's copy).");
#endif
#if defined(LZE_CUDA_EMULATION)
  bind_emulator(m);
#endif
#if defined(LZE_BIND_CPU)
  m.def("predict", &predict, py::call_guard<py::gil_scoped_release>(),
        "DOTS pass-rate prediction (fused scores, online softmax, weighted sum); returns an "
        "error code.");
#endif
}

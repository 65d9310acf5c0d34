"""Torch custom ops over the compiled backends (``_lze_cpu``, ``_lze_cuda``, ``_lze_cuda_emu``).

The compiled modules take raw pointers (``csrc/bindings.cpp``); this module owns the torch side:
output allocation, dtype codes, the current CUDA stream or the CPU thread budget, and the fake
(meta) implementations that let ``torch.compile`` trace through the ops and CUDA graphs capture
them. Each compiled module becomes one :class:`NativeBackend` with the ops
``lze_kernels::step_<name>`` and ``lze_kernels::topk_<name>`` (``ops.lze_update``,
``ops.topk_mask``), ``lze_kernels::select_step_<name>`` (a whole selection step in one native
call, what ``LZESelector.step`` runs under ``torch.compile``; eagerly it runs through
:mod:`lze_kernels.runners` without the dispatcher) and ``lze_kernels::predict_<name>`` (the DOTS
prediction), where the module has a ``predict`` function (only ``_lze_cpu`` so far).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import emulated, runtime, validation
from . import layout as L
from .extensions import load_module
from .layout import KernelParams, SelectorState
from .reference import Selection, StepStats

Tensor = torch.Tensor
_STATE_ARGS = ("records", "step_counter", "fault")


def cpu_thread_budget(device: Optional[torch.device] = None) -> tuple[int, bool]:
    """(max_threads, adaptive) for the C++ CPU kernels (``csrc/cpu/parallel.h``).

    ``LZE_NUM_THREADS=n`` runs every call on n threads (fewer for small batches). Unset, a
    call runs on ``torch.get_num_threads()`` threads (which follows ``OMP_NUM_THREADS`` and
    ``torch.set_num_threads``) or on the calling thread alone, whichever has been faster
    lately, so the kernels fall back to one thread when the other cores are busy."""
    value = os.environ.get("LZE_NUM_THREADS", "")
    if not value:
        return torch.get_num_threads(), True
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LZE_NUM_THREADS: expected an int >= 1, got {value!r}")
    return int(value), False


def cuda_launch_arg(device: torch.device) -> tuple[int, int]:
    """(stream, device index) of a launch on ``device``: its current stream, and the device the
    call makes current for itself (the tensors' device, which need not be torch's current one)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return runtime.CUDA.stream(device), index


def _check_status(status: int, what: str) -> None:
    # A launch error code is returned synchronously by the launcher: no device sync involved.
    if status != 0:
        raise RuntimeError(f"lze_kernels: {what} failed with error code {status}")


class NativeBackend:
    """A compiled module exposed as torch custom ops with fake implementations. ``launch_arg``
    gives the launchers' last argument from the device (the CPU threads, or the CUDA (stream,
    device)); ``runtime`` orders the host's work around the module's (lze_kernels/runtime.py)."""

    def __init__(self, name: str, module_name: str, device_type: str, launch_arg,
                 host_runtime: runtime.HostRuntime):
        self.name = name
        self.module_name = module_name
        self.device_type = device_type
        self._launch_arg = launch_arg
        self.runtime = host_runtime
        self._module = None
        self._import_error: Optional[ImportError] = None
        self._launch_errors: dict[str, Optional[str]] = {}  # device -> probe result
        self._step_op = self._define_step_op()
        self._topk_op = self._define_topk_op()
        self._select_step_op = self._define_select_step_op()
        self._predict_op = self._define_predict_op()

    @property
    def module(self):
        """The compiled module, or None when it cannot be imported (tried once)."""
        if self._module is None and self._import_error is None:
            try:
                self._module = load_module(self.module_name)
            except ImportError as error:
                self._import_error = error
        return self._module

    def available(self) -> bool:
        return self.module is not None

    def unavailable_reason(self) -> str:
        """Why the module cannot run, naming it (for warnings and errors): missing, or a
        failed probe launch (:meth:`launch_error`)."""
        failed = "; ".join(f"{device}: {error}" for device, error in self._launch_errors.items()
                           if error is not None)
        if self._module is not None and failed:
            return f"the compiled module lze_kernels.{self.module_name} cannot launch ({failed})"
        return (f"the compiled module lze_kernels.{self.module_name} is missing "
                f"({self._import_error})")

    def launch_error(self, device: torch.device) -> Optional[str]:
        """Why a launch on ``device`` fails (None when it runs), probed once per device.

        The CUDA module links the CUDA runtime statically, so it imports even where the driver
        is older than that runtime; every launch then returns cudaErrorInsufficientDriver (35).
        The probe is one top-k launch on a 1-element batch, whose launch status the launcher
        returns synchronously."""
        key = str(device)
        if key not in self._launch_errors:
            self._launch_errors[key] = self._probe(device)
        return self._launch_errors[key]

    def _probe(self, device: torch.device) -> Optional[str]:
        energy = torch.zeros(1, device=device)
        step_counter = torch.zeros(2, dtype=torch.int64, device=device)
        try:
            self.topk(energy, 1, 0.0, 0, step_counter)
        except RuntimeError as error:
            return str(error)
        return None

    def has_op(self, op: str) -> bool:
        """Whether the module has a kernel for ``op`` (every module has step and topk)."""
        return op in ("step", "topk") or (op == "predict" and hasattr(self.module, "predict"))

    # -- the ops ------------------------------------------------------------------------------

    def step(self, rewards, valid, prompt_ids, state: SelectorState, params: KernelParams):
        adv, pass_rate, energy, momentum = _eager_or_op(self._step_op, rewards)(
            rewards.contiguous(), None if valid is None else valid.contiguous(),
            prompt_ids.contiguous(), state.records, state.step_counter, state.fault,
            params.beta, params.one_minus_beta, params.d_min, params.alpha, params.eps,
            params.norm_by_std, params.prune_after,
        )
        return StepStats(adv, pass_rate, energy, momentum)

    def launch_arg(self, device: torch.device):
        """The launchers' last argument on ``device``: the CUDA stream or the CPU threads."""
        return self._launch_arg(device)

    def kernel_address(self, host: Tensor) -> int:
        """The address the kernels write a host buffer through: under CUDA the device pointer
        of pinned, mapped memory (``cudaHostGetDevicePointer``), elsewhere its own address.
        Memory the device cannot address (pageable host memory) is refused, never passed on."""
        address = self.module.mapped_pointer(host.data_ptr())
        if address == 0:
            raise RuntimeError(f"lze_kernels: {self.name} cannot map the host buffer at "
                               f"{host.data_ptr():#x} for the device: it is not pinned, mapped "
                               "memory (cudaHostGetDevicePointer refused it)")
        return address

    def plan(self, batch: int, device: torch.device, argument: str):
        """The CUDA module's launch plan of a top-k over ``batch`` rows on ``device``, its
        opt-ins made (csrc/cuda/selection_plan.h); None for modules without plans. A batch no
        plan fits on the device is refused here, before anything is queued."""
        if not hasattr(self.module, "plan_topk"):
            return None
        index = self._launch_arg(device)[1]
        status, plan = self.module.plan_topk(batch, index)
        if status == self.module.NO_PLAN:
            raise ValueError(self._no_plan_message(batch, index, argument))
        _check_status(status, f"plan ({self.name})")
        return plan

    def _no_plan_message(self, batch: int, index: int, argument: str) -> str:
        _, shape = self.module.device_shape(index)
        return (f"{argument}: a selection over B = {batch} rows has no launch plan on device "
                f"{index} with the {self.name} backend: the device allows "
                f"{shape.shared_optin} bytes of shared memory a block, the one-block plan takes "
                f"up to {shape.one_block_max_rows} rows and no histogram plan fits; "
                "backend='triton' or backend='torch' runs it")

    def topk(self, energy, k: int, noise_scale: float, seed: int, step_counter) -> Selection:
        self.plan(energy.shape[0], energy.device, "energy")  # a refusal, before the op
        keep_mask, kept, num_kept = _eager_or_op(self._topk_op, energy)(
            energy.contiguous(), k, noise_scale, seed, step_counter
        )
        return Selection(keep_mask, kept, num_kept.view(()))

    def predict(self, query_emb, ref_emb, ref_pass, scale: float):
        """DOTS prediction (``dots.predict_pass_rates``); the kernel reads fp32 embeddings."""
        return _eager_or_op(self._predict_op, query_emb)(
            query_emb.float().contiguous(), ref_emb.float().contiguous(),
                                ref_pass.float().contiguous(), scale)

    # -- op definitions -----------------------------------------------------------------------

    def _define_step_op(self):
        @torch.library.custom_op(
            f"lze_kernels::step_{self.name}", mutates_args=_STATE_ARGS,
            device_types=self.device_type,
        )
        def step_op(
            rewards: Tensor, valid: Optional[Tensor], prompt_ids: Tensor, records: Tensor,
            step_counter: Tensor, fault: Tensor, beta: float,
            one_minus_beta: float, d_min: float, alpha: float, eps: float, norm_by_std: bool,
            prune_after: int,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            validation.check_records_alignment(records)  # before anything is written
            outputs = _empty_step_outputs(rewards)
            adv, pass_rate, energy, momentum = outputs
            batch, group = rewards.shape
            status = self.module.step(
                rewards.data_ptr(), L.REWARD_DTYPE_CODES[rewards.dtype],
                0 if valid is None else valid.data_ptr(), prompt_ids.data_ptr(),
                batch, group, records.shape[0] - 1, records.data_ptr(),
                step_counter.data_ptr(), adv.data_ptr(), pass_rate.data_ptr(),
                energy.data_ptr(), momentum.data_ptr(), fault.data_ptr(), beta, one_minus_beta,
                d_min, alpha, eps, norm_by_std, prune_after, self._launch_arg(rewards.device),
            )
            self.runtime.keep_alive(rewards, valid, prompt_ids, *outputs)  # a queued launch's
            _check_status(status, f"step ({self.name})")
            return outputs

        @step_op.register_fake
        def _(rewards, valid, prompt_ids, records, step_counter, fault, *scalars):
            return _empty_step_outputs(rewards)

        return step_op

    def _define_topk_op(self):
        @torch.library.custom_op(
            f"lze_kernels::topk_{self.name}", mutates_args=(), device_types=self.device_type
        )
        def topk_op(
            energy: Tensor, k: int, noise_scale: float, seed: int, step_counter: Tensor
        ) -> tuple[Tensor, Tensor, Tensor]:
            outputs = _empty_topk_outputs(energy, k)
            keep_mask, kept, num_kept = outputs
            workspace, workspace_args = self._topk_workspace(energy)
            status = self.module.topk(
                energy.data_ptr(), energy.shape[0], k, noise_scale, seed,
                step_counter.data_ptr(), keep_mask.data_ptr(), kept.data_ptr(),
                num_kept.data_ptr(), *workspace_args, self._launch_arg(energy.device),
            )
            self.runtime.keep_alive(workspace, energy, *outputs)  # used by queued launches
            _check_status(status, f"topk ({self.name})")
            return outputs

        @topk_op.register_fake
        def _(energy, k, noise_scale, seed, step_counter):
            return _empty_topk_outputs(energy, k)

        return topk_op

    def _topk_workspace(self, energy: Tensor) -> tuple[Optional[Tensor], tuple]:
        """The CUDA top-k's scratch buffer (csrc/cuda/lze_topk.cu) and the launcher's arguments
        for it and its plan: (None, ()) for modules without one. Allocated per call from
        torch's caching allocator, so CUDA graphs capture it and concurrent streams never share
        it; its contents need no initialisation (the emulator's are poisoned). Once the caller
        frees it, the allocator hands the buffer out again only behind the launches on this
        stream (the emulator's runtime holds it until they have run)."""
        plan = self.plan(energy.shape[0], energy.device, "energy")
        if plan is None:
            return None, ()
        workspace = self.empty_scratch(self.module.topk_workspace_bytes(plan), energy.device)
        return workspace, (workspace.data_ptr() if workspace.numel() else 0, plan)

    def empty_scratch(self, nbytes: int, device) -> Tensor:
        """Uninitialised device bytes; poisoned under the emulator, so that a kernel reading
        scratch it did not write fails there as it would on a GPU."""
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.runtime is runtime.EMULATED:
            scratch.fill_(0xA5)
        return scratch

    def _define_select_step_op(self):
        @torch.library.custom_op(
            f"lze_kernels::select_step_{self.name}", mutates_args=_STATE_ARGS,
            device_types=self.device_type,
        )
        def select_step_op(
            rewards: Tensor, valid: Optional[Tensor], prompt_ids: Tensor, records: Tensor,
            step_counter: Tensor, fault: Tensor, k: int, beta: float, one_minus_beta: float,
            d_min: float, alpha: float, eps: float, norm_by_std: bool, prune_after: int,
            noise_scale: float, seed: int, fault_mirror: int,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            outputs = empty_select_outputs(rewards, k)
            batch, group = rewards.shape
            plan = self.plan(batch, rewards.device, "rewards")
            workspace = self.select_step_workspace(plan, group, rewards.device)
            call = self.module.select_step(
                batch, group, records.shape[0] - 1, k, records.data_ptr(),
                step_counter.data_ptr(), fault.data_ptr(), fault_mirror,
                *(t.data_ptr() for t in outputs), 0 if workspace is None else workspace.data_ptr(),
                beta, one_minus_beta, d_min, alpha, eps, norm_by_std, prune_after, noise_scale,
                seed, *(() if plan is None else (plan,)))
            status = call.run(rewards.data_ptr(), L.REWARD_DTYPE_CODES[rewards.dtype],
                              0 if valid is None else valid.data_ptr(), prompt_ids.data_ptr(), 0,
                              self._launch_arg(rewards.device))
            # read or written by launches still queued (see _topk_workspace): a captured graph
            # keeps them as long as it lives, as a CUDA graph's private pool does
            self.runtime.keep_alive(workspace, rewards, valid, prompt_ids, *outputs)
            _check_status(status, f"select_step ({self.name})")
            return outputs

        @select_step_op.register_fake
        def _(rewards, valid, prompt_ids, records, step_counter, fault, k, *scalars):
            return empty_select_outputs(rewards, k)

        return select_step_op

    def select_step_workspace(self, plan, group: int, device) -> Optional[Tensor]:
        """The CUDA selection step's scratch by ``plan`` (csrc/cuda/selection_plan.h), from
        torch's caching allocator; None for modules without one (``plan`` None)."""
        if plan is None:
            return None
        return self.empty_scratch(self.module.select_step_workspace_bytes(plan, group), device)

    def _define_predict_op(self):
        @torch.library.custom_op(
            f"lze_kernels::predict_{self.name}", mutates_args=(), device_types=self.device_type
        )
        def predict_op(query_emb: Tensor, ref_emb: Tensor, ref_pass: Tensor,
                       scale: float) -> Tensor:
            out = torch.empty(query_emb.shape[0], dtype=torch.float32, device=query_emb.device)
            status = self.module.predict(
                query_emb.data_ptr(), ref_emb.data_ptr(), ref_pass.data_ptr(),
                query_emb.shape[0], ref_emb.shape[0], query_emb.shape[1], scale,
                out.data_ptr(), self._launch_arg(query_emb.device),
            )
            _check_status(status, f"predict ({self.name})")
            return out

        @predict_op.register_fake
        def _(query_emb, ref_emb, ref_pass, scale):
            return query_emb.new_empty(query_emb.shape[0], dtype=torch.float32)

        return predict_op


def _eager_or_op(op, tensor: Tensor):
    """The op's own function when nothing needs the dispatcher (plain eager tensors, no
    ``torch.compile`` tracing, no fake tensors or dispatch modes), else the registered op.

    Going through ``torch.library``'s dispatcher costs about 35 us per call on the host, which at
    small batches is most of a step (verl adapter, 128 x 8: 110 us through the ops, 35 us
    direct); the function is the same code, so results are identical."""
    return op if needs_dispatcher(tensor) else op._init_fn


def _empty_step_outputs(rewards: Tensor):
    batch = rewards.shape[0]
    f32 = dict(dtype=torch.float32, device=rewards.device)
    return (
        torch.empty(rewards.shape, **f32), torch.empty(batch, **f32),
        torch.empty(batch, **f32), torch.empty(batch, **f32),
    )


def empty_select_outputs(rewards: Tensor, k: int) -> tuple:
    """A selection step's seven outputs, empty: advantages, pass rate, energy, momentum,
    keep_mask, kept_indices and the 0-dim num_kept."""
    return (*_empty_step_outputs(rewards), torch.empty(rewards.shape[0], dtype=torch.bool,
                                                       device=rewards.device),
            torch.empty(k, dtype=torch.int64, device=rewards.device),
            torch.empty((), dtype=torch.int64, device=rewards.device))


def needs_dispatcher(tensor: Tensor) -> bool:
    """Whether a call on ``tensor`` must go through the registered op: ``torch.compile``
    tracing, fake tensors or a dispatch mode (see :func:`_eager_or_op`)."""
    return torch.compiler.is_compiling() or without_data(tensor)


def without_data(tensor: Tensor) -> bool:
    """Whether ``tensor`` has no values to compute with: a fake tensor, or any tensor while a
    dispatch mode (``FakeTensorMode``, a recorder) intercepts the ops."""
    return isinstance(tensor, FakeTensor) or _get_current_dispatch_mode() is not None


def _empty_topk_outputs(energy: Tensor, k: int):
    device = energy.device
    return (
        torch.empty(energy.shape[0], dtype=torch.bool, device=device),
        torch.empty(k, dtype=torch.int64, device=device),
        torch.empty(1, dtype=torch.int64, device=device),
    )


CPU = NativeBackend("cpu", "_lze_cpu", "cpu", cpu_thread_budget, runtime.HOST)
CUDA = NativeBackend("cuda", "_lze_cuda", "cuda", cuda_launch_arg, runtime.CUDA)
# The CUDA kernel sources compiled with g++ against csrc/emu/cuda_emu.h: CPU tensors, CUDA code.
CUDA_EMULATED = NativeBackend("cuda_emulated", "_lze_cuda_emu", "cpu", emulated.launch_arg,
                              runtime.EMULATED)

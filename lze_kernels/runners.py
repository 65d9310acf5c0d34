"""A selector's steps on its backend: the step and the top-k, with the fault word's host mirror
and, for a checked step, an undo of the state.

:class:`NativeRunner` (the compiled backends) makes one native call a step: the module checks
the sizes and launches the step and the top-k (csrc/cpu/select_cpu.cpp, csrc/cuda/lze_select.cu)
by the plan made for the batch size on the device before the first step over it (the CUDA
module's launch plan, with its shared-memory opt-ins; a batch no plan fits is refused then, with
nothing queued). Its outputs come from a small pool per ``(B, G)`` instead of seven allocations
a step (the reuse rule below). :class:`OpsRunner` (the torch and Triton backends) calls the
backend's step and top-k. The selector runs one step at a time on one stream (its lock and
stream check, lze_kernels/selector.py): two steps never share a pooled buffer or the state.

The output reuse rule. The C++ and CUDA modules are torch-free builds that take raw pointers, so
they cannot allocate torch tensors; the caller provides the outputs. A step's seven outputs are
views of one buffer. The next step over the same ``(B, G)`` writes into a buffer of the pool
only when nothing outside the pool references it any more: no Python reference to any of the
seven tensors (counted against a baseline measured in this interpreter by the same code, so
the rule holds whatever the interpreter's own references are, e.g. CPython 3.14's borrowed
ones), no other tensor sharing its memory (a view, a ``.data`` alias), no C++ holder (autograd's
saved tensors). Otherwise it takes another (the pool holds :data:`POOL_SIZE`; past that a step
gets fresh outputs it does not keep). So a step's outputs are never overwritten while the caller
can still reach them, and a loop ``out = sel.step(...)`` alternates between two buffers with no
allocation. Work queued on another CUDA stream that reads them is not known to the pool
(``Tensor.record_stream`` protects only memory the caching allocator frees): order the
selector's stream after it before the next step (``torch.cuda.current_stream().wait_stream(s)``),
or make the selector with ``pool_outputs=False``, whose outputs are torch's allocations, which
``record_stream`` does protect. Under ``torch.compile``, fake tensors, a dispatch mode or a graph
capture, a step allocates its outputs instead (through the registered op under the dispatcher),
so a graph's outputs live in its private pool.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Optional

import torch

from . import layout as L
from .faults import FaultWord
from .native import needs_dispatcher
from .layout import KernelParams, SelectorState
from .reference import Selection, StepStats

POOL_SIZE = 3  # output buffers kept per (B, G): a loop holds one while the next step runs
MAX_PLANS = 8  # (B, G) plans kept: the oldest goes first (a ragged last batch, varying B)

_HAS_USE_COUNT = hasattr(torch.Tensor, "_use_count")


class SelectionConfig:
    """What the top-k of a step needs besides the energies: k per batch size, noise, seed."""

    __slots__ = ("num_keep", "noise_scale", "seed")

    def __init__(self, config):
        self.num_keep = config.num_keep
        self.noise_scale = config.noise_scale
        self.seed = config.seed


class OpsRunner:
    """Steps through a backend's step and top-k ops (the torch reference, Triton)."""

    def __init__(self, backend, state: SelectorState, params: KernelParams,
                 selection: SelectionConfig, faults: FaultWord):
        self._backend, self._state, self._params = backend, state, params
        self._selection, self._faults = selection, faults
        self._undo_rows: Optional[L.StateRows] = None

    def run(self, rewards, valid, prompt_ids, keep_undo: bool) -> tuple[StepStats, Selection]:
        state, sel = self._state, self._selection
        self._undo_rows = state.rows_of(prompt_ids) if keep_undo else None
        # The host word is real memory: not written while tracing or on fake tensors.
        mirror = None if needs_dispatcher(rewards) else self._faults.tensor
        stats = self._backend.step(rewards, valid, prompt_ids, state, self._params,
                                   fault_mirror=mirror)
        selection = self._backend.topk(stats.energy, sel.num_keep(rewards.shape[0]),
                                       sel.noise_scale, sel.seed, state.step_counter)
        return stats, selection

    def undo(self) -> None:
        """Restore the state as it was before the last ``run(..., keep_undo=True)``."""
        self._state.restore(self._undo_rows)


class NativeRunner:
    """Steps of one selector on a compiled backend: one native call a step. ``pool_outputs``
    False: every step's outputs are a fresh allocation (the reuse rule above)."""

    def __init__(self, backend, state: SelectorState, params: KernelParams,
                 selection: SelectionConfig, faults: FaultWord, pool_outputs: bool = True):
        self._backend, self._state, self._params = backend, state, params
        self._selection, self._faults = selection, faults
        self._pool_size = POOL_SIZE if pool_outputs else 0
        self._mirror_address = backend.kernel_address(faults.tensor)
        self._plans: dict[tuple[int, int], _StepPlan] = {}
        self._undo_ids: Optional[torch.Tensor] = None
        self._undo_records: Optional[torch.Tensor] = None

    def run(self, rewards, valid, prompt_ids, keep_undo: bool) -> tuple[StepStats, Selection]:
        if needs_fresh_outputs(rewards, self._backend.runtime):
            return self._run_op(rewards, valid, prompt_ids, keep_undo)
        plan = self._plan(*rewards.shape)
        outputs = plan.outputs()
        rewards, prompt_ids = rewards.contiguous(), prompt_ids.contiguous()
        valid = None if valid is None else valid.contiguous()
        undo = plan.undo_buffer() if keep_undo else None
        status = outputs.call.run(
            rewards.data_ptr(), L.REWARD_DTYPE_CODES[rewards.dtype],
            0 if valid is None else valid.data_ptr(), prompt_ids.data_ptr(),
            0 if undo is None else undo.data_ptr(), self._backend.launch_arg(rewards.device))
        self._backend.runtime.keep_alive(rewards, valid, prompt_ids)  # read by queued launches
        if status != 0:
            raise RuntimeError(f"lze_kernels: select_step ({self._backend.name}) failed with "
                               f"error code {status}")
        self._undo_ids, self._undo_records = (prompt_ids, undo) if keep_undo else (None, None)
        return outputs.stats, outputs.selection

    def _plan(self, batch: int, group: int) -> "_StepPlan":
        """The plan of steps over ``(B, G)``, made (and a batch no launch plan fits refused,
        before anything is queued) at the first step over it."""
        plan = self._plans.get((batch, group))
        if plan is None:
            plan = _StepPlan(self, batch, group)
            if len(self._plans) == MAX_PLANS:  # outputs still referenced stay with their users
                del self._plans[next(iter(self._plans))]
            self._plans[batch, group] = plan
        return plan

    def _run_op(self, rewards, valid, prompt_ids, keep_undo: bool):
        """The step through the registered op (fresh outputs): under the dispatcher, or while a
        CUDA graph captures it."""
        state, params, sel = self._state, self._params, self._selection
        undo = state.rows_of(prompt_ids) if keep_undo else None
        outputs = self._backend._select_step_op(
            rewards.contiguous(), None if valid is None else valid.contiguous(),
            prompt_ids.contiguous(), state.records, state.step_counter, state.fault,
            sel.num_keep(rewards.shape[0]), params.beta, params.one_minus_beta, params.d_min,
            params.alpha, params.eps, params.norm_by_std, params.prune_after, sel.noise_scale,
            sel.seed, self._mirror_address)
        self._undo_ids, self._undo_records = ((undo.ids, undo.records) if keep_undo
                                              else (None, None))
        return StepStats(*outputs[:4]), Selection(*outputs[4:])

    def undo(self) -> None:
        """Restore the state as it was before the last ``run(..., keep_undo=True)``."""
        state = self._state
        state.records.index_copy_(0, self._undo_ids.clamp(0, state.num_prompts),
                                  self._undo_records)
        state.step_counter[0] -= 1


def needs_fresh_outputs(rewards: torch.Tensor, host_runtime) -> bool:
    """Whether a step must allocate its outputs: under the dispatcher (``torch.compile``, fake
    tensors, a dispatch mode) or inside a graph capture."""
    return needs_dispatcher(rewards) or host_runtime.capturing(rewards.device)


class _StepPlan:
    """What the steps over one ``(B, G)`` reuse: the launch plan (CUDA), the output pool, the
    undo buffer, the CUDA workspace."""

    def __init__(self, runner: NativeRunner, batch: int, group: int):
        self._runner, self.batch, self.group = runner, batch, group
        self.k = runner._selection.num_keep(batch)
        device = runner._state.records.device
        self.launch_plan = runner._backend.plan(batch, device, "rewards")
        self.workspace = runner._backend.select_step_workspace(self.launch_plan, group, device)
        self._pool: list[_Outputs] = []
        self._undo: Optional[torch.Tensor] = None

    def outputs(self) -> "_Outputs":
        """A pooled output set nothing else references, a new one while the pool has room, or
        a fresh one past it."""
        for outputs in self._pool:
            if outputs.released():
                return outputs
        outputs = _Outputs(self)
        if len(self._pool) < self._runner._pool_size:
            self._pool.append(outputs)
        return outputs

    def undo_buffer(self) -> torch.Tensor:
        if self._undo is None:
            self._undo = torch.empty((self.batch, L.RECORD_WORDS), dtype=torch.int32,
                                     device=self._runner._state.records.device)
        return self._undo


class _Outputs:
    """One step's seven outputs as views of one buffer, with the module's call object whose
    pointers are those views (``csrc/bindings.cpp``: SelectStep)."""

    def __init__(self, plan: _StepPlan):
        runner = plan._runner
        state, params, sel = runner._state, runner._params, runner._selection
        device = state.records.device
        batch, group, k = plan.batch, plan.group, plan.k
        # int64 first (8-byte alignment), then fp32, then bool; each field 16-byte aligned.
        fields = ((torch.int64, (k,)), (torch.int64, ()), (torch.float32, (batch, group)),
                  (torch.float32, (batch,)), (torch.float32, (batch,)), (torch.float32, (batch,)),
                  (torch.bool, (batch,)))
        sizes = [_aligned(dtype.itemsize * _numel(shape)) for dtype, shape in fields]
        self._buffer = runner._backend.empty_scratch(sum(sizes), device)
        views, offset = [], 0
        for (dtype, shape), size in zip(fields, sizes):
            numel = _numel(shape)
            views.append(self._buffer[offset:offset + dtype.itemsize * numel].view(dtype)
                         .view(shape))
            offset += size
        kept, num_kept, advantages, pass_rate, energy, momentum, keep_mask = views
        self.stats = StepStats(advantages, pass_rate, energy, momentum)
        self.selection = Selection(keep_mask, kept, num_kept)
        self._storage = self._buffer.untyped_storage()
        self._storage_uses = torch._C._storage_Use_Count(self._storage._cdata)
        self.call = runner._backend.module.select_step(
            batch, group, state.num_prompts, k, state.records.data_ptr(),
            state.step_counter.data_ptr(), state.fault.data_ptr(), runner._mirror_address,
            advantages.data_ptr(), pass_rate.data_ptr(), energy.data_ptr(), momentum.data_ptr(),
            keep_mask.data_ptr(), kept.data_ptr(), num_kept.data_ptr(),
            0 if plan.workspace is None else plan.workspace.data_ptr(), params.beta,
            params.one_minus_beta, params.d_min, params.alpha, params.eps, params.norm_by_std,
            params.prune_after, sel.noise_scale, sel.seed,
            *(() if plan.launch_plan is None else (plan.launch_plan,)))

    def released(self) -> bool:
        """Whether nothing outside this object references the outputs (the reuse rule)."""
        if not _HAS_USE_COUNT:
            return False
        if torch._C._storage_Use_Count(self._storage._cdata) != self._storage_uses:
            return False  # another tensor shares the buffer: a view or an alias of an output
        baseline = unreferenced_count()
        for group in (self.stats, self.selection):
            # One TensorImpl owner each (its Python object): no C++ holder (a saved tensor).
            if any(n != baseline for n in python_references(group)):
                return False
            if any(tensor._use_count() != 1 for tensor in group):
                return False
        return True


def python_references(tensors) -> list[int]:
    """``sys.getrefcount`` of each of ``tensors`` as this function sees it (its tuple's, its loop's
    and the call's references included: what the interpreter adds is measured, not assumed)."""
    return [sys.getrefcount(tensor) for tensor in tensors]


@lru_cache(maxsize=1)
def unreferenced_count() -> int:
    """What :func:`python_references` reports for a tensor only a tuple holds, in this
    interpreter (3 on CPython 3.11-3.13)."""
    return python_references((torch.empty(0),))[0]


def _numel(shape: tuple) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _aligned(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16

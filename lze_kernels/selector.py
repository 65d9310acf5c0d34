"""``LZESelector``: Learning-Zone Energy data selection for GRPO/DAPO, state on the device.

Per training step the selector turns the rewards of B prompt groups of G rollouts into GRPO
advantages and a fixed-shape top-k selection of the groups on the learning frontier (docs/spec.md §2-4);
between steps it keeps per-prompt state (anchor difficulty, pass-rate EMA, solved streaks) for
the whole dataset on the device, prunes mastered prompts from rollout with replay (docs/spec.md §5) and
splits a rollout budget across prompts (docs/spec.md §6).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import dispatch, reference, validation
from . import layout as L
from .captured import CapturedStep
from .config import LZEConfig
from .faults import FaultWord
from .layout import KernelParams, SelectorState
from .runners import SelectionConfig

_FORMAT = "lze_kernels.selector/1"


@dataclass
class StepOutput:
    """Everything a trainer needs from one step; every shape follows from B, G and k."""

    advantages: torch.Tensor  # [B, G] fp32 GRPO per-sequence advantages
    pass_rate: torch.Tensor  # [B] fp32
    energy: torch.Tensor  # [B] fp32
    momentum: torch.Tensor  # [B] fp32
    keep_mask: torch.Tensor  # [B] bool
    kept_indices: torch.Tensor  # [k] int64, ascending batch position, -1 padded
    num_kept: torch.Tensor  # 0-dim int64 = min(k, #groups with E > 0)


class LZESelector:
    """Online LZE selector over a dataset of ``num_prompts`` prompts.

    Args:
        num_prompts: N, the number of dataset rows ``prompt_ids`` index into.
        config: hyper-parameters (:class:`LZEConfig`).
        device: where the state lives; inputs must be on the same device.
        backend: ``"auto" | "torch" | "triton" | "cuda" | "cpu"`` (``"cuda_emulated"`` runs the
            CUDA kernel sources on CPU threads, for tests). ``sel.backend`` tells which runs.
        pool_outputs: on the compiled backends, reuse a step's output buffers once nothing
            references them (lze_kernels/runners.py); ``False``: a fresh allocation a step, for
            outputs read on other CUDA streams (``Tensor.record_stream`` then protects them).

    A selector's steps run one at a time (a lock) on one stream: the first step's; a step on
    another stream raises ``ValueError`` (two steps at once would share the state's scratch
    and the output pool) unless :meth:`use_current_stream` moved it there.
    """

    def __init__(self, num_prompts: int, config: Optional[LZEConfig] = None,
                 device="cpu", backend: str = "auto", pool_outputs: bool = True):
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
        self.config = config if config is not None else LZEConfig()
        if not isinstance(self.config, LZEConfig):
            raise ValueError(f"config: expected an LZEConfig, got {type(config).__name__}")
        # As tensors report it: "cuda" -> "cuda:0", accelerate's "cpu:0" -> "cpu" (inputs are
        # checked against it by equality).
        self.device = torch.empty(0, device=device).device
        self._backend = dispatch.resolve(backend, self.device)
        self._runtime = self._backend.runtime(self.device)
        self._params = KernelParams.from_config(self.config)
        self._state = SelectorState.empty(num_prompts, self.device)
        self._faults = FaultWord(self._runtime)
        # What runs a step: one native call on the compiled backends (lze_kernels.runners).
        self._runner = self._backend.runner(self._state, self._params,
                                            SelectionConfig(self.config), self._faults,
                                            pool_outputs)
        self._lock = threading.Lock()
        self._stream: Optional[int] = None  # of the steps so far
        self.epoch = 0

    @property
    def state(self) -> SelectorState:
        """The per-prompt state (``records``, its ``fstate`` / ``istate`` views, the step counter,
        the fault word): read it, write it in place (``load_state_dict``); the selector keeps
        this one object for its lifetime."""
        return self._state

    @property
    def backend(self) -> str:
        """The backend that runs ``step`` (``auto`` resolved)."""
        return self._backend.name

    @property
    def num_prompts(self) -> int:
        return self.state.num_prompts

    # ------------------------------------------------------------------------- training step

    def step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor,
             valid: Optional[torch.Tensor] = None, *, check_inputs: Optional[bool] = None,
             sorted: bool = False) -> StepOutput:
        """Score one batch of prompt groups, update their state and select the top-k groups.

        ``rewards`` [B, G] float in [0, 1], ``prompt_ids`` [B] int64 distinct ids in [0, N),
        ``valid`` [B, G] bool for ragged groups. Shapes, dtypes and devices are checked here;
        values by the kernels on the device, which skip a bad row (its state is not written)
        and record a fault (docs/kernels.md, "Bad input"). ``check_inputs`` says when that raises
        ``ValueError``:

        * ``True``: right after the step, which it undoes (one host sync);
        * ``None`` (default): ``True`` on a CPU; on a GPU, without a sync, at the start of a
          later step once the step that faulted has finished (that later step does not run: its
          batch is not applied), or at :meth:`raise_if_faulted`. The step kernel writes the
          fault word into host-mapped memory, so the check reads host memory instead of
          synchronising (its cost on a GPU is measured by the GPU check, docs/gpu-check.md),
          and keeps working when the step is captured in a CUDA graph (:meth:`capture_step`);
        * ``False``: only at :meth:`raise_if_faulted` or a later checked step.

        ``kept_indices`` lists the kept groups in ascending batch position; ``sorted=True``
        orders them by descending score instead (docs/spec.md §4: O(B) more work and a sort of
        k keys).

        On the compiled backends the step is one native call, and its outputs are reused by a
        later step once nothing references them any more (lze_kernels/runners.py: never while
        you hold any of them or a view of one).
        """
        validation.check_step_structure(rewards, prompt_ids, valid, self.device,
                                        self.num_prompts)
        if torch.compiler.is_compiling():  # traced once into a graph: no host-side ordering
            stats, selection = self._run(rewards, prompt_ids, valid, check_inputs)
        else:
            with self._lock:
                self._claim_stream()
                stats, selection = self._run(rewards, prompt_ids, valid, check_inputs)
        if sorted:
            self._runtime.before_host_access(self.device)
            selection = reference.sort_by_score(selection, stats.energy, self.config.noise_scale,
                                                self.config.seed, self._state.step_counter[0])
        return StepOutput(*stats, *selection)

    def _run(self, rewards, prompt_ids, valid, check_inputs):
        when = _check_time(check_inputs, self._runtime, self.device)
        if when == "later":
            self._raise_arrived_faults()
        stats, selection = self._runner.run(rewards, valid, prompt_ids, keep_undo=when == "now")
        if when == "now":
            self._undo_and_raise_if_faulted()
        return stats, selection

    def _claim_stream(self) -> None:
        """The steps' stream: the first step's; a step on another raises (a capture runs
        nothing and is not checked: its replay is)."""
        if self._runtime.capturing(self.device):
            return
        stream = self._runtime.stream(self.device)
        if self._stream is None:
            self._stream = stream
        elif stream != self._stream:
            raise ValueError(
                f"stream: this selector's steps run on stream {self._stream:#x}, got a step on "
                f"stream {stream:#x}: two steps at once would share the selector's state and "
                "outputs. Step on one stream, or call use_current_stream() to move the selector "
                "to the current stream (it orders it after the earlier steps)")

    def use_current_stream(self) -> None:
        """Moves the selector's steps to the current stream, ordered after its earlier steps
        (the current stream waits for the stream they ran on)."""
        with self._lock:
            stream = self._runtime.stream(self.device)
            if self._stream is not None and stream != self._stream:
                self._runtime.order_after(self.device, self._stream)
            self._stream = stream

    def _undo_and_raise_if_faulted(self) -> None:
        """A checked step's one host sync (none on a CPU): on a fault, restore the state as it
        was before the step, clear the fault word and raise."""
        self._runtime.synchronize(self.device)  # the step has run: the mirror is written
        bits = self._faults.bits()
        if bits:
            self._runner.undo()
            self._clear_faults()
            validation.raise_for_faults(bits, self.num_prompts, found="now")

    def _raise_arrived_faults(self) -> None:
        """The default check on a GPU: raise what the fault word's host mirror says, if an
        earlier step faulted (no sync while none did). The steps still queued copy the word
        again, so they run before it is cleared; inside a graph capture nothing runs, so the
        faults are raised and left recorded (capture_step raises them before capturing)."""
        bits = self._faults.bits()
        if not bits:
            return
        if not self._runtime.capturing(self.device):
            self._runtime.synchronize(self.device)
            bits = self._faults.bits()
            self._clear_faults()
        validation.raise_for_faults(bits, self.num_prompts, found="later")

    def _clear_faults(self) -> None:
        """The device word zeroed behind the queued work, then the host's copy (once nothing
        queued writes it: after a synchronisation)."""
        self._runtime.zero_(self._state.fault)
        self._faults.clear()

    def raise_if_faulted(self) -> None:
        """Raise (and clear) the faults that unchecked steps recorded on the device. Waits for
        the steps queued so far (a host sync)."""
        with self._lock:
            self._runtime.synchronize(self.device)
            bits = int(self._state.fault[0])
            if bits:
                self._clear_faults()
                validation.raise_for_faults(bits, self.num_prompts)
            self._faults.clear()

    def capture_step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor,
                     valid: Optional[torch.Tensor] = None, *,
                     check_inputs: Optional[bool] = None, sorted: bool = False
                     ) -> CapturedStep:
        """The step over a fixed ``(B, G)`` as a replayable graph: a step on this first batch
        (its outputs are the returned object's ``output``), then, on a GPU, the step captured in
        a ``torch.cuda.CUDAGraph`` whose static inputs are copies of these tensors; each
        ``replay()`` is one graph launch. On a CPU ``replay()`` runs the step. See
        :class:`lze_kernels.captured.CapturedStep`."""
        return CapturedStep(self, rewards, prompt_ids, valid, check_inputs, sorted)

    # ------------------------------------------------------------------------- forward pruner

    def rollout_mask(self, prompt_ids: torch.Tensor, *, check_inputs: bool = True) -> torch.Tensor:
        """[C] bool: which prompts get rollouts (not pruned, or drawn for replay; docs/spec.md §5)."""
        validation.check_prompt_ids_structure(prompt_ids, self.device)
        self._runtime.before_host_access(self.device)
        if check_inputs:
            validation.check_prompt_id_values(prompt_ids, self.num_prompts, distinct=False)
        return reference.rollout_eligible(self._state, prompt_ids)

    def take_eligible(self, candidate_ids: torch.Tensor, batch_size: int, *,
                      check_inputs: bool = True):
        """Fixed-shape pick of ``batch_size`` prompts from ``C >= batch_size`` candidates:
        eligible ones first (in candidate order), padded with ineligible ones.
        Returns ``(prompt_ids [B], eligible [B] bool)``."""
        eligible = self.rollout_mask(candidate_ids, check_inputs=check_inputs)
        if not isinstance(batch_size, int) or not 1 <= batch_size <= candidate_ids.shape[0]:
            raise ValueError(f"batch_size: expected an int in [1, {candidate_ids.shape[0]}] "
                             f"(the number of candidates), got {batch_size!r}")
        return reference.take_eligible(eligible, candidate_ids, batch_size)

    def num_pruned(self) -> torch.Tensor:
        """0-dim int64 tensor: prompts currently pruned (replays included), for metrics."""
        self._runtime.before_host_access(self.device)
        flags = self._state.istate[:self.num_prompts, L.FLAGS]
        return ((flags & L.FLAG_PRUNED) != 0).sum()

    def begin_epoch(self) -> None:
        """Draw this epoch's replays: each pruned prompt with probability ``replay_ratio``."""
        self._runtime.before_host_access(self.device)
        reference.draw_replays(self._state, self.config.replay_ratio, self.config.seed,
                               self.epoch)
        self.epoch += 1

    # ------------------------------------------------------------------------- rollout budget

    def allocate_rollouts(self, prompt_ids: torch.Tensor, total: int, tau: float = 0.2,
                          n_min: int = 2, n_max: int = 32, *, score: str = "energy",
                          check_inputs: bool = True) -> torch.Tensor:
        """[B] int64 rollout counts in ``[n_min, n_max]`` summing to ``total``, proportional to
        ``softmax(score / tau)`` (docs/spec.md §6). ``score``: ``"energy"`` or ``"pass_rate"``."""
        validation.check_prompt_ids_structure(prompt_ids, self.device)
        if check_inputs:
            validation.check_prompt_id_values(prompt_ids, self.num_prompts, distinct=False)
        validation.check_rollout_budget(prompt_ids.shape[0], total, tau, n_min, n_max)
        self._runtime.before_host_access(self.device)
        scores = reference.allocation_scores(self._state, prompt_ids, score)
        return reference.allocate_rollouts(scores, total, tau, n_min, n_max)

    # ------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Everything needed to resume: the state tables, the step counter (which keys the
        noise stream), the epoch (which keys replay draws) and the config."""
        n = self.num_prompts
        contiguous = dict(memory_format=torch.contiguous_format)
        self._runtime.before_host_access(self.device)
        return {
            "format": _FORMAT,
            "num_prompts": n,
            "config": self.config.to_dict(),
            # The records' two halves, as the two tables of earlier versions (the same format
            # both ways: files written before the one-record layout load, and these load there).
            "fstate": self._state.fstate[:n].clone(**contiguous),
            "istate": self._state.istate[:n].clone(**contiguous),
            "step_counter": self._state.step_counter.clone(),
            "fault": self._state.fault.clone(),
            "epoch": self.epoch,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`. Everything is checked before anything is written; the
        steps queued so far run first (one host sync: they write the fault word's host copy)."""
        n = self.num_prompts
        _check_state_dict(state_dict, n, self.config)
        with self._lock:
            self._runtime.synchronize(self.device)
            self._state.fstate[:n].copy_(state_dict["fstate"])
            self._state.istate[:n].copy_(state_dict["istate"])
            self._state.step_counter.copy_(state_dict["step_counter"])
            self._state.fault.copy_(state_dict["fault"])
            self._faults.set(int(state_dict["fault"][0]))  # as the next step would copy it
            self.epoch = state_dict["epoch"]


def _check_time(check_inputs: Optional[bool], host_runtime, device) -> str:
    """When a step's value faults raise: "now" (a host sync), "later" (a later step, no sync:
    the default where launches are asynchronous, a GPU, and in a graph capture) or "off"."""
    if check_inputs is None:
        deferred = host_runtime.asynchronous or host_runtime.capturing(device)
        return "later" if deferred else "now"
    if not isinstance(check_inputs, bool):
        raise ValueError(f"check_inputs: expected True, False or None, got {check_inputs!r}")
    return "now" if check_inputs else "off"


def _check_state_dict(sd: dict, num_prompts: int, config: LZEConfig) -> None:
    if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
        raise ValueError(f"state_dict: expected a dict with format {_FORMAT!r}")
    if sd.get("num_prompts") != num_prompts:
        raise ValueError(f"state_dict: expected num_prompts {num_prompts}, "
                         f"got {sd.get('num_prompts')!r}")
    if LZEConfig.from_dict(sd["config"]) != config:
        raise ValueError("state_dict: its config differs from this selector's "
                         f"({sd['config']} vs {config.to_dict()})")
    expected = {
        "fstate": ((num_prompts, L.NUM_FIELDS), torch.float32),
        "istate": ((num_prompts, L.NUM_FIELDS), torch.int32),
        "step_counter": ((2,), torch.int64),
        "fault": ((1,), torch.int32),
    }
    for key, (shape, dtype) in expected.items():
        t = sd.get(key)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"state_dict[{key!r}]: expected a {dtype} tensor of shape {shape}")
    if not isinstance(sd.get("epoch"), int) or sd["epoch"] < 0:
        raise ValueError("state_dict['epoch']: expected an int >= 0")

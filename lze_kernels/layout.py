"""Memory layout of the selector state and the scalar parameters every backend receives.

Mirrors ``csrc/lze_math.h`` field for field; ``tests/test_layout.py`` keeps the two in step.
The per-prompt state is two row-major tables of four 32-bit fields each, so that on a GPU the
random gather of one prompt's state is a single aligned 16-byte load per table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fstate [N, 4] float32
D_INIT, EMA, LAST_PASS_RATE, LAST_ENERGY = range(4)
# istate [N, 4] int32
SEEN, SOLVED_STREAK, FLAGS, CLAIM = range(4)
NUM_FIELDS = 4

FLAG_PRUNED = 1
FLAG_REPLAY = 2

FAULT_ID_OUT_OF_RANGE = 1
FAULT_DUPLICATE_ID = 2
FAULT_NONFINITE_REWARD = 4
FAULT_REWARD_OUT_OF_RANGE = 8

# Templates: {num_prompts} is filled in where the state is known.
FAULT_MESSAGES = {
    FAULT_ID_OUT_OF_RANGE: "prompt_ids: expected every id in [0, {num_prompts})",
    FAULT_DUPLICATE_ID: "prompt_ids: expected distinct ids within one step",
    FAULT_NONFINITE_REWARD: "rewards: expected finite values (found NaN or inf)",
    FAULT_REWARD_OUT_OF_RANGE: "rewards: expected values in [0, 1]",
}

REWARD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Rounded to fp32 where it is compared; equals the kernels' 1.0f - 1e-6f (docs/spec.md §5).
SOLVED_THRESHOLD = 1.0 - 1e-6
UNSET_D_INIT = -1.0


@dataclass(frozen=True)
class KernelParams:
    """Scalar parameters of the fused step, as the kernels see them.

    ``one_minus_beta`` is computed here in double precision and rounded to fp32 once by every
    backend, exactly as torch rounds a Python scalar multiplied with a float32 tensor.
    """

    beta: float
    one_minus_beta: float
    d_min: float
    alpha: float
    eps: float
    norm_by_std: bool
    prune_after: int

    @classmethod
    def from_config(cls, config) -> "KernelParams":
        return cls(
            beta=config.beta,
            one_minus_beta=1.0 - config.beta,
            d_min=config.d_min,
            alpha=config.alpha,
            eps=config.eps,
            norm_by_std=config.norm_by_std,
            prune_after=config.prune_after,
        )


@dataclass
class SelectorState:
    """Device-resident state of a selector; every field is a tensor that lives for the run.

    ``step_counter[0]`` counts completed steps (the noise stream of step t is keyed by it);
    ``step_counter[1]`` is scratch the GPU kernels use to elect the last program of a launch and
    is 0 between calls. ``fault`` holds the fault bits of rows skipped since the last check.
    """

    fstate: torch.Tensor
    istate: torch.Tensor
    step_counter: torch.Tensor
    fault: torch.Tensor

    @classmethod
    def empty(cls, num_prompts: int, device) -> "SelectorState":
        # One row past the prompts: a write sink for skipped rows of the torch reference (which
        # scatters every batch row, masked ones to row N). Kernels never touch it.
        rows = num_prompts + 1
        fstate = torch.zeros(rows, NUM_FIELDS, dtype=torch.float32, device=device)
        fstate[:, D_INIT] = UNSET_D_INIT
        return cls(
            fstate=fstate,
            istate=torch.zeros(rows, NUM_FIELDS, dtype=torch.int32, device=device),
            step_counter=torch.zeros(2, dtype=torch.int64, device=device),
            fault=torch.zeros(1, dtype=torch.int32, device=device),
        )

    @property
    def num_prompts(self) -> int:
        return self.fstate.shape[0] - 1

    def rows_of(self, prompt_ids: torch.Tensor) -> "StateRows":
        """A copy of the state rows a step over ``prompt_ids`` may write (ids outside [0, N)
        read the spare row N, which the torch reference writes for them), so that
        :meth:`restore` can undo the step. Three launches, no sync."""
        ids = prompt_ids.clamp(0, self.num_prompts)
        return StateRows(ids, self.fstate.index_select(0, ids), self.istate.index_select(0, ids))

    def restore(self, rows: "StateRows") -> None:
        """Undo the one step taken since :meth:`rows_of`: its state rows, and the step counter,
        which every step advances by one."""
        self.fstate.index_copy_(0, rows.ids, rows.fstate)
        self.istate.index_copy_(0, rows.ids, rows.istate)
        self.step_counter[0] -= 1


@dataclass(frozen=True)
class StateRows:
    """State rows copied before a step (:meth:`SelectorState.rows_of`)."""

    ids: torch.Tensor  # [B] int64 rows of the tables, in [0, N]
    fstate: torch.Tensor  # [B, 4] float32
    istate: torch.Tensor  # [B, 4] int32

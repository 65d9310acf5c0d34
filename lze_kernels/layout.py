"""Memory layout of the selector state and the scalar parameters every backend receives.

Mirrors ``csrc/lze_math.h`` field for field; ``tests/test_layout.py`` keeps the two in step.
The per-prompt state is one table of 32-byte records ``[N + 1, 8]`` int32: a prompt's four fp32
fields (``fstate``, a view) then its four int32 fields (``istate``, a view). On a GPU a prompt's
state is then one 32-byte sector: the random gather, the claim and the scatter of a row touch
one sector, where two tables touched two (four random sector accesses a row instead of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fstate [N, 4] float32: words 0-3 of a record
D_INIT, EMA, LAST_PASS_RATE, LAST_ENERGY = range(4)
# istate [N, 4] int32: words 4-7 of a record
SEEN, SOLVED_STREAK, FLAGS, CLAIM = range(4)
NUM_FIELDS = 4
RECORD_WORDS = 2 * NUM_FIELDS  # 32 bytes

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

    ``records [N + 1, 8]`` int32 holds one 32-byte record per prompt; ``fstate`` and ``istate``
    are its float and int halves as ``[N + 1, 4]`` views (reads and in-place writes through them
    change the records). ``step_counter[0]`` counts completed steps (the noise stream of step t is
    keyed by it); ``step_counter[1]`` is scratch the GPU kernels use to elect the last program of
    a launch and is 0 between calls. ``fault`` holds the fault bits of rows skipped since the
    last check.
    """

    records: torch.Tensor
    step_counter: torch.Tensor
    fault: torch.Tensor

    @classmethod
    def empty(cls, num_prompts: int, device) -> "SelectorState":
        # One row past the prompts: a write sink for skipped rows of the torch reference (which
        # scatters every batch row, masked ones to row N). Kernels never touch it.
        records = torch.zeros(num_prompts + 1, RECORD_WORDS, dtype=torch.int32, device=device)
        state = cls(records=records,
                    step_counter=torch.zeros(2, dtype=torch.int64, device=device),
                    fault=torch.zeros(1, dtype=torch.int32, device=device))
        state.fstate[:, D_INIT] = UNSET_D_INIT
        return state

    @property
    def fstate(self) -> torch.Tensor:
        """``[N + 1, 4]`` float32 view of the records' float fields (D_INIT, EMA, ...)."""
        return self.records[:, :NUM_FIELDS].view(torch.float32)

    @property
    def istate(self) -> torch.Tensor:
        """``[N + 1, 4]`` int32 view of the records' int fields (SEEN, ..., CLAIM)."""
        return self.records[:, NUM_FIELDS:]

    @property
    def num_prompts(self) -> int:
        return self.records.shape[0] - 1

    def rows_of(self, prompt_ids: torch.Tensor) -> "StateRows":
        """A copy of the records a step over ``prompt_ids`` may write (ids outside [0, N) read
        the spare row N, or row 0, which the torch reference writes for them), so that
        :meth:`restore` can undo the step. Two launches, no sync."""
        ids = prompt_ids.clamp(0, self.num_prompts)
        return StateRows(ids, self.records.index_select(0, ids))

    def restore(self, rows: "StateRows") -> None:
        """Undo the one step taken since :meth:`rows_of`: its records, and the step counter,
        which every step advances by one."""
        self.records.index_copy_(0, rows.ids, rows.records)
        self.step_counter[0] -= 1


@dataclass(frozen=True)
class StateRows:
    """State records copied before a step (:meth:`SelectorState.rows_of`)."""

    ids: torch.Tensor  # [B] int64 rows of the table, in [0, N]
    records: torch.Tensor  # [B, 8] int32

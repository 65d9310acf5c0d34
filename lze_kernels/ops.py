"""Building blocks for users who keep their own training loop.

Each function is sync-free and returns fixed-shape tensors. ``lze_update`` and ``topk_mask`` run
on a backend (``"auto"`` picks the fused kernels of the device); the others are PyTorch. DOTS (SPEC 8, :mod:`lze_kernels.dots`): ``predict_pass_rates`` runs on a
backend too; ``calibrate_linear``, ``apply_calibration`` and ``sample_near_half`` are PyTorch.

Example (inside a verl/TRL advantage hook)::

    state = ops.new_state(num_prompts, device)
    stats = ops.lze_update(rewards, prompt_ids, state)          # advantages, energy, ...
    sel = ops.topk_mask(stats.energy, k=ops.num_keep(B, 0.4))   # keep_mask, kept_indices
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch, reference, validation
from .config import LZEConfig, num_keep
from .dots import apply_calibration, calibrate_linear, predict_pass_rates, sample_near_half
from .layout import KernelParams, SelectorState
from .reference import GroupStats, Selection, StepStats, dapo_keep_mask, group_stats

__all__ = [
    "GroupStats", "Selection", "StepStats", "new_state", "group_stats", "grpo_advantages",
    "lze_update", "topk_mask", "dapo_keep_mask", "allocate_rollouts", "num_keep",
    "predict_pass_rates", "calibrate_linear", "apply_calibration", "sample_near_half",
]


def new_state(num_prompts: int, device="cpu") -> SelectorState:
    """Fresh per-prompt state for ``num_prompts`` prompts on ``device``."""
    return SelectorState.empty(num_prompts, torch.device(device))


def grpo_advantages(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None,
                    eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """[B, G] GRPO per-sequence advantages ``(r - mean) / (std + eps)`` over the valid rollouts of
    each row (SPEC 2: verl semantics, unbiased std), or ``r - mean`` with ``norm_by_std=False``.

    One difference from verl: a row with a single valid rollout gets ``A = 0`` here, where
    verl's ``compute_grpo_outcome_advantage`` (mean 0, std 1 for a group of one) gives
    ``A = r / (1 + eps)``. Rows without valid rollouts and invalid entries get 0."""
    return reference.grpo_advantages(group_stats(rewards, valid), eps, norm_by_std)


def lze_update(rewards: torch.Tensor, prompt_ids: torch.Tensor, state: SelectorState,
               valid: Optional[torch.Tensor] = None, config: Optional[LZEConfig] = None,
               backend: str = "auto") -> StepStats:
    """Fused group statistics, advantages, energy and state update (SPEC 2, 3, 5); one launch.

    No value checks: bad rows are skipped and recorded in ``state.fault``."""
    params = KernelParams.from_config(config or LZEConfig())
    return dispatch.resolve(backend, rewards.device).step(
        rewards, valid, prompt_ids, state, params
    )


def topk_mask(energy: torch.Tensor, k: int, noise_scale: float = 0.0, seed: int = 0,
              step: Optional[torch.Tensor] = None, backend: str = "auto") -> Selection:
    """Fixed-shape top-k of groups by energy (SPEC 4); groups with E = 0 never fill the quota.

    ``step`` is an int64 tensor whose first element keys the noise stream with ``seed``
    (e.g. ``state.step_counter``); default 0."""
    if not isinstance(k, int) or not 1 <= k <= energy.shape[0]:
        raise ValueError(f"k: expected an int in [1, {energy.shape[0]}], got {k!r}")
    if step is None:
        step = torch.zeros(1, dtype=torch.int64, device=energy.device)
    return dispatch.resolve(backend, energy.device).topk(energy, k, noise_scale, seed, step)


def allocate_rollouts(scores: torch.Tensor, total: int, tau: float = 0.2, n_min: int = 2,
                      n_max: int = 32) -> torch.Tensor:
    """[B] int64 rollout counts in [n_min, n_max] summing to ``total``, by largest remainder
    of ``total * softmax(scores / tau)`` under the bounds (SPEC 6)."""
    validation.check_rollout_budget(scores.shape[0], total, tau, n_min, n_max)
    return reference.allocate_rollouts(scores, total, tau, n_min, n_max)

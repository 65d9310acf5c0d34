"""Building blocks for users who keep their own training loop.

Each function is sync-free and returns fixed-shape tensors. ``lze_update`` and ``topk_mask`` run
on a backend (``"auto"`` picks the fused kernels of the device); the others are PyTorch. DOTS
(docs/spec.md §8, :mod:`lze_kernels.dots`): ``predict_pass_rates`` runs on a backend too;
``calibrate_linear``, ``apply_calibration`` and ``sample_near_half`` are PyTorch.

Every op checks its arguments' structure before anything runs (dtype, shape, device agreement
with the state, contiguity of the state, sizes and index ranges known on the host) and raises a
``ValueError`` naming the argument, with the state unchanged; these checks read metadata only and
never synchronise. What only the device knows (a prompt id past the state, a duplicate id, a NaN
reward or one outside [0, 1]) is not checked on the host: ``lze_update`` skips such rows on the
device and records fault bits in ``state.fault``, which :func:`raise_if_faulted` (one sync) turns
into the same ``ValueError``. docs/kernels.md, "Public ops: checks and device faults".

Example (inside a verl/TRL advantage hook)::

    state = ops.new_state(num_prompts, device)
    stats = ops.lze_update(rewards, prompt_ids, state)          # advantages, energy, ...
    sel = ops.topk_mask(stats.energy, k=ops.num_keep(B, 0.4))   # keep_mask, kept_indices
    ops.raise_if_faulted(state)                                 # now and then: syncs once
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch, reference, validation
from .config import LZEConfig, num_keep
from .dots import apply_calibration, calibrate_linear, predict_pass_rates, sample_near_half
from .layout import KernelParams, SelectorState
from .reference import GroupStats, Selection, StepStats
from .validation import raise_if_faulted

__all__ = [
    "GroupStats", "Selection", "StepStats", "new_state", "group_stats", "grpo_advantages",
    "lze_update", "raise_if_faulted", "topk_mask", "dapo_keep_mask",
    "allocate_rollouts_by_score", "num_keep", "predict_pass_rates", "calibrate_linear",
    "apply_calibration", "sample_near_half",
]


def new_state(num_prompts: int, device="cpu") -> SelectorState:
    """Fresh per-prompt state for ``num_prompts`` prompts on ``device``."""
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
    return SelectorState.empty(num_prompts, torch.device(device))


def group_stats(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None) -> GroupStats:
    """Count, mean and unbiased std of the valid rewards of each row of ``rewards [B, G]``
    (any float dtype; ``valid [B, G]`` bool on the same device), accumulated in fp32."""
    validation.check_rewards_structure(rewards, valid, None)
    return reference.group_stats(rewards, valid)


def grpo_advantages(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None,
                    eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """[B, G] GRPO per-sequence advantages ``(r - mean) / (std + eps)`` over the valid rollouts of
    each row (docs/spec.md §2: verl semantics, unbiased std), or ``r - mean`` with
    ``norm_by_std=False``.

    One difference from verl: a row with a single valid rollout gets ``A = 0`` here, where
    verl's ``compute_grpo_outcome_advantage`` (mean 0, std 1 for a group of one) gives
    ``A = r / (1 + eps)``. Rows without valid rollouts and invalid entries get 0."""
    validation.check_positive_float("eps", eps)
    return reference.grpo_advantages(group_stats(rewards, valid), eps, norm_by_std)


def dapo_keep_mask(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B] bool: DAPO dynamic sampling (Yu et al., 2025), rows whose valid rewards are not all
    equal. ``rewards [B, G]`` any float dtype and range, ``valid [B, G]`` bool."""
    validation.check_rewards_structure(rewards, valid, None)
    return reference.dapo_keep_mask(rewards, valid)


def lze_update(rewards: torch.Tensor, prompt_ids: torch.Tensor, state: SelectorState,
               valid: Optional[torch.Tensor] = None, config: Optional[LZEConfig] = None,
               backend: str = "auto") -> StepStats:
    """Fused group statistics, advantages, energy and state update (docs/spec.md §2, 3, 5); one
    launch.

    ``rewards [B, G]`` fp32, bf16 or fp16, ``prompt_ids [B]`` int64 (B <= N), ``valid [B, G]``
    bool, all on the device of ``state`` (:func:`new_state`). Their structure is checked here
    (``ValueError`` naming the argument, state unchanged); their values are not: a row with an
    id outside [0, N), a duplicate id, a NaN/inf reward or one outside [0, 1] is skipped on the
    device and recorded in ``state.fault``, raised by :func:`raise_if_faulted`."""
    validation.check_state(state)
    validation.check_step_structure(rewards, prompt_ids, valid, state.fstate.device,
                                    state.num_prompts)
    if config is not None and not isinstance(config, LZEConfig):
        raise ValueError(f"config: expected an LZEConfig, got {type(config).__name__}")
    params = KernelParams.from_config(config or LZEConfig())
    return dispatch.resolve(backend, rewards.device).step(
        rewards, valid, prompt_ids, state, params
    )


def topk_mask(energy: torch.Tensor, k: int, noise_scale: float = 0.0, seed: int = 0,
              step: Optional[torch.Tensor] = None, backend: str = "auto",
              sorted: bool = False) -> Selection:
    """Fixed-shape top-k of groups by energy (docs/spec.md §4); groups with E = 0 never fill
    the quota.

    ``energy [B]`` fp32 (``lze_update``'s), ``k`` in [1, B], ``noise_scale >= 0``, ``seed`` in
    [0, 2**32). ``step`` is an int64 tensor on ``energy``'s device whose first element keys the
    noise stream with ``seed`` (e.g. ``state.step_counter``); default 0. ``kept_indices`` lists
    the kept groups in ascending batch position, or by descending score with ``sorted=True``
    (O(B) more work and a sort of k keys)."""
    validation.check_topk(energy, k, noise_scale, seed, step)
    if step is None:
        step = torch.zeros(1, dtype=torch.int64, device=energy.device)
    selection = dispatch.resolve(backend, energy.device).topk(energy, k, noise_scale, seed, step)
    if sorted:
        selection = reference.sort_by_score(selection, energy, noise_scale, seed, step[0])
    return selection


def allocate_rollouts_by_score(scores: torch.Tensor, total: int, tau: float = 0.2,
                               n_min: int = 2, n_max: int = 32) -> torch.Tensor:
    """[B] int64 rollout counts in [n_min, n_max] summing to ``total``, by largest remainder
    of ``total * softmax(scores / tau)`` under the bounds (docs/spec.md §6).

    ``scores [B]`` are float scores (e.g. ``lze_update``'s energies); integer tensors are
    refused, since prompt ids go to :meth:`LZESelector.allocate_rollouts
    <lze_kernels.LZESelector.allocate_rollouts>`, which looks their scores up in its state."""
    validation.check_rollout_scores(scores)
    validation.check_rollout_budget(scores.shape[0], total, tau, n_min, n_max)
    return reference.allocate_rollouts(scores, total, tau, n_min, n_max)

"""What both integrations share: which whole prompt groups a step keeps, and the metrics of it.

A selection *method* decides from one step's rewards ``[B, G]`` which groups go to the actor
update: ``"lze"`` keeps the top-k groups by Learning-Zone Energy (docs/spec.md §3-4, stateful,
one fused step) and ``"dapo"`` keeps the groups whose rewards are not all equal (DAPO dynamic
sampling, Yu et al., 2025, docs/spec.md §7, stateless). Trainers drop or keep whole groups, never
single rollouts (docs/spec.md §4).
Plain GRPO (every group) is the framework's own trainer (TRL's ``GRPOTrainer``, verl's ``grpo``
estimator), so neither integration has a method for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import layout as L
from .. import ops, validation
from ..selector import LZESelector, StepOutput

METHODS = ("lze", "dapo")

ScoreFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class GroupSelection:
    """The groups one step keeps; every tensor is on the rewards' device."""

    prompt_ids: torch.Tensor  # [B] int64 dataset rows
    keep: torch.Tensor  # [B] bool
    num_kept: torch.Tensor  # 0-dim int64
    step: Optional[StepOutput] = None  # the selector's full output (method "lze")


def check_method(method: str, name: str = "method") -> str:
    """``method``, if it is one of :data:`METHODS`; else a ``ValueError`` naming ``name``."""
    if method not in METHODS:
        raise ValueError(f"{name}: expected one of {METHODS}, got {method!r}")
    return method


def select_groups(method: str, selector: Optional[LZESelector], rewards: torch.Tensor,
                  prompt_ids: torch.Tensor, valid: Optional[torch.Tensor],
                  score_fn: Optional[ScoreFn] = None, *,
                  ids_checked: bool = False) -> GroupSelection:
    """Apply ``method`` to ``rewards`` [B, G] (``valid`` [B, G] marks the scored rollouts; None:
    all are).

    ``"lze"`` maps the rewards by :func:`unit_scores`, checks them and (unless the caller has,
    ``ids_checked``) the ids' range and distinctness once, then runs ``selector.step`` without
    its own value checks; ``"dapo"`` needs no selector and takes rewards of any range."""
    if method == "dapo":
        keep = ops.dapo_keep_mask(rewards, valid)
        return GroupSelection(prompt_ids, keep, keep.sum())
    rewards = unit_scores(rewards, valid, score_fn)
    if not ids_checked:
        validation.check_prompt_id_values(prompt_ids, selector.num_prompts, distinct=True)
    if valid is not None:
        rewards = torch.where(valid, rewards, 0.0)  # unscored entries may hold NaN
    out = selector.step(rewards.float(), prompt_ids, valid, check_inputs=False)
    return GroupSelection(prompt_ids, out.keep_mask, out.num_kept, out)


def unit_scores(rewards: torch.Tensor, valid: Optional[torch.Tensor],
                score_fn: Optional[ScoreFn]) -> torch.Tensor:
    """Rewards mapped by ``score_fn`` (default: unchanged; it gets and returns a 1-D tensor) for
    LZE's pass rate, checked to lie in [0, 1] on the valid entries (all when ``valid`` is None):
    NaN and inf fail too. One host sync."""
    scores = rewards if score_fn is None else score_fn(rewards.reshape(-1))
    if not isinstance(scores, torch.Tensor) or scores.numel() != rewards.numel():
        raise ValueError(f"score_fn: expected a tensor of {rewards.numel()} scores, "
                         f"got {getattr(scores, 'shape', type(scores).__name__)}")
    scores = scores.view(rewards.shape)
    checked = scores if valid is None else torch.where(valid, scores, 0.0)
    low, high = torch.stack(torch.aminmax(checked)).tolist()  # NaN propagates
    if not (0.0 <= low and high <= 1.0):
        raise ValueError(
            f"rewards: LZE needs each completion's reward in [0, 1] (a pass rate), got values in "
            f"[{low:g}, {high:g}]. Rewards of several functions are summed: a format and an "
            f"accuracy reward in [0, 1] each sum to [0, 2]. Map them to [0, 1] with score_fn, "
            f"e.g. score_fn=lambda r: r / 2 (the mean of two rewards) or "
            f"score_fn=lambda r: (r >= 2).float() (both right), or weight them to sum to 1 "
            f"(TRL: GRPOConfig(reward_weights=[0.5, 0.5])).")
    return scores


def selection_metrics(selection: GroupSelection,
                      selector: Optional[LZESelector]) -> dict[str, float]:
    """``lze/kept_ratio`` (kept groups / B); with a selector also ``lze/energy_mean`` over the
    step's groups and ``lze/pruned``, the fraction of the dataset the forward pruner skips."""
    values = {"lze/kept_ratio": selection.num_kept.float() / selection.keep.shape[0]}
    if selection.step is not None:
        values["lze/energy_mean"] = selection.step.energy.mean()
    if selector is not None:
        flags = selector.state.istate[: selector.num_prompts, L.FLAGS]
        values["lze/pruned"] = ((flags & L.FLAG_PRUNED) != 0).float().mean()
    # One device-to-host copy per logged step (the frameworks log host floats).
    return dict(zip(values, torch.stack(list(values.values())).tolist()))

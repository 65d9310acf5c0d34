"""LZE selection as a verl advantage estimator; verl itself is imported only by ``register``.

verl's trainer calls an advantage estimator once per step with the flat batch of ``bs`` responses:
``token_level_rewards`` [bs, T], ``response_mask`` [bs, T] and ``index``, the ``uid`` of each
response's prompt (a numpy object array of strings, or a tensor), plus ``epsilon``,
``norm_adv_by_std_in_grpo`` or an algorithm ``config`` holding it. :class:`LZEAdvantage` takes
exactly that, returns verl's ``(advantages, returns)`` [bs, T] and keeps a per-response
``keep_mask`` of the whole groups the policy kept (``adapter.last``).

Group statistics, advantages, energy, the state update and the top-k run in the fused kernels on
a ``[B, G_max]`` layout. The only host work is :func:`group_by_uid`, one vectorised
``numpy.unique`` over the uids (``torch.unique`` for tensors) that numbers the groups; the rest
is tensor indexing. verl makes a fresh ``uid`` per prompt per step (``uuid4`` in ``fit``), so uids
group responses but cannot key LZE's per-prompt state: the stable id is the dataset row,
``non_tensor_batch["index"]`` (from ``extra_info["index"]`` in verl's RLHF dataset). Pass it as
``prompt_index`` or :meth:`LZEAdvantage.bind` it before verl calls the estimator (the registry
call does not forward it).

Advantages follow verl's ``compute_grpo_outcome_advantage`` (volcengine/verl,
``verl/trainer/ppo/core_algos.py``): scores ``s = token_level_rewards.sum(-1)``; per uid group of
n >= 2 responses ``(s - mean) / (std + epsilon)`` with the unbiased std, or ``s - mean`` when
``norm_adv_by_std_in_grpo`` is false (Dr. GRPO); a group of one response has mean 0 and std 1,
so ``s / (1 + epsilon)`` (resp. ``s``); the scalar is broadcast as ``A * response_mask``, and
returns equal advantages. (The kernels give a one-response group A = 0, SPEC 2; the adapter
follows verl here.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from .. import ops
from ..config import LZEConfig
from ..selector import LZESelector
from .selection import GroupSelection, ScoreFn, check_policy, select_groups, unit_scores


class UidGroups(NamedTuple):
    """Where each response sits in the ``[num_groups, width]`` group layout."""

    row: torch.Tensor  # [bs] int64 group of each response
    slot: torch.Tensor  # [bs] int64 position inside its group
    first: torch.Tensor  # [num_groups] int64 first response of each group
    width: int  # largest group size


def group_by_uid(index, device) -> UidGroups:
    """Number verl's uid groups (in sorted uid order) with one vectorised unique, then place each
    response in its group by a stable sort: no Python loop over uids or responses."""
    if isinstance(index, torch.Tensor):
        row = torch.unique(index.to(device), return_inverse=True)[1]
    else:
        row = torch.from_numpy(np.unique(np.asarray(index), return_inverse=True)[1]).to(device)
    row = row.reshape(-1).to(torch.int64)
    counts = torch.bincount(row)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(row, stable=True).indices
    slot = torch.empty_like(row)
    slot[order] = torch.arange(row.shape[0], device=device) - starts[row[order]]
    return UidGroups(row, slot, order[starts], int(counts.max()))


@dataclass
class VerlStep:
    """One estimator call: verl's outputs plus the selection."""

    advantages: torch.Tensor  # [bs, T]
    returns: torch.Tensor  # [bs, T] (= advantages, as in verl's GRPO)
    keep_mask: torch.Tensor  # [bs] bool: the response's group is kept
    groups: UidGroups
    selection: GroupSelection  # per group: dataset row, keep, num_kept, selector output


class LZEAdvantage:
    """verl advantage estimator with LZE (or DAPO) group selection.

    Args:
        num_prompts: dataset size N (``policy="lze"``; dataset rows index its state).
        config: the selector's :class:`~lze_kernels.LZEConfig`.
        policy: ``"lze"`` or ``"dapo"`` (keep groups whose scores are not all equal).
        device: where the selector state lives and the kernels run; results come back on the
            device of ``token_level_rewards``.
        backend: the selector's kernel backend.
        score_fn: maps the [bs] response scores to [0, 1] for LZE's pass rate (default: as is);
            advantages always use the raw scores.
    """

    def __init__(self, num_prompts: Optional[int] = None, config: Optional[LZEConfig] = None, *,
                 policy: str = "lze", device="cpu", backend: str = "auto",
                 score_fn: Optional[ScoreFn] = None):
        check_policy(policy)
        self.policy = policy
        self.device = torch.device(device)
        self.score_fn = score_fn
        self.selector: Optional[LZESelector] = None
        if policy == "lze":
            self.selector = LZESelector(num_prompts, config, self.device, backend)
        self.last: Optional[VerlStep] = None
        self._bound: Optional[torch.Tensor] = None

    def bind(self, prompt_index) -> None:
        """Dataset row of each response (e.g. ``batch.non_tensor_batch["index"]``), used by the
        next call that gets no ``prompt_index``."""
        self._bound = _as_ids(prompt_index, self.device)

    def __call__(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                 index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: Optional[bool] = None,
                 config: Any = None, prompt_index=None, **unused):
        """verl's estimator signature; returns ``(advantages, returns)``, sets :attr:`last`."""
        step = self.compute(token_level_rewards, response_mask, index, epsilon,
                            norm_adv_by_std_in_grpo, config, prompt_index)
        return step.advantages, step.returns

    def compute(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                epsilon: float = 1e-6, norm_adv_by_std_in_grpo: Optional[bool] = None,
                config: Any = None, prompt_index=None) -> VerlStep:
        """Like ``__call__`` but returns everything (:class:`VerlStep`)."""
        _check_token_tensors(token_level_rewards, response_mask)
        norm = _norm_by_std(norm_adv_by_std_in_grpo, config)
        out_device, rewards_dtype = token_level_rewards.device, token_level_rewards.dtype
        scores = token_level_rewards.sum(dim=-1).to(self.device)
        groups = group_by_uid(index, self.device)
        if groups.row.shape[0] != scores.shape[0]:
            raise ValueError(f"index: expected {scores.shape[0]} uids (one per response), "
                             f"got {groups.row.shape[0]}")
        num_groups = groups.first.shape[0]
        valid = self._layout(torch.ones_like(scores, dtype=torch.bool), groups, num_groups)
        raw = self._layout(scores, groups, num_groups)
        prompt_ids = self._group_prompt_ids(prompt_index, groups)

        selection = select_groups(self.policy, self.selector, self._policy_scores(raw, valid),
                                  prompt_ids, valid)
        advantages = self._advantages(raw, valid, selection, epsilon, norm)
        per_response = advantages[groups.row, groups.slot].to(out_device, rewards_dtype)
        advantages = per_response.unsqueeze(-1) * response_mask
        keep_mask = selection.keep[groups.row].to(out_device)
        self.last = VerlStep(advantages, advantages, keep_mask, groups, selection)
        return self.last

    def register(self, name: str = "lze_grpo") -> None:
        """Make this estimator selectable as ``algorithm.adv_estimator=<name>`` in verl."""
        from verl.trainer.ppo.core_algos import register_adv_est

        register_adv_est(name)(self)

    def state_dict(self) -> dict:
        return {} if self.selector is None else {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.selector is not None:
            self.selector.load_state_dict(state["selector"])

    # ------------------------------------------------------------------------- internals

    @staticmethod
    def _layout(values: torch.Tensor, groups: UidGroups, num_groups: int) -> torch.Tensor:
        """[bs] per-response values -> [num_groups, width], zero-padded."""
        out = values.new_zeros(num_groups, groups.width)
        out[groups.row, groups.slot] = values
        return out

    def _group_prompt_ids(self, prompt_index, groups: UidGroups) -> torch.Tensor:
        """[num_groups] dataset rows; the first response's row, checked for the whole group."""
        ids = self._bound if prompt_index is None else _as_ids(prompt_index, self.device)
        self._bound = None
        if ids is None:
            if self.policy == "dapo":  # stateless: the ids are only reported
                return torch.full_like(groups.first, -1)
            raise ValueError("prompt_index: LZE needs each response's dataset row (verl: "
                             "non_tensor_batch['index']); pass it or call bind() first")
        if ids.shape != groups.row.shape:
            raise ValueError(f"prompt_index: expected {groups.row.shape[0]} dataset rows (one "
                             f"per response), got shape {tuple(ids.shape)}")
        group_ids = ids[groups.first]
        if bool((ids != group_ids[groups.row]).any()):
            raise ValueError("prompt_index: responses of one uid carry different dataset rows")
        return group_ids

    def _policy_scores(self, raw: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return raw if self.policy == "dapo" else unit_scores(raw, valid, self.score_fn)

    def _advantages(self, raw: torch.Tensor, valid: torch.Tensor, selection: GroupSelection,
                    epsilon: float, norm: bool) -> torch.Tensor:
        """[num_groups, width] verl GRPO advantages; the fused step's when it saw the same
        rewards and constants, else one vectorised pass."""
        step = selection.step
        same = (step is not None and self.score_fn is None
                and self.selector.config == replace(self.selector.config, eps=epsilon,
                                                    norm_by_std=norm))
        advantages = step.advantages if same else ops.grpo_advantages(raw, valid, epsilon, norm)
        # verl: a one-response group has mean 0 and std 1.
        single = valid.sum(dim=1, keepdim=True) == 1
        return torch.where(single & valid, raw / (1.0 + epsilon) if norm else raw, advantages)


def _as_ids(values, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.int64).reshape(-1)
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device).reshape(-1)


def _check_token_tensors(token_level_rewards, response_mask) -> None:
    for name, value in (("token_level_rewards", token_level_rewards),
                        ("response_mask", response_mask)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise ValueError(f"{name}: expected a [bs, response_length] tensor, got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(f"response_mask: expected shape {tuple(token_level_rewards.shape)} like "
                         f"token_level_rewards, got {tuple(response_mask.shape)}")


def _norm_by_std(explicit: Optional[bool], config: Any) -> bool:
    """verl passes ``norm_adv_by_std_in_grpo`` directly (its GRPO branch) or inside the algorithm
    config (the registry branch); default True as in verl."""
    if explicit is not None:
        return bool(explicit)
    if config is None:
        return True
    if isinstance(config, dict):
        return bool(config.get("norm_adv_by_std_in_grpo", True))
    return bool(getattr(config, "norm_adv_by_std_in_grpo", True))

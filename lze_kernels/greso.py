"""GRESO's pre-rollout filter on the device: skip prompts whose groups were zero-variance epoch
after epoch (Zheng et al. 2025, "Act Only When It Pays: Efficient Reinforcement Learning for LLM
Reasoning via Selective Rollouts", arXiv 2506.02177, Algorithm 1).

Per prompt the filter keeps a *streak* ``z``: how many times in a row (one observation per epoch)
its whole group was all right (kind *easy*) or all wrong (kind *hard*). Before rollout a prompt
with ``z > 0`` is kept with probability ``max(p_kind ** z, p_floor)`` (``p_floor = 0.01``), i.e.
skipped with ``1 - max(p ** z, 0.01)``; a prompt never seen or last seen with mixed rewards is
always kept. After each step the two exploration probabilities move toward a target share of
zero-variance groups among those generated (default 25 %, a third of it all-right):
``p_kind <- clamp(p_kind + delta, 0.05, 0.95)`` if the step's share of that kind is below its
target, else ``p_kind - delta``.

Everything is fixed-shape tensor work on the state's device with no host synchronisation: the
skip draw is Philox keyed by (seed, step) with the prompt id as counter (reproducible on any
device, like the pruner's replay draw), and the adaptation reads the step's shares as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import reference, validation

EASY, HARD = 1, 2  # kinds of a streak (0: none)
P_FLOOR = 0.01  # keep probability never below this (GRESO's minimum exploration)
P_MIN, P_MAX = 0.05, 0.95  # clamp of the adapted exploration probabilities
_STREAM = 0x40000000  # Philox stream offset of the skip draws (the pruner's replays use 2^31+)
_FORMAT = "lze_kernels.greso/1"


@dataclass(frozen=True)
class GresoConfig:
    target_zero_variance: float = 0.25  # share of zero-variance groups among those generated
    easy_share: float = 1.0 / 3.0  # part of the target for all-right groups (the rest all-wrong)
    delta: float = 0.01  # change of p_easy / p_hard per step
    initial: float = 0.5  # p_easy and p_hard at start
    seed: int = 0

    def __post_init__(self):
        validation.check_unit_interval("target_zero_variance", self.target_zero_variance)
        validation.check_unit_interval("easy_share", self.easy_share)
        if not 0 <= self.delta <= 1:
            raise ValueError(f"delta: expected a float in [0, 1], got {self.delta!r}")
        if not P_MIN <= self.initial <= P_MAX:
            raise ValueError(f"initial: expected a float in [{P_MIN}, {P_MAX}], "
                             f"got {self.initial!r}")

    @property
    def targets(self) -> tuple[float, float]:
        """(all-right, all-wrong) target shares."""
        t = self.target_zero_variance
        return t * self.easy_share, t * (1.0 - self.easy_share)


class GresoFilter:
    """Streaks of ``num_prompts`` prompts and the two exploration probabilities, on ``device``."""

    def __init__(self, num_prompts: int, config: Optional[GresoConfig] = None, device="cpu"):
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
        self.config = config or GresoConfig()
        self.device = torch.empty(0, device=device).device
        self.streak = torch.zeros(num_prompts, dtype=torch.int32, device=self.device)
        self.kind = torch.zeros(num_prompts, dtype=torch.int8, device=self.device)
        # p[EASY - 1], p[HARD - 1]
        self.p = torch.full((2,), self.config.initial, dtype=torch.float32, device=self.device)
        # Built once: a tensor made from host values in observe() is a copy that syncs on CUDA.
        self.targets = torch.tensor(self.config.targets, dtype=torch.float32, device=self.device)

    @property
    def num_prompts(self) -> int:
        return self.streak.shape[0]

    def keep_probability(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[C] float32: ``max(p_kind ** streak, 0.01)``, 1 for prompts without a streak."""
        streak, kind = self.streak[prompt_ids], self.kind[prompt_ids].long()
        base = self.p[(kind - 1).clamp(min=0)]
        keep = torch.clamp(base ** streak.float(), min=P_FLOOR)
        return torch.where(streak > 0, keep, torch.ones_like(keep))

    def rollout_mask(self, prompt_ids: torch.Tensor, step: int) -> torch.Tensor:
        """[C] bool: which candidates are rolled out this step (the seeded skip draw)."""
        validation.check_prompt_ids_structure(prompt_ids, self.device)
        stream = torch.full((), _STREAM + step, dtype=torch.int64, device=self.device)
        u = reference.uniform_from_bits(reference.philox_4x32_10(self.config.seed, stream,
                                                                 prompt_ids))
        return u < self.keep_probability(prompt_ids)

    def observe(self, prompt_ids: torch.Tensor, rewards: torch.Tensor,
                valid: torch.Tensor, adapt: bool = True) -> None:
        """Update the streaks of the step's prompts ([B] distinct ids, [B, G] binary rewards and
        validity; rows without responses keep their state) and, if ``adapt``, move ``p`` toward
        the targets by the step's zero-variance shares among the groups generated (the official
        code adapts only from the second epoch on: ``adapt=False`` in the first)."""
        if valid is None:
            raise ValueError("valid: expected a [B, G] bool tensor, got None")
        validation.check_rewards_structure(rewards, valid, self.device)
        validation.check_prompt_ids_structure(prompt_ids, self.device, rewards.shape[0])
        responded = valid.any(dim=1)
        all_right = responded & torch.where(valid, rewards >= 1, True).all(dim=1)
        all_wrong = responded & torch.where(valid, rewards <= 0, True).all(dim=1)
        kind = torch.where(all_right, EASY, torch.where(all_wrong, HARD, 0)).to(torch.int8)
        old_kind, old_streak = self.kind[prompt_ids], self.streak[prompt_ids]
        streak = torch.where(kind == 0, 0, torch.where(kind == old_kind, old_streak + 1, 1))
        self.streak[prompt_ids] = torch.where(responded, streak.to(torch.int32), old_streak)
        self.kind[prompt_ids] = torch.where(responded, kind, old_kind)
        if not adapt:
            return
        generated = responded.sum().clamp(min=1).float()
        shares = torch.stack([all_right.sum(), all_wrong.sum()]).float() / generated
        moved = torch.where(shares < self.targets, self.config.delta, -self.config.delta)
        any_generated = responded.any()
        self.p.copy_(torch.where(any_generated, (self.p + moved).clamp(P_MIN, P_MAX), self.p))

    def state_dict(self) -> dict:
        return {"format": _FORMAT, "streak": self.streak.clone(), "kind": self.kind.clone(),
                "p": self.p.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; everything is checked before anything is written."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"state_dict: expected a dict with format {_FORMAT!r}")
        expected = {"streak": ((self.num_prompts,), torch.int32),
                    "kind": ((self.num_prompts,), torch.int8), "p": ((2,), torch.float32)}
        for key, (shape, dtype) in expected.items():
            t = state.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"state_dict[{key!r}]: expected a {dtype} tensor of shape {shape}")
        self.streak.copy_(state["streak"])
        self.kind.copy_(state["kind"])
        self.p.copy_(state["p"])

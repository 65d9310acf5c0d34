"""The LZE selector state every selection method shares (:mod:`lze_trainer.methods`).

Every rank runs the same :class:`lze_kernels.LZESelector` on the same all-gathered rewards, so all
ranks hold identical selector state without any broadcast. The selector always runs, whatever
``selection.method`` is: it gives the GRPO advantages (docs/spec.md §2) and keeps each prompt's history
(anchor, EMA, solved streak) current, so switching method, warm-up steps and the forward pruner
all see the same state. Which groups reach the update is the method's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lze_kernels import LZEConfig, LZESelector


@dataclass
class Selection:
    advantages: torch.Tensor  # [B, G] per-sequence GRPO advantages
    keep_mask: torch.Tensor  # [B] bool: groups that reach the update
    energy: torch.Tensor  # [B]
    pass_rate: torch.Tensor  # [B]


def candidates_per_step(prune: bool, candidate_factor: float, batch_size: int) -> int:
    """Prompts to draw per step: B, or more when the pruner may skip some."""
    return math.ceil(batch_size * candidate_factor) if prune else batch_size


class GroupSelector:
    def __init__(self, cfg, num_prompts: int, device: torch.device):
        s = cfg.selection
        self.prune = s.prune
        self.candidate_factor = s.candidate_factor
        self.lze = LZESelector(num_prompts, LZEConfig(
            keep_ratio=s.keep_ratio, noise_scale=s.noise_scale, seed=cfg.trainer.seed % 2**32,
            beta=s.beta, d_min=s.d_min, alpha=s.alpha, norm_by_std=cfg.actor.norm_adv_by_std,
            prune_after=s.prune_after, replay_ratio=s.replay_ratio,
        ), device=device, backend=s.backend)

    def num_candidates(self, batch_size: int) -> int:
        return candidates_per_step(self.prune, self.candidate_factor, batch_size)

    def choose_prompts(self, candidates: torch.Tensor, batch_size: int):
        """(prompt ids [B], whether each gets rollouts [B]): eligible candidates first (docs/spec.md §5)."""
        if not self.prune:
            return candidates[:batch_size], torch.ones(batch_size, dtype=torch.bool)
        return self.lze.take_eligible(candidates.to(self.lze.device), batch_size)

    def begin_epoch(self) -> None:
        self.lze.begin_epoch()

    def score(self, rewards: torch.Tensor, prompt_ids: torch.Tensor,
              valid: torch.Tensor) -> Selection:
        """Advantages, energies and LZE's top-k of the step's groups ([B, G] rewards of all
        ranks); updates every scored prompt's state."""
        out = self.lze.step(rewards, prompt_ids, valid, check_inputs=False)
        return Selection(out.advantages, out.keep_mask, out.energy, out.pass_rate)

    def num_pruned(self) -> int:
        """Prompts the forward pruner currently skips (replays not counted out). Syncs."""
        return int(self.lze.num_pruned())

    def raise_if_faulted(self) -> None:
        self.lze.raise_if_faulted()

    def state_dict(self) -> dict:
        return self.lze.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.lze.load_state_dict(state)

"""The host-side Python-loop baseline: one LZE selection step the way today's trainers run it.

Grouping and advantages follow verl's ``compute_grpo_outcome_advantage``: the flat per-sequence
scores are grouped by prompt id into a dict of lists, each group's mean and std come from
per-group torch ops, and the advantages are written back one sequence at a time. The LZE part
follows the public release: pass rates read with one ``.item()`` per prompt, the per-prompt state
in a Python dict, energies in Python floats and the top-k by a Python sort.

It computes what :meth:`lze_kernels.LZESelector.step` computes (docs/spec.md §2-5) for the inputs the
benchmark feeds it (every rollout valid, distinct ids in range); ``tests/test_baselines.py``
checks that. The Gumbel noise is drawn with the library's counter-based generator in one
vectorised call, so both sides see the same noise and the loop is not charged for a per-row RNG.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from lze_kernels import LZEConfig
from lze_kernels.layout import SOLVED_THRESHOLD
from lze_kernels.reference import gumbel_noise


@dataclass
class PromptState:
    """What the release keeps per prompt id, in a Python dict."""

    d_init: float = -1.0
    ema: float = 0.0
    seen: int = 0
    solved_streak: int = 0
    pruned: bool = False


@dataclass
class LoopStepOutput:
    advantages: torch.Tensor  # [B, G]
    pass_rate: list
    energy: list
    momentum: list
    keep_mask: torch.Tensor  # [B] bool
    kept_indices: list  # [k], -1 padded
    num_kept: int


@dataclass
class PythonLoopSelector:
    """LZE selection with host-side Python state, one step per :meth:`step` call."""

    config: LZEConfig = field(default_factory=LZEConfig)
    state: dict = field(default_factory=lambda: defaultdict(PromptState))
    steps_done: int = 0

    def step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor) -> LoopStepOutput:
        batch, group = rewards.shape
        index = prompt_ids.repeat_interleave(group).tolist()  # verl: one uid per sequence
        scores = rewards.reshape(-1).float().clone()
        id2mean, id2std = _group_mean_std(scores, index)
        _write_advantages(scores, index, id2mean, id2std, self.config)
        self.steps_done += 1

        energy, momentum, pass_rate = [], [], []
        for pid in prompt_ids.tolist():
            p = id2mean[pid].item()
            e, m = self._update_prompt(self.state[pid], p)
            energy.append(e)
            momentum.append(m)
            pass_rate.append(p)
        kept = sorted(self._top_k(energy))  # in batch order, as LZESelector lists them
        keep_mask = [False] * batch
        for i in kept:
            keep_mask[i] = True
        k = self.config.num_keep(batch)
        return LoopStepOutput(
            advantages=scores.view(batch, group),
            pass_rate=pass_rate,
            energy=energy,
            momentum=momentum,
            keep_mask=torch.tensor(keep_mask),
            kept_indices=kept + [-1] * (k - len(kept)),
            num_kept=len(kept),
        )

    def _update_prompt(self, s: PromptState, p: float):
        """docs/spec.md §3 and §5 for one prompt: returns (energy, momentum) and updates its state."""
        cfg = self.config
        if s.seen == 0:
            s.d_init, momentum = max(1.0 - p, cfg.d_min), 0.0
            s.ema = p
        else:
            momentum = min(2.0 * abs(p - s.ema), 1.0)
            s.ema = cfg.beta * s.ema + (1.0 - cfg.beta) * p
        energy = s.d_init * (4.0 * p * (1.0 - p)) * (1.0 + cfg.alpha * momentum)
        s.seen += 1
        s.solved_streak = s.solved_streak + 1 if p >= SOLVED_THRESHOLD else 0
        s.pruned = s.solved_streak >= cfg.prune_after
        return energy, momentum

    def _top_k(self, energy: list) -> list:
        """Batch positions of the k best candidates (E > 0), best first; ties to the smaller
        position (Python's sort is stable)."""
        cfg = self.config
        candidates = [i for i, e in enumerate(energy) if e > 0.0]
        score = energy
        if cfg.noise_scale > 0 and candidates:
            spread = max(energy[i] for i in candidates) - min(energy[i] for i in candidates)
            scale = cfg.noise_scale * max(spread, 0.01)
            step = torch.tensor(self.steps_done)
            noise = gumbel_noise(cfg.seed, step, len(energy), "cpu").tolist()
            score = [e + scale * g for e, g in zip(energy, noise)]
        ranked = sorted(candidates, key=lambda i: -score[i])
        return ranked[: cfg.num_keep(len(energy))]


def _group_mean_std(scores: torch.Tensor, index: list):
    """verl: group the per-sequence scores by uid, then per-group torch mean and unbiased std."""
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for uid, group_scores in id2score.items():
        values = torch.stack(group_scores)
        id2mean[uid] = torch.mean(values)
        id2std[uid] = torch.std(values) if len(group_scores) > 1 else None
    return id2mean, id2std


def _write_advantages(scores: torch.Tensor, index: list, id2mean, id2std, cfg: LZEConfig):
    """verl: advantages written back into ``scores`` one sequence at a time (docs/spec.md §2)."""
    for i in range(scores.shape[0]):
        uid = index[i]
        if id2std[uid] is None:
            scores[i] = 0.0
        elif cfg.norm_by_std:
            scores[i] = (scores[i] - id2mean[uid]) / (id2std[uid] + cfg.eps)
        else:
            scores[i] = scores[i] - id2mean[uid]

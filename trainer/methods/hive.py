"""``selection.entropy_filter=true``: HIVE's two-stage choice of prompts before rollout (HIVE,
"Train at (the) Moving Edge", arXiv 2603.25184; seed ``004_4c68405ba23ff00f``: "1. coarse
screening with historical information: preliminary filtering using historical reward
trajectories; 2. fine pruning via online validation, using prompt entropy as a real-time proxy to
prune instances with outdated utility"; the v2 abstract: "historical reward statistics ... as a
cheap prior to filter candidate prompts"). No official code was found; the paper's method section
was not readable here, so the rule below is our reading of those sources and of a secondary note
citing its sections 2-3 ("online verification takes the upper half by current prompt entropy
within the shortlisted pool only; the median is computed from that pool"; "the history shortlist
is broad and retains exploration candidates").

1. **History (coarse).** ``ceil(selection.hive.pool_factor x B)`` candidates (at most every
   training prompt) come from the epoch sampler. Each gets a prior from its reward history, the
   learning edge of medium difficulty: ``4 p (1 - p)`` of its pass-rate EMA ``p`` (the LZE
   selector's per-prompt EMA, updated from every rollout the prompt had), and 1 for a prompt
   never rolled out (kept for exploration).
   The ``S = ceil(B / selection.hive.keep_share)`` candidates with the highest prior form the
   shortlist (ties in sampler order), so prompts whose history says solved or hopeless drop out
   first.
2. **Prompt entropy (fine).** One prefill of the current policy gives each shortlisted prompt's
   entropy ``H`` (the mean entropy of its next-token distributions over the prompt,
   :func:`prefill.mean_prompt_entropy`); the ``B`` with the highest ``H`` are rolled out, the
   top ``hive.keep_share`` of the pool (the top half by default: above the pool's median).

The batch is always full (B prompts) as long as the sampler has ``S`` prompts. The prefill's tokens
are booked as compute (``forward/entropy``). HIVE keeps no state of its own: its history is the
selector's, which is checkpointed.
"""

from __future__ import annotations

import math

import torch

from lze_kernels import layout as L

from .base import MethodContext, PromptPlan, StepBatch
from .prefill import mean_prompt_entropy, prompt_features
from ..selection import Selection


class HistoryThenEntropy:
    """Wraps a sampler-driven chooser (``grpo``, ``dapo``, ``lze``): its candidates, screened
    by reward history and then by prompt entropy (module docstring)."""

    def __init__(self, ctx: MethodContext, inner):
        self.ctx, self.inner = ctx, inner
        self.stage1_dropped = 0
        self.stage2_dropped = 0

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        s = self.ctx.cfg.selection
        pool = self.inner.candidates(min(math.ceil(s.hive.pool_factor * batch_size),
                                         self.ctx.num_prompts))
        shortlist_size = min(math.ceil(batch_size / s.hive.keep_share), len(pool))
        shortlist = shortlist_by_history(self.history_prior(pool.to(self.ctx.device)),
                                         shortlist_size)
        shortlisted = pool[shortlist.cpu()]
        entropy = prompt_features(self.ctx, shortlisted.tolist(), mean_prompt_entropy, "entropy")
        chosen = shortlisted[top_entropy(entropy, batch_size).cpu()]
        self.stage1_dropped = len(pool) - len(shortlisted)
        self.stage2_dropped = len(shortlisted) - len(chosen)
        eligible = torch.ones(len(chosen), dtype=torch.bool)
        return PromptPlan(chosen, self.inner.counts(chosen, eligible))

    def history_prior(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[n] ``4 p (1 - p)`` of each prompt's pass-rate EMA, 1 for prompts never rolled out."""
        state = self.ctx.selector.lze.state
        ema = state.fstate[prompt_ids, L.EMA].float()
        seen = state.istate[prompt_ids, L.SEEN] > 0
        return torch.where(seen, 4.0 * ema * (1.0 - ema), torch.ones_like(ema))

    def candidates(self, n: int) -> torch.Tensor:
        return self.inner.candidates(n)

    def counts(self, prompt_ids: torch.Tensor, eligible: torch.Tensor) -> list[int]:
        return self.inner.counts(prompt_ids, eligible)

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        self.inner.observe(batch, selection)

    def metrics(self) -> dict[str, float]:
        return {**self.inner.metrics(), "hive/history_dropped": float(self.stage1_dropped),
                "hive/dropped": float(self.stage2_dropped)}

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])


def shortlist_by_history(prior: torch.Tensor, n: int) -> torch.Tensor:
    """[n] indices of the ``n`` highest priors, ties in index (sampler) order."""
    return torch.sort(prior, descending=True, stable=True).indices[:n]


def top_entropy(entropy: torch.Tensor, n: int) -> torch.Tensor:
    """[n] indices of the ``n`` highest prompt entropies, ties in index order."""
    return torch.sort(entropy, descending=True, stable=True).indices[:n]

"""``selection.method=greso``: GRESO's selective rollouts (Zheng et al. 2025, "Act Only When It
Pays", arXiv 2506.02177; official code Infini-AI-Lab/GRESO at b277843) on DAPO's dynamic sampling.

Before rollout, each candidate prompt whose group was all right (or all wrong) in its last ``z``
rollouts in a row is skipped with probability ``1 - max(p_kind ** z, 0.01)``; the exploration
probabilities ``p_easy`` and ``p_hard`` move by ``selection.greso.step`` per step toward a target
share of zero-variance groups among the step's generated ones (``greso.target_zero_variance``,
split ``greso.easy_share`` all-right / the rest all-wrong), from the second epoch on, as the
official trainer does (``if epoch > 0``). The streaks, the probabilities and the seeded skip draw
live on the device in :class:`lze_kernels.greso.GresoFilter`.

The loop around the filter is the official one (:mod:`.fill`): the filter thins an unbounded
stream of candidates until the rollout batch holds ``ceil(1.5 B)`` survivors (384 for 256);
groups whose rewards are all equal never reach the update (dynamic sampling), and top-up rounds
of survivors sized by the last round's zero-variance share refill the batch with mixed groups;
every group rolled out, in every round, feeds the streaks and the step's shares.
"""

from __future__ import annotations

from typing import Optional

import torch

from lze_kernels.greso import GresoConfig, GresoFilter

from . import register
from .base import Method, MethodContext, keep_mixed
from .fill import FillingPrompts, FillRule, fill_rule, rolled_tensors


def greso_filter(ctx: MethodContext) -> GresoFilter:
    """The run's GRESO filter from the ``selection.greso`` settings (also SPEED's prefilter)."""
    s = ctx.cfg.selection
    return GresoFilter(ctx.num_prompts, GresoConfig(
        target_zero_variance=s.greso.target_zero_variance, easy_share=s.greso.easy_share,
        delta=s.greso.step, initial=s.greso.initial, seed=ctx.cfg.trainer.seed % 2**32),
        device=ctx.device)


def greso_metrics(filter: GresoFilter) -> dict[str, float]:
    p_easy, p_hard = filter.p.tolist()
    return {"greso/p_easy": p_easy, "greso/p_hard": p_hard,
            "greso/streaking_prompts": float((filter.streak > 0).sum())}


class GresoPrompts(FillingPrompts):
    """A filling chooser whose candidates pass GRESO's skip draw first (``filter=None``: they
    all do) and whose rolled-out groups feed the filter's streaks."""

    def __init__(self, ctx: MethodContext, rule: FillRule, filter: Optional[GresoFilter]):
        super().__init__(ctx, rule)
        self.filter = filter

    def draw(self, n: int, excluded: set[int]) -> list[int]:
        """The first ``n`` survivors of the sampler's stream; each candidate met is consumed
        (skipped ones too), and the stream ends when every prompt was met this step."""
        if self.filter is None:
            return super().draw(n, excluded)
        kept: list[int] = []
        while len(kept) < n and len(excluded) < self.ctx.num_prompts:
            drawn = super().draw(n - len(kept), excluded)
            if drawn:
                ids = torch.tensor(drawn, device=self.filter.device)
                keep = self.filter.rollout_mask(ids, self.step).tolist()
                kept += [pid for pid, k in zip(drawn, keep) if k]
        return kept

    def learn(self, rolled: list[tuple[int, list[float]]]) -> None:
        if self.filter is None or not rolled:
            return
        ids, rewards, valid = rolled_tensors(rolled, self.filter.device)
        first_epoch = self.ctx.sampler.epoch <= 1  # epochs started so far
        self.filter.observe(ids, rewards, valid, adapt=not first_epoch)

    def metrics(self) -> dict[str, float]:
        own = greso_metrics(self.filter) if self.filter is not None else {}
        return {**super().metrics(), **own}

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "greso": self.filter.state_dict()} if self.filter is not None else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.filter is not None:
            self.filter.load_state_dict(state["greso"])


@register("greso")
def greso_method(ctx: MethodContext) -> Method:
    chooser = GresoPrompts(ctx, fill_rule(ctx.cfg, "greso"), greso_filter(ctx))
    return Method("greso", ctx, chooser=chooser, collect=chooser.collect, keep=keep_mixed,
                  rank_state=chooser)

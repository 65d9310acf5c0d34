"""``selection.policy=greso``: GRESO's selective rollouts (Zheng et al. 2025, arXiv 2506.02177).

Before rollout, each candidate prompt whose group was all right (or all wrong) in its last
``z`` epochs in a row is skipped with probability ``1 - max(p_kind ** z, 0.01)``; the exploration
probabilities ``p_easy`` and ``p_hard`` move by ``selection.greso_step`` per step toward a target
share of zero-variance groups among the generated ones (``greso_target_zero_variance``, split
``greso_easy_share`` all-right / the rest all-wrong). The streaks, the probabilities and the
seeded skip draw live on the device in :class:`lze_kernels.greso.GresoFilter`.

A step draws ``ceil(B x selection.candidate_factor)`` candidates from the epoch order and rolls
out the first B that survive the draw, in candidate order; when fewer survive, the remaining rows
are skipped prompts with no rollouts (fixed shapes, as the forward pruner does). Every group that
is rolled out reaches the update, as in GRPO (GRESO filters before rollout only).
"""

from __future__ import annotations

import math

from lze_kernels import reference
from lze_kernels.greso import GresoConfig, GresoFilter

from . import register
from .base import Method, MethodContext, PromptPlan, SampledPrompts, StepBatch, keep_all
from ..selection import Selection


def greso_filter(ctx: MethodContext) -> GresoFilter:
    """The run's GRESO filter from the ``selection.greso_*`` settings (also SPEED's prefilter)."""
    s = ctx.cfg.selection
    return GresoFilter(ctx.num_prompts, GresoConfig(
        target_zero_variance=s.greso_target_zero_variance, easy_share=s.greso_easy_share,
        delta=s.greso_step, initial=s.greso_initial, seed=ctx.cfg.trainer.seed % 2**32),
        device=ctx.device)


def greso_metrics(filter: GresoFilter) -> dict[str, float]:
    p_easy, p_hard = filter.p.tolist()
    return {"greso/p_easy": p_easy, "greso/p_hard": p_hard,
            "greso/streaking_prompts": float((filter.streak > 0).sum())}


class GresoPrompts(SampledPrompts):
    """Candidates from the sampler, thinned by GRESO's skip draw."""

    def __init__(self, ctx: MethodContext):
        super().__init__(ctx)
        self.filter = greso_filter(ctx)

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        drawn = self.candidates(math.ceil(batch_size * self.ctx.cfg.selection.candidate_factor))
        drawn = drawn.to(self.ctx.device)
        keep = self.filter.rollout_mask(drawn, step)
        prompt_ids, eligible = reference.take_eligible(keep, drawn, batch_size)
        return PromptPlan(prompt_ids.cpu(), self.counts(prompt_ids, eligible))

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        g, device = batch.gathered, self.ctx.device
        self.filter.observe(batch.plan.prompt_ids.to(device), g.rewards.to(device),
                            g.valid.to(device))

    def metrics(self) -> dict[str, float]:
        return greso_metrics(self.filter)

    def state_dict(self) -> dict:
        return {"greso": self.filter.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.filter.load_state_dict(state["greso"])


@register("greso")
def greso_method(ctx: MethodContext) -> Method:
    return Method("greso", ctx, chooser=GresoPrompts(ctx), keep=keep_all)

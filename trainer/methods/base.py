"""The parts every selection method is made of, and the plain ones (GRPO, DAPO, LZE).

A step of the trainer asks its :class:`Method` four things, in this order:

1. ``plan(step)``: which B prompts to roll out and how many times each (*forward* selection:
   the sampler, the forward pruner, rollout allocation, DOTS, GRESO, HIVE's entropy check);
2. ``collect(plan)``: roll them out and score them on this rank's engine; DAPO, GRESO, SPEED
   and LZE's refill fill the plan here, round by round, with the groups they accept
   (:mod:`.fill`);
3. ``select(batch, step)``: GRPO advantages and which groups reach the update (*backward*
   selection: all, DAPO's non-zero variance, LZE's top-k energy);
4. ``observe(batch, selection)``: what the method learns from the step's rewards (GRESO's
   streaks, the replay buffer).

Each part is a small object, so a method is a combination: ``selection.method`` names one in the
registry (:mod:`lze_trainer.methods`), switches such as the pruner or HIVE's entropy check wrap
its chooser. Every rank builds the same method and feeds it the same all-gathered numbers, so all
ranks make the same choices without a broadcast; per-prompt state lives on the device in
:class:`lze_kernels.LZESelector` or in the method's own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from lze_kernels import ops

from ..batch import RolloutGroup
from ..data import PromptSampler
from ..generation import GatheredGroups, Generation
from ..selection import GroupSelector, Selection, candidates_per_step


@dataclass
class PromptPlan:
    """The step's prompts, the same on every rank."""

    prompt_ids: torch.Tensor  # [B] int64, host: dataset rows, distinct
    counts: list[int]  # rollouts per prompt (0: no rollout, e.g. pruned)


@dataclass
class StepBatch:
    """A step's rolled-out prompts: this rank's groups and everyone's rewards."""

    plan: PromptPlan
    groups: list[RolloutGroup]  # this rank's engine's groups (``row`` = position in the plan)
    gathered: GatheredGroups  # [B, width] on every rank
    replayed: int = 0  # the last rows were replayed from a buffer, not generated (docs/spec.md §9)

    def generated_rows(self) -> torch.Tensor:
        """[B] bool: the rows rolled out this step."""
        n = len(self.plan.counts)
        return torch.arange(n) < n - self.replayed


@dataclass
class MethodContext:
    """What a method may use: the config, the shared LZE state, the sampler and the engines."""

    cfg: object
    num_prompts: int
    device: torch.device
    selector: GroupSelector  # the LZE state (advantages, anchors, EMAs, solved streaks)
    sampler: PromptSampler  # the seeded epoch order of the training prompts
    generation: Generation  # roll out and score on this rank's engine, gather over ranks
    actor: object = None  # the policy under training (forward passes, e.g. HIVE's prefill)
    extras: dict = field(default_factory=dict)  # method-specific services (e.g. embeddings)

    @property
    def batch_size(self) -> int:
        return self.cfg.trainer.batch_size


# ====================================================================== 1. forward: prompts

class SampledPrompts:
    """The next B prompts of the epoch sampler; with the forward pruner (``selection.prune``)
    the first B eligible of ``ceil(B x candidate_factor)`` candidates (docs/spec.md §5); with rollout
    allocation (``rollout.allocation``) per-prompt counts from ``softmax(E / tau)`` (docs/spec.md §6)."""

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx

    def candidates(self, n: int) -> torch.Tensor:
        """The next ``n`` distinct prompts of the sampler; a new epoch draws the pruner's
        replays."""
        sampler, selector = self.ctx.sampler, self.ctx.selector
        epoch_before = sampler.epoch
        drawn = torch.tensor(sampler.next(n))
        if sampler.epoch != epoch_before:
            selector.begin_epoch()
        return drawn

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        s = self.ctx.cfg.selection
        drawn = self.candidates(candidates_per_step(s.prune, s.candidate_factor, batch_size))
        prompt_ids, eligible = self.ctx.selector.choose_prompts(drawn, batch_size)
        return PromptPlan(prompt_ids.cpu(), self.counts(prompt_ids, eligible))

    def counts(self, prompt_ids: torch.Tensor, eligible: torch.Tensor) -> list[int]:
        r = self.ctx.cfg.rollout
        B = prompt_ids.shape[0]
        if r.allocation:
            counts = self.ctx.selector.lze.allocate_rollouts(
                prompt_ids.to(self.ctx.device), total=B * r.n, tau=r.allocation_tau,
                n_min=r.allocation_min, n_max=r.allocation_max)
        else:
            counts = torch.full((B,), r.n, dtype=torch.int64)
        return torch.where(eligible.to(counts.device), counts, 0).tolist()

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """The chooser's own numbers for the step's metrics (read after the step)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ====================================================================== 2. rollout + reward

def generate_plan(ctx: MethodContext, plan: PromptPlan) -> list[RolloutGroup]:
    """Roll out and score this rank's slice of the plan (rows keep their plan positions)."""
    rows = ctx.generation.local_rows(len(plan.counts))
    return ctx.generation.generate_and_score(
        [int(plan.prompt_ids[i]) for i in rows], [plan.counts[i] for i in rows], "train",
        rows=rows)


# ====================================================================== 3. backward: groups

def keep_all(selection: Selection, batch: StepBatch, step: int) -> torch.Tensor:
    """Plain GRPO: every group with responses."""
    return batch_valid(batch, selection).any(dim=1)


def keep_mixed(selection: Selection, batch: StepBatch, step: int) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): groups whose rewards are not all equal."""
    rewards, valid = batch.gathered.rewards, batch.gathered.valid
    return ops.dapo_keep_mask(rewards.to(selection.keep_mask.device),
                              valid.to(selection.keep_mask.device))


def keep_top_energy(selection: Selection, batch: StepBatch, step: int) -> torch.Tensor:
    """LZE: the top ``floor(keep_ratio x B)`` groups by Learning-Zone Energy (docs/spec.md §3-4)."""
    return selection.keep_mask


def batch_valid(batch: StepBatch, selection: Selection) -> torch.Tensor:
    return batch.gathered.valid.to(selection.keep_mask.device)


GroupFilter = Callable[[Selection, StepBatch, int], torch.Tensor]


# ====================================================================== the method

class Method:
    """One selection method: a prompt chooser, a collector and a group filter (see the module
    docstring); ``name`` is its registry name."""

    def __init__(self, name: str, ctx: MethodContext, chooser=None,
                 collect: Optional[Callable[[MethodContext, PromptPlan], list]] = None,
                 keep: GroupFilter = keep_top_energy, rank_state=None):
        """``rank_state``: a part holding state only this rank has (``rank_state_dict`` /
        ``load_rank_state_dict``), e.g. the groups a filling loop carries to the next step."""
        self.name, self.ctx = name, ctx
        self.chooser = chooser if chooser is not None else SampledPrompts(ctx)
        self._collect = collect or generate_plan
        self.group_filter = keep  # backward selection; switches may replace it
        self.rank_state = rank_state

    def fresh_batch_size(self) -> int:
        """Prompts rolled out per step (rollout replay makes it smaller than B)."""
        return self.ctx.batch_size

    def plan(self, step: int) -> PromptPlan:
        return self.chooser.choose(step, self.fresh_batch_size())

    def collect(self, plan: PromptPlan) -> list[RolloutGroup]:
        return self._collect(self.ctx, plan)

    def select(self, batch: StepBatch, step: int) -> Selection:
        """Advantages and state from the LZE selector (it always runs: every method's metrics
        and the pruner rest on its pass rates), then this method's choice of groups."""
        g = batch.gathered
        device = self.ctx.device
        selection = self.ctx.selector.score(g.rewards.to(device), batch.plan.prompt_ids.to(device),
                                            g.valid.to(device))
        if step < self.ctx.cfg.selection.warmup_steps:
            keep = keep_all(selection, batch, step)
        else:
            keep = self.group_filter(selection, batch, step)
        return Selection(selection.advantages, keep, selection.energy, selection.pass_rate)

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        self.chooser.observe(batch, selection)

    def step_metrics(self) -> dict[str, float]:
        """Method-specific metrics of the step (skip probabilities, drops, calibration)."""
        return self.chooser.metrics()

    def state_dict(self) -> dict:
        return {"sampler": self.ctx.sampler.state_dict(),
                "selector": self.ctx.selector.state_dict(),
                "chooser": self.chooser.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ctx.sampler.load_state_dict(state["sampler"])
        self.ctx.selector.load_state_dict(state["selector"])
        self.chooser.load_state_dict(state["chooser"])

    def rank_state_dict(self) -> dict:
        """State only this rank holds (saved in a file per rank; e.g. replayed groups' tokens)."""
        return self.rank_state.rank_state_dict() if self.rank_state is not None else {}

    def load_rank_state_dict(self, state: dict) -> None:
        if self.rank_state is not None:
            self.rank_state.load_rank_state_dict(state)

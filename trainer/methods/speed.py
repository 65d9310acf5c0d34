"""``selection.policy=speed``: SPEED-RL's screening before full rollout (Zhang et al. 2025,
"SPEED-RL: Faster Training of Reasoning Models via Online Curriculum Learning", arXiv 2506.09016).

Each candidate prompt is first rolled out a few times (``selection.speed_screen_rollouts``, 4);
only prompts whose screening rewards are mixed (neither all right nor all wrong: the ones with a
GRPO gradient in expectation) are continued up to the full group of ``rollout.n``, reusing their
screening rollouts. Screening rounds draw more candidates until B prompts are accepted or
``selection.speed_max_rounds`` rounds have run; rows left unfilled are skipped prompts with no
rollouts (fixed shapes). Every full group reaches the update.

With ``selection.speed_prefilter=greso`` the candidates are first thinned by GRESO's skip draw
(Zheng et al. 2025, arXiv 2506.02177; :mod:`.greso`), fed by the screening rewards of every
engine: a prompt whose screening was all right or all wrong in a row is screened less and less
often, so fewer screening rollouts go to prompts that teach nothing.

Data parallelism: each rollout engine screens its own slice of each round's candidates and
accepts up to its share of B (its rows of the step's batch), so accepted groups never change
hands before the update; one all-reduce per round tells every rank whether any engine still needs
prompts (all ranks draw the same candidates), one all-gather at the end gives every rank the
plan. Screening and continuation rollouts are booked under their own purposes in the compute
ledger.
"""

from __future__ import annotations

import math

import torch

from .. import distributed as D
from ..batch import RolloutGroup, is_mixed  # is_mixed: the screening verdict
from . import register
from .base import Method, MethodContext, PromptPlan, SampledPrompts, keep_all
from .greso import greso_filter, greso_metrics


class ScreenedPrompts(SampledPrompts):
    """Prompts chosen while rolling out: :meth:`choose` leaves the plan empty and
    :meth:`screen_and_continue` fills it."""

    def __init__(self, ctx: MethodContext):
        super().__init__(ctx)
        prefilter = ctx.cfg.selection.speed_prefilter
        self.filter = greso_filter(ctx) if prefilter == "greso" else None
        self.step = 0

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        self.step = step  # the prefilter's skip draw is keyed by the step
        return PromptPlan(torch.zeros(batch_size, dtype=torch.int64), [0] * batch_size)

    def screen_and_continue(self, ctx: MethodContext, plan: PromptPlan) -> list[RolloutGroup]:
        """Screen candidates round by round, continue the mixed ones to full groups; fills
        ``plan`` (the same on every rank) and returns this engine's full groups at their rows."""
        s, generation = ctx.cfg.selection, ctx.generation
        rows = list(generation.local_rows(len(plan.counts)))
        accepted: list[RolloutGroup] = []
        rejected: list[int] = []
        screened: list[tuple[int, list[float]]] = []  # (prompt, screening rewards)
        drawn_this_step: set[int] = set()
        for round in range(s.speed_max_rounds):
            need = int(D.all_reduce(len(rows) - len(accepted), "max"))
            if need == 0:
                break
            per_shard = math.ceil(need * s.candidate_factor)
            drawn = self._draw(per_shard * generation.num_shards)
            # A round that crosses an epoch may draw a prompt again: it is screened once.
            mine = [pid for pid in _slice(drawn, generation) if pid not in drawn_this_step]
            drawn_this_step.update(drawn)
            screen = mine[:math.ceil((len(rows) - len(accepted)) * s.candidate_factor)]
            groups = generation.generate_and_score(
                screen, [s.speed_screen_rollouts] * len(screen), "screening", round=round)
            screened += [(g.prompt_id, g.rewards) for g in groups]
            for group in groups:
                if is_mixed(group.rewards) and len(accepted) < len(rows):
                    accepted.append(group)
                else:
                    rejected.append(group.prompt_id)
        full = _continue(ctx, accepted)
        idle = _idle_prompts(rejected, len(rows) - len(full), drawn_this_step, generation,
                             ctx.num_prompts)
        every_screening = _fill_plan(plan, rows, full, idle, screened)
        if self.filter is not None:
            self._observe_screening(every_screening)
        return full

    def _draw(self, n: int) -> list[int]:
        """The sampler's next ``n`` candidates; with the prefilter, the first ``n`` it lets
        through, drawing on (skipping is free) for at most one pass over the prompts. Every rank
        draws the same: the filter's state and its skip draw are the same on every rank."""
        if self.filter is None:
            return self.candidates(n).tolist()
        kept: dict[int, None] = {}  # in draw order; drawing on may cross an epoch: each once
        for _ in range(math.ceil(self.ctx.num_prompts / n)):
            drawn = self.candidates(n)
            keep = self.filter.rollout_mask(drawn.to(self.filter.device), self.step)
            kept.update((pid, None) for pid, k in zip(drawn.tolist(), keep.tolist()) if k)
            if len(kept) >= n:
                break
        return list(kept)[:n]

    def _observe_screening(self, screened: list[tuple[int, list[float]]]) -> None:
        """Every engine's screening rewards of this step feed the prefilter's streaks."""
        if not screened:
            return
        device = self.filter.device
        ids = torch.tensor([pid for pid, _ in screened], device=device)
        # every screened prompt has speed_screen_rollouts rewards
        rewards = torch.tensor([r for _, r in screened], device=device)
        self.filter.observe(ids, rewards, torch.ones_like(rewards, dtype=torch.bool))

    def metrics(self) -> dict[str, float]:
        return greso_metrics(self.filter) if self.filter is not None else {}

    def state_dict(self) -> dict:
        return {"greso": self.filter.state_dict()} if self.filter is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.filter is not None:
            self.filter.load_state_dict(state["greso"])


def _slice(drawn: list[int], generation) -> list[int]:
    """This engine's contiguous share of a round's candidates."""
    return [drawn[i] for i in generation.local_rows(len(drawn))]


def _continue(ctx: MethodContext, accepted: list[RolloutGroup]) -> list[RolloutGroup]:
    """The accepted prompts' remaining ``rollout.n - screen`` rollouts, joined to the screening
    ones (one engine call)."""
    rest = ctx.cfg.rollout.n - ctx.cfg.selection.speed_screen_rollouts
    more = ctx.generation.generate_and_score([g.prompt_id for g in accepted],
                                             [rest] * len(accepted), "continuation")
    return [RolloutGroup(row=0, prompt_id=g.prompt_id, prompt=g.prompt,
                         responses=g.responses + m.responses, rewards=g.rewards + m.rewards)
            for g, m in zip(accepted, more)]


def _idle_prompts(rejected: list[int], n: int, drawn: set[int], generation,
                  num_prompts: int) -> list[int]:
    """Distinct ids for this engine's unfilled rows (no rollouts): its rejected candidates, or
    in the rare case of too few, ids of its own residue class that no engine drew this step."""
    idle = rejected[:n]
    spare = (pid for pid in range(generation.shard, num_prompts, generation.num_shards)
             if pid not in drawn)
    return idle + [next(spare) for _ in range(n - len(idle))]


def _fill_plan(plan: PromptPlan, rows: list[int], full: list[RolloutGroup], idle: list[int],
               screened: list[tuple[int, list[float]]]) -> list[tuple[int, list[float]]]:
    """Accepted groups take this engine's first rows, idle prompts (no rollouts) the rest; then
    every rank learns every engine's rows and screening rewards (one collective; tensor-parallel
    peers send the same twice). Returns every engine's screening, each prompt once."""
    for row, group in zip(rows, full):
        group.row = row
    mine = ([(g.row, g.prompt_id, len(g.responses)) for g in full]
            + [(row, pid, 0) for row, pid in zip(rows[len(full):], idle)])
    every_screening: dict[int, list[float]] = {}
    for parcel, screening in D.all_gather_object((mine, screened)):
        for row, pid, count in parcel:
            plan.prompt_ids[row] = pid
            plan.counts[row] = count
        every_screening.update(screening)
    return list(every_screening.items())


@register("speed")
def speed_method(ctx: MethodContext) -> Method:
    chooser = ScreenedPrompts(ctx)
    return Method("speed", ctx, chooser=chooser, collect=chooser.screen_and_continue,
                  keep=keep_all)

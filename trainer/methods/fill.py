"""The batch-filling loop of dynamic sampling: generation rounds until the step's batch holds the
groups a method accepts. One loop serves DAPO, GRESO, SPEED and LZE's ``selection.refill``; each
brings a :class:`FillRule` (what a round rolls out, how large, what it accepts, what it keeps for
the next step).

What the official code runs, and the rule that follows it:

* **DAPO** (Yu et al. 2025; verl ``recipe/dapo/dapo_ray_trainer.py``): each round rolls out a
  generation batch of ``gen_batch_size`` prompts (the recipes: 3 x the training batch), keeps the
  groups whose rewards are not all equal, and goes on until B are kept, then truncates to B; more
  than ``max_num_gen_batches`` (10) rounds raise.
* **GRESO** (Zheng et al. 2025; Infini-AI-Lab/GRESO ``verl/trainer/ppo/ray_trainer.py``) runs on
  DAPO's dynamic sampling: the skip filter thins the dataloader stream until the rollout batch
  holds ``sampling_batch_size`` = 384 survivors for a training batch of 256; while fewer than 256
  mixed groups are collected, a top-up round rolls out ``remaining / (1 - zero-variance share of
  the last round) x 1.25`` survivors (at least 64, at most 384), and a top-up whose estimate fits
  in 384 is the last one (the step then trains on what it has); the surplus is truncated.
* **SPEED** (Zhang et al. 2025; Zanette-Labs/speed-rl ``verl/trainer/ppo/data_controller.py``):
  each inference call screens ``gen_batch_size`` new prompts (64 for a training batch of 16) with
  ``n_init`` rollouts and, in the same call, continues the prompts the previous call accepted
  (screening rewards with std > 0) with ``n_cont`` more; a prompt trains once its group is
  complete, the step trains once B are, and what is left (complete groups beyond B, accepted
  prompts awaiting their continuation) stays for the next step; a 50th call raises.
* **LZE refill** (``selection.refill``, this project): LZE rolls out its B prompts as published;
  while fewer than ``ceil(keep_ratio x B)`` of them have mixed rewards (energy > 0), top-up rounds
  sized as GRESO's replace zero-variance rows by mixed groups, so the top-k quota can be met.

Where this loop differs, and why: every method's step stops at ``selection.fill.max_rounds``
rounds and trains on what it has (rows beyond its accepted groups hold its rejected groups,
which its group filter does not train, or prompts without rollouts), where DAPO and SPEED raise:
a study run should not die on a hard stretch of data, and the ``fill/capped`` metric shows it.

Data parallelism: each rollout engine fills its own rows of the step's batch (its contiguous
slice, :meth:`~lze_trainer.generation.Generation.local_rows`) from the groups it generated, so
groups never change hands before the update. Per round one all-gather tells every rank how many
prompts each engine asks for; every rank then draws the same candidates from the shared sampler
in engine order and keeps its own engine's, so all ranks stay in step. One all-gather at the end
gives every rank the plan, every engine's rolled-out rewards (GRESO's streaks) and the prompts
carried over. Every round's rollouts are booked in the compute ledger under their purpose
(``train`` for a first round, ``refill`` for top-ups, ``screening`` / ``continuation`` for
SPEED).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .. import distributed as D
from ..batch import RolloutGroup, is_mixed
from .base import MethodContext, PromptPlan, SampledPrompts

# Official round sizes per training row and round caps, by method (see the module docstring).
OFFICIAL_FACTOR = {"dapo": 3.0, "greso": 384 / 256, "speed": 64 / 16, "lze": 1.0}
OFFICIAL_MAX_ROUNDS = {"dapo": 10, "greso": 50, "speed": 50, "lze": 10}
TOPUP_SAFETY, TOPUP_MIN_SHARE = 1.25, 64 / 256  # GRESO's top-up: x 1.25, at least 64 of 256


@dataclass(frozen=True)
class FillRule:
    """How a method fills its batch (per engine, for its ``rows`` rows)."""

    factor: float  # prompts a full round rolls out per row
    max_rounds: int  # rounds per step at most
    accept_share: float = 1.0  # accepted groups wanted per row (LZE refill: keep_ratio)
    adaptive: bool = False  # top-ups sized remaining / (1 - zero-variance share) x 1.25
    last_when_it_fits: bool = False  # GRESO: a top-up whose estimate fits a full round is last
    screen: int = 0  # SPEED: rollouts of a screening (0: full groups from the start)
    carry: bool = False  # SPEED: keep what is left over for the next step

    def target(self, rows: int) -> int:
        return math.ceil(self.accept_share * rows - 1e-9)

    def round_size(self, rows: int, need: int, round: int, zero_share: Optional[float]
                   ) -> tuple[int, bool]:
        """(prompts to roll out, whether this round is the step's last)."""
        full = math.ceil(self.factor * rows)
        if round == 0 or not self.adaptive:
            return full, False
        estimate = math.ceil(need / max(1.0 - zero_share, 1e-6) * TOPUP_SAFETY)
        size = max(min(estimate, full), math.ceil(TOPUP_MIN_SHARE * rows))
        return size, self.last_when_it_fits and estimate <= full


def fill_rule(cfg, method: str) -> FillRule:
    """The rule of ``method`` from the ``selection.fill`` settings (None: the official value)."""
    s = cfg.selection
    factor = s.fill.factor if s.fill.factor is not None else OFFICIAL_FACTOR[method]
    rounds = s.fill.max_rounds if s.fill.max_rounds is not None else OFFICIAL_MAX_ROUNDS[method]
    if method == "speed":
        return FillRule(factor, rounds, screen=s.speed.screen_rollouts, carry=True)
    if method == "greso":
        return FillRule(factor, rounds, adaptive=True, last_when_it_fits=True)
    if method == "lze":
        return FillRule(factor, rounds, accept_share=s.keep_ratio, adaptive=True)
    return FillRule(factor, rounds)


class FillingPrompts(SampledPrompts):
    """A chooser whose plan is filled while rolling out: :meth:`choose` leaves the plan empty
    and :meth:`collect` runs the rounds. Subclasses change how candidates are drawn
    (:meth:`draw`) and what the step's rewards teach them (:meth:`learn`)."""

    def __init__(self, ctx: MethodContext, rule: FillRule):
        super().__init__(ctx)
        self.rule = rule
        self.step = 0
        self.ready: list[RolloutGroup] = []  # this engine's complete accepted groups, carried
        self.pending: list[RolloutGroup] = []  # SPEED: accepted screenings awaiting continuation
        self.carried_ids: list[int] = []  # every engine's carried prompts (the same on all ranks)
        self.rolled: list[tuple[int, list[float]]] = []  # every engine's new groups this step
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ the plan

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        self.step = step  # keys the skip draw of GRESO's filter
        return PromptPlan(torch.zeros(batch_size, dtype=torch.int64), [0] * batch_size)

    def collect(self, ctx: MethodContext, plan: PromptPlan) -> list[RolloutGroup]:
        """Roll out round by round until every engine holds its accepted groups (or the cap);
        fills ``plan`` (the same on every rank) and returns this engine's groups at their rows."""
        generation = ctx.generation
        rows = list(generation.local_rows(len(plan.counts)))
        excluded = set(self.carried_ids)  # no prompt twice in one step, nor one carried over
        met: set[int] = set()  # candidates drawn for this engine (rolled out or skipped)
        rejected: list[RolloutGroup] = []
        rolled: list[tuple[int, list[float]]] = []
        zero_share: Optional[float] = None
        done = False
        rounds = 0
        while True:
            need = 0 if done else max(0, self.rule.target(len(rows)) - len(self.ready))
            exhausted = len(excluded) >= self.ctx.num_prompts  # every prompt met this step
            wants = need > 0 and (not exhausted or bool(self.pending))
            size, last = (self.rule.round_size(len(rows), need, rounds, zero_share) if wants
                          else (0, False))
            sizes = D.all_gather_object(size)[::generation.tp]  # the round's one collective
            if not any(sizes) or rounds == self.rule.max_rounds:
                break
            mine = self._draw_for_engines(sizes, excluded, generation.shard, met)
            if size:
                new = self._roll_out(generation, mine, rounds)
                rolled += [(g.prompt_id, g.rewards) for g in new]
                rejected += [g for g in new if not is_mixed(g.rewards)]
                zero_share = sum(not is_mixed(g.rewards) for g in new) / max(len(new), 1)
                done = last
            rounds += 1
        capped = any(sizes)
        return self._fill_plan(plan, rows, rejected, rolled, excluded, met, rounds, capped)

    def _draw_for_engines(self, sizes: list[int], excluded: set[int], shard: int,
                          met: set[int]) -> list[int]:
        """Every rank draws the same candidates for each engine that asks, in engine order;
        returns this engine's and adds every candidate met for it to ``met``."""
        mine: list[int] = []
        for engine, size in enumerate(sizes):
            if size:
                before = set(excluded)
                drawn = self.draw(size, excluded)
                if engine == shard:
                    mine = drawn
                    met.update(excluded - before)
        return mine

    def draw(self, n: int, excluded: set[int]) -> list[int]:
        """Up to ``n`` new candidates from the sampler, none in ``excluded`` (which grows by
        every prompt drawn: a round that crosses an epoch may meet a prompt again)."""
        room = self.ctx.num_prompts - len(excluded)
        if room <= 0:
            return []
        drawn = [pid for pid in self.candidates(min(n, self.ctx.num_prompts)).tolist()
                 if pid not in excluded]
        excluded.update(drawn)
        return drawn

    def _roll_out(self, generation, prompts: list[int], round: int) -> list[RolloutGroup]:
        """One engine call: SPEED's pending continuations fused with the round's new prompts.
        Completed groups join ``ready``; new accepted groups join ``ready`` (or ``pending``
        while they need a continuation). Returns the new groups."""
        r, n = self.rule, self.ctx.cfg.rollout.n
        continued = self.pending
        new_purpose = "screening" if r.screen else ("train" if round == 0 else "refill")
        counts = [n - r.screen] * len(continued) + [r.screen or n] * len(prompts)
        purposes = ["continuation"] * len(continued) + [new_purpose] * len(prompts)
        ids = [g.prompt_id for g in continued] + prompts
        groups = (generation.generate_and_score(ids, counts, purposes, round=round)
                  if ids else [])
        self.ready += [_joined(old, more) for old, more in zip(continued, groups)]
        new = groups[len(continued):]
        accepted = [g for g in new if is_mixed(g.rewards)]
        self.pending = accepted if r.screen else []
        self.ready += [] if r.screen else accepted
        return new

    def _fill_plan(self, plan: PromptPlan, rows: list[int], rejected: list[RolloutGroup],
                   rolled, excluded: set[int], met: set[int], rounds: int, capped: bool
                   ) -> list[RolloutGroup]:
        """This engine's rows: its accepted groups, then (when short) its rejected groups, then
        prompts without rollouts; what is left is carried (SPEED) or dropped (truncation). Then
        every rank learns every engine's rows, rolled-out rewards and carried prompts (one
        collective)."""
        taken, self.ready = self.ready[:len(rows)], self.ready[len(rows):]
        accepted = len(taken)
        taken += rejected[:len(rows) - len(taken)]
        if not self.rule.carry:
            self.ready = []
        groups = [replace(g, row=row) for row, g in zip(rows, taken)]
        carried = [g.prompt_id for g in self.ready + self.pending]
        unused = met - {g.prompt_id for g in groups} - set(carried)
        idle = _idle_prompts(len(rows) - len(groups), sorted(unused), excluded, carried,
                             self.ctx)
        parcel = ([(g.row, g.prompt_id, len(g.responses)) for g in groups]
                  + [(row, pid, 0) for row, pid in zip(rows[len(groups):], idle)])
        self.rolled, self.carried_ids = [], []
        short = 0
        for cells, engine_rolled, engine_carried, engine_short in D.all_gather_object(
                (parcel, rolled, carried, len(rows) - accepted))[::self.ctx.generation.tp]:
            for row, pid, count in cells:
                plan.prompt_ids[row], plan.counts[row] = pid, count
            self.rolled += engine_rolled
            self.carried_ids += engine_carried
            short += engine_short
        self.last = {"fill/rounds": float(rounds), "fill/capped": float(capped),
                     "fill/short_rows": float(short),
                     "fill/carried_groups": float(len(self.carried_ids))}
        return groups

    # ------------------------------------------------------------------ what the step teaches

    def observe(self, batch, selection) -> None:
        self.learn(self.rolled)

    def learn(self, rolled: list[tuple[int, list[float]]]) -> None:
        """What every engine's groups rolled out this step teach the chooser (GRESO: streaks)."""

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"carried_ids": list(self.carried_ids)}

    def load_state_dict(self, state: dict) -> None:
        self.carried_ids = list(state["carried_ids"])

    def rank_state_dict(self) -> dict:
        """This engine's carried groups, tokens included (SPEED)."""
        return {"fill_ready": list(self.ready), "fill_pending": list(self.pending)}

    def load_rank_state_dict(self, state: dict) -> None:
        self.ready = list(state.get("fill_ready", []))
        self.pending = list(state.get("fill_pending", []))
        mine = {g.prompt_id for g in self.ready + self.pending}
        if not mine <= set(self.carried_ids):
            raise RuntimeError(f"fill: this engine holds carried prompts {sorted(mine)} the "
                               f"checkpoint's index does not list (written with another rank "
                               "layout?)")


def rolled_tensors(rolled: list[tuple[int, list[float]]], device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([n] prompt ids, [n, width] rewards, [n, width] valid) of groups of any sizes."""
    width = max(len(r) for _, r in rolled)
    rewards = torch.zeros(len(rolled), width)
    valid = torch.zeros(len(rolled), width, dtype=torch.bool)
    for i, (_, r) in enumerate(rolled):
        rewards[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
        valid[i, :len(r)] = True
    ids = torch.tensor([pid for pid, _ in rolled], dtype=torch.int64)
    return ids.to(device), rewards.to(device), valid.to(device)


def _joined(screened: RolloutGroup, more: RolloutGroup) -> RolloutGroup:
    """A screened group completed by its continuation (screening responses first)."""
    return replace(screened, responses=screened.responses + more.responses,
                   rewards=screened.rewards + more.rewards)


def _idle_prompts(n: int, unused: list[int], excluded: set[int], carried: list[int],
                  ctx: MethodContext) -> list[int]:
    """Ids for this engine's rows without rollouts (the selector needs an id per row; a row
    without rollouts is inert in it, docs/spec.md §1, so the id only has to be in range):
    candidates met for this engine that hold no row (skipped or dropped: no other engine has
    them), then ids of its own residue class that no engine met or carries this step
    (``excluded`` is the same on every rank), then this engine's carried prompts (in no row this
    step), all distinct; when a step has met every prompt (a small data set that forward
    filters thin, an engine that drew after another took the rest), its residue class again."""
    generation = ctx.generation
    own = range(generation.shard, ctx.num_prompts, generation.num_shards)
    ids = [*unused, *(pid for pid in own if pid not in excluded), *carried]  # disjoint
    pool = own or range(ctx.num_prompts)  # fewer prompts than engines: any id
    ids += [pool[i % len(pool)] for i in range(n - len(ids))]
    return ids[:n]

"""``replay.ratio=sigma``: Rollout Replay (Sun et al. 2025, "Improving Data Efficiency for LLM
Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout Replay",
docs/spec.md §9), a switch over any selection method.

Once the buffer holds enough groups, a step rolls out only ``fresh = sigma x B`` prompts (rounded
to a multiple of the rollout engines, at least one each) and trains on the method's kept fresh
groups plus up to ``B - fresh`` groups drawn **uniformly at random without replacement** from the
buffer (the official ``replay_strategy=random``: ``torch.randperm`` over the buffer's groups,
ASTRAL-Group/data-efficient-llm-rl at 59df918, ``rl_training/verl/verl/trainer/ppo/
ray_trainer.py``:104-109), skipping prompts of the step's own plan (the official code allows the
overlap and only logs it, 1012-1014: here a prompt is one row of a step). The draw is seeded by
``(trainer.seed, step)``, so a resumed run draws what the lost one did. After the draw the buffer
keeps only its newest ``replay.buffer_size - fresh`` groups (the official truncation to
``buffer_size - sigma B``, 118-124; run it with ``buffer_size = B`` as the official script does,
512 at B = 512), then the step's fresh groups with mixed rewards enter. The buffer holds groups
with non-zero reward variance only (the official filter, 87-95), one copy per prompt (a newer
group of a prompt replaces the older, 70-81), at most ``replay.buffer_size`` (FIFO by insertion).
Replayed groups reach the update without selection and without touching the selector's per-prompt
history (it only sees what was generated), with GRPO advantages recomputed from their stored
rewards (as the official code does, 1062); their tokens carry the log-probs ``mu`` of the policy
that sampled them, so the update weights them by ``pi_old / mu``
(:func:`lze_trainer.loss.behaviour_weights`; the official loss, ``core_algos.py``:197-235, runs
with a symmetric clip of 0.2: set ``actor.clip_ratio_high=0.2`` with replay).

``mu``: the official code takes it from the actor (``compute_log_prob`` at the generating step,
981); here it is the rollout engine's log-probs of the same weights at the same step (the engine
holds the actor's weights after every sync). The two differ only by kernel numerics, which the
trainer measures on every fresh batch (``actor/engine_logprob_abs_diff_max``); the actor's would
cost one more forward pass over every group that enters the buffer, since with one optimizer step
per training step the update recomputes no old log-probs.

Data parallelism: the buffer's index (prompt, rewards, validity, lengths, owning engine, in
insertion order) comes from the all-gathered rewards and is the same on every rank; a group's
tokens stay on the ranks of the engine that generated them, which send them to whichever rank
trains on them, as for fresh groups (:func:`lze_trainer.dispatch.dispatch_kept_groups`).
Checkpoints hold the index once and each rank's tokens in that rank's own file.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional

import torch

from lze_kernels import ops

from ..batch import RolloutGroup
from ..generation import GatheredGroups
from ..selection import Selection
from .base import Method, PromptPlan, StepBatch

REPLAY_STREAM = 0x5EED  # separates the replay draw's seed from the trainer's other streams


@dataclass
class BufferEntry:
    """A buffered group's index entry (the same on every rank)."""

    prompt_id: int
    rewards: torch.Tensor  # [width] float32, 0 where invalid
    valid: torch.Tensor  # [width] bool
    lengths: torch.Tensor  # [width] int32 response tokens
    shard: int  # the rollout engine whose ranks hold its tokens


class ReplayBuffer:
    """The latest ``capacity`` groups, oldest first, one per prompt; ``tokens`` holds the groups
    this rank's engine generated (keyed by prompt id)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, BufferEntry] = OrderedDict()
        self.tokens: dict[int, RolloutGroup] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: BufferEntry, group: Optional[RolloutGroup]) -> None:
        """Append ``entry`` (and its tokens where this rank holds them), dropping an older copy of
        its prompt and then the oldest entries beyond the capacity (FIFO)."""
        self.entries.pop(entry.prompt_id, None)
        self.tokens.pop(entry.prompt_id, None)
        self.entries[entry.prompt_id] = entry
        if group is not None:
            self.tokens[entry.prompt_id] = group
        while len(self.entries) > self.capacity:
            oldest, _ = self.entries.popitem(last=False)
            self.tokens.pop(oldest, None)

    def draw(self, n: int, exclude: set[int], generator: torch.Generator) -> list[BufferEntry]:
        """Up to ``n`` entries drawn uniformly at random without replacement among those whose
        prompts are not in ``exclude`` (in draw order)."""
        candidates = [e for pid, e in self.entries.items() if pid not in exclude]
        order = torch.randperm(len(candidates), generator=generator)[:n]
        return [candidates[i] for i in order.tolist()]

    def keep_newest(self, n: int) -> None:
        """Drop all but the newest ``n`` entries (and their tokens)."""
        while len(self.entries) > max(n, 0):
            oldest, _ = self.entries.popitem(last=False)
            self.tokens.pop(oldest, None)

    def state_dict(self) -> dict:
        return {"entries": [vars(e) for e in self.entries.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.entries = OrderedDict((e["prompt_id"], BufferEntry(**e)) for e in state["entries"])

    def check_tokens(self, shard: int) -> None:
        """This rank must hold the tokens of exactly its engine's entries (after a resume)."""
        expected = {pid for pid, e in self.entries.items() if e.shard == shard}
        if set(self.tokens) != expected:
            raise RuntimeError(f"replay buffer: engine {shard} holds tokens of {len(self.tokens)} "
                               f"groups, its index lists {len(expected)} (checkpoint written "
                               "with another rank layout?)")


class RolloutReplay:
    """Wraps a built :class:`Method`: its plan rolls out ``fresh`` prompts, its select adds the
    replayed rows to the step's batch, and observe fills the buffer."""

    def __init__(self, inner: Method):
        self.inner, self.name, self.ctx = inner, inner.name, inner.ctx
        self.buffer = ReplayBuffer(self.ctx.cfg.replay.buffer_size)
        self.replayed = 0  # groups replayed in the last step
        self._fresh: Optional[tuple[StepBatch, Selection]] = None
        inner.fresh_batch_size = self.fresh_batch_size  # the inner plan rolls out the fresh share

    def fresh_batch_size(self) -> int:
        """B until the buffer holds the replayed share ``B - fresh``, then ``fresh``."""
        B = self.ctx.batch_size
        fresh = fresh_size(B, self.ctx.cfg.replay.ratio, self.ctx.generation.num_shards)
        return fresh if len(self.buffer) >= B - fresh else B

    def plan(self, step: int) -> PromptPlan:
        return self.inner.plan(step)

    def collect(self, plan: PromptPlan) -> list[RolloutGroup]:
        return self.inner.collect(plan)

    def select(self, batch: StepBatch, step: int) -> Selection:
        """The method selects among the fresh rows (and updates its state from them only); then
        the replayed groups are appended to ``batch`` as rows ``fresh..``, all kept."""
        fresh = self.inner.select(batch, step)
        self._fresh = (replace(batch), fresh)
        exclude = set(batch.plan.prompt_ids.tolist())
        B, r = self.ctx.batch_size, self.ctx.cfg.replay
        chosen = self.buffer.draw(B - len(batch.plan.counts), exclude, self.generator(step))
        if chosen:
            self._append(batch, chosen)
        self.buffer.keep_newest(r.buffer_size - fresh_size(B, r.ratio,
                                                           self.ctx.generation.num_shards))
        self.replayed = len(chosen)
        if not chosen:
            return fresh
        rewards = torch.stack([e.rewards for e in chosen]).to(self.ctx.device)
        valid = torch.stack([e.valid for e in chosen]).to(self.ctx.device)
        advantages = ops.grpo_advantages(rewards, valid, self.ctx.selector.lze.config.eps,
                                         self.ctx.cfg.actor.norm_adv_by_std)
        R, device = len(chosen), fresh.keep_mask.device
        unscored = torch.zeros(R, dtype=fresh.energy.dtype, device=device)  # not the selector's
        return Selection(torch.cat([fresh.advantages, advantages.to(fresh.advantages.dtype)]),
                         torch.cat([fresh.keep_mask, torch.ones(R, dtype=torch.bool,
                                                                device=device)]),
                         torch.cat([fresh.energy, unscored]),
                         torch.cat([fresh.pass_rate, unscored.to(fresh.pass_rate.dtype)]))

    def generator(self, step: int) -> torch.Generator:
        """The step's seeded draw (a resumed run draws the same groups)."""
        return torch.Generator().manual_seed(
            (self.ctx.cfg.trainer.seed * 1_000_003 + step * 7919 + REPLAY_STREAM) % 2**63)

    def _append(self, batch: StepBatch, chosen: list[BufferEntry]) -> None:
        n, shard = len(batch.plan.counts), self.ctx.generation.shard
        g = batch.gathered
        batch.plan = PromptPlan(
            torch.cat([batch.plan.prompt_ids,
                       torch.tensor([e.prompt_id for e in chosen], dtype=torch.int64)]),
            batch.plan.counts + [int(e.valid.sum()) for e in chosen])
        batch.gathered = GatheredGroups(
            torch.cat([g.rewards, torch.stack([e.rewards for e in chosen])]),
            torch.cat([g.valid, torch.stack([e.valid for e in chosen])]),
            torch.cat([g.lengths, torch.stack([e.lengths for e in chosen])]))
        batch.groups = batch.groups + [
            replace(self.buffer.tokens[e.prompt_id], row=n + i, off_policy=True)
            for i, e in enumerate(chosen) if e.shard == shard]
        batch.replayed = len(chosen)

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        """The method observes the fresh rows; their groups with mixed rewards enter the buffer
        in row order (the last row is the newest)."""
        fresh_batch, fresh_selection = self._fresh
        self.inner.observe(fresh_batch, fresh_selection)
        g, n = fresh_batch.gathered, len(fresh_batch.plan.counts)
        mixed = (~g.zero_variance() & g.valid.any(dim=1)).tolist()
        mine = {group.row: group for group in fresh_batch.groups}
        shards = self.ctx.generation.num_shards
        for row in (r for r in range(n) if mixed[r]):
            entry = BufferEntry(int(fresh_batch.plan.prompt_ids[row]), g.rewards[row].clone(),
                                g.valid[row].clone(), g.lengths[row].clone(),
                                owner_shard(row, n, shards))
            group = mine.get(row)
            self.buffer.add(entry, None if group is None else replace(group, advantages=[]))

    def step_metrics(self) -> dict[str, float]:
        return {**self.inner.step_metrics(), "replay/groups": float(self.replayed),
                "replay/buffer_size": float(len(self.buffer))}

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "replay": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.buffer.load_state_dict(state["replay"])

    def rank_state_dict(self) -> dict:
        return {**self.inner.rank_state_dict(), "replay_tokens": dict(self.buffer.tokens)}

    def load_rank_state_dict(self, state: dict) -> None:
        self.inner.load_rank_state_dict(state)
        self.buffer.tokens = dict(state["replay_tokens"])
        self.buffer.check_tokens(self.ctx.generation.shard)


def fresh_size(batch_size: int, ratio: float, shards: int) -> int:
    """Prompts rolled out per step once replay runs: ``ratio x B`` rounded to a multiple of the
    rollout engines (each rolls out the same share, at least one prompt)."""
    return min(batch_size, shards * max(1, round(ratio * batch_size / shards)))


def owner_shard(row: int, n: int, shards: int) -> int:
    """The rollout engine that generated ``row`` of ``n`` (the contiguous slices of
    :meth:`lze_trainer.generation.Generation.local_rows`)."""
    return row // -(-n // shards)


def with_replay(method: Method) -> Method | RolloutReplay:
    """``method`` with rollout replay when ``replay.ratio > 0``."""
    return RolloutReplay(method) if method.ctx.cfg.replay.ratio > 0 else method

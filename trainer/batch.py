"""Rollout groups, how kept groups are spread over ranks, and the padded tensors of an update.

Selection keeps or drops whole groups (SPEC 4: a group's advantages were computed on all of its
responses, so cutting sequences out of a kept group would bias them; the LZE release does exactly
that to fill mini-batches, this trainer does not). The kept groups are then balanced over ranks so
every rank runs the same number of micro-batches (a DeepSpeed requirement: every backward takes
part in collectives); where the count does not divide, ranks pad with zero-weight copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from .rollout import Completion


@dataclass
class RolloutGroup:
    """One prompt and its responses, as one rank generated and scored them."""

    row: int  # position in the step's global batch
    prompt_id: int  # dataset row index (the selector's id)
    prompt: list[int]
    responses: list[Completion]
    rewards: list[float]
    advantages: list[float] = field(default_factory=list)  # set after selection
    weight: float = 1.0  # 0 for padding copies


def assign_kept_groups(kept_rows: Sequence[int], rows_per_shard: int, world_size: int,
                       tp: int) -> list[list[int]]:
    """Rows each rank trains on: the same count on every rank (ceil(K / W), padding marked -1),
    groups staying on a rank of the engine that generated them where the quota allows.

    Rank r belongs to rollout shard r // tp, which generated global rows
    [shard * rows_per_shard, (shard + 1) * rows_per_shard)."""
    per_rank = -(-len(kept_rows) // world_size)
    quota = [len(kept_rows) // world_size + (1 if r < len(kept_rows) % world_size else 0)
             for r in range(world_size)]
    plan: list[list[int]] = [[] for _ in range(world_size)]
    leftover = []
    for row in kept_rows:
        shard = row // rows_per_shard
        local = [r for r in range(shard * tp, shard * tp + tp) if len(plan[r]) < quota[r]]
        if local:  # the least loaded peer keeps tensor-parallel ranks balanced
            plan[min(local, key=lambda r: len(plan[r]))].append(row)
        else:
            leftover.append(row)
    for row in leftover:
        rank = next(r for r in range(world_size) if len(plan[r]) < quota[r])
        plan[rank].append(row)
    return [rows + [-1] * (per_rank - len(rows)) for rows in plan]


@dataclass
class SequenceBatch:
    """Right-padded prompt+response sequences of one micro-batch. Per-token tensors are aligned
    with ``input_ids``: position t holds what concerns the token at t."""

    input_ids: torch.Tensor  # [n, L] long
    attention_mask: torch.Tensor  # [n, L] long
    loss_mask: torch.Tensor  # [n, L] float: sequence weight on response tokens, 0 elsewhere
    advantages: torch.Tensor  # [n] float
    engine_logprobs: torch.Tensor  # [n, L] float, the rollout engine's log-probs
    old_logprobs: torch.Tensor | None = None  # [n, L], set when the update needs them

    def to(self, device) -> "SequenceBatch":
        return replace(self, **{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                for k, v in vars(self).items()})


def micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: int, count: int,
                  pad_id: int) -> list[SequenceBatch]:
    """The groups' sequences in ``count`` micro-batches of at most ``micro_batch_size``; missing
    ones (``count`` is the maximum over ranks) are zero-weight copies of the first sequence."""
    sequences = [(g, j) for g in groups for j in range(len(g.responses))]
    chunks = [sequences[i:i + micro_batch_size]
              for i in range(0, len(sequences), micro_batch_size)]
    filler = [(replace(groups[0], weight=0.0), 0)]
    chunks += [filler] * (count - len(chunks))
    return [_collate(chunk, pad_id) for chunk in chunks]


def num_micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: int) -> int:
    sequences = sum(len(g.responses) for g in groups)
    return -(-sequences // micro_batch_size)


def _collate(chunk, pad_id: int) -> SequenceBatch:
    length = max(len(g.prompt) + len(g.responses[j].token_ids) for g, j in chunk)
    n = len(chunk)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length))
    engine_logprobs = torch.zeros((n, length))
    advantages = torch.zeros(n)
    for i, (group, j) in enumerate(chunk):
        response = group.responses[j]
        start, end = len(group.prompt), len(group.prompt) + len(response.token_ids)
        input_ids[i, :start] = torch.tensor(group.prompt)
        input_ids[i, start:end] = torch.tensor(response.token_ids)
        attention[i, :end] = 1
        loss_mask[i, start:end] = group.weight
        engine_logprobs[i, start:end] = torch.tensor(response.logprobs)
        advantages[i] = group.advantages[j] if group.weight else 0.0
    return SequenceBatch(input_ids, attention, loss_mask, advantages, engine_logprobs)

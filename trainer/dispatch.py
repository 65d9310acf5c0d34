"""Moving the kept groups of a step to the ranks that train on them, and the update's batches.

Selection keeps or drops whole groups (docs/spec.md §4: a group's advantages were computed on all of its
responses, so cutting sequences out of a kept group would bias them; the LZE release does exactly
that to fill mini-batches, this trainer does not). The kept groups are balanced over ranks so
every rank runs the same number of micro-batches (a DeepSpeed requirement: every backward takes
part in collectives); where the count does not divide, ranks pad with zero-weight copies. Each
mini-batch's loss is divided by its kept tokens (or sequences) counted over all ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import numpy as np
import torch

from . import distributed as D
from .batch import RolloutGroup, SequenceBatch, micro_batches, num_micro_batches
from .loss import Normaliser


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


def dispatch_kept_groups(local_groups: list[RolloutGroup], advantages: torch.Tensor,
                         kept_rows: list[int], rows_per_shard: int, world: D.World,
                         tp: int) -> list[RolloutGroup]:
    """This rank's share of the kept groups, with their advantages ([B, G] on the host).

    ``local_groups`` are the groups this rank's engine generated. A group another engine
    generated is sent by that engine's first rank; padding slots become zero-weight copies."""
    plan = assign_kept_groups(kept_rows, rows_per_shard, world.size, tp)
    shard = world.rank // tp
    local = {g.row: g for g in local_groups}
    outgoing = {}
    if world.rank % tp == 0:
        for rank, rows in enumerate(plan):
            if rank // tp != shard:
                outgoing.update({row: local[row] for row in rows if row in local})
    received = {}
    if world.size > tp:  # more than one engine: groups may change hands
        for parcel in D.all_gather_object(outgoing):
            received.update(parcel)
    mine = []
    for row in plan[world.rank]:
        if row < 0:
            # An engine may have generated nothing this step (SPEED accepting no prompt): its
            # padding is a weightless one-token prompt (micro_batches makes it a sequence).
            filler = local_groups[0] if local_groups else RolloutGroup(
                row=-1, prompt_id=-1, prompt=[0], responses=[], rewards=[])
            mine.append(replace(filler, weight=0.0, advantages=[0.0] * len(filler.responses)))
        else:
            group = local[row] if row in local else received[row]
            mine.append(replace(group, advantages=advantages[row, :len(group.responses)].tolist()))
    return mine


def update_batches(groups: list[RolloutGroup], mini_batches: int,
                   micro_batch_size: Optional[int],
                   max_response_length: int, pad_id: int, max_tokens: Optional[int] = None
                   ) -> tuple[list[list[SequenceBatch]], list[Normaliser]]:
    """Split this rank's groups into ``mini_batches`` optimizer steps of micro-batches (packed by
    length, at most ``max_tokens`` padded tokens each: :func:`lze_trainer.batch.pack`), each with
    the normaliser of its tokens and sequences over all ranks (collective: every rank calls)."""
    parts = [p for p in np.array_split(np.arange(len(groups)), mini_batches) if len(p)]
    batches, norms = [], []
    for part in parts:
        members = [groups[i] for i in part]
        weighted = [g for g in members if g.weight > 0]
        tokens, sequences = D.all_reduce_many(
            [sum(len(c.token_ids) for g in weighted for c in g.responses),
             sum(len(g.responses) for g in weighted)])
        count = int(D.all_reduce(num_micro_batches(members, micro_batch_size, max_tokens), "max"))
        norms.append(Normaliser(tokens, sequences, max_response_length))
        batches.append(micro_batches(members, micro_batch_size, count, pad_id, max_tokens))
    return batches, norms

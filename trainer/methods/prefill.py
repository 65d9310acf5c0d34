"""Forward passes of the policy over prompts only (no generation), spread over the ranks: the
per-prompt features that HIVE's entropy check and DOTS's policy embeddings read.

Rows are split over all ranks in equal slices (the last padded with copies of its first row, so
that every rank runs the same number of forwards, as ZeRO-3 requires), each rank runs its slice
in micro-batches of ``actor.micro_batch_size`` (or as many longest prompts as the update's token
cap holds, :meth:`lze_trainer.actor.Actor.micro_batch_tokens`) without gradient, and one all-gather gives every
rank every row. The prompt tokens are booked in the compute ledger as an extra forward pass
(``forward/<purpose>``: 2P FLOPs per token).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import distributed as D
from ..loss import token_entropy

Feature = Callable[[object, torch.Tensor, torch.Tensor], torch.Tensor]


def mean_prompt_entropy(output, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n] mean entropy of the policy's next-token distributions over each prompt's positions
    (HIVE's prompt entropy)."""
    entropy = token_entropy(output.logits, 1.0)[:, 1:]
    positions = mask[:, 1:].float()
    return (entropy * positions).sum(-1) / positions.sum(-1).clamp(min=1.0)


def mean_hidden_state(output, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n, d] last hidden states mean-pooled over each prompt's tokens (DOTS's embeddings)."""
    hidden = output.hidden_states[-1].float()
    weights = mask.unsqueeze(-1).float()
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def prompt_features(ctx, prompt_ids: Sequence[int], feature: Feature, purpose: str,
                    hidden_states: bool = False) -> torch.Tensor:
    """[n, ...] float32 ``feature`` of each prompt, the same on every rank (collective)."""
    world, train = ctx.generation.world, ctx.generation.train
    n = len(prompt_ids)
    per_rank = -(-n // world.size)
    start = min(world.rank * per_rank, n)
    mine = list(prompt_ids[start:start + per_rank])
    mine += [mine[0] if mine else prompt_ids[0]] * (per_rank - len(mine))
    local = _forward(ctx, [train.token_ids[pid] for pid in mine], feature, hidden_states)
    tokens = sum(len(train.token_ids[pid]) for pid in prompt_ids[start:start + per_rank])
    ctx.generation.ledger.add("forward", purpose, float(tokens))
    gathered = torch.empty((world.size * per_rank,) + tuple(local.shape[1:]),
                           dtype=local.dtype, device=local.device)
    D.all_gather_rows(gathered, local)
    return gathered[:n]


@torch.no_grad()
def _forward(ctx, prompts: list[list[int]], feature: Feature, hidden_states: bool):
    actor, device = ctx.actor, ctx.generation.world.device
    size = ctx.cfg.actor.micro_batch_size or max(
        1, actor.micro_batch_tokens() // ctx.cfg.data.max_prompt_tokens)
    parts = []
    for i in range(0, len(prompts), size):
        chunk = prompts[i:i + size]
        length = max(len(p) for p in chunk)
        input_ids = torch.full((len(chunk), length), actor.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), length), dtype=torch.long)
        for j, p in enumerate(chunk):
            input_ids[j, :len(p)] = torch.tensor(p)
            mask[j, :len(p)] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        output = actor.engine(input_ids=input_ids, attention_mask=mask, use_cache=False,
                              output_hidden_states=hidden_states)
        parts.append(feature(output, input_ids, mask).float())
    return torch.cat(parts)

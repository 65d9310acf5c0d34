"""Rollout groups and the padded tensors of an update's micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

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
    off_policy: bool = False  # replayed: sampled by an older policy (docs/spec.md §9)


def is_mixed(rewards: Sequence[float]) -> bool:
    """A group with a GRPO gradient: its rewards are not all equal (with binary rewards, some
    right and some wrong)."""
    return len(set(rewards)) > 1


@dataclass
class SequenceBatch:
    """Right-padded prompt+response sequences of one micro-batch. Per-token tensors are aligned
    with ``input_ids``: position t holds what concerns the token at t."""

    input_ids: torch.Tensor  # [n, L] long
    attention_mask: torch.Tensor  # [n, L] long
    loss_mask: torch.Tensor  # [n, L] float: sequence weight on response tokens, 0 elsewhere
    advantages: torch.Tensor  # [n] float
    engine_logprobs: torch.Tensor  # [n, L] float, the rollout engine's log-probs
    off_policy: torch.Tensor  # [n] bool: replayed sequences, whose engine log-probs are mu
    old_logprobs: torch.Tensor | None = None  # [n, L], set when the update needs them

    def to(self, device) -> "SequenceBatch":
        return replace(self, **{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                for k, v in vars(self).items()})


def micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: int, count: int,
                  pad_id: int, max_tokens: Optional[int] = None) -> list[SequenceBatch]:
    """The groups' sequences packed by :func:`pack` into ``count`` micro-batches; missing ones
    (``count`` is the maximum over ranks) are zero-weight copies of the first sequence."""
    chunks = pack(groups, micro_batch_size, max_tokens)
    chunks += [[_filler(groups)]] * (count - len(chunks))
    return [_collate(chunk, pad_id) for chunk in chunks]


def _filler(groups: Sequence[RolloutGroup]) -> tuple[RolloutGroup, int]:
    """A zero-weight sequence for the micro-batches a rank runs only to stay in step with the
    others: its first sequence, or, when none of its groups has responses (every prompt of its
    engine skipped or dropped before rollout), its first prompt with one token."""
    for group in groups:
        if group.responses:
            return replace(group, weight=0.0), 0
    group = groups[0]
    stand_in = Completion(token_ids=group.prompt[-1:], logprobs=[0.0], truncated=False)
    return replace(group, weight=0.0, responses=[stand_in], advantages=[0.0]), 0


def num_micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: int,
                      max_tokens: Optional[int] = None) -> int:
    return len(pack(groups, micro_batch_size, max_tokens))


def pack(groups: Sequence[RolloutGroup], micro_batch_size: int,
         max_tokens: Optional[int] = None) -> list[list[tuple[RolloutGroup, int]]]:
    """(group, response index) chunks: sequences sorted longest first (stable), cut greedily into
    chunks of at most ``micro_batch_size`` rows whose padded size, rows x the first (longest)
    length, is at most ``max_tokens`` (None: no token cap). A sequence longer than the cap gets a
    chunk of its own (config validation rules that out for the trainer's sequences).

    Sorting makes a chunk's padding the length spread of neighbours, so memory and time follow
    the tokens, not the longest response of the batch; the loss is a sum over sequences divided
    by global normalisers (:mod:`lze_trainer.loss`), so the order changes nothing but float
    rounding. For a sorted list, greedy cutting gives the fewest chunks. A micro-batch's logits
    are rows x length x V in the model's dtype, so ``max_tokens`` bounds them by
    ``max_tokens x V x 2`` bytes in bf16 (and their gradient by as much again)."""
    sequences = sorted(((g, j) for g in groups for j in range(len(g.responses))),
                       key=lambda s: -_length(*s))
    chunks: list[list[tuple[RolloutGroup, int]]] = []
    for seq in sequences:
        if chunks and _fits(chunks[-1], micro_batch_size, max_tokens):
            chunks[-1].append(seq)
        else:
            chunks.append([seq])
    return chunks


def _fits(chunk, micro_batch_size: int, max_tokens: Optional[int]) -> bool:
    """Whether one more (no longer) sequence can join ``chunk``."""
    rows = len(chunk) + 1
    return rows <= micro_batch_size and (max_tokens is None or rows * _length(*chunk[0]) <= max_tokens)


def _length(group: RolloutGroup, j: int) -> int:
    return len(group.prompt) + len(group.responses[j].token_ids)


def _collate(chunk, pad_id: int) -> SequenceBatch:
    length = max(_length(g, j) for g, j in chunk)
    n = len(chunk)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length))
    engine_logprobs = torch.zeros((n, length))
    advantages = torch.zeros(n)
    off_policy = torch.tensor([group.off_policy for group, _ in chunk])
    for i, (group, j) in enumerate(chunk):
        response = group.responses[j]
        start, end = len(group.prompt), len(group.prompt) + len(response.token_ids)
        input_ids[i, :start] = torch.tensor(group.prompt)
        input_ids[i, start:end] = torch.tensor(response.token_ids)
        attention[i, :end] = 1
        loss_mask[i, start:end] = group.weight
        engine_logprobs[i, start:end] = torch.tensor(response.logprobs)
        advantages[i] = group.advantages[j] if group.weight else 0.0
    return SequenceBatch(input_ids, attention, loss_mask, advantages, engine_logprobs, off_policy)

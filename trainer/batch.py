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
    """One micro-batch: each distinct prompt once, as a prefix (every token but its last), and
    per sequence what follows it, ``input_ids``: the prompt's last token, then the response,
    right-padded (at least one column: a one-token prompt's prefix is all padding). The actor
    runs each prefix once and its sequences on top of its keys and values
    (:meth:`lze_trainer.actor.Actor.sequence_logits`), so a group's G sequences share one pass over
    their prompt. Per-token tensors are aligned with ``input_ids``: position t holds what concerns
    the token at t. Without a prefix (``prefix_ids`` None) ``input_ids`` are whole sequences."""

    input_ids: torch.Tensor  # [n, L] long
    attention_mask: torch.Tensor  # [n, L] long
    loss_mask: torch.Tensor  # [n, L] float: sequence weight on response tokens, 0 elsewhere
    advantages: torch.Tensor  # [n] float
    engine_logprobs: torch.Tensor  # [n, L] float, the rollout engine's log-probs
    off_policy: torch.Tensor  # [n] bool: replayed sequences, whose engine log-probs are mu
    old_logprobs: torch.Tensor | None = None  # [n, L], set when the update needs them
    prefix_ids: torch.Tensor | None = None  # [m, P] long: prompts but their last token, right-padded
    prefix_mask: torch.Tensor | None = None  # [m, P] long
    prefix_index: torch.Tensor | None = None  # [n] long: the row of prefix_ids each sequence follows

    def to(self, device) -> "SequenceBatch":
        return replace(self, **{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                for k, v in vars(self).items()})

    def sequence_lengths(self) -> torch.Tensor:
        """[n] tokens of each whole sequence (prompt and response)."""
        lengths = self.attention_mask.sum(dim=1)
        if self.prefix_ids is not None:
            lengths = lengths + self.prefix_mask.sum(dim=1)[self.prefix_index]
        return lengths

    def positions(self) -> torch.Tensor:
        """[n, L] position of each token of ``input_ids`` in its whole sequence."""
        start = torch.zeros_like(self.advantages, dtype=torch.long)
        if self.prefix_ids is not None:
            start = self.prefix_mask.sum(dim=1)[self.prefix_index]
        steps = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return start[:, None] + steps

    def whole_sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, P + L] ids, attention mask and positions of every sequence with its prefix in front
        (the prefix's right padding between the two, masked)."""
        if self.prefix_ids is None:
            return self.input_ids, self.attention_mask, self.positions()
        prefix = torch.arange(self.prefix_ids.shape[1], device=self.input_ids.device)
        return (torch.cat([self.prefix_ids[self.prefix_index], self.input_ids], dim=1),
                torch.cat([self.prefix_mask[self.prefix_index], self.attention_mask], dim=1),
                torch.cat([prefix.expand(len(self.input_ids), -1), self.positions()], dim=1))


def micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: Optional[int], count: int,
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


def num_micro_batches(groups: Sequence[RolloutGroup], micro_batch_size: Optional[int],
                      max_tokens: Optional[int] = None) -> int:
    return len(pack(groups, micro_batch_size, max_tokens))


def pack(groups: Sequence[RolloutGroup], micro_batch_size: Optional[int],
         max_tokens: Optional[int] = None) -> list[list[tuple[RolloutGroup, int]]]:
    """(group, response index) chunks: sequences sorted longest response first (stable, so a
    group's sequences stay together where lengths tie), cut greedily into chunks of at most
    ``micro_batch_size`` rows (None: no row cap) whose padded size, rows x (longest prefix +
    longest suffix), is at most ``max_tokens`` (None: no token cap). A sequence longer than the
    cap gets a chunk of its own (config validation rules that out for the trainer's sequences).

    Sorting makes a chunk's padding the length spread of neighbours, so memory and time follow
    the tokens, not the longest response of the batch; the loss is a sum over sequences divided
    by global normalisers (:mod:`lze_trainer.loss`), so the order changes nothing but float
    rounding. For a sorted list, greedy cutting gives the fewest chunks. A micro-batch's logits
    are rows x suffix length x V in the model's dtype, so ``max_tokens`` bounds them by
    ``max_tokens x V x 2`` bytes in bf16 (and their gradient by as much again)."""
    sequences = sorted(((g, j) for g in groups for j in range(len(g.responses))),
                       key=lambda s: -_suffix_length(*s))
    chunks: list[list[tuple[RolloutGroup, int]]] = []
    longest_prefix = 0  # of the last chunk
    for group, j in sequences:
        prefix = max(longest_prefix, _prefix_length(group))
        if chunks and _fits(len(chunks[-1]) + 1, prefix + _suffix_length(*chunks[-1][0]),
                            micro_batch_size, max_tokens):
            chunks[-1].append((group, j))
        else:
            chunks.append([(group, j)])
            prefix = _prefix_length(group)
        longest_prefix = prefix
    return chunks


def _fits(rows: int, length: int, micro_batch_size: Optional[int],
          max_tokens: Optional[int]) -> bool:
    """Whether a chunk of ``rows`` padded to ``length`` tokens is within the caps."""
    return ((micro_batch_size is None or rows <= micro_batch_size)
            and (max_tokens is None or rows * length <= max_tokens))


def _prefix_length(group: RolloutGroup) -> int:
    return max(len(group.prompt) - 1, 0)


def _suffix_length(group: RolloutGroup, j: int) -> int:
    return len(group.prompt) - _prefix_length(group) + len(group.responses[j].token_ids)


def _collate(chunk, pad_id: int) -> SequenceBatch:
    prompts = list(dict.fromkeys(tuple(group.prompt) for group, _ in chunk))
    prefix_ids, prefix_mask = _right_padded([p[:-1] for p in prompts], pad_id, min_width=1)
    row_of = {p: i for i, p in enumerate(prompts)}
    n, length = len(chunk), max(_suffix_length(g, j) for g, j in chunk)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length))
    engine_logprobs = torch.zeros((n, length))
    advantages = torch.zeros(n)
    off_policy = torch.tensor([group.off_policy for group, _ in chunk])
    for i, (group, j) in enumerate(chunk):
        response = group.responses[j]
        last = group.prompt[-1:]
        start, end = len(last), len(last) + len(response.token_ids)
        input_ids[i, :end] = torch.tensor(last + response.token_ids, dtype=torch.long)
        attention[i, :end] = 1
        loss_mask[i, start:end] = group.weight
        engine_logprobs[i, start:end] = torch.tensor(response.logprobs)
        advantages[i] = group.advantages[j] if group.weight else 0.0
    prefix_index = torch.tensor([row_of[tuple(group.prompt)] for group, _ in chunk])
    return SequenceBatch(input_ids, attention, loss_mask, advantages, engine_logprobs, off_policy,
                         prefix_ids=prefix_ids, prefix_mask=prefix_mask, prefix_index=prefix_index)


def _right_padded(rows: Sequence[Sequence[int]], pad_id: int,
                  min_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), max(min_width, *map(len, rows))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask

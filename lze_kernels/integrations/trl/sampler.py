"""The forward pruner (docs/spec.md §5) as a drop-in for TRL's ``RepeatSampler``.

TRL's sampler walks a permutation of the dataset in chunks of ``batch_size`` prompts (one
generation batch), yields each prompt ``mini_repeat_count`` (= num_generations) times in a row
and each chunk ``repeat_count`` times. :class:`PrunedRepeatSampler` keeps that structure and its
length, so batch shapes and steps per epoch do not change; only the prompts differ. At the start
of each epoch :class:`EpochPlanner` draws the epoch's replays (``LZESelector.begin_epoch``) and
orders the permutation eligible-first (``LZESelector.take_eligible``); the chunks then cycle
through the eligible prompts, so a pruned prompt is not sampled unless it was drawn for replay.
Only when fewer than ``batch_size`` prompts are eligible are ineligible ones padded in.

The plan is fixed for the whole epoch and saved with the checkpoint: a run resumed mid-epoch
samples exactly what the uninterrupted run sampled, whatever the selector learnt since.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

from ...selector import LZESelector


class EpochPlanner:
    """Per-epoch sampling order over the selector's prompts (dataset rows ``0..N-1``)."""

    def __init__(self, selector: LZESelector, seed: int, shuffle: bool = True):
        self.selector = selector
        self.seed = seed
        self.shuffle = shuffle
        self._epoch: Optional[int] = None
        self._order: Optional[torch.Tensor] = None  # [N] int64 on the CPU, eligible first
        self._num_eligible = 0

    @property
    def num_prompts(self) -> int:
        return self.selector.num_prompts

    def plan(self, epoch: int) -> tuple[torch.Tensor, int]:
        """``(order [N], num_eligible)`` of ``epoch``; drawn once, at its first request."""
        if epoch != self._epoch:
            self.selector.begin_epoch()
            n = self.num_prompts
            device = self.selector.device
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                candidates = torch.randperm(n, generator=generator).to(device)
            else:
                candidates = torch.arange(n, device=device)
            order, eligible = self.selector.take_eligible(candidates, n)
            # Once per epoch: the DataLoader yields host ints, so the order lives on the host.
            self._epoch, self._order = epoch, order.cpu()
            self._num_eligible = int(eligible.sum())
        return self._order, self._num_eligible

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "order": self._order, "num_eligible": self._num_eligible}

    def load_state_dict(self, state: dict) -> None:
        order = state["order"]
        if order is not None and tuple(order.shape) != (self.num_prompts,):
            raise ValueError(f"state['order']: expected {self.num_prompts} prompt ids, "
                             f"got shape {tuple(order.shape)}")
        self._epoch, self._order = state["epoch"], None if order is None else order.cpu()
        self._num_eligible = state["num_eligible"]


def chunk_prompts(order: torch.Tensor, num_eligible: int, chunk: int, size: int) -> torch.Tensor:
    """Prompts of generation chunk ``chunk``: the next ``size`` eligible prompts of ``order``,
    cycling (distinct within the chunk), or all eligible ones padded with ineligible ones."""
    if num_eligible < size:
        return order[:size]
    positions = (chunk * size + torch.arange(size)) % num_eligible
    return order[positions]


class PrunedRepeatSampler(Sampler[int]):
    """TRL's ``RepeatSampler`` index structure over :class:`EpochPlanner`'s plan."""

    def __init__(self, planner: EpochPlanner, mini_repeat_count: int, batch_size: int,
                 repeat_count: int):
        if not 1 <= batch_size <= planner.num_prompts:
            raise ValueError(f"batch_size: expected an int in [1, {planner.num_prompts}] "
                             f"(prompts per generation batch), got {batch_size!r}")
        self.planner = planner
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer (through accelerate) before each epoch, also on resume."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order, num_eligible = self.planner.plan(self.epoch)
        self.epoch += 1  # a loop that never calls set_epoch still moves on
        for chunk in range(self.planner.num_prompts // self.batch_size):
            # ``order`` is a host tensor (plan): no device sync here.
            prompts = chunk_prompts(order, num_eligible, chunk, self.batch_size).tolist()
            for _ in range(self.repeat_count):
                for index in prompts:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        chunks = self.planner.num_prompts // self.batch_size
        return chunks * self.batch_size * self.mini_repeat_count * self.repeat_count

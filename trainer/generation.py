"""Rolling out and scoring prompt groups on this rank's engine, and gathering them over ranks.

The services every selection method builds on (:mod:`lze_trainer.methods`): a method decides which
prompts to roll out, how many times and for what ``purpose`` (the step's training groups, a DOTS
reference set, a SPEED screening round); this module generates them on the engine of this rank's
shard, scores them, books their tokens in the compute ledger, and all-gathers the ``[n, width]``
rewards so every rank can make the same decision from the same numbers.

Data parallelism: a global list of n prompts is split over the rollout engines in contiguous
slices (:meth:`Generation.local_rows`); tensor-parallel peers of one engine hold the same slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import distributed as D
from .batch import RolloutGroup, is_mixed
from .compute import ComputeLedger
from .metrics import Timer
from .reward import RewardScorer, as_correctness
from .rollout import SamplingSpec

# Engine seed offsets per purpose: each purpose samples its own stream.
_PURPOSE_SEEDS = {"train": 0, "eval": 1, "reference": 2, "screening": 3, "continuation": 4,
                  "predictor": 5,  # predictor: DOTS's offline labels (methods.dots_predictor)
                  "refill": 6}  # refill: dynamic sampling's top-up rounds (methods.fill)
# Purposes whose rollouts extend groups booked already (SPEED's continuation of its screened
# prompts): their tokens and rollouts count, their groups do not count again.
_EXTENDING = {"continuation"}


@dataclass
class GatheredGroups:
    """A global batch's rewards as every rank sees them (host tensors)."""

    rewards: torch.Tensor  # [n, width] float32, 0 where invalid
    valid: torch.Tensor  # [n, width] bool
    lengths: torch.Tensor  # [n, width] int32 response tokens

    def zero_variance(self) -> torch.Tensor:
        """[n] bool: rows with responses whose rewards are all equal (no GRPO gradient)."""
        high = torch.where(self.valid, self.rewards, -torch.inf).amax(dim=1)
        low = torch.where(self.valid, self.rewards, torch.inf).amin(dim=1)
        return (high == low) & self.valid.any(dim=1)


class Generation:
    def __init__(self, cfg, world: D.World, engine, scorer: RewardScorer, train_set, tokenizer,
                 ledger: ComputeLedger, write: Callable[[str], None]):
        """``write`` shows a line to the user (the trainer's metrics writer)."""
        self.cfg, self.world, self.engine, self.scorer = cfg, world, engine, scorer
        self.write = write
        self.train, self.tokenizer, self.ledger = train_set, tokenizer, ledger
        self.tp = cfg.rollout.tensor_parallel_size
        self.shard = world.rank // self.tp
        self.num_shards = world.size // self.tp
        self.sampling = SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p,
                                     cfg.rollout.max_new_tokens)
        self.step = 0  # keys the engine seeds
        self.timer = Timer()  # the current step's phases
        self.scorer_errors = self.scorer_timeouts = 0

    def begin_step(self, step: int, timer: Timer) -> None:
        self.step, self.timer = step, timer

    # ------------------------------------------------------------------ where rows go

    def local_rows(self, n: int) -> range:
        """The rows of a global list of ``n`` prompts this rank's engine rolls out: contiguous
        slices of ``ceil(n / shards)`` (the last ones may be shorter or empty)."""
        per_shard = -(-n // self.num_shards)
        start = min(self.shard * per_shard, n)
        return range(start, min(start + per_shard, n))

    # ------------------------------------------------------------------ generate and score

    def generate_and_score(self, prompt_ids: Sequence[int], counts: Sequence[int],
                           purpose: str | Sequence[str], rows: Sequence[int] | None = None,
                           round: int = 0) -> list[RolloutGroup]:
        """``counts[i]`` responses to dataset prompt ``prompt_ids[i]``, scored, as groups whose
        ``row`` is ``rows[i]`` (default: ``i``). ``purpose`` is the call's, or one per prompt (one
        engine call serving several, e.g. SPEED's continuations fused with a screening: each
        booked under its own). Every call of one step needs its own (last purpose, ``round``) so
        that it samples a stream of its own, reproducibly."""
        purposes = [purpose] * len(prompt_ids) if isinstance(purpose, str) else list(purpose)
        rows = list(range(len(prompt_ids))) if rows is None else list(rows)
        prompts = [self.train.token_ids[pid] for pid in prompt_ids]
        with self.timer("rollout"):
            completions = self.engine.generate(prompts, list(counts), self.sampling,
                                               seed=self.seed(purposes[-1], round))
        groups = [RolloutGroup(row=row, prompt_id=pid, prompt=prompt, responses=c, rewards=[])
                  for row, pid, prompt, c in zip(rows, prompt_ids, prompts, completions)]
        with self.timer("reward"):
            self._score(groups)
        for kind in dict.fromkeys(purposes):
            self._book([g for g, p in zip(groups, purposes) if p == kind], kind)
        return groups

    def seed(self, purpose: str, round: int = 0) -> int:
        """Engine seed of this step, shard, purpose and round: a resumed run samples what the lost
        one did."""
        offset = _PURPOSE_SEEDS[purpose] + 8 * round
        return (self.cfg.trainer.seed * 1_000_003 + self.step * 7919 + self.shard * 104_729
                + offset) % 2**31

    def _score(self, groups: list[RolloutGroup]) -> None:
        texts, rows = [], []
        for g in groups:
            for c in g.responses:
                texts.append(self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                rows.append(self.train.rows[g.prompt_id])
        result = self.scorer.score(texts, rows)
        rewards = iter(as_correctness(result.rewards, self.cfg.reward.correct_threshold))
        for g in groups:
            g.rewards = [next(rewards) for _ in g.responses]
        self.scorer_errors += result.errors
        self.scorer_timeouts += result.timeouts
        if result.first_error:
            self.write(f"rank {self.world.rank}: {result.errors} scorer errors this step, "
                       f"first: {result.first_error}")

    def _book(self, groups: list[RolloutGroup], purpose: str) -> None:
        if self.world.rank % self.tp:  # tensor-parallel peers generated the same tokens once
            return
        new_groups = [] if purpose in _EXTENDING else [g for g in groups if g.responses]
        self.ledger.add_rollouts(
            purpose,
            prompt_tokens=sum(len(g.prompt) * len(g.responses) for g in groups),
            generated_tokens=sum(len(c.token_ids) for g in groups for c in g.responses),
            rollouts=sum(len(g.responses) for g in groups),
            groups=len(new_groups),
            zero_variance_groups=sum(1 for g in new_groups if not is_mixed(g.rewards)))

    # ------------------------------------------------------------------ gather

    def gather(self, local_groups: list[RolloutGroup], n: int, width: int) -> GatheredGroups:
        """[n, width] rewards, validity and lengths of a global list of ``n`` prompts from the
        groups each engine generated for its :meth:`local_rows`, in one collective (the three
        travel as one float32 tensor: lengths are exact below 2**24 tokens)."""
        per_shard = -(-n // self.num_shards)
        local = torch.zeros(per_shard, width, 3)  # reward, valid, length
        start = self.local_rows(n).start
        for g in local_groups:
            i, m = g.row - start, len(g.responses)
            local[i, :m, 0] = torch.tensor(g.rewards, dtype=torch.float32)
            local[i, :m, 1] = 1.0
            local[i, :m, 2] = torch.tensor([len(c.token_ids) for c in g.responses],
                                           dtype=torch.float32)
        rows = self._gather_rows(local.to(self.world.device))[:n].cpu()
        return GatheredGroups(rows[..., 0].contiguous(), rows[..., 1] > 0,
                              rows[..., 2].to(torch.int32))

    def _gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[shards * rows, ...] from every engine's [rows, ...] (tensor-parallel peers hold
        copies; one of them counts)."""
        rows, rest = local.shape[0], tuple(local.shape[1:])
        gathered = torch.empty((self.world.size * rows,) + rest, dtype=local.dtype,
                               device=local.device)
        D.all_gather_rows(gathered, local)
        return gathered.view((self.world.size, rows) + rest)[::self.tp].flatten(0, 1)

    def take_scorer_counts(self) -> dict[str, float]:
        """This step's scorer errors and timeouts over all ranks (collective)."""
        errors, timeouts = D.all_reduce_many([self.scorer_errors, self.scorer_timeouts])
        self.scorer_errors = self.scorer_timeouts = 0
        return {"reward/scorer_errors": errors, "reward/scorer_timeouts": timeouts}

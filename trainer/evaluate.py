"""Held-out accuracy with the rollout engines: greedy and sampled, each set split over engines.

For a set of n prompts: ``eval/<set>/pass@1`` is the greedy accuracy, ``eval/<set>/sampled_acc``
the mean accuracy of ``rollout.eval_samples`` responses per prompt at ``rollout.eval_temperature``,
each with its standard error over prompts (``..._se``), so a change between two evaluations can
be judged against noise.
"""

from __future__ import annotations

import math
import time

from . import distributed as D
from .reward import as_correctness
from .rollout import SamplingSpec


def evaluate(engine, eval_sets, scorer, tokenizer, cfg, world: D.World, shard: int,
             seed: int) -> dict[str, float]:
    start = time.perf_counter()
    r = cfg.rollout
    engines = world.size // r.tensor_parallel_size
    leader = world.rank % r.tensor_parallel_size == 0  # tensor-parallel peers count once
    results: dict[str, float] = {}
    for prompt_set in eval_sets:
        mine = list(range(shard, len(prompt_set), engines))
        prompts = [prompt_set.token_ids[i] for i in mine]
        rows = [prompt_set.rows[i] for i in mine]
        greedy, sampled = _accuracy_sums(engine, scorer, tokenizer, cfg, prompts, rows, seed)
        sums = D.all_reduce_many([*greedy, *sampled] if leader else [0.0] * 4)
        n = len(prompt_set)
        for kind, (total, squares) in (("pass@1", sums[:2]), ("sampled_acc", sums[2:])):
            mean = total / n
            results[f"eval/{prompt_set.name}/{kind}"] = mean
            results[f"eval/{prompt_set.name}/{kind}_se"] = _standard_error(mean, squares / n, n)
        results[f"eval/{prompt_set.name}/n"] = float(n)
    results["timing_s/eval"] = time.perf_counter() - start
    return results


def _accuracy_sums(engine, scorer, tokenizer, cfg, prompts, rows, seed: int
                   ) -> tuple[tuple[float, float], tuple[float, float]]:
    """Greedy and sampled passes over the same prompts in one engine call (the engine batches
    them together); for each, the sum over prompts of each prompt's mean reward and of its
    square (for the error)."""
    r = cfg.rollout
    n = len(prompts)
    greedy = SamplingSpec(0.0, 1.0, r.max_new_tokens)
    sampled = SamplingSpec(r.eval_temperature, r.top_p, r.max_new_tokens)
    completions = engine.generate(list(prompts) * 2, [1] * n + [r.eval_samples] * n,
                                  [greedy] * n + [sampled] * n, seed=seed)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True)
             for group in completions for c in group]
    scored_rows = list(rows) + [row for row in rows for _ in range(r.eval_samples)]
    rewards = as_correctness(scorer.score(texts, scored_rows).rewards,
                             cfg.reward.correct_threshold)
    k = r.eval_samples
    sampled_means = [sum(rewards[n + i * k:n + (i + 1) * k]) / k for i in range(n)]
    return _sums(rewards[:n]), _sums(sampled_means)


def _sums(per_prompt: list[float]) -> tuple[float, float]:
    return sum(per_prompt), sum(p * p for p in per_prompt)


def _standard_error(mean: float, mean_of_squares: float, n: int) -> float:
    if n < 2:
        return 0.0
    variance = max(mean_of_squares - mean * mean, 0.0) * n / (n - 1)
    return math.sqrt(variance / n)

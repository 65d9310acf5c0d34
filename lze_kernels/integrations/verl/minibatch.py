"""How many groups one verl step trains on: LZE's k in whole mini-batches.

verl splits the update into mini-batches of ``ppo_mini_batch_size x n`` rows and each of them
evenly over the data-parallel ranks (the legacy actor asserts it; v1 pads the batch with no-op
rows of 128 tokens instead), and with ``actor.use_prefix_grouper`` (legacy) gives each rank whole
groups. So a step can train on a multiple of ``unit`` groups (:func:`group_unit`), and LZE's
``k0 = floor(B x keep_ratio)`` (docs/spec.md §4) is rounded to the **nearest** such multiple
(:func:`keep_count`): rounded up, the extra groups are the next ones by energy; rounded down,
the last of the top k0 stay out. The optimizer steps keep the size the user set (one per
``ppo_mini_batch_size`` groups, as in plain GRPO). The cost: up to half a unit of groups more or
fewer than ``k0`` per step, ``|k / B - keep_ratio| <= unit / (2 B)`` (B = 1,024,
``ppo_mini_batch_size`` = 256, keep_ratio 0.4: k = 512, 0.5); where ``k0`` is under half a unit,
one whole unit (at ``ppo_mini_batch_size = train_batch_size``: every group, no selection). Every
set-up that plain GRPO accepts has ``unit`` dividing B, so none is refused.
"""

from __future__ import annotations

import math

import numpy as np

from ...config import num_keep


def group_unit(rows_multiple: int, rollout_n: int, data_parallel: int = 1,
               whole_groups_per_rank: bool = False) -> int:
    """The fewest groups of ``rollout_n`` rows whose rows are a multiple of ``rows_multiple``
    (verl's: ``lcm(ppo_mini_batch_size x n, dp)``); with ``whole_groups_per_rank`` also a
    multiple of ``data_parallel`` groups."""
    unit = rows_multiple // math.gcd(rows_multiple, rollout_n)
    return math.lcm(unit, data_parallel) if whole_groups_per_rank else unit


def keep_count(num_groups: int, keep_ratio: float, unit: int) -> int:
    """Groups a step keeps of ``num_groups``: ``floor(num_groups x keep_ratio)`` rounded to the
    nearest multiple of ``unit`` (halves up), at least one unit, at most the whole units in
    ``num_groups`` (all of them when there is no whole unit)."""
    units = num_groups // unit
    if units == 0:
        return num_groups
    nearest = math.floor(num_keep(num_groups, keep_ratio) / unit + 0.5)
    return min(max(nearest, 1), units) * unit


def groups_to_train(method: str, num_groups: int, keep_ratio: float, num_selected: int,
                    unit: int) -> int:
    """The groups a step trains on: LZE :func:`keep_count`; DAPO the ``num_selected`` groups
    whose rewards differ, rounded up to a whole unit (at most ``num_groups``)."""
    if method == "dapo":
        return min(num_groups, max(unit, -(-num_selected // unit) * unit))
    return keep_count(num_groups, keep_ratio, unit)


def leading_groups_near(sizes: np.ndarray, target_rows: float) -> int:
    """How many leading groups (``sizes``: their rows, in ranking order) come nearest to
    ``target_rows`` rows, at least one (ties: the fewer). Groups of ``n`` rows and a target of
    ``k x n``: exactly k."""
    return int(np.argmin(np.abs(np.cumsum(sizes) - target_rows))) + 1

"""How many groups one verl step trains on: LZE's k in whole mini-batches.

verl splits the update into mini-batches of ``ppo_mini_batch_size x n`` rows and each of them
evenly over the data-parallel ranks (the legacy actor asserts it; v1 pads the batch with no-op
rows of 128 tokens instead), and with ``actor.use_prefix_grouper`` (legacy) gives each rank whole
groups. So a step can train on a multiple of ``unit`` groups (:func:`group_unit`), and LZE's
``k0 = floor(B x keep_ratio)`` (at least 1; docs/spec.md §4) is rounded to the **nearest** such
multiple (:func:`keep_count`): rounded up, the extra groups are the next ones by energy; rounded
down, the last of the top k0 stay out. The optimizer steps keep the size the user set (one per
``ppo_mini_batch_size`` groups, as in plain GRPO).

The rounding, exactly as :func:`keep_count` computes it, with ``units = B // unit``:
``k = clamp(floor(k0 / unit + 1/2), 1, units) x unit`` (``k = B`` when ``units`` is 0). So
``|k - k0| <= unit / 2`` whenever ``unit / 2 <= k0 < (units + 1/2) x unit``; below that ``k`` is
one whole unit, above it ``units x unit``. Measured from ``B x keep_ratio`` instead of ``k0``
the floor adds up to one group: ``|k - B x keep_ratio| < unit / 2 + 1`` (B = 30, a unit of 3,
keep_ratio 0.165: ``B x keep_ratio`` = 4.95, k0 = 4, k = 3). B = 1,024, ``ppo_mini_batch_size``
= 256, keep_ratio 0.4: k0 = 409, k = 512 (0.5). Where ``k = B`` (no whole unit in B, or ``k0``
rounds up to every unit, e.g. ``ppo_mini_batch_size = train_batch_size``) nothing is selected:
:func:`no_selection_warning` says so at start-up. Every set-up that plain GRPO accepts has
``unit`` dividing B, so none is refused.
"""

from __future__ import annotations

import math
from typing import Optional

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


def no_selection_warning(method: str, num_groups: int, keep_ratio: float,
                         unit: int) -> Optional[str]:
    """Why a step of ``num_groups`` groups in units of ``unit`` keeps every group, or None when
    the method can leave groups out."""
    if method == "dapo":
        if unit < num_groups:
            return None
        return (f"DAPO keeps every group: each update takes whole mini-batches of {unit} groups "
                f"and a sample holds {num_groups} (lze/keep_ratio_effective = 1.0); lower "
                "ppo_mini_batch_size to leave groups out")
    kept = keep_count(num_groups, keep_ratio, unit)
    if kept < num_groups:
        return None
    return (f"LZE selects nothing: each update takes whole mini-batches of {unit} groups "
            f"(ppo_mini_batch_size, and rows the data-parallel ranks divide), and k = "
            f"floor({num_groups} x {keep_ratio:g}) = {num_keep(num_groups, keep_ratio)} of a "
            f"sample's {num_groups} groups rounds to all {kept} (lze/keep_ratio_effective = "
            "1.0). Lower ppo_mini_batch_size (or raise data.train_batch_size, or lower "
            "trainer.v1.sync.parameter_sync_step) so that a sample holds several mini-batches")

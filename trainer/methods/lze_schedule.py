"""The LZE release's keep-ratio schedule, as an option of ``lze``
(``selection.keep_ratio_schedule=release``).

The public LZE release (Stellaris167/LZE at a508a2f) does not select by energy in epoch 0: its
selection mask applies only when ``epoch > 0`` (``verl/trainer/ppo/ray_trainer.py``:2172), but
whenever its configured ratio is below 1, groups whose advantages are all zero are removed in
every epoch (2161-2168, 2186), so epoch 0 trains exactly the groups with mixed rewards (DAPO's
filter) while each prompt is seen once and anchored. From epoch 1 the keep ratio ramps linearly
from 1.0 to its target over ``schedule.ramp_epochs`` epochs and stays there, never below
``schedule.floor`` (``sample_attention/backward_scorer.py``:396-398)::

    keep = groups with mixed rewards                               e = 0
    ratio(e) = max(floor, 1 - (1 - target) * min(e / ramp, 1))     e >= 1

``k = clamp(floor(B * ratio), 1, B)`` as in docs/spec.md §4, top-k by energy with the selector's seeded
Gumbel noise (zero-variance groups have zero energy and never fill the quota, as in the release);
the epoch is the sampler's, a host integer, so the schedule costs no synchronisation.

Which setting is which: this schedule with the defaults (target 0.7, floor 0.3, ramp 3 epochs) is
the release's *config default* (``verl/trainer/config/ppo_trainer.yaml``:229-239). The release's
*published example* (``examples/data_selection/run_qwen2.5_math_selection.sh``: ratio 0.4,
``warmup_transition_epochs=0``) and the paper's "40% of the training data per step" are a fixed
0.4 from the first step: that is plain ``lze`` (``keep_ratio_schedule=fixed``, ``keep_ratio=0.4``).
"""

from __future__ import annotations

import torch

from lze_kernels import ops

from . import register
from .base import (Method, MethodContext, StepBatch, keep_all, keep_mixed,
                   keep_top_energy)
from ..selection import Selection


def release_keep_ratio(epoch: int, target: float, floor: float, ramp_epochs: int) -> float:
    """The release's keep ratio in ``epoch`` (see the module docstring; 1.0 in epoch 0, where the
    groups with mixed rewards are kept instead of a top-k)."""
    if epoch == 0:
        return 1.0
    return max(floor, 1.0 - (1.0 - target) * min(epoch / ramp_epochs, 1.0))


class ScheduledTopEnergy:
    """Group filter: the groups with mixed rewards in epoch 0, then LZE's top-k with ``k`` from
    the release's schedule of the current epoch."""

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx

    def epoch(self) -> int:
        return max(self.ctx.sampler.epoch - 1, 0)  # the sampler counts epochs started

    def keep_ratio(self) -> float:
        s = self.ctx.cfg.selection
        return release_keep_ratio(self.epoch(), s.schedule.target, s.schedule.floor,
                                  s.schedule.ramp_epochs)

    def __call__(self, selection: Selection, batch: StepBatch, step: int) -> torch.Tensor:
        s, lze = self.ctx.cfg.selection, self.ctx.selector.lze
        if s.schedule.target >= 1.0:  # the release prunes nothing when its ratio is 1
            return keep_all(selection, batch, step)
        ratio = self.keep_ratio()
        if self.epoch() == 0:
            return keep_mixed(selection, batch, step)
        k = ops.num_keep(selection.energy.shape[0], ratio)
        return ops.topk_mask(selection.energy, k, s.noise_scale, lze.config.seed,
                             lze.state.step_counter, backend=lze.backend).keep_mask


def lze_method(ctx: MethodContext) -> Method:
    """``lze`` with the fixed keep ratio (docs/spec.md §4) or the release's schedule."""
    if ctx.cfg.selection.keep_ratio_schedule == "release":
        return Method("lze", ctx, keep=ScheduledTopEnergy(ctx))
    return Method("lze", ctx, keep=keep_top_energy)


register("lze")(lze_method)

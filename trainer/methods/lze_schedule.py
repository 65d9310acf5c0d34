"""The LZE release's keep-ratio schedule, as an option of ``lze``
(``selection.keep_ratio_schedule=release``).

The public LZE release does not select from the first step: during epoch 0 every group is kept
(each prompt is seen once and anchored first), then the keep ratio ramps linearly from 1.0 to its
target over ``schedule_ramp_epochs`` epochs and stays there, never below ``schedule_floor``::

    ratio(e) = 1                                                   e = 0
    ratio(e) = max(floor, 1 - (1 - target) * min(e / ramp, 1))     e >= 1

(release defaults: target 0.7, floor 0.3, ramp 3 epochs). ``k = clamp(floor(B * ratio), 1, B)``
as in SPEC 4, top-k by energy with the selector's seeded Gumbel noise; the epoch is the sampler's,
a host integer, so the schedule costs no synchronisation.
"""

from __future__ import annotations

import torch

from lze_kernels import ops

from . import register
from .base import Method, MethodContext, StepBatch, keep_all, keep_top_energy
from ..selection import Selection


def release_keep_ratio(epoch: int, target: float, floor: float, ramp_epochs: int) -> float:
    """The release's keep ratio in ``epoch`` (see the module docstring)."""
    if epoch == 0:
        return 1.0
    return max(floor, 1.0 - (1.0 - target) * min(epoch / ramp_epochs, 1.0))


class ScheduledTopEnergy:
    """Group filter: LZE's top-k with ``k`` from the release's schedule of the current epoch."""

    def __init__(self, ctx: MethodContext):
        self.ctx = ctx

    def keep_ratio(self) -> float:
        s = self.ctx.cfg.selection
        epoch = max(self.ctx.sampler.epoch - 1, 0)  # the sampler counts epochs started
        return release_keep_ratio(epoch, s.schedule_target, s.schedule_floor,
                                  s.schedule_ramp_epochs)

    def __call__(self, selection: Selection, batch: StepBatch, step: int) -> torch.Tensor:
        ratio = self.keep_ratio()
        if ratio >= 1.0:
            return keep_all(selection, batch, step)
        s, lze = self.ctx.cfg.selection, self.ctx.selector.lze
        k = ops.num_keep(selection.energy.shape[0], ratio)
        return ops.topk_mask(selection.energy, k, s.noise_scale, lze.config.seed,
                             lze.state.step_counter, backend=lze.backend).keep_mask


def lze_method(ctx: MethodContext) -> Method:
    """``lze`` with the fixed keep ratio (SPEC 4) or the release's schedule."""
    if ctx.cfg.selection.keep_ratio_schedule == "release":
        return Method("lze", ctx, keep=ScheduledTopEnergy(ctx))
    return Method("lze", ctx, keep=keep_top_energy)


register("lze")(lze_method)

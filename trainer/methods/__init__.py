"""Selection methods of the trainer, one registry by name (``selection.method``).

Each method is a module of its own that registers a builder with :func:`register`; the trainer
builds the configured one with :func:`build` and calls its phases (:class:`Method`). Switches
wrap the built method's parts (the forward pruner, rollout allocation, HIVE's two stages before
rollout, rollout replay).

* ``grpo``: every group (plain GRPO), the sampler's next B prompts; ``dapo``: DAPO's dynamic
  sampling (Yu et al. 2025): generation rounds until B groups with non-zero reward variance are
  collected (:mod:`.fill`); ``lze``: the top ``floor(keep_ratio x B)`` groups by Learning-Zone
  Energy (docs/spec.md §3-4) of the sampler's next B prompts, with a fixed keep ratio or the LZE
  release's schedule (:mod:`.lze_schedule`);
* ``dots`` (:mod:`.dots`), ``greso`` (:mod:`.greso`), ``speed`` (:mod:`.speed`): choose before
  rollout by predicted difficulty, by zero-variance streaks (on dynamic sampling), or by a
  screening round (filling the batch, carrying surplus to the next step);
* switches: ``selection.refill`` (LZE: top-up rounds until the top-k quota has groups with
  energy > 0, the loop of :mod:`.fill`), ``selection.entropy_filter`` (HIVE: a shortlist by
  reward history, then the top half of it by prompt entropy, :mod:`.hive`), ``replay.ratio``
  (Rollout Replay, :mod:`.replay`), ``selection.keep_top_energy`` (a method that chooses before
  rollout then trains only LZE's top ``floor(keep_ratio x B)`` of its groups by energy, e.g.
  SPEED's screened batch: forward and backward selection combined).
"""

from __future__ import annotations

from typing import Callable

from .base import (Method, MethodContext, PromptPlan, SampledPrompts, StepBatch, keep_all,
                   keep_mixed, keep_top_energy)
from .fill import FillingPrompts, fill_rule

Builder = Callable[[MethodContext], Method]
_REGISTRY: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    def add(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"selection method {name!r} is registered twice")
        _REGISTRY[name] = builder
        return builder
    return add


def names() -> list[str]:
    return sorted(_REGISTRY)


def build(ctx: MethodContext) -> Method:
    """The method ``selection.method`` names, with the switches that wrap any method."""
    name = ctx.cfg.selection.method
    if name not in _REGISTRY:
        raise ValueError(f"selection.method: expected one of {names()}, got {name!r}")
    method = _REGISTRY[name](ctx)
    if ctx.cfg.selection.entropy_filter:
        method.chooser = HistoryThenEntropy(ctx, method.chooser)
    if ctx.cfg.selection.keep_top_energy:
        method.group_filter = keep_top_energy
    if ctx.cfg.selection.refill:
        with_refill(method)
    return with_replay(method)


def with_refill(method: Method) -> None:
    """``selection.refill``: the method's plan is filled by the shared loop (:mod:`.fill`) until
    it holds ``ceil(keep_ratio x B)`` groups with mixed rewards, LZE's quota."""
    chooser = FillingPrompts(method.ctx, fill_rule(method.ctx.cfg, "lze"))
    method.chooser, method._collect, method.rank_state = chooser, chooser.collect, chooser


@register("grpo")
def _grpo(ctx: MethodContext) -> Method:
    return Method("grpo", ctx, keep=keep_all)


@register("dapo")
def _dapo(ctx: MethodContext) -> Method:
    chooser = FillingPrompts(ctx, fill_rule(ctx.cfg, "dapo"))
    return Method("dapo", ctx, chooser=chooser, collect=chooser.collect, keep=keep_mixed,
                  rank_state=chooser)


# Each module registers its method on import (after ``register`` exists).
from . import dots, greso, lze_schedule, speed  # noqa: E402,F401
from .hive import HistoryThenEntropy  # noqa: E402
from .replay import with_replay  # noqa: E402


__all__ = ["Method", "MethodContext", "PromptPlan", "SampledPrompts", "StepBatch", "build",
           "names", "register"]

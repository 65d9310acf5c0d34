"""Selection methods of the trainer, one registry by name (``selection.policy``).

Each method is a module of its own that registers a builder with :func:`register`; the trainer
builds the configured one with :func:`build` and calls its phases (:class:`Method`). Switches that
combine with any policy (the forward pruner, rollout allocation, HIVE's entropy check, rollout
replay) wrap the built method's parts.

* ``uniform``: every group (plain GRPO); ``dapo``: groups with non-zero reward variance (DAPO
  dynamic sampling, Yu et al. 2025); ``lze``: the top ``floor(keep_ratio x B)`` groups by
  Learning-Zone Energy (SPEC 3-4) — all three roll out the sampler's next B prompts.
"""

from __future__ import annotations

from typing import Callable

from .base import (Method, MethodContext, PromptPlan, SampledPrompts, StepBatch, keep_all,
                   keep_mixed, keep_top_energy)

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
    """The method ``selection.policy`` names, with the switches that wrap any method."""
    name = ctx.cfg.selection.policy
    if name not in _REGISTRY:
        raise ValueError(f"selection.policy: expected one of {names()}, got {name!r}")
    return _REGISTRY[name](ctx)


@register("uniform")
def _uniform(ctx: MethodContext) -> Method:
    return Method("uniform", ctx, keep=keep_all)


@register("dapo")
def _dapo(ctx: MethodContext) -> Method:
    return Method("dapo", ctx, keep=keep_mixed)


@register("lze")
def _lze(ctx: MethodContext) -> Method:
    return Method("lze", ctx, keep=keep_top_energy)


__all__ = ["Method", "MethodContext", "PromptPlan", "SampledPrompts", "StepBatch", "build",
           "names", "register"]

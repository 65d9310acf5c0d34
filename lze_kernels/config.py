"""Configuration of an :class:`~lze_kernels.LZESelector` (defaults: docs/spec.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

_SEED_LIMIT = 2**32


@dataclass(frozen=True)
class LZEConfig:
    """Hyper-parameters of Learning-Zone Energy selection.

    Energy ``E = D * 4p(1-p) * (1 + alpha * m)`` with anchor ``D = max(1 - p_first, d_min)``,
    momentum ``m = min(2|p - ema|, 1)`` and ``ema <- beta * ema + (1 - beta) * p``.
    """

    keep_ratio: float = 0.4  # fraction of groups kept for the actor update (k = floor(B * r))
    noise_scale: float = 0.05  # Gumbel exploration noise, relative to the energy spread; 0 = off
    seed: int = 0  # key of the counter-based noise stream (with the step index)
    beta: float = 0.9  # EMA decay of the pass rate
    d_min: float = 0.05  # floor of the anchor difficulty D
    alpha: float = 0.3  # weight of the momentum term
    eps: float = 1e-6  # GRPO advantage denominator guard
    norm_by_std: bool = True  # False: Dr. GRPO advantages r - mean
    prune_after: int = 2  # forward pruner: consecutive solved epochs before a prompt is skipped
    replay_ratio: float = 0.1  # forward pruner: chance a pruned prompt is replayed each epoch

    def __post_init__(self) -> None:
        _require(0.0 < self.keep_ratio <= 1.0, "keep_ratio", "a float in (0, 1]", self.keep_ratio)
        _require(self.noise_scale >= 0.0 and math.isfinite(self.noise_scale), "noise_scale",
                 "a finite float >= 0", self.noise_scale)
        _require(isinstance(self.seed, int) and 0 <= self.seed < _SEED_LIMIT, "seed",
                 "an int in [0, 2**32)", self.seed)
        _require(0.0 <= self.beta < 1.0, "beta", "a float in [0, 1)", self.beta)
        _require(0.0 <= self.d_min <= 1.0, "d_min", "a float in [0, 1]", self.d_min)
        _require(self.alpha >= 0.0 and math.isfinite(self.alpha), "alpha",
                 "a finite float >= 0", self.alpha)
        _require(self.eps > 0.0 and math.isfinite(self.eps), "eps", "a finite float > 0",
                 self.eps)
        _require(isinstance(self.norm_by_std, bool), "norm_by_std", "a bool", self.norm_by_std)
        _require(isinstance(self.prune_after, int) and self.prune_after >= 1, "prune_after",
                 "an int >= 1", self.prune_after)
        _require(0.0 <= self.replay_ratio <= 1.0, "replay_ratio", "a float in [0, 1]",
                 self.replay_ratio)

    def num_keep(self, batch_size: int) -> int:
        """k = clamp(floor(B * keep_ratio), 1, B): depends on B only (docs/spec.md §4)."""
        return num_keep(batch_size, self.keep_ratio)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "LZEConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config: unknown fields {unknown}; expected a subset of "
                             f"{sorted(known)}")
        return cls(**values)


def num_keep(batch_size: int, keep_ratio: float) -> int:
    """Number of groups kept from a batch of ``batch_size``: clamp(floor(B * r), 1, B)."""
    return min(max(int(math.floor(batch_size * keep_ratio)), 1), batch_size)


def _require(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {got!r}")

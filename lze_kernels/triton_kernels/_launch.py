"""Launch-shape helpers: compiled-variant descriptions (for ahead-of-time compilation) and the
interpreter switch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchConfig:
    """A kernel with the argument types and constexpr values one wrapper launch compiles to.

    ``signature`` maps every kernel argument to its Triton type (``"*fp32"``, ``"i32"``,
    ``"constexpr"``, ...); ``constexprs`` gives the value of each ``"constexpr"`` argument."""

    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int
    options: dict = field(default_factory=lambda: {"enable_fp_fusion": False})

    def pointer_args(self) -> list[str]:
        return [arg for arg, kind in self.signature.items() if kind.startswith("*")]


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter, whose cost is per operation (numpy on a
    whole tile) rather than per element: it wants few, large tiles, a GPU wants register-sized
    ones, so the wrappers pick tile shapes by this."""
    return os.environ.get("TRITON_INTERPRET") == "1"

"""Triton backend: one fused launch per step and one per top-k selection.

Exports the backend interface of :mod:`lze_kernels.dispatch` (``step`` and ``topk``) and
``aot_configs()``, which enumerates every compiled variant the two wrappers can launch
(``tools/triton_aot.py`` compiles them all for real GPUs).
"""

import itertools

from .step import aot_configs as _step_configs
from .step import step
from .topk import aot_configs as _topk_configs
from .topk import topk

__all__ = ["step", "topk"]


def aot_configs():
    """Every :class:`~._launch_config.LaunchConfig` the two wrappers can launch."""
    return itertools.chain(_step_configs(), _topk_configs())

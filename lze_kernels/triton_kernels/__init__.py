"""Triton backend: one fused launch per step, one per top-k selection, one per DOTS prediction.

Exports the backend interface of :mod:`lze_kernels.dispatch` (``step``, ``topk`` and
``predict_pass_rates``) and
``aot_configs()``, which enumerates every compiled variant the two wrappers can launch
(``tools/triton_aot.py`` compiles them all for real GPUs).
"""

import itertools

from .dots import aot_configs as _dots_configs
from .dots import predict_pass_rates
from .step import aot_configs as _step_configs
from .step import step
from .topk import aot_configs as _topk_configs
from .topk import topk

__all__ = ["step", "topk", "predict_pass_rates"]


def aot_configs():
    """Every :class:`~._launch_config.LaunchConfig` the wrappers can launch."""
    return itertools.chain(_step_configs(), _topk_configs(), _dots_configs())

"""lze-kernels: fused, host-sync-free Learning-Zone Energy data selection for RL post-training.

>>> from lze_kernels import LZESelector, LZEConfig
>>> sel = LZESelector(num_prompts=1000, config=LZEConfig(keep_ratio=0.4))
>>> out = sel.step(rewards, prompt_ids)   # advantages, energy, keep_mask, kept_indices, ...
"""

from . import ops
from .config import LZEConfig, num_keep
from .dispatch import available_backends
from .selector import LZESelector, StepOutput

__all__ = ["LZESelector", "LZEConfig", "StepOutput", "ops", "num_keep", "available_backends"]
__version__ = "0.1.0"

"""LZE selection inside TRL's ``GRPOTrainer`` (checked with trl 1.16.0; imports ``trl``).

>>> from lze_kernels import LZEConfig
>>> from lze_kernels.integrations.trl import LZEGRPOTrainer
>>> trainer = LZEGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=dataset,
...                          method="lze", lze_config=LZEConfig(keep_ratio=0.4))
"""

from .sampler import EpochPlanner, PrunedRepeatSampler
from .trainer import LZEGRPOTrainer
from .vllm_sync import sync_colocated_vllm_by_reload

__all__ = ["LZEGRPOTrainer", "EpochPlanner", "PrunedRepeatSampler",
           "sync_colocated_vllm_by_reload"]

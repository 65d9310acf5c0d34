"""LZE selection in verl's legacy trainer (``RayPPOTrainer``, ``trainer.use_v1=false``).

verl's registry calls an advantage estimator with the uids only (fresh uuid4 per prompt and
step), and nothing calls a sampler back with rewards. :class:`LZERayPPOTrainer` adds the two
links, as two small method overrides and nothing else:

* ``_get_gen_batch`` (called right after ``fit`` makes the step's uids, with the dataset rows
  still in the batch) binds each uid to its row in the registered
  :class:`~.estimator.LZEAdvantage` (``algorithm.adv_estimator=<its name>``), so it can key its
  selector state by dataset row;
* ``_update_actor`` (after advantages, with the step's rewards) feeds the groups' rewards to a
  :class:`~.forward.ForwardSampler` given as ``train_sampler``, before the dataloader draws the
  next batch.

The estimator's state travels in verl's ``data.pt`` through :mod:`.checkpoint` (the trainer
registers it and requires ``data.custom_cls`` to be :class:`~.checkpoint.LZERLHFDataset`); the
sampler's state travels there natively (torchdata saves a stateful sampler).
"""

from __future__ import annotations

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from . import checkpoint
from .checkpoint import LZERLHFDataset
from .estimator import LZEAdvantage, _layout, group_by_uid, rows_by_uid
from .forward import ForwardSampler


class LZERayPPOTrainer(RayPPOTrainer):
    """verl's legacy ``RayPPOTrainer`` with LZE's estimator bound to dataset rows and the forward
    sampler fed with each step's rewards. Takes ``RayPPOTrainer``'s arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_forward_setting(self.train_dataloader)
        self._rows_by_uid: dict = {}
        estimator = _registered_estimator(self.config.algorithm.adv_estimator)
        if isinstance(estimator, LZEAdvantage) and estimator.selector is not None:
            if not isinstance(self.train_dataset, LZERLHFDataset):
                raise ValueError("data.custom_cls: LZE's selector state travels in verl's "
                                 "checkpoint through lze_kernels.integrations.verl.checkpoint."
                                 "LZERLHFDataset; set data.custom_cls.path=pkg://lze_kernels."
                                 "integrations.verl.checkpoint and data.custom_cls.name="
                                 "LZERLHFDataset")
            checkpoint.register("estimator", estimator)

    def _get_gen_batch(self, batch):
        self.bind_rows(batch)
        return super()._get_gen_batch(batch)

    def _update_actor(self, batch):
        self.observe_rewards(batch)
        return super()._update_actor(batch)

    def bind_rows(self, batch) -> None:
        """Remember the step's uid -> dataset row, and bind it in an LZE estimator."""
        uids, rows = batch.non_tensor_batch["uid"], batch.non_tensor_batch["index"]
        self._rows_by_uid = rows_by_uid(uids, rows)
        estimator = _registered_estimator(self.config.algorithm.adv_estimator)
        if isinstance(estimator, LZEAdvantage):
            estimator.bind_uids(uids, rows)

    def observe_rewards(self, batch) -> None:
        """Feed the step's groups (dataset row, response scores) to a :class:`ForwardSampler`."""
        sampler = self.train_dataloader.sampler
        if not isinstance(sampler, ForwardSampler):
            return
        uids = batch.non_tensor_batch["uid"]
        groups = group_by_uid(uids, "cpu")
        scores = batch.batch["token_level_scores"].sum(dim=-1).float().cpu()
        raw, valid = _layout(scores, groups)
        group_uids = np.asarray(uids)[groups.host_first].tolist()
        rows = torch.tensor([self._rows_by_uid[uid] for uid in group_uids], dtype=torch.int64)
        sampler.observe(rows, raw, valid)


def check_forward_setting(dataloader) -> None:
    """Refuse dataloader settings under which a :class:`ForwardSampler` acts on stale state."""
    if isinstance(dataloader.sampler, ForwardSampler) and dataloader.num_workers != 0:
        raise ValueError(f"data.dataloader_num_workers: the forward sampler needs 0 (got "
                         f"{dataloader.num_workers}): worker processes prefetch batches drawn "
                         "before the previous step's rewards are observed")


def _registered_estimator(name):
    try:
        return get_adv_estimator_fn(name)
    except ValueError:  # verl's built-in branches (gae, grpo) are not in the registry
        return None

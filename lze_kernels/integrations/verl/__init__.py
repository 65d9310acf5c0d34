"""LZE selection inside verl (checked against verl 0.9.1, ``make test-verl``).

* :mod:`.estimator`: :class:`LZEAdvantage`, an advantage estimator with verl's calling conventions
  that registers itself in verl's estimator registry (verl is imported only by ``register``).
* :mod:`.legacy`: :class:`~.legacy.LZERayPPOTrainer`, verl's legacy ``RayPPOTrainer`` with the
  estimator bound to each step's dataset rows and its state in verl's checkpoint (imports verl).
* :mod:`.replay_buffer`: :class:`~.replay_buffer.LZEReplayBuffer`, the v1 trainer's
  ``trainer.v1.sampler.custom_sampler``: LZE or DAPO picks the groups of each training batch and
  verl's refill tops it up (imports verl).
* :mod:`.forward`: :class:`~.forward.ForwardSampler`, the pruner with replay, GRESO's skip draw
  or DOTS's prediction near 1/2 choosing the prompts verl rolls out (legacy ``train_sampler``).
"""

from .estimator import LZEAdvantage, UidGroups, VerlStep, group_by_uid

__all__ = ["LZEAdvantage", "UidGroups", "VerlStep", "group_by_uid"]

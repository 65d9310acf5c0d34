"""LZE selection inside verl (checked against verl 0.9.1, ``make test-verl``).

* :mod:`.estimator`: :class:`LZEAdvantage`, an advantage estimator with verl's calling conventions
  that registers itself in verl's estimator registry (verl is imported only by ``register``).
* :mod:`.legacy`: :class:`~.legacy.LZERayPPOTrainer`, verl's legacy ``RayPPOTrainer`` that
  selects where the rewards are first known and drops the other groups' rows before any
  log-prob pass, its selection state in ``lze_selection.pt`` beside verl's checkpoint (imports
  verl).
* :mod:`.replay_buffer`: :class:`~.replay_buffer.LZEReplayBuffer`, the v1 trainer's
  ``trainer.v1.sampler.custom_sampler``: LZE or DAPO picks the groups of each training batch
  from the K rolled out (``mode=topk``) or tops it up to K with verl's refill (``mode=refill``)
  (imports verl).
* :mod:`.row_table`: the train set's rows and each row's prompt key, which every step's rows are
  checked against.
* :mod:`.rows`: dataset-row checks, and a row that comes twice in one batch as one observation.
* :mod:`.forward`: :class:`~.forward.ForwardSampler`, the pruner with replay, GRESO's skip draw
  or DOTS's prediction near 1/2 choosing the prompts verl rolls out (legacy ``train_sampler``).
"""

from .estimator import LZEAdvantage, StepSelection, UidGroups, VerlStep, group_by_uid

__all__ = ["LZEAdvantage", "StepSelection", "UidGroups", "VerlStep", "group_by_uid"]

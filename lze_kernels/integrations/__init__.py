"""Drop-in LZE selection for RL trainers people already use.

* :mod:`lze_kernels.integrations.trl`: ``LZEGRPOTrainer``, a subclass of TRL's ``GRPOTrainer``
  (importing it imports ``trl``).
* :mod:`lze_kernels.integrations.verl`: selection inside verl 0.9.1: ``LZEAdvantage`` (an
  advantage estimator with verl's calling conventions, registered in verl's estimator registry),
  ``LZEReplayBuffer`` (the v1 trainer's ``custom_sampler``), ``LZERayPPOTrainer`` (the legacy
  trainer), ``ForwardSampler`` (the pruner, GRESO and DOTS choosing the prompts verl rolls out)
  and ``LZERLHFDataset`` (selection state in verl's checkpoint); ``verl`` is imported only where
  a class needs it.

Nothing here is imported by ``import lze_kernels``.
"""

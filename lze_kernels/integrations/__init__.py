"""Drop-in LZE selection for RL trainers people already use.

* :mod:`lze_kernels.integrations.trl`: ``LZEGRPOTrainer``, a subclass of TRL's ``GRPOTrainer``
  (importing it imports ``trl``).
* :mod:`lze_kernels.integrations.verl`: ``LZEAdvantage``, an advantage estimator with verl's calling
  conventions that registers itself in verl's estimator registry (``verl`` is imported only by
  ``register``).

Nothing here is imported by ``import lze_kernels``.
"""

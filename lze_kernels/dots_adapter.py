"""DOTS's adaptive difficulty predictor: a lightweight adapter and a calibration head over frozen
prompt embeddings (Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning
Through Difficulty-targeted Online Data Selection and Rollout Replay"; the authors' code,
ASTRAL-Group/data-efficient-llm-rl at 59df918, ``rl_training/verl/verl/trainer/ppo/
teacher_utils.py``:14-154, trained by ``adaptive_difficulty_prediction/train.py``).

* **Adapter.** Separate query and reference projections, each
  ``LayerNorm -> Linear -> (GELU -> Dropout -> Linear) x (layers - 1) -> LayerNorm``
  (``build_projection``, 14-31). Scores are scaled dot products of the projected vectors,
  ``<P_q z_q, P_r z_j> / sqrt(hidden)``, a softmax over the K references and the weighted mean of
  their pass rates ``y_j`` (``RegressionHead``, 138-154): the attention of docs/spec.md §8 on projected
  vectors, so inference projects every embedding once and runs the fused kernel
  (:func:`lze_kernels.ops.predict_pass_rates`) on the projections.
* **Calibration head** (``group_logit_temp``, 101-125). An MLP ``2 -> 10 -> ReLU -> 2`` of the
  reference labels' mean and (unbiased) standard deviation gives a temperature
  ``t = softplus(.)`` clamped to [0.01, 10] and a bias ``b = tanh(.)``;
  ``p_hat = sigmoid(logit(clamp(base, 1e-4, 1 - 1e-4)) / t + b)``.

The module is pure PyTorch (no transformers): the trainer trains it offline with binary
cross-entropy (``lze_trainer.methods.dots_predictor``) and freezes it; :meth:`predict` serves
inference.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from . import dots

# logit(base) is taken on [EPS, 1 - EPS] (the official clamp).
EPS = 1e-4
TEMPERATURE_RANGE = (1e-2, 10.0)


def projection(input_size: int, hidden_size: int, layers: int, dropout: float) -> nn.Sequential:
    """``LayerNorm -> Linear -> (GELU -> Dropout -> Linear) x (layers - 1) -> LayerNorm``."""
    parts: list[nn.Module] = [nn.LayerNorm(input_size), nn.Linear(input_size, hidden_size)]
    for _ in range(layers - 1):
        parts += [nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size)]
    parts.append(nn.LayerNorm(hidden_size))
    return nn.Sequential(*parts)


class DifficultyAdapter(nn.Module):
    """Query/reference projections plus the calibration head (see the module docstring)."""

    def __init__(self, input_size: int, hidden_size: int = 128, layers: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        if input_size < 1 or hidden_size < 1 or layers < 1:
            raise ValueError("DifficultyAdapter: expected input_size, hidden_size and layers >= 1, "
                             f"got {(input_size, hidden_size, layers)}")
        self.hidden_size = hidden_size
        self.query_proj = projection(input_size, hidden_size, layers, dropout)
        self.ref_proj = projection(input_size, hidden_size, layers, dropout)
        self.calibration = nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 2))

    def calibrate(self, base: torch.Tensor, ref_labels: torch.Tensor) -> torch.Tensor:
        """[N] the head's temperature and bias, from the labels' mean and std, in logit space."""
        labels = ref_labels.float()
        spread = labels.std() if labels.numel() > 1 else labels.new_zeros(())
        temp_bias = self.calibration(torch.stack([labels.mean(), spread]))
        temperature = F.softplus(temp_bias[0]).clamp(*TEMPERATURE_RANGE)
        bias = torch.tanh(temp_bias[1])
        return torch.sigmoid(torch.logit(base.clamp(EPS, 1.0 - EPS)) / temperature + bias)

    def forward(self, query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_labels: torch.Tensor,
                exclude: torch.Tensor | None = None) -> torch.Tensor:
        """[n] differentiable predicted pass rates (training): ``exclude`` [n, K] bool masks
        query-reference pairs out of the softmax (a query that is itself a reference)."""
        q, r = self.query_proj(query_emb.float()), self.ref_proj(ref_emb.float())
        scores = q @ r.T / math.sqrt(self.hidden_size)
        if exclude is not None:
            scores = scores.masked_fill(exclude, -torch.inf)
        base = torch.softmax(scores, dim=1) @ ref_labels.float()
        return self.calibrate(base, ref_labels)

    @torch.no_grad()
    def project(self, query_emb: torch.Tensor, ref_emb: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected queries [N, hidden] and references [K, hidden] (eval mode only)."""
        if self.training:
            raise RuntimeError("DifficultyAdapter.project/predict: call .eval() first (the "
                               "projections' dropout is on in training mode)")
        return self.query_proj(query_emb.float()), self.ref_proj(ref_emb.float())

    @torch.no_grad()
    def predict(self, query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_labels: torch.Tensor,
                backend: str = "auto") -> torch.Tensor:
        """[N] fp32 calibrated predictions of every query: project once, then the fused attention
        kernel on the projections (``1 / sqrt(hidden)`` scale), then the calibration head."""
        q, r = self.project(query_emb, ref_emb)
        base = dots.predict_pass_rates(q.contiguous(), r.contiguous(), ref_labels, 1.0,
                                       backend=backend)
        return self.calibrate(base, ref_labels)

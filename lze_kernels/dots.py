"""DOTS: difficulty prediction from a reference set and sampling near p = 1/2 (docs/spec.md §8).

Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through
Difficulty-targeted Online Data Selection and Rollout Replay". A reference set of K prompts is
rolled out and labelled with pass rates ``y_j``; every prompt ``q`` with fixed embedding ``z_q``
gets the attention-weighted prediction

    p_hat_q = sum_j softmax_j(<z_q, z_j> / (sqrt(d) tau_attn)) y_j,

optionally calibrated by a least-squares line fitted on the references, and the step's prompts
are drawn without replacement with probability proportional to ``exp(-|p_hat - 1/2| / tau)``
(Gumbel top-k: Kool et al. 2019, "Stochastic Beams and Where to Find Them").

:func:`predict_pass_rates` runs on a backend (``"auto"``: the fused kernel of the device, one
pass over the queries with an online softmax, Milakov & Gimelshein 2018, as in FlashAttention,
Dao et al. 2022); :func:`lze_kernels.reference.predict_pass_rates_reference` (with the other oracles) is its
oracle. The rest is PyTorch. All of
it is sync-free and fixed-shape.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch, reference, validation

# A calibration whose predictions vary less than this (variance) keeps the identity.
MIN_CALIBRATION_VARIANCE = 1e-12
# Philox stream of the sampler's Gumbel draws (GRESO uses 2^30, the pruner's replays 2^31).
SAMPLER_STREAM = 0x20000000


def attention_scale(dim: int, attention_tau: float) -> float:
    """``1 / (sqrt(d) tau_attn)``, the factor of every score."""
    return 1.0 / (math.sqrt(dim) * attention_tau)


def predict_pass_rates(query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_pass: torch.Tensor,
                       attention_tau: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """[N] fp32 predicted pass rates of the queries from K labelled references (docs/spec.md §8).

    ``query_emb [N, d]`` and ``ref_emb [K, d]`` (fp32, bf16 or fp16, one dtype), ``ref_pass [K]``
    (any float dtype); scores, softmax and weighted sum in one pass, no ``[N, K]`` matrix."""
    validation.check_dots_prediction(query_emb, ref_emb, ref_pass, attention_tau)
    scale = attention_scale(query_emb.shape[1], attention_tau)
    kernel = dispatch.resolve_op(backend, query_emb.device, "predict")
    return kernel.predict(query_emb, ref_emb, ref_pass.float().contiguous(), scale)


def calibrate_linear(predicted: torch.Tensor, actual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares line ``actual ~ slope * predicted + intercept`` over K points, as two 0-dim
    fp32 tensors: ``slope = cov(x, y) / var(x)``, ``intercept = mean(y) - slope mean(x)``
    (accumulated in fp64). When ``var(x) <= MIN_CALIBRATION_VARIANCE`` (e.g. K = 1) the fit is
    undetermined and the identity (1, 0) is returned."""
    validation.check_calibration_points(predicted, actual)
    x, y = predicted.double(), actual.double()
    dx, dy = x - x.mean(), y - y.mean()
    var = (dx * dx).mean()
    fitted = var > MIN_CALIBRATION_VARIANCE
    slope = torch.where(fitted, (dx * dy).mean() / var.clamp_min(MIN_CALIBRATION_VARIANCE), 1.0)
    intercept = torch.where(fitted, y.mean() - slope * x.mean(), 0.0)
    return slope.float(), intercept.float()


def apply_calibration(pred: torch.Tensor, slope, intercept) -> torch.Tensor:
    """``clamp(slope * pred + intercept, 0, 1)`` (slope and intercept: floats or 0-dim tensors)."""
    validation.check_calibration(pred, slope, intercept)
    return (slope * pred.float() + intercept).clamp(0.0, 1.0)


def near_half_keys(predicted: torch.Tensor, tau: float, seed: int, step: torch.Tensor,
                   eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N] fp64 Gumbel keys ``-|p_hat - 1/2| / tau + g``, ``g ~ Gumbel(0, 1)`` from Philox keyed
    by ``(seed, SAMPLER_STREAM + step[0])`` with the prompt index as counter; ``-inf`` for
    ineligible or NaN predictions. The top n keys are a sample without replacement with
    probability proportional to ``exp(-|p_hat - 1/2| / tau)``."""
    rows = torch.arange(predicted.shape[0], device=predicted.device)
    stream = SAMPLER_STREAM + step.reshape(-1)[0]
    gumbel = reference.standard_gumbel(reference.uniform_from_bits(
        reference.philox_4x32_10(seed, stream, rows))).double()
    keys = -(predicted.double() - 0.5).abs() / tau + gumbel
    usable = ~torch.isnan(keys)
    if eligible is not None:
        usable = usable & eligible
    return torch.where(usable, keys, -torch.inf)


def sample_near_half(predicted: torch.Tensor, n: int, tau: float = 1e-3, seed: int = 0,
                     step: Optional[torch.Tensor] = None,
                     eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n] int64 distinct prompt indices drawn without replacement with probability
    ``∝ exp(-|p_hat - 1/2| / tau)`` among the eligible prompts (docs/spec.md §8).

    Deterministic per ``(seed, step[0])`` (``step``: int64 tensor, default 0). A stable
    descending sort of :func:`near_half_keys` orders equal keys by index, so when fewer than n
    prompts are eligible the rest are filled with ineligible ones in index order: always n
    distinct valid indices, no host sync."""
    validation.check_near_half_sampling(predicted, n, tau, seed, step, eligible)
    if step is None:
        step = torch.zeros(1, dtype=torch.int64, device=predicted.device)
    keys = near_half_keys(predicted, tau, seed, step, eligible)
    return torch.sort(keys, descending=True, stable=True).indices[:n]

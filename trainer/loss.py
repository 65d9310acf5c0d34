"""The GRPO/DAPO policy loss, token by token, and how it is aggregated.

Per response token t of sequence i, with ratio ``rho = exp(logp - old_logp)`` and the sequence's
GRPO advantage ``A_i`` (PPO, Schulman et al. 2017; clip-higher from DAPO, Yu et al. 2025)::

    l_it = max(-A_i rho, -A_i clip(rho, 1 - eps_low, 1 + eps_high))

Aggregation (``loss_agg_mode``), always against normalisers counted over *all* ranks, so the loss
is the same however the kept groups are spread over ranks and micro-batches:

* ``token-mean``: sum of l over every kept token / number of kept tokens (DAPO);
* ``seq-mean-token-mean``: mean over kept sequences of each sequence's token mean (GRPO paper);
* ``seq-mean-token-sum-norm``: sum of l / (kept sequences x max response length), the constant
  normaliser of Dr. GRPO (Liu et al. 2025), which removes the length bias.

KL to a frozen reference (off by default, as in DAPO) uses Schulman's estimators
(http://joschu.net/blog/kl-approx.html): k1 = logp - ref, k3 = exp(ref - logp) - (ref - logp) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normaliser:
    """Global counts of one mini-batch (summed over ranks) that every micro-batch divides by."""

    tokens: float  # kept response tokens
    sequences: float  # kept sequences
    max_response_length: int  # Dr. GRPO's constant

    def denominator(self, mode: str) -> float:
        if mode == "token-mean":
            return max(self.tokens, 1.0)
        if mode == "seq-mean-token-mean":
            return max(self.sequences, 1.0)
        if mode == "seq-mean-token-sum-norm":
            return max(self.sequences, 1.0) * self.max_response_length
        raise ValueError(f"actor.loss_agg_mode: expected token-mean, seq-mean-token-mean or "
                         f"seq-mean-token-sum-norm, got {mode!r}")


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """[n, L] log-prob of token t under the logits at t-1 (position 0 gets 0), after dividing the
    logits by the sampling temperature, which is the distribution the engine sampled from."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(chosen, (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[n, L] entropy of the distribution each position's token was drawn from (aligned like
    :func:`token_log_probs`)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss [n, L] and where the clip was active (bool [n, L])."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def behaviour_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                      off_policy: torch.Tensor) -> torch.Tensor:
    """Per-token importance weight ``w = pi_old / mu`` [n, L] of replayed sequences (rows where
    ``off_policy`` [n] is set), 1 for fresh ones; no gradient flows through it.

    Rollout Replay's off-policy GRPO loss (SPEC 9; Sun et al. 2025, "Improving Data Efficiency
    for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
    Replay") is ``-w min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`` with
    ``rho = pi_theta / pi_old``: the clipped surrogate times ``w``, where ``mu`` is the policy that
    sampled the tokens (the engine's log-probs at the time). When ``mu = pi_old``, ``w = 1``: plain
    GRPO."""
    weights = torch.exp(old_logp.detach() - behaviour_logp.detach())
    return torch.where(off_policy.unsqueeze(-1), weights, torch.ones_like(weights))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        # Clamped as verl does: one extreme token must not dominate the batch.
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"actor.kl_estimator: expected k1 or k3, got {estimator!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str,
              norm: Normaliser) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: the sum over its kept tokens, weighted as
    ``mode`` says, divided by the global normaliser (so shares add up over ranks and
    micro-batches). ``mask`` [n, L] is 1 on kept response tokens, 0 elsewhere."""
    masked = values * mask
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / norm.denominator(mode)
    return masked.sum() / norm.denominator(mode)

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
from typing import Optional

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


# Logit entries per row chunk of the bounded log-softmax: 2**26 float32 entries are 256 MiB, so
# at V = 151,936 a chunk is C = 441 rows and its float32 temporaries stay near 1 GiB whatever n x L.
CHUNK_ELEMENTS = 2**26


class _SampledLogSoftmax(torch.autograd.Function):
    """Per row of ``x = logits / T`` ([N, V], any float dtype): ``log softmax(x)[label]`` and, when
    asked, the entropy ``H = -sum_k p_k log p_k``, in float32, computed chunk by chunk of C rows.

    Nothing of size N x V in float32 is built or saved: the forward keeps only the logits (alive
    anyway), the labels and two float32 vectors (logsumexp, entropy); the backward rebuilds each
    chunk's log-softmax from the saved logsumexp. With ``p = softmax(x)``::

        d log p_label / d x_k = 1[k = label] - p_k,      d H / d x_k = -p_k (log p_k + H)

    Peak memory beyond the logits: forward at most 3 x C x V x 4 bytes (the upcast chunk, the
    logsumexp's temporary and, with entropy, p); backward the gradient of the logits (N x V in
    the logits' dtype, what autograd holds for any loss on them) plus 2 x C x V x 4 bytes. The
    same row-wise scheme as TRL's ``selective_log_softmax`` and verl's chunked entropy, with the
    backward written out so that autograd does not keep every chunk's float32 copy.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, with_entropy: bool, chunk_rows: int):
        n = logits.shape[0]
        out = dict(dtype=torch.float32, device=logits.device)
        logp, lse = torch.empty(n, **out), torch.empty(n, **out)
        entropy = torch.empty(n if with_entropy else 0, **out)
        for rows in _row_chunks(n, chunk_rows):
            x = _scaled_chunk(logits[rows], temperature)
            lse[rows] = torch.logsumexp(x, dim=-1)
            logp[rows] = x.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:
                x.sub_(lse[rows, None])  # log p
                entropy[rows] = -(x.exp().unsqueeze(1) @ x.unsqueeze(2)).view(-1)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in _row_chunks(logits.shape[0], ctx.chunk_rows):
            log_p = _scaled_chunk(logits[rows], ctx.temperature).sub_(lse[rows, None])
            p = log_p.exp()
            g = None if grad_logp is None else grad_logp[rows, None]
            if grad_entropy is None:  # only log p is used: -g p, in p's storage
                chunk_grad = p.mul_(-g)
            else:  # -g_H p (log p + H), in log_p's storage, then -g p
                chunk_grad = log_p.add_(entropy[rows, None]).mul_(p).mul_(-grad_entropy[rows, None])
                if g is not None:
                    chunk_grad.sub_(p.mul_(g))
            if g is not None:
                chunk_grad.scatter_add_(-1, labels[rows, None], g)
            grad[rows] = chunk_grad.div_(ctx.temperature)
        return grad, None, None, None, None


def _row_chunks(n: int, chunk_rows: int):
    return (slice(start, start + chunk_rows) for start in range(0, n, chunk_rows))


def _scaled_chunk(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new float32 [C, V] tensor ``chunk / T`` (never a view of the logits: it is changed in place)."""
    return chunk.to(torch.float32, copy=True).div_(temperature)


def token_log_probs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor,
                                temperature: float = 1.0, entropy: bool = False,
                                chunk_rows: Optional[int] = None
                                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[n, L] float32 log-prob of token t under the logits at t-1 (position 0 gets 0), after dividing
    the logits [n, L, V] by the sampling temperature (the distribution the engine sampled from),
    and, when ``entropy``, the [n, L] entropy of that distribution aligned the same way (else None).

    Bounded: no float32 tensor of n x L x V entries (:class:`_SampledLogSoftmax`); ``chunk_rows``
    (default ``CHUNK_ELEMENTS // V``) sets the rows per chunk. Every position is scored against the
    next token (the last against an arbitrary one, then dropped), so the logits are read in place
    through a view rather than sliced into a copy."""
    n, length, vocab = logits.shape
    labels = input_ids.roll(-1, dims=1).reshape(-1)
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    logp, ent = _SampledLogSoftmax.apply(logits.reshape(n * length, vocab), labels, temperature,
                                         entropy, rows)
    shift = lambda values: torch.nn.functional.pad(values.view(n, length)[:, :-1], (1, 0))
    return shift(logp), (shift(ent) if entropy else None)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """[n, L] log-prob of token t under the logits at t-1 (position 0 gets 0), after dividing the
    logits by the sampling temperature, computed the bounded way of
    :func:`token_log_probs_and_entropy`."""
    return token_log_probs_and_entropy(logits, input_ids, temperature)[0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[n, L] entropy of the distribution each position's token was drawn from (aligned like
    :func:`token_log_probs`), computed the bounded way of :func:`token_log_probs_and_entropy`."""
    ids = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_log_probs_and_entropy(logits, ids, temperature, entropy=True)[1]


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

    Rollout Replay's off-policy GRPO loss (docs/spec.md §9; Sun et al. 2025, "Improving Data Efficiency
    for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
    Replay") is ``-w min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`` with
    ``rho = pi_theta / pi_old``: the clipped surrogate times ``w``, where ``mu`` is the policy that
    sampled the tokens (the engine's log-probs at the time; the official code recomputes them with
    the actor at that step, :mod:`lze_trainer.methods.replay` says why the engine's serve here).
    The official runs clip symmetrically, ``eps = 0.2`` (``core_algos.py``:197-235,
    ``ppo_trainer.yaml``:30): ``actor.clip_ratio_high=0.2``. When ``mu = pi_old``, ``w = 1``:
    plain GRPO."""
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

"""The policy loss against numbers computed by hand, for every aggregation mode, and the property
the trainer relies on: micro-batch shares with global normalisers add up to the whole-batch loss."""

import math

import pytest
import torch

from lze_trainer.loss import (Normaliser, aggregate, clipped_surrogate, kl_penalty,
                              token_entropy, token_log_probs)

# Two sequences, response tokens marked by the mask: 3 tokens and 1 token.
LOGP = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, 0.0, -0.3, 0.0]])
OLD = torch.tensor([[0.0, -1.2, -0.5, -1.0], [0.0, 0.0, -0.1, 0.0]])
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
ADV = torch.tensor([1.5, -0.5])
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def hand_token_losses():
    """Per (sequence, token) loss written out with floats: max(-A r, -A clip(r))."""
    out = {}
    for i, (tokens, a) in enumerate([((1, 2, 3), 1.5), ((2,), -0.5)]):
        for t in tokens:
            r = math.exp(LOGP[i, t].item() - OLD[i, t].item())
            clipped = min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            out[(i, t)] = max(-a * r, -a * clipped)
    return out


def test_clipped_surrogate_matches_hand_computation():
    loss, clipped = clipped_surrogate(LOGP, OLD, ADV, CLIP_LOW, CLIP_HIGH)
    for (i, t), expected in hand_token_losses().items():
        assert loss[i, t].item() == pytest.approx(expected, rel=1e-6)
    # ratio e^0.2 = 1.22 (A > 0): inside the clip; ratio e^-1 = 0.37 (A > 0): the unclipped term
    # is the larger loss, so the clip is not active; seq 1 ratio e^-0.2 = 0.82 (A < 0): inside.
    assert not clipped[0, 1] and not clipped[0, 3] and not clipped[1, 2]
    big = clipped_surrogate(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([1.0]),
                            CLIP_LOW, CLIP_HIGH)
    assert big[1][0, 1] and big[0][0, 1].item() == pytest.approx(-(1 + CLIP_HIGH))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_modes_match_hand_computation(mode):
    losses = hand_token_losses()
    seq0 = [losses[(0, t)] for t in (1, 2, 3)]
    seq1 = [losses[(1, 2)]]
    expected = {
        "token-mean": (sum(seq0) + sum(seq1)) / 4,
        "seq-mean-token-mean": (sum(seq0) / 3 + sum(seq1) / 1) / 2,
        "seq-mean-token-sum-norm": (sum(seq0) + sum(seq1)) / (2 * 16),  # Dr. GRPO: 2 seqs x 16
    }[mode]
    per_token, _ = clipped_surrogate(LOGP, OLD, ADV, CLIP_LOW, CLIP_HIGH)
    norm = Normaliser(tokens=4, sequences=2, max_response_length=16)
    assert aggregate(per_token, MASK, mode, norm).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_shares_over_ranks_and_micro_batches_add_up(mode):
    """Kept groups spread over ranks / micro-batches, each divided by the global normaliser, give
    exactly the loss of the whole batch on one rank: the trainer's normalisation invariant."""
    gen = torch.Generator().manual_seed(0)
    n, length = 7, 9
    logp = -torch.rand(n, length, generator=gen)
    old = logp + 0.1 * torch.randn(n, length, generator=gen)
    adv = torch.randn(n, generator=gen)
    mask = (torch.rand(n, length, generator=gen) > 0.3).float()
    mask[:, 0] = 0
    per_token, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    norm = Normaliser(tokens=float(mask.sum()), sequences=float(n), max_response_length=length)
    whole = aggregate(per_token, mask, mode, norm)
    parts = sum(aggregate(per_token[s], mask[s], mode, norm)
                for s in (slice(0, 2), slice(2, 3), slice(3, 7)))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_zero_weight_sequences_contribute_nothing():
    per_token, _ = clipped_surrogate(LOGP, OLD, ADV, CLIP_LOW, CLIP_HIGH)
    padded = torch.cat([per_token, torch.full((1, 4), float(1e6))])
    mask = torch.cat([MASK, torch.zeros(1, 4)])
    norm = Normaliser(tokens=4, sequences=2, max_response_length=16)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(padded, mask, mode, norm).item() == pytest.approx(
            aggregate(per_token, MASK, mode, norm).item())


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    k1 = kl_penalty(logp, ref, "k1")
    assert k1.tolist() == pytest.approx([0.5, -1.0])
    k3 = kl_penalty(logp, ref, "k3")
    expected = [math.exp(r - l) - (r - l) - 1 for l, r in ((-1.0, -1.5), (-2.0, -1.0))]
    assert k3.tolist() == pytest.approx(expected)
    assert (k3 >= 0).all()  # k3 is non-negative for every sample
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k2")


def test_token_log_probs_and_entropy_alignment():
    vocab = 5
    logits = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, vocab, (2, 4), generator=torch.Generator().manual_seed(2))
    temperature = 0.7
    logp = token_log_probs(logits, ids, temperature)
    assert (logp[:, 0] == 0).all()
    for i in range(2):
        for t in range(1, 4):
            expected = torch.log_softmax(logits[i, t - 1] / temperature, -1)[ids[i, t]]
            assert logp[i, t].item() == pytest.approx(expected.item(), rel=1e-5)
    ent = token_entropy(logits, temperature)
    p = torch.softmax(logits[1, 2] / temperature, -1)
    assert ent[1, 3].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        Normaliser(1, 1, 1).denominator("token-sum")

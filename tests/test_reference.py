"""The PyTorch reference against docs/spec.md's known values, hand-computed cases and properties."""

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import advantage_error_bound, assert_within, gamma
from lze_kernels import layout as L
from lze_kernels import reference as R
from lze_kernels.layout import SelectorState


def rows_with_correct(counts, group=8):
    rewards = torch.zeros(len(counts), group)
    for i, c in enumerate(counts):
        rewards[i, :c] = 1.0
    return rewards


def test_spec_known_energies_first_sight(params):
    state = SelectorState.empty(10, "cpu")
    out = R.lze_step(rows_with_correct([0, 1, 2, 4, 8]), None, torch.arange(5), state, params)
    assert out.energy.tolist() == [0.0, 0.3828125, 0.5625, 0.5, 0.0]
    assert out.momentum.tolist() == [0.0] * 5
    assert state.fstate[:5, L.D_INIT].tolist() == pytest.approx([1.0, 0.875, 0.75, 0.5, 0.05])
    assert state.step_counter.tolist() == [1, 0]


def test_energy_peaks_at_one_third_on_first_sight(params):
    group = 300
    state = SelectorState.empty(group + 1, "cpu")
    out = R.lze_step(rows_with_correct(range(group + 1), group), None,
                     torch.arange(group + 1), state, params)
    assert int(out.energy.argmax()) == 100  # p = 1/3


def test_second_sight_momentum_ema_and_anchor(params):
    state = SelectorState.empty(1, "cpu")
    ids = torch.tensor([0])
    R.lze_step(rows_with_correct([2]), None, ids, state, params)  # p = 0.25, D = 0.75
    out = R.lze_step(rows_with_correct([6]), None, ids, state, params)  # p = 0.75
    m = min(2 * abs(0.75 - 0.25), 1.0)
    assert out.momentum.item() == pytest.approx(m)
    assert out.energy.item() == pytest.approx(0.75 * 4 * 0.75 * 0.25 * (1 + 0.3 * m))
    assert state.fstate[0, L.EMA].item() == pytest.approx(0.9 * 0.25 + 0.1 * 0.75)
    assert state.fstate[0, L.D_INIT].item() == 0.75  # never re-anchored
    assert state.istate[0, L.SEEN].item() == 2


def test_advantages_verl_semantics(params):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.3, 0.9, 0.0, 0.0]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    stats = R.group_stats(rewards, valid)
    adv = R.grpo_advantages(stats, eps=1e-6)
    std0 = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased
    assert adv[0].tolist() == pytest.approx([0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6)] * 1
                                            + [-0.5 / (std0 + 1e-6), 0.5 / (std0 + 1e-6)])
    assert adv[1].tolist() == [0.0] * 4
    std2 = torch.tensor([0.3, 0.9]).std().item()
    assert adv[2, :2].tolist() == pytest.approx([-0.3 / (std2 + 1e-6), 0.3 / (std2 + 1e-6)])
    assert adv[2, 2:].tolist() == [0.0, 0.0]
    dr = R.grpo_advantages(stats, norm_by_std=False)
    assert dr[2, :2].tolist() == pytest.approx([-0.3, 0.3])


def test_single_rollout_and_empty_rows_are_inert(params):
    state = SelectorState.empty(4, "cpu")
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    valid = torch.tensor([[True, False], [False, False]])
    out = R.lze_step(rewards, valid, torch.tensor([0, 1]), state, params)
    assert out.advantages.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert out.pass_rate.tolist() == [1.0, 0.0]
    assert state.istate[1].tolist() == [0, 0, 0, 0]  # empty row: no state change
    assert state.fstate[1, L.D_INIT].item() == L.UNSET_D_INIT


def test_pruner_streak_prune_replay_and_reactivation(params):
    state = SelectorState.empty(3, "cpu")
    ids = torch.tensor([0, 1])
    solved_and_failed = rows_with_correct([8, 0])
    for _ in range(2):
        R.lze_step(solved_and_failed, None, ids, state, params)
    assert R.rollout_eligible(state, torch.arange(3)).tolist() == [False, True, True]
    R.draw_replays(state, replay_ratio=1.0, seed=0, epoch=0)
    assert R.rollout_eligible(state, torch.tensor([0])).tolist() == [True]
    R.lze_step(rows_with_correct([7]), None, torch.tensor([0]), state, params)  # forgot
    assert state.istate[0, L.FLAGS].item() == 0  # reactivated
    assert state.istate[0, L.SOLVED_STREAK].item() == 0


def test_replay_draw_rate_and_determinism():
    state = SelectorState.empty(20000, "cpu")
    state.istate[:, L.FLAGS] = L.FLAG_PRUNED
    R.draw_replays(state, 0.1, seed=3, epoch=5)
    first = state.istate[:, L.FLAGS].clone()
    R.draw_replays(state, 0.1, seed=3, epoch=5)
    assert torch.equal(first, state.istate[:, L.FLAGS])
    rate = ((first[:-1] & L.FLAG_REPLAY) != 0).float().mean().item()
    assert abs(rate - 0.1) < 0.01


def test_topk_ties_go_to_smaller_position_and_zero_never_fills():
    energy = torch.tensor([0.5, 0.0, 0.5, 0.2, 0.5, 0.0])
    sel = R.topk_select(energy, 5)
    assert sel.kept_indices.tolist() == [0, 2, 3, 4, -1]  # batch order
    assert sel.num_kept.item() == 4
    assert sel.keep_mask.tolist() == [True, False, True, True, True, False]
    assert R.sort_by_score(sel, energy).kept_indices.tolist() == [0, 2, 4, 3, -1]
    sel = R.topk_select(energy, 2)
    assert sel.kept_indices.tolist() == [0, 2]


def test_kept_rows_are_the_mask_in_batch_order_padded():
    mask = torch.tensor([False, True, True, False, True])
    assert R.kept_rows(mask, 5).tolist() == [1, 2, 4, -1, -1]
    assert R.kept_rows(mask, 3).tolist() == [1, 2, 4]
    assert R.kept_rows(torch.zeros(3, dtype=torch.bool), 2).tolist() == [-1, -1]


def test_sort_by_score_orders_the_kept_rows_by_noisy_score():
    energy = torch.rand(300) * (torch.rand(300) > 0.2)
    step = torch.tensor(7)
    sel = R.topk_select(energy, 120, 0.3, seed=5, step=step)
    ordered = R.sort_by_score(sel, energy, 0.3, seed=5, step=step)
    score = R.selection_scores(energy, 0.3, 5, step)
    expected = torch.sort(score, descending=True, stable=True).indices[:sel.num_kept]
    assert torch.equal(ordered.kept_indices[:sel.num_kept], expected)
    assert (ordered.kept_indices[sel.num_kept:] == -1).all()
    assert torch.equal(ordered.keep_mask, sel.keep_mask)


def test_topk_no_candidates():
    sel = R.topk_select(torch.zeros(4), 2, noise_scale=0.05)
    assert sel.kept_indices.tolist() == [-1, -1]
    assert sel.num_kept.item() == 0 and not sel.keep_mask.any()


def test_noise_is_seeded_by_seed_and_step():
    energy = torch.rand(500) + 0.01
    step = torch.tensor(3)
    a = R.topk_select(energy, 100, 0.5, seed=1, step=step).kept_indices
    b = R.topk_select(energy, 100, 0.5, seed=1, step=step).kept_indices
    c = R.topk_select(energy, 100, 0.5, seed=2, step=step).kept_indices
    d = R.topk_select(energy, 100, 0.5, seed=1, step=torch.tensor(4)).kept_indices
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_philox_matches_published_known_answer():
    # Random123's known-answer test for philox4x32-10: counter 0, key 0 -> first word 0x6627e8d5
    assert R.philox_4x32_10(0, torch.tensor(0), torch.tensor([0])).tolist() == [0x6627E8D5]


def test_gumbel_noise_statistics():
    g = R.gumbel_noise(0, torch.tensor(1), 200000, "cpu")
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03
    assert torch.isfinite(g).all()


def test_dapo_keeps_nonzero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    valid = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    assert R.dapo_keep_mask(rewards, valid).tolist() == [False, True, False, False]


def exact_largest_remainder(scores, total, tau, n_min, n_max):
    """Host oracle for docs/spec.md §6: iterative capped proportional split, then largest remainder."""
    w = torch.softmax(torch.tensor(scores, dtype=torch.float64) / tau, 0).tolist()
    b, cap, budget = len(w), n_max - n_min, total - len(w) * n_min
    # The reference's closed-form water-filling (sorted weights, cumulative sums) and this
    # iterative split round differently in fp64: shares within 64 ulp of the total of a bound
    # or an integer count as on it.
    slack = 64 * sys.float_info.epsilon * max(total, 1)
    fixed = {}
    while True:  # saturate rows whose proportional share exceeds the cap, repeat
        free = [i for i in range(b) if i not in fixed]
        left = budget - cap * len(fixed)
        mass = sum(w[i] for i in free)
        share = {i: left * w[i] / mass if mass > 0 else 0.0 for i in free}
        over = [i for i in free if share[i] > cap + slack]
        if not over:
            break
        fixed.update({i: cap for i in over})
    ideal = [fixed.get(i, share.get(i, 0.0)) for i in range(b)]
    base = [math.floor(x + slack) for x in ideal]
    order = sorted((i for i in range(b) if base[i] < cap), key=lambda i: (-(ideal[i] - base[i]), i))
    for i in order[: budget - sum(base)]:
        base[i] += 1
    return [n + n_min for n in base]


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=40),
    n_min=st.integers(0, 3),
    span=st.integers(1, 40),
    tau=st.sampled_from([0.1, 0.2, 0.3, 1.0]),
    fill=st.floats(0.0, 1.0),
)
def test_allocation_sums_bounds_and_matches_exact(scores, n_min, span, tau, fill):
    b, n_max = len(scores), n_min + span
    total = b * n_min + round(fill * b * span)
    counts = R.allocate_rollouts(torch.tensor(scores), total, tau, n_min, n_max)
    assert counts.sum().item() == total
    assert counts.min().item() >= n_min and counts.max().item() <= n_max
    exact = exact_largest_remainder(scores, total, tau, n_min, n_max)
    assert sum(abs(a - e) for a, e in zip(counts.tolist(), exact)) <= 2  # float rounding ties


def test_allocation_prefers_high_energy():
    counts = R.allocate_rollouts(torch.tensor([0.6, 0.3, 0.0]), 48, tau=0.2, n_min=2, n_max=32)
    assert counts.tolist()[0] > counts.tolist()[1] > counts.tolist()[2] >= 2


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 8), min_size=1, max_size=30),
    keep_ratio=st.floats(0.05, 1.0),
)
def test_selection_properties(counts, keep_ratio, params):
    state = SelectorState.empty(len(counts), "cpu")
    rewards = rows_with_correct(counts)
    out = R.lze_step(rewards, None, torch.arange(len(counts)), state, params)
    k = min(max(math.floor(len(counts) * keep_ratio), 1), len(counts))
    sel = R.topk_select(out.energy, k)
    candidates = int((out.energy > 0).sum())
    assert sel.num_kept.item() == min(k, candidates) == int(sel.keep_mask.sum())
    kept = out.energy[sel.keep_mask]
    dropped = out.energy[~sel.keep_mask & (out.energy > 0)]
    if kept.numel() and dropped.numel():
        assert kept.min() >= dropped.max()
    # Exactly 0 in exact arithmetic: each advantage's rounding plus the sum's own.
    group = rewards.shape[1]
    sum_bound = (advantage_error_bound(rewards, None, params.eps).sum(dim=1)
                 + gamma(group) * out.advantages.abs().sum(dim=1))
    assert_within(out.advantages.sum(dim=1), torch.zeros(len(counts)), sum_bound)

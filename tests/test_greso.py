"""GRESO's pre-rollout filter (lze_kernels.greso) on hand-made histories with known values."""

import pytest
import torch

from lze_kernels.greso import GresoConfig, GresoFilter

ALL_RIGHT, ALL_WRONG, MIXED = [1.0] * 4, [0.0] * 4, [1.0, 0.0, 1.0, 0.0]


def observe(f, ids, rows, valid=None):
    rewards = torch.tensor(rows)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    f.observe(torch.tensor(ids), rewards, valid)


def test_streaks_count_consecutive_zero_variance_epochs_by_kind():
    f = GresoFilter(5, GresoConfig(delta=0.0))
    observe(f, [0, 1, 2, 3], [ALL_RIGHT, ALL_WRONG, MIXED, ALL_RIGHT])
    observe(f, [0, 1, 2, 3], [ALL_RIGHT, ALL_WRONG, ALL_RIGHT, ALL_WRONG])
    assert f.streak.tolist() == [2, 2, 1, 1, 0]
    assert f.kind.tolist() == [1, 2, 1, 2, 0]
    observe(f, [0], [MIXED])  # a mixed group ends the streak
    assert f.streak[0] == 0 and f.kind[0] == 0


def test_rows_without_responses_keep_their_state():
    f = GresoFilter(3, GresoConfig(delta=0.0))
    observe(f, [0, 1], [ALL_RIGHT, ALL_WRONG])
    observe(f, [0, 1], [ALL_RIGHT, MIXED], valid=torch.tensor([[True] * 4, [False] * 4]))
    assert f.streak.tolist() == [2, 1, 0]


def test_keep_probability_is_p_to_the_streak_with_a_floor():
    f = GresoFilter(4, GresoConfig(delta=0.0, initial=0.5))
    f.p.copy_(torch.tensor([0.5, 0.1]))
    f.streak.copy_(torch.tensor([0, 2, 1, 3], dtype=torch.int32))
    f.kind.copy_(torch.tensor([0, 1, 2, 2], dtype=torch.int8))
    keep = f.keep_probability(torch.arange(4))
    torch.testing.assert_close(keep, torch.tensor([1.0, 0.25, 0.1, 0.01]))  # 0.1^3 -> floor


def test_skip_draw_is_seeded_and_follows_the_keep_probability():
    n = 20000
    f = GresoFilter(n, GresoConfig(delta=0.0, seed=3))
    f.streak.fill_(2)
    f.kind.fill_(1)  # p_easy^2 = 0.25
    ids = torch.arange(n)
    first = f.rollout_mask(ids, step=7)
    assert torch.equal(first, f.rollout_mask(ids, step=7))
    assert not torch.equal(first, f.rollout_mask(ids, step=8))
    assert abs(first.float().mean().item() - 0.25) < 0.015  # 5 sigma
    f.streak.zero_()
    assert f.rollout_mask(ids, step=7).all()  # no streak: always rolled out


def test_exploration_probabilities_move_toward_the_target_shares():
    # Target 0.3 split 1/3 easy (0.1), 2/3 hard (0.2). A step with 50 % all-right and no
    # all-wrong groups: too many easy ones (p_easy down), too few hard ones (p_hard up).
    f = GresoFilter(4, GresoConfig(target_zero_variance=0.3, easy_share=1 / 3, delta=0.01,
                                   initial=0.5))
    observe(f, [0, 1, 2, 3], [ALL_RIGHT, ALL_RIGHT, MIXED, MIXED])
    torch.testing.assert_close(f.p, torch.tensor([0.49, 0.51]))
    f.p.copy_(torch.tensor([0.05, 0.95]))
    observe(f, [0, 1, 2, 3], [ALL_RIGHT, ALL_RIGHT, MIXED, MIXED])
    torch.testing.assert_close(f.p, torch.tensor([0.05, 0.95]))  # clamped


def test_state_dict_round_trip_and_checks():
    f = GresoFilter(3)
    observe(f, [0, 2], [ALL_RIGHT, ALL_WRONG])
    g = GresoFilter(3)
    g.load_state_dict(f.state_dict())
    assert torch.equal(g.streak, f.streak) and torch.equal(g.p, f.p)
    with pytest.raises(ValueError, match="streak"):
        GresoFilter(4).load_state_dict(f.state_dict())


@pytest.mark.parametrize("kwargs, name", [({"target_zero_variance": 1.5}, "target_zero_variance"),
                                          ({"initial": 0.99}, "initial"),
                                          ({"easy_share": -0.1}, "easy_share")])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GresoConfig(**kwargs)


def test_draw_and_update_run_on_fake_tensors():
    """No host sync: both run where tensors have no data (a .item() or data-dependent shape
    would raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        f = GresoFilter(100)
        ids = torch.randperm(100)[:16]
        assert f.rollout_mask(ids, step=3).shape == (16,)
        f.observe(ids, torch.rand(16, 4).round(), torch.ones(16, 4, dtype=torch.bool))


def test_draw_and_update_copy_nothing_from_the_host(monkeypatch):
    """No tensor is built from host values on the hot path: on CUDA that is a copy that syncs
    (the first GPU run caught ``observe`` making its targets so, under sync debug mode)."""
    f = GresoFilter(100)
    ids, rewards = torch.randperm(100)[:16], torch.rand(16, 4).round()
    valid = torch.ones(16, 4, dtype=torch.bool)

    def host_copy(*args, **kwargs):
        raise AssertionError("torch.tensor on the hot path")

    monkeypatch.setattr(torch, "tensor", host_copy)
    f.rollout_mask(ids, step=3)
    f.observe(ids, rewards, valid)


def test_observe_without_adapting_updates_streaks_but_not_p():
    # The official trainer adapts p only from the second epoch (``if epoch > 0``).
    f = GresoFilter(3, GresoConfig(delta=0.1, initial=0.5))
    observe(f, [0, 1, 2], [ALL_RIGHT, ALL_RIGHT, ALL_WRONG])
    moved = f.p.clone()
    f.p.fill_(0.5)
    f.observe(torch.tensor([0, 1, 2]), torch.tensor([ALL_RIGHT, ALL_RIGHT, ALL_WRONG]),
              torch.ones(3, 4, dtype=torch.bool), adapt=False)
    assert f.p.tolist() == [0.5, 0.5] and f.streak.tolist() == [2, 2, 2]
    assert moved.tolist() != [0.5, 0.5]

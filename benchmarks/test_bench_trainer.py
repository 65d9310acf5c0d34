"""Where a GRPO step's time goes, per phase, and the share spent in selection (target < 1 %).

Each case runs the trainer under ``torchrun --nproc_per_node=2`` for a few steps and reads the
per-step ``timing_s/*`` metrics it logs (rank 0's clock). Steps after the first are summarised by
their median. ``timing_s/wait`` is rank 0 waiting at a barrier for the slowest engine's rollouts;
``timing_s/select`` is then everything selection costs the step: the all-gather of the ``[B, G]``
rewards, ``LZESelector.step`` (fused kernels) and reading the kept rows to the host.

Cases: the ``tiny`` preset with each engine (steps of a fraction of a second, the worst case for
the share), and the ``demo`` preset's model and batch (steps of seconds, as in real training).
Results: ``trainer_phases.json`` and ``.md`` in the run folder.
"""

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from bench_common import merge_result, run_file  # noqa: E402
from trainer_launch import tail, train  # noqa: E402

PHASES = ("prompts", "rollout", "reward", "wait", "select", "dispatch", "update", "sync", "step")
STEPS = 8
# A random tiny model is rarely right: its rewards are its responses' length parity, so that every
# step keeps groups and runs a real update (tests/trainer_rewards.py).
PARITY = ["reward.function=trainer_rewards:even_length", "sft_warmup.steps=0"]
CASES = [  # (preset, engine, extra overrides)
    ("tiny", "vllm", PARITY),
    ("tiny", "hf", PARITY),
    ("demo", "vllm", [*PARITY, "rollout.max_new_tokens=16"]),
]


@pytest.mark.parametrize("preset, engine, extra", CASES, ids=[f"{p}-{e}" for p, e, _ in CASES])
def test_trainer_step_phases(benchmark, tmp_path, preset, engine, extra):
    run_dir = tmp_path / "run"

    def run():
        result = train(run_dir, f"rollout.engine={engine}", f"trainer.total_steps={STEPS}",
                       "trainer.eval_every=0", "trainer.save_every=0",
                       "trainer.save_hf_model=false", "data.eval=[]", *extra, preset=preset,
                       timeout=1800)
        assert result.returncode == 0, tail(result)

    benchmark.pedantic(run, rounds=1, iterations=1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing_s/step" in r and r["step"] > 1]  # step 1 warms up
    summary = {f"{phase}_s": statistics.median(r[f"timing_s/{phase}"] for r in steps)
               for phase in PHASES}
    summary["select_share"] = statistics.median(r["timing_s/select_share"] for r in steps)
    summary["kept_ratio"] = statistics.mean(r["sa/kept_ratio"] for r in steps)
    summary.update(preset=preset, engine=engine, steps=len(steps))
    benchmark.extra_info.update(summary)
    _record(f"{preset}-{engine}", summary)


def _record(case: str, summary: dict) -> None:
    table = merge_result(run_file("trainer_phases.json"), case, summary)
    lines = ["| case | " + " | ".join(PHASES) + " | select share |",
             "|---" * (len(PHASES) + 2) + "|"]
    for name, s in sorted(table.items()):
        cells = [f"{s[f'{p}_s'] * 1000:.1f} ms" for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * s['select_share']:.2f} % |")
    run_file("trainer_phases.md").write_text(
        "Median per-phase time of a GRPO step (2 ranks, steps 2-8)\n\n" + "\n".join(lines) + "\n")

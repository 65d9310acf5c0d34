"""The short table a run ends with: what it learned, what it spent, where its time went."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .metrics import METRICS_FILE, PLOT_FILE, read_metrics

PHASES = ("rollout", "reward", "wait", "select", "dispatch", "update", "sync", "step")
# Parts of the update (inside its time, not added to the step's phases): the forward passes (old
# log-probs included), the backward passes and the optimizer steps (lze_trainer.actor).
UPDATE_PARTS = ("update_forward", "update_backward", "update_optimizer")


def run_summary(run_dir: Path, wall_seconds: float) -> str:
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "timing_s/step" in r]
    lines = [f"Run summary ({run_dir}, {len(steps)} steps, {wall_seconds / 60:.1f} min wall)"]
    lines += _held_out(rows)
    if steps:
        last = steps[-1]
        lines.append(
            f"  rollouts generated {last['total/rollouts']:,.0f} | groups kept "
            f"{last['total/update_groups']:,.0f} | update tokens {last['total/update_tokens']:,.0f}"
            f" | generated tokens {last['total/generated_tokens']:,.0f}")
        medians = {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in steps)
                   for p in PHASES + UPDATE_PARTS}
        share = statistics.median(r["timing_s/select_share"] for r in steps)
        parts = ", ".join(f"{p.removeprefix('update_')} {_seconds(medians[p])}"
                          for p in UPDATE_PARTS)
        lines.append("  median step: " + ", ".join(
            f"{p} {_seconds(medians[p])}" + (f" ({parts})" if p == "update" else "")
            for p in PHASES) + f"; selection {100 * share:.2f} % of the step")
    startup = {k.removeprefix("startup_s/"): v for r in rows[:1] for k, v in r.items()
               if k.startswith("startup_s/")}
    if startup:
        lines.append("  start-up: " + ", ".join(f"{k} {_seconds(v)}" for k, v in startup.items()))
    lines.append(f"  metrics {run_dir / METRICS_FILE} | TensorBoard {run_dir / 'tensorboard'} "
                 f"| plot {run_dir / PLOT_FILE}")
    return "\n".join(lines)


def _held_out(rows: list[dict]) -> list[str]:
    """Accuracy at the first and last evaluation, the change, and twice its standard error."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    lines = []
    for key in sorted(k for k in last if k.endswith(("/pass@1", "/sampled_acc"))):
        name = key.removeprefix("eval/")
        before, after = first.get(key, math.nan), last[key]
        two_se = 2 * math.hypot(first.get(key + "_se", 0.0), last.get(key + "_se", 0.0))
        label = "greedy" if key.endswith("pass@1") else "sampled"
        n = int(last.get(key.rsplit("/", 1)[0] + "/n", 0))
        lines.append(f"  held-out {name.rsplit('/', 1)[0]} ({label}, n={n}): {before:.3f} -> "
                     f"{after:.3f} ({100 * (after - before):+.1f} points, 2 SE = "
                     f"{100 * two_se:.1f}) at steps {first['step']} -> {last['step']}")
    return lines


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"

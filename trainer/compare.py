"""Runs side by side: ``python -m lze_trainer.compare RUN_DIR [RUN_DIR ...] --out FILE.png``.

One PNG with, per run, held-out accuracy (greedy pass@1 solid, sampled dashed) against GRPO step
and against the update tokens the run had spent by then (``total/update_tokens``: selection's
saving shows as a curve shifted left), and the mean training reward against step. It reads only
the runs' ``metrics.jsonl``, so it works on finished, running or copied runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .metrics import read_metrics


def plot_comparison(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens, reward) = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, run_dir in enumerate(run_dirs):
        rows = read_metrics(run_dir)
        if not rows:
            raise SystemExit(f"compare: {run_dir} has no metrics.jsonl (is it a run folder?)")
        color, name = f"C{index}", Path(run_dir).name
        spent = _update_tokens_by_step(rows)
        for key, style in _held_out_keys(rows):
            points = [(r["step"], r[key]) for r in rows if key in r]
            label = f"{name}: {key.removeprefix('eval/')}"
            by_step.plot(*zip(*points), style, color=color, marker="o", label=label)
            by_tokens.plot([spent[s] for s, _ in points], [v for _, v in points], style,
                           color=color, marker="o", label=label)
        steps = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        if steps:
            reward.plot(*zip(*steps), color=color, alpha=0.8, label=name)
    by_step.set(title="held-out accuracy", xlabel="GRPO step")
    by_tokens.set(title="held-out accuracy vs update cost", xlabel="update tokens spent")
    reward.set(title="train reward (mean over rollouts)", xlabel="GRPO step")
    for ax in (by_step, by_tokens, reward):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _held_out_keys(rows: list[dict]) -> list[tuple[str, str]]:
    keys = sorted({k for r in rows for k in r if k.startswith("eval/")})
    return ([(k, "-") for k in keys if k.endswith("/pass@1")]
            + [(k, "--") for k in keys if k.endswith("/sampled_acc")])


def _update_tokens_by_step(rows: list[dict]) -> dict[int, float]:
    """Update tokens spent by the end of each step (0 before the first)."""
    spent = {0: 0.0}
    for r in rows:
        if "total/update_tokens" in r:
            spent[r["step"]] = r["total/update_tokens"]
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lze_trainer.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (trainer.run_dir)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    print(plot_comparison(args.runs, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

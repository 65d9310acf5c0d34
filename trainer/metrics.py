"""Metrics: JSONL and TensorBoard on rank 0 (and Weights & Biases when configured), a tqdm bar,
and the end-of-run plot of reward, held-out accuracy and kept ratio against step."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from .run_log import console

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"


class Timer:
    """Wall-clock seconds per named phase of one step (``timing_s/<phase>``).

    Phases are exclusive: a phase entered inside another (a DOTS reference rollout inside the
    prompt phase) pauses the outer one, so the phases of a step add up to its wall time. A phase
    timed with ``inclusive=True`` (the whole step) stays outside that accounting."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [phase, start of its current stretch]

    @contextmanager
    def __call__(self, phase: str, inclusive: bool = False) -> Iterator[None]:
        start = time.perf_counter()
        if inclusive:
            try:
                yield
            finally:
                self._add(phase, time.perf_counter() - start)
            return
        if self._open:
            outer = self._open[-1]
            self._add(outer[0], start - outer[1])
        self._open.append([phase, start])
        try:
            yield
        finally:
            end = time.perf_counter()
            self._add(phase, end - self._open.pop()[1])
            if self._open:
                self._open[-1][1] = end

    def _add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def as_metrics(self) -> dict[str, float]:
        return {f"timing_s/{phase}": s for phase, s in self.seconds.items()}


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: Optional[int], total_steps: int,
                 wandb_project: Optional[str], progress_bar: bool, config_dict: dict):
        """``resume_step``: the checkpoint's step when resuming, None for a new run (which
        replaces the logs of an earlier run in the same folder)."""
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tensorboard = self.wandb = self.bar = None
        if not enabled:
            return
        if resume_step is None:
            self.path.unlink(missing_ok=True)
            shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
        else:
            truncate_jsonl(self.path, resume_step)
        from torch.utils.tensorboard import SummaryWriter

        start = resume_step or 0
        self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start + 1)
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config_dict,
                                    resume="allow", name=run_dir.name)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start, desc="GRPO", unit="step",
                            dynamic_ncols=True, file=console("err"))

    def start_clock(self) -> None:
        """The bar's rate and ETA count from the first GRPO step, not from its creation (before
        the warm-up, the engines and the first evaluation)."""
        if self.bar is not None:
            self.bar.unpause()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def advance(self, step: int, metrics: dict[str, float]) -> None:
        """Move the bar to ``step`` showing reward and kept ratio."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                 kept=f"{metrics.get('sa/kept_ratio', float('nan')):.2f}")

    def write(self, message: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=console())
        else:
            print(message, file=console(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def truncate_jsonl(path: Path, step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop what the lost run logged."""
    if Path(path).exists():
        kept = [r for r in read_jsonl(path) if r["step"] <= step]
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in kept))


def plot_run(run_dir: Path) -> Optional[Path]:
    """PNG of mean reward, held-out accuracy (greedy and sampled) and kept ratio against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _plot_series(axes[0], rows, ["reward/mean"], "train reward (mean over rollouts)")
    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/")
                        and (k.endswith("/pass@1") or k.endswith("/sampled_acc"))})
    _plot_series(axes[1], rows, eval_keys, "held-out accuracy")
    _plot_series(axes[2], rows, ["sa/kept_ratio"], "kept ratio (groups in the update)")
    axes[2].set_ylim(0, 1.05)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_series(ax, rows: list[dict], keys: list[str], title: str) -> None:
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=key)
    ax.set_title(title)
    if keys:
        ax.legend(fontsize=8)

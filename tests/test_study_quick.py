"""``make study QUICK=1``: the whole study pipeline (two methods, one seed, a few steps) under
torchrun, then its report. It checks the pipeline, not the result."""

import csv
import subprocess
import sys

import pytest

from trainer_launch import ROOT, environment

pytestmark = pytest.mark.slow


def test_quick_study_writes_csv_plots_and_report(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "lze_trainer.study", "--quick", "--runs",
                             str(runs), "--out", str(out)], cwd=ROOT, env=environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "study_steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == {"grpo", "lze"}
    grpo = [r for r in rows if r["method"] == "grpo"]
    lze = [r for r in rows if r["method"] == "lze"]
    assert [int(r["step"]) for r in grpo] == [0, 1, 2, 3, 4]
    assert [int(r["step"]) for r in grpo if r["pass@1"]] == [0, 2, 4]
    # LZE runs to plain GRPO's FLOPs (it trains on fewer groups a step: more steps), and is
    # evaluated where its FLOPs cross GRPO's held-out points.
    budget = float(grpo[-1]["flops"])
    flops = [float(r["flops"]) for r in lze]
    assert flops == sorted(flops) and flops[-1] >= budget > flops[-2]
    points = [float(r["flops"]) for r in grpo if r["pass@1"] and int(r["step"]) > 0]
    evaluated = [float(r["flops"]) for r in lze if r["pass@1"] and int(r["step"]) > 0]
    assert len(evaluated) == len(points) and all(e >= p for e, p in zip(evaluated, points))
    report = (out / "study.md").read_text()
    assert "| grpo (1) |" in report and "| lze (1) |" in report and "Quick pipeline check" in report
    assert "Budget: plain GRPO's 4 steps" in report
    assert "zero reward variance" in report
    for png in ("study_accuracy.png", "study_zero_variance.png"):
        assert (out / png).stat().st_size > 10_000
    # A second call keeps the finished runs and only rewrites the report.
    again = subprocess.run([sys.executable, "-m", "lze_trainer.study", "--quick", "--runs",
                            str(runs), "--out", str(out)], cwd=ROOT, env=environment(),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("is finished, kept") == 2

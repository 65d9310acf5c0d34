"""``make study QUICK=1``: the whole study pipeline of both regimes (two methods each, one seed, a
few steps, from the shipped warm start) under torchrun, then their reports. It checks the
pipeline, not the result: one rank a run (`make study` runs two; the trainer's multi-rank paths
are the end-to-end tests' job), which halves the four launches' start-up cost."""

import csv
import subprocess
import sys

import pytest

from trainer_launch import ROOT, environment

pytestmark = pytest.mark.slow


def test_quick_study_writes_csv_plots_and_report_for_both_regimes(tmp_path):
    from lze_trainer.study import REGIMES

    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "lze_trainer.study", "--quick", "--quick-runs", str(runs),
               "--nproc", "1"]
    result = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for regime in REGIMES.values():
        baseline, other = regime.quick_methods
        out = runs / regime.name / "report"
        with open(out / "study_steps.csv") as f:
            rows = list(csv.DictReader(f))
        assert {r["method"] for r in rows} == {baseline, other}
        grpo = [r for r in rows if r["method"] == baseline]
        selective = [r for r in rows if r["method"] == other]
        assert [int(r["step"]) for r in grpo] == [0, 1, 2, 3, 4]
        assert [int(r["step"]) for r in grpo if r["pass@1"]] == [0, 2, 4]
        # The other method runs to plain GRPO's FLOPs (it trains on fewer groups a step: more
        # steps), and is evaluated where its FLOPs cross GRPO's held-out points.
        budget = float(grpo[-1]["flops"])
        flops = [float(r["flops"]) for r in selective]
        assert flops == sorted(flops) and flops[-1] >= budget > flops[-2]
        points = [float(r["flops"]) for r in grpo if r["pass@1"] and int(r["step"]) > 0]
        evaluated = [float(r["flops"]) for r in selective if r["pass@1"] and int(r["step"]) > 0]
        assert len(evaluated) == len(points) and all(e >= p for e, p in zip(evaluated, points))
        assert float(grpo[-1]["rollout_tokens"]) == float(grpo[-1]["generated_tokens"]) > 0
        report = (out / "study.md").read_text()
        assert f"| {baseline} (1) |" in report and f"| {other} (1) |" in report
        assert "Quick pipeline check" in report and f"the `{regime.preset}` preset" in report
        assert "steps, " in report and "zero reward variance" in report and "## Summary" in report
        assert f"| {baseline}-s0 |" in report  # the runs with their load
        for png in ("study_accuracy.png", "study_accuracy_top.png", "study_zero_variance.png"):
            assert (out / png).stat().st_size > 10_000
    # A second call keeps the finished runs and only rewrites the reports.
    again = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and again.stdout.count("is finished, kept") == 4

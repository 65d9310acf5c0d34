"""The study's report on hand-made runs with known curves (the runs themselves: make study).

The hand-made study follows the protocol: plain GRPO runs 4 steps at 100 FLOPs a step and is
evaluated after every step; LZE spends 50 FLOPs a step, so it runs 8 steps to spend GRPO's 400
and is evaluated at steps 2, 4, 6, 8, where its FLOPs cross GRPO's points (100, 200, 300, 400).
"""

import ast
import csv
import json
from pathlib import Path

import pytest

from lze_trainer.study import budget_of, is_finished
from lze_trainer.study_report import (CSV_FILE, LOAD_FILE, MARKDOWN_FILE, WALL_FILE, at_budget,
                                      crossing, curve, goal_verdict, run_rows, table_rows,
                                      value_at, write_report)

GRPO = [0.1, 0.2, 0.3, 0.4, 0.5]


def _write_run(folder, accuracies, flops_per_step, every=1, step_s=1.0, wall=60.0,
               trained=(8.0, 3.0), tokens=40.0, entropy_tokens=0.0):
    """A run of ``every x (len(accuracies) - 1)`` steps evaluated every ``every`` steps and at
    step 0: greedy = accuracies[k] at its k-th point, sampled = half of it; ``trained``: groups
    trained per step, and how many of them had zero reward variance; ``tokens`` generated and
    ``entropy_tokens`` prefilled for HIVE's entropy per step."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "startup_s/data": 1.0},
            {"step": 0, "eval/heldout/pass@1": accuracies[0],
             "eval/heldout/sampled_acc": accuracies[0] / 2}]
    for step in range(1, every * (len(accuracies) - 1) + 1):
        row = {"step": step, "total/flops": step * flops_per_step,
               "total/rollouts": 8.0 * step, "total/generated_tokens": tokens * step,
               "total/forward/entropy": entropy_tokens * step,
               "total/update_tokens": 10.0 * step, "timing_s/step": step_s,
               "total/update_groups": trained[0] * step,
               "total/zero_variance_trained": trained[1] * step,
               "timing_s/rollout": step_s / 2, "timing_s/update": step_s / 4,
               "reward/zero_std_frac": 0.5, "select/zero_variance_trained_frac": 0.1,
               "reward/all_correct_frac": 0.2, "reward/all_wrong_frac": 0.3}
        if step % every == 0:
            row.update({"eval/heldout/pass@1": accuracies[step // every],
                        "eval/heldout/sampled_acc": accuracies[step // every] / 2})
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / WALL_FILE).write_text(f"{wall}\n")
    (folder / LOAD_FILE).write_text(json.dumps({"mean": 1.5, "max": 2.0}) + "\n")


@pytest.fixture
def study(tmp_path):
    runs = tmp_path / "runs"
    for seed, lze_end in ((0, 0.55), (1, 0.57)):
        _write_run(runs / f"grpo-s{seed}", GRPO, 100.0)
        _write_run(runs / f"lze-s{seed}", [0.1, 0.2, 0.3, 0.5, lze_end], 50.0, every=2,
                   step_s=0.5, trained=(5.0, 0.0))
        _write_run(runs / f"slow-s{seed}", [0.1, 0.1, 0.2, 0.2, 0.3], 100.0)
    return {m: [runs / f"{m}-s{s}" for s in (0, 1)] for m in ("grpo", "lze", "slow")}


def _table(study):
    curves = {metric: {m: curve([run_rows(m, s, f) for s, f in enumerate(folders)], [0, 1],
                                metric)
                       for m, folders in study.items()} for metric in ("pass@1", "sampled_acc")}
    return {(t["metric"], t["method"]): t for t in table_rows(curves, "grpo")}


def test_rows_are_cumulative_and_merge_step_zero(study):
    rows = run_rows("grpo", 0, study["grpo"][0])
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["pass@1"] == 0.1 and rows[0]["flops"] == 0.0
    assert [r["wall_s"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_crossing_and_value_interpolate_between_held_out_points():
    accuracy, cost = [0.1, 0.3, 0.5], [0.0, 100.0, 200.0]
    assert crossing(accuracy, cost, 0.4) == pytest.approx(150.0)
    assert crossing(accuracy, cost, 0.1) == 0.0 and crossing(accuracy, cost, 0.6) is None
    # The first crossing counts, not a later one after a dip.
    assert crossing([0.1, 0.5, 0.2, 0.6], [0, 10, 20, 30], 0.3) == pytest.approx(5.0)
    assert value_at(accuracy, cost, 50.0) == pytest.approx(0.2)
    assert value_at(accuracy, cost, 200.0) == pytest.approx(0.5)
    assert value_at(accuracy, cost, 250.0) is None  # the run stopped before it


def test_compute_to_ninety_percent_of_grpo_gain_and_to_its_final(study):
    table = _table(study)
    grpo, lze, slow = (table[("pass@1", m)] for m in ("grpo", "lze", "slow"))
    # GRPO: 0.1 -> 0.5, so 90 % of its gain is 0.46, crossed at 300 + 0.6 x 100 = 360 FLOPs.
    assert grpo["targets"].gain == pytest.approx(0.46) and grpo["targets"].final == 0.5
    assert grpo["gain"]["flops"] == pytest.approx(1.0) and grpo["gain_paired"]["flops"] == [1, 1]
    # LZE: 0.3 at 200 FLOPs, 0.5 at 300: 0.46 at 280, after 5.6 steps of 0.5 s vs GRPO's 3.6 s.
    assert lze["gain"]["flops"] == pytest.approx(280 / 360)
    assert lze["gain"]["wall_s"] == pytest.approx((280 / 50 * 0.5) / 3.6)
    assert lze["gain_paired"]["flops"] == [pytest.approx(280 / 360)] * 2
    # It generates as many tokens a step as GRPO (it rolls out every prompt) in 5.6 steps to
    # GRPO's 3.6: backward selection alone saves no rollout tokens.
    assert lze["gain"]["rollout_tokens"] == pytest.approx(5.6 / 3.6)
    assert lze["gain_paired"]["rollout_tokens"] == [pytest.approx(5.6 / 3.6)] * 2
    # GRPO's final 0.5: LZE at 300 FLOPs, GRPO at 400.
    assert lze["final"]["flops"] == pytest.approx(300 / 400)
    assert slow["gain"]["flops"] is None and slow["gain_paired"]["flops"] == [None, None]


def test_generated_tokens_count_every_purpose_and_the_entropy_prefill(tmp_path):
    _write_run(tmp_path / "hive-s0", GRPO, 100.0, tokens=30.0, entropy_tokens=5.0)
    rows = run_rows("hive", 0, tmp_path / "hive-s0")
    assert rows[-1]["generated_tokens"] == 120.0 and rows[-1]["rollout_tokens"] == 140.0


def test_accuracy_at_shares_of_the_budget_with_paired_differences(study):
    lze = _table(study)[("pass@1", "lze")]
    quarter, half, full = (lze["at"][f] for f in (0.25, 0.5, 1.0))
    assert quarter["mean"] == pytest.approx(0.2) and quarter["diff"] == pytest.approx(0.0)
    assert half["mean"] == pytest.approx(0.3)
    # At 400 FLOPs: 0.55 and 0.57 against GRPO's 0.5 on both seeds.
    assert full["mean"] == pytest.approx(0.56) and full["diff"] == pytest.approx(0.06)
    assert full["diff_se"] == pytest.approx(0.01)
    assert full["se"] == pytest.approx(0.01)


def test_a_run_that_stopped_short_has_no_value_at_the_full_budget(tmp_path):
    runs = tmp_path / "runs"
    _write_run(runs / "grpo-s0", GRPO, 100.0)
    _write_run(runs / "capped-s0", [0.1, 0.2, 0.3], 50.0, every=2)  # 200 of 400 FLOPs
    rows = {m: [run_rows(m, 0, runs / f"{m}-s0")] for m in ("grpo", "capped")}
    base, capped = (curve(rows[m], [0], "pass@1") for m in ("grpo", "capped"))
    assert at_budget(capped, base, 0.5)["mean"] == pytest.approx(0.3)
    assert at_budget(capped, base, 1.0) is None
    text = write_report({m: [runs / f"{m}-s0"] for m in rows}, "grpo", tmp_path / "out",
                        rates={"grpo": 3e-4, "capped": 3e-4}).read_text()
    assert ("| capped (1) | 0.0003 | 0.200 ± n/a | +0.000 ± n/a | 0.300 ± n/a | +0.000 ± n/a "
            "| ran short |") in text


def test_goal_needs_every_ratio_on_both_metrics_and_a_lead_of_two_paired_se(study):
    table = list(_table(study).values())
    verdict = goal_verdict(table, "lze")
    assert "**not met** by `lze`" in verdict and "0.78x the FLOPs (goal 0.5x)" in verdict
    # The costs the goal does not cap are stated beside it.
    assert verdict.endswith("Its generated tokens to 90 % of the gain: 1.56x (greedy pass@1), "
                            "1.56x (sampled accuracy) (outside this regime's goal).")
    fast = [{**t, "method": "fast", "gain": {"flops": 0.4, "wall_s": 0.5, "rollout_tokens": 0.7}}
            for t in table if t["method"] == "lze"]
    assert "**met** by `fast`" in goal_verdict(table + fast, "fast")
    # Where the goal counts generated tokens too (many passes), their ratio alone can miss.
    tokens = goal_verdict(table + fast, "fast", ("flops", "wall_s", "rollout_tokens"), "many-pass")
    assert tokens.startswith("**Goal, many-pass**") and "0.5x its generated tokens" in tokens
    assert "**not met** by `fast`: on greedy pass@1 it needs 0.70x the generated tokens" in tokens
    assert "FLOPs (goal" not in tokens
    level = [{**t, "at": {**t["at"], 1.0: {**t["at"][1.0], "diff": 0.01, "diff_se": 0.01}}}
             for t in fast]
    assert "not two SE above" in goal_verdict(table + level, "fast")


def test_report_files(study, tmp_path):
    out = tmp_path / "report"
    path = write_report(study, "grpo", out, rates={"grpo": 3e-4, "lze": 1.5e-4})
    text = path.read_text()
    assert path == out / MARKDOWN_FILE
    assert ("| lze (2) | 0.00015 | 0.200 ± 0.000 | +0.000 ± 0.000 | 0.300 ± 0.000 | "
            "+0.000 ± 0.000 | 0.560 ± 0.010 | +0.060 ± 0.010 |") in text
    assert "| lze | 0.78x (0.78x, 0.78x) | 0.78x | 1.56x (1.56x, 1.56x) | 0.75x (0.75x, 0.75x) |" \
        in text
    assert "slow does not help on greedy pass@1: it never reached 90 % of plain GRPO's gain" in text
    assert ("lze reached 90 % of plain GRPO's gain on greedy pass@1 with 0.78x its FLOPs, 0.78x "
            "its wall time and 1.56x its generated tokens") in text
    assert ("at the full budget it is -0.200 ± 0.000 against plain GRPO (paired), below it by "
            "more than two SE.") in text
    assert "Budget: plain GRPO (`grpo`, learning rate 0.0003) 4 steps, 400 FLOPs" in text
    assert "50 % of the groups had zero reward variance (20 % all right, 30 % all wrong" in text
    assert "The runs took 6 min in all" in text
    assert "| lze-s0 | 1.0 | 0.50 | 1.5 | 2.0 |" in text  # the runs with their load
    with open(out / CSV_FILE) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * (5 + 9 + 5)
    for png in ("study_accuracy.png", "study_accuracy_top.png", "study_zero_variance.png"):
        assert (out / png).stat().st_size > 10_000


def test_the_summary_holds_the_verdict_and_grpo_with_the_best_methods(study, tmp_path):
    runs = tmp_path / "runs"
    for seed in (0, 1):  # a fourth method, so that the summary leaves one out
        _write_run(runs / f"level-s{seed}", GRPO, 100.0)
    methods = {**study, "level": [runs / f"level-s{s}" for s in (0, 1)]}
    text = write_report(methods, "grpo", tmp_path / "report", rates={"grpo": 1.5e-4},
                        search={"best": {"method": "lze", "candidates": ["lze"], "seeds": [10],
                                         "ratios": {}},
                                "report": tmp_path / "search" / MARKDOWN_FILE}).read_text()
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert "**Goal** (the best method reaches 90 % of tuned plain GRPO's gain" in summary
    lines = [line for line in summary.splitlines() if line.startswith("| ")]
    # GRPO first, then the best three by their worst ratio: lze, level (1.0x), slow (never).
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| grpo", "| lze", "| level", "| slow"]
    assert lines[1].startswith("| grpo | 0.00015 | 0.500 (+0.000 ± 0.000) "
                               "| 0.250 (+0.000 ± 0.000) | 1.00x / 1.00x | 1.00x / 1.00x "
                               "| 1.00x / 1.00x |")


def test_the_search_tunes_each_baseline_by_how_high_it_ends(tmp_path, monkeypatch):
    from lze_trainer.study_report import end_score, read_best, tuned_variant

    runs = tmp_path / "runs"
    ends = {"grpo-lr0.5": 0.6, "grpo": 0.5, "grpo-lr2": 0.4}
    for name, end in ends.items():
        _write_run(runs / f"{name}-s10", [0.1, 0.2, 0.3, 0.4, end], 100.0)
    folders = {m: [runs / f"{m}-s10"] for m in ends}
    # The last four points, greedy and sampled (half of greedy) averaged.
    assert end_score(folders["grpo"]) == pytest.approx(0.75 * (0.2 + 0.3 + 0.4 + 0.5) / 4)
    assert tuned_variant(folders) == "grpo-lr0.5"
    _write_run(runs / "lze-s10", [0.1, 0.3, 0.5, 0.6, 0.7], 50.0, every=2)
    text = write_report({**folders, "lze": [runs / "lze-s10"]}, "grpo-lr0.5", tmp_path / "search",
                        rates={"grpo-lr0.5": 1.5e-4, "grpo": 3e-4, "grpo-lr2": 6e-4},
                        candidates=["lze"], tuned={"grpo": list(ends)}).read_text()
    assert read_best(tmp_path / "search")["tuned"] == {"grpo": "grpo-lr0.5"}
    assert "| grpo-lr0.5 | 0.00015 | 0.281 | yes |" in text
    assert "`grpo-lr0.5` is at the grid's edge" in text


def test_main_methods_run_the_tuned_baselines_and_the_pick(tmp_path, monkeypatch):
    from lze_trainer.study import METHODS, REGIMES, main_methods, overrides

    regime = REGIMES["one-pass"]
    monkeypatch.chdir(tmp_path)
    assert main_methods(regime) == ("grpo", list(METHODS))  # before any search
    regime.search_report.mkdir(parents=True)
    (regime.search_report / "best.json").write_text(json.dumps(
        {"method": "lze-refill-lr0.5", "tuned": {"grpo": "grpo-lr0.5", "dapo": "dapo-lr2"}}))
    baseline, methods = main_methods(regime)
    assert baseline == "grpo-lr0.5" and methods[:2] == ["grpo-lr0.5", "dapo-lr2"]
    assert methods[-1] == "lze-refill-lr0.5" and "lze" in methods and len(methods) == 12
    assert overrides("lze-refill-lr0.5", "study") == [
        "selection.method=lze", "selection.refill=true", "actor.lr=0.00015"]


def test_a_method_name_with_a_learning_rate_is_split_and_checked():
    from lze_trainer.study import split_variant, variant

    assert variant("grpo", 1.0) == "grpo" and variant("grpo", 0.5) == "grpo-lr0.5"
    assert split_variant("greso-lze-lr2") == ("greso-lze", 2.0)
    assert split_variant("speed-greso-lze") == ("speed-greso-lze", 1.0)
    with pytest.raises(SystemExit, match="unknown method 'nope-lr2'"):
        split_variant("nope-lr2")


def test_one_seed_has_no_se_so_nothing_is_called_below_plain_grpo(study, tmp_path):
    one_seed = {m: folders[:1] for m, folders in study.items()}
    text = write_report(one_seed, "grpo", tmp_path / "report").read_text()
    assert "at the full budget it is -0.200 ± n/a against plain GRPO (paired)." in text
    assert "below it" not in text


def test_every_method_has_its_own_colour_and_marker_and_grpo_stands_out():
    from lze_trainer.study_report import _styles

    methods = ["grpo"] + [f"m{k}" for k in range(11)]
    styles = _styles(methods, "grpo")
    others = [styles[m] for m in methods[1:]]
    assert len({s["color"] for s in others}) == 11 and len({s["marker"] for s in others}) == 11
    assert styles["grpo"]["color"] == "black" and "black" not in {s["color"] for s in others}
    assert styles["grpo"]["linewidth"] > max(s["linewidth"] for s in others)


def test_signal_per_step_counts_the_groups_with_mixed_rewards(study, tmp_path):
    """GRPO trains on 8 groups a step, 5 of them mixed, for 100 FLOPs; LZE on 5, all mixed, for
    50: the same signal per step at half the FLOPs, twice the signal per FLOP."""
    from lze_trainer.study_report import signal_per_step

    rows = {m: [run_rows(m, s, f) for s, f in enumerate(folders)] for m, folders in study.items()}
    signal = signal_per_step(rows)
    assert signal["grpo"] == pytest.approx(
        {"flops": 100.0, "trained_groups": 8.0, "trained_mixed_groups": 5.0})
    assert signal["lze"] == pytest.approx(
        {"flops": 50.0, "trained_groups": 5.0, "trained_mixed_groups": 5.0})
    text = write_report(study, "grpo", tmp_path / "report").read_text()
    assert "| grpo | 1.00x | 8.0 | 5.0 | 1.00x | 1.00x |" in text
    assert "| lze | 0.50x | 5.0 | 5.0 | 1.00x | 2.00x |" in text
    with open(tmp_path / "report" / CSV_FILE) as f:
        last = [r for r in csv.DictReader(f) if r["method"] == "lze" and r["step"] == "8"][0]
    assert float(last["trained_groups"]) == 40.0 and float(last["trained_mixed_groups"]) == 40.0


def test_runs_without_group_totals_have_no_signal_table(tmp_path):
    """Runs logged before the trainer counted trained groups: the table is left out, not faked."""
    from lze_trainer.study_report import signal_per_step

    folder = tmp_path / "grpo-s0"
    _write_run(folder, [0.1, 0.2], 100.0)
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        r.pop("total/update_groups", None)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert signal_per_step({"grpo": [run_rows("grpo", 0, folder)]}) == {}
    text = write_report({"grpo": [folder]}, "grpo", tmp_path / "report").read_text()
    assert "Training signal per step" not in text


def test_the_report_says_whether_the_machine_kept_its_speed(study, tmp_path):
    steady = write_report(study, "grpo", tmp_path / "steady").read_text()
    assert "plain GRPO per seed: 1.00, 1.00 s (within 15 % of each other" in steady
    assert "mix speeds" not in steady
    # The same work ran 1.2x slower for seed 1: its wall time says nothing about the method.
    runs = tmp_path / "drift"
    _write_run(runs / "grpo-s0", GRPO, 100.0)
    _write_run(runs / "grpo-s1", GRPO, 100.0, step_s=1.2)
    drift = write_report({"grpo": [runs / "grpo-s0", runs / "grpo-s1"]}, "grpo",
                         tmp_path / "drift-report").read_text()
    assert "1.00, 1.20 s: they differ by more than 15 %" in drift
    assert "**the wall-time ratios mix speeds**" in drift


def test_the_report_counts_the_seeds_each_method_ran(study, tmp_path):
    assert "seeds per method: 2." in write_report(study, "grpo", tmp_path / "even").read_text()
    # An interrupted study: slow's seed 1 never ran, so slow's row rests on one seed.
    uneven = {**study, "slow": [study["slow"][0], tmp_path / "runs" / "slow-s9"]}
    text = write_report(uneven, "grpo", tmp_path / "uneven").read_text()
    assert "seeds per method: 1 to 2 (each row says how many)." in text
    assert "| slow (1) |" in text


def test_a_run_is_finished_once_it_ended_cleanly(study):
    assert is_finished(study["grpo"][0])
    (study["grpo"][0] / WALL_FILE).unlink()  # killed before the study recorded its wall time
    assert not is_finished(study["grpo"][0])


def test_the_budget_of_a_seed_is_what_plain_grpo_spent_and_where_it_evaluated(study):
    assert budget_of(study["grpo"][0]) == [
        "trainer.flops_budget=400.0", "trainer.eval_at_flops=[100.0,200.0,300.0,400.0]"]
    from lze_trainer.config import load

    trainer = load("study", budget_of(study["grpo"][0])).trainer
    assert trainer.flops_budget == 400.0 and trainer.eval_at_flops == [100.0, 200.0, 300.0, 400.0]


def test_no_ratio_when_grpo_never_beats_its_start(tmp_path):
    runs = tmp_path / "runs"
    _write_run(runs / "grpo-s0", [0.3, 0.2, 0.1], 100.0)
    _write_run(runs / "lze-s0", [0.3, 0.4, 0.5], 100.0)
    text = write_report({m: [runs / f"{m}-s0"] for m in ("grpo", "lze")}, "grpo",
                        tmp_path / "out").read_text()
    assert "n/a (GRPO never beat its start)" in text
    assert "never rose above its start, so no ratio is defined for lze" in text


def test_readme_quotes_each_regimes_summary_between_its_markers(study, tmp_path):
    from lze_trainer.study_report import README_BEGIN, README_END, quote_in_readme

    old = tmp_path / "old.md"  # a report from before the summary is left out
    old.write_text("# Title\n\n## Held-out greedy pass@1\n")
    reports = {"one-pass": write_report(study, "grpo", tmp_path / "docs"),
               "many-pass": write_report(study, "grpo", tmp_path / "docs" / "many"), "old": old}
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n")
    assert quote_in_readme(reports, readme)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "#### One-pass ([full report](docs/study.md))" in text
    assert "#### Many-pass ([full report](docs/many/study.md))" in text
    assert text.count("| grpo | - |") == 2 and "| lze |" in text
    assert "Held-out greedy" not in text and "Training signal" not in text and "Old" not in text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not quote_in_readme(reports, plain) and plain.read_text() == "no markers\n"


def test_the_search_picks_the_smallest_worst_ratio_and_the_main_report_names_it(
        study, tmp_path, monkeypatch):
    from lze_trainer.study import REGIMES, main_methods, overrides
    from lze_trainer.study_report import read_best

    regime = REGIMES["one-pass"]
    monkeypatch.chdir(tmp_path)
    search_report = {"best": None, "report": regime.search_report / MARKDOWN_FILE}
    before = write_report(study, "grpo", regime.report, search=search_report).read_text()
    assert "best combination found" not in before and "**Goal**" not in before
    search = write_report(study, "grpo", regime.search_report,
                          candidates=["slow", "lze"]).read_text()
    best = read_best(regime.search_report)
    # LZE reaches 90 % of GRPO's gain at 280 of its 360 FLOPs and 2.8 of its 3.6 s; slow never.
    assert best["method"] == "lze" and best["worst_ratio"] == pytest.approx(280 / 360)
    assert best["candidates"] == ["lze", "slow"] and best["seeds"] == [0, 1]
    assert "Picked as the best combination" in search and "**not met** by `lze`" in search
    main = write_report(study, "grpo", regime.report,
                        overrides={m: overrides(m, "study") for m in ("grpo", "lze")},
                        search={**search_report, "best": best}).read_text()
    assert "The best combination found is `lze` (`selection.method=lze`)" in main
    assert "greedy pass@1 0.78x FLOPs, 0.78x wall time" in main and "`slow` did worse" in main
    assert "**Goal**" in main and "**not met** by `lze`" in main
    assert main_methods(regime)[1].count("lze") == 1


def test_pick_best_wants_both_metrics_reached_then_the_larger_lead():
    from lze_trainer.study_report import pick_best

    def rows(method, greedy, sampled, lead):
        return [{"metric": m, "method": method, "gain": {"flops": r, "wall_s": r},
                 "at": {1.0: {"diff": lead}}} for m, r in (("pass@1", greedy),
                                                           ("sampled_acc", sampled))]

    table = rows("grpo", 1.0, 1.0, 0.0) + rows("fast-greedy", 0.2, None, 0.05) \
        + rows("even", 0.6, 0.7, 0.01) + rows("never", None, None, 0.02)
    assert pick_best(table, ["fast-greedy", "even", "never"], [10])["method"] == "even"
    assert pick_best(table, ["fast-greedy", "never"], [10])["method"] == "fast-greedy"
    assert pick_best(table, ["fast-greedy", "never"], [10])["worst_ratio"] is None
    assert pick_best(table, ["absent"], [10]) is None


@pytest.mark.parametrize("folder", [".", "replica"])
def test_the_link_to_the_search_resolves_from_the_report_folder(study, folder, tmp_path,
                                                                 monkeypatch):
    from lze_trainer.study import REGIMES
    from lze_trainer.study_report import read_best

    search_report = REGIMES["one-pass"].search_report
    monkeypatch.chdir(tmp_path)
    write_report(study, "grpo", search_report, candidates=["lze"])
    out = Path("docs") / folder
    search = {"best": read_best(search_report), "report": search_report / MARKDOWN_FILE}
    text = write_report(study, "grpo", out, search=search).read_text()
    link = text.split("(see [the search](")[1].split(")")[0]
    assert (out / link).resolve() == (search_report / "study.md").resolve()
    task = text.split("[study-task.md](")[1].split(")")[0]
    assert (out / task).resolve() == (tmp_path / "docs" / "study-task.md").resolve()


def test_the_report_does_not_import_the_study_driver():
    """study -> study_report only: the report is computed from runs, not from the driver."""
    import lze_trainer.study_report as report

    tree = ast.parse(Path(report.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name and name.endswith("study") for name in imported), imported


@pytest.mark.parametrize("regime", ["one-pass", "many-pass"])
def test_every_study_method_loads_with_its_preset_at_the_official_settings(regime):
    from lze_trainer.config import load
    from lze_trainer.study import BASE_METHODS, LR_FACTORS, REGIMES, TUNED, overrides, variant

    r = REGIMES[regime]
    preset = load(r.preset)
    configs = {m: load(r.preset, overrides(m, r.preset)) for m in BASE_METHODS}
    assert {c.rollout.n for c in configs.values()} == {preset.rollout.n}  # one G for all
    assert preset.selection.speed.screen_rollouts * 3 <= preset.rollout.n  # a third at most
    for m in ("dots", "dots-replay"):  # the official K / B = 256 / 512
        assert configs[m].selection.dots.reference_size * 2 == preset.trainer.batch_size
    assert configs["dots-replay"].replay.buffer_size == preset.trainer.batch_size
    assert all(c.actor.lr == preset.actor.lr for c in configs.values())
    for m in (*TUNED, *r.candidates):  # the search's grid, the same for every method
        for f in LR_FACTORS:
            assert load(r.preset, overrides(variant(m, f), r.preset)).actor.lr == pytest.approx(
                f * preset.actor.lr)


def test_a_best_rate_at_the_grids_edge_adds_the_next_rate_beyond_it(tmp_path, monkeypatch):
    from lze_trainer.study import REGIMES, _rate_grid

    regime = REGIMES["one-pass"]
    monkeypatch.chdir(tmp_path)
    runs = regime.search_runs
    for name, end in {"grpo-lr0.5": 0.6, "grpo": 0.5, "grpo-lr2": 0.4, "grpo-lr0.25": 0.7,
                      "lze-lr0.5": 0.5, "lze": 0.6, "lze-lr2": 0.4}.items():
        _write_run(runs / f"{name}-s10", [0.1, 0.2, 0.3, 0.4, end], 100.0)
    # Without launching (run=False) the grid is what finished: GRPO's best, 0.5x, is at the edge,
    # so 0.25x joins it; LZE's best is inside the grid.
    assert _rate_grid(regime, "grpo", [10], None, 2, run=False) == [
        "grpo-lr0.5", "grpo", "grpo-lr2", "grpo-lr0.25"]
    assert _rate_grid(regime, "lze", [10], "grpo-lr0.25", 2, run=False) == [
        "lze-lr0.5", "lze", "lze-lr2"]


def test_a_wall_time_ratio_from_runs_at_another_load_is_marked(study, tmp_path):
    from lze_trainer.study_report import load_mismatch

    assert load_mismatch(study, "grpo") == set()  # every run met a load of 1.5
    for folder in study["lze"]:  # LZE's runs met twice GRPO's load
        (folder / LOAD_FILE).write_text(json.dumps({"mean": 3.0, "max": 4.0}) + "\n")
    assert load_mismatch(study, "grpo") == {"lze"}
    text = write_report(study, "grpo", tmp_path / "report").read_text()
    assert "| lze | 0.78x (0.78x, 0.78x) | 0.78x † | 1.56x" in text
    assert "† Its runs met a machine load" in text


@pytest.mark.parametrize("repeats", [True, False])
def test_a_run_timed_again_replaces_it_only_when_it_repeats_its_outcome(study, repeats,
                                                                       monkeypatch):
    import shutil

    from lze_trainer import study as driver

    folder = study["grpo"][0]
    (folder / "config.yaml").write_text("trainer: {}\n")
    (folder.parent / f"{folder.name}.log").write_text("first\n")

    def fake_launch(twin, args, nproc):  # the same run again, twice as fast
        assert args == ["--config", str(folder / "config.yaml")]
        shutil.copytree(folder, twin)
        rows = [json.loads(x) for x in (twin / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r["timing_s/step"] = r.get("timing_s/step", 0.0) / 2
            if not repeats and "eval/heldout/pass@1" in r:
                r["eval/heldout/pass@1"] += 0.01
        (twin / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (twin.parent / f"{twin.name}.log").write_text("again\n")
        return 30.0

    monkeypatch.setattr(driver, "_launch", fake_launch)
    if repeats:
        driver.retime(folder, 2)
        assert run_rows("grpo", 0, folder)[-1]["wall_s"] == 2.0
        assert (folder.parent / f"{folder.name}.log").read_text() == "again\n"
        assert not (folder.parent / f"{folder.name}-retime").exists()
    else:
        with pytest.raises(SystemExit, match="not deterministic here"):
            driver.retime(folder, 2)
        assert run_rows("grpo", 0, folder)[-1]["wall_s"] == 4.0

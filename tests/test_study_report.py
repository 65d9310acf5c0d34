"""The study's report on hand-made runs with known curves (the runs themselves: make study)."""

import csv
import json

import pytest

from lze_trainer.study import WALL_FILE, is_finished
from lze_trainer.study_report import (CSV_FILE, MARKDOWN_FILE, area_per_flop, curve, run_rows,
                                      table_rows, write_report)


def _write_run(folder, accuracies, flops_per_step, step_s=1.0, wall=60.0, trained=(8.0, 3.0)):
    """A run that evaluates every step: greedy = accuracies[step], sampled = half of it;
    ``trained``: groups trained per step, and how many of them had zero reward variance."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "startup_s/data": 1.0},
            {"step": 0, "eval/heldout/pass@1": accuracies[0],
             "eval/heldout/sampled_acc": accuracies[0] / 2}]
    for step in range(1, len(accuracies)):
        rows.append({"step": step, "total/flops": step * flops_per_step,
                     "total/rollouts": 8.0 * step, "total/generated_tokens": 40.0 * step,
                     "total/update_tokens": 10.0 * step, "timing_s/step": step_s,
                     "total/update_groups": trained[0] * step,
                     "total/zero_variance_trained": trained[1] * step,
                     "timing_s/rollout": step_s / 2, "timing_s/update": step_s / 4,
                     "reward/zero_std_frac": 0.5, "select/zero_variance_trained_frac": 0.1,
                     "reward/all_correct_frac": 0.2, "reward/all_wrong_frac": 0.3,
                     "eval/heldout/pass@1": accuracies[step],
                     "eval/heldout/sampled_acc": accuracies[step] / 2})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / WALL_FILE).write_text(f"{wall}\n")


@pytest.fixture
def study(tmp_path):
    runs = tmp_path / "runs"
    # GRPO: 0.1 -> 0.5 in 4 steps at 100 FLOPs a step; LZE: the same accuracies at half the cost.
    for seed in (0, 1):
        _write_run(runs / f"grpo-s{seed}", [0.1, 0.2, 0.3, 0.4, 0.5], 100.0)
        _write_run(runs / f"lze-s{seed}", [0.1, 0.2, 0.3, 0.5, 0.5], 50.0, step_s=0.5,
                   trained=(5.0, 0.0))
        _write_run(runs / f"slow-s{seed}", [0.1, 0.1, 0.2, 0.2, 0.3], 100.0)
    return {m: [runs / f"{m}-s{s}" for s in (0, 1)] for m in ("grpo", "lze", "slow")}


def test_rows_are_cumulative_and_merge_step_zero(study):
    rows = run_rows("grpo", 0, study["grpo"][0])
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["pass@1"] == 0.1 and rows[0]["flops"] == 0.0
    assert [r["wall_s"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_ratios_against_grpo_area_and_final(study):
    curves = {metric: {m: curve([run_rows(m, 0, f) for f in folders], metric)
                       for m, folders in study.items()} for metric in ("pass@1", "sampled_acc")}
    table = {(t["metric"], t["method"]): t for t in table_rows(curves, "grpo")}
    grpo, lze, slow = (table[("pass@1", m)] for m in ("grpo", "lze", "slow"))
    assert grpo["flops_ratio"] == pytest.approx(1.0) and grpo["target"] == pytest.approx(0.5)
    # LZE reaches 0.5 at step 3 with 150 FLOPs; GRPO at step 4 with 400; wall 1.5 s vs 4 s.
    assert lze["flops_ratio"] == pytest.approx(150 / 400)
    assert lze["wall_ratio"] == pytest.approx(1.5 / 4)
    assert slow["flops_ratio"] is None and slow["best"] == pytest.approx(0.3)
    assert lze["final"] == pytest.approx(0.5) and lze["final_se"] == pytest.approx(0.0)
    # Area over the smallest total (LZE's 200 FLOPs): GRPO rises 0.1 -> 0.3 there (mean 0.2).
    assert grpo["area"] == pytest.approx(0.2)
    assert area_per_flop(curves["pass@1"]["lze"], 200.0) == pytest.approx(
        (0.15 * 50 + 0.25 * 50 + 0.4 * 50 + 0.5 * 50) / 200)


def test_report_files(study, tmp_path):
    out = tmp_path / "report"
    path = write_report(study, "grpo", out)
    text = path.read_text()
    assert path == out / MARKDOWN_FILE
    assert "| lze | 0.38x | 0.38x |" in text
    assert "slow did not reach plain GRPO's final greedy pass@1 (0.500)" in text
    assert "40 % of the groups had zero reward variance" not in text  # 50 %, from the data
    assert "50 % of the groups had zero reward variance (20 % all right, 30 % all wrong" in text
    assert "The runs took 6 min in all" in text
    with open(out / CSV_FILE) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 2 * 5
    for png in ("study_accuracy.png", "study_zero_variance.png"):
        assert (out / png).stat().st_size > 10_000


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
        last = [r for r in csv.DictReader(f) if r["method"] == "lze" and r["step"] == "4"][0]
    assert float(last["trained_groups"]) == 20.0 and float(last["trained_mixed_groups"]) == 20.0


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
    _write_run(runs / "grpo-s0", [0.1, 0.2, 0.3, 0.4, 0.5], 100.0)
    _write_run(runs / "grpo-s1", [0.1, 0.2, 0.3, 0.4, 0.5], 100.0, step_s=1.2)
    drift = write_report({"grpo": [runs / "grpo-s0", runs / "grpo-s1"]}, "grpo",
                         tmp_path / "drift-report").read_text()
    assert "1.00, 1.20 s: they differ by more than 15 %" in drift
    assert "**the wall-time ratios mix speeds**" in drift


def test_the_report_counts_the_seeds_each_method_ran(study, tmp_path):
    assert "seeds per method: 2;" in write_report(study, "grpo", tmp_path / "even").read_text()
    # An interrupted study: slow's seed 1 never ran, so slow's row rests on one seed.
    uneven = {**study, "slow": [study["slow"][0], tmp_path / "runs" / "slow-s9"]}
    text = write_report(uneven, "grpo", tmp_path / "uneven").read_text()
    assert "seeds per method: 1 to 2 (each row says how many);" in text
    assert "| 0.300 ± n/a (1) |" in text


def test_a_run_is_finished_only_at_its_last_step(study):
    assert is_finished(study["grpo"][0], 4)
    assert not is_finished(study["grpo"][0], 5)


def test_no_ratio_when_grpo_never_beats_its_start(tmp_path):
    runs = tmp_path / "runs"
    _write_run(runs / "grpo-s0", [0.3, 0.2, 0.1], 100.0)
    _write_run(runs / "lze-s0", [0.3, 0.4, 0.5], 50.0)
    text = write_report({m: [runs / f"{m}-s0"] for m in ("grpo", "lze")}, "grpo",
                        tmp_path / "out").read_text()
    assert "| lze | n/a (GRPO never beat its start) |" in text
    assert "no ratio is defined for lze (best 0.500)" in text


def test_paired_ratios_compare_each_seed_with_grpo_of_the_same_seed(study, tmp_path):
    from lze_trainer.study_report import paired_flops_ratios

    rows = {m: [run_rows(m, s, f) for s, f in enumerate(folders)] for m, folders in study.items()}
    # Seed 1 of LZE reaches 0.5 only at its last step: 200 of GRPO's 400 FLOPs.
    _write_run(tmp_path / "late-s1", [0.1, 0.2, 0.3, 0.4, 0.5], 50.0)
    rows["lze"][1] = run_rows("lze", 1, tmp_path / "late-s1")
    paired = paired_flops_ratios(rows, "grpo", "pass@1")
    assert paired["grpo"] == [1.0, 1.0] and paired["slow"] == [None, None]
    assert paired["lze"] == [pytest.approx(150 / 400), pytest.approx(200 / 400)]
    text = write_report(study, "grpo", tmp_path / "report").read_text()
    assert ("Per seed, against plain GRPO's run of the same seed: 0.38x, 0.38x its FLOPs."
            in text)


def test_readme_quotes_the_report_tables_between_its_markers(tmp_path):
    from lze_trainer.study_report import README_BEGIN, README_END, quote_in_readme

    report = tmp_path / "study.md"
    report.write_text("# Title\n\nsetup\n\n## Held-out greedy pass@1\n\n| a |\n|---|\n| 1 |\n\n"
                      "## Held-out sampled accuracy\n\n| b |\n\n## What the numbers say\n\n- x\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n")
    assert quote_in_readme(report, readme)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "#### Held-out greedy pass@1" in text and "| 1 |" in text and "| b |" in text
    assert "What the numbers say" not in text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not quote_in_readme(report, plain) and plain.read_text() == "no markers\n"


def test_the_search_picks_the_smallest_worst_ratio_and_the_main_report_names_it(
        study, tmp_path, monkeypatch):
    from lze_trainer.study import DOCS, METHODS, SEARCH_DIR, study_methods
    from lze_trainer.study_report import read_best

    monkeypatch.chdir(tmp_path)
    assert read_best(DOCS / SEARCH_DIR) is None and study_methods() == list(METHODS)
    before_search = write_report(study, "grpo", DOCS, best_note=True).read_text()
    assert "best combination found" not in before_search
    search = write_report(study, "grpo", DOCS / SEARCH_DIR, candidates=["slow", "lze"]).read_text()
    best = read_best(DOCS / SEARCH_DIR)
    # LZE reaches GRPO's final at 150 of its 400 FLOPs (0.375x) and 1.5 of its 4 s; slow never.
    assert best["method"] == "lze" and best["worst_ratio"] == pytest.approx(0.375)
    assert best["candidates"] == ["lze", "slow"] and best["seeds"] == [0, 1]
    assert "Picked as the best combination" in search and "`lze`" in search
    main = write_report(study, "grpo", DOCS, best_note=True).read_text()
    assert "The best combination found is `lze` (`selection.policy=lze`)" in main
    assert "greedy pass@1 0.38x FLOPs, 0.38x wall time" in main and "`slow` did worse" in main
    assert study_methods().count("lze") == 1


def test_pick_best_wants_both_metrics_reached_then_the_larger_area():
    from lze_trainer.study_report import pick_best

    def rows(method, greedy, sampled, area):
        return [{"metric": m, "method": method, "flops_ratio": r, "wall_ratio": r, "area": area}
                for m, r in (("pass@1", greedy), ("sampled_acc", sampled))]

    table = rows("grpo", 1.0, 1.0, 0.3) + rows("fast-greedy", 0.2, None, 0.5) \
        + rows("even", 0.6, 0.7, 0.4) + rows("never", None, None, 0.45)
    assert pick_best(table, ["fast-greedy", "even", "never"], [10])["method"] == "even"
    assert pick_best(table, ["fast-greedy", "never"], [10])["method"] == "fast-greedy"
    assert pick_best(table, ["fast-greedy", "never"], [10])["worst_ratio"] is None
    assert pick_best(table, ["absent"], [10]) is None


@pytest.mark.parametrize("folder", [".", "replica"])
def test_the_link_to_the_search_resolves_from_the_report_folder(study, folder, tmp_path,
                                                                 monkeypatch):
    from lze_trainer.study import DOCS, SEARCH_DIR

    monkeypatch.chdir(tmp_path)
    write_report(study, "grpo", DOCS / SEARCH_DIR, candidates=["lze"])
    out = DOCS / folder
    text = write_report(study, "grpo", out, best_note=True).read_text()
    link = text.split("(see [the search](")[1].split(")")[0]
    assert (out / link).resolve() == (DOCS / SEARCH_DIR / "study.md").resolve()

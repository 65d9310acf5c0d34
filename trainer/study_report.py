"""The study's report, computed from its runs' ``metrics.jsonl`` only (never written by hand).

* ``study_steps.csv``: one row per step of every run (compute, wall time, zero-variance shares,
  held-out accuracy where evaluated);
* ``study_accuracy.png``: held-out accuracy (greedy and sampled) against the FLOPs proxy, the
  generated tokens and the wall time of the steps, mean over seeds with a min-max band;
* ``study_zero_variance.png``: share of zero-variance groups among those generated and those
  trained on, per step;
* ``study.md``: the task, the table and the plots, plain sentences where a method does not
  help, and the training signal each method buys per step and per FLOP.

Per method (means over seeds, evaluated steps aligned by step): the FLOPs and the step wall time to
first reach plain GRPO's final held-out accuracy, as ratios to what plain GRPO needed to first
reach it ("not reached" with the best accuracy and the FLOPs spent otherwise); the area under
accuracy-vs-FLOPs over the FLOPs range every method spent, divided by that range (a mean
accuracy); final accuracy with its standard error over seeds.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .metrics import read_metrics

METRICS = ("pass@1", "sampled_acc")
METRIC_NAMES = {"pass@1": "greedy pass@1", "sampled_acc": "sampled accuracy"}
CSV_FILE, MARKDOWN_FILE, BEST_FILE = "study_steps.csv", "study.md", "best.json"
ACCURACY_PLOT, ZERO_VARIANCE_PLOT = "study_accuracy.png", "study_zero_variance.png"
STEADY_SPREAD = 1.15  # plain GRPO's median step times over seeds may differ by 15 % at most
COLUMNS = ("method", "seed", "step", "flops", "rollouts", "generated_tokens", "prefill_tokens",
           "update_tokens", "wall_s", "rollout_s", "update_s", "zero_variance_generated",
           "zero_variance_trained", "all_correct", "all_wrong", "trained_groups",
           "trained_mixed_groups", "pass@1", "sampled_acc")


@dataclass
class Curve:
    """One method's held-out accuracy at its evaluated steps, mean (and range) over seeds, with
    the mean cost spent by then."""

    steps: list[int]
    accuracy: list[float]
    low: list[float]
    high: list[float]
    cost: dict[str, list[float]]  # "flops" | "generated_tokens" | "wall_s" -> per step
    finals: list[float]  # each seed's final accuracy


def run_rows(method: str, seed: int, folder: Path) -> list[dict]:
    """The CSV rows of one run: cumulative costs after each step (step 0: before training)."""
    rows, wall, rollout_s, update_s = [], 0.0, 0.0, 0.0
    for r in read_metrics(folder):
        wall += r.get("timing_s/step", 0.0)
        rollout_s += r.get("timing_s/rollout", 0.0)
        update_s += r.get("timing_s/update", 0.0)
        row = {"method": method, "seed": seed, "step": r["step"],
               "flops": r.get("total/flops", 0.0), "rollouts": r.get("total/rollouts", 0.0),
               "generated_tokens": r.get("total/generated_tokens", 0.0),
               "prefill_tokens": r.get("total/prefill_tokens", 0.0),
               "update_tokens": r.get("total/update_tokens", 0.0), "wall_s": wall,
               "rollout_s": rollout_s, "update_s": update_s,
               "zero_variance_generated": r.get("compute/zero_variance_generated_frac",
                                                  r.get("reward/zero_std_frac")),
               "zero_variance_trained": r.get("select/zero_variance_trained_frac"),
               "all_correct": r.get("reward/all_correct_frac"),
               "all_wrong": r.get("reward/all_wrong_frac"),
               "trained_groups": r.get("total/update_groups"),
               "trained_mixed_groups": _mixed(r.get("total/update_groups"),
                                              r.get("total/zero_variance_trained"))}
        for metric in METRICS:
            row[metric] = next((v for k, v in r.items()
                                if k.startswith("eval/") and k.endswith("/" + metric)), None)
        if rows and rows[-1]["step"] == row["step"]:  # step 0: the start-up line, then eval
            rows[-1].update({k: v for k, v in row.items() if v is not None})
        else:
            rows.append(row)
    return rows


def _mixed(groups: Optional[float], zero_variance: Optional[float]) -> Optional[float]:
    """Groups with mixed rewards (nonzero variance) among ``groups``: with binary rewards the only
    ones with a GRPO advantage, so the only ones that move the policy."""
    return None if groups is None or zero_variance is None else groups - zero_variance


def curve(rows_by_seed: list[list[dict]], metric: str) -> Optional[Curve]:
    """Accuracy at the steps every seed evaluated, with costs carried over from the last step."""
    per_seed = [{r["step"]: r for r in rows if r.get(metric) is not None} for rows in rows_by_seed]
    per_seed = [p for p in per_seed if p]
    if not per_seed:
        return None
    steps = sorted(set.intersection(*(set(p) for p in per_seed)))
    values = [[p[s][metric] for p in per_seed] for s in steps]
    cost = {key: [statistics.mean(p[s][key] for p in per_seed) for s in steps]
            for key in ("flops", "generated_tokens", "wall_s")}
    return Curve(steps, [statistics.mean(v) for v in values], [min(v) for v in values],
                 [max(v) for v in values], cost, [p[max(p)][metric] for p in per_seed])


def first_reach(c: Curve, target: float, cost: str) -> Optional[float]:
    for accuracy, spent in zip(c.accuracy, c.cost[cost]):
        if accuracy >= target - 1e-12:
            return spent
    return None


def area_per_flop(c: Curve, flops_range: float) -> float:
    """Mean accuracy over [0, flops_range] of FLOPs (trapezoids; the curve held flat past its
    last point, which never happens when flops_range is the smallest total)."""
    xs, ys = c.cost["flops"], c.accuracy
    area = 0.0
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 >= flops_range:
            break
        right = min(x1, flops_range)
        y_right = y0 + (y1 - y0) * (right - x0) / (x1 - x0) if x1 > x0 else y1
        area += (right - x0) * (y0 + y_right) / 2
    return area / flops_range if flops_range > 0 else float("nan")


def _standard_error(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def write_report(runs: dict[str, list[Path]], baseline: str, out: Path, quick: bool = False,
                 best_note: bool = False, candidates: Optional[list[str]] = None) -> Path:
    """The CSV, plots and markdown of ``runs`` into ``out``; ``best_note`` says how the best
    combination was found (the main study's report); ``candidates`` (the search's report): pick
    the best of them and write it to ``BEST_FILE``, which the main study reads."""
    out.mkdir(parents=True, exist_ok=True)
    rows = {m: [run_rows(m, _seed(f), f) for f in folders] for m, folders in runs.items()}
    _write_csv(out / CSV_FILE, [r for per_method in rows.values() for rs in per_method for r in rs])
    curves = {metric: {m: curve(rows[m], metric) for m in rows} for metric in METRICS}
    _plot_accuracy(curves, out / ACCURACY_PLOT)
    _plot_zero_variance(rows, out / ZERO_VARIANCE_PLOT)
    table = table_rows(curves, baseline)
    paired = {metric: paired_flops_ratios(rows, baseline, metric) for metric in METRICS}
    for t in table:
        t["paired_flops"] = paired[t["metric"]].get(t["method"], [])
    best = pick_best(table, candidates, sorted({_seed(f) for fs in runs.values() for f in fs})) \
        if candidates else None
    if best is not None:
        (out / BEST_FILE).write_text(json.dumps(best, indent=1) + "\n")
    markdown = _markdown(rows, curves, table, baseline, runs, quick, out if best_note else None,
                         best)
    (out / MARKDOWN_FILE).write_text(markdown)
    return out / MARKDOWN_FILE


def paired_flops_ratios(rows: dict[str, list[list[dict]]], baseline: str,
                        metric: str) -> dict[str, list[Optional[float]]]:
    """Per method, one FLOPs ratio per seed against plain GRPO's run of the same seed: the FLOPs
    to first reach that run's final accuracy over what the run needed to first reach it (None:
    not reached; NaN: that GRPO run ended at its starting accuracy). The table compares mean
    curves; these show how far one seed moves a ratio on a curve that has flattened."""
    base = {rs[0]["seed"]: curve([rs], metric) for rs in rows.get(baseline, []) if rs}
    result: dict[str, list[Optional[float]]] = {}
    for method, per_seed in rows.items():
        for rs in per_seed:
            b, c = (base.get(rs[0]["seed"]), curve([rs], metric)) if rs else (None, None)
            if b is None or c is None:
                continue
            target = b.finals[0]
            spent, needed = first_reach(c, target, "flops"), first_reach(b, target, "flops")
            ratio = None if spent is None else spent / needed if needed else math.nan
            result.setdefault(method, []).append(ratio)
    return result


def pick_best(table: list[dict], candidates: list[str], seeds: list[int]) -> Optional[dict]:
    """The candidate whose worst ratio to plain GRPO (the largest of its FLOPs and wall-time
    ratios on both metrics; "not reached" counts as infinite) is smallest; ties, and the case
    where none reached both, go to the larger mean area / FLOP. None without candidates."""
    by_method: dict[str, list[dict]] = {}
    for t in table:
        if t["method"] in candidates:
            by_method.setdefault(t["method"], []).append(t)
    if not by_method:
        return None

    def worst(method: str) -> float:
        ratios = [t[k] for t in by_method[method] for k in ("flops_ratio", "wall_ratio")]
        return math.inf if None in ratios else max(ratios)

    def area(method: str) -> float:
        return statistics.mean(t["area"] for t in by_method[method])

    method = min(by_method, key=lambda m: (worst(m), -area(m)))
    return {"method": method, "worst_ratio": None if math.isinf(worst(method)) else worst(method),
            "ratios": {t["metric"]: {"flops": t["flops_ratio"], "wall": t["wall_ratio"]}
                       for t in by_method[method]},
            "candidates": list(by_method), "seeds": seeds}


def read_best(search: Path) -> Optional[dict]:
    """The search's pick (``BEST_FILE`` in its report folder), or None before any search."""
    path = search / BEST_FILE
    return json.loads(path.read_text()) if path.exists() else None


README_BEGIN, README_END = "<!-- study tables: begin -->", "<!-- study tables: end -->"


def quote_in_readme(report: Path, readme: Path) -> bool:
    """Copy the report's two tables between the README's markers (the README quotes the main
    table, generated, never typed); False when the README has no markers."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    markdown = report.read_text()
    start = markdown.index("## Held-out")
    tables = markdown[start:markdown.index("## What the numbers say")].replace("## ", "#### ")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(f"{head}{README_BEGIN}\n{tables.strip()}\n{README_END}{tail}")
    return True


def _seed(folder: Path) -> int:
    return int(folder.name.rsplit("-s", 1)[1])


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})


# ---------------------------------------------------------------------- the table

def table_rows(curves: dict, baseline: str) -> list[dict]:
    """Per method and metric: the ratios to plain GRPO, area, final accuracy."""
    result = []
    for metric, by_method in curves.items():
        base = by_method.get(baseline)
        if base is None:
            continue
        target = statistics.mean(base.finals)
        flops_range = min(c.cost["flops"][-1] for c in by_method.values() if c)
        base_flops = first_reach(base, target, "flops")
        base_wall = first_reach(base, target, "wall_s")
        for method, c in by_method.items():
            if c is None:
                continue
            flops, wall = first_reach(c, target, "flops"), first_reach(c, target, "wall_s")
            result.append({
                "metric": metric, "method": method, "target": target,
                "baseline_improved": bool(base_flops),
                "flops_ratio": flops / base_flops if flops is not None and base_flops else None,
                "wall_ratio": wall / base_wall if wall is not None and base_wall else None,
                "best": max(c.accuracy), "flops_spent": c.cost["flops"][-1],
                "area": area_per_flop(c, flops_range),
                "final": statistics.mean(c.finals), "final_se": _standard_error(c.finals),
                "seeds": len(c.finals)})
    return result


def _markdown(rows, curves, table: list[dict], baseline: str, runs: dict[str, list[Path]],
              quick: bool, best_note_from: Path | None, picked: Optional[dict]) -> str:
    """The report; ``best_note_from``: its folder, to link the search from (None: no note);
    ``picked``: the search's pick among its candidates (None: not a search)."""
    lines = ["# Selection methods against plain GRPO: compute for the same held-out accuracy", "",
             "Generated by `make study` (`python -m lze_trainer.study`) from the runs' metrics; "
             "do not edit by hand." + (" **Quick pipeline check (`QUICK=1`): a few steps, not "
                                       "a result.**" if quick else ""), ""]
    lines += _setup_lines(rows, runs, baseline)
    lines += _best_line(best_note_from) if best_note_from else []
    lines += _picked_line(picked) if picked else []
    for metric in METRICS:
        lines += [f"## Held-out {METRIC_NAMES[metric]}", "",
                  "| method | FLOPs to reach GRPO's final (ratio) | step wall time to reach it "
                  "(ratio) | best | FLOPs spent | area / FLOP | final ± SE (seeds) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for t in (t for t in table if t["metric"] == metric):
            lines.append(
                f"| {t['method']} | {_ratio(t['flops_ratio'], t)} | {_ratio(t['wall_ratio'], t)} "
                f"| {t['best']:.3f} | {t['flops_spent']:.3g} | {t['area']:.3f} "
                f"| {t['final']:.3f} ± {_se(t['final_se'])} ({t['seeds']}) |")
        lines.append("")
    lines += ["## What the numbers say", ""] + _verdicts(table, baseline) + [""]
    lines += _signal_lines(rows, baseline)
    lines += ["## Plots", "", f"![held-out accuracy against compute]({ACCURACY_PLOT})", "",
              f"![zero-variance groups generated and trained on]({ZERO_VARIANCE_PLOT})", "",
              "## How it is measured", "",
              "FLOPs proxy with P parameters: 2P per prefill and generated token (reference sets "
              "and screening included), 2P per token of every extra forward pass (old log-probs, "
              "entropy prefill, embeddings), 6P per update token: every token of a trained "
              "sequence, prompt included, which the update's forward and backward run through "
              "(`lze_trainer.compute`). Wall time is the sum of the training steps' time "
              "(evaluation and start-up excluded). "
              "Ratios compare the compute at the first evaluated step where a method's mean "
              "accuracy over seeds reaches plain GRPO's mean final accuracy with what plain GRPO "
              "needed to first reach it. Area / FLOP is the mean accuracy over the FLOPs range "
              "every method spent. Every step of every run is in "
              f"[`{CSV_FILE}`]({CSV_FILE}).", ""]
    return "\n".join(lines)


def _setup_lines(rows, runs: dict[str, list[Path]], baseline: str) -> list[str]:
    from .study import WALL_FILE

    # The task's spread as plain GRPO meets it (forward selection changes what a step generates).
    first = [rs[1] for rs in rows.get(baseline, []) if len(rs) > 1]
    walls = [float((f / WALL_FILE).read_text()) for folders in runs.values() for f in folders
             if (f / WALL_FILE).exists()]
    seeds = sorted({sum(1 for r in per if r) for per in rows.values()})
    seeds_text = (f"{seeds[0]}" if len(seeds) == 1 else
                  f"{seeds[0]} to {seeds[-1]} (each row says how many)")
    lines = [f"Methods: {', '.join(runs)}; seeds per method: {seeds_text}; steps per run: "
             f"{max((r[-1]['step'] for per in rows.values() for r in per if r), default=0)}."]
    if first:
        share = {k: statistics.mean(r[k] or 0.0 for r in first)
                 for k in ("zero_variance_generated", "all_correct", "all_wrong")}
        lines.append(f"At the first GRPO step {100 * share['zero_variance_generated']:.0f} % of "
                     f"the groups had zero reward variance ({100 * share['all_correct']:.0f} % "
                     f"all right, {100 * share['all_wrong']:.0f} % all wrong; mean over its seeds).")
    if walls:
        lines.append(f"The runs took {sum(walls) / 60:.0f} min in all on this machine "
                     f"({len(walls)} runs, start-up and evaluation included).")
    return lines + _steadiness_lines(rows.get(baseline, [])) + [""]


def _steadiness_lines(baseline_runs: list[list[dict]]) -> list[str]:
    """Whether the machine kept its speed: plain GRPO's step does the same work in every seed
    (same B, G and token budget), and the study runs its seeds at different times, so their median
    step times differing by more than STEADY_SPREAD means the speed changed (another load, another
    machine) and the wall-time ratios mix speeds."""
    medians = [statistics.median(b["wall_s"] - a["wall_s"] for a, b in zip(rs, rs[1:]))
               for rs in baseline_runs if len(rs) > 1]
    if len(medians) < 2:  # one seed: nothing to compare its speed with
        return []
    spread = f"{round(100 * (STEADY_SPREAD - 1))} %"
    line = ("Median step wall time of plain GRPO per seed: "
            f"{', '.join(f'{m:.2f}' for m in medians)} s")
    if max(medians) > STEADY_SPREAD * min(medians):
        return [line + f": they differ by more than {spread}, so the machine's "
                "speed changed during the study and **the wall-time ratios mix speeds** (rerun "
                "on a quiet machine)."]
    return [line + f" (within {spread} of each other: the machine kept its speed, "
            "which the wall-time ratios assume)."]


def signal_per_step(rows: dict[str, list[list[dict]]]) -> dict[str, dict[str, float]]:
    """Per method, means over seeds of each run's per-step averages: FLOPs, groups trained and
    groups with mixed rewards trained (runs that did not log the group totals are left out)."""
    result = {}
    for method, per_seed in rows.items():
        runs = [rs[-1] for rs in per_seed
                if rs and rs[-1]["step"] > 0 and rs[-1].get("trained_mixed_groups") is not None]
        if runs:
            result[method] = {key: statistics.mean(r[key] / r["step"] for r in runs)
                              for key in ("flops", "trained_groups", "trained_mixed_groups")}
    return result


def _signal_lines(rows: dict[str, list[list[dict]]], baseline: str) -> list[str]:
    """The training signal per step and per FLOP, against plain GRPO's: why a method saves
    compute at a fixed step budget or does not."""
    signal = signal_per_step(rows)
    base = signal.get(baseline)
    if base is None or not base["flops"] or not base["trained_mixed_groups"]:
        return []
    lines = ["## Training signal per step", "",
             "A group whose rollouts all got the same reward has zero GRPO advantage and adds no "
             "policy gradient: it only enlarges the loss's token count, a scale that Adam's "
             "normalisation and the gradient clip undo. At the same learning rate a step moves "
             "the policy by a similar amount whatever it trains on, and the groups with mixed "
             "rewards set its direction. A method can save compute at this step budget only "
             "when it trains on as many of them per step as plain GRPO for fewer FLOPs (then it "
             "follows plain GRPO's curve at a lower cost, and reaches GRPO's final before the "
             "last step only where that curve has flattened), or on more of them per step. "
             "Replayed groups count here, although an older policy generated them.", "",
             "| method | FLOPs per step (x GRPO) | groups trained per step | with mixed rewards "
             "| mixed groups per step (x GRPO) | mixed groups per FLOP (x GRPO) |",
             "|---|---:|---:|---:|---:|---:|"]
    base_per_flop = base["trained_mixed_groups"] / base["flops"]
    for method, s in signal.items():
        per_flop = s["trained_mixed_groups"] / s["flops"] if s["flops"] else math.nan
        lines.append(f"| {method} | {s['flops'] / base['flops']:.2f}x | "
                     f"{s['trained_groups']:.1f} | {s['trained_mixed_groups']:.1f} | "
                     f"{s['trained_mixed_groups'] / base['trained_mixed_groups']:.2f}x | "
                     f"{per_flop / base_per_flop:.2f}x |")
    return lines + [""]


def _best_line(out: Path) -> list[str]:
    """How the best combination was found (on seeds the table does not report), linked from a
    report in ``out``; nothing before a search."""
    from .study import ALL_METHODS, DOCS, SEARCH_DIR

    best = read_best(DOCS / SEARCH_DIR)
    if best is None:
        return []
    search = Path(os.path.relpath(DOCS / SEARCH_DIR / MARKDOWN_FILE, out)).as_posix()
    others = [c for c in best["candidates"] if c != best["method"]]
    seeds = ", ".join(map(str, best["seeds"]))
    return [f"The best combination found is `{best['method']}` "
            f"(`{' '.join(ALL_METHODS[best['method']])}`), picked by code from the search on "
            f"seed {seeds}, which this table does not report: among "
            f"{', '.join(f'`{c}`' for c in best['candidates'])} it had the smallest worst ratio "
            f"to plain GRPO there ({_ratios_text(best)}); {', '.join(f'`{c}`' for c in others)} "
            f"did worse (see [the search]({search})).", ""]


def _picked_line(best: dict) -> list[str]:
    return [f"Picked as the best combination (the smallest worst ratio to plain GRPO, FLOPs and "
            f"wall time on both metrics): `{best['method']}` ({_ratios_text(best)}); the main "
            f"study runs it on its seeds.", ""]


def _ratios_text(best: dict) -> str:
    return "; ".join(f"{METRIC_NAMES[m]} not reached" if r["flops"] is None else
                     f"{METRIC_NAMES[m]} {r['flops']:.2f}x FLOPs, {_ratio(r['wall'])} wall time"
                     for m, r in best["ratios"].items())


def _verdicts(table: list[dict], baseline: str) -> list[str]:
    lines = []
    for t in table:
        if t["method"] == baseline:
            continue
        name, metric = t["method"], METRIC_NAMES[t["metric"]]
        if not t["baseline_improved"]:
            lines.append(f"- Plain GRPO's {metric} never rose above its starting value, so no "
                         f"ratio is defined for {name} (best {t['best']:.3f}).")
        elif t["flops_ratio"] is None:
            lines.append(f"- {name} did not reach plain GRPO's final {metric} ({t['target']:.3f}); "
                         f"its best was {t['best']:.3f} after {t['flops_spent']:.3g} FLOPs.")
        elif t["flops_ratio"] >= 1:
            lines.append(f"- {name} does not save compute on {metric}: it needed "
                         f"{t['flops_ratio']:.2f}x plain GRPO's FLOPs to reach its final "
                         "accuracy.")
        else:
            lines.append(f"- {name} reached plain GRPO's final {metric} with "
                         f"{t['flops_ratio']:.2f}x its FLOPs and {_ratio(t['wall_ratio'])} its "
                         "step wall time.")
        paired = t.get("paired_flops", [])
        if t["baseline_improved"] and len(paired) > 1 and any(r is not None for r in paired):
            lines[-1] += (" Per seed, against plain GRPO's run of the same seed: "
                          f"{', '.join(_paired(r) for r in paired)} its FLOPs.")
    return lines or ["- Only the baseline ran."]


def _paired(ratio: Optional[float]) -> str:
    return "not reached" if ratio is None else "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"


def _se(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _ratio(value: Optional[float], row: Optional[dict] = None) -> str:
    if row is not None and not row["baseline_improved"]:
        return "n/a (GRPO never beat its start)"
    return "not reached" if value is None else f"{value:.2f}x"


# ---------------------------------------------------------------------- plots

def _plot_accuracy(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = [("flops", "FLOPs proxy"), ("generated_tokens", "generated tokens"),
             ("wall_s", "step wall time (s)")]
    fig, axes = plt.subplots(len(METRICS), len(costs), figsize=(16, 8.5), squeeze=False)
    for i, metric in enumerate(METRICS):
        for j, (cost, label) in enumerate(costs):
            ax = axes[i][j]
            for k, (method, c) in enumerate(curves[metric].items()):
                if c is None:
                    continue
                ax.plot(c.cost[cost], c.accuracy, color=f"C{k % 10}",
                        linestyle="-" if k < 10 else "--", marker=".", label=method)
                ax.fill_between(c.cost[cost], c.low, c.high, color=f"C{k % 10}", alpha=0.15)
            ax.set(xlabel=label, ylabel=f"held-out {METRIC_NAMES[metric]}")
            # Hundreds of thousands of tokens as 1e5 ticks: full numbers overlap at this width.
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("held-out accuracy against compute (mean over seeds, band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_zero_variance(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for k, (method, per_seed) in enumerate(rows.items()):
        for ax, key in zip(axes, ("zero_variance_generated", "zero_variance_trained")):
            by_step: dict[int, list[float]] = {}
            for rs in per_seed:
                for r in rs:
                    if r.get(key) is not None and r["step"] > 0:
                        by_step.setdefault(r["step"], []).append(r[key])
            if by_step:
                steps = sorted(by_step)
                ax.plot(steps, [statistics.mean(by_step[s]) for s in steps], color=f"C{k % 10}",
                        linestyle="-" if k < 10 else "--", label=method, alpha=0.85)
    axes[0].set(title="zero-variance share of the groups generated", xlabel="step")
    axes[1].set(title="zero-variance share of the groups trained on", xlabel="step")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

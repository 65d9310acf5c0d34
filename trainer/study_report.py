"""The study's report, computed from its runs' ``metrics.jsonl`` only (never written by hand).

The protocol (:mod:`lze_trainer.study`): on each seed tuned plain GRPO runs its step budget and
is evaluated at ``K`` evenly spaced steps; every other method then runs until its cumulative
FLOPs proxy reaches what plain GRPO spent on that seed, and is evaluated at the first step whose
FLOPs cross each of plain GRPO's evaluation points. So the k-th held-out point of every run of a
seed sits at (about) the same compute, and methods are compared there.

* ``study_steps.csv``: one row per step of every run (compute, wall time, zero-variance shares,
  held-out accuracy where evaluated);
* ``study_accuracy.png``: held-out accuracy (greedy and sampled) of every method against the
  FLOPs proxy, the generated tokens and the wall time of the steps, mean over seeds with a
  min-max band; ``study_accuracy_top.png``: the same for plain GRPO and the three best methods;
* ``study_zero_variance.png``: share of zero-variance groups among those generated and those
  trained on, per step;
* ``study.md``: a summary (the goal's verdict and the key rows), then per method and metric the
  accuracy at 25 %, 50 % and 100 % of the budget (mean ± SE over seeds) with its paired
  difference to plain GRPO (per-seed differences, their mean ± SE), and the FLOPs, wall time and
  generated tokens to first reach 90 % of plain GRPO's gain (from the shared step-0 accuracy to
  plain GRPO's mean final) and to plain GRPO's final, as ratios to what plain GRPO needed, the
  crossing interpolated linearly between held-out points, on the mean curves and per seed; plain
  sentences where a method does not help; the training signal each method buys per step and per
  FLOP; each run's wall time and the machine's load while it ran.
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
ACCURACY_PLOT, TOP_PLOT = "study_accuracy.png", "study_accuracy_top.png"
ZERO_VARIANCE_PLOT = "study_zero_variance.png"
WALL_FILE = "wall_seconds.txt"  # a finished run's whole wall time, start-up included
LOAD_FILE = "load.json"  # the machine's 1-minute load average while the run ran (mean, max)
STEADY_SPREAD = 1.15  # plain GRPO's median step times over seeds may differ by 15 % at most
# A method's runs met a load this many times plain GRPO's (or its inverse): its wall-time ratio
# compares two speeds of the machine, and the tables mark it.
LOAD_SPREAD = 1.5
LOAD_MARK = "†"
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)  # accuracy compared at these shares of the FLOPs budget
GAIN_SHARE = 0.9  # the main target: this share of plain GRPO's gain over the budget
# Costs to a target. Generated tokens: of every purpose (training rollouts, screening, reference
# sets, top-up rounds, continuations), plus the prompt tokens of HIVE's entropy prefill: on a GPU,
# generation is most of a step's time, and the tokens say what a method spends there.
COSTS = ("flops", "wall_s", "rollout_tokens")
COST_NAMES = {"flops": "FLOPs", "wall_s": "wall time", "rollout_tokens": "generated tokens"}
PER_SEED_COSTS = ("flops", "rollout_tokens")  # wall time per seed would mix loads
# The study's goal: 90 % of tuned plain GRPO's gain with at most these ratios of its costs (each
# regime names the costs its goal caps), and above it at the full budget by two paired SE.
GOAL_RATIOS = {"flops": 0.5, "wall_s": 0.6, "rollout_tokens": 0.5}
END_POINTS = 4  # a learning rate is judged by the mean of a run's last held-out points
TASK_PAGE = Path("docs/study-task.md")  # how each regime's task was chosen
TOP = 3  # methods beside plain GRPO in the summary and the top plot
COLUMNS = ("method", "seed", "step", "flops", "rollouts", "generated_tokens", "rollout_tokens",
           "prefill_tokens", "update_tokens", "wall_s", "rollout_s", "update_s",
           "zero_variance_generated", "zero_variance_trained", "all_correct", "all_wrong",
           "trained_groups", "trained_mixed_groups", "pass@1", "sampled_acc")


@dataclass
class Curve:
    """One method's held-out accuracy per seed at its evaluation points (the k-th evaluation of
    every seed aligned: under the study's protocol, at the same compute), with the compute spent
    by each point."""

    seeds: list[int]
    accuracy: list[list[float]]  # [seed][point]
    cost: dict[str, list[list[float]]]  # a COSTS name -> [seed][point]

    def mean(self) -> list[float]:
        return [statistics.mean(v) for v in zip(*self.accuracy)]

    def low(self) -> list[float]:
        return [min(v) for v in zip(*self.accuracy)]

    def high(self) -> list[float]:
        return [max(v) for v in zip(*self.accuracy)]

    def mean_cost(self, cost: str) -> list[float]:
        return [statistics.mean(v) for v in zip(*self.cost[cost])]

    def seed_index(self, seed: int) -> Optional[int]:
        return self.seeds.index(seed) if seed in self.seeds else None


def run_rows(method: str, seed: int, folder: Path) -> list[dict]:
    """The CSV rows of one run: cumulative costs after each step (step 0: before training)."""
    rows, wall, rollout_s, update_s = [], 0.0, 0.0, 0.0
    for r in read_metrics(folder):
        wall += r.get("timing_s/step", 0.0)
        rollout_s += r.get("timing_s/rollout", 0.0)
        update_s += r.get("timing_s/update", 0.0)
        generated = r.get("total/generated_tokens", 0.0)
        row = {"method": method, "seed": seed, "step": r["step"],
               "flops": r.get("total/flops", 0.0), "rollouts": r.get("total/rollouts", 0.0),
               "generated_tokens": generated,
               "rollout_tokens": generated + r.get("total/forward/entropy", 0.0),
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


def curve(rows_by_seed: list[list[dict]], seeds: list[int], metric: str) -> Optional[Curve]:
    """The evaluated rows of each seed, in order, aligned by their position (the common prefix
    when a run stopped short of its last point)."""
    evaluated = [([r for r in rows if r.get(metric) is not None], seed)
                 for rows, seed in zip(rows_by_seed, seeds)]
    evaluated = [(rows, seed) for rows, seed in evaluated if rows]
    if not evaluated:
        return None
    points = min(len(rows) for rows, _ in evaluated)
    return Curve([seed for _, seed in evaluated],
                 [[r[metric] for r in rows[:points]] for rows, _ in evaluated],
                 {cost: [[r[cost] for r in rows[:points]] for rows, _ in evaluated]
                  for cost in COSTS})


def crossing(accuracy: list[float], cost: list[float], target: float) -> Optional[float]:
    """The compute at which ``accuracy`` first reaches ``target``, interpolated linearly between
    the held-out points around the crossing (None: never reached)."""
    for i, value in enumerate(accuracy):
        if value >= target - 1e-12:
            if i == 0:
                return cost[0]
            a0, c0 = accuracy[i - 1], cost[i - 1]
            return c0 + (target - a0) / (value - a0) * (cost[i] - c0)
    return None


def value_at(accuracy: list[float], cost: list[float], spent: float) -> Optional[float]:
    """Accuracy at ``spent`` compute, interpolated linearly between held-out points (None: the
    run stopped before it)."""
    for i in range(1, len(cost)):
        if cost[i] >= spent - 1e-9 * max(abs(spent), 1.0):
            c0, c1 = cost[i - 1], cost[i]
            weight = (spent - c0) / (c1 - c0) if c1 > c0 else 1.0
            return accuracy[i - 1] + weight * (accuracy[i] - accuracy[i - 1])
    return None


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return statistics.mean(values), se


@dataclass
class Targets:
    """Plain GRPO's accuracy targets of one metric, on its mean curve and per seed."""

    gain: float  # start + GAIN_SHARE x (final - start), mean curve
    final: float  # plain GRPO's mean final
    improved: bool  # plain GRPO ended above its start (else no ratio is defined)
    per_seed: dict[int, tuple[float, float]]  # seed -> (gain target, final) of its own run


def targets(base: Curve) -> Targets:
    mean = base.mean()
    per_seed = {seed: (acc[0] + GAIN_SHARE * (acc[-1] - acc[0]), acc[-1])
                for seed, acc in zip(base.seeds, base.accuracy)}
    return Targets(mean[0] + GAIN_SHARE * (mean[-1] - mean[0]), mean[-1], mean[-1] > mean[0],
                   per_seed)


def ratio(spent: Optional[float], needed: Optional[float]) -> Optional[float]:
    return None if spent is None or not needed else spent / needed


def compute_to(c: Curve, base: Curve, target: float, cost: str) -> Optional[float]:
    """Ratio of the compute the mean curve of ``c`` needs to first reach ``target`` to what plain
    GRPO's mean curve needs."""
    return ratio(crossing(c.mean(), c.mean_cost(cost), target),
                 crossing(base.mean(), base.mean_cost(cost), target))


def paired_compute_to(c: Curve, base: Curve, t: Targets, which: int,
                      cost: str = "flops") -> list[Optional[float]]:
    """Per seed, the ``cost`` ratio to the seed's own plain GRPO run's target (``which``: 0 the
    gain target, 1 its final): NaN where that run never rose above its start."""
    result = []
    for seed, accuracy, spent in zip(c.seeds, c.accuracy, c.cost[cost]):
        b = base.seed_index(seed)
        if b is None:
            continue
        target = t.per_seed[seed][which]
        if base.accuracy[b][-1] <= base.accuracy[b][0]:
            result.append(math.nan)
            continue
        result.append(ratio(crossing(accuracy, spent, target),
                            crossing(base.accuracy[b], base.cost[cost][b], target)))
    return result


def at_budget(c: Curve, base: Curve, fraction: float) -> Optional[dict]:
    """Accuracy at ``fraction`` of each seed's budget (plain GRPO's FLOPs on that seed), mean ±
    SE over seeds, and the paired difference to plain GRPO (None: a run stopped short)."""
    mine, differences = [], []
    for seed, accuracy, flops in zip(c.seeds, c.accuracy, c.cost["flops"]):
        b = base.seed_index(seed)
        if b is None:
            continue
        spent = fraction * base.cost["flops"][b][-1]
        value = value_at(accuracy, flops, spent)
        base_value = value_at(base.accuracy[b], base.cost["flops"][b], spent)
        if value is None or base_value is None:
            return None
        mine.append(value)
        differences.append(value - base_value)
    if not mine:
        return None
    (mean, se), (diff, diff_se) = mean_se(mine), mean_se(differences)
    return {"mean": mean, "se": se, "diff": diff, "diff_se": diff_se}


def table_rows(curves: dict, baseline: str) -> list[dict]:
    """Per method and metric: accuracy at shares of the budget, compute to GRPO's targets
    (``gain``/``final``: cost -> ratio on the mean curves; ``*_paired``: cost -> per seed)."""
    result = []
    for metric, by_method in curves.items():
        base = by_method.get(baseline)
        if base is None:
            continue
        t = targets(base)
        for method, c in by_method.items():
            if c is None:
                continue
            result.append({
                "metric": metric, "method": method, "targets": t,
                "at": {f: at_budget(c, base, f) for f in BUDGET_FRACTIONS},
                "gain": {cost: compute_to(c, base, t.gain, cost) for cost in COSTS},
                "gain_paired": {cost: paired_compute_to(c, base, t, 0, cost)
                                for cost in PER_SEED_COSTS},
                "final": {cost: compute_to(c, base, t.final, cost) for cost in COSTS},
                "final_paired": {cost: paired_compute_to(c, base, t, 1, cost)
                                 for cost in PER_SEED_COSTS},
                "best": max(c.mean()), "flops_spent": c.mean_cost("flops")[-1],
                "seeds": len(c.seeds)})
    return result


def ranking(table: list[dict], methods: list[str], costs=("flops", "wall_s")) -> list[dict]:
    """``methods`` best first: by the worst of their ratios to plain GRPO (``costs`` to 90 % of
    its gain, on both metrics; not reached counts as infinite), ties, and those that reached on
    neither, by the larger mean paired difference at the full budget. Each entry: method,
    worst_ratio (None: not reached), ratios (metric -> cost -> ratio)."""
    by_method: dict[str, list[dict]] = {}
    for t in table:
        if t["method"] in methods:
            by_method.setdefault(t["method"], []).append(t)

    def worst(method: str) -> float:
        ratios = [t["gain"][k] for t in by_method[method] for k in costs]
        return math.inf if None in ratios else max(ratios)

    def lead(method: str) -> float:
        ends = [t["at"][1.0] for t in by_method[method]]
        return statistics.mean(e["diff"] for e in ends) if None not in ends else -math.inf

    order = sorted(by_method, key=lambda m: (worst(m), -lead(m)))
    return [{"method": m, "worst_ratio": None if math.isinf(worst(m)) else worst(m),
             "ratios": {t["metric"]: {k: t["gain"][k] for k in costs} for t in by_method[m]}}
            for m in order]


def pick_best(table: list[dict], candidates: list[str], seeds: list[int],
              costs=("flops", "wall_s")) -> Optional[dict]:
    """The first of :func:`ranking` among ``candidates``, with the candidates and seeds it was
    picked from. None without candidates."""
    ranked = ranking(table, candidates, costs)
    return {**ranked[0], "candidates": [r["method"] for r in ranked],
            "seeds": seeds} if ranked else None


def end_score(folders: list[Path]) -> Optional[float]:
    """How high a run ends: the mean of its last ``END_POINTS`` held-out accuracies (the last
    third of the budget; less noisy than the last point alone), over both metrics and the seeds.
    None when a run has no held-out points."""
    values = []
    for folder in folders:
        rows = run_rows("", 0, folder)
        for metric in METRICS:
            points = [r[metric] for r in rows if r.get(metric) is not None]
            if not points:
                return None
            values.append(statistics.mean(points[-END_POINTS:]))
    return statistics.mean(values) if values else None


def tuned_variant(runs: dict[str, list[Path]]) -> str:
    """Of a method's learning-rate variants (name -> run folders), the one that ends highest
    (:func:`end_score`)."""
    scores = {name: end_score(folders) for name, folders in runs.items()}
    scored = {name: s for name, s in scores.items() if s is not None}
    if not scored:
        raise SystemExit(f"study: none of {sorted(runs)} has held-out points to tune on")
    return max(scored, key=scored.get)


def goal_verdict(table: list[dict], method: str, costs=("flops", "wall_s"),
                 regime: Optional[str] = None) -> Optional[str]:
    """Whether ``method`` meets the study's goal: 90 % of plain GRPO's gain with at most
    ``GOAL_RATIOS`` of each of ``costs`` on both metrics, and at the full budget above plain GRPO
    by at least two standard errors of the paired differences. The verdict names every ratio
    that misses."""
    rows = [t for t in table if t["method"] == method]
    if len(rows) != len(METRICS):
        return None
    misses = []
    for t in rows:
        name, end = METRIC_NAMES[t["metric"]], t["at"][1.0]
        ratios = {k: t["gain"][k] for k in costs}
        if None in ratios.values():
            misses.append(f"it does not reach 90 % of the gain on {name}")
        else:
            over = [f"{ratios[k]:.2f}x the {COST_NAMES[k]} (goal {GOAL_RATIOS[k]}x)"
                    for k in costs if ratios[k] > GOAL_RATIOS[k]]
            if over:
                misses.append(f"on {name} it needs " + ", ".join(over))
        if end is None or not end["diff"] > 0 or not end["diff"] >= 2 * end["diff_se"]:
            misses.append(f"at the full budget its {name} is "
                          + ("not measured" if end is None else
                             f"{_signed(end['diff'])} ± {_se(end['diff_se'])} against plain "
                             "GRPO's (paired), not two SE above"))
    caps = ", ".join(f"{GOAL_RATIOS[k]}x its {COST_NAMES[k]}" for k in costs)
    head = (f"**Goal{f', {regime}' if regime else ''}** (the best method reaches 90 % of tuned "
            f"plain GRPO's gain with at most {caps} on both metrics, and ends above it by at "
            "least two SE of the paired differences): ")
    verdict = head + ("**met** by `" + method + "`." if not misses else
                      f"**not met** by `{method}`: " + "; ".join(misses) + ".")
    others = [k for k in COSTS if k not in costs]  # stated, though this goal does not cap them
    if others:
        verdict += " " + "; ".join(
            f"Its {COST_NAMES[k]} to 90 % of the gain: " + ", ".join(
                f"{_ratio(t['gain'][k])} ({METRIC_NAMES[t['metric']]})" for t in rows)
            for k in others) + " (outside this regime's goal)."
    return verdict


def write_report(runs: dict[str, list[Path]], baseline: str, out: Path, quick: bool = False,
                 search: Optional[dict] = None, overrides: Optional[dict[str, list[str]]] = None,
                 candidates: Optional[list[str]] = None, preset: str = "study",
                 rates: Optional[dict[str, float]] = None,
                 tuned: Optional[dict[str, list[str]]] = None,
                 goal_costs=("flops", "wall_s"), regime: Optional[str] = None) -> Path:
    """The CSV, plots and markdown of ``runs`` into ``out``; ``baseline``: tuned plain GRPO.
    ``search`` (the main study's report): the search's pick and report path, for the note on how
    the best combination was found; ``overrides``: each method's config overrides, quoted there;
    ``rates``: each method's learning rate, stated in every row; ``candidates`` (the search's
    report): pick the best of them, and ``tuned`` (method -> its learning-rate variants): keep
    each tuned baseline's best rate, both written to ``BEST_FILE``; ``goal_costs``: the costs
    the goal caps."""
    out.mkdir(parents=True, exist_ok=True)
    seeds = {m: [_seed(f) for f in folders] for m, folders in runs.items()}
    rows = {m: [run_rows(m, s, f) for s, f in zip(seeds[m], folders)]
            for m, folders in runs.items()}
    _write_csv(out / CSV_FILE, [r for per_method in rows.values() for rs in per_method for r in rs])
    curves = {metric: {m: curve(rows[m], seeds[m], metric) for m in rows} for metric in METRICS}
    table = table_rows(curves, baseline)
    top = [r["method"] for r in ranking(table, [m for m in runs if m != baseline],
                                        goal_costs)][:TOP]
    _plot_accuracy(curves, baseline, out / ACCURACY_PLOT)
    _plot_accuracy({k: {m: c for m, c in v.items() if m in [baseline, *top]}
                    for k, v in curves.items()}, baseline, out / TOP_PLOT,
                   title=f"plain GRPO and the {len(top)} best methods")
    _plot_zero_variance(rows, baseline, out / ZERO_VARIANCE_PLOT)
    all_seeds = sorted({s for ss in seeds.values() for s in ss})
    best = pick_best(table, candidates, all_seeds, goal_costs) if candidates else None
    tuned_names = {m: tuned_variant({v: runs[v] for v in variants if v in runs})
                   for m, variants in (tuned or {}).items() if any(v in runs for v in variants)}
    if best is not None:
        (out / BEST_FILE).write_text(json.dumps({**best, "tuned": tuned_names}, indent=1) + "\n")
    rates = rates or {}
    pick = (search or {}).get("best") or best
    goal = goal_verdict(table, pick["method"], goal_costs, regime) if pick else None
    other_load = load_mismatch(runs, baseline)
    lines = _header(quick, preset, regime, out) + _summary(table, baseline, top, rates, goal,
                                                           goal_costs, other_load)
    lines += _setup_lines(rows, runs, baseline, rates)
    if search is not None and search.get("best"):
        lines += _best_line(search["best"], Path(os.path.relpath(search["report"], out)),
                            overrides or {}, rates)
    if tuned_names:
        lines += _tuning_lines(runs, tuned or {}, tuned_names, rates)
    if best is not None:
        lines += _picked_line(best, rates)
    lines += _tables(table, rates, other_load) + ["## What the numbers say", ""]
    lines += _verdicts(table, baseline) + [""]
    lines += _signal_lines(rows, baseline) + _runs_lines(runs) + _closing_lines()
    (out / MARKDOWN_FILE).write_text("\n".join(lines))
    return out / MARKDOWN_FILE


def run_load(folder: Path) -> Optional[float]:
    """The machine's mean 1-minute load average while the run ran (None: not recorded)."""
    path = folder / LOAD_FILE
    return json.loads(path.read_text())["mean"] if path.exists() else None


def load_mismatch(runs: dict[str, list[Path]], baseline: str) -> set[str]:
    """Methods whose runs met a mean load more than LOAD_SPREAD times plain GRPO's on the same
    seeds, or less than its inverse: their wall-time ratios compare two speeds of the machine."""
    def mean_load(folders: list[Path]) -> Optional[float]:
        loads = [run_load(f) for f in folders]
        return statistics.mean(loads) if loads and None not in loads else None

    base = mean_load(runs.get(baseline, []))
    if not base:
        return set()
    mismatched = set()
    for method, folders in runs.items():
        load = mean_load(folders)
        if load and not 1 / LOAD_SPREAD <= load / base <= LOAD_SPREAD:
            mismatched.add(method)
    return mismatched


def _load_note(marked: set[str]) -> list[str]:
    return ([f"{LOAD_MARK} Its runs met a machine load (1-minute load average, in the runs table) "
             f"more than {LOAD_SPREAD}x or less than 1/{LOAD_SPREAD} of plain GRPO's: the "
             "wall-time ratio compares two speeds of the machine.", ""] if marked else [])


def read_best(search: Path) -> Optional[dict]:
    """The search's pick (``BEST_FILE`` in its report folder), or None before any search."""
    path = search / BEST_FILE
    return json.loads(path.read_text()) if path.exists() else None


README_BEGIN, README_END = "<!-- study tables: begin -->", "<!-- study tables: end -->"
SUMMARY_HEADING = "## Summary"


def quote_in_readme(reports: dict[str, Path], readme: Path) -> bool:
    """Copy each regime's summary (its goal verdict and the key rows: tuned plain GRPO and the
    best three methods) between the README's markers, generated, never typed; False when the
    README has no markers."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    quoted = []
    for regime, report in reports.items():
        markdown = report.read_text()
        if SUMMARY_HEADING not in markdown:  # a report from before the summary: nothing to quote
            continue
        start = markdown.index(SUMMARY_HEADING) + len(SUMMARY_HEADING)
        summary = markdown[start:markdown.index("\n## ", start)].strip()
        link = os.path.relpath(report, readme.parent)
        quoted.append(f"#### {regime.capitalize()} ([full report]({link}))\n\n{summary}")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(f"{head}{README_BEGIN}\n" + "\n\n".join(quoted) + f"\n{README_END}{tail}")
    return True


def _seed(folder: Path) -> int:
    return int(folder.name.rsplit("-s", 1)[1])


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})


# ---------------------------------------------------------------------- the markdown

def _header(quick: bool, preset: str, regime: Optional[str], out: Path) -> list[str]:
    title = "Selection methods against tuned plain GRPO at equal compute"
    task_page = Path(os.path.relpath(TASK_PAGE, out)).as_posix()
    return [f"# {title}" + (f": {regime}" if regime else ""), "",
            "Generated by `make study` (`python -m lze_trainer.study`) from the runs' metrics; "
            "do not edit by hand." + (" **Quick pipeline check (`QUICK=1`): a few steps, not "
                                      "a result.**" if quick else ""), "",
            f"Task, model and budget: the `{preset}` preset (`trainer/configs/{preset}.yaml`), "
            "chosen by plain GRPO's curve alone before any selective method ran on it "
            f"([study-task.md]({task_page})); every run starts from the shipped warmed model "
            "its preset names.", ""]


def _rate(rates: dict[str, float], method: str) -> str:
    return f"{rates[method]:.3g}" if method in rates else "-"


def _summary(table: list[dict], baseline: str, top: list[str], rates: dict[str, float],
             goal: Optional[str], costs, other_load: set[str]) -> list[str]:
    """The goal's verdict and the key rows: plain GRPO and the best methods, at the full budget
    and to 90 % of its gain (greedy / sampled in each cell)."""
    by = {(t["method"], t["metric"]): t for t in table}
    if not any(m == baseline for m, _ in by):
        return []
    lines = [SUMMARY_HEADING, ""] + ([goal, ""] if goal else [])
    costs_head = " | ".join(f"{COST_NAMES[k]} to 90 % of the gain" for k in COSTS)
    lines += ["| method | learning rate | greedy at the full budget (vs GRPO) | sampled at the "
              f"full budget (vs GRPO) | {costs_head} |",
              "|---|" + "---:|" * (3 + len(COSTS))]
    for method in [baseline, *top]:
        rows = [by.get((method, metric)) for metric in METRICS]
        if None in rows:
            continue
        ends = [t["at"][1.0] for t in rows]
        cells = [method, _rate(rates, method)]
        cells += ["ran short" if e is None else
                  f"{e['mean']:.3f} ({_signed(e['diff'])} ± {_se(e['diff_se'])})" for e in ends]
        cells += [" / ".join(_ratio(t["gain"][k], t) for t in rows)
                  + (f" {LOAD_MARK}" if k == "wall_s" and method in other_load else "")
                  for k in COSTS]
        lines.append("| " + " | ".join(cells) + " |")
    ranked = ", ".join(COST_NAMES[k] for k in costs)
    marked = other_load & {baseline, *top}
    return lines + ["", f"Tuned plain GRPO and the {len(top)} best methods, ranked by the worst of "
                    f"their ratios ({ranked}) to 90 % of GRPO's gain on both metrics; ratios as "
                    "greedy / sampled, on the mean curves over seeds (per seed in the report's "
                    "tables).",
                    ""] + _load_note(marked)


def _tables(table: list[dict], rates: dict[str, float], other_load: set[str]) -> list[str]:
    lines = []
    for metric in METRICS:
        rows = [t for t in table if t["metric"] == metric]
        if not rows:
            continue
        t0 = rows[0]["targets"]
        lines += [f"## Held-out {METRIC_NAMES[metric]}", "",
                  f"Accuracy at equal compute: mean ± SE over seeds, and the paired difference "
                  f"to plain GRPO at the same FLOPs on the same seed (mean ± SE of the per-seed "
                  f"differences). Plain GRPO's mean final: {t0.final:.3f}; 90 % of its gain: "
                  f"{t0.gain:.3f}.", "",
                  "| method | learning rate | 25 % of the budget | vs GRPO | 50 % | vs GRPO "
                  "| 100 % | vs GRPO |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for t in rows:
            cells = [_rate(rates, t["method"])]
            for f in BUDGET_FRACTIONS:
                a = t["at"][f]
                cells += (["ran short", "-"] if a is None else
                          [f"{a['mean']:.3f} ± {_se(a['se'])}",
                           f"{_signed(a['diff'])} ± {_se(a['diff_se'])}"])
            lines.append(f"| {t['method']} ({t['seeds']}) | " + " | ".join(cells) + " |")
        lines += ["", f"Compute to plain GRPO's targets on {METRIC_NAMES[metric]}, as ratios to "
                  "what plain GRPO needed: on the mean curves, and per seed against the same "
                  "seed's GRPO run (in brackets).", "",
                  "| method | FLOPs to 90 % of GRPO's gain (per seed) | wall time to it "
                  "| generated tokens to it (per seed) | FLOPs to GRPO's final (per seed) "
                  "| wall time to it | generated tokens to it (per seed) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for t in rows:
            cells = []
            for target in ("gain", "final"):
                cells += [_ratio(t[target][k], t)
                          + (_per_seed(t[f"{target}_paired"][k]) if k in PER_SEED_COSTS else "")
                          + (f" {LOAD_MARK}" if k == "wall_s" and t["method"] in other_load
                             else "")
                          for k in COSTS]
            lines.append(f"| {t['method']} | " + " | ".join(cells) + " |")
        lines += [""] + _load_note(other_load & {t["method"] for t in rows})
    return lines


def _verdicts(table: list[dict], baseline: str) -> list[str]:
    """A plain sentence per method and metric: where it saves compute, and where it does not."""
    lines = []
    for t in table:
        if t["method"] == baseline:
            continue
        name, metric, end = t["method"], METRIC_NAMES[t["metric"]], t["at"][1.0]
        if not t["targets"].improved:
            lines.append(f"- Plain GRPO's {metric} never rose above its start, so no ratio is "
                         f"defined for {name}.")
            continue
        flops, tokens = t["gain"]["flops"], t["gain"]["rollout_tokens"]
        if flops is None:
            text = (f"- {name} does not help on {metric}: it never reached 90 % of plain GRPO's "
                    f"gain ({t['targets'].gain:.3f}; its best {t['best']:.3f})")
        elif flops >= 1:
            text = (f"- {name} does not save compute on {metric}: it needed {flops:.2f}x plain "
                    "GRPO's FLOPs to reach 90 % of its gain")
        else:
            text = (f"- {name} reached 90 % of plain GRPO's gain on {metric} with {flops:.2f}x "
                    f"its FLOPs, {_ratio(t['gain']['wall_s'])} its wall time and "
                    f"{_ratio(tokens)} its generated tokens")
        if end is not None:
            text += (f"; at the full budget it is {_signed(end['diff'])} ± {_se(end['diff_se'])} "
                     "against plain GRPO (paired)")
            if end["diff"] + 2 * end["diff_se"] < 0:  # False without an SE (one seed)
                text += ", below it by more than two SE"
        lines.append(text + ".")
    return lines or ["- Only the baseline ran."]


def _closing_lines() -> list[str]:
    return ["## Plots", "",
            f"![held-out accuracy of plain GRPO and the best methods]({TOP_PLOT})", "",
            f"![held-out accuracy of every method against compute]({ACCURACY_PLOT})", "",
            f"![zero-variance groups generated and trained on]({ZERO_VARIANCE_PLOT})", "",
            "## How it is measured", "",
            "FLOPs proxy with P parameters: 2P per prefill and generated token (reference sets "
            "and screening included), 2P per token of every extra forward pass (old log-probs, "
            "entropy prefill, embeddings), 6P per update token: every token of a trained "
            "sequence, prompt included, which the update's forward and backward run through "
            "(`lze_trainer.compute`). Generated tokens: every token the engines generated, "
            "whatever for (training rollouts, screening, reference sets, top-up rounds, "
            "continuations), plus the prompt tokens of HIVE's entropy prefill. Wall time is the "
            "sum of the training steps' time (evaluation and start-up excluded). On each seed "
            "every method runs until its FLOPs reach what tuned plain GRPO spent on that seed, "
            "and is evaluated at the first step whose FLOPs cross each of plain GRPO's "
            "evaluation points. Compute to a target is interpolated linearly between the two "
            "held-out points around the first crossing, on the mean curves over seeds (the "
            "ratio) and on each seed's run against plain GRPO's run of the same seed (in "
            "brackets); accuracy at a share of the budget likewise. "
            f"Every step of every run is in [`{CSV_FILE}`]({CSV_FILE}).", ""]


def _setup_lines(rows, runs: dict[str, list[Path]], baseline: str,
                 rates: dict[str, float]) -> list[str]:
    # The task's spread as plain GRPO meets it (forward selection changes what a step generates).
    first = [rs[1] for rs in rows.get(baseline, []) if len(rs) > 1]
    walls = [float((f / WALL_FILE).read_text()) for folders in runs.values() for f in folders
             if (f / WALL_FILE).exists()]
    seeds = sorted({sum(1 for r in per if r) for per in rows.values()})
    seeds_text = (f"{seeds[0]}" if len(seeds) == 1 else
                  f"{seeds[0]} to {seeds[-1]} (each row says how many)")
    base_runs = [rs for rs in rows.get(baseline, []) if rs]
    lines = ["## Setup", "", f"Methods: {', '.join(runs)}; seeds per method: {seeds_text}."]
    if base_runs:
        budget = statistics.mean(rs[-1]["flops"] for rs in base_runs)
        lines.append(f"Budget: plain GRPO (`{baseline}`, learning rate {_rate(rates, baseline)}) "
                     f"{base_runs[0][-1]['step']} steps, {budget:.3g} FLOPs (mean over its "
                     "seeds); every other method runs until it has spent what plain GRPO spent "
                     "on the same seed.")
    if first:
        share = {k: statistics.mean(r[k] or 0.0 for r in first)
                 for k in ("zero_variance_generated", "all_correct", "all_wrong")}
        lines.append(f"At the first GRPO step {100 * share['zero_variance_generated']:.0f} % of "
                     f"the groups had zero reward variance ({100 * share['all_correct']:.0f} % "
                     f"all right, {100 * share['all_wrong']:.0f} % all wrong; mean over its "
                     "seeds).")
    if walls:
        lines.append(f"The runs took {sum(walls) / 60:.0f} min in all, one after another on one "
                     f"machine ({len(walls)} runs, start-up and evaluation included).")
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
             "rewards set its direction. At equal compute, a method that trains on as many of "
             "them per step as plain GRPO for fewer FLOPs takes more steps within the same "
             "budget, so it can get ahead of plain GRPO's curve; the mixed groups per FLOP say "
             "by how much at most. Replayed groups count here, although an older policy "
             "generated them.", "",
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


def _runs_lines(runs: dict[str, list[Path]]) -> list[str]:
    """Each run's wall time (start-up and evaluation included), its training steps' median time,
    and the machine's 1-minute load average while it ran, in the order the runs ran: a
    wall-time ratio compares two runs only as far as they met the same load."""
    rows = []
    for method, folders in runs.items():
        for folder in folders:
            if not (folder / WALL_FILE).exists():
                continue
            steps = [r["timing_s/step"] for r in read_metrics(folder) if "timing_s/step" in r]
            load = (json.loads((folder / LOAD_FILE).read_text())
                    if (folder / LOAD_FILE).exists() else None)
            rows.append(((folder / WALL_FILE).stat().st_mtime, folder.name,
                         float((folder / WALL_FILE).read_text()),
                         statistics.median(steps) if steps else math.nan, load))
    if not rows:
        return []
    lines = ["## Runs", "", "In the order they ran. Wall time: the whole run, start-up and "
             "held-out passes included; load: the machine's 1-minute load average sampled every "
             "5 s while it ran (the runs use 2 ranks; other jobs on the machine add to it).", "",
             "| run | wall time (min) | median step (s) | load: mean | max |",
             "|---|---:|---:|---:|---:|"]
    for _, name, wall, step, load in sorted(rows):
        lines.append(f"| {name} | {wall / 60:.1f} | {step:.2f} | "
                     + (f"{load['mean']:.1f} | {load['max']:.1f} |" if load else "- | - |"))
    return lines + [""]


def _best_line(best: dict, search_link: Path, overrides: dict[str, list[str]],
               rates: dict[str, float]) -> list[str]:
    """How the best combination and the baselines' rates were found (on seeds the table does not
    report)."""
    others = [c for c in best["candidates"] if c != best["method"]]
    seeds = ", ".join(map(str, best["seeds"]))
    setting = " ".join(overrides.get(best["method"], []))
    tuned = best.get("tuned", {})
    tuned_text = (" The baselines run at the learning rate that ended highest there: "
                  + ", ".join(f"`{v}` ({_rate(rates, v)})" for v in tuned.values()) + "."
                  if tuned else "")
    return [f"The best combination found is `{best['method']}`"
            + (f" (`{setting}`)" if setting else "")
            + f", picked by code from the search on seed {seeds}, which this table does not "
            f"report: among {', '.join(f'`{c}`' for c in best['candidates'])} it had the "
            f"smallest worst ratio to tuned plain GRPO there ({_ratios_text(best)}); "
            f"{', '.join(f'`{c}`' for c in others) or 'no other'} did worse (see "
            f"[the search]({search_link.as_posix()})).{tuned_text} Every other method runs at "
            "the preset's learning rate, as its paper runs it.", ""]


def _tuning_lines(runs: dict[str, list[Path]], tuned: dict[str, list[str]],
                  chosen: dict[str, str], rates: dict[str, float]) -> list[str]:
    """Each tuned baseline's learning rates (ascending) and how high each ended: the rate kept is
    the one that ended highest; one at the grid's edge may not be the best there is."""
    lines = ["## Tuned baselines", "",
             f"Each baseline at every learning rate of the grid, judged by how high it ends: the "
             f"mean of its last {END_POINTS} held-out points (the last third of the budget), "
             "greedy and sampled averaged. Plain GRPO's runs spend their step budget; DAPO's "
             "run to tuned plain GRPO's FLOPs.", "",
             "| method | learning rate | end score | kept |", "|---|---:|---:|---|"]
    for method, variants in tuned.items():
        present = sorted((v for v in variants if v in runs), key=lambda v: rates.get(v, 0.0))
        for v in present:
            score = end_score(runs[v])
            lines.append(f"| {v} | {_rate(rates, v)} | "
                         f"{'-' if score is None else f'{score:.3f}'} | "
                         f"{'yes' if v == chosen.get(method) else ''} |")
        if chosen.get(method) in (present[0], present[-1]) and len(present) > 1:
            lines.append(f"| | | | `{chosen[method]}` is at the grid's edge: a rate beyond it "
                         "might end higher |")
    return lines + [""]


def _picked_line(best: dict, rates: dict[str, float]) -> list[str]:
    return [f"Picked as the best combination (the smallest worst ratio to tuned plain GRPO, to "
            f"90 % of its gain on both metrics): `{best['method']}` at learning rate "
            f"{_rate(rates, best['method'])} ({_ratios_text(best)}); the main study runs it on "
            "its seeds.", ""]


def _ratios_text(best: dict) -> str:
    parts = []
    for metric, ratios in best["ratios"].items():
        if None in ratios.values():
            parts.append(f"{METRIC_NAMES[metric]} not reached")
        else:
            parts.append(f"{METRIC_NAMES[metric]} " + ", ".join(
                f"{r:.2f}x {COST_NAMES[k]}" for k, r in ratios.items()))
    return "; ".join(parts)


def _per_seed(ratios: list[Optional[float]]) -> str:
    return f" ({', '.join(_paired(r) for r in ratios)})" if len(ratios) > 1 else ""


def _paired(value: Optional[float]) -> str:
    return "not reached" if value is None else "n/a" if math.isnan(value) else f"{value:.2f}x"


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def _se(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _ratio(value: Optional[float], row: Optional[dict] = None) -> str:
    if row is not None and not row["targets"].improved:
        return "n/a (GRPO never beat its start)"
    return "not reached" if value is None else f"{value:.2f}x"


# ---------------------------------------------------------------------- plots

MARKERS = "osD^vP*Xh<>p"


def _styles(methods: list[str], baseline: str) -> dict[str, dict]:
    """Every method its own colour and marker; plain GRPO a thick black line drawn on top."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Dark2"].colors
    others = [m for m in methods if m != baseline]
    styles = {m: {"color": palette[k % len(palette)], "marker": MARKERS[k % len(MARKERS)],
                  "linewidth": 1.3, "markersize": 4, "zorder": 2}
              for k, m in enumerate(others)}
    styles[baseline] = {"color": "black", "marker": "o", "linewidth": 2.8, "markersize": 5,
                        "zorder": 5}
    return styles


def _plot_accuracy(curves: dict, baseline: str, path: Path, title: str = "every method") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = [("flops", "FLOPs proxy"), ("rollout_tokens", "generated tokens"),
             ("wall_s", "step wall time (s)")]
    styles = _styles(list(curves[METRICS[0]]), baseline)
    fig, axes = plt.subplots(len(METRICS), len(costs), figsize=(17, 9), squeeze=False)
    for i, metric in enumerate(METRICS):
        for j, (cost, label) in enumerate(costs):
            ax = axes[i][j]
            for method, c in curves[metric].items():
                if c is None:
                    continue
                x = c.mean_cost(cost)
                ax.plot(x, c.mean(), label=method, **styles[method])
                ax.fill_between(x, c.low(), c.high(), color=styles[method]["color"], alpha=0.12,
                                zorder=styles[method]["zorder"] - 1)
            ax.set(xlabel=label, ylabel=f"held-out {METRIC_NAMES[metric]}")
            # Hundreds of thousands of tokens as 1e5 ticks: full numbers overlap at this width.
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"held-out accuracy against compute at equal budgets, {title} (mean over seeds, "
                 "band: min-max over seeds; plain GRPO in black)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_zero_variance(rows: dict, baseline: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = _styles(list(rows), baseline)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for method, per_seed in rows.items():
        for ax, key in zip(axes, ("zero_variance_generated", "zero_variance_trained")):
            by_step: dict[int, list[float]] = {}
            for rs in per_seed:
                for r in rs:
                    if r.get(key) is not None and r["step"] > 0:
                        by_step.setdefault(r["step"], []).append(r[key])
            if by_step:
                steps = sorted(by_step)
                style = {**styles[method], "marker": None}
                ax.plot(steps, [statistics.mean(by_step[s]) for s in steps], label=method,
                        alpha=0.85, **style)
    axes[0].set(title="zero-variance share of the groups generated", xlabel="step")
    axes[1].set(title="zero-variance share of the groups trained on", xlabel="step")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""``make study``: every selection method of the trainer against tuned plain GRPO at equal compute,
in two regimes.

Regimes (:data:`REGIMES`), each a preset chosen by plain GRPO's curve alone (docs/study-task.md):

* ``one-pass`` (the ``study`` preset): 96 steps of 64 prompts over 4,000 training prompts, about
  1.5 passes: a prompt's history barely exists;
* ``many-pass`` (the ``study-many-pass`` preset): plain GRPO's budget makes at least 5 passes
  over its training prompts, so the methods that act on what a prompt did before (the pruner,
  GRESO, LZE's anchor and momentum, HIVE's history, replay) can act; its goal also counts the
  generated tokens.

Each regime has its own search and its own main table (their best learning rates differ).

``python -m lze_trainer.study --search [--regime one-pass]`` tunes the baselines and searches for
the best combination on :data:`SEARCH_SEEDS` (never reported in the main table): plain GRPO at
every learning rate of :data:`LR_FACTORS` x the preset's runs its step budget; the rate whose
runs end highest (study_report.tuned_variant) is tuned plain GRPO, whose FLOPs are then every
other run's budget; DAPO and the regime's candidates run at every rate of the grid too (a method
whose best rate is at the grid's edge also at the next rate beyond it), DAPO's best rate is kept
the same way, and the candidate (method and rate) with the smallest worst ratio to tuned GRPO
is the pick (study_report.pick_best). Report: ``docs/study_search/`` (one
pass), ``docs/study_many_pass_search/``.

``python -m lze_trainer.study [--regime ...] [--seeds 0 1 2]`` (the main study) runs, seed by
seed, tuned plain GRPO for the preset's step budget (evaluated at :data:`EVAL_POINTS` evenly
spaced steps), then every other method (:data:`METHODS` as their papers run them at the preset's
rate, DAPO at its tuned rate, and the search's pick at its rate) until its cumulative FLOPs proxy
reaches what tuned GRPO spent on that seed (``trainer.flops_budget``), evaluated at the first step
whose FLOPs cross each of GRPO's evaluation points (``trainer.eval_at_flops``): every held-out
point has a partner at equal compute on the same seed. A seed's runs follow its GRPO run, one
after another (the wall-time ratios compare runs close in time; each run's load average is
recorded beside it). Then the report (:mod:`lze_trainer.study_report`): a CSV of every step of
every run, the plots and ``study.md`` (``docs/`` for one pass, ``docs/study_many_pass/``).

Every regime starts from the same warmed model on every machine (``model.path: warm:study``,
:mod:`lze_trainer.warm_starts`). A finished run is not run again, so an interrupted study
continues where it stopped; ``--report-only`` rewrites the reports from the runs.

``--quick`` checks the pipeline of both regimes in CI (two methods each, one seed, a few steps, a
small held-out set, the preset's rate), not the result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .metrics import read_metrics
from .study_report import (LOAD_FILE, MARKDOWN_FILE, WALL_FILE, quote_in_readme, read_best,
                           tuned_variant, write_report)

# Method -> config overrides of a study preset: every method of the trainer as its paper runs it
# (docs/methods.md), at the preset's learning rate.
METHODS: dict[str, list[str]] = {
    "grpo": ["selection.method=grpo"],
    "dapo": ["selection.method=dapo"],  # dynamic sampling: rounds until B mixed groups
    "lze": ["selection.method=lze"],  # the release's published example: a fixed 0.4
    "lze-release": ["selection.method=lze", "selection.keep_ratio_schedule=release"],
    "lze-prune": ["selection.method=lze", "selection.prune=true"],
    "lze-alloc": ["selection.method=lze", "rollout.allocation=true"],
    # K = ceil(B / 2) references every other step (the default: the official 256 per 512).
    "dots": ["selection.method=dots"],
    # The official replay run clips symmetrically at 0.2 (no clip-higher) with a buffer of B.
    "dots-replay": ["selection.method=dots", "replay.ratio=0.5", "actor.clip_ratio_high=0.2",
                    "replay.buffer_size=${trainer.batch_size}"],
    "greso": ["selection.method=greso"],  # on dynamic sampling, as its scripts run it
    "speed": ["selection.method=speed"],  # 4 screening rollouts of G = 12
    "lze-hive": ["selection.method=lze", "selection.entropy_filter=true"],
}
# Combinations that only the search tries (a pick among them joins the main table).
COMBINATIONS: dict[str, list[str]] = {
    # LZE with top-up rounds until its quota of groups with energy > 0 is met.
    "lze-refill": ["selection.method=lze", "selection.refill=true"],
    # Forward selection by history (GRESO's skips) and backward selection by energy (LZE's top
    # 40 % of the groups GRESO's batch holds): fewer rollouts and fewer update tokens.
    "greso-lze": ["selection.method=greso", "selection.keep_top_energy=true"],
    # SPEED's screening thinned first by GRESO's history, the batch cut to LZE's top 40 %.
    "speed-greso-lze": ["selection.method=speed", "selection.speed.prefilter=greso",
                        "selection.keep_top_energy=true"],
}
BASE_METHODS = {**METHODS, **COMBINATIONS}
BASELINE = "grpo"  # tuned on the search seeds; its FLOPs are every other run's budget
TUNED = ("grpo", "dapo")  # baselines the search tunes, each kept at its best rate
# The search's learning-rate grid, x the preset's rate, the same for the baselines and the
# candidates; a method whose best rate is at the grid's edge also runs the next rate beyond it.
LR_FACTORS = (0.5, 1.0, 2.0)
SEARCH_SEEDS = [10]  # never reported in the main table
# Plain GRPO's held-out points over its budget: every 1/12, so 25 % and 50 % of it are points.
EVAL_POINTS = 12
# Another method may run up to this many times plain GRPO's steps to spend the same FLOPs (the
# cheapest per step spend about 0.45x of a GRPO step); a run that stops at the cap is reported
# as having run short.
STEP_CAP = 4
DOCS = Path("docs")


@dataclass(frozen=True)
class Regime:
    """A task of the study, with where its runs and reports go."""

    name: str
    preset: str
    runs: Path  # the main study's run folders
    report: Path  # the main study's report folder
    search_runs: Path
    search_report: Path
    candidates: tuple[str, ...]  # searched at every rate of LR_FACTORS
    goal_costs: tuple[str, ...]  # costs the goal caps (study_report.GOAL_RATIOS)
    quick_methods: tuple[str, ...]  # the CI pipeline check's two methods


REGIMES: dict[str, Regime] = {
    # One pass: LZE's update savings and its variants (in 1.5 passes the forward methods that
    # act on a prompt's history barely act; the many-pass regime searches them).
    "one-pass": Regime("one-pass", "study", Path("runs/study"), DOCS, Path("runs/study-search"),
                       DOCS / "study_search", ("lze", "lze-release", "lze-refill"),
                       ("flops", "wall_s"), ("grpo", "lze")),
    # Many passes: forward selection by history can skip rollouts, so the goal counts generated
    # tokens and the candidates combine a forward method with LZE's backward selection (LZE
    # alone rolls out every prompt and cannot save them).
    "many-pass": Regime("many-pass", "study-many-pass", Path("runs/study-many-pass"),
                        DOCS / "study_many_pass", Path("runs/study-many-pass-search"),
                        DOCS / "study_many_pass_search",
                        ("lze-prune", "greso-lze", "lze-hive", "speed-greso-lze"),
                        ("flops", "wall_s", "rollout_tokens"), ("grpo", "lze-prune")),
}
# The quick pipeline check: a few steps on a small held-out set, a KV cache sized for them, and
# one thread a rank (CI runs it beside other tests).
QUICK_OVERRIDES = ["trainer.total_steps=4", "trainer.eval_every=2", "data.eval_limit=96",
                   "rollout.eval_samples=2", "trainer.save_hf_model=false",
                   "rollout.cpu_kv_cache_gib=0.125", "trainer.threads_per_rank=1"]
_VARIANT = re.compile(r"^(?P<method>.+)-lr(?P<factor>[0-9.]+)$")


def variant(method: str, factor: float) -> str:
    """``method`` at ``factor`` x the preset's learning rate: ``lze-lr0.5``; x1 is ``lze``."""
    return method if factor == 1.0 else f"{method}-lr{factor:g}"


def split_variant(name: str) -> tuple[str, float]:
    """``lze-lr0.5`` -> ("lze", 0.5); ``lze`` -> ("lze", 1.0)."""
    match = _VARIANT.match(name)
    if match and match["method"] in BASE_METHODS:
        return match["method"], float(match["factor"])
    if name not in BASE_METHODS:
        raise SystemExit(f"study: unknown method {name!r}; expected one of "
                         f"{sorted(BASE_METHODS)}, optionally with -lr<factor>")
    return name, 1.0


def overrides(name: str, preset: str) -> list[str]:
    """The config overrides of a method or its learning-rate variant on ``preset``."""
    method, factor = split_variant(name)
    return BASE_METHODS[method] + ([] if factor == 1.0 else
                                   [f"actor.lr={factor * preset_lr(preset)!r}"])


def preset_lr(preset: str) -> float:
    from .config import load

    return load(preset).actor.lr


def learning_rate(name: str, preset: str) -> float:
    return split_variant(name)[1] * preset_lr(preset)


def run_dir(runs: Path, method: str, seed: int) -> Path:
    return runs / f"{method}-s{seed}"


def is_finished(folder: Path) -> bool:
    """A run that ended cleanly (the study writes its wall time only then) and logged steps."""
    return (folder / WALL_FILE).exists() and any("timing_s/step" in r
                                                 for r in read_metrics(folder))


def budget_of(baseline: Path) -> list[str]:
    """The overrides that give a method plain GRPO's budget on this seed: the FLOPs its finished
    run spent, and the FLOPs at each of its held-out points after step 0."""
    rows = read_metrics(baseline)
    points = [r["total/flops"] for r in rows
              if r.get("step", 0) > 0 and "total/flops" in r
              and any(k.startswith("eval/") for k in r)]
    spent = [r["total/flops"] for r in rows if "total/flops" in r]
    if not spent or not points:
        raise SystemExit(f"study: {baseline} has no FLOPs or held-out points to take a budget "
                         "from; rerun it")
    return [f"trainer.flops_budget={spent[-1]!r}",
            f"trainer.eval_at_flops=[{','.join(repr(p) for p in points)}]"]


def launch(folder: Path, preset: str, method: str, seed: int, extra: list[str],
           nproc: int) -> float:
    """One training run of ``method`` on ``preset`` under torchrun; returns its wall seconds."""
    return _launch(folder, ["--config", preset, f"trainer.seed={seed}",
                            *overrides(method, preset), *extra], nproc)


def _launch(folder: Path, args: list[str], nproc: int) -> float:
    """The trainer under torchrun with ``args`` into ``folder``; returns its wall seconds. Its
    console goes to ``<folder>.log``; the machine's 1-minute load average, sampled while it runs,
    to ``LOAD_FILE`` (the wall-time ratios assume runs met the same load)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "lze_trainer", *args, f"trainer.run_dir={folder}"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    start, loads, done = time.time(), [], threading.Event()

    def sample_load() -> None:
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    with open(f"{folder}.log", "w") as log:
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    done.set()
    sampler.join()
    if result.returncode != 0:
        raise SystemExit(f"study: {folder.name} failed (exit {result.returncode}); see "
                         f"{folder}.log")
    # The run ended when its console did: the driver may have been paused (SIGSTOP) after it.
    seconds = os.stat(f"{folder}.log").st_mtime - start
    (folder / LOAD_FILE).write_text(json.dumps(
        {"mean": sum(loads) / len(loads) if loads else os.getloadavg()[0],
         "max": max(loads, default=os.getloadavg()[0])}) + "\n")
    (folder / WALL_FILE).write_text(f"{seconds:.1f}\n")
    return seconds


def retime(folder: Path, nproc: int) -> None:
    """Run a finished run again from its saved config, for its wall time at the machine's load
    now: on one machine the runs are deterministic, so the twin must log the same FLOPs and
    held-out accuracies; then it replaces the run (else both are kept and the study stops)."""
    twin = folder.with_name(folder.name + "-retime")
    shutil.rmtree(twin, ignore_errors=True)
    seconds = _launch(twin, ["--config", str(folder / "config.yaml")], nproc)
    if _outcome(twin) != _outcome(folder):
        raise SystemExit(f"study: {twin} did not repeat {folder} (its FLOPs or held-out "
                         "accuracies differ): runs are not deterministic here, so a run cannot "
                         "be timed again; both are kept")
    shutil.rmtree(folder)
    twin.rename(folder)
    Path(f"{twin}.log").replace(f"{folder}.log")
    print(f"study: {folder} timed again: {seconds / 60:.1f} min", flush=True)


def _outcome(folder: Path) -> list[tuple]:
    """What a run computed, without its timing: per step its FLOPs and held-out accuracies."""
    return [(r["step"], r.get("total/flops"),
             *sorted((k, v) for k, v in r.items() if k.startswith("eval/")))
            for r in read_metrics(folder)]


def run_all(runs: Path, preset: str, methods: list[str], seeds: list[int], baseline: str,
            extra: list[str], nproc: int) -> None:
    """Seed by seed, ``baseline`` first (its FLOPs set the others' budget), then ``methods``."""
    steps_cap = f"trainer.total_steps={STEP_CAP * _total_steps(preset, extra)}"
    for seed in seeds:  # every method's seed 0 first: an interrupted study stays comparable
        _run_once(runs, preset, baseline, seed, extra, nproc)
        for method in (m for m in methods if m != baseline):
            budget = [*budget_of(run_dir(runs, baseline, seed)), steps_cap]
            _run_once(runs, preset, method, seed, extra + budget, nproc)


def _run_once(runs: Path, preset: str, method: str, seed: int, extra: list[str],
              nproc: int) -> None:
    folder = run_dir(runs, method, seed)
    if is_finished(folder):
        print(f"study: {folder} is finished, kept", flush=True)
        return
    seconds = launch(folder, preset, method, seed, extra, nproc)
    print(f"study: {method} seed {seed} done in {seconds / 60:.1f} min", flush=True)


def search(regime: Regime, seeds: list[int], nproc: int, run: bool = True) -> Path:
    """Tune the baselines and pick the best combination of ``regime`` on ``seeds``: plain GRPO's
    rates first (its best sets every other run's budget), then DAPO's and each candidate's."""
    runs = regime.search_runs
    folders = lambda names: {m: [run_dir(runs, m, s) for s in seeds] for m in names}  # noqa: E731
    grpo = _rate_grid(regime, BASELINE, seeds, None, nproc, run)
    baseline = tuned_variant(folders(grpo))
    grids = {m: _rate_grid(regime, m, seeds, baseline, nproc, run)
             for m in (*TUNED[1:], *regime.candidates)}
    methods = [baseline, *(g for g in grpo if g != baseline), *(v for g in grids.values()
                                                                for v in g)]
    return write_report(folders(methods), baseline, regime.search_report, preset=regime.preset,
                        rates={m: learning_rate(m, regime.preset) for m in methods},
                        overrides={m: overrides(m, regime.preset) for m in methods},
                        candidates=[v for m in regime.candidates for v in grids[m]],
                        tuned={BASELINE: grpo, **{m: grids[m] for m in TUNED[1:]}},
                        goal_costs=regime.goal_costs, regime=regime.name)


def _rate_grid(regime: Regime, method: str, seeds: list[int], baseline: str | None, nproc: int,
               run: bool) -> list[str]:
    """``method`` at every rate of LR_FACTORS (at ``baseline``'s FLOPs budget unless it is the
    baseline); where the one that ends highest (study_report.tuned_variant) is at the grid's edge,
    also at the next rate beyond it, once (the best rate may lie there). Returns the variants
    run."""
    runs = regime.search_runs
    names = [variant(method, f) for f in LR_FACTORS]

    def run_names(todo: list[str]) -> None:
        if run:
            for seed in seeds:
                for name in todo:
                    budget = [] if baseline is None else _budget(runs, regime.preset, baseline,
                                                                 seed)
                    _run_once(runs, regime.preset, name, seed, budget, nproc)

    run_names(names)
    best = split_variant(tuned_variant({n: [run_dir(runs, n, s) for s in seeds] for n in names}))[1]
    low, high = min(LR_FACTORS), max(LR_FACTORS)
    if best in (low, high):
        beyond = variant(method, best / 2 if best == low else best * 2)
        run_names([beyond])
        if all(is_finished(run_dir(runs, beyond, s)) for s in seeds):
            names.append(beyond)
    return names


def _budget(runs: Path, preset: str, baseline: str, seed: int) -> list[str]:
    """A method's budget on ``seed``: what ``baseline`` spent there, and the step cap."""
    return [*budget_of(run_dir(runs, baseline, seed)),
            f"trainer.total_steps={STEP_CAP * _total_steps(preset, [])}"]


def main_methods(regime: Regime) -> tuple[str, list[str]]:
    """Tuned plain GRPO and the main table's other methods: tuned DAPO, every other method at the
    preset's rate, and the search's pick (at its rate) when it is not one of them. Before any
    search, the baselines run at the preset's rate."""
    best = read_best(regime.search_report)
    tuned = (best or {}).get("tuned", {})
    methods = [tuned.get(m, m) for m in METHODS]
    if best is not None:
        split_variant(best["method"])  # a pick that is no longer a method stops the study here
        if best["method"] not in methods:
            methods.append(best["method"])
    return methods[0], methods


def main_study(regime: Regime, seeds: list[int], nproc: int, run: bool = True,
               quick: Path | None = None) -> Path:
    """The main table of ``regime``; ``quick``: the pipeline check's runs under that folder,
    with its report beside them."""
    if quick:
        baseline, methods = regime.quick_methods[0], list(regime.quick_methods)
        runs, extra = quick / regime.name, list(QUICK_OVERRIDES)
        out, search = runs / "report", None
    else:
        baseline, methods = main_methods(regime)
        runs, out, extra = regime.runs, regime.report, []
        search = {"best": read_best(regime.search_report),
                  "report": regime.search_report / MARKDOWN_FILE}
    if run:
        run_all(runs, regime.preset, methods, seeds, baseline, extra, nproc)
    return write_report({m: [run_dir(runs, m, s) for s in seeds] for m in methods}, baseline,
                        out, quick=bool(quick), preset=regime.preset, search=search,
                        rates={m: learning_rate(m, regime.preset) for m in methods},
                        overrides={m: overrides(m, regime.preset) for m in methods},
                        goal_costs=regime.goal_costs, regime=regime.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lze_trainer.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=[*REGIMES, "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="pipeline check (CI)")
    parser.add_argument("--quick-runs", type=Path, default=Path("runs/study-quick"),
                        help="the pipeline check's run folders (one per regime, report inside)")
    parser.add_argument("--search", action="store_true",
                        help="tune the baselines and search for the best combination")
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--report-only", action="store_true", help="write the reports only")
    parser.add_argument("--retime", nargs="+", default=[], metavar="METHOD",
                        help="first run these methods' finished runs (of --seeds; with --search, "
                        "the search's) again for their wall time at the machine's load now")
    args = parser.parse_args(argv)

    regimes = list(REGIMES.values()) if args.regime == "both" else [REGIMES[args.regime]]
    reports = {}
    for regime in regimes:
        seeds = args.seeds or (SEARCH_SEEDS if args.search else [0, 1, 2])
        for method in args.retime:
            for seed in seeds:
                retime(run_dir(regime.search_runs if args.search else regime.runs, method, seed),
                       args.nproc)
        if args.search:
            report = search(regime, args.seeds or SEARCH_SEEDS, args.nproc, not args.report_only)
        else:
            report = main_study(regime, args.seeds or ([0] if args.quick else [0, 1, 2]),
                                args.nproc, not args.report_only,
                                args.quick_runs if args.quick else None)
            reports[regime.name] = report
        print(f"study: {regime.name} report {report}", flush=True)
    if reports and not args.quick and Path("README.md").exists():
        main_reports = {r.name: r.report / MARKDOWN_FILE for r in REGIMES.values()
                        if (r.report / MARKDOWN_FILE).exists()}
        if quote_in_readme(main_reports, Path("README.md")):
            print("study: README.md quotes the verdicts and the key rows", flush=True)
    return 0


def _total_steps(preset: str, extra: list[str]) -> int:
    from .config import load

    return load(preset, extra).trainer.total_steps


if __name__ == "__main__":
    raise SystemExit(main())

"""``make study``: every selection method of the trainer against plain GRPO at equal compute.

``python -m lze_trainer.study [--quick] [--seeds 0 1 2] [--methods grpo lze ...]`` runs, seed by
seed, plain GRPO for the ``study`` preset's step budget (evaluated at :data:`EVAL_POINTS` evenly
spaced steps), then every other method until its cumulative FLOPs proxy reaches what plain GRPO
spent on that seed (``trainer.flops_budget``), evaluated at the first step whose FLOPs cross each
of plain GRPO's evaluation points (``trainer.eval_at_flops``): every held-out point has a partner
at equal compute on the same seed (as the papers compare: the same compute, or the compute to
the same accuracy). Same B, G, learning rate and warm-up for all; the same seed gives the same
warm-up and, where the method allows, the same prompt order. Each run goes under torchrun, one
after another; then the report (:mod:`lze_trainer.study_report`): a CSV of every step of every
run, the plots and ``docs/study.md``. A finished run is not run again, so an interrupted study
continues where it stopped; ``--report-only`` rewrites the report from the runs.

``--search`` runs the search for the best combination (plain GRPO and :data:`CANDIDATES` on
:data:`SEARCH_SEEDS`, seeds the main table never reports) and writes its own report to
``docs/study_search/``; ``make study`` runs it first.

``--quick`` checks the pipeline in CI (two methods, one seed, a few steps, a short warm-up and a
small held-out set), not the result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from .metrics import read_metrics
from .study_report import MARKDOWN_FILE, WALL_FILE, quote_in_readme, read_best, write_report

# Method -> config overrides of the study preset. Every method of the trainer as its paper runs
# it (README, "Selection methods"), and the best combination found on seeds other than the
# reported ones (see docs/study.md).
METHODS: dict[str, list[str]] = {
    "grpo": ["selection.policy=uniform"],
    "dapo": ["selection.policy=dapo"],  # dynamic sampling: rounds until B mixed groups
    "lze": ["selection.policy=lze"],  # the release's published example: a fixed 0.4
    "lze-release": ["selection.policy=lze", "selection.keep_ratio_schedule=release"],
    "lze-prune": ["selection.policy=lze", "selection.prune=true"],
    "lze-alloc": ["selection.policy=lze", "rollout.allocation=true"],
    # K = B / 2 references every other step, the official K / B (256 per 512 prompts).
    "dots": ["selection.policy=dots", "selection.dots_reference_size=32"],
    # The official replay run clips symmetrically at 0.2 (no clip-higher) with a buffer of B.
    "dots-replay": ["selection.policy=dots", "selection.dots_reference_size=32", "replay.ratio=0.5",
                    "actor.clip_ratio_high=0.2", "replay.buffer_size=64"],
    "greso": ["selection.policy=greso"],  # on dynamic sampling, as its scripts run it
    "speed": ["selection.policy=speed"],  # 4 screening rollouts of G = 12
    "lze-hive": ["selection.policy=lze", "selection.entropy_filter=true"],
}
# Candidates for the best combination, tried on seeds other than the reported ones (the search,
# docs/study_search/), which picks the one with the smallest worst ratio to plain GRPO there
# (study_report.pick_best); the main study runs it under its own name. The search may also try a
# learning-rate multiplier; the pick then keeps its own rate. Both ways have a reason: a selective
# batch is less noisy (no zero-advantage groups), and on the study's task larger steps (twice the
# rate, or four optimizer steps a batch) lost accuracy in plain GRPO's pilots (docs/study-task.md).
# The fixed-step searches before this protocol are listed in docs/study-fixed-steps/.
CANDIDATES: dict[str, list[str]] = {
    "speed": METHODS["speed"],
    "lze": METHODS["lze"],
    "lze-prune": METHODS["lze-prune"],
    "lze-hive": METHODS["lze-hive"],
    # LZE with top-up rounds until its quota of groups with energy > 0 is met.
    "lze-refill": ["selection.policy=lze", "selection.refill=true"],
    "lze-lr2": [*METHODS["lze"], "actor.lr=6.0e-4"],  # twice the preset's 3e-4
    "lze-lr05": [*METHODS["lze"], "actor.lr=1.5e-4"],  # half of it
}
ALL_METHODS = {**METHODS, **CANDIDATES}
SEARCH_SEEDS = [10]  # seeds of the search for "best" (never reported in the main table)
DOCS = Path("docs")  # the study's report
SEARCH_DIR = "study_search"  # the search's report, next to the study's
BASELINE = "grpo"
PRESET = "study"
# Plain GRPO's held-out points over its budget: every 1/12, so 25 % and 50 % of it are points.
EVAL_POINTS = 12
# Another method may run up to this many times plain GRPO's steps to spend the same FLOPs (the
# cheapest per step spend about 0.45x of a GRPO step); a run that stops at the cap is reported
# as having run short.
STEP_CAP = 4
# The quick pipeline check: a few steps from a short warm-up, on a small held-out set.
QUICK_METHODS = ["grpo", "lze"]
QUICK_OVERRIDES = ["trainer.total_steps=4", "trainer.eval_every=2", "sft_warmup.steps=30",
                   "data.eval_limit=96", "rollout.eval_samples=2", "trainer.save_hf_model=false"]


def study_methods() -> list[str]:
    """The main table's methods: every method of the trainer, and the search's pick when it is
    not one of them."""
    best = read_best(DOCS / SEARCH_DIR)
    if best is not None and best["method"] not in ALL_METHODS:
        raise SystemExit(f"study: the search picked {best['method']!r}, which is no longer a "
                         f"candidate; rerun it (python -m lze_trainer.study --search)")
    extra = [] if best is None or best["method"] in METHODS else [best["method"]]
    return list(METHODS) + extra


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


def launch(folder: Path, method: str, seed: int, extra: list[str], nproc: int) -> float:
    """One training run under torchrun; returns its wall seconds. Its console goes to
    ``<folder>.log``. The warm-up cache sits next to the runs' root (``runs/warmup``), so the
    search and the main study share one warm-up (the cache names each by a digest of its
    settings, so the quick check's shorter one lives beside it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "lze_trainer", "--config", PRESET,
           f"trainer.run_dir={folder}", f"trainer.seed={seed}",
           f"sft_warmup.cache_dir={folder.parent.parent / 'warmup'}", *ALL_METHODS[method],
           *extra]
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(f"{folder}.log", "w") as log:
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    if result.returncode != 0:
        raise SystemExit(f"study: {method} seed {seed} failed (exit {result.returncode}); "
                         f"see {folder}.log")
    seconds = time.time() - start
    (folder / WALL_FILE).write_text(f"{seconds:.1f}\n")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lze_trainer.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="pipeline check (CI)")
    parser.add_argument("--methods", nargs="+", choices=sorted(ALL_METHODS), default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument("--runs", type=Path, default=None, help="run folders (default runs/study)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default docs)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.total_steps")
    parser.add_argument("--report-only", action="store_true", help="write the report only")
    parser.add_argument("--search", action="store_true",
                        help="the search for 'best': GRPO and the CANDIDATES on SEARCH_SEEDS")
    args = parser.parse_args(argv)

    if args.search:
        methods = args.methods or [BASELINE, *CANDIDATES]
        seeds = args.seeds or SEARCH_SEEDS
        runs = args.runs or Path("runs/study-search")
        out = args.out or DOCS / SEARCH_DIR
    else:
        methods = args.methods or (QUICK_METHODS if args.quick else study_methods())
        seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
        runs = args.runs or Path("runs/study-quick" if args.quick else "runs/study")
        out = args.out or (runs / "report" if args.quick else DOCS)
    extra = list(QUICK_OVERRIDES) if args.quick else []
    if args.steps is not None:
        extra += [f"trainer.total_steps={args.steps}",
                  f"trainer.eval_every={max(args.steps // EVAL_POINTS, 1)}"]
    methods = [BASELINE] + [m for m in methods if m != BASELINE]  # it sets everyone's budget

    if not args.report_only:
        steps_cap = f"trainer.total_steps={STEP_CAP * _total_steps(extra)}"
        for seed in seeds:  # every method's seed 0 first: an interrupted study stays comparable
            for method in methods:
                folder = run_dir(runs, method, seed)
                if is_finished(folder):
                    print(f"study: {folder} is finished, kept", flush=True)
                    continue
                budget = ([] if method == BASELINE else
                          [*budget_of(run_dir(runs, BASELINE, seed)), steps_cap])
                seconds = launch(folder, method, seed, extra + budget, args.nproc)
                print(f"study: {method} seed {seed} done in {seconds / 60:.1f} min", flush=True)
    main_study = not (args.quick or args.search)
    search = ({"best": read_best(DOCS / SEARCH_DIR), "report": DOCS / SEARCH_DIR / MARKDOWN_FILE}
              if main_study else None)
    report = write_report({m: [run_dir(runs, m, s) for s in seeds] for m in methods}, BASELINE,
                          out, quick=args.quick, search=search, overrides=ALL_METHODS,
                          candidates=list(CANDIDATES) if args.search else None)
    print(f"study: report {report}", flush=True)
    if main_study and out == DOCS and Path("README.md").exists():
        if quote_in_readme(report, Path("README.md")):
            print("study: README.md quotes the new tables", flush=True)
    return 0


def _total_steps(extra: list[str]) -> int:
    from .config import load

    return load(PRESET, extra).trainer.total_steps


if __name__ == "__main__":
    raise SystemExit(main())

"""Where `make test`'s minutes go: a report that never judges, and a budget check developers run.

``mark start|end STAGE`` (from the Makefile's recipes) appends a stage's wall seconds to
``$LZE_STAGE_TIMES`` (nothing when it is unset, e.g. a plain `make setup`). ``report`` (the end
of `make test`) prints the stage table against each stage's budget, the slowest tests of every
suite with their wall and CPU seconds (tests/timing_plugin.py records them), and a WARNING for
each stage or test file over its budget, and exits 0: CI's verdict is the tests' alone, because
a timing read on a machine of unknown speed and load cannot tell a slow file from a slow machine
(a fresh clone on a 2-core machine 2.5x slower per core than the recording one ran every test
green and the old guard, which failed the run, judged one file at 21.9 % of its suite against a
12.5 % share: files do not slow down alike).
``check`` (`make test-times`, for developers) judges the last run's records and exits 1 when a
test file takes more than its share: its CPU seconds as a percentage of the rest of its suite's,
over its share in tests/time_budgets.json times ``check_tolerance`` (files not listed get the
default share; files under the floor share of the whole run are not judged). That tolerance is
the spread of machines it must hold across: on machines up to ``check_tolerance`` x apart, where
each file may slow down by any factor in that range, a file within its share is never failed.
Standard library only: it runs before any venv exists and in every venv.

Usage: python tools/test_times.py report --stages F --tests DIR --budgets F [--json OUT]
       python tools/test_times.py check --tests DIR --budgets F
       python tools/test_times.py mark start|end STAGE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SLOWEST = 25
TOTAL = "make test"  # the stage the whole run marks


@dataclass(frozen=True)
class OverBudget:
    suite: str
    file: str
    cpu_s: float
    percent: float  # of the rest of the suite's CPU seconds
    share_percent: float


def load_budgets(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_records(folder: Path) -> list[dict]:
    records = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def file_totals(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """suite -> file -> {"cpu_s", "wall_s", "tests"}."""
    totals: dict = defaultdict(lambda: defaultdict(lambda: {"cpu_s": 0.0, "wall_s": 0.0,
                                                             "tests": 0}))
    for r in records:
        entry = totals[r["suite"]][r["file"]]
        entry["cpu_s"] += r["cpu_s"]
        entry["wall_s"] += r["wall_s"]
        entry["tests"] += 1
    return {suite: dict(files) for suite, files in totals.items()}


def percent_of_the_rest(files: dict[str, dict[str, float]]) -> dict[str, float]:
    """file -> its CPU seconds as a percentage of the other files' in the same suite (a suite of
    one file, or of files that took no CPU, has nothing to measure against: left out)."""
    total = sum(entry["cpu_s"] for entry in files.values())
    return {file: 100.0 * entry["cpu_s"] / (total - entry["cpu_s"])
            for file, entry in files.items() if total - entry["cpu_s"] > 0}


def files_over_budget(records: list[dict], budgets: dict, tolerance: float) -> list[OverBudget]:
    """The files whose part of their suite's CPU seconds passes tolerance x their share.

    A file below ``floor_percent_of_run`` of the whole run's CPU seconds is not judged: it cannot
    move the run's budget, and in a suite of a few files its part moves with any other file's
    cost (CI's warm Triton cache once made the Triton suite's 8 CPU s file 170 % of the rest)."""
    totals = file_totals(records)
    floor_s = budgets["floor_percent_of_run"] / 100.0 * sum(
        entry["cpu_s"] for files in totals.values() for entry in files.values())
    over = []
    for suite, files in sorted(totals.items()):
        for file, percent in sorted(percent_of_the_rest(files).items()):
            if files[file]["cpu_s"] < floor_s:
                continue
            share = budgets["files"].get(suite, {}).get(file, budgets["default_file_percent"])
            if percent > tolerance * share:
                over.append(OverBudget(suite, file, round(files[file]["cpu_s"], 1),
                                       round(percent, 1), share))
    return over


def read_stages(path: Path) -> dict[str, float]:
    stages: dict[str, float] = {}
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            name, seconds = line.split("\t")[:2]
            stages[name] = stages.get(name, 0.0) + float(seconds)
    return stages


def render(stages: dict[str, float], records: list[dict], budgets: dict,
           over: list[OverBudget], tolerance: float) -> str:
    lines = ["", "make test: stages (wall seconds; beside the set-up: "
             f"{', '.join(budgets['concurrent'])})",
             f"{'stage':<24}{'seconds':>10}{'budget':>10}"]
    for name, budget in budgets["stages"].items():
        seconds = stages.get(name)
        shown = "up to date" if seconds is None else f"{seconds:.1f}"
        flag = "  over" if seconds is not None and seconds > budget else ""
        lines.append(f"{name:<24}{shown:>10}{budget:>10}{flag}")
    total = stages.get(TOTAL, sum(s for name, s in stages.items()
                                  if name not in budgets["concurrent"]))
    flag = "  over" if total > budgets["total_s"] else ""
    lines.append(f"{TOTAL:<24}{total:>10.1f}{budgets['total_s']:>10}{flag}")
    lines += ["", f"{SLOWEST} slowest tests (wall s, CPU s incl. child processes, suite)"]
    for r in sorted(records, key=lambda r: r["wall_s"], reverse=True)[:SLOWEST]:
        lines.append(f"{r['wall_s']:8.1f} {r['cpu_s']:8.1f}  {r['suite']:<7} {r['nodeid']}")
    return "\n".join(lines + [over_line(o, tolerance, "WARNING") for o in over])


def over_line(o: OverBudget, tolerance: float, word: str) -> str:
    return (f"{word}: {o.file} took {o.cpu_s} CPU s in the {o.suite} suite, {o.percent} % of "
            f"the rest of the suite's, over {tolerance} x its share of {o.share_percent} % "
            "(tests/time_budgets.json): make it faster, or raise its share and say why")


def outcome_counts(records: list[dict]) -> dict[str, dict[str, int]]:
    """suite -> {"passed": n, "skipped": n, "failed": n}."""
    counts: dict = defaultdict(lambda: {"passed": 0, "skipped": 0, "failed": 0})
    for r in records:
        counts[r["suite"]][r.get("outcome", "passed")] += 1
    return dict(counts)


def summary(stages: dict[str, float], records: list[dict], budgets: dict) -> dict:
    """What the run measured, with the budgets it ran against (the pages render both)."""
    limits = dict(budgets["stages"], **{TOTAL: budgets["total_s"]})
    return {"stages": {name: {"seconds": round(s, 1), "minutes": round(s / 60, 1),
                              "budget_s": limits.get(name)}
                       for name, s in stages.items()},
            "tests": outcome_counts(records),
            "cpu_s": {suite: round(sum(e["cpu_s"] for e in files.values()), 1)
                      for suite, files in file_totals(records).items()},
            "files": {suite: {f: {k: round(v, 1) for k, v in e.items()} for f, e in files.items()}
                      for suite, files in file_totals(records).items()}}


def report(args) -> int:
    """The run's times, with warnings; always 0: timings never decide CI's verdict."""
    budgets = load_budgets(args.budgets)
    stages, records = read_stages(args.stages), read_records(args.tests)
    tolerance = budgets["report_tolerance"]
    print(render(stages, records, budgets, files_over_budget(records, budgets, tolerance),
                 tolerance))
    if args.json:
        Path(args.json).write_text(json.dumps(summary(stages, records, budgets), indent=1) + "\n")
    return 0


def check(args) -> int:
    """The developers' budget check: 1 when a file passes check_tolerance x its share."""
    budgets = load_budgets(args.budgets)
    records = read_records(args.tests)
    if not records:
        print(f"no test records in {args.tests}: run `make test` first")
        return 1
    tolerance = budgets["check_tolerance"]
    over = files_over_budget(records, budgets, tolerance)
    for o in over:
        print(over_line(o, tolerance, "FAILED"))
    print(f"{len(over)} file(s) over {tolerance} x their share, of "
          f"{sum(len(f) for f in file_totals(records).values())} judged by suite")
    return 1 if over else 0


def mark(args) -> int:
    """Stage start/end stamps, kept next to the stage file until the stage ends."""
    target = os.environ.get("LZE_STAGE_TIMES")
    if not target:
        return 0
    stamp = Path(target).with_name(f".{args.stage.replace(' ', '_')}.start")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    if args.when == "start":
        stamp.write_text(str(time.time()))
    else:
        seconds = time.time() - float(stamp.read_text())
        stamp.unlink()
        with open(target, "a") as f:
            f.write(f"{args.stage}\t{seconds:.1f}\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("--stages", type=Path, required=True)
    rep.add_argument("--tests", type=Path, required=True)
    rep.add_argument("--budgets", type=Path, required=True)
    rep.add_argument("--json", type=Path)
    chk = sub.add_parser("check")
    chk.add_argument("--tests", type=Path, required=True)
    chk.add_argument("--budgets", type=Path, required=True)
    mk = sub.add_parser("mark")
    mk.add_argument("when", choices=("start", "end"))
    mk.add_argument("stage")
    args = parser.parse_args(argv)
    return {"report": report, "check": check, "mark": mark}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

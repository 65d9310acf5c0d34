"""Per-test time record for `make test`'s report and `make test-times` (tools/test_times.py).

With ``LZE_TEST_TIMES`` set to a folder, every test appends one JSON line to
``<folder>/<suite>-<worker>.jsonl`` (one file per pytest-xdist worker, so no two processes write
the same file): its node id, outcome (passed, skipped or failed), and wall seconds and CPU
seconds of setup, call and teardown together.
CPU time is the process's own (all threads) plus that of the child processes it waited for
(torchrun ranks, compilers, Ray's processes once shut down): unlike wall time it hardly moves
when other work shares the cores, so a file's share of its suite reads alike on a busy machine.
``LZE_TEST_SUITE`` names the suite (main, triton, verl). Unset, nothing is recorded.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _record_path(folder: str) -> Path:
    suite = os.environ.get("LZE_TEST_SUITE", "main")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{suite}-{worker}.jsonl"


# nodeid -> its outcome so far: "failed" if any phase failed, else "skipped" if one was skipped.
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "skipped"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get("LZE_TEST_TIMES")
    if not folder:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    record = {"nodeid": item.nodeid, "file": item.nodeid.split("::")[0],
              "wall_s": round(time.perf_counter() - wall, 3),
              "cpu_s": round(_cpu_seconds() - cpu, 3),
              "outcome": _outcomes.pop(item.nodeid, "passed"),
              "suite": os.environ.get("LZE_TEST_SUITE", "main")}
    with open(_record_path(folder), "a") as f:
        f.write(json.dumps(record) + "\n")

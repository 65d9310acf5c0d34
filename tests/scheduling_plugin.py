"""How `make test` spreads a suite over pytest-xdist workers (``-n 2 --dist loadfile``).

* A test file runs on one worker (``--dist loadfile``), so its module-scoped fixtures (a trainer
  run, a compiled module, a Ray cluster) are built once. (``--dist loadgroup`` with
  ``xdist_group`` marks would split finer, but xdist 3.8 marks a group by rewriting
  ``item._nodeid``, which pytest 9 no longer reads: every mark was ignored.)
* The costliest files are scheduled first, by their share of the suite's CPU seconds in
  tests/time_budgets.json, then the other files with slow tests (``@pytest.mark.slow``), then
  the rest: the workers start on the long ones and the many short files fill the end evenly
  instead of one worker finishing a long file alone (longest first: the fresh-clone run before
  this order left one worker idle for 144 of the main suite's 670 s). The Makefile passes
  ``--no-loadscope-reorder``: xdist's default order is by the number of tests in a file, which
  put 976 one-millisecond checks first and a 60 s trainer run last.
* Each worker gets its share of the cores for torch's intra-op threads (torchrun children set
  their own: tests/trainer_launch.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

BUDGETS = Path(__file__).with_name("time_budgets.json")


def _worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config):
    if _worker_count() > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _worker_count()))


def _shares() -> dict[str, float]:
    """This suite's files' shares of its CPU seconds (``LZE_TEST_SUITE``, as make test sets)."""
    suite = os.environ.get("LZE_TEST_SUITE", "main")
    return json.loads(BUDGETS.read_text())["files"].get(suite, {})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    shares = _shares()
    slow_files = {_file(item) for item in items if item.get_closest_marker("slow") is not None}
    # stable: a file's tests stay together and in their order
    items.sort(key=lambda item: (-shares.get(_file(item), 0.0), _file(item) not in slow_files))


def _file(item) -> str:
    return item.nodeid.split("::")[0]

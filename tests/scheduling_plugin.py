"""How `make test` spreads a suite over pytest-xdist workers (``-n 2 --dist loadfile``).

* A test file runs on one worker (``--dist loadfile``), so its module-scoped fixtures (a trainer
  run, a compiled module, a Ray cluster) are built once. (``--dist loadgroup`` with
  ``xdist_group`` marks would split finer, but xdist 3.8 marks a group by rewriting
  ``item._nodeid``, which pytest 9 no longer reads: every mark was ignored.)
* Files with slow tests (``@pytest.mark.slow``: trainer runs under torchrun, builds) are
  scheduled first, so the workers start on the long ones and the many short files fill the end
  evenly instead of one worker finishing a long file alone.
* Each worker gets its share of the cores for torch's intra-op threads (torchrun children set
  their own: tests/trainer_launch.py).
"""

from __future__ import annotations

import os

import pytest


def _worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config):
    if _worker_count() > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _worker_count()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    slow_files = {_file(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _file(item) not in slow_files)  # stable: files stay contiguous


def _file(item) -> str:
    return item.nodeid.split("::")[0]

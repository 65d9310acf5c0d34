"""How `make test` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

* A test file whose tests share a module-scoped fixture (a trainer run, a compiled module, a
  model) runs on one worker, so the fixture is built once: its tests get one ``xdist_group``.
* Files with slow tests (``@pytest.mark.slow``: trainer runs under torchrun, builds) are
  scheduled first, so the workers start on the long ones and the many short tests fill the end
  evenly instead of one worker finishing a long test alone. A file's tests stay together (its
  module fixtures are built once).
* Each worker gets its share of the cores for torch's intra-op threads (torchrun children set
  their own: one thread a rank).
"""

from __future__ import annotations

import os

import pytest


def _worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


def pytest_configure(config):
    if _worker_count() > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _worker_count()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    slow_files = set()
    for item in items:
        if _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(_file(item)))
        if item.get_closest_marker("slow") is not None:
            slow_files.add(_file(item))
    items.sort(key=lambda item: _file(item) not in slow_files)  # stable: files stay contiguous


def _file(item) -> str:
    return item.nodeid.split("::")[0]

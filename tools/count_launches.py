"""Kernel launches of one CUDA selection step at every plan boundary, on the limits of each
architecture users run (sm_80, sm_86, sm_89, sm_90), counted in the CUDA emulator (the unchanged
.cu kernels on CPU threads: ``cuda_emulated``), written to benchmarks/results/launches.json,
recorded in docs/figure-sources.toml and rendered into the README. After changing the CUDA plans
(csrc/cuda/selection_plan.h, lze_select.cu), commit, then:

    make build && .venv/bin/python tools/count_launches.py

The boundaries are where the module's own count (``select_step_launches`` of its plan) changes
between 1 and :data:`MAX_ROWS` rows; a step is run on each side of each, and at both ends,
unchecked and with ``check_inputs=True``, and its launches counted (``launches()``); a count
unlike the module's stops the command. tests/test_render_docs.py fails while the file disagrees
with the built module's count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_docs  # noqa: E402

RESULTS = "benchmarks/results/launches.json"
MAX_ROWS = 1 << 20  # the GPU check's largest B
GROUP = 2  # a step's launches do not depend on G (the emulator is faster at a small one)
MACHINE = "the CUDA emulator"
SOURCES = ("csrc", "lze_kernels")


def module():
    from lze_kernels import emulated

    return emulated.module()


def module_launches(batch: int, with_undo: int) -> int:
    """The module's own count of a step's launches at ``batch`` rows on the current device."""
    mod = module()
    return mod.select_step_launches(mod.plan_topk(batch, 0)[1], with_undo)


def boundaries(count, top: int = MAX_ROWS) -> list[int]:
    """The sizes B in (1, top] where ``count(B)`` differs from ``count(B - 1)``, found between
    powers of two by bisection (at most one change between two consecutive ones)."""
    found, low = [], 1
    while low < top:
        high = min(2 * low, top)
        if count(high) != count(low):
            lo, hi = low, high  # count(lo) == count(low) != count(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if count(mid) == count(low) else (lo, mid)
            found.append(hi)
        low = high
    return found


def counted(batch: int, check_inputs: bool) -> int:
    """Launches of one emulated step at ``batch`` rows of G = :data:`GROUP` (its plan made by an
    earlier step)."""
    import torch

    from lze_kernels import LZESelector

    selector = LZESelector(2 * batch, backend="cuda_emulated")
    gen = torch.Generator().manual_seed(batch)
    rewards = (torch.rand(batch, GROUP, generator=gen) < 0.5).float()
    ids = torch.randperm(2 * batch, generator=gen)[:batch]
    selector.step(rewards, ids, check_inputs=check_inputs)
    module().launches()  # reset
    selector.step(rewards, (ids + 1) % (2 * batch), check_inputs=check_inputs)
    return module().launches()


def spans(rows: list[dict]) -> list[dict]:
    """Consecutive rows of equal counts merged: ``{"from", "to", "launches", "checked"}``."""
    out: list[dict] = []
    for row in rows:
        if out and (out[-1]["launches"], out[-1]["checked"]) == (row["launches"], row["checked"]):
            out[-1]["to"] = row["B"]
        else:
            out.append({"from": row["B"], "to": row["B"], "launches": row["launches"],
                        "checked": row["checked"]})
    return out


def words(spans_: list[dict]) -> str:
    """"2 at B = 1 to 16,384 and 4 at B = 16,385 to 1,048,576 (one more with check_inputs=True:
    its undo copy)"."""
    parts = [f"{s['launches']} at B = {s['from']:,} to {s['to']:,}" for s in spans_]
    extra = {s["checked"] - s["launches"] for s in spans_}
    tail = (f" ({extra.pop()} more with `check_inputs=True`: its undo copy)" if len(extra) == 1
            else "; with `check_inputs=True`: " + ", ".join(f"{s['checked']}" for s in spans_))
    return " and ".join(parts) + tail


def measure_architecture() -> list[dict]:
    """Every boundary's two sides and both ends on the current device, counted; stops at a count
    unlike the module's."""
    edges = boundaries(lambda b: module_launches(b, 0))
    sizes = sorted({1, MAX_ROWS, *edges, *(b - 1 for b in edges)})
    rows = []
    for batch in sizes:
        row = {"B": batch, "launches": counted(batch, False), "checked": counted(batch, True)}
        expected = (module_launches(batch, 0), module_launches(batch, 1))
        if (row["launches"], row["checked"]) != expected:
            raise SystemExit(f"B = {batch}: {row['launches']} / {row['checked']} launches counted,"
                             f" the module says {expected[0]} / {expected[1]}")
        rows.append(row)
        print(f"B = {batch:,}: {row['launches']} launches, {row['checked']} checked", flush=True)
    return rows


def measure() -> dict:
    """Each architecture's counts; the words group architectures whose spans agree."""
    from lze_kernels import emulated

    per_arch, by_words = {}, {}
    for arch in emulated.ARCHITECTURES:
        print(f"sm_{arch}:", flush=True)
        with emulated.architectures(arch):
            rows = measure_architecture()
        per_arch[f"sm_{arch}"] = {"rows": rows, "spans": spans(rows)}
        by_words.setdefault(words(per_arch[f"sm_{arch}"]["spans"]), []).append(f"sm_{arch}")
    return {"what": "kernel launches of one LZESelector.step on the CUDA backend, counted in the "
                    f"CUDA emulator under each architecture's limits at G = {GROUP} "
                    "(tools/count_launches.py)",
            "architectures": per_arch,
            "words": "; ".join(f"{text} on {' and '.join(archs)}"
                               for text, archs in by_words.items())}


def uncommitted() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", *SOURCES], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    if uncommitted():
        print(f"count_launches: {' and '.join(SOURCES)} have uncommitted changes: commit them "
              "(the counts are recorded as the commit's), make build, then run this again",
              file=sys.stderr)
        return 1
    (ROOT / RESULTS).write_text(json.dumps(measure(), indent=1) + "\n")
    print(f"wrote {RESULTS}; recorded as {render_docs.record(RESULTS, 'launches', None, MACHINE)}")
    return render_docs.main([])


if __name__ == "__main__":
    sys.exit(main())

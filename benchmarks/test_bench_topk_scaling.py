"""How the GPU selection kernels' time grows with B, measured without a GPU.

The CUDA top-k (csrc/cuda/lze_topk.cu) runs on CPU threads through the emulator
(``cuda_emulated``) and the Triton top-k in the interpreter: neither is a GPU's speed, but both
execute every thread's work, so their time grows as the kernels' work does. Each size is timed
as the best of a few calls (the machine may be busy; the least disturbed call is the closest to
the work itself), at B = 16,385, 65,540 and 262,160 (both backends' multi-launch plans, past the
one-block and one-program limits; noise on). Linear work gives time(4B) / time(B) near 4; the
rank-by-counting kernel this replaced gave about 16.
Goal: at most 6. The counts behind it, not timed, are in tests/test_topk_linear.py.
Results: topk_scaling.md in the run folder (bench_common.run_file).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from bench_common import run_file

from lze_kernels import dispatch

BATCHES = (16385, 65540, 262160)
CALLS = 3
RATIO_GOAL = 6.0


def best_seconds(backend, batch: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    energy = torch.where(torch.rand(batch, generator=gen) < 1 / 3, 0.0,
                         torch.rand(batch, generator=gen))
    counter = torch.tensor([3, 0])
    times = []
    for _ in range(CALLS):
        begin = time.perf_counter()
        backend.topk(energy, int(0.4 * batch), 0.05, 7, counter)
        times.append(time.perf_counter() - begin)
    return min(times)


def _write_table(rows: dict) -> None:
    lines = ["# Top-k time against B without a GPU", "",
             "Written by benchmarks/test_bench_topk_scaling.py: best of "
             f"{CALLS} calls, noise on, k = 0.4 B, on {os.cpu_count()} CPU cores (the emulator "
             "runs blocks on a worker per core; the interpreter runs programs in turn). Run with "
             "TRITON_INTERPRET=1 for the Triton row.", "",
             "| backend | " + " | ".join(f"B = {b:,}" for b in BATCHES)
             + " | time(4B) / time(B), worst |", "|---" * (len(BATCHES) + 2) + "|"]
    for name, seconds in rows.items():
        ratios = [seconds[i + 1] / seconds[i] for i in range(len(BATCHES) - 1)]
        lines.append(f"| {name} | " + " | ".join(f"{s * 1e3:.0f} ms" for s in seconds)
                     + f" | {max(ratios):.2f} |")
    run_file("topk_scaling.md").write_text("\n".join(lines) + "\n")


_measured: dict = {}


@pytest.mark.parametrize("name", ["cuda_emulated", "triton"])
def test_topk_time_grows_linearly(benchmark, name):
    backend = dispatch.BACKENDS[name]
    if not backend.available() or not dispatch.supports(backend, torch.device("cpu")):
        pytest.skip(f"{name} does not run on the CPU here (Triton needs TRITON_INTERPRET=1)")
    seconds = [best_seconds(backend, batch) for batch in BATCHES]
    ratios = [seconds[i + 1] / seconds[i] for i in range(len(BATCHES) - 1)]
    benchmark.extra_info.update(batches=list(BATCHES), seconds=seconds, ratios=ratios,
                                goal=RATIO_GOAL)
    _measured[name] = seconds
    _write_table(_measured)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures are in extra_info
    print(f"{name}: " + ", ".join(f"{r:.2f}" for r in ratios) + " (time(4B) / time(B))")

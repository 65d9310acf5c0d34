"""The C++ CPU step with every core busy, next to the same step on the machine as it is.

A trainer's CPU is rarely idle (rollout engine, optimizer, data workers), and kernels that
spin-wait for their threads collapse there: with OpenMP, 2 threads on 2 busy cores turned a 1 ms
step into 50 ms. Per (B, G) of ``test_bench_step.py``, per load and per thread setting this
times ``LZESelector.step(rewards, prompt_ids, check_inputs=False)`` on the ``cpu`` backend:

* load ``quiet``: nothing besides the benchmark (on a shared machine, as quiet as it is: each
  case records the load average); ``busy``: one busy-loop process per core, spawned for the
  duration of the case;
* threads ``single``: ``LZE_NUM_THREADS=1``; ``default``: the backend's default (up to
  ``torch.get_num_threads()`` threads, or the calling thread alone while that is faster).

Target (``report.py``): busy default <= 2x busy single-thread, i.e. using more threads never
costs more than 2x when the cores are shared. The ratio is taken from calls of the two settings in
turn under the same spinners (``interleaved_*_s`` of the busy default case); the separate cases'
medians are shown beside it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
from bench_common import BATCHES, GROUPS, RoundInputs, run_benchmark

from lze_kernels import LZESelector, available_backends

LOADS = ("quiet", "busy")
THREADS = {"single": "1", "default": None}  # LZE_NUM_THREADS
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif("cpu" not in available_backends(CPU),
                                reason="the C++ cpu backend is not built")


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes spinning in a Python loop until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(count)]
    try:
        time.sleep(0.3)  # past their start-up: spinning
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def _cases():
    # Each (B, G)'s four cases run back to back, so that they see the same machine.
    for batch in BATCHES:
        for group in GROUPS:
            for load in LOADS:
                for threads in THREADS:
                    yield pytest.param(batch, group, load, threads,
                                       id=f"B{batch}-G{group}-{load}-{threads}")


@pytest.mark.parametrize("batch, group, load, threads", _cases())
def test_cpu_step_under_load(benchmark, monkeypatch, batch, group, load, threads):
    _use_threads(monkeypatch, threads)
    inputs = RoundInputs(batch, group, CPU)
    selector = LZESelector(inputs.num_prompts, device=CPU, backend="cpu")

    def step(rewards, prompt_ids):
        return selector.step(rewards, prompt_ids, check_inputs=False)

    benchmark.group = f"busy B={batch} G={group}"
    spinners = os.cpu_count() if load == "busy" else 0
    with busy_cores(spinners):
        run_benchmark(benchmark, step, inputs, CPU, B=batch, G=group,
                      variant=f"cpu {load} {threads}", backend="cpu", load=load,
                      threads=threads, busy_processes=spinners)
        if load == "busy" and threads == "default":
            benchmark.extra_info.update(_interleaved(step, inputs, monkeypatch))
        benchmark.extra_info["load_average"] = os.getloadavg()[0]


def _use_threads(monkeypatch, threads: str) -> None:
    """The backend reads LZE_NUM_THREADS at every call (unset: its default)."""
    if THREADS[threads] is None:
        monkeypatch.delenv("LZE_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("LZE_NUM_THREADS", THREADS[threads])


def _interleaved(step, inputs, monkeypatch, rounds: int = 41) -> dict:
    """Median seconds of single-thread and default calls taken in turn under the same spinners.
    Separate cases see different moments of a shared machine (the busy single-thread time alone
    varied 3x between two runs here); calls in turn see the same one, so their ratio is the
    target's measure."""
    seconds = {"single": [], "default": []}
    for _ in range(rounds):
        for threads in seconds:
            _use_threads(monkeypatch, threads)
            args, _ = inputs()
            start = time.perf_counter()
            step(*args)
            seconds[threads].append(time.perf_counter() - start)
    return {f"interleaved_{k}_s": statistics.median(v) for k, v in seconds.items()}

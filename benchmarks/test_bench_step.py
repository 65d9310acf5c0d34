"""One full LZE selection step, per (B, G) and per variant (what is compared: docs/benchmarks.md).

The unit timed is ``LZESelector.step(rewards, prompt_ids, check_inputs=False)``: the fused
statistics/energy/state update and the noisy top-k, on a persistent selector of N = 4 B prompts,
against what a user would run instead: the shortest plain PyTorch step (torch_baselines.LeanTorchStep,
about twenty ops) eager and under ``torch.compile(fullgraph=True, dynamic=False)``, the
feature-parity step in plain PyTorch (torch_baselines.PlainTorchSelector) eager and compiled, and
the host-side loop of today's trainers (baselines.PythonLoopSelector). The reference backend is the
correctness oracle, not a speed anchor: it is not timed. Inputs and timing: bench_common.py.

``test_host_cost_of_one_step`` times what a step costs the host at B = 16, G = 8 on one thread,
where the kernels' own work is a few microseconds: the fused call unchecked ("off") and with its
default check, against the lean step eager, interleaved in one run (host_cost.json in the run folder).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from baselines import PythonLoopSelector
from bench_common import BATCHES, GROUPS, RoundInputs, run_benchmark, run_file, unchecked
from torch_baselines import LeanTorchStep, PlainTorchSelector

from lze_kernels import LZEConfig, LZESelector

VARIANTS = ("fused", "torch_lean", "torch_lean_compile", "torch_plain", "torch_plain_compile",
            "python_loop", "floor")
# The Python loop costs ~25 us per sequence; 2^18 sequences keeps B=16384, G=16 (a target).
LOOP_MAX_SEQUENCES = 2**18
STATE_ROW_BYTES = 32  # fstate + istate row of one prompt (lze_kernels.layout)


def _cases():
    for batch in BATCHES:
        for group in GROUPS:
            for variant in VARIANTS:
                too_slow = variant == "python_loop" and batch * group > LOOP_MAX_SEQUENCES
                marks = pytest.mark.skip(reason=f"python_loop capped at B*G <= "
                                                f"{LOOP_MAX_SEQUENCES}") if too_slow else ()
                yield pytest.param(batch, group, variant, marks=marks,
                                   id=f"B{batch}-G{group}-{variant}")


def _fused_step(num_prompts, device):
    selector = LZESelector(num_prompts, device=device)
    return unchecked(selector.step), selector.backend


def _compiled_step(baseline):
    """torch.compile of a plain PyTorch step, static shapes: one graph per (B, G), as a user
    compiling a fixed batch shape gets. The bound method is what is compiled (a compiled
    ``functools.partial`` of a step ran ~100x slower per call here, torch 2.13)."""
    def build(num_prompts, device):
        torch._dynamo.reset()  # a fresh cache per case: no recompile limit across the grid
        step = baseline(num_prompts, device=device).step
        return torch.compile(step, fullgraph=True, dynamic=False), "torch+compile"
    return build


def _floor(rewards, prompt_ids):
    return rewards.sum(dim=1)


BUILDERS = {
    "fused": _fused_step,
    "torch_lean": lambda n, device: (LeanTorchStep(n, device=device).step, "torch"),
    "torch_lean_compile": _compiled_step(LeanTorchStep),
    "torch_plain": lambda n, device: (PlainTorchSelector(n, device=device).step, "torch"),
    "torch_plain_compile": _compiled_step(PlainTorchSelector),
    "python_loop": lambda n, device: (PythonLoopSelector().step, "python"),
    "floor": lambda n, device: (_floor, "torch"),
}


def bytes_moved(variant: str, batch: int, group: int) -> int:
    """Bytes a step must read and write at least: rewards in and advantages out, the id and
    the state row of each prompt (read and written), the per-row outputs and the kept indices.
    The floor reads the rewards and writes one sum per row."""
    if variant == "floor":
        return 4 * batch * group + 4 * batch
    per_row = 8 + 2 * STATE_ROW_BYTES + 3 * 4 + 1  # id, state in/out, p/E/m, keep_mask
    return 2 * 4 * batch * group + per_row * batch + 8 * LZEConfig().num_keep(batch)


@pytest.mark.parametrize("batch, group, variant", _cases())
def test_step(benchmark, device, batch, group, variant):
    inputs = RoundInputs(batch, group, device)
    step, backend = BUILDERS[variant](inputs.num_prompts, device)
    benchmark.group = f"B={batch} G={group}"
    run_benchmark(benchmark, step, inputs, device, B=batch, G=group, variant=variant,
                  backend=backend, bytes=bytes_moved(variant, batch, group))


# ----------------------------------------------------------------------------- host cost

HOST_COST_SHAPE = (16, 8)  # (B, G): the kernels' own work is a few microseconds
HOST_COST_GOALS = {"fused_off": 0.2, "fused_default": 0.25}  # x the lean step eager, at most
HOST_COST_CALLS, HOST_COST_REPEATS, HOST_COST_BATCHES = 200, 21, 64


def _host_cost_variants(num_prompts: int) -> dict:
    return {"fused_off": unchecked(LZESelector(num_prompts, backend="cpu").step),
            "fused_default": LZESelector(num_prompts, backend="cpu").step,
            "lean_eager": LeanTorchStep(num_prompts).step}


def _microseconds_per_call(step, batches) -> float:
    begin = time.perf_counter()
    for i in range(HOST_COST_CALLS):
        step(*batches[i % len(batches)])
    return (time.perf_counter() - begin) / HOST_COST_CALLS * 1e6


def test_host_cost_of_one_step(benchmark, monkeypatch):
    """Microseconds per step on one CPU thread at B = 16, G = 8: the fused call unchecked
    ("off") and with its default check (on a CPU: the fault word read right after the step,
    with the undo records copied before it), against the lean step eager. Each repeat times
    HOST_COST_CALLS calls of every variant back to back, the variants' order rotating; the
    figure is the median over repeats, so all three share the machine's load. Goal: off <=
    0.2x and default <= 0.25x the lean step's time."""
    monkeypatch.setenv("LZE_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch, group = HOST_COST_SHAPE
        inputs = RoundInputs(batch, group, torch.device("cpu"))
        batches = [inputs()[0] for _ in range(HOST_COST_BATCHES)]
        variants = _host_cost_variants(inputs.num_prompts)
        load_before = os.getloadavg()
        for step in variants.values():
            _microseconds_per_call(step, batches)  # warm-up: pools, caches
        times = {name: [] for name in variants}
        names = list(variants)
        for repeat in range(HOST_COST_REPEATS):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                times[name].append(_microseconds_per_call(variants[name], batches))
        load_after = os.getloadavg()
    finally:
        torch.set_num_threads(threads)
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = {name: median[name] / median["lean_eager"] for name in HOST_COST_GOALS}
    result = {"B": batch, "G": group, "threads": 1, "backend": "cpu", "torch": torch.__version__,
              "unit": "microseconds per step, median over repeats", "median_us": median,
              "ratio_to_lean_eager": ratios, "goal": HOST_COST_GOALS,
              "goal_met": {name: ratios[name] <= HOST_COST_GOALS[name] for name in ratios},
              "calls_per_repeat": HOST_COST_CALLS, "repeats": HOST_COST_REPEATS,
              "load_average_before": load_before, "load_average_after": load_after,
              "cpu_count": os.cpu_count()}
    run_file("host_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    run_file("host_cost.md").write_text(_host_cost_table(result))
    benchmark.extra_info.update(result)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the figures are in extra_info
    print(json.dumps({"median_us": median, "ratio_to_lean_eager": ratios}, indent=1))


def _host_cost_table(result: dict) -> str:
    median, ratios = result["median_us"], result["ratio_to_lean_eager"]
    rows = [f"| {name} | {median[name]:.1f} | "
            + (f"{ratios[name]:.3f} (goal <= {result['goal'][name]}) |" if name in ratios
               else "1 |") for name in ("fused_off", "fused_default", "lean_eager")]
    return "\n".join([
        "# Host cost of one step on the CPU", "",
        "Written by benchmarks/test_bench_step.py::test_host_cost_of_one_step (results in "
        "host_cost.json): B = {B}, G = {G}, the C++ CPU backend on one thread, microseconds per "
        "step (median over {repeats} repeats of {calls_per_repeat} calls, the variants "
        "interleaved), load average {before:.1f} before and {after:.1f} after, {cpu_count} "
        "cores.".format(before=result["load_average_before"][0],
                        after=result["load_average_after"][0], **result), "",
        "| variant | us per step | x the lean step eager |", "|---|---:|---:|", *rows, ""])

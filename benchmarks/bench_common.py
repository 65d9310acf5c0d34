"""What every benchmark here shares: fresh inputs per round, the timing loop, and the run folder
its results files go to.

Each round gets fresh binary rewards and fresh distinct ids, made on the device outside the timed
region from a seed that depends only on (B, G), so every variant sees the same sequence of inputs. On a GPU the
timed call ends with a device sync, and the median CUDA-event time and the number of device
kernels of one call are recorded as well.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

# A run's results go to a folder of its own (benchmarks/conftest.py names it), never to the
# registered results the docs render (benchmarks/results/): `python tools/render_docs.py --record
# RUN_FOLDER` copies a run's files there and records them.
RUN_ENV = "LZE_BENCH_RUN"
RESULTS = Path(__file__).resolve().parent / "results"

# The (B, G) grid of the step benchmarks.
BATCHES = (512, 2048, 8192, 16384, 65536)
GROUPS = (8, 16, 64)
PROMPTS_PER_ROW = 4  # N = 4 B
SECONDS_PER_CASE = 1.0
MIN_ROUNDS, MAX_ROUNDS = 3, 200


class RoundInputs:
    """pytest-benchmark ``setup``: fresh (rewards [B, G], prompt_ids [B]) for each round."""

    def __init__(self, batch: int, group: int, device: torch.device):
        self.batch, self.group, self.device = batch, group, device
        self.num_prompts = PROMPTS_PER_ROW * batch
        # Drawn on the device: at B = 1M a round's 16M rewards would take longer to make on
        # the host than the steps take to run.
        self.generator = torch.Generator(device=device).manual_seed(batch * 1000 + group)

    def __call__(self):
        g, device = self.generator, self.device
        p_correct = torch.rand(self.batch, 1, generator=g, device=device)
        rewards = (torch.rand(self.batch, self.group, generator=g, device=device)
                   < p_correct).float()
        ids = torch.randperm(self.num_prompts, generator=g, device=device)[: self.batch]
        return (rewards, ids), {}


def unchecked(step):
    """``step(rewards, prompt_ids)`` with ``check_inputs=False``: the fused call without its
    value check."""
    def unchecked_step(rewards, prompt_ids):
        return step(rewards, prompt_ids, check_inputs=False)

    return unchecked_step


def run_benchmark(benchmark, step, inputs, device: torch.device, **info) -> None:
    """Warm ``step`` up (this compiles what is compiled), pick the number of rounds from one
    timed call, then time it on fresh ``inputs()`` each round; ``info`` goes to extra_info."""
    step = _synchronized(step, device)
    _seconds_of_one_call(step, inputs)
    rounds = _rounds(_seconds_of_one_call(step, inputs))
    benchmark.extra_info.update(info, device=device.type)
    if device.type == "cuda":
        benchmark.extra_info["device_median_s"] = _cuda_event_seconds(step, inputs, rounds)
        benchmark.extra_info["kernel_launches"] = _kernel_launches(step, inputs)
    benchmark.pedantic(step, setup=inputs, rounds=rounds, iterations=1)


def _synchronized(step, device: torch.device):
    if device.type != "cuda":
        return step

    def synced(*args):
        out = step(*args)
        torch.cuda.synchronize(device)
        return out

    return synced


def _seconds_of_one_call(step, inputs) -> float:
    args, _ = inputs()
    start = time.perf_counter()
    step(*args)
    return time.perf_counter() - start


def _rounds(seconds_per_call: float) -> int:
    return int(min(MAX_ROUNDS, max(MIN_ROUNDS, SECONDS_PER_CASE / seconds_per_call)))


def _cuda_event_seconds(step, inputs, rounds: int) -> float:
    """Median device time of one call (CUDA events), fresh inputs each round."""
    times = []
    for _ in range(rounds):
        args, _ = inputs()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _kernel_launches(step, inputs) -> int:
    """Device kernels (and copies/memsets) of one call, counted by torch.profiler."""
    args, _ = inputs()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run_file(name: str) -> Path:
    """``name`` in this run's folder ($LZE_BENCH_RUN), which it creates."""
    folder = Path(os.environ[RUN_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def merge_result(path: Path, case: str, value: dict) -> dict:
    """Write ``value`` as ``case`` into the JSON table at ``path`` (a file of the run folder),
    keeping the cases recorded there: by this run, or, in a new run folder, by the registered
    table of the same name (benchmarks/results/), so a run of some cases records the others as
    they were. Returns the whole table."""
    path = Path(path)
    start = path if path.exists() else RESULTS / path.name
    table = json.loads(start.read_text()) if start.exists() else {}
    table[case] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return table

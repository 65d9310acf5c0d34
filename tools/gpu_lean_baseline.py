"""The fused step against the lean PyTorch step on one GPU, timed by CUDA events: a run's
``lean-baseline.json`` (tools/gpu_runs.py reads it; docs/gpu-results.md and the README render it).

    python tools/gpu_lean_baseline.py RUN_FOLDER/lean-baseline.json [--batches 256,4096]

Per B (G = 16, N = 4B prompts, keep 0.4), in microseconds: the median of CUDA events around
each call over fresh inputs, after a warm-up call (``gpu_bench._event_median``), of the fused
CUDA and Triton steps (``check_inputs=False`` and the default), the lean step eager and under
``torch.compile(dynamic=False)`` (compiled before timing: ``compile_s``), and ``torch.topk`` of
B keys alone; each built by ``benchmarks/gpu_bench.py``.

The 2026-11-27 H100 run's lean-baseline.json (docs/gpu-runs/2026-11-27-h100-416255b) was written
by a script that was not kept; this one was written after it from that file's fields and the
run's notes, and has not run on a GPU yet. That script also ran a float64 oracle, host-sync and
deferred-fault checks, which the check's kernel stage (tests/test_gpu.py) runs now.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "benchmarks")]
import gpu_runs  # noqa: E402

BATCHES = (256, 4096, 65536, 262144, 1048576)
GROUP, ROUNDS = 16, 50


def time_variant(variant: str, batch: int, device) -> dict:
    """``{name in lean-baseline.json: microseconds}`` of one variant at one B (the compiled
    lean step also its first call's seconds, ``compile_s``)."""
    import gpu_bench
    from bench_common import RoundInputs

    inputs = RoundInputs(batch, GROUP, device)
    step = gpu_bench.build_step(gpu_runs.LEAN_VARIANTS[variant], 4 * batch, device, batch)
    out = {}
    if variant == "torch_plain_compile":
        begin = time.perf_counter()
        step(*inputs()[0])
        gpu_bench._synchronize(device)
        out["compile_s"] = round(time.perf_counter() - begin, 1)
    out[variant] = gpu_bench._event_median(step, ROUNDS, inputs=inputs) * 1e6
    return out


def measure(batches) -> dict:
    import torch
    import triton

    device = torch.device("cuda")
    bench = {}
    for batch in batches:
        row = {}
        for variant in gpu_runs.LEAN_VARIANTS:
            row.update(time_variant(variant, batch, device))
        bench[str(batch)] = row
        print(batch, json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__, "script": "tools/gpu_lean_baseline.py",
            "timer": f"median of {ROUNDS} CUDA-event timings after a warm-up call",
            "load_average": os.getloadavg(), "bench_us": bench}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_lean_baseline: needs a CUDA device", file=sys.stderr)
        return 1
    data = measure([int(b) for b in args.batches.split(",")])
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

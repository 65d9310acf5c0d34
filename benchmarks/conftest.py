"""Benchmark setup: the device under test, the facts every result file should carry, and the run
folder the results go to: $LZE_BENCH_RUN, by default a new benchmarks/runs/<UTC time>/ (ignored by
git), with run.json naming the commit, whether the tree had uncommitted changes, and the machine
(what `python tools/render_docs.py --record RUN_FOLDER` records).

The fused backend on a CPU is the C++ one, so TRITON_INTERPRET is deliberately left unset.
Inductor compiles in-process: its pool of compile workers would start (importing torch) while
later cases are being timed, and on 2 cores that slowed some of them down by 100x.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import lze_kernels  # noqa: E402
from lze_kernels import dispatch  # noqa: E402


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fused_backend_name(device: torch.device) -> str:
    """What ``backend="auto"`` runs on ``device``: the fused backend of the device."""
    return dispatch.resolve("auto", device).name


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_runs  # noqa: E402
import render_docs  # noqa: E402

RUN_FOLDER = Path(os.environ.setdefault(
    "LZE_BENCH_RUN", str(ROOT / "benchmarks" / "runs" / time.strftime("%Y%m%d-%H%M%S",
                                                                       time.gmtime()))))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def pytest_sessionstart(session):
    """run.json: what measured this run, for the record."""
    device = bench_device()
    machine = (gpu_runs.article(torch.cuda.get_device_name(device)) if device.type == "cuda"
               else render_docs.describe_cpu())
    RUN_FOLDER.mkdir(parents=True, exist_ok=True)
    (RUN_FOLDER / "run.json").write_text(json.dumps({
        "commit": _git("rev-parse", "--short=7", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine, "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average": os.getloadavg()}, indent=1) + "\n")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return bench_device()


def pytest_benchmark_update_machine_info(config, machine_info):
    device = bench_device()
    machine_info["torch"] = torch.__version__
    machine_info["lze_kernels"] = lze_kernels.__version__
    machine_info["device"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                              else f"cpu ({os.cpu_count()} cores)")
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["fused_backend"] = fused_backend_name(device)
    machine_info["available_backends"] = lze_kernels.available_backends(device)
    machine_info["load_average"] = os.getloadavg()  # other jobs on the machine skew timings

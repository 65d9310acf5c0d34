"""Benchmark setup: the device under test and the facts every result file should carry.

The fused backend on a CPU is the C++ one, so TRITON_INTERPRET is deliberately left unset.
Inductor compiles in-process: its pool of compile workers would start (importing torch) while
later cases are being timed, and on 2 cores that slowed some of them down by 100x.
"""

import os

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

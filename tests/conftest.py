"""Shared test setup. TRITON_INTERPRET must be set before any @triton.jit function is defined,
so it is set here, before lze_kernels is imported: the Triton kernels then run on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lze_kernels import dispatch  # noqa: E402
from lze_kernels.config import LZEConfig  # noqa: E402
from lze_kernels.layout import KernelParams  # noqa: E402

# Kernel backends that run here on CPU tensors, compared against the torch reference.
KERNEL_BACKENDS = ("cpu", "cuda_emulated", "triton")
# Largest batch each backend is run at: the Triton interpreter and the CUDA emulator execute
# kernel code in Python / on fibers, and the GPU top-k does O(B^2 / P) work by design.
MAX_BATCH = {"cpu": 65536, "cuda_emulated": 16384, "triton": 16384, "torch": 65536}


def pytest_report_header(config):
    try:
        import triton
    except ImportError:
        return "triton: not installed"
    return f"triton {triton.__version__} ({os.path.dirname(triton.__file__)})"


def pytest_configure(config):
    """tools/test_triton_latest.sh sets LZE_EXPECT_TRITON: fail unless that Triton is the one
    imported (a PYTHONPATH mistake would otherwise test the venv's pinned Triton twice)."""
    expected = os.environ.get("LZE_EXPECT_TRITON")
    if not expected:
        return
    import triton

    if triton.__version__ != expected:
        raise pytest.UsageError(f"LZE_EXPECT_TRITON={expected}, but triton {triton.__version__} "
                                f"was imported from {os.path.dirname(triton.__file__)}")


def backend_param(name):
    """A pytest param for a kernel backend, skipped when it is not built/installed here."""
    backend = dispatch.BACKENDS[name]
    ok = backend.available() and dispatch.supports(backend, torch.device("cpu"))
    return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name} not available"),
                        id=name)


@pytest.fixture(scope="session")
def params():
    return KernelParams.from_config(LZEConfig())


def binary_rewards(batch, group, generator, p_correct=None):
    """Binary rewards whose per-row success probability is spread over [0, 1]."""
    if p_correct is None:
        p_correct = torch.rand(batch, 1, generator=generator)
    return (torch.rand(batch, group, generator=generator) < p_correct).float()


def ragged_valid(batch, group, generator):
    """A valid mask with a random number of valid rollouts per row (some rows empty)."""
    counts = torch.randint(0, group + 1, (batch, 1), generator=generator)
    return torch.arange(group)[None, :] < counts

"""The thread pool of the C++ CPU kernels (csrc/cpu/parallel.h), checked by csrc/cpu/pool_check.cpp:
concurrent jobs of every shape under ThreadSanitizer, and forked children that use the pool while
a parent thread keeps it busy (the children must neither hang nor lose tasks)."""

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
GXX = shutil.which("g++")
SOURCES = [str(CSRC / "cpu" / "pool_check.cpp"), str(CSRC / "cpu" / "parallel.cpp")]

RACE_RUNS = 10  # about 1 s each

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found")


def build(tmp_path: Path, *flags: str) -> Path:
    binary = tmp_path / "pool_check"
    subprocess.run([GXX, "-std=c++17", "-O1", "-g", "-pthread", f"-I{CSRC}", *flags, *SOURCES,
                    "-o", str(binary)], check=True, capture_output=True, text=True)
    return binary


def run(binary: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), mode], capture_output=True, text=True, timeout=300)


def test_concurrent_jobs_run_every_task_once_without_races(tmp_path):
    try:
        binary = build(tmp_path, "-fsanitize=thread")
    except subprocess.CalledProcessError as error:
        pytest.skip(f"g++ cannot build with ThreadSanitizer: {error.stderr[-500:]}")
    # Races show in some runs only: the index-past-the-end claim fixed in parallel.cpp (job_)
    # failed 10 runs in 60 before the fix, none in 160 after.
    for _ in range(RACE_RUNS):
        result = run(binary, "jobs")
        report = result.stdout + result.stderr
        assert "ThreadSanitizer" not in report, report
        assert result.returncode == 0, report


def test_forked_children_get_a_working_pool(tmp_path):
    result = run(build(tmp_path), "fork")
    assert result.returncode == 0, result.stdout + result.stderr

"""The CUDA emulator (csrc/emu/cuda_emu.h) enforces the rules a GPU and its driver enforce: each
rule is broken by a kernel of csrc/emu/rules_driver.cpp, run in a process of its own, and the
emulator answers as a GPU would (the driver's error code) or stops the process with its message
where a GPU would hang or compute garbage (a spin that cannot end, a kernel using more static
shared memory than it declares)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GXX = shutil.which("g++")

# case -> what the emulator reports: the driver's code (the case prints it, exit 0) or the
# emulator's message (the process stops).
RETURNS = {
    "dynamic_past_default": "error code 1",  # 8 KiB static + 40 KiB + 4 B dynamic, no opt-in
    "opt_in_limits_80": "sm_80: error code 1, error code 0, error code 0, error code 1",
    "opt_in_limits_86": "sm_86: error code 1, error code 0, error code 0, error code 1",
    "opt_in_limits_89": "sm_89: error code 1, error code 0, error code 0, error code 1",
    "opt_in_limits_90": "sm_90: error code 1, error code 0, error code 0, error code 1",
    "opt_in_per_device": "error code 1",
    "launch_bounds": "error code 701, error code 9",
    "uninitialised_shared": "count ",  # not 64: the counter started poisoned
    "block_order": "blocks read 0",
    "misaligned_vector": "error code 716, error code 716, then 2",  # sticky; later launches not run
    "asynchronous_host_write": "0 at launch, 5 after the sync, error code 1 for pageable memory",
    "event_order": "0 queued, 2 after B",
    "capture_rules": "error code 900, error code 901, replayed 4",
    "stream_of_another_device": "error code 400",
    "nan_bits": "0x7fffffff",
}
STOPS = {
    "undeclared_static_shared": "need 8 bytes or more, past the 4 it declares",
    "forward_progress": "2 resident blocks spins and 6 of the 8 blocks have not started",
    "spin_in_block": "a spin-wait inside a block",
}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not found")
    out = tmp_path_factory.mktemp("rules") / "rules_driver"
    subprocess.run([GXX, "-std=c++20", "-pthread", "-O0", "-ffp-contract=off", "-Wall",
                    "-Wextra", "-Werror", "-DLZE_CUDA_EMULATION", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "csrc" / "emu" / "rules_driver.cpp"), "-o", str(out)],
                   check=True)
    return out


def run_case(driver, case):
    return subprocess.run([str(driver), case], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", sorted(RETURNS))
def test_a_kernel_breaking_a_rule_gets_the_drivers_answer(driver, case):
    result = run_case(driver, case)
    assert result.returncode == 0 and "WRONG" not in result.stdout, result.stdout + result.stderr
    assert RETURNS[case] in result.stdout, result.stdout


@pytest.mark.parametrize("case", sorted(STOPS))
def test_a_kernel_that_would_hang_or_corrupt_a_gpu_stops_with_the_emulators_message(driver, case):
    result = run_case(driver, case)
    assert result.returncode != 0 and "ran to its end" not in result.stdout, result.stdout
    assert STOPS[case] in result.stderr, result.stderr


def test_a_correct_look_back_whose_blocks_are_slow_runs_to_its_end(driver):
    """Slow blocks are not stuck ones: a block that waited long and has seen its word change is on
    its way, even while it computes before its next atomic (as a worker the OS descheduled
    would). The watch of 05d6c1a, which counted how long threads had spun, stopped this process
    every time, and stopped the top-k's look-back (write_kernel) on a loaded machine."""
    result = run_case(driver, "slow_look_back")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 of 3 blocks published, error code 0" in result.stdout, result.stdout

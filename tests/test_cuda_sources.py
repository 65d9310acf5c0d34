"""The CUDA kernel sources (csrc/cuda/*.cu), checked without a GPU. (Their results, run on CPU
threads through the emulator, are compared with the reference by tests/test_backends.py as the
``cuda_emulated`` backend.)

* nvcc compiles them for sm_80, sm_86, sm_89 and sm_90 with warnings as errors and
  --fmad=false; ptxas resource usage goes to benchmarks/results/cuda_resources.json, register
  spills fail, and each kernel's static shared memory is what it declares to the emulator
  (LZE_KERNEL_RESOURCES), which checks launches and opt-ins against it;
* the emulator in OS-thread mode under ThreadSanitizer reports no race (tools/emu_tsan.sh).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SOURCES = ("lze_select", "lze_step", "lze_topk")
# Every __global__ function of the sources (the top-k has a one-block and a three-launch plan,
# plus prepare_kernel for a top-k alone; a checked selection step copies its undo records).
KERNELS = ("lze_step_kernel", "lze_step_tile_kernel", "small_topk_kernel", "prepare_kernel",
           "score_kernel", "refine_kernel", "write_kernel", "undo_kernel")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
RESOURCES_JSON = ROOT / "benchmarks" / "results" / "cuda_resources.json"
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")

# ----------------------------------------------------------------------------- nvcc


def ptxas_resources(output: str) -> dict:
    """Per-kernel registers, shared memory, stack and spill bytes from `ptxas -v` output."""
    kernels, name = {}, None
    for line in output.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
            kernels[name] = {"registers": 0, "smem_bytes": 0}
        elif name and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                      r"(\d+) bytes spill loads", line)):
            kernels[name].update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]),
                                 spill_load_bytes=int(m[3]))
        elif name and "Used" in line:
            if m := re.search(r"Used (\d+) registers", line):
                kernels[name]["registers"] = int(m[1])
            if m := re.search(r"(\d+) bytes smem", line):
                kernels[name]["smem_bytes"] = int(m[1])
    return kernels


def nvcc_command(unit: Path, arch: str, out_dir: Path) -> list[str]:
    return [NVCC, "-std=c++17", "--fmad=false", f"-arch={arch}", "-Werror", "all-warnings",
            "-Xptxas", "-v", f"-I{CSRC}", "-c", str(unit), "-o", str(out_dir / f"{arch}.o")]


@pytest.fixture(scope="module")
def cuda_resources(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    out_dir = tmp_path_factory.mktemp("nvcc")
    # The sources as one translation unit (as the emulator builds them), its headers parsed once;
    # both archs at once: nvcc is one process a core.
    unit = out_dir / "sources.cu"
    unit.write_text("".join(f'#include "cuda/{source}.cu"\n' for source in SOURCES))
    procs = {arch: subprocess.Popen(nvcc_command(unit, arch, out_dir), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for arch in ARCHS}
    usage = {}
    for arch, proc in procs.items():
        output = proc.communicate()[0]
        assert proc.returncode == 0, output
        usage[arch] = ptxas_resources(output)
    RESOURCES_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESOURCES_JSON.write_text(json.dumps(usage, indent=2, sort_keys=True) + "\n")
    return usage


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_without_spills(cuda_resources, arch):
    kernels = cuda_resources[arch]
    assert sorted(k for k in KERNELS if any(k in name for name in kernels)) == sorted(KERNELS)
    assert len(kernels) == len(KERNELS)
    for name, res in kernels.items():
        assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, (name, res)
        assert res["registers"] <= 64, (name, res)


def declared_resources() -> dict[str, tuple[str, int]]:
    """kernel -> (max threads, static shared bytes) as LZE_KERNEL_RESOURCES declares them."""
    declared = {}
    for source in sorted((CSRC / "cuda").glob("*.cu")):
        for m in re.finditer(r"LZE_KERNEL_RESOURCES\((\w+),\s*([\w:]+),\s*(\d+)\)",
                             source.read_text()):
            declared[m[1]] = (m[2], int(m[3]))
    return declared


@pytest.mark.parametrize("arch", ARCHS)
def test_each_kernel_declares_its_static_shared_memory_to_the_emulator(cuda_resources, arch):
    declared = declared_resources()
    assert sorted(declared) == sorted(KERNELS)
    for name, res in cuda_resources[arch].items():
        kernel = next(k for k in KERNELS if k in name)
        assert declared[kernel][1] == res["smem_bytes"], (arch, kernel, res)


# ----------------------------------------------------------------------------- ThreadSanitizer


def test_tsan_driver_reports_no_race(tmp_path):
    if GXX is None:
        pytest.skip("g++ not found")
    probe = tmp_path / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    if subprocess.run([GXX, "-fsanitize=thread", str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip("g++ cannot link ThreadSanitizer")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "emu_tsan.sh"), str(tmp_path)],
                          capture_output=True, text=True)
    report = proc.stdout + proc.stderr
    assert "ThreadSanitizer" not in report, report
    assert proc.returncode == 0, report
    assert "all checks passed" in proc.stdout

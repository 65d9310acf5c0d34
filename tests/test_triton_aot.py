"""Every Triton kernel variant compiles ahead of time to an sm_90 cubin without spills.

The interpreter (which the rest of the suite uses) cannot catch what only the real compiler
sees: ops it rejects, shared-memory limits, register spills. ``tools/triton_aot.py`` compiles
every ``LaunchConfig`` of ``lze_kernels.triton_kernels.aot_configs()`` in a subprocess with
``TRITON_INTERPRET`` unset, and writes the resource table to
``benchmarks/results/triton_resources_<triton version>.json`` (``make test`` runs this file under
the pinned Triton and, through ``tools/test_triton_latest.sh``, the newest one). One subprocess
compiles both passes (every config for both archs, and the scalars-as-one pass), once per run;
its compiles and ptxas reports are cached in Triton's cache directory. sm_90 is the GPU the
project targets (the H100); a cold cache compiles its variants in some 45 CPU seconds, and
``python tools/triton_aot.py --arch 80 90`` adds sm_80 (as many again) when an A100 matters.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ROOT / "benchmarks" / "results" / f"triton_resources_{triton.__version__}.json"
ARCHS = ("sm_90",)
# Every architecture users run allows 48 KiB of shared memory a block without the opt-in (and 99 KB
# on sm_86/sm_89, 163 KB on sm_80, 227 KB on sm_90 with it): the kernels stay within the 48 KiB.
MAX_SHARED_BYTES = 48 * 1024


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "triton_aot.py"), "--arch", "90",
         "--with-scalars-as-one", "--output", str(RESOURCES)],
        env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    document = json.loads(run.stdout)
    # The subprocess imports triton from the same path (PYTHONPATH is inherited).
    assert document["triton"] == triton.__version__
    return document


@pytest.fixture(scope="module")
def compiled(report):
    return report["kernels"]


def _config_names():
    # Importing the kernels only defines them; safe under the interpreter too.
    from lze_kernels.triton_kernels import aot_configs

    return sorted(config.name for config in aot_configs())


def test_every_config_compiles_for_every_arch(compiled):
    built = {(kernel["name"], kernel["arch"]) for kernel in compiled}
    expected = {(name, arch) for name in _config_names() for arch in ARCHS}
    assert built == expected


def test_no_register_spills(compiled):
    spilling = [k for k in compiled if k["spill_stores"] or k["spill_loads"]]
    assert not spilling, json.dumps(spilling, indent=1)


def test_resources_within_limits(compiled):
    for kernel in compiled:
        assert kernel["registers"] <= 255, kernel
        assert kernel["shared_bytes"] <= MAX_SHARED_BYTES, kernel


def test_resource_table_written(compiled):
    assert json.loads(RESOURCES.read_text())["kernels"] == compiled


def test_every_gpu_launch_shape_is_compiled_ahead_of_time(monkeypatch):
    """What the wrappers launch on a GPU (tile shapes for every G, the top-k blocks) is one of
    the variants compiled above, so no launch meets the real compiler for the first time."""
    from lze_kernels.triton_kernels import aot_configs

    # The modules, not the functions of the same names the package exports.
    step = importlib.import_module("lze_kernels.triton_kernels.step")
    topk = importlib.import_module("lze_kernels.triton_kernels.topk")

    compiled = {(c.fn, tuple(sorted((k, v) for k, v in c.constexprs.items() if k.isupper())))
                for c in aot_configs()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the wrappers' GPU launch shapes
    for group in range(1, step.MAX_GROUP_SIZE + 1):
        rows, block_g = step.tile_shape(num_rows=65536, group_size=group)
        key = (step._lze_step_kernel, (("BLOCK_G", block_g), ("BLOCK_ROWS", rows)))
        assert key in compiled, group
    dots = importlib.import_module("lze_kernels.triton_kernels.dots")
    for dims in (1, 17, 384, 4096):
        block_n, block_k, block_d = dots.block_shape(100_000, 256, dims)
        for dtype in dots._POINTER_TYPES:
            key = (dots._dots_predict_kernel,
                   (("BLOCK_D", block_d), ("BLOCK_K", block_k), ("BLOCK_N", block_n),
                    ("DOT_PRECISION", dots._DOT_PRECISION[dtype]), ("UPCAST", False)))
            assert key in compiled, (dims, dtype)
    grid = (("MAX_PROGRAMS", topk.MAX_PROGRAMS), ("TILE", topk.tile_rows()))
    for noise in (False, True):
        for batch in (1, 1024, 1025, topk.SMALL_MAX_ROWS):
            key = (topk._small_topk_kernel,
                   (("BLOCK", topk.small_block(batch)), ("HAS_NOISE", noise)))
            assert key in compiled, (batch, noise)
        assert (topk._prepare_kernel, (("HAS_NOISE", noise), grid[1])) in compiled
        assert (topk._score_kernel, (("HAS_NOISE", noise), *grid)) in compiled
    for key in [(topk._refine_kernel, (grid[0], ("PASS", 1), grid[1])),
                (topk._refine_kernel, (grid[0], ("PASS", 2), grid[1])),
                (topk._count_kernel, grid), (topk._write_kernel, grid)]:
        assert key in compiled, key


def test_every_kernel_compiles_with_its_integer_arguments_equal_to_one(report):
    """The JIT compiles an integer argument equal to 1 as the constant 1 (a Python int in the
    kernel), unless the kernel lists it in ``do_not_specialize``. The top-k kernel's
    ``seed.to(tl.int64)`` failed so on the first GPU run (Triton 3.6, seed 1), which neither the
    interpreter nor the compile above (``i32`` arguments) could see."""
    kernels = {kernel["name"].split("[")[0] for kernel in report["scalars_as_one"]}
    assert {kernel["arch"] for kernel in report["scalars_as_one"]} == {"sm_90"}
    assert kernels == {name.split("[")[0] for name in _config_names()}

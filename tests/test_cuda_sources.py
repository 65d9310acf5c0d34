"""The CUDA kernel sources (csrc/cuda/*.cu), checked without a GPU:

* nvcc compiles both for sm_80 and sm_90 with warnings as errors and --fmad=false; ptxas
  resource usage goes to benchmarks/results/cuda_resources.json and register spills fail;
* the sources built with g++ against the CPU emulator (a private ctypes build, independent of
  the packaged extension) match the PyTorch reference, on single- and multi-block launches;
* the emulator in OS-thread mode under ThreadSanitizer reports no race (tools/emu_tsan.sh).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lze_kernels import layout as L
from lze_kernels import reference as R
from lze_kernels.layout import KernelParams, SelectorState

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SOURCES = ("lze_step", "lze_topk")
ARCHS = ("sm_80", "sm_90")
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


def nvcc_compile(source: str, arch: str, out_dir: Path) -> dict:
    cmd = [NVCC, "-std=c++17", "--fmad=false", f"-arch={arch}", "-Werror", "all-warnings",
           "-Xptxas", "-v", f"-I{CSRC}", "-c", str(CSRC / "cuda" / f"{source}.cu"),
           "-o", str(out_dir / f"{source}.{arch}.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ptxas_resources(proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def cuda_resources(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    out_dir = tmp_path_factory.mktemp("nvcc")
    usage = {arch: {} for arch in ARCHS}
    for arch in ARCHS:
        for source in SOURCES:
            usage[arch].update(nvcc_compile(source, arch, out_dir))
    RESOURCES_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESOURCES_JSON.write_text(json.dumps(usage, indent=2, sort_keys=True) + "\n")
    return usage


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_without_spills(cuda_resources, arch):
    kernels = cuda_resources[arch]
    assert len(kernels) == len(SOURCES)
    for name, res in kernels.items():
        assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, (name, res)
        assert res["registers"] <= 64, (name, res)


# ----------------------------------------------------------------------------- emulated build


class CParams(ctypes.Structure):
    _fields_ = [("beta", ctypes.c_float), ("one_minus_beta", ctypes.c_float),
                ("d_min", ctypes.c_float), ("alpha", ctypes.c_float), ("eps", ctypes.c_float),
                ("norm_by_std", ctypes.c_int32), ("prune_after", ctypes.c_int32)]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """The emulated kernels as a ctypes library. LZE_EMU_BUILD_DIR and LZE_EMU_CXXFLAGS (e.g.
    ``--coverage``) let tools/emu_gcov.sh build an instrumented copy in a known place."""
    if GXX is None:
        pytest.skip("g++ not found")
    build_dir = os.environ.get("LZE_EMU_BUILD_DIR")
    build_dir = Path(build_dir) if build_dir else tmp_path_factory.mktemp("emu")
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / "emu_kernels.so"
    cmd = [GXX, "-std=c++20", "-pthread", "-O2", "-ffp-contract=off", "-fPIC", "-shared",
           "-Wall", "-Wextra", "-Werror", "-DLZE_CUDA_EMULATION", f"-I{CSRC}",
           *shlex.split(os.environ.get("LZE_EMU_CXXFLAGS", "")),
           str(CSRC / "emu" / "emu_kernels.cpp"), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib))


def ptr(t: torch.Tensor | None):
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def emu_step(lib, rewards, valid, prompt_ids, state: SelectorState, p: KernelParams):
    B, G = rewards.shape
    out = R.StepStats(*(torch.full(s, float("nan")) for s in ((B, G), (B,), (B,), (B,))))
    valid_u8 = valid.to(torch.uint8).contiguous() if valid is not None else None
    c_params = CParams(p.beta, p.one_minus_beta, p.d_min, p.alpha, p.eps, int(p.norm_by_std),
                       p.prune_after)
    rc = lib.lze_step_cuda(
        ptr(rewards), ctypes.c_int32(L.REWARD_DTYPE_CODES[rewards.dtype]), ptr(valid_u8),
        ptr(prompt_ids), ctypes.c_int64(B), ctypes.c_int64(G), ctypes.c_int64(state.num_prompts),
        ptr(state.fstate), ptr(state.istate), ptr(state.step_counter), ptr(out.advantages),
        ptr(out.pass_rate), ptr(out.energy), ptr(out.momentum), ptr(state.fault), c_params,
        ctypes.c_void_p(0))
    assert rc == 0
    return out


def emu_topk(lib, energy, k, noise_scale, seed, step_counter):
    B = energy.shape[0]
    keep = torch.full((B,), 7, dtype=torch.uint8)
    kept = torch.full((k,), -7, dtype=torch.int64)
    num = torch.full((1,), -7, dtype=torch.int64)
    rc = lib.lze_topk_cuda(ptr(energy), ctypes.c_int64(B), ctypes.c_int64(k),
                           ctypes.c_float(noise_scale), ctypes.c_uint32(seed), ptr(step_counter),
                           ptr(keep), ptr(kept), ptr(num), ctypes.c_void_p(0))
    assert rc == 0
    return R.Selection(keep.bool(), kept, num[0])


def clone_state(s: SelectorState) -> SelectorState:
    return SelectorState(s.fstate.clone(), s.istate.clone(), s.step_counter.clone(),
                         s.fault.clone())


def assert_same_state(got: SelectorState, want: SelectorState, rows=slice(None, -1)):
    # Row N is the reference's write sink; the kernels never touch it.
    assert torch.equal(got.fstate[rows], want.fstate[rows])
    assert torch.equal(got.istate[rows], want.istate[rows])
    assert torch.equal(got.step_counter, want.step_counter)


def run_both(lib, rewards, valid, ids, state, params):
    ours = clone_state(state)
    got = emu_step(lib, rewards, valid, ids, ours, params)
    want = R.lze_step(rewards, valid, ids, state, params)
    return got, want, ours


def assert_step_outputs(got, want):
    for name in ("pass_rate", "energy", "momentum"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.advantages, want.advantages, rtol=1e-6, atol=1e-6)


# Segment widths 1..32 (several rows per warp), one warp per row (G > 32), and grids of one and
# of many blocks (256 threads: 8 * 32 / W rows per block).
STEP_SHAPES = [(1, 1), (5, 3), (37, 8), (300, 16), (129, 5), (64, 32), (40, 33), (9, 100)]


@pytest.mark.parametrize("B,G", STEP_SHAPES)
@pytest.mark.parametrize("ragged", [False, True])
def test_emulated_step_matches_reference_over_steps(emu, params, B, G, ragged):
    gen = torch.Generator().manual_seed(B * 1000 + G)
    num_prompts = 2 * B + 3
    state = SelectorState.empty(num_prompts, "cpu")
    for step in range(4):  # first sight, momentum, solved streaks and pruning
        p_correct = torch.rand(B, 1, generator=gen)
        p_correct[: B // 4] = 1.0
        rewards = (torch.rand(B, G, generator=gen) < p_correct).float()
        counts = torch.randint(0, G + 1, (B, 1), generator=gen)
        valid = torch.arange(G)[None, :] < counts if ragged else None
        ids = torch.randperm(num_prompts, generator=gen)[:B] if step % 2 else torch.arange(B)
        got, want, ours = run_both(emu, rewards, valid, ids, state, params)
        assert_step_outputs(got, want)
        assert_same_state(ours, state)
        assert ours.fault.item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_step_half_rewards_and_dr_grpo(emu, params, dtype):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(50, 12, generator=gen).to(dtype)
    state = SelectorState.empty(60, "cpu")
    dr_grpo = KernelParams(**{**params.__dict__, "norm_by_std": False})
    for p in (params, dr_grpo):
        got, want, ours = run_both(emu, rewards, None, torch.arange(50), state, p)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.fstate, state.fstate, rtol=1e-6, atol=1e-6)
        assert torch.equal(ours.istate, state.istate)


def test_emulated_step_faults_skip_rows(emu, params):
    B, G = 40, 8
    rewards = (torch.arange(B * G).reshape(B, G) % 3 == 0).float()
    rewards[3, 2], rewards[4, 0], rewards[5, 7] = float("nan"), 1.5, float("-inf")
    valid = torch.ones(B, G, dtype=torch.bool)
    valid[6, 1] = False
    rewards[6, 1] = float("nan")  # an invalid NaN is no fault
    ids = torch.arange(B)
    ids[7], ids[8] = -1, 1000
    state = SelectorState.empty(50, "cpu")
    got, want, ours = run_both(emu, rewards, valid, ids, state, params)
    assert_step_outputs(got, want)
    assert_same_state(ours, state)
    assert ours.fault.item() == state.fault.item() == (
        L.FAULT_ID_OUT_OF_RANGE | L.FAULT_NONFINITE_REWARD | L.FAULT_REWARD_OUT_OF_RANGE)


def test_emulated_step_duplicate_ids(emu, params):
    """One of the rows sharing an id updates the prompt (the reference keeps the first, the
    kernel the first to claim); the others are skipped with the duplicate fault bit."""
    B, G = 64, 4
    rewards = (torch.arange(B * G).reshape(B, G) % 5 < 2).float()
    ids = torch.arange(B)
    ids[40:44] = 9  # rows 9, 40..43 share prompt 9
    state = SelectorState.empty(B, "cpu")
    got, want, ours = run_both(emu, rewards, None, ids, state, params)
    sharing = torch.tensor([9, 40, 41, 42, 43])
    others = torch.ones(B, dtype=torch.bool)
    others[sharing] = False
    for name in ("pass_rate", "energy", "momentum", "advantages"):
        assert torch.equal(getattr(got, name)[others], getattr(want, name)[others]), name
    winners = (got.pass_rate[sharing] != 0).nonzero().flatten()
    assert len(winners) == 1
    assert ours.fault.item() == L.FAULT_DUPLICATE_ID == state.fault.item()
    assert_same_state(ours, state, rows=others.nonzero().flatten())


def test_emulated_step_empty_batch_advances_counter(emu, params):
    state = SelectorState.empty(4, "cpu")
    got, want, ours = run_both(emu, torch.zeros(0, 8), None, torch.zeros(0, dtype=torch.int64),
                               state, params)
    assert_same_state(ours, state)
    assert ours.step_counter.tolist() == [1, 0]


# Top-k: 128 threads per block, so B <= 128 is one block and larger B many blocks.
TOPK_SIZES = [1, 7, 100, 128, 129, 1000, 4099]


@pytest.mark.parametrize("B", TOPK_SIZES)
@pytest.mark.parametrize("noise_scale", [0.0, 0.05])
def test_emulated_topk_matches_reference(emu, B, noise_scale):
    gen = torch.Generator().manual_seed(B)
    # Few distinct energies (ties), a third of the rows non-candidates.
    energy = torch.randint(0, 6, (B,), generator=gen).float() / 8
    energy[torch.rand(B, generator=gen) < 0.1] = -0.0
    step = torch.tensor([B % 5, 0], dtype=torch.int64)
    for k in sorted({1, max(1, int(B * 0.4)), B}):
        got = emu_topk(emu, energy, k, noise_scale, 1234, step)
        want = R.topk_select(energy, k, noise_scale, 1234, step=step[0])
        for name in ("keep_mask", "kept_indices", "num_kept"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, k)


def test_emulated_topk_no_candidates(emu):
    got = emu_topk(emu, torch.zeros(300), 120, 0.05, 0, torch.zeros(2, dtype=torch.int64))
    assert not got.keep_mask.any() and (got.kept_indices == -1).all() and got.num_kept == 0


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

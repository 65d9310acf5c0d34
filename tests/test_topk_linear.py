"""The linear-work top-k (csrc/cuda/lze_topk.cu, lze_kernels/triton_kernels/topk.py,
csrc/cpu/topk_cpu.cpp) against the reference at every size, and its work counted.

* Selections equal ``reference.topk_select`` bit for bit on every backend that runs here, from
  one row to B = 1,048,576, through both launch plans of the GPU kernels (CUDA: one block up to
  16,384 rows, three launches above; Triton: one program up to 4,096 rows, the grid plan above),
  with exact ties that straddle
  the blocks' tiles, noise, and quotas from 1 to B.
* The work is linear in B, counted, not timed: the CUDA kernels under the emulator count their
  reads of per-row input (LZE_COUNT_ROW_READS) and the Triton interpreter its loaded elements;
  4x the rows is exactly (CUDA) or at most 1 % over (Triton) 4x the reads, a fixed number of
  passes over the rows. The old rank-by-counting kernel read B^2 / 128 keys.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import KERNEL_BACKENDS, backend_param
from lze_kernels import dispatch, native, ops, reference

BACKENDS = [backend_param(name) for name in KERNEL_BACKENDS]
triton_topk = importlib.import_module("lze_kernels.triton_kernels.topk")


def energies(batch: int, seed: int, distinct: int | None = None) -> torch.Tensor:
    """A third zero (never kept); the rest uniform, or ``distinct`` values (exact ties)."""
    gen = torch.Generator().manual_seed(seed)
    if distinct is None:
        energy = torch.rand(batch, generator=gen)
    else:
        energy = (torch.randint(1, distinct + 1, (batch,), generator=gen).float() / distinct)
    return torch.where(torch.rand(batch, generator=gen) < 1 / 3, 0.0, energy)


def assert_same_selection(backend_name, energy, k, noise_scale, seed=11, step=6, want=None):
    """The backend's selection equals the reference's (``want``, when computed already)."""
    counter = torch.tensor([step, 0])
    got = dispatch.BACKENDS[backend_name].topk(energy, k, noise_scale, seed, counter)
    if want is None:
        want = reference.topk_select(energy, k, noise_scale, seed, counter[0])
    assert torch.equal(got.keep_mask, want.keep_mask)
    assert torch.equal(got.kept_indices, want.kept_indices)
    assert got.num_kept.shape == () and int(got.num_kept) == int(want.num_kept)


@functools.lru_cache(maxsize=None)
def reference_case(batch: int, seed: int, distinct, k: int, noise_scale: float):
    """(energies, the reference's selection) of a case every backend is checked on: the oracle
    (Philox and two float64 logs a row in torch ops) runs once, not once a backend."""
    energy = energies(batch, seed, distinct)
    return energy, reference.topk_select(energy, k, noise_scale, 11, torch.tensor(6))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("noise_scale", [0.0, 0.05])
def test_a_million_rows_select_what_the_reference_selects(backend_name, noise_scale):
    k = int(0.4 * (1 << 20))
    energy, want = reference_case(1 << 20, 1, None if noise_scale else 64, k, noise_scale)
    assert_same_selection(backend_name, energy, k, noise_scale, want=want)


# Batches around the plans' limits (CUDA: one block to 16,384 rows; Triton: one program to
# 4,096) and over several tiles of the multi-launch plans (16,384 rows per CUDA block, 65,536
# per interpreted Triton program), each with a ragged last tile; four distinct energies make the
# k-th best tied with rows in many tiles.
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("batch", [4096, 4097, 16384, 16385, 3 * 16384 + 17, 2 * 65536 + 999])
def test_ties_across_tiles_go_to_the_smaller_rows(backend_name, batch):
    candidates = int((energies(batch, seed=batch, distinct=4) > 0).sum())
    for k in (1, batch // 5, candidates - 1, candidates, batch):
        energy, want = reference_case(batch, batch, 4, k, 0.0)
        assert_same_selection(backend_name, energy, k, 0.0, want=want)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_property_any_batch_quota_and_noise(backend_name, data):
    batch = data.draw(st.one_of(st.integers(1, 300), st.integers(8000, 20000)), label="batch")
    distinct = data.draw(st.sampled_from([None, 1, 3, 1000]), label="distinct")
    energy = energies(batch, data.draw(st.integers(0, 2**31)), distinct)
    k = data.draw(st.integers(1, batch), label="k")
    noise_scale = data.draw(st.sampled_from([0.0, 0.05, 3.0]), label="noise_scale")
    assert_same_selection(backend_name, energy, k, noise_scale,
                          seed=data.draw(st.integers(0, 2**32 - 1)), step=data.draw(
                              st.integers(0, 2**40)))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sorted_gives_descending_scores(backend_name):
    energy = energies(20000, seed=3)
    counter = torch.tensor([2, 0])
    got = ops.topk_mask(energy, 8000, 0.05, 4, counter, backend=backend_name, sorted=True)
    want = reference.topk_select(energy, 8000, 0.05, 4, counter[0])
    score = reference.selection_scores(energy, 0.05, 4, counter[0])
    expected = torch.sort(score, descending=True, stable=True).indices[:int(want.num_kept)]
    assert torch.equal(got.kept_indices[:int(want.num_kept)], expected)
    assert torch.equal(got.keep_mask, want.keep_mask)


# ----------------------------------------------------------------------------- work counts


def cuda_row_reads(batch: int, noise_scale: float) -> int:
    """Per-row input reads of one emulated CUDA top-k of ``batch`` rows."""
    module = native.CUDA_EMULATED.module
    energy = energies(batch, seed=batch)
    module.row_reads()  # reset
    native.CUDA_EMULATED.topk(energy, int(0.4 * batch), noise_scale, 0, torch.zeros(2).long())
    return module.row_reads()


@pytest.mark.parametrize("backend_name", [backend_param("cuda_emulated")])
@pytest.mark.parametrize("noise_scale", [0.0, 0.05])
def test_cuda_topk_reads_each_row_a_fixed_number_of_times(backend_name, noise_scale):
    # A top-k alone (ops.topk_mask): the energies (twice with noise: their extent first), then
    # the scores twice (refinement) and twice in the write (its count, then its rows), in one
    # block up to 16,384 rows; above, prepare + three launches read the same.
    passes = 5 if noise_scale else 4
    for batch in (8192, 16384, 16385, 65536, 262144):
        assert cuda_row_reads(batch, noise_scale) == passes * batch, batch


@contextlib.contextmanager
def counting_interpreter_loads():
    """Counts the elements every interpreted ``tl.load`` reads (its mask's true entries)."""
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    original = builder.create_masked_load
    count = [0]

    def counted(self, ptrs, mask, *args):
        count[0] += int(mask.data.sum())
        return original(self, ptrs, mask, *args)

    builder.create_masked_load = counted
    try:
        yield count
    finally:
        builder.create_masked_load = original


def triton_loads(batch: int) -> int:
    energy = energies(batch, seed=batch)
    with counting_interpreter_loads() as count:
        triton_topk.topk(energy, int(0.4 * batch), 0.05, 0, torch.zeros(2).long())
    return count[0]


@pytest.mark.parametrize("backend_name", [backend_param("triton")])
def test_triton_topk_loads_grow_linearly(backend_name):
    """Besides the rows, each launch loads a fixed few words (cutoff, slots) per program and the
    last program its histogram: 4x the rows is 4x the loads within 1 %, some 6 per row, in the
    one-program plan (to 65,536 rows) and in the six-launch plan."""
    for small, large in ((1 << 14, 1 << 16), (1 << 17, 1 << 19)):  # one program; six launches
        loads = {batch: triton_loads(batch) for batch in (small, large)}
        assert loads[large] <= 4.04 * loads[small]
        assert loads[large] <= 6.5 * large

"""The CUDA selection's launch plans under the limits of every architecture users run (sm_80
A100, sm_86 A10/A40/RTX 3090, sm_89 L4/L40S/RTX 4090, sm_90 H100/H200), in the emulator, which
enforces each device's shared memory a block (with and without the opt-in), its SM count and
the kernels' launch bounds (csrc/emu/). Selections are bit-identical to the reference at every
plan boundary: the opt-in's (10,140 / 10,141 rows: 8,592 B of static shared memory plus 4 B a
row pass 48 KiB; 12,288 / 12,289: 48 KiB of rows alone), the one-block plan's (16,384 /
16,385), a last tile of one row, and a million rows; with blocks in reverse and random order.
The plans' shapes: one block an SM at a million rows, two 16-bit digits where 128 KiB of
counters fit a block and three of 11, 11 and 10 bits where they do not, and the launches and
blocks on both sides of 16,384 rows."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import binary_rewards
from lze_kernels import LZEConfig, LZESelector, available_backends, dispatch, emulated, reference

pytestmark = pytest.mark.skipif("cuda_emulated" not in available_backends("cpu"),
                                reason="the emulated CUDA module is not built")
ARCHS = emulated.ARCHITECTURES
SMS = {80: 108, 86: 84, 89: 142, 90: 132}
PASSES = {80: 2, 86: 3, 89: 3, 90: 2}  # 128 KiB of counters + static: fits 163 / 227 KB, not 99
# 4,096-row tiles (one strip of 1,024 threads) above 16,384 rows: 20,481 leaves a last tile of
# one row.
BOUNDARIES = (10140, 10141, 12288, 12289, 16384, 16385, 20481)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_gets_plans_sized_from_its_limits(arch):
    module = emulated.module()
    with emulated.architectures(arch):
        status, shape = module.device_shape(0)
        assert status == 0
        assert (shape.sms, shape.one_block_max_rows, shape.passes) == (SMS[arch], 16384,
                                                                         PASSES[arch])
        one = module.plan_topk(16384, 0)[1]
        assert (one.one_block, one.blocks, one.shared_bytes, one.launches) == (1, 1, 65536, 1)
        above = module.plan_topk(16385, 0)[1]
        assert (above.one_block, above.blocks, above.tile_rows) == (0, 5, 4096)
        assert above.launches == PASSES[arch] + 1
        assert above.shared_bytes == (131072 if PASSES[arch] == 2 else 4096)
        million = module.plan_topk(1 << 20, 0)[1]
        assert million.blocks == SMS[arch]  # one block an SM
        assert million.tile_rows < 65536 and million.tile_rows % 4 == 0
        assert module.plan_topk(1 << 24, 0)[1].tile_rows == 61440  # below 65,536: no carry


def step_pair(batch, noise_scale):
    config = LZEConfig(keep_ratio=0.4, noise_scale=noise_scale, seed=5)
    return (LZESelector(2 * batch, config, backend="cuda_emulated"),
            LZESelector(2 * batch, config, backend="torch"))


def assert_steps_agree(batch, noise_scale, group=2):
    """Two selection steps over the same prompts (the second with history): selections, energies
    and the state bit-identical to the reference's."""
    sel, ref = step_pair(batch, noise_scale)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randperm(2 * batch, generator=gen)[:batch]
    for _ in range(2):
        rewards = binary_rewards(batch, group, gen)
        got, want = sel.step(rewards, ids, check_inputs=False), ref.step(rewards, ids)
        for field in ("energy", "keep_mask", "kept_indices", "num_kept"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (batch, field)
    assert torch.equal(sel.state.records[:-1], ref.state.records[:-1]), batch


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("noise_scale", [0.0, 0.05])
def test_a_step_at_every_plan_boundary_selects_what_the_reference_selects(arch, noise_scale):
    with emulated.architectures(arch):
        for batch in BOUNDARIES:
            assert_steps_agree(batch, noise_scale)


@pytest.mark.parametrize("order, seed", [("reverse", 0), ("random", 1), ("random", 2)])
def test_blocks_in_any_order_and_few_resident_select_the_same(order, seed):
    """The large plan's tickets and look-back wait only on blocks that started: blocks started
    in reverse or random order, two resident at once, give the same selection."""
    with emulated.architectures(86), emulated.block_order(order, seed, workers=2):
        assert_steps_agree(20481, 0.05)


@functools.lru_cache(maxsize=None)
def million_case(noise_scale: float):
    batch = 1 << 20
    gen = torch.Generator().manual_seed(3)
    energy = torch.randint(1, 65, (batch,), generator=gen).float() / 64  # many exact ties
    energy = torch.where(torch.rand(batch, generator=gen) < 1 / 3, 0.0, energy)
    k = int(0.4 * batch)
    return energy, k, reference.topk_select(energy, k, noise_scale, 11, torch.tensor(6))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_million_rows_select_what_the_reference_selects_on_every_architecture(arch):
    energy, k, want = million_case(0.05)
    with emulated.architectures(arch):
        got = dispatch.BACKENDS["cuda_emulated"].topk(energy, k, 0.05, 11,
                                                      torch.tensor([6, 0]))
    assert torch.equal(got.keep_mask, want.keep_mask)
    assert torch.equal(got.kept_indices, want.kept_indices)
    assert int(got.num_kept) == int(want.num_kept)


@pytest.mark.parametrize("arch", ARCHS)
def test_launches_and_blocks_on_both_sides_of_the_one_block_limit(arch):
    """At 16,384 rows: the step kernel (64 blocks of 256 rows) and one top-k block; at 16,385: the
    step kernel (65 blocks) and a histogram launch a digit plus the write, five blocks each (tiles
    of 4,096 rows): the top-k's work spread over five SMs instead of one more launch's cost on
    one (benchmarks time both sides on a GPU: tools/gpu_check.py)."""
    module = emulated.module()
    with emulated.architectures(arch):
        counts = {}
        for batch in (16384, 16385):
            sel, _ = step_pair(batch, 0.05)
            gen = torch.Generator().manual_seed(0)
            ids = torch.randperm(2 * batch, generator=gen)[:batch]
            rewards = binary_rewards(batch, 2, gen)
            module.launches(), module.blocks()
            sel.step(rewards, ids, check_inputs=False)
            counts[batch] = (module.launches(), module.blocks())
    top_k_launches = PASSES[arch] + 1
    assert counts == {16384: (2, 64 + 1), 16385: (1 + top_k_launches, 65 + 5 * top_k_launches)}

"""The Python-loop baseline computes what the selector computes, so timing it is a fair comparison.

Several steps over a small table, so that prompts come back (EMA, momentum, solved streaks,
pruning) and the noisy top-k is exercised; compared against the torch reference backend.
"""

import pytest
import torch
from baselines import PythonLoopSelector

from lze_kernels import LZEConfig, LZESelector
from lze_kernels import layout as L

NUM_PROMPTS, BATCH, STEPS = 96, 48, 6


def _rounds(group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        # Every third row always right, so that some prompts are solved twice and get pruned.
        p_correct = torch.rand(BATCH, 1, generator=g)
        p_correct[::3] = 1.0
        rewards = (torch.rand(BATCH, group, generator=g) < p_correct).float()
        yield rewards, torch.randperm(NUM_PROMPTS, generator=g)[:BATCH]


def _assert_same_step(ours, ref):
    torch.testing.assert_close(ours.advantages, ref.advantages, rtol=1e-5, atol=1e-6)
    assert ours.pass_rate == ref.pass_rate.tolist()
    torch.testing.assert_close(torch.tensor(ours.energy, dtype=torch.float32), ref.energy)
    torch.testing.assert_close(torch.tensor(ours.momentum, dtype=torch.float32), ref.momentum)
    assert ours.kept_indices == ref.kept_indices.tolist()
    assert torch.equal(ours.keep_mask, ref.keep_mask)
    assert ours.num_kept == int(ref.num_kept)


def _assert_same_state(ours: PythonLoopSelector, ref: LZESelector):
    ids = sorted(ours.state)
    fstate, istate = ref.state.fstate[ids], ref.state.istate[ids]
    rows = [ours.state[i] for i in ids]
    torch.testing.assert_close(torch.tensor([s.d_init for s in rows]), fstate[:, L.D_INIT])
    torch.testing.assert_close(torch.tensor([s.ema for s in rows]), fstate[:, L.EMA])
    assert [s.seen for s in rows] == istate[:, L.SEEN].tolist()
    assert [s.solved_streak for s in rows] == istate[:, L.SOLVED_STREAK].tolist()
    assert [s.pruned for s in rows] == ((istate[:, L.FLAGS] & L.FLAG_PRUNED) != 0).tolist()


@pytest.mark.parametrize("group, noise_scale", [(8, 0.05), (8, 0.0), (5, 0.05), (1, 0.0)])
def test_python_loop_matches_reference(group, noise_scale):
    config = LZEConfig(noise_scale=noise_scale)
    ours = PythonLoopSelector(config)
    ref = LZESelector(NUM_PROMPTS, config=config, backend="torch")
    for rewards, ids in _rounds(group, seed=group):
        _assert_same_step(ours.step(rewards, ids), ref.step(rewards, ids))
    _assert_same_state(ours, ref)
    assert any(s.pruned for s in ours.state.values())


@pytest.mark.parametrize("ragged", [False, True])
def test_lean_step_computes_what_the_selector_computes(ragged):
    """The lean baseline (torch_baselines.LeanTorchStep) does the step's work: without noise its
    advantages, pass rates, energies and momenta are the selector's over several steps of
    returning prompts, and it keeps k rows of the largest energies (ties in any order)."""
    from torch_baselines import LeanTorchStep

    config = LZEConfig(noise_scale=0.0)
    lean, ref = LeanTorchStep(NUM_PROMPTS, config), LZESelector(NUM_PROMPTS, config,
                                                                backend="torch")
    gen = torch.Generator().manual_seed(5)
    for rewards, ids in _rounds(8, seed=5):
        valid = (torch.arange(8)[None] < torch.randint(2, 9, (BATCH, 1), generator=gen)
                 if ragged else None)
        advantages, pass_rate, energy, momentum, kept = lean.step(rewards, ids, valid)
        want = ref.step(rewards, ids, valid)
        masked = advantages if valid is None else torch.where(valid, advantages, 0.0)
        torch.testing.assert_close(masked, want.advantages, rtol=1e-5, atol=1e-6)
        for got, name in ((pass_rate, "pass_rate"), (energy, "energy"), (momentum, "momentum")):
            torch.testing.assert_close(got, getattr(want, name), rtol=0, atol=0)
        top = torch.sort(energy, descending=True).values[:kept.numel()]
        assert torch.equal(torch.sort(energy[kept], descending=True).values, top)

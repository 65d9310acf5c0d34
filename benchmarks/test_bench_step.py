"""One full LZE selection step, per (B, G) and per variant (what is compared: docs/benchmarks.md).

The unit timed is ``LZESelector.step(rewards, prompt_ids, check_inputs=False)``: the fused
statistics/energy/state update and the noisy top-k, on a persistent selector of N = 4 B prompts,
against what a user would run instead: the same step in plain vectorised PyTorch
(torch_baselines.PlainTorchSelector), eager and under ``torch.compile``, and the host-side loop of
today's trainers (baselines.PythonLoopSelector). The reference backend is the correctness oracle,
not a speed anchor: it is not timed. Inputs and timing: bench_common.py.
"""

from __future__ import annotations

import pytest
import torch
from baselines import PythonLoopSelector
from bench_common import BATCHES, GROUPS, RoundInputs, run_benchmark, unchecked
from torch_baselines import PlainTorchSelector

from lze_kernels import LZEConfig, LZESelector

VARIANTS = ("fused", "torch_plain", "torch_plain_compile", "python_loop", "floor")
# The Python loop costs ~25 us per sequence; 2^18 sequences keeps B=16384, G=16 (a target).
LOOP_MAX_SEQUENCES = 2**18
STATE_ROW_BYTES = 32  # fstate + istate row of one prompt (lze_kernels.layout)


def _cases():
    for batch in BATCHES:
        for group in GROUPS:
            for variant in VARIANTS:
                too_slow = variant == "python_loop" and batch * group > LOOP_MAX_SEQUENCES
                marks = pytest.mark.skip(reason=f"python_loop capped at B*G <= "
                                                f"{LOOP_MAX_SEQUENCES}") if too_slow else ()
                yield pytest.param(batch, group, variant, marks=marks,
                                   id=f"B{batch}-G{group}-{variant}")


def _fused_step(num_prompts, device):
    selector = LZESelector(num_prompts, device=device)
    return unchecked(selector.step), selector.backend


def _plain_compiled_step(num_prompts, device):
    """torch.compile of the plain PyTorch step, static shapes: one graph per (B, G), as a user
    compiling a fixed batch shape gets. The bound method is what is compiled (a compiled
    ``functools.partial`` of a step ran ~100x slower per call here, torch 2.13)."""
    torch._dynamo.reset()  # a fresh cache per case: no recompile limit across the grid
    plain = PlainTorchSelector(num_prompts, device=device)
    return torch.compile(plain.step, fullgraph=True, dynamic=False), "torch+compile"


def _floor(rewards, prompt_ids):
    return rewards.sum(dim=1)


BUILDERS = {
    "fused": _fused_step,
    "torch_plain": lambda n, device: (PlainTorchSelector(n, device=device).step, "torch"),
    "torch_plain_compile": _plain_compiled_step,
    "python_loop": lambda n, device: (PythonLoopSelector().step, "python"),
    "floor": lambda n, device: (_floor, "torch"),
}


def bytes_moved(variant: str, batch: int, group: int) -> int:
    """Bytes a step must read and write at least: rewards in and advantages out, the id and
    the state row of each prompt (read and written), the per-row outputs and the kept indices.
    The floor reads the rewards and writes one sum per row."""
    if variant == "floor":
        return 4 * batch * group + 4 * batch
    per_row = 8 + 2 * STATE_ROW_BYTES + 3 * 4 + 1  # id, state in/out, p/E/m, keep_mask
    return 2 * 4 * batch * group + per_row * batch + 8 * LZEConfig().num_keep(batch)


@pytest.mark.parametrize("batch, group, variant", _cases())
def test_step(benchmark, device, batch, group, variant):
    inputs = RoundInputs(batch, group, device)
    step, backend = BUILDERS[variant](inputs.num_prompts, device)
    benchmark.group = f"B={batch} G={group}"
    run_benchmark(benchmark, step, inputs, device, B=batch, G=group, variant=variant,
                  backend=backend, bytes=bytes_moved(variant, batch, group))

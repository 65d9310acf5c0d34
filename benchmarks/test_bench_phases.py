"""The two launches of the fused step timed apart, at the batch sizes of the targets: the update
(statistics, advantages, energy, state; ``ops.lze_update``) and the noisy top-k
(``ops.topk_mask``). Their sum against the whole step shows the Python overhead between them."""

from __future__ import annotations

import pytest
from bench_common import RoundInputs, run_benchmark

from lze_kernels import LZEConfig, dispatch, ops

BATCHES = (16384, 65536)
GROUP = 16
CONFIG = LZEConfig()


class TopkInputs:
    """Fresh energies each round: one update step on fresh rewards and ids (not timed)."""

    def __init__(self, rounds: RoundInputs, state):
        self.rounds, self.state = rounds, state

    def __call__(self):
        (rewards, ids), _ = self.rounds()
        return (ops.lze_update(rewards, ids, self.state, config=CONFIG).energy,), {}


def _update_phase(inputs: RoundInputs, state):
    def update(rewards, prompt_ids):
        return ops.lze_update(rewards, prompt_ids, state, config=CONFIG)

    return update, inputs


def _topk_phase(inputs: RoundInputs, state):
    k = CONFIG.num_keep(inputs.batch)

    def topk(energy):
        return ops.topk_mask(energy, k, CONFIG.noise_scale, CONFIG.seed, state.step_counter)

    return topk, TopkInputs(inputs, state)


PHASES = {"fused_update": _update_phase, "fused_topk": _topk_phase}


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("batch", BATCHES)
def test_phase(benchmark, device, batch, phase):
    rounds = RoundInputs(batch, GROUP, device)
    step, inputs = PHASES[phase](rounds, ops.new_state(rounds.num_prompts, device))
    benchmark.group = f"B={batch} G={GROUP}"
    run_benchmark(benchmark, step, inputs, device, B=batch, G=GROUP, variant=phase,
                  backend=dispatch.resolve("auto", device).name)

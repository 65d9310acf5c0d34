"""LZE with forward selection through verl 0.9.1's own ``fit()`` over three passes of a small
dataset, on two data-parallel ranks, and a run stopped at an epoch boundary and resumed through
verl's own checkpoint.

Every run keeps floor(6 x 0.5) = 3 of B = 6 groups rounded to whole mini-batches of 2 groups
(4 groups: the selector's 3 and the next by energy) and does not use verl's prefix grouper
(``tests/test_verl_fit.py`` does). The dataset has 12 prompts, every third one always solved (a
group of equal rewards, no learning signal), so the pruner prunes and batches span passes:

* legacy ``LZERayPPOTrainer`` with the pruner (``ForwardSampler`` as verl's ``train_sampler``),
  6 steps (3 passes), and the same run stopped after step 2 (the end of the first pass) with
  verl's ``_save_checkpoint``, then resumed by a fresh trainer through verl's
  ``_load_checkpoint`` (which skips the dataloader state at an epoch boundary): steps 3-6
  roll out the same prompts and responses and keep the same groups as the run that never
  stopped;
* legacy with DOTS, and v1 (``LZEReplayBuffer``, ``sampler_kwargs.forward``) with GRESO, 6 steps
  each.

Each step: B x n rows rolled out, k x n rows in each later stage, half on each rank's worker,
the kept groups among the step's prompts, the effective ratio logged. Marked slow (five fits of
about a minute each here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from crafted_state import same  # noqa: E402
from verl_cpu import harness, task  # noqa: E402
from verl_cpu.harness import Shape  # noqa: E402

from lze_kernels import LZEConfig  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = Shape(batch=6, n=4, steps=6, prompts=12, ranks=2)
KEEP_RATIO, KEPT = 0.5, 4  # floor(6 x 0.5) = 3, rounded to mini-batches of 2 groups
STOP_AT = 2  # the end of the first pass (12 prompts, 6 per step)
LZE_OPTIONS = {"keep_ratio": KEEP_RATIO, "noise_scale": 0.0, "prune_after": 1,
               "replay_ratio": 0.0}
OVERRIDES = ["actor_rollout_ref.actor.ppo_mini_batch_size=2"]


class Runs:
    """Each ``fit`` of the module, run once when a test first asks for it."""

    def __init__(self, work: Path):
        from transformers import AutoTokenizer

        self.work = work
        self.model = task.build_model(work / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.train = task.write_dataset(work / "train.parquet", SHAPE.prompts, solved_every=3)
        self.done: dict[str, harness.Run] = {}
        self.samplers: dict = {}

    def __getitem__(self, name: str) -> harness.Run:
        if name not in self.done:
            self.done[name] = getattr(self, name)()
        return self.done[name]

    def compose(self, v1: bool, overrides=(), steps=SHAPE.steps, checkpoints="checkpoints"):
        shape = Shape(**{**vars(SHAPE), "steps": steps})
        return harness.compose(self.model, self.train, self.work, v1=v1, shape=shape,
                               overrides=OVERRIDES + list(overrides) + [
                                   f"trainer.default_local_dir={self.work / checkpoints}"])

    def legacy(self, method: str, overrides=(), steps=SHAPE.steps, checkpoints="checkpoints",
               record=None):
        """Legacy LZE fed by a fresh ``ForwardSampler`` of ``method`` (a fresh process's)."""
        from lze_kernels.integrations.verl import LZEAdvantage
        from lze_kernels.integrations.verl.forward import ForwardSampler
        from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

        lze = LZEAdvantage(SHAPE.prompts, LZEConfig(**LZE_OPTIONS))
        embeddings = torch.randn(SHAPE.prompts, 8, generator=torch.Generator().manual_seed(0))
        sampler = ForwardSampler(SHAPE.prompts, SHAPE.batch, method, seed=1,
                                 selector=lze.selector, embeddings=embeddings)
        self.samplers[record or method] = sampler
        with harness.registered(lze) as name:
            config = self.compose(False, [f"algorithm.adv_estimator={name}", *overrides], steps,
                                  checkpoints)
            return harness.fit_legacy(config, trainer_cls=LZERayPPOTrainer,
                                      train_sampler=sampler)

    def legacy_pruner(self):
        return self.legacy("pruner")

    def legacy_dots(self):
        return self.legacy("dots")

    def legacy_stopped(self):
        """The pruner run, stopped after step 2 with verl's checkpoint of it."""
        return self.legacy("pruner", [f"trainer.save_freq={STOP_AT}"], steps=STOP_AT,
                           checkpoints="resumed", record="stopped")

    def legacy_resumed(self):
        """A fresh trainer resuming the stopped run from its checkpoint (verl's resume_mode
        auto), to step 6."""
        self["legacy_stopped"]
        return self.legacy("pruner", ["trainer.resume_mode=auto"], checkpoints="resumed",
                           record="resumed")

    def v1_greso(self):
        from lze_kernels.integrations.verl import checkpoint

        try:
            return harness.fit_v1(self.compose(True, harness.v1_buffer(
                "topk", SHAPE.prompts, LZE_OPTIONS,
                forward={"method": "greso", "batch_size": SHAPE.batch, "seed": 1})))
        finally:
            self.samplers["greso"] = checkpoint.part(checkpoint.FORWARD)
            for name in ("replay_buffer", checkpoint.FORWARD):
                checkpoint.unregister(name)


def responses(run: harness.Run, step: int) -> list[tuple]:
    """The step's generations (prompt, response, log-probs), in a fixed order (the server
    records them in the order the agent loop's requests arrive)."""
    return sorted((g.prompt, g.response, g.log_probs) for g in run.generations[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with harness.cpu_platform():
        yield Runs(tmp_path_factory.mktemp("verl_fit_passes"))


@pytest.mark.parametrize("name, method", [("legacy_pruner", "pruner"),
                                          ("legacy_dots", "dots"), ("v1_greso", "greso")])
def test_three_passes_with_forward_selection(runs, name, method):
    """Six steps over three passes of the data: every step rolls out B prompts and hands k
    groups to the later stages, half on each rank, the kept groups among the step's prompts,
    the effective ratio logged; the forward sampler observed every step (the pruner's and
    GRESO's permutation went through three passes or more)."""
    run = runs[name]
    assert run.steps == list(range(1, SHAPE.steps + 1))
    for step in run.steps:
        assert run.rows(step, "rollout") == len(run.generations[step]) == SHAPE.batch * SHAPE.n
        for stage in ("old_log_prob", "ref_log_prob", "update"):
            assert run.rows_per_rank(step, stage) == {0: KEPT * SHAPE.n // 2,
                                                      1: KEPT * SHAPE.n // 2}, (step, stage)
        rolled_out, updated = harness.prompt_rows(run, step, runs.tokenizer)
        assert set(updated) <= set(rolled_out)
        assert run.metrics[step]["lze/keep_ratio_effective"] == KEPT / SHAPE.batch
    sampler = runs.samplers[method]
    assert sampler.method == method and sampler.steps == SHAPE.steps  # observed every step
    if method != "dots":  # DOTS draws each batch afresh, not a pass of a permutation
        assert sampler.passes + (sampler.position > 0) >= 3


def test_a_run_resumed_at_an_epoch_boundary_selects_as_one_that_never_stopped(runs):
    """Stopped after step 2 (verl saves its checkpoint and lze_selection.pt; the resume skips
    verl's data.pt at the epoch boundary), resumed by a fresh trainer: steps 3-6 roll out the
    same prompts and responses and update on the same groups as the uninterrupted run, and the
    first two steps were the same too."""
    whole, stopped, resumed = runs["legacy_pruner"], runs["legacy_stopped"], runs["legacy_resumed"]
    assert stopped.steps == [1, 2] and resumed.steps == [3, 4, 5, 6]
    for step, part in [(1, stopped), (2, stopped), (3, resumed), (4, resumed), (5, resumed),
                       (6, resumed)]:
        assert responses(part, step) == responses(whole, step), step
        assert (harness.prompt_rows(part, step, runs.tokenizer)
                == harness.prompt_rows(whole, step, runs.tokenizer)), step
    for resumed_part, whole_part in [(runs.samplers["resumed"], runs.samplers["pruner"]),
                                     (runs.samplers["resumed"].selector,
                                      runs.samplers["pruner"].selector)]:
        assert same(resumed_part.state_dict(), whole_part.state_dict())

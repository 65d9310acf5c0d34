"""LZE through verl 0.9.1's own training loops on this CPU: legacy ``RayPPOTrainer.fit()`` (the
project's ``LZERayPPOTrainer``) and the v1 trainer (``LZEReplayBuffer`` as its custom sampler),
3 steps each with plain GRPO and with LZE, on two data-parallel ranks.

Nothing of verl's loop is copied or stubbed: verl's Ray worker group runs verl's
``ActorRolloutRefWorker`` on two ranks (FSDP2 actor and reference model, gloo), its agent loop,
reward loop and weight sync, on a CPU platform loaded through verl's
``VERL_USE_EXTERNAL_MODULES`` and a Hugging Face rollout server behind verl's rollout interfaces
(``tests/verl_cpu``). The test records what each rank's worker receives in each stage (old
log-probs, reference log-probs, update; the rollout as ``fit`` hands it over) and checks that
LZE's update equals a plain GRPO update on the kept groups alone: the same responses replayed
through a GRPO ``fit`` of one step on a dataset of just those prompts. The legacy runs use
``actor.use_prefix_grouper`` (whole groups per rank; verl refuses a group count the ranks do not
divide); ``tests/test_verl_fit_passes.py`` runs legacy without it.

Runs where verl is installed (``make test-verl``); each ``fit`` starts its own Ray instance and
takes about a minute here, so the module is marked slow.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from verl_cpu import harness, task  # noqa: E402
from verl_cpu.harness import STAGES, Shape  # noqa: E402

from lze_kernels import LZEConfig  # noqa: E402
from lze_kernels.config import num_keep  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = Shape(batch=4, n=4, steps=3, prompts=16, ranks=2)
KEEP_RATIO = 0.5
KEPT = num_keep(SHAPE.batch, KEEP_RATIO)  # k of docs/spec.md §4: 2 of 4 groups
# verl splits the update into mini-batches of ppo_mini_batch_size groups and LZE keeps whole
# ones: with mini-batches of k groups it keeps exactly k (tests/test_verl_fit_passes.py rounds).
MINI_BATCH = [f"actor_rollout_ref.actor.ppo_mini_batch_size={KEPT}"]
PREFIX_GROUPER = ["actor_rollout_ref.actor.use_prefix_grouper=True"]
LZE_OPTIONS = {"keep_ratio": KEEP_RATIO, "noise_scale": 0.0}
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "verl_stages.md"


class Runs:
    """Each ``fit`` of the module, run once when a test first asks for it."""

    def __init__(self, work: Path):
        from transformers import AutoTokenizer

        self.work = work
        self.model = task.build_model(work / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.train = task.write_dataset(work / "train.parquet", SHAPE.prompts)
        self.done: dict[str, harness.Run] = {}

    def __getitem__(self, name: str) -> harness.Run:
        if name not in self.done:
            self.done[name] = getattr(self, name)()
        return self.done[name]

    def compose(self, v1: bool, overrides=(), train=None, shape=SHAPE):
        return harness.compose(self.model, train or self.train, self.work, v1=v1, shape=shape,
                               overrides=MINI_BATCH + ([] if v1 else PREFIX_GROUPER)
                               + list(overrides))

    def legacy_grpo(self):
        return harness.fit_legacy(self.compose(v1=False))

    def legacy_lze(self):
        from lze_kernels.integrations.verl import LZEAdvantage
        from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

        with harness.registered(LZEAdvantage(SHAPE.prompts, LZEConfig(**LZE_OPTIONS))) as name:
            return harness.fit_legacy(self.compose(False, [f"algorithm.adv_estimator={name}"]),
                                      trainer_cls=LZERayPPOTrainer)

    def legacy_replay(self):
        """Plain GRPO, one step, on a dataset of exactly the groups legacy LZE updated on at
        step 1, the rollout server replaying their recorded responses."""
        kept = kept_generations(self["legacy_lze"], step=1)
        return self.replay(kept, v1=False)

    def v1_grpo(self):
        return harness.fit_v1(self.compose(v1=True))

    def v1_topk(self):
        return harness.fit_v1(self.compose(True, v1_buffer("topk")))

    def v1_refill(self):
        return harness.fit_v1(self.compose(True, v1_buffer("refill") + [
            "data.gen_batch_size=1", "+trainer.v1.sampler.sampler_kwargs.gen_batch_size=1"]))

    def v1_replay(self):
        kept = kept_generations(self["v1_topk"], step=1)
        return self.replay(kept, v1=True)

    def replay(self, kept: list[harness.Generation], v1: bool) -> harness.Run:
        rows = sorted({task.row_of_text(self.tokenizer.decode(list(g.prompt))) for g in kept})
        train = task.write_dataset(self.work / f"kept_{'v1' if v1 else 'legacy'}.parquet",
                                   SHAPE.prompts, rows=rows)
        shape = Shape(batch=len(rows), n=SHAPE.n, steps=1, prompts=len(rows))
        config = self.compose(v1=v1, train=train, shape=shape, overrides=[
            "data.shuffle=False", f"actor_rollout_ref.actor.ppo_mini_batch_size={len(rows)}"])
        fit = harness.fit_v1 if v1 else harness.fit_legacy
        return fit(config, before_fit=harness.replay_on_server(kept))


def v1_buffer(mode: str) -> list[str]:
    return harness.v1_buffer(mode, SHAPE.prompts, LZE_OPTIONS)


def kept_generations(run: harness.Run, step: int) -> list[harness.Generation]:
    """The responses of ``step`` whose rows reached the update (matched by their tokens)."""
    updated = [seq for call in run.stages[step]["update"] for seq in call.sequences]
    left = list(updated)
    kept = []
    for g in run.generations[step]:
        if g.prompt + g.response in left:
            left.remove(g.prompt + g.response)
            kept.append(g)
    assert not left, "every updated row is a response the rollout server generated"
    return kept


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with harness.cpu_platform():
        yield Runs(tmp_path_factory.mktemp("verl_fit"))


# ----------------------------------------------------------------------------------- checks


def assert_each_rank_gets(run: harness.Run, step: int, rows: int) -> None:
    """``rows`` rows in each stage after the rollout, half on each rank's worker, no padding."""
    for stage in ("old_log_prob", "ref_log_prob", "update"):
        assert run.rows_per_rank(step, stage) == {0: rows // 2, 1: rows // 2}, (step, stage)
        assert run.padding_rows(step, stage) == 0, (step, stage)


@pytest.mark.parametrize("trainer", ["legacy", "v1"])
def test_grpo_every_stage_gets_every_row(runs, trainer):
    """Plain GRPO: each step the B x n responses generated reach every stage, half on each
    rank, and the log-prob passes run over exactly the tokens the rollout server generated
    (prompt + response)."""
    run = runs[f"{trainer}_grpo"]
    assert run.steps == [1, 2, 3]
    for step in run.steps:
        assert len(run.generations[step]) == run.rows(step, "rollout") == SHAPE.batch * SHAPE.n
        assert_each_rank_gets(run, step, SHAPE.batch * SHAPE.n)
        assert run.tokens(step, "old_log_prob") == run.tokens(step, "rollout")


def test_legacy_lze_sends_k_groups_past_the_reward(runs):
    """Legacy LZE: B x n rows rolled out, exactly k x n rows (k = floor(B x keep_ratio) groups,
    whole groups on each rank under the prefix grouper) reach the old-log-prob pass, the
    reference pass and the update, half on each rank; the effective ratio is logged."""
    run = runs["legacy_lze"]
    assert run.steps == [1, 2, 3]
    for step in run.steps:
        assert run.rows(step, "rollout") == len(run.generations[step]) == SHAPE.batch * SHAPE.n
        assert_each_rank_gets(run, step, KEPT * SHAPE.n)
        assert run.tokens(step, "update") < run.tokens(step, "rollout")
        assert run.metrics[step]["lze/keep_ratio_effective"] == KEPT / SHAPE.batch


def test_legacy_lze_update_is_grpo_on_the_kept_groups(runs):
    """The actor's step-1 update under LZE (SGD: -lr x gradient, synced to the rollout server)
    equals plain GRPO's update on a batch of only the k kept groups, same responses."""
    lze, replay = runs["legacy_lze"], runs["legacy_replay"]
    assert replay.rows(1, "update") == KEPT * SHAPE.n
    assert_same_update(lze, replay)


def test_v1_topk_rolls_out_k_prompts_and_updates_the_top_groups(runs):
    """v1 top-k: the trainer's K = train_batch_size prompts are rolled out (no refill), and the
    update gets k = floor(K x keep_ratio) groups, half on each rank, no padding rows; the
    effective ratio is logged."""
    run = runs["v1_topk"]
    assert run.steps == [1, 2, 3]
    for step in run.steps:
        assert len(run.generations[step]) == run.rows(step, "rollout") == SHAPE.batch * SHAPE.n
        assert_each_rank_gets(run, step, KEPT * SHAPE.n)
        assert run.metrics[step]["lze/keep_ratio_effective"] == KEPT / SHAPE.batch


def test_v1_topk_update_is_grpo_on_the_kept_groups(runs):
    """v1 top-k's step-1 update equals plain GRPO's on a batch of only the groups the buffer
    handed over, same responses (v1 GRPO, one step, on a dataset of those prompts)."""
    assert_same_update(runs["v1_topk"], runs["v1_replay"])


def test_v1_refill_rolls_out_extra_prompts_for_a_full_batch(runs):
    """v1 refill: at least ceil(B / keep_ratio) prompts rolled out per step, B groups updated."""
    run = runs["v1_refill"]
    assert run.steps == [1, 2, 3]
    least = math.ceil(SHAPE.batch / KEEP_RATIO) * SHAPE.n
    for step in run.steps:
        assert len(run.generations[step]) == run.rows(step, "rollout") >= least
        assert_each_rank_gets(run, step, SHAPE.batch * SHAPE.n)


def assert_same_update(selected: harness.Run, replay: harness.Run) -> None:
    """Step-1 weight change of ``selected`` equals ``replay``'s. The two sum the same gradient
    terms (about a hundred tokens per entry) in possibly another order: fp32 rounding, 1.2e-7
    per term, bounds the difference well below 1e-5 of the largest change (measured: none in
    legacy, 3e-7 of the largest change in v1)."""
    start = selected.weights[0]
    for name, value in replay.weights[0].items():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0)
    change = {k: selected.weights[1][k] - start[k] for k in start}
    largest = max(float(v.abs().max()) for v in change.values())
    assert largest > 0, "the update moved the weights"
    for name in start:
        torch.testing.assert_close(replay.weights[1][name] - start[name], change[name], rtol=0,
                                   atol=1e-5 * largest, msg=name)


# ----------------------------------------------------------------------------------- table


def test_stage_table(runs):
    """Rows per stage and the FLOPs proxy per step against plain GRPO, written to
    benchmarks/results/verl_stages.md (docs/verl.md quotes it)."""
    table = stage_table({"legacy": ("legacy_grpo", {"GRPO": "legacy_grpo", "LZE": "legacy_lze"}),
                         "v1": ("v1_grpo", {"GRPO": "v1_grpo", "LZE top-k": "v1_topk",
                                            "LZE refill": "v1_refill"})}, runs)
    RESULTS.write_text(table)
    assert "| legacy | LZE |" in table


def stage_table(modes: dict, runs: Runs) -> str:
    lines = [
        f"Rows each stage of verl's own `fit()` received on its {SHAPE.ranks} ranks together, "
        f"mean per step over\n{SHAPE.steps} steps (B = {SHAPE.batch} prompts, n = {SHAPE.n}, "
        f"keep_ratio {KEEP_RATIO}, k = {KEPT}), and the FLOPs proxy per step\n(2P per rollout and "
        "log-prob token, 6P per update token) against plain GRPO of the same\ntrainer. "
        "Written by `tests/test_verl_fit.py::test_stage_table`.",
        "",
        "| trainer | method | rollout | old log-probs | reference | update | FLOPs / GRPO |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, (baseline, methods) in modes.items():
        base = harness.flops(runs[baseline])
        for method, name in methods.items():
            run = runs[name]
            cells = [f"{sum(run.rows(s, stage) for s in run.steps) / len(run.steps):.3g}"
                     for stage in STAGES]
            lines.append(f"| {mode} | {method} | " + " | ".join(cells)
                         + f" | {harness.flops(run) / base:.2f} |")
    return "\n".join(lines) + "\n"

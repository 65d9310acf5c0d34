"""LZE through verl 0.9.1's own training loops on the CPU, on two data-parallel ranks: legacy
``RayPPOTrainer.fit()`` (the project's ``LZERayPPOTrainer``) and the v1 trainer's ``fit()``
(``LZEReplayBuffer`` as ``trainer.v1.sampler.custom_sampler``).

Nothing of verl's loop is copied or stubbed: verl's Ray worker group runs verl's
``ActorRolloutRefWorker`` on two ranks (FSDP2 actor and reference model, gloo), its agent loop,
reward loop and weight sync, on a CPU platform loaded through verl's
``VERL_USE_EXTERNAL_MODULES`` and a Hugging Face rollout server behind verl's rollout interfaces
(``tests/verl_cpu``). Every run of this module shares one Ray cluster and one set of workers
(:class:`verl_cpu.harness.Cluster`, reset to the same weights before each run), so the module
runs on one pytest-xdist worker (``xdist_group``) and its runs one after another.

What runs (``Runs``), each recorded per step and per rank (old log-probs, reference log-probs,
update; the rollout as ``fit`` hands it over; the rollout server's responses and weights):

* plain GRPO, 3 steps, both trainers, and v1's refill mode (the stage table);
* the update: LZE's weights after each of 3 steps equal plain GRPO's on a batch of only the kept
  groups (a GRPO ``fit`` over datasets of just those prompts, the server replaying their
  responses), legacy with the prefix grouper on and off, v1;
* every method through both trainers over three passes of the data (LZE alone, and LZE with the
  pruner, GRESO and DOTS choosing the prompts), 6 steps each; each also stopped at an epoch
  boundary and mid-epoch and resumed through verl's own checkpoint;
* the data users have: two train files whose ``extra_info.index`` both restart at 0 with rows
  ``data.filter_overlong_prompts`` drops, through both trainers;
* the set-ups selection cannot serve: each says so (refused, warned) through verl's own code;
* validation on in two runs (legacy and v1), and the README's verl quick start through one step.

Marked slow (the module takes a few minutes on two cores; see docs/verl.md).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from crafted_state import same  # noqa: E402
from readme_blocks import RECORD_PYTHON3, block, run_bash  # noqa: E402
from verl_cpu import harness, task  # noqa: E402
from verl_cpu.harness import STAGES, Shape  # noqa: E402

from lze_kernels import LZEConfig  # noqa: E402
from lze_kernels.config import num_keep  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("verl_fit")]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "verl_fit.json"
KEEP_RATIO = 0.5
LZE = {"keep_ratio": KEEP_RATIO, "noise_scale": 0.0}
FORWARD_LZE = {**LZE, "prune_after": 1, "replay_ratio": 0.0}
MINI = "actor_rollout_ref.actor.ppo_mini_batch_size=2"
PREFIX = "actor_rollout_ref.actor.use_prefix_grouper=True"
# B = 4 of 16 prompts, k = floor(4 x 0.5) = 2 groups, one mini-batch of 2: plain GRPO, the update.
SMALL = Shape(batch=4, steps=3, prompts=16)
# Three passes: LZE alone, B = 4 of 8 prompts (k = 2); the forward methods, B = 6 of 12 prompts,
# k0 = 3 rounded to a whole mini-batch of 4 groups (the selector's 3 and the next by energy; one
# mini-batch, so that an update does not depend on the order verl splits the rows in).
# Every third prompt always solved (zero-variance groups; the pruner prunes them). Two steps a
# pass: step 2 ends a pass (a stop at an epoch boundary), step 3 is mid-pass.
SOLVED_EVERY = 3
LZE_PASSES = Shape(batch=4, steps=6, prompts=8)
PASSES = Shape(batch=6, steps=6, prompts=12)
KEPT = {LZE_PASSES: 2, PASSES: 4, SMALL: 2}
FORWARD = ("pruner", "greso", "dots")
TRAINERS = ("legacy", "v1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with harness.Cluster(tmp_path_factory.mktemp("verl_fit")) as cluster:
        yield Runs(cluster)


class Runs:
    """Each ``fit`` of the module on the shared cluster, run once when a test first asks."""

    def __init__(self, cluster: harness.Cluster):
        self.cluster, self.work, self.tokenizer = cluster, cluster.work, cluster.tokenizer
        self.data = {"small": task.write_dataset(self.work / "small.parquet", 16),
                     "lze": task.write_dataset(self.work / "lze.parquet", 8,
                                               solved_every=SOLVED_EVERY),
                     "passes": task.write_dataset(self.work / "passes.parquet", 12,
                                                  solved_every=SOLVED_EVERY),
                     "val": task.write_dataset(self.work / "val.parquet", 4, indices=[None] * 4)}
        embeddings = torch.randn(PASSES.prompts, 8, generator=torch.Generator().manual_seed(0))
        self.embeddings = self.work / "embeddings.pt"
        torch.save(embeddings, self.embeddings)
        self.done: dict[str, harness.Run] = {}
        self.parts: dict = {}  # the selection parts each legacy run was built with

    def __getitem__(self, name: str) -> harness.Run:
        if name not in self.done:
            trainer, _, rest = name.partition("_")
            method, _, stop = rest.partition("@")
            if method in ("grpo", "lze_prefix", "refill") or method.startswith("replay"):
                self.done[name] = getattr(self, f"{trainer}_{method.split('.')[0]}")(method)
            else:
                self.done[name] = self.passes(trainer, method, stop)
        return self.done[name]

    def compose(self, v1: bool, shape: Shape, data: str = "small", overrides=(), **kwargs):
        """A run's config; its validation set is a file of its own (a v1 forward sampler needs
        one: LZERLHFDataset remaps every dataset of the train files)."""
        return self.cluster.compose(v1=v1, shape=shape, train_files=kwargs.pop(
            "train_files", self.data[data]), val_files=kwargs.pop("val_files", self.data["val"]),
            overrides=[MINI, *overrides], **kwargs)

    # ----------------------------------------------------------------- plain GRPO, the update

    def legacy_grpo(self, _):
        return self.cluster.fit_legacy(self.compose(False, SMALL, overrides=[PREFIX]))

    def v1_grpo(self, _):
        return self.cluster.fit_v1(self.compose(True, SMALL))

    def legacy_lze_prefix(self, _):
        """Legacy LZE with the prefix grouper, validation at steps 2 and 3 on a set without
        extra_info.index."""
        from lze_kernels.integrations.verl import LZEAdvantage
        from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

        with harness.registered(LZEAdvantage(SMALL.prompts, LZEConfig(**LZE))) as name:
            config = self.compose(False, SMALL, overrides=[
                PREFIX, f"algorithm.adv_estimator={name}", "trainer.test_freq=2",
                *harness.LZE_DATASET], val_files=self.data["val"])
            return self.cluster.fit_legacy(config, trainer_cls=LZERayPPOTrainer)

    def v1_refill(self, _):
        """v1 refill, validation at steps 2 and 3 on a set without extra_info.index."""
        return self.cluster.fit_v1(self.compose(True, SMALL, overrides=[
            *harness.v1_buffer("refill", LZE), "data.gen_batch_size=1",
            "+trainer.v1.sampler.sampler_kwargs.gen_batch_size=1", "trainer.test_freq=2"],
            val_files=self.data["val"]))

    def legacy_replay(self, name):
        return self.replay(name, v1=False)

    def v1_replay(self, name):
        return self.replay(name, v1=True)

    def replay(self, name: str, v1: bool) -> harness.Run:
        """Plain GRPO over the steps of run ``name`` (after "replay."), each step on a batch of
        exactly the groups that run updated on, the server replaying their responses."""
        source = name.split(".", 1)[1]
        selected = self[f"{'v1' if v1 else 'legacy'}_{source}"]
        steps = [1, 2, 3]
        kept = [kept_generations(selected, step) for step in steps]
        numbers = [sorted({self.number(g.prompt) for g in gens}) for gens in kept]
        train = task.write_dataset(self.work / f"{name}_{v1}.parquet", 16,
                                   rows=[n for step in numbers for n in step],
                                   solved_every=0 if source == "lze_prefix" else SOLVED_EVERY)
        shape = Shape(batch=len(numbers[0]), steps=len(steps), prompts=len(numbers[0]))
        prefix = [PREFIX] if source == "lze_prefix" else []
        config = self.compose(v1, shape, train_files=train, overrides=[
            *prefix, "data.shuffle=False",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.batch}"])
        fit = self.cluster.fit_v1 if v1 else self.cluster.fit_legacy
        return fit(config, before_fit=harness.replay_on_server(g for gens in kept for g in gens))

    def number(self, tokens) -> int:
        return task.row_of_text(self.tokenizer.decode(list(tokens)))

    # ----------------------------------------------------------------- three passes, resumes

    def passes(self, trainer: str, method: str, stop: str) -> harness.Run:
        """``method`` (lze, pruner, greso, dots) through ``trainer``'s fit over three passes,
        verl saving its checkpoint every two steps; ``stop`` "2": a run that stopped at step 2
        (the end of a pass) resumed from that checkpoint, stopping after step 3; "3": that run
        resumed from its step-3 checkpoint (mid-pass), stopping after step 4."""
        shape = LZE_PASSES if method == "lze" else PASSES
        data = "lze" if method == "lze" else "passes"
        steps, save, resume = shape.steps, 2, []
        if stop:
            origin = (self.work / f"{trainer}_{method}" if stop == "2"
                      else self.work / f"{trainer}_{method}@2")
            self[f"{trainer}_{method}" if stop == "2" else f"{trainer}_{method}@2"]
            steps, save = int(stop) + 1, 1
            resume = ["trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={origin / f'global_step_{stop}'}"]
        name = f"{trainer}_{method}" + (f"@{stop}" if stop else "")
        overrides = [f"trainer.save_freq={save}", *resume,
                     f"trainer.default_local_dir={self.work / name}",
                     f"actor_rollout_ref.actor.ppo_mini_batch_size={KEPT[shape]}"]
        shape = Shape(**{**vars(shape), "steps": steps})
        lze = FORWARD_LZE if method in FORWARD else LZE
        if trainer == "v1":
            forward = None if method == "lze" else {"method": method, "seed": 1, **(
                {"embeddings": self.embeddings} if method == "dots" else {})}
            return self.cluster.fit_v1(self.compose(True, shape, data, overrides=[
                *harness.v1_buffer("topk", lze, forward), *overrides]))
        return self.legacy_passes(name, method, shape, data, lze, overrides)

    def legacy_passes(self, name, method, shape, data, lze, overrides) -> harness.Run:
        """Legacy LZE fed by a fresh ``ForwardSampler`` of ``method`` (a fresh process's);
        LZE alone on verl's sequential sampler (verl restarts its random sampler's generator
        when it resumes at an epoch boundary: its own behaviour, not the selection's)."""
        from lze_kernels.integrations.verl import LZEAdvantage
        from lze_kernels.integrations.verl.forward import ForwardSampler
        from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

        estimator = LZEAdvantage(shape.prompts, LZEConfig(**lze))
        sampler = None
        if method in FORWARD:
            sampler = ForwardSampler(shape.prompts, shape.batch, method, seed=1,
                                     selector=estimator.selector, embeddings=torch.load(
                                         self.embeddings), greso=greso_filter(shape.prompts))
        extra = ["data.shuffle=False"] if sampler is None else []
        self.parts[name] = (estimator, sampler)
        with harness.registered(estimator) as registered:
            config = self.compose(False, shape, data, overrides=[
                f"algorithm.adv_estimator={registered}", *harness.LZE_DATASET, *extra,
                *overrides])
            return self.cluster.fit_legacy(config, trainer_cls=LZERayPPOTrainer,
                                           train_sampler=sampler)


def greso_filter(num_prompts: int):
    from lze_kernels.greso import GresoConfig, GresoFilter

    return GresoFilter(num_prompts, GresoConfig())


def kept_generations(run: harness.Run, step: int) -> list[harness.Generation]:
    """The responses of ``step`` whose rows reached the update (matched by their tokens)."""
    left = [seq for call in run.stages[step]["update"] for seq in call.sequences]
    kept = []
    for g in run.generations[step]:
        if g.prompt + g.response in left:
            left.remove(g.prompt + g.response)
            kept.append(g)
    assert not left, "every updated row is a response the rollout server generated"
    return kept


# ----------------------------------------------------------------------------------- checks


def assert_each_rank_gets(run: harness.Run, step: int, rows: int) -> None:
    """``rows`` rows in each stage after the rollout, half on each rank's worker, no padding."""
    for stage in ("old_log_prob", "ref_log_prob", "update"):
        assert run.rows_per_rank(step, stage) == {0: rows // 2, 1: rows // 2}, (step, stage)
        assert run.padding_rows(step, stage) == 0, (step, stage)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_grpo_every_stage_gets_every_row(runs, trainer):
    """Plain GRPO: each step the B x n responses generated reach every stage, half on each
    rank, and the log-prob passes run over exactly the tokens the rollout server generated."""
    run = runs[f"{trainer}_grpo"]
    assert run.steps == [1, 2, 3]
    for step in run.steps:
        assert len(run.generations[step]) == run.rows(step, "rollout") == SMALL.batch * SMALL.n
        assert_each_rank_gets(run, step, SMALL.batch * SMALL.n)
        assert run.tokens(step, "old_log_prob") == run.tokens(step, "rollout")


@pytest.mark.parametrize("name", ["legacy_lze_prefix", "v1_lze"])
def test_lze_sends_k_groups_past_the_reward(runs, name):
    """LZE: B x n rows rolled out (v1: exactly the K the trainer dispatched, no refill), k x n
    rows (k = floor(B x keep_ratio) groups) reach the old-log-prob pass, the reference pass and
    the update, half on each rank, no padding; the effective ratio is logged."""
    run = runs[name]
    shape = SMALL if name == "legacy_lze_prefix" else LZE_PASSES
    for step in run.steps:
        assert run.rows(step, "rollout") == len(run.generations[step]) == shape.batch * shape.n
        assert_each_rank_gets(run, step, KEPT[shape] * shape.n)
        assert run.metrics[step]["lze/keep_ratio_effective"] == KEPT[shape] / shape.batch


@pytest.mark.parametrize("name", ["legacy_lze_prefix", "legacy_lze", "v1_lze"])
def test_the_update_is_grpo_on_the_kept_groups_at_every_step(runs, name):
    """The actor's weights after each of 3 steps (SGD: -lr x gradient, synced to the rollout
    server) equal plain GRPO's on batches of only the kept groups, same responses: legacy with
    the prefix grouper (whole groups per rank) and without, and v1 (which has none)."""
    trainer, _, source = name.partition("_")
    selected, replay = runs[name], runs[f"{trainer}_replay.{source}"]
    for step in (1, 2, 3):
        assert replay.rows(step, "update") == len(kept_generations(selected, step))
    assert_same_updates(selected, replay, steps=(1, 2, 3))


def assert_same_updates(selected: harness.Run, replay: harness.Run, steps) -> None:
    """Each step's weight change of ``selected`` equals ``replay``'s. The two sum the same
    gradient terms (about a hundred tokens per entry) in possibly another order, from weights
    that agree to fp32 rounding: 1.2e-7 per term bounds the difference well below 1e-5 of the
    run's largest change (measured: at most 3e-7 of it). A step whose kept groups all have
    equal rewards at step 1 (zero advantages, and the KL term's gradient is zero while the actor
    is the reference) changes nothing, in both."""
    for name, value in replay.weights[0].items():
        torch.testing.assert_close(value, selected.weights[0][name], rtol=0, atol=0)
    changes = {step: {k: selected.weights[step][k] - selected.weights[step - 1][k]
                      for k in selected.weights[0]} for step in steps}
    largest = max(float(v.abs().max()) for change in changes.values() for v in change.values())
    assert largest > 0, "the updates moved the weights"
    for step, change in changes.items():
        for key in change:
            torch.testing.assert_close(replay.weights[step][key] - replay.weights[step - 1][key],
                                       change[key], rtol=0, atol=1e-5 * largest,
                                       msg=f"step {step}: {key}")


def test_v1_refill_rolls_out_extra_prompts_for_a_full_batch(runs):
    """v1 refill: at least ceil(B / keep_ratio) prompts rolled out per step, B groups updated,
    half on each rank; validation ran between steps on a set without extra_info.index."""
    run = runs["v1_refill"]
    assert run.steps == [1, 2, 3]
    least = math.ceil(SMALL.batch / KEEP_RATIO) * SMALL.n
    for step in run.steps:
        assert len(run.generations[step]) == run.rows(step, "rollout") >= least
        assert_each_rank_gets(run, step, SMALL.batch * SMALL.n)
    assert_validated(run, [2, 3])


def test_legacy_validation_between_steps_leaves_the_selection_alone(runs):
    """Legacy LZE with validation after steps 2 and 3 (verl's _validate runs _get_gen_batch on
    the validation batch, whose rows carry no extra_info.index): step 3 selects as usual."""
    run = runs["legacy_lze_prefix"]
    assert run.steps == [1, 2, 3]
    assert_validated(run, [2, 3])
    assert_each_rank_gets(run, 3, KEPT[SMALL] * SMALL.n)


def assert_validated(run: harness.Run, steps) -> None:
    assert sorted(run.validations) == steps
    for step in steps:
        assert len(run.validations[step]) == 4  # the validation set, one greedy response each
        assert any(key.startswith("val-core/") for key in run.metrics[step])


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("method", ("lze",) + FORWARD)
def test_every_method_over_three_passes(runs, trainer, method):
    """Six steps over three passes of the data: every step rolls out B prompts and hands k
    groups to the later stages, half on each rank, no padding, the kept groups among the
    step's prompts, the effective ratio logged (4 of 6 for the forward methods: k0 = 3 rounded
    to a whole mini-batch of 4); a forward sampler observed every step and its permutation went
    through three passes or more (DOTS draws each batch afresh)."""
    run = runs[f"{trainer}_{method}"]
    shape = LZE_PASSES if method == "lze" else PASSES
    assert run.steps == list(range(1, 7))
    for step in run.steps:
        assert run.rows(step, "rollout") == len(run.generations[step]) == shape.batch * shape.n
        assert_each_rank_gets(run, step, KEPT[shape] * shape.n)
        rolled_out, updated = harness.prompt_rows(run, step, runs.tokenizer)
        assert set(updated) <= set(rolled_out)
        assert run.metrics[step]["lze/keep_ratio_effective"] == KEPT[shape] / shape.batch
    assert KEPT[PASSES] != num_keep(PASSES.batch, KEEP_RATIO)  # rounded, not floor(r B)
    if method in FORWARD:
        sampler = forward_sampler(runs, trainer, method)
        assert sampler.method == method and sampler.steps == 6  # observed every step
        if method != "dots":
            assert sampler.passes + (sampler.position > 0) >= 3


def forward_sampler(runs: Runs, trainer: str, method: str, stop: str = ""):
    name = f"{trainer}_{method}{stop and '@' + stop}"
    if trainer == "legacy":
        return runs.parts[name][1]
    return runs[name].trainer.replay_buffer.forward


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("method", ("lze",) + FORWARD)
def test_stops_resumed_through_verls_checkpoint_select_as_one_run(runs, trainer, method):
    """The three-pass run saved verl's checkpoint at step 2 (the end of a pass; legacy verl
    skips its data.pt there); a fresh trainer resumed from it (resume_path) runs step 3 and
    saves; another resumes from that mid-pass checkpoint and runs step 4. Each rolls out the
    same prompts and responses and updates on the same groups as the run that never stopped,
    and the selection state saved after step 4 (legacy lze_selection.pt, v1 data.pt) is the
    uninterrupted run's."""
    whole = runs[f"{trainer}_{method}"]
    for stop, step in (("2", 3), ("3", 4)):
        part = runs[f"{trainer}_{method}@{stop}"]
        assert part.steps == [step], stop
        assert_same_responses(part, whole, step)
        assert (harness.prompt_rows(part, step, runs.tokenizer)
                == harness.prompt_rows(whole, step, runs.tokenizer)), stop
    folder = f"{trainer}_{method}"
    assert same(selection_state(runs.work / f"{folder}@3", trainer, 4),
                selection_state(runs.work / folder, trainer, 4))


def assert_same_responses(part: harness.Run, whole: harness.Run, step: int) -> None:
    """The step's generations: the same prompts and response tokens, and log-probs equal to
    fp32 rounding (v1's TransferQueue hands the update its rows in the order the rollouts
    finished, so the weights may differ in the last bits)."""
    def generations(run):
        return sorted(run.generations[step], key=lambda g: (g.prompt, g.response))

    got, expected = generations(part), generations(whole)
    assert [(g.prompt, g.response) for g in got] == [(g.prompt, g.response) for g in expected]
    torch.testing.assert_close(torch.tensor([p for g in got for p in g.log_probs]),
                               torch.tensor([p for g in expected for p in g.log_probs]),
                               rtol=0, atol=1e-5)


def selection_state(folder: Path, trainer: str, step: int) -> dict:
    """The selection state verl's checkpoint holds after ``step``."""
    if trainer == "legacy":
        from lze_kernels.integrations.verl.legacy import SELECTION_FILE

        return torch.load(folder / f"global_step_{step}" / SELECTION_FILE, weights_only=True)
    state = torch.load(folder / f"global_step_{step}" / "data.pt", weights_only=False)
    return state["dataset_state"]["lze_selection"]


# ----------------------------------------------------------------------------- the data users have


def two_files(work: Path) -> list[Path]:
    """Prompts 0-5 in one file, 6-11 in another, extra_info.index 0-5 in each (as a
    preprocessing script run per file writes them), prompts 2 and 8 longer than
    data.max_prompt_length; every third prompt always solved."""
    return [task.write_dataset(work / "rows_a.parquet", 12, rows=list(range(6)), long_rows=[2],
                               solved_every=3),
            task.write_dataset(work / "rows_b.parquet", 12, rows=list(range(6, 12)),
                               indices=list(range(6)), long_rows=[8], solved_every=3)]


ROWS_SHAPE = Shape(batch=4, steps=2, prompts=10)  # 12 prompts, 2 filtered out
POSITIONS = [0, 1, 3, 4, 5, 6, 7, 9, 10, 11]  # the prompt at each row after filtering
FILTER = "data.filter_overlong_prompts=True"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_two_files_and_filtered_rows_key_each_prompt_by_its_row(runs, trainer):
    """Two train files whose extra_info.index both restart at 0, two of their prompts dropped by
    data.filter_overlong_prompts: through fit (GRESO choosing the prompts, LZE the groups) each
    prompt's history sits at its row in the filtered train set: the selector has seen exactly
    the rows of the prompts rolled out, and the always-solved prompts' rows hold pass rate 1."""
    from lze_kernels.layout import LAST_PASS_RATE, SEEN

    run, selector = rows_run(runs, trainer)
    rolled_out = {runs.number(g.prompt) for step in run.steps for g in run.generations[step]}
    seen = torch.nonzero(selector.state.istate[:ROWS_SHAPE.prompts, SEEN]).view(-1).tolist()
    assert seen == sorted(POSITIONS.index(n) for n in rolled_out) and len(seen) == 8
    for number in rolled_out:
        row = POSITIONS.index(number)
        if number % 3 == 0:
            assert float(selector.state.fstate[row, LAST_PASS_RATE]) == 1.0, number
    for step in run.steps:
        assert_each_rank_gets(run, step, KEPT[SMALL] * SMALL.n)


def rows_run(runs: Runs, trainer: str):
    """The two-file, filtered train set through ``trainer``'s fit: ``(run, selector)``."""
    files = two_files(runs.work)
    if trainer == "v1":
        run = runs.cluster.fit_v1(runs.compose(True, ROWS_SHAPE, train_files=files, overrides=[
            FILTER, *harness.v1_buffer("topk", LZE, {"method": "greso", "seed": 1})]))
        return run, run.trainer.replay_buffer.selector
    from lze_kernels.integrations.verl import LZEAdvantage
    from lze_kernels.integrations.verl.forward import ForwardSampler
    from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

    estimator = LZEAdvantage(ROWS_SHAPE.prompts, LZEConfig(**LZE))
    sampler = ForwardSampler(ROWS_SHAPE.prompts, ROWS_SHAPE.batch, "greso", seed=1,
                             greso=greso_filter(ROWS_SHAPE.prompts))
    with harness.registered(estimator) as name:
        config = runs.compose(False, ROWS_SHAPE, train_files=files, overrides=[
            FILTER, f"algorithm.adv_estimator={name}", *harness.LZE_DATASET])
        run = runs.cluster.fit_legacy(config, trainer_cls=LZERayPPOTrainer,
                                      train_sampler=sampler)
    return run, estimator.selector


def test_verls_own_dataset_with_two_files_is_refused_at_start_up(runs):
    """Without LZERLHFDataset, verl's dataset hands the selection extra_info.index as the row:
    two files restarting at 0 would merge prompts' histories. Legacy refuses it when the
    trainer is built, v1 when verl builds the replay buffer, both naming the fix."""
    from lze_kernels.integrations.verl import LZEAdvantage
    from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer
    from verl.trainer.ppo.v1 import get_trainer_cls

    files = two_files(runs.work)
    with harness.registered(LZEAdvantage(12, LZEConfig(**LZE))) as name:
        config = runs.compose(False, ROWS_SHAPE, train_files=files,
                              overrides=[f"algorithm.adv_estimator={name}"])
        with pytest.raises(ValueError, match=r"train_dataset: .*data\.custom_cls"):
            runs.cluster.legacy_trainer(config, LZERayPPOTrainer)
    config = runs.compose(True, ROWS_SHAPE, train_files=files, overrides=[
        *harness.v1_buffer("topk", LZE)[:2], "+trainer.v1.sampler.sampler_kwargs.method=lze"])
    with pytest.raises(ValueError, match=r"data\.custom_cls: LZEReplayBuffer needs LZERLHFDataset"):
        get_trainer_cls("sync")(config=config)


# ----------------------------------------------------------------------------- set-ups


def test_selection_that_cannot_act_warns_at_start_up_and_logs_it(runs):
    """One mini-batch holds every group (legacy: ppo_mini_batch_size = train_batch_size; v1:
    parameter_sync_step 2 makes each sample one mini-batch): each trainer warns before its first
    step, then trains on every group and logs lze/keep_ratio_effective = 1.0."""
    from lze_kernels.integrations.verl import LZEAdvantage
    from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

    one_step = Shape(batch=4, steps=1, prompts=16)
    with pytest.warns(UserWarning, match="LZE selects nothing"):
        with harness.registered(LZEAdvantage(16, LZEConfig(**LZE))) as name:
            legacy = runs.cluster.fit_legacy(runs.compose(False, one_step, overrides=[
                f"algorithm.adv_estimator={name}", *harness.LZE_DATASET,
                "actor_rollout_ref.actor.ppo_mini_batch_size=4"]), trainer_cls=LZERayPPOTrainer)
    with pytest.warns(UserWarning, match="LZE selects nothing"):
        v1 = runs.cluster.fit_v1(runs.compose(True, one_step, overrides=[
            *harness.v1_buffer("topk", LZE), "+trainer.v1.sync.parameter_sync_step=2"]))
    for run in (legacy, v1):
        assert run.metrics[1]["lze/keep_ratio_effective"] == 1.0
        assert run.rows(1, "update") == one_step.batch * one_step.n


def test_v1_with_a_colocated_reward_model_is_refused_at_start_up(runs):
    """verl's v1 trainer scores with a colocated reward model after sample(): the buffer would
    select before any reward exists, so building the trainer refuses it with the two ways out."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = runs.compose(True, SMALL, overrides=[
        *harness.v1_buffer("topk", LZE), "reward.reward_model.enable=True",
        f"reward.reward_model.model_path={runs.cluster.model}"])
    with pytest.raises(ValueError, match=r"reward_model\.enable_resource_pool.*legacy trainer"):
        get_trainer_cls("sync")(config=config)


def test_v1_refill_out_of_rounds_names_the_setting(runs):
    """Every prompt always solved (every group's rewards equal): refill's rounds run out and
    fit stops with a ValueError naming sampler_kwargs.max_rounds."""
    solved = task.write_dataset(runs.work / "solved.parquet", 8, solved_every=1)
    config = runs.compose(True, Shape(batch=4, steps=1, prompts=8), train_files=solved, overrides=[
        *harness.v1_buffer("refill", LZE), "data.gen_batch_size=1",
        "+trainer.v1.sampler.sampler_kwargs.gen_batch_size=1",
        "+trainer.v1.sampler.sampler_kwargs.max_rounds=2"])
    with pytest.raises(ValueError, match=r"sampler_kwargs\.max_rounds: no group could be kept"):
        runs.cluster.fit_v1(config)


# ----------------------------------------------------------------------------- quick start


def gsm8k_source(folder: Path) -> Path:
    """A small GSM8K in the hub's row format (question, answer ending '#### <number>')."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 12), ("test", 4)):
        rows = [{"question": f"What is {a} + {a + 1}?", "answer": f"{a} + {a + 1} = {2 * a + 1}\n"
                 f"#### {2 * a + 1}"} for a in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


# What the CPU harness changes in the quick start's launch: the model and rollout, the ranks and
# batch sizes of two CPU ranks, the workers' group size and response length (the shared
# cluster's), one step.
CPU_OVERRIDES = ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
                 "trainer.n_gpus_per_node=2", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                 "data.max_response_length=8", "trainer.total_training_steps=1")


def test_the_readme_quick_start_runs_as_printed_through_a_step(runs, tmp_path):
    """README.md's verl block, run by bash as printed: pip gets `install -e .` (a stand-in: this
    venv has the package), examples/verl/prepare_data.py writes GSM8K to ~/data/gsm8k (HOME a
    scratch folder, GSM8K_SOURCE a small local GSM8K: there is no hub here), and
    examples/verl/run_lze_grpo.sh's launch is recorded (python3 a stand-in) and run by the CPU
    harness for one step, with the harness's model, rollout, ranks and batch sizes
    (CPU_OVERRIDES) and the rest as the script gives it: the prepared data, LZE's replay buffer
    and dataset class, validation on the test split at the last step."""
    home = tmp_path / "home"
    home.mkdir()
    recorders = ('pip() { printf "pip %s\\n" "$*" >&2; }; export -f pip\n'
                 + RECORD_PYTHON3.split("\n", 1)[1])  # python3 records, python runs
    out = run_bash(recorders + block("verl").text, cwd=ROOT, env={
        "HOME": str(home), "GSM8K_SOURCE": str(gsm8k_source(tmp_path / "gsm8k")),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    assert "pip install -e ." in out.stderr
    overrides = [line for line in out.stdout.splitlines() if "=" in line]
    train = home / "data" / "gsm8k" / "train.parquet"
    assert f"data.train_files={train}" in overrides
    config = harness.compose(runs.cluster.model, tmp_path, v1=True, overrides=[
        *overrides, f"actor_rollout_ref.model.path={runs.cluster.model}", *CPU_OVERRIDES,
        f"trainer.default_local_dir={tmp_path / 'checkpoints'}"])
    run = runs.cluster.fit_v1(config)
    assert run.steps == [1] and run.rows(1, "rollout") == 4 * 4
    assert run.rows(1, "update") == 2 * 4 and run.metrics[1]["lze/keep_ratio_effective"] == 0.5
    assert all("####" in runs.tokenizer.decode(list(g.prompt)) for g in run.generations[1])
    assert run.trainer.replay_buffer.num_prompts == 12  # the prepared train split's rows
    assert len(run.validations[1]) == 4 and (tmp_path / "checkpoints" / "global_step_1").is_dir()


# ----------------------------------------------------------------------------- the stage table

STAGE_TABLE = ROOT / "benchmarks" / "results" / "verl_stages.md"
TABLE_RUNS = {  # row label: run, its shape
    "legacy, plain GRPO": ("legacy_grpo", SMALL), "legacy, LZE": ("legacy_lze_prefix", SMALL),
    "v1, plain GRPO": ("v1_grpo", SMALL), "v1, LZE `mode=topk`": ("v1_lze", LZE_PASSES),
    "v1, LZE `mode=refill`": ("v1_refill", SMALL),
    **{f"{trainer}, LZE + {method}": (f"{trainer}_{method}", PASSES)
       for trainer in TRAINERS for method in FORWARD}}


# Refill rolls out more prompts than plain GRPO: its FLOPs against the plain GRPO run of its shape.
GRPO_BASELINE = {"v1, LZE `mode=refill`": "v1_grpo"}


def test_stage_table(runs):
    """What each stage received per step in the runs above (both ranks together, mean per
    step), the effective keep ratio, and the FLOPs proxy against plain GRPO: the same rollouts
    through every stage (the GRPO runs measure 1.00), for refill the GRPO run; written to
    benchmarks/results/verl_fit.json and rendered to verl_stages.md (docs/verl.md and the
    README quote them)."""
    rows = {}
    for label, (name, shape) in TABLE_RUNS.items():
        run = runs[name]
        mean = {stage: sum(run.rows(s, stage) for s in run.steps) / len(run.steps)
                for stage in STAGES}
        kept = [run.metrics[s].get("lze/keep_ratio_effective") for s in run.steps]
        grpo = (harness.flops(runs[GRPO_BASELINE[label]]) if label in GRPO_BASELINE
                else harness.flops(run, every_stage=True))
        rows[label] = {**mean, "steps": len(run.steps), "batch": shape.batch, "n": shape.n,
                       "keep_ratio_effective": None if kept[0] is None else sum(kept) / len(kept),
                       "flops_vs_grpo": harness.flops(run) / grpo}
    for label in ("legacy, plain GRPO", "v1, plain GRPO"):
        assert rows[label]["flops_vs_grpo"] == pytest.approx(1.0)
    results = {"what": "verl 0.9.1's own fit() on 2 CPU ranks (tests/test_verl_fit.py)",
               "keep_ratio": KEEP_RATIO, "ranks": SMALL.ranks, "rows": rows}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    STAGE_TABLE.write_text(stage_table(results))
    assert rows["legacy, LZE"]["update"] == KEPT[SMALL] * SMALL.n


def stage_table(results: dict) -> str:
    """The rows-per-stage table of ``results`` (verl_fit.json) in Markdown."""
    lines = ["Rows each stage of verl's own `fit()` received on its two CPU ranks together, mean per "
             "step,\nthe effective keep ratio and the FLOPs proxy against plain GRPO (the same "
             "rollouts through every\nstage; for refill, the GRPO run of its B). Written by "
             "`tests/test_verl_fit.py::test_stage_table`\nfrom `verl_fit.json`.", "",
             "| verl trainer, method | B x n | steps | rollout | old log-probs | reference | "
             "update | keep ratio | FLOPs / GRPO |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in results["rows"].items():
        ratio = "1" if r["keep_ratio_effective"] is None else f"{r['keep_ratio_effective']:.3g}"
        cells = " | ".join(f"{r[stage]:.3g}" for stage in STAGES)
        lines.append(f"| {label} | {r['batch']} x {r['n']} | {r['steps']} | {cells} | {ratio} | "
                     f"{r['flops_vs_grpo']:.2f} |")
    return "\n".join(lines) + "\n"

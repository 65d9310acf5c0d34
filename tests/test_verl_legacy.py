"""LZE selection in verl's legacy RayPPOTrainer, through the installed verl's own code paths.

Runs where verl is installed (``make test-verl``: verl 0.9.1 in .venv-verl); skipped elsewhere.
verl's functions and classes run as they are: ``DataProto``, its registry
(``register_adv_est`` / ``get_adv_estimator_fn``), ``ray_trainer.compute_advantage``, the
trainer's ``_get_gen_batch``, ``_balance_batch``, ``_save_checkpoint`` and ``_load_checkpoint``,
torchdata's ``StatefulDataLoader`` with verl's ``collate_fn``. The boundary on a CPU: the Ray
worker groups (FSDP actor, vLLM rollout), so the trainer object is made without ``__init__``
and told the data-parallel size the actor's worker group would report; its worker group saves
and loads nothing. (``fit`` itself, with every stage's row count, is tests/test_verl_fit.py.)
"""

import copy
import itertools
import os
import types
from collections import Counter
import uuid

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("verl")

from crafted_state import Payload, same  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels.greso import GresoConfig, GresoFilter  # noqa: E402
from lze_kernels.integrations.verl import LZEAdvantage  # noqa: E402
from lze_kernels.integrations.verl.forward import ForwardSampler  # noqa: E402
from lze_kernels.layout import SEEN  # noqa: E402
from lze_kernels.integrations.verl.legacy import (SELECTION_FILE,  # noqa: E402
                                                  LZERayPPOTrainer, check_settings)
from lze_kernels.integrations.verl.rows import select_on_rows  # noqa: E402
from lze_kernels.serialization import UnsafeStateFileError  # noqa: E402

GROUP, LENGTH = 4, 6
CONFIG = LZEConfig(keep_ratio=0.5, noise_scale=0.0)


@pytest.fixture
def registered():
    """Register estimators under fresh names in verl's registry; remove them afterwards."""
    names = []

    def register(estimator):
        name = f"lze_test_{uuid.uuid4().hex[:8]}"
        estimator.register(name)
        names.append(name)
        return name

    yield register
    for name in names:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)


class NoWorkers:
    """The actor's worker group at the Ray boundary: its checkpoint files are not this test's."""

    def save_checkpoint(self, *args, **kwargs):
        pass

    def load_checkpoint(self, *args, **kwargs):
        pass


def trainer_config(estimator="grpo", mini=2, batch=8, checkpoints="ckpt", balance=True,
                   prefix_grouper=False):
    """The parts of verl's trainer config the hooks and verl's checkpoint methods read."""
    return OmegaConf.create({
        "algorithm": {"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini,
                                        "use_prefix_grouper": prefix_grouper,
                                        "checkpoint": {"async_save": False}},
                              "rollout": {"n": GROUP}},
        "data": {"train_batch_size": batch},
        "trainer": {"balance_batch": balance, "default_local_dir": str(checkpoints),
                    "default_hdfs_dir": None, "resume_mode": "auto", "resume_from_path": None,
                    "del_local_ckpt_after_load": False}})


def trainer_without_workers(dp_size=2, dataloader=None, **config):
    """verl's trainer object up to its Ray boundary: no worker groups, the dp size given."""
    trainer = object.__new__(LZERayPPOTrainer)
    trainer.config = trainer_config(**config)
    trainer.use_prefix_grouper = trainer.config.actor_rollout_ref.actor.use_prefix_grouper
    trainer.train_dataloader = dataloader or types.SimpleNamespace(sampler=None, num_workers=0)
    trainer._get_dp_size = lambda worker_group, role: dp_size
    trainer.actor_rollout_wg = NoWorkers()
    trainer.use_critic = trainer.use_rm = False
    trainer._binding = None
    trainer._validating = False
    trainer.rows = None  # no train set: the rows are not checked against one
    trainer.global_steps = 0
    return trainer


def outcome_rewards(pass_counts, lengths):
    """A binary outcome reward on each response's last token, the first c of a group right."""
    solved = torch.cat([torch.arange(GROUP) < c for c in pass_counts]).float()
    return torch.zeros(len(lengths), LENGTH).scatter_(1, (lengths - 1)[:, None], solved[:, None])


ROW_OF_UID = {}  # every uid fit_batch made -> its dataset row (the trainer uses its binding up)


def prompt_of(row):
    """The prompt at ``row`` of the train set these tests stand in for."""
    return [{"role": "user", "content": f"prompt {row}"}]


def object_array(values):
    """A numpy object array of ``values`` (lists kept whole), as verl's collate_fn makes."""
    values = list(values)
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def fit_batch(trainer, pass_counts, rows, seed=0, scored=True, prompts=None):
    """A step's batch the way legacy ``fit`` holds it at ``_balance_batch``: fresh uuid4 uids
    (``_get_gen_batch`` has run on the prompts and moved the dataset rows out), repeated per
    rollout (``repeat(interleave=True)``), right-padded responses, the agent loop's rewards in
    ``rm_scores``. ``prompts``: each group's prompt (default: the prompt at its row)."""
    prompts = [prompt_of(r) for r in rows] if prompts is None else prompts
    prompts = DataProto.from_dict(
        {"input_ids": torch.zeros(len(rows), 3, dtype=torch.long)},
        non_tensors={"uid": np.array([str(uuid.uuid4()) for _ in rows], dtype=object),
                     "index": np.array(rows, dtype=object), "raw_prompt": object_array(prompts)})
    trainer._get_gen_batch(prompts)
    ROW_OF_UID.update(zip(prompts.non_tensor_batch["uid"], rows))
    batch = prompts.repeat(GROUP, interleave=True)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (len(batch),), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    tensors = {"response_mask": mask,
               "attention_mask": torch.cat([torch.ones(len(batch), 3, dtype=torch.long), mask],
                                           dim=1)}
    if scored:
        tensors["rm_scores"] = outcome_rewards(pass_counts, lengths)
    batch.batch = DataProto.from_dict(tensors).batch
    return batch


def rows_in(trainer, batch):
    return sorted({ROW_OF_UID[uid] for uid in batch.non_tensor_batch["uid"]})


def advantages(batch, estimator_name, norm=True):
    batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
    out = compute_advantage(batch, adv_estimator=estimator_name,
                            config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
                            norm_adv_by_std_in_grpo=norm)
    return out.batch["advantages"]


def group_rewards(pass_counts):
    return torch.stack([(torch.arange(GROUP) < c).float() for c in pass_counts])


# ----------------------------------------------------------------------------- dropping rows


def test_the_kept_groups_alone_reach_the_update_as_plain_grpo(registered):
    """Three steps through the hooks: after _balance_batch only the k = 4 of 8 groups an
    independent LZESelector keeps remain (k x n = 16 rows go on to the log-prob passes and the
    update), their tokens are the batch's tokens, and compute_advantage with the registered
    estimator gives exactly verl's own grpo on that batch: plain GRPO on the kept groups."""
    rows = [5, 0, 9, 2, 7, 3, 11, 6]
    counts = [0, 1, 2, 4, 3, 2, 1, 3]
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    oracle = LZESelector(12, CONFIG)
    for step in range(3):
        batch = fit_batch(trainer, counts, rows, seed=step)
        metrics = {}
        trainer._balance_batch(batch, metrics=metrics)
        expected = oracle.step(group_rewards(counts), torch.tensor(rows))
        kept = sorted(rows[i] for i in expected.kept_indices.tolist() if i >= 0)
        assert rows_in(trainer, batch) == kept and len(kept) == 4
        assert len(batch) == 4 * GROUP == metrics["lze/rows_past_reward"]
        assert metrics["lze/groups_rolled_out"] == 8
        assert metrics["lze/score_mean_rolled_out"] == pytest.approx(sum(counts) / (8 * GROUP))
        got = advantages(batch, trainer.config.algorithm.adv_estimator)
        torch.testing.assert_close(got, advantages(batch, "grpo"), rtol=0, atol=1e-6)
        assert got.abs().sum() > 0
        counts = counts[1:] + counts[:1]  # the prompts' pass counts change between steps


def test_the_cut_batch_holds_the_kept_groups_whole(registered):
    """Rows leave the batch as whole groups, each kept response with the fields it had."""
    trainer = trainer_without_workers(estimator=registered(LZEAdvantage(12, CONFIG)))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])

    def responses(b):
        return Counter((uid, tuple(b.batch["rm_scores"][i].tolist()),
                        tuple(b.batch["attention_mask"][i].tolist()))
                       for i, uid in enumerate(b.non_tensor_batch["uid"]))

    before = responses(batch)
    trainer._balance_batch(batch, metrics={})
    after = responses(batch)
    assert not after - before and after.total() == len(batch)
    _, sizes = np.unique(batch.non_tensor_batch["uid"], return_counts=True)
    assert sizes.tolist() == [GROUP] * 4


def test_fewer_groups_with_energy_than_k_are_filled_by_the_next_ones(registered):
    """Two of eight groups have mixed rewards (energy > 0); k = 4 are kept: those two, then the
    next groups by energy (all zero: batch order). Their advantages are zero, as plain GRPO on
    the same four groups gives them."""
    rows = [5, 0, 9, 2, 7, 3, 11, 6]
    counts = [4, 0, 2, 4, 0, 1, 4, 0]
    trainer = trainer_without_workers(estimator=registered(LZEAdvantage(12, CONFIG)))
    batch = fit_batch(trainer, counts, rows)
    trainer._balance_batch(batch, metrics={})
    assert rows_in(trainer, batch) == sorted([9, 3, 5, 0])
    got = advantages(batch, trainer.config.algorithm.adv_estimator)
    torch.testing.assert_close(got, advantages(batch, "grpo"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("keep_ratio, mini, dp, prefix_grouper, kept", [
    (0.5, 1, 1, False, 4), (0.5, 2, 8, False, 4),  # floor(8 x 0.5) = 4 is whole mini-batches
    (0.375, 2, 1, False, 4), (0.375, 4, 2, False, 4),  # 3 rounded up to whole mini-batches
    (0.625, 4, 2, False, 4),  # 5 rounded down
    (0.5, 8, 2, False, 8),  # ppo_mini_batch_size = train_batch_size: one mini-batch, every group
    (0.375, 1, 2, False, 3), (0.375, 1, 2, True, 4)])  # prefix grouper: whole groups per rank
def test_k_is_keep_ratio_in_whole_mini_batches(registered, keep_ratio, mini, dp,
                                               prefix_grouper, kept):
    """B = 8, n = 4: k = floor(B x keep_ratio) rounded to the nearest multiple of the groups
    verl can split (ppo_mini_batch_size, rows divisible by dp; with use_prefix_grouper, groups
    divisible by dp), filled by energy when rounded up; verl's own _balance_batch (its
    group-level balancing under the prefix grouper) takes the cut batch; the effective ratio is
    logged. Nothing plain GRPO accepts is refused."""
    config = LZEConfig(keep_ratio=keep_ratio, noise_scale=0.0)
    trainer = trainer_without_workers(dp_size=dp, mini=mini, prefix_grouper=prefix_grouper,
                                      estimator=registered(LZEAdvantage(12, config)))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])
    metrics = {}
    trainer._balance_batch(batch, metrics=metrics)
    assert len(batch) == kept * GROUP and len(batch) % dp == 0
    assert metrics["lze/keep_ratio_effective"] == kept / 8
    assert metrics["lze/rows_past_reward"] == kept * GROUP


def test_the_keep_ratio_holds_at_b_1024_with_mini_batches_of_256(registered):
    """The issue's case: B = 1,024 prompts, ppo_mini_batch_size 256, keep_ratio 0.4, 8 ranks:
    k0 = 409 rounds to 2 mini-batches, 512 groups (0.5, within 0.4 +/- 256 / 1,024 / 2) where
    the largest multiple below k0 kept 256 (0.25); the step logs it, and the 512 are the 409
    the selector keeps and the next 103 by energy."""
    batch_size = 1024
    config = LZEConfig(keep_ratio=0.4, noise_scale=0.0)
    lze = LZEAdvantage(batch_size, config)
    trainer = trainer_without_workers(dp_size=8, mini=256, batch=batch_size,
                                      estimator=registered(lze))
    rows = torch.randperm(batch_size, generator=torch.Generator().manual_seed(0)).tolist()
    counts = [1 + row % 3 for row in rows]  # every group mixed: energy > 0
    batch = fit_batch(trainer, counts, rows)
    metrics = {}
    trainer._balance_batch(batch, metrics=metrics)
    assert metrics["lze/keep_ratio_effective"] == 0.5
    assert abs(metrics["lze/keep_ratio_effective"] - 0.4) <= 256 / batch_size / 2
    assert len(batch) == 512 * GROUP
    oracle = LZESelector(batch_size, config).step(group_rewards(counts), torch.tensor(rows))
    top = {rows[i] for i in torch.nonzero(oracle.keep_mask).view(-1).tolist()}
    assert len(top) == 409 and top <= set(rows_in(trainer, batch))


def test_dapo_keeps_the_mixed_groups_filled_to_a_multiple(registered):
    """DAPO keeps the 3 groups with unequal rewards, filled to 4 (a multiple of 2)."""
    trainer = trainer_without_workers(estimator=registered(LZEAdvantage(method="dapo")))
    batch = fit_batch(trainer, [4, 1, 0, 2, 4, 3, 0, 0], [5, 0, 9, 2, 7, 3, 11, 6])
    trainer._balance_batch(batch, metrics={})
    assert rows_in(trainer, batch) == sorted([0, 2, 3, 5])


def test_a_colocated_reward_model_scores_before_the_selection(registered):
    """With a colocated reward model the batch reaches _balance_batch unscored: the hook scores
    it there (fit then finds rm_scores and does not score again); without one it is refused."""
    trainer = trainer_without_workers(estimator=registered(LZEAdvantage(12, CONFIG)))
    counts = [0, 1, 2, 4, 3, 2, 1, 3]
    batch = fit_batch(trainer, counts, [5, 0, 9, 2, 7, 3, 11, 6], scored=False)
    with pytest.raises(ValueError, match="rm_scores"):
        trainer._balance_batch(batch, metrics={})
    calls = []

    def reward_model(unscored):
        calls.append(len(unscored))
        lengths = unscored.batch["response_mask"].sum(-1)
        return DataProto.from_dict({"rm_scores": outcome_rewards(counts, lengths)})

    trainer.use_rm, trainer._compute_reward_colocate = True, reward_model
    trainer._balance_batch(batch, metrics={})
    assert calls == [8 * GROUP] and len(batch) == 4 * GROUP and "rm_scores" in batch.batch.keys()


def test_compute_advantage_refuses_a_group_the_selection_dropped(registered):
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])
    full = batch.select_idxs(np.arange(len(batch)))
    trainer._balance_batch(batch, metrics={})
    with pytest.raises(ValueError, match="dropped"):
        advantages(full, trainer.config.algorithm.adv_estimator)


def test_a_dataset_without_row_indices_is_refused_at_every_step_with_the_fix(registered):
    """verl fills a missing extra_info.index with 0, so every group carries row 0 with its own
    prompt: refused at any step (here after a step of right rows), saying how to write
    extra_info.index, with the selector's state and the batch unchanged; a batch with no index
    field at all likewise, when the step binds it."""
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    trainer._balance_batch(fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6]),
                           metrics={})
    before = copy.deepcopy(lze.state_dict())
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [0] * 8,
                      prompts=[prompt_of(r) for r in range(8)])
    with pytest.raises(ValueError, match=r"different prompts carry dataset row 0.*"
                                         r"extra_info\.index.*with_indices=True"):
        trainer._balance_batch(batch, metrics={})
    assert same(lze.state_dict(), before) and len(batch) == 8 * GROUP
    unindexed = DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)},
                                    non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(ValueError, match=r"index: .*extra_info\.index"):
        trainer._get_gen_batch(unindexed)


def test_groups_of_unequal_size_are_refused_naming_the_agent_loop(registered):
    """A group that lost a response (an agent loop that drops or splits trajectories) breaks
    the whole-mini-batch arithmetic: refused naming the agent-loop setting, state unchanged."""
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])
    short = batch.select_idxs(np.arange(len(batch) - 1))
    before = copy.deepcopy(lze.state_dict())
    with pytest.raises(ValueError, match="3 to 4 responses.*default_agent_loop"):
        trainer._balance_batch(short, metrics={})
    assert same(lze.state_dict(), before)


def test_the_uid_binding_is_used_up_by_the_selection_that_used_it(registered):
    """A selection rejected for bad rewards keeps the step's binding (the corrected retry
    runs); a selection that succeeds uses it up, so a second _balance_batch on the step's batch
    is refused instead of selecting (and updating the state) again."""
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])
    batch.batch["rm_scores"] *= 2
    with pytest.raises(ValueError, match="rewards"):
        trainer._balance_batch(batch, metrics={})
    batch.batch["rm_scores"] /= 2
    trainer._balance_batch(batch, metrics={})
    after = copy.deepcopy(lze.state_dict())
    with pytest.raises(ValueError, match="selects once per step"):
        trainer._balance_batch(batch, metrics={})
    assert same(lze.state_dict(), after) and len(batch) == 4 * GROUP


def test_a_row_drawn_twice_selects_by_group(registered):
    """Row 5 comes in two groups, one all wrong and one all right: one observation (pass rate
    1/2 over its eight rollouts, the highest energy, the row the selector keeps), but neither
    group can learn (zero advantages), so the k = 2 slots go to the groups with mixed rewards,
    rows 7 and 9, and the update is plain GRPO on them."""
    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(dp_size=1, mini=1, batch=4, estimator=registered(lze))
    batch = fit_batch(trainer, [0, 3, 4, 3], [5, 7, 5, 9])
    trainer._balance_batch(batch, metrics={})
    merged = torch.cat([group_rewards([0, 3, 3]),
                        torch.cat([group_rewards([4]), torch.zeros(2, GROUP)])], dim=1)
    valid = torch.cat([torch.ones(3, GROUP, dtype=torch.bool),
                       torch.tensor([[True], [False], [False]]).expand(3, GROUP)], dim=1)
    oracle = LZESelector(12, CONFIG)
    assert oracle.step(merged, torch.tensor([5, 7, 9]), valid).keep_mask.tolist() == [
        True, False, False]  # the selector's pick: row 5
    assert torch.equal(lze.selector.state.fstate, oracle.state.fstate)  # one update per row
    assert lze.selector.state.istate[[5, 7, 9], SEEN].tolist() == [1, 1, 1]
    assert rows_in(trainer, batch) == [7, 9]
    got = advantages(batch, trainer.config.algorithm.adv_estimator)
    torch.testing.assert_close(got, advantages(batch, "grpo"), rtol=0, atol=1e-6)
    assert bool((got.abs().sum(dim=1) > 0).all())


def test_settings_that_break_the_selection_are_refused(registered):
    lze = LZEAdvantage(12, CONFIG)
    loader = types.SimpleNamespace(sampler=None, num_workers=0)
    with pytest.raises(ValueError, match="trainer.balance_batch"):
        check_settings(trainer_config(balance=False), loader, lze)
    check_settings(trainer_config(balance=False), loader, None)  # nothing to select
    sampler = ForwardSampler(12, 4, "pruner", selector=LZESelector(12, CONFIG))
    with pytest.raises(ValueError, match="dataloader_num_workers"):
        check_settings(trainer_config(), types.SimpleNamespace(sampler=sampler, num_workers=2),
                       lze)
    with pytest.raises(ValueError, match="train_sampler: the pruner"):
        check_settings(trainer_config(), types.SimpleNamespace(sampler=sampler, num_workers=0),
                       lze)


def test_selection_off_equals_verls_grpo_after_balance_batch(registered):
    """The estimator called on a whole batch that verl's own _balance_batch reordered, with
    selection off (zero_dropped=False): verl's grpo."""
    trainer = trainer_without_workers(dp_size=4)
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2], [5, 0, 9, 2, 7, 3])
    RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    for method in ("lze", "dapo"):
        lze = LZEAdvantage(10, CONFIG, method=method)
        name = registered(lze)
        rows = [ROW_OF_UID[u] for u in batch.non_tensor_batch["uid"]]
        lze.bind_uids(batch.non_tensor_batch["uid"], rows,
                      object_array(prompt_of(r) for r in rows))
        torch.testing.assert_close(advantages(batch, name), advantages(batch, "grpo"),
                                   rtol=0, atol=1e-6)


def estimator_step(name, rows, prompts, pass_counts):
    """One step of a user's own loop around the estimator alone: bind_uids on the prompts' batch
    (uid, index, raw_prompt), the rollout, verl's compute_advantage."""
    estimator = core_algos.get_adv_estimator_fn(name)
    uids = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    estimator.bind_uids(uids, np.array(rows, dtype=object), object_array(prompts))
    lengths = torch.full((len(rows) * GROUP,), LENGTH)
    batch = DataProto.from_dict({"response_mask": torch.ones(len(lengths), LENGTH,
                                                             dtype=torch.long),
                                 "rm_scores": outcome_rewards(pass_counts, lengths)},
                                non_tensors={"uid": np.repeat(uids, GROUP)})
    return advantages(batch, name)


def test_the_estimator_alone_refuses_rows_that_cannot_be_right_at_every_step(registered):
    """bind_uids then verl's compute_advantage: after a step of right rows, a batch whose groups
    all carry row 0 with their own prompts (a dataset without extra_info.index), one whose two
    prompts share a row, and one with a row outside [0, N) are each refused, the selector's
    state unchanged; one prompt drawn for every group is one observation of its row."""
    lze = LZEAdvantage(12, CONFIG)
    name = registered(lze)
    counts = [0, 1, 3, 2]
    estimator_step(name, [5, 0, 9, 2], [prompt_of(r) for r in (5, 0, 9, 2)], counts)
    before = copy.deepcopy(lze.state_dict())
    for rows, prompts, says in (
            ([0, 0, 0, 0], [5, 0, 9, 2], r"different prompts carry dataset row 0.*extra_info"),
            ([5, 0, 5, 2], [5, 0, 9, 2], "different prompts carry dataset row 5"),
            ([5, 0, 12, 2], [5, 0, 9, 2], r"expected dataset rows in \[0, 12\)")):
        with pytest.raises(ValueError, match=says):
            estimator_step(name, rows, [prompt_of(r) for r in prompts], counts)
        assert same(lze.state_dict(), before)
    estimator_step(name, [3] * 4, [prompt_of(3)] * 4, counts)
    assert int(lze.selector.state.step_counter[0]) == 2
    assert lze.selector.state.istate[:12, SEEN].tolist() == [int(r in (0, 2, 3, 5, 9))
                                                           for r in range(12)]


# ----------------------------------------------------------------------------- forward sampler

NUM_PROMPTS, BATCH = 12, 4


def loader(sampler, num_workers=0, num_prompts=NUM_PROMPTS, batch=BATCH):
    """verl's legacy train dataloader: StatefulDataLoader, verl's collate_fn, the sampler given
    as ``train_sampler``, batches of train_batch_size, drop_last."""
    dataset = [{"index": i, "input_ids": torch.tensor([i])} for i in range(num_prompts)]
    return StatefulDataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True,
                              collate_fn=collate_fn, num_workers=num_workers)


def rows_of(batch_dict):
    return [int(i) for i in batch_dict["index"]]


def counts_of(rows, pass_rate):
    return [round(pass_rate[r] * GROUP) for r in rows]


def test_pruner_skips_the_pruned_prompts():
    """Prompts solved in prune_after=2 consecutive passes are pruned; with replay_ratio 0 the
    next pass of verl's dataloader never yields them, the others keep their permutation order."""
    config = LZEConfig(keep_ratio=0.5, noise_scale=0.0, prune_after=2, replay_ratio=0.0)
    selector = LZESelector(NUM_PROMPTS, config)
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "pruner", seed=3, selector=selector)
    solved = {2, 5, 11}
    pass_rate = {r: 1.0 if r in solved else 0.5 for r in range(NUM_PROMPTS)}
    data = loader(sampler)
    for _ in range(2):  # two passes, every prompt observed once per pass
        for batch in data:
            rows = rows_of(batch)
            selector.step(group_rewards(counts_of(rows, pass_rate)), torch.tensor(rows))
            sampler.observe(torch.tensor(rows), group_rewards(counts_of(rows, pass_rate)))
    assert set(torch.nonzero(selector.rollout_mask(torch.arange(NUM_PROMPTS)) == 0)
               .view(-1).tolist()) == solved
    third = [row for batch in data for row in rows_of(batch)]
    order = [r for r in torch.randperm(NUM_PROMPTS, generator=torch.Generator().manual_seed(
        3 * 1_000_003 + 2)).tolist() if r not in solved]
    assert third[:len(order)] == order  # the pass of 9 unpruned prompts, in permutation order
    assert not solved & set(third[:len(order)])


def test_greso_skips_the_streaked_prompts():
    """GRESO: prompts whose groups were all right 30 times in a row are kept with probability
    0.01 (p_easy^30 < 0.01); the sampler yields exactly the rows its seeded draw keeps."""
    greso = GresoFilter(NUM_PROMPTS, GresoConfig(seed=7))
    easy = torch.tensor([1, 6, 8])
    for _ in range(30):
        greso.observe(easy, torch.ones(3, GROUP), torch.ones(3, GROUP, dtype=torch.bool))
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "greso", seed=1, greso=greso)
    first = rows_of(next(iter(loader(sampler))))
    perm = torch.randperm(NUM_PROMPTS, generator=torch.Generator().manual_seed(1 * 1_000_003))
    keep = greso.rollout_mask(perm, 0)
    assert first == perm[keep][:BATCH].tolist()
    assert not set(first) & set(easy.tolist())
    assert greso.keep_probability(easy).max() == pytest.approx(0.01)


def test_dots_favours_prompts_predicted_near_half():
    """DOTS with one-hot embeddings: an observed prompt is predicted at its own pass rate, so
    the one observed at 1/2 comes first, the ones at 0 and 1 not at all in the next batch."""
    embeddings = torch.eye(NUM_PROMPTS) * 20.0
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "dots", seed=0, embeddings=embeddings,
                             tau=1e-3, attention_tau=0.1)
    data = loader(sampler)
    it = iter(data)
    first = rows_of(next(it))
    rates = {first[0]: 0.0, first[1]: 1.0, first[2]: 0.5, first[3]: 1.0}
    sampler.observe(torch.tensor(first), group_rewards(counts_of(first, rates)))
    second = rows_of(next(it))
    assert second[0] == first[2]
    assert not {first[0], first[1], first[3]} & set(second)


def test_the_hook_feeds_the_sampler_every_group_generated(registered):
    """_balance_batch gives the forward sampler all eight groups (GRESO's streaks move for the
    rows of all-right or all-wrong groups), before LZE drops four of them."""
    greso = GresoFilter(NUM_PROMPTS)
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "greso", greso=greso)
    trainer = trainer_without_workers(dataloader=loader(sampler),
                                      estimator=registered(LZEAdvantage(NUM_PROMPTS, CONFIG)))
    rows = [3, 9, 0, 1, 4, 5, 6, 7]
    batch = fit_batch(trainer, [4, 0, 2, 1, 3, 4, 2, 0], rows)
    trainer._balance_batch(batch, metrics={})
    assert len(batch) == 4 * GROUP
    streaked = {3, 9, 5, 7}
    assert greso.streak.tolist() == [int(r in streaked) for r in range(NUM_PROMPTS)]
    assert greso.kind[3] == 1 and greso.kind[9] == 2


@pytest.mark.parametrize("method", ["pruner", "greso", "dots"])
def test_observe_refuses_bad_rows_and_leaves_the_state(method):
    """Row -1 (which would write the last row), row N (a bare IndexError), fractional ids and
    rewards out of [0, 1]: ValueError naming the argument, the sampler's state unchanged."""
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, method, selector=LZESelector(NUM_PROMPTS),
                             greso=GresoFilter(NUM_PROMPTS), embeddings=torch.eye(NUM_PROMPTS))
    sampler.observe(torch.tensor([1, 2]), group_rewards([1, 3]))
    before = sampler.state_dict()
    for rows, rewards, name in [([-1, 2], group_rewards([1, 3]), "prompt_ids"),
                                ([1, NUM_PROMPTS], group_rewards([1, 3]), "prompt_ids"),
                                (torch.tensor([0.7, 2.0]), group_rewards([1, 3]), "prompt_ids"),
                                ([1, 2], group_rewards([1, 3]) * 2, "rewards"),
                                ([1, 2], group_rewards([1])[:1], "rewards")]:
        ids = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows)
        with pytest.raises(ValueError, match=name):
            sampler.observe(ids, rewards)
    assert same(sampler.state_dict(), before)


@pytest.mark.parametrize("method", ["pruner", "greso", "dots"])
def test_a_first_observation_of_one_row_only_is_refused_with_the_fix(method):
    """A forward sampler's first observation whose groups all carry one row (a dataset without
    extra_info.index) is refused, naming the fix, before any state changes; once the sampler
    has observed a step, a batch may repeat one row (a pruner with one prompt left)."""
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, method, selector=LZESelector(NUM_PROMPTS),
                             greso=GresoFilter(NUM_PROMPTS), embeddings=torch.eye(NUM_PROMPTS))
    before = sampler.state_dict()
    with pytest.raises(ValueError, match=r"prompt_ids: .*extra_info\.index"):
        sampler.observe(torch.tensor([0, 0, 0]), group_rewards([1, 3, 2]))
    assert same(sampler.state_dict(), before)
    sampler.observe(torch.tensor([1, 2]), group_rewards([1, 3]))
    sampler.observe(torch.tensor([4, 4]), group_rewards([1, 3]))


# ----------------------------------------------------------------------------- repeated rows


def run_legacy(trainer, data, steps, pass_rate, start_step=0, record=None, save_at=None,
               balance=True):
    """Drive the hooks as legacy fit does, epoch by epoch over verl's dataloader: per step the
    prompts' rewards by their fixed pass rates, _balance_batch (``balance=False``: the
    selection alone, without verl's own balancing after it), and verl's _save_checkpoint at
    ``save_at``. Records (rows drawn, rows kept) per step."""
    record = [] if record is None else record
    step = start_step
    while step < steps:
        for batch_dict in data:
            step += 1
            trainer.global_steps = step
            rows = rows_of(batch_dict)
            batch = fit_batch(trainer, counts_of(rows, pass_rate), rows, seed=step)
            if balance:
                trainer._balance_batch(batch, metrics={})
            else:
                trainer.select_rows(batch, metrics={})
            record.append((rows, rows_in(trainer, batch)))
            if step == save_at:
                trainer._save_checkpoint()
            if step == steps:
                break
    return record


def forward_parts(method, num_prompts, batch, seed, config):
    selector_lze = LZEAdvantage(num_prompts, config)
    sampler = ForwardSampler(num_prompts, batch, method, seed=seed, selector=selector_lze.selector,
                             greso=GresoFilter(num_prompts, GresoConfig(seed=seed)),
                             embeddings=torch.randn(num_prompts, 8, generator=torch.Generator()
                                                    .manual_seed(seed)))
    return selector_lze, sampler


@pytest.mark.parametrize("method", ["pruner", "greso", "dots"])
def test_small_data_over_many_passes_never_stops(registered, method):
    """The README's pruner set-up on small data (most prompts solved, so pruned after two
    passes, and batches span passes and repeat rows), GRESO and DOTS likewise: ten seeds,
    30 steps each through the hooks, no error; repeated rows occur and are kept whole."""
    pass_rate = {r: 1.0 if r % 3 else 0.5 for r in range(NUM_PROMPTS)}
    config = LZEConfig(keep_ratio=0.5, prune_after=2, replay_ratio=0.1, seed=1)
    repeats = 0
    for seed in range(10):
        lze, sampler = forward_parts(method, NUM_PROMPTS, BATCH, seed, config)
        trainer = trainer_without_workers(dataloader=loader(sampler), mini=1, batch=BATCH,
                                          estimator=registered(lze))
        for drawn, kept in run_legacy(trainer, loader(sampler), 30, pass_rate):
            repeats += len(drawn) != len(set(drawn))
            assert set(kept) <= set(drawn)
    if method != "dots":  # DOTS draws each batch without replacement
        assert repeats > 0


@pytest.mark.slow
def test_readme_scale_three_passes_twenty_seeds_never_stops(registered):
    """N = 7,473, B = 128 (the README's GSM8K set-up), the forward pruner's permutation: its
    batch 59 spans the first and second pass. For 20 sampler seeds over 3 passes every step's
    selection runs (the sampler observing each step, as the hook feeds it), and the seeds whose
    batch repeats a row are the expected share (1 - exp(-49 x 79 / 7,473) ~ 0.40 of them); one
    seed runs every step through the trainer's hooks."""
    num_prompts, batch = 7473, 128
    pass_rate = {r: (r % 5) / 4 for r in range(num_prompts)}
    config = LZEConfig(keep_ratio=0.5, seed=0)
    steps = 3 * num_prompts // batch
    seeds_with_repeats = 0
    for seed in range(20):
        lze, sampler = forward_parts("pruner", num_prompts, batch, seed, config)
        data = loader(sampler, num_prompts=num_prompts, batch=batch)
        if seed == 0:
            trainer = trainer_without_workers(dataloader=data, mini=16, batch=batch,
                                              estimator=registered(lze))
            record = run_legacy(trainer, data, steps, pass_rate, balance=False)
        else:
            record = run_selection(lze, sampler, data, steps, pass_rate)
        assert len(record) == steps and all(len(set(kept)) <= 64 for _, kept in record)
        seeds_with_repeats += any(len(d) != len(set(d)) for d, _ in record)
    assert 3 <= seeds_with_repeats <= 16


def run_selection(lze, sampler, data, steps, pass_rate):
    """What the hook does each step, on the rows the dataloader draws: the selection on the
    step's groups (a repeated row one observation), the sampler fed every group."""
    record = []
    while len(record) < steps:
        for batch_dict in data:
            rows = rows_of(batch_dict)
            rewards = group_rewards(counts_of(rows, pass_rate))
            selection = select_on_rows("lze", lze.selector, rewards, None, np.array(rows))
            sampler.observe(torch.tensor(rows), rewards)
            record.append((rows, [r for r, kept in zip(rows, selection.keep.tolist()) if kept]))
            if len(record) == steps:
                break
    return record


# ----------------------------------------------------------------------------- resume


def resume_parts(method, tmp_path, registered, name=None):
    """A fresh process's selection parts, trainer and dataloader (the same seeds)."""
    config = LZEConfig(keep_ratio=0.5, noise_scale=0.1, seed=4, prune_after=1, replay_ratio=0.5)
    lze = LZEAdvantage(NUM_PROMPTS, config)
    if method == "estimator":
        sampler = SequentialSampler(range(NUM_PROMPTS))
    else:
        _, sampler = forward_parts(method, NUM_PROMPTS, BATCH, 5, config)
        sampler.selector = lze.selector
    if name is None:
        name = registered(lze)
    else:
        core_algos.ADV_ESTIMATOR_REGISTRY[name] = lze  # the resumed process registers anew
    data = loader(sampler)
    trainer = trainer_without_workers(dataloader=data, mini=1, batch=BATCH, estimator=name,
                                      checkpoints=tmp_path)
    return trainer, data, lze


@pytest.mark.parametrize("method", ["estimator", "pruner", "greso", "dots"])
@pytest.mark.parametrize("save_at", [3, 5])  # an epoch boundary (3 steps per epoch), mid-epoch
def test_resume_continues_the_identical_selections(tmp_path, registered, method, save_at):
    """verl's own _save_checkpoint at step ``save_at``, then a fresh trainer's verl
    _load_checkpoint: at an epoch boundary verl skips data.pt, and the selection state comes
    back from lze_selection.pt; either way the resumed run draws and keeps exactly what the
    uninterrupted run does."""
    pass_rate = {r: (r % 5) / 4 for r in range(NUM_PROMPTS)}
    trainer, data, lze = resume_parts(method, tmp_path, registered)
    record = run_legacy(trainer, data, 9, pass_rate, save_at=save_at)
    assert os.path.exists(tmp_path / f"global_step_{save_at}" / SELECTION_FILE)

    name = trainer.config.algorithm.adv_estimator
    resumed, data2, lze2 = resume_parts(method, tmp_path, registered, name=name)
    resumed._load_checkpoint()
    assert resumed.global_steps == save_at
    saved = torch.load(tmp_path / f"global_step_{save_at}" / SELECTION_FILE, weights_only=True)
    assert torch.equal(lze2.selector.state.step_counter,
                       saved["estimator"]["selector"]["step_counter"])
    assert int(lze2.selector.state.step_counter[0]) == save_at  # not back at 0
    rest = run_legacy(resumed, data2, 9, pass_rate, start_step=save_at)
    assert rest == record[save_at:]


def test_a_checkpoint_without_the_selection_file_is_refused(tmp_path, registered):
    trainer, data, _ = resume_parts("greso", tmp_path, registered)
    run_legacy(trainer, data, 3, {r: 0.5 for r in range(NUM_PROMPTS)}, save_at=3)
    os.remove(tmp_path / "global_step_3" / SELECTION_FILE)
    resumed, _, _ = resume_parts("greso", tmp_path, registered,
                                 name=trainer.config.algorithm.adv_estimator)
    with pytest.raises(ValueError, match=SELECTION_FILE):
        resumed._load_checkpoint()


def test_a_crafted_selection_file_is_refused_and_never_runs(tmp_path, registered):
    trainer, data, _ = resume_parts("greso", tmp_path, registered)
    run_legacy(trainer, data, 3, {r: 0.5 for r in range(NUM_PROMPTS)}, save_at=3)
    marker = tmp_path / "ran"
    torch.save(Payload(marker), tmp_path / "global_step_3" / SELECTION_FILE)
    resumed, _, _ = resume_parts("greso", tmp_path, registered,
                                 name=trainer.config.algorithm.adv_estimator)
    with pytest.raises(UnsafeStateFileError, match="builtins.exec"):
        resumed._load_checkpoint()
    assert not marker.exists()


# ----------------------------------------------------------------------------- one step a batch


def test_the_selector_steps_once_per_batch_whatever_raises_after_it(registered, monkeypatch):
    """The selector's step and the use of the step's binding commit together: a forward sampler
    whose observe fails after the selector stepped leaves the step taken and the binding used,
    so a retry of _balance_batch on the same batch is refused instead of stepping the selector
    a second time. An observation the sampler refuses is found before the step: nothing
    changes, the binding stays for the retry."""
    lze = LZEAdvantage(NUM_PROMPTS, CONFIG)
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "greso", greso=GresoFilter(NUM_PROMPTS))
    trainer = trainer_without_workers(dataloader=loader(sampler), estimator=registered(lze))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])

    def fails(*args, **kwargs):
        raise RuntimeError("the sampler failed after the selection")

    monkeypatch.setattr(sampler, "observe", fails)
    with pytest.raises(RuntimeError, match="after the selection"):
        trainer._balance_batch(batch, metrics={})
    assert int(lze.selector.state.step_counter[0]) == 1
    with pytest.raises(ValueError, match="selects once per step"):
        trainer._balance_batch(batch, metrics={})
    assert int(lze.selector.state.step_counter[0]) == 1

    small = ForwardSampler(8, BATCH, "greso", greso=GresoFilter(8))  # rows 9 and 11 out of range
    trainer = trainer_without_workers(dataloader=loader(small, num_prompts=8),
                                      estimator=registered(LZEAdvantage(NUM_PROMPTS, CONFIG)))
    batch = fit_batch(trainer, [0, 1, 2, 4, 3, 2, 1, 3], [5, 0, 9, 2, 7, 3, 11, 6])
    estimator = core_algos.get_adv_estimator_fn(trainer.config.algorithm.adv_estimator)
    with pytest.raises(ValueError, match="prompt_ids"):
        trainer._balance_batch(batch, metrics={})
    assert int(estimator.selector.state.step_counter[0]) == 0 and trainer._binding is not None


def test_rows_are_checked_by_their_prompts_before_the_rollout(registered):
    """The trainer holds the train set's row table (each row's prompt key, read at load): a step
    whose prompts arrive at rows that hold other prompts (rows 6-11 carrying the prompts of
    rows 0-5) is refused when _get_gen_batch binds them, before the rollout, with the fix; the
    selector and the previous step's state untouched."""
    from lze_kernels.integrations.verl.row_table import RowTable, prompt_keys

    lze = LZEAdvantage(12, CONFIG)
    trainer = trainer_without_workers(estimator=registered(lze))
    trainer.rows = RowTable(prompt_keys([prompt_of(r) for r in range(12)]),
                            np.array(list(range(6)) * 2))  # two files restarting at 0
    rows, counts = [5, 0, 9, 2, 7, 3, 11, 6], [0, 1, 2, 4, 3, 2, 1, 3]
    trainer._balance_batch(fit_batch(trainer, counts, rows), metrics={})
    after = copy.deepcopy(lze.state_dict())
    with pytest.raises(ValueError, match=r"index: a prompt arrives as row 9, but row 9 of the "
                                         r"train set holds another prompt.*custom_cls"):
        fit_batch(trainer, counts, rows, prompts=[prompt_of(r % 6) for r in rows])
    assert same(lze.state_dict(), after) and trainer._binding is None


def test_validation_batches_are_not_bound(registered):
    """verl's _validate runs _get_gen_batch on validation batches (their rows may carry no
    extra_info.index): the trainer leaves the step's binding alone while it validates."""
    trainer = trainer_without_workers(estimator=registered(LZEAdvantage(12, CONFIG)))
    trainer._validating = True
    unindexed = DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)},
                                    non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    trainer._get_gen_batch(unindexed)
    assert trainer._binding is None


# ----------------------------------------------------------------------------- the train set


def train_set(files, custom=True):
    """verl's create_rl_dataset over ``files`` (LZERLHFDataset, or verl's own RLHFDataset)."""
    from verl.trainer.ppo.utils import create_rl_dataset

    cls = {"path": "pkg://lze_kernels.integrations.verl.checkpoint", "name": "LZERLHFDataset"}
    config = OmegaConf.create({"train_files": [str(f) for f in files],
                               "filter_overlong_prompts": False,
                               "custom_cls": cls if custom else {"path": None, "name": None}})
    return create_rl_dataset(config.train_files, config, None, None)


def test_the_train_set_keys_prompts_by_row_checked_at_start_up(tmp_path, registered, caplog):
    """Two train files whose extra_info.index both restart at 0: verl's own RLHFDataset would
    hand the selection index 0-5 twice (two prompts' histories merged), so LZERayPPOTrainer
    refuses it at start-up with the fix; LZERLHFDataset hands each prompt its row (0-11, the
    position verl's samplers yield), extra_info untouched, and says at load that the two
    numberings differ. The selection parts must be sized to the train set."""
    from verl_cpu import task

    from lze_kernels.integrations.verl.legacy import check_train_set

    first = task.write_dataset(tmp_path / "a.parquet", 12, rows=list(range(6)))
    second = task.write_dataset(tmp_path / "b.parquet", 12, rows=list(range(6, 12)),
                                indices=list(range(6)))
    batches = types.SimpleNamespace(sampler=None, batch_size=4)
    with pytest.raises(ValueError, match=r"train_dataset: .*6 repeat an extra_info\.index"
                                         r".*data\.custom_cls\.name=LZERLHFDataset"):
        check_train_set(train_set([first, second], custom=False), batches,
                        LZEAdvantage(12, CONFIG))
    check_train_set(train_set([first], custom=False), batches, LZEAdvantage(6, CONFIG))
    with caplog.at_level("WARNING"):
        rows = train_set([first, second])
    assert "extra_info.index differs" in caplog.text
    assert check_train_set(rows, batches, LZEAdvantage(12, CONFIG)).source_index.tolist() == (
        list(range(6)) * 2)
    assert [rows[i]["index"] for i in range(12)] == list(range(12))
    assert [rows[i]["extra_info"]["index"] for i in range(12)] == list(range(6)) * 2
    with pytest.raises(ValueError, match=r"num_prompts: .*the train set 12.*num_prompts 16"):
        check_train_set(rows, batches, LZEAdvantage(16, CONFIG))
    sampler = ForwardSampler(12, 6, "greso", greso=GresoFilter(12))
    with pytest.raises(ValueError, match="train_sampler: its batch_size is 6"):
        check_train_set(rows, types.SimpleNamespace(sampler=sampler, batch_size=4),
                        LZEAdvantage(12, CONFIG))


# ----------------------------------------------------------------------------- dataset classes
# A user's data.custom_cls through verl's own classes: create_rl_dataset, LZERayPPOTrainer's real
# __init__ (verl's RayPPOTrainer builds the train dataloader), and fit's steps up to the
# log-prob passes on the batches that dataloader yields.

USER_DATASETS = os.path.join(os.path.dirname(__file__), "verl_cpu", "user_datasets.py")


def built_trainer(files, estimator_name, custom_cls=None):
    """LZERayPPOTrainer as verl's task runner builds it (config composed from verl's
    ppo_trainer.yaml, the train set from create_rl_dataset, taken in order), up to its Ray
    boundary: no worker groups, two data-parallel ranks."""
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import Role, create_rl_dataset

    data = "[" + ",".join(str(f) for f in files) + "]"
    overrides = [f"data.train_files={data}", f"data.val_files={data}",
                 "data.train_batch_size=4", "data.filter_overlong_prompts=False",
                 "data.shuffle=False", "data.dataloader_num_workers=0",
                 f"actor_rollout_ref.rollout.n={GROUP}",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 f"algorithm.adv_estimator={estimator_name}", "trainer.use_v1=False"]
    if custom_cls is not None:
        overrides += [f"data.custom_cls.path={custom_cls[0]}",
                      f"data.custom_cls.name={custom_cls[1]}"]
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    dataset = create_rl_dataset(config.data.train_files, config.data, None, None)
    trainer = LZERayPPOTrainer(config=config, tokenizer=None,
                               role_worker_mapping={Role.ActorRollout: object},
                               resource_pool_manager=None, train_dataset=dataset,
                               val_dataset=dataset)
    trainer._get_dp_size = lambda worker_group, role: 2
    trainer.actor_rollout_wg = NoWorkers()
    return trainer


def fit_steps(trainer, batches, steps):
    """``steps`` of legacy fit up to the log-prob passes on ``batches`` (an iterator over the
    trainer's own train dataloader): uids, _get_gen_batch, the rollout (n responses, pass
    counts by prompt), _balance_batch. Returns the prompts of each step (their numbers)."""
    from verl_cpu import task

    prompts = []
    for batch_dict in itertools.islice(batches, steps):
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))],
                                                 dtype=object)
        gen_batch = trainer._get_gen_batch(batch)
        numbers = [task.row_of_text(p[0]["content"]) for p in gen_batch.non_tensor_batch[
            "raw_prompt"]]
        prompts.append(numbers)
        batch = batch.repeat(GROUP, interleave=True)
        lengths = torch.full((len(batch),), LENGTH)
        mask = torch.ones(len(batch), LENGTH, dtype=torch.long)
        batch = batch.union(DataProto.from_dict({
            "response_mask": mask, "attention_mask": torch.cat([mask, mask], dim=1),
            "rm_scores": outcome_rewards([1 + n % 3 for n in numbers], lengths)}))
        trainer._balance_batch(batch, metrics={})
    return prompts


def two_files(tmp_path):
    """Prompts 0-5 and 6-11 in two files whose extra_info.index both restart at 0."""
    from verl_cpu import task

    return [task.write_dataset(tmp_path / "a.parquet", 12, rows=list(range(6))),
            task.write_dataset(tmp_path / "b.parquet", 12, rows=list(range(6, 12)),
                               indices=list(range(6)))]


def test_a_dataset_class_that_is_no_rlhf_dataset_is_refused_at_start_up(tmp_path, registered):
    """A plain torch Dataset as data.custom_cls (verl accepts any): LZERayPPOTrainer's
    construction refuses it, naming data.custom_cls and the fix, as v1's buffer does."""
    name = registered(LZEAdvantage(12, CONFIG))
    with pytest.raises(ValueError, match=r"data\.custom_cls: OwnDataset is not a verl "
                                         r"RLHFDataset.*Fix: data\.custom_cls\.path="):
        built_trainer(two_files(tmp_path), name, (USER_DATASETS, "OwnDataset"))


def test_a_subclass_handing_extra_info_index_is_refused_before_its_rollout(tmp_path,
                                                                          registered):
    """An LZERLHFDataset subclass that hands verl extra_info.index as the row, over two files
    restarting at 0: the first step (prompts 0-3, at their rows) selects; the second holds
    prompts 6 and 7 of the second file as rows 0 and 1, which hold prompts 0 and 1, so
    _get_gen_batch refuses it with the fix before its rollout, the selector as after step 1.
    LZERLHFDataset itself and verl's RLHFDataset on one file select each prompt at its row."""
    lze = LZEAdvantage(12, CONFIG)
    trainer = built_trainer(two_files(tmp_path), registered(lze),
                            (USER_DATASETS, "SourceIndexDataset"))
    batches = iter(trainer.train_dataloader)
    assert fit_steps(trainer, batches, 1) == [[0, 1, 2, 3]]
    after = copy.deepcopy(lze.state_dict())
    with pytest.raises(ValueError, match=r"index: a prompt arrives as row 0, but row 0 of the "
                                         r"train set holds another prompt .*2 of 4.*custom_cls"):
        fit_steps(trainer, batches, 1)
    assert same(lze.state_dict(), after)

    for files, custom_cls in ((two_files(tmp_path), (
            "pkg://lze_kernels.integrations.verl.checkpoint", "LZERLHFDataset")),
                              (two_files(tmp_path)[:1], None)):
        lze = LZEAdvantage(6 * len(files), CONFIG)
        trainer = built_trainer(files, registered(lze), custom_cls)
        steps = len(files) * 6 // 4
        assert sum(fit_steps(trainer, iter(trainer.train_dataloader), steps), []) == list(
            range(4 * steps))
        seen = torch.nonzero(lze.selector.state.istate[:6 * len(files), SEEN]).view(-1).tolist()
        assert seen == list(range(4 * steps))

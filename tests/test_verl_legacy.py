"""LZE selection in verl's legacy RayPPOTrainer, through the installed verl's own code paths.

Runs where verl is installed (``make test-verl``: verl 0.9.1 in .venv-verl); skipped elsewhere.
verl's functions and classes run as they are: ``DataProto``, its registry
(``register_adv_est`` / ``get_adv_estimator_fn``), ``ray_trainer.compute_advantage``, the
trainer's ``_balance_batch`` and ``_get_gen_batch``, torchdata's ``StatefulDataLoader`` with
verl's ``collate_fn``. The boundary on a CPU: the Ray worker groups (FSDP actor, vLLM rollout),
so the trainer object is made without ``__init__`` and ``_balance_batch`` is told the
data-parallel size the actor's worker group would report.
"""

import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels.greso import GresoConfig, GresoFilter  # noqa: E402
from lze_kernels.integrations.verl import LZEAdvantage, checkpoint  # noqa: E402
from lze_kernels.integrations.verl.checkpoint import LZERLHFDataset  # noqa: E402
from lze_kernels.integrations.verl.forward import ForwardSampler  # noqa: E402
from lze_kernels.integrations.verl.legacy import (LZERayPPOTrainer,  # noqa: E402
                                                  check_forward_setting)

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


def fit_batch(pass_counts, rows, seed=0):
    """A DataProto the way legacy ``fit`` holds it at ``compute_advantage``: fresh uuid4 uids
    repeated per rollout (``repeat(interleave=True)``), the dataset row in ``index``, a binary
    outcome reward on each response's last token, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = DataProto.from_dict(non_tensors={
        "uid": np.array([str(uuid.uuid4()) for _ in rows], dtype=object),
        "index": np.array(rows, dtype=object)})
    batch = prompts.repeat(GROUP, interleave=True)
    bs = len(batch)
    lengths = torch.randint(1, LENGTH + 1, (bs,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    solved = torch.cat([torch.arange(GROUP) < c for c in pass_counts]).float()
    rewards = torch.zeros(bs, LENGTH).scatter_(1, (lengths - 1)[:, None], solved[:, None])
    batch.batch = DataProto.from_dict({
        "token_level_rewards": rewards, "token_level_scores": rewards, "response_mask": mask,
        "attention_mask": torch.cat([torch.ones(bs, 3, dtype=torch.long), mask], dim=1)}).batch
    return batch


def trainer_without_workers(dp_size=2, **attributes):
    """verl's trainer object up to its Ray boundary: no worker groups, the dp size given."""
    trainer = object.__new__(LZERayPPOTrainer)
    trainer._get_dp_size = lambda worker_group, role: dp_size
    trainer.actor_rollout_wg = None
    trainer._rows_by_uid = {}
    for name, value in attributes.items():
        setattr(trainer, name, value)
    return trainer


def advantages(batch, estimator_name, norm=True):
    out = compute_advantage(batch, adv_estimator=estimator_name,
                            config=AlgoConfig(norm_adv_by_std_in_grpo=norm),
                            norm_adv_by_std_in_grpo=norm)
    return out.batch["advantages"]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("policy", ["lze", "dapo"])
def test_selection_off_equals_verls_grpo_after_balance_batch(registered, policy, norm):
    """Through verl's registry and compute_advantage, on a batch reordered by verl's own
    _balance_batch: with selection off (zero_dropped=False) the advantages are verl's grpo."""
    batch = fit_batch([0, 1, 2, 4, 3, 2], rows=[5, 0, 9, 2, 7, 3])
    trainer_without_workers(dp_size=4)._balance_batch(batch, metrics={})
    lze = LZEAdvantage(10, CONFIG, policy=policy)
    name = registered(lze)
    assert core_algos.get_adv_estimator_fn(name) is lze
    expected = advantages(batch, "grpo", norm)
    lze.bind_uids(batch.non_tensor_batch["uid"], batch.non_tensor_batch["index"])
    torch.testing.assert_close(advantages(batch, name, norm), expected, rtol=0, atol=1e-6)


def test_kept_groups_are_the_selectors_pick(registered):
    """zero_dropped=True: verl trains on the groups an independent LZESelector keeps on the same
    rewards and rows, with verl's grpo advantages; the others get zero advantages."""
    rows = [5, 0, 9, 2, 7, 3]
    counts = [0, 1, 2, 4, 3, 2]
    lze = LZEAdvantage(10, CONFIG, zero_dropped=True)
    oracle = LZESelector(10, CONFIG)
    name = registered(lze)
    for step in range(3):
        batch = fit_batch(counts, rows, seed=step)
        trainer_without_workers()._balance_batch(batch, metrics={})
        lze.bind_uids(batch.non_tensor_batch["uid"], batch.non_tensor_batch["index"])
        got = advantages(batch, name)
        expected = oracle.step(torch.stack([torch.arange(GROUP) < c for c in counts]).float(),
                               torch.tensor(rows))
        kept_rows = {rows[i] for i in expected.kept_indices.tolist() if i >= 0}
        response_rows = batch.non_tensor_batch["index"].astype(np.int64)
        kept = torch.from_numpy(np.isin(response_rows, list(kept_rows)))
        grpo = advantages(batch, "grpo")
        torch.testing.assert_close(got[kept], grpo[kept], rtol=0, atol=1e-6)
        assert not got[~kept].any()
        assert len(kept_rows) == 3  # keep_ratio 0.5 of 6 groups
        counts = counts[1:] + counts[:1]  # the prompts' pass counts change between steps


def test_get_gen_batch_binds_the_steps_rows(registered):
    """The trainer's _get_gen_batch (verl's, wrapped) binds each uid to its dataset row: the
    estimator then keys its state by row without being passed it."""
    lze = LZEAdvantage(10, CONFIG)
    trainer = trainer_without_workers(config=AlgoConfigHolder(registered(lze)))
    rows = [4, 1, 8]
    prompts = DataProto.from_dict(
        {"input_ids": torch.zeros(3, 2, dtype=torch.long)},
        non_tensors={"uid": np.array([str(uuid.uuid4()) for _ in rows], dtype=object),
                     "index": np.array(rows, dtype=object),
                     "raw_prompt": np.array(["a", "b", "c"], dtype=object)})
    gen_batch = trainer._get_gen_batch(prompts)
    assert "raw_prompt" in gen_batch.non_tensor_batch  # verl's own split ran
    batch = prompts.repeat(GROUP, interleave=True)
    batch.batch = fit_batch([1, 2, 3], rows).batch
    lze(batch.batch["token_level_rewards"], batch.batch["response_mask"],
        batch.non_tensor_batch["uid"])
    assert lze.last.selection.prompt_ids.tolist() == rows
    # A binding serves one call; uids verl never bound are refused, naming the hook.
    with pytest.raises(ValueError, match="bind_uids"):
        lze(batch.batch["token_level_rewards"], batch.batch["response_mask"],
            batch.non_tensor_batch["uid"])
    assert "index" not in prompts.non_tensor_batch  # verl's _get_gen_batch moved it out
    trainer.bind_rows(gen_batch)
    with pytest.raises(ValueError, match="not bound by bind_uids"):
        lze(batch.batch["token_level_rewards"], batch.batch["response_mask"],
            np.array([str(uuid.uuid4())] * len(batch), dtype=object))


class AlgoConfigHolder:
    """The part of verl's trainer config the hooks read."""

    def __init__(self, estimator_name):
        self.algorithm = AlgoConfig(adv_estimator=estimator_name)


# ----------------------------------------------------------------------------- forward sampler

NUM_PROMPTS, BATCH = 12, 4


def loader(sampler, num_workers=0):
    """verl's legacy train dataloader: StatefulDataLoader, verl's collate_fn, the sampler given
    as ``train_sampler``, batches of train_batch_size, drop_last."""
    dataset = [{"index": i, "input_ids": torch.tensor([i])} for i in range(NUM_PROMPTS)]
    return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True,
                              collate_fn=collate_fn, num_workers=num_workers)


def rows_of(batch_dict):
    return [int(i) for i in batch_dict["index"]]


def group_rewards(rows, pass_rate):
    return torch.stack([(torch.arange(GROUP) < round(pass_rate[r] * GROUP)).float()
                        for r in rows])


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
            selector.step(group_rewards(rows, pass_rate), torch.tensor(rows))
            sampler.observe(torch.tensor(rows), group_rewards(rows, pass_rate))
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
    sampler.observe(torch.tensor(first), group_rewards(first, rates))
    second = rows_of(next(it))
    assert second[0] == first[2]
    assert not {first[0], first[1], first[3]} & set(second)


@pytest.mark.parametrize("method", ["pruner", "greso", "dots"])
def test_resume_mid_epoch_continues_the_same_sequence(method):
    """verl saves train_dataloader.state_dict() in data.pt; a fresh dataloader and sampler that
    load it mid-epoch yield the same batches as the run that went on."""
    rates = {r: (r % 5) / 4 for r in range(NUM_PROMPTS)}

    def make():
        selector = LZESelector(NUM_PROMPTS, LZEConfig(prune_after=1, replay_ratio=0.5))
        greso = GresoFilter(NUM_PROMPTS, GresoConfig(seed=2))
        sampler = ForwardSampler(NUM_PROMPTS, BATCH, method, seed=5, selector=selector,
                                 greso=greso, embeddings=torch.randn(
                                     NUM_PROMPTS, 8, generator=torch.Generator().manual_seed(0)))
        return sampler, selector

    def run(sampler, selector, data, steps):
        out, it = [], iter(data)
        for _ in range(steps):
            try:
                rows = rows_of(next(it))
            except StopIteration:
                it = iter(data)
                rows = rows_of(next(it))
            rewards = group_rewards(rows, rates)
            selector.step(rewards, torch.tensor(rows))
            sampler.observe(torch.tensor(rows), rewards)
            out.append(rows)
        return out

    sampler, selector = make()
    data = loader(sampler)
    run(sampler, selector, data, 4)  # mid-way through the second dataloader epoch
    saved = (data.state_dict(), selector.state_dict())
    expected = run(sampler, selector, data, 5)
    sampler2, selector2 = make()
    data2 = loader(sampler2)
    data2.load_state_dict(saved[0])
    selector2.load_state_dict(saved[1])
    assert run(sampler2, selector2, data2, 5) == expected


def test_dataloader_workers_are_refused():
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "dots", embeddings=torch.eye(NUM_PROMPTS))
    with pytest.raises(ValueError, match="dataloader_num_workers"):
        check_forward_setting(loader(sampler, num_workers=2))
    check_forward_setting(loader(sampler))


def test_observe_rewards_feeds_the_sampler_from_verls_batch():
    """The trainer's _update_actor hook: the step's groups reach the sampler keyed by the rows
    _get_gen_batch bound (here GRESO's streaks move for exactly those rows)."""
    greso = GresoFilter(NUM_PROMPTS)
    sampler = ForwardSampler(NUM_PROMPTS, BATCH, "greso", greso=greso)
    trainer = trainer_without_workers(train_dataloader=loader(sampler),
                                      config=AlgoConfigHolder("grpo"))
    rows = [3, 9, 0]
    batch = fit_batch([4, 0, 2], rows)
    trainer.bind_rows(batch)
    trainer._balance_batch(batch, metrics={})
    trainer.observe_rewards(batch)
    assert greso.streak.tolist() == [0 if r not in (3, 9) else 1 for r in range(NUM_PROMPTS)]
    assert greso.kind[3] == 1 and greso.kind[9] == 2


# ----------------------------------------------------------------------------- checkpoint


def rlhf_dataset_rows(n):
    """verl's RLHFDataset subclass up to its tokenizer (the state path needs no item)."""
    dataset = object.__new__(LZERLHFDataset)
    dataset.dataframe = list(range(n))
    return dataset


def test_estimator_state_resumes_from_verls_data_pt(tmp_path, registered):
    """The estimator's selector state goes where verl's _save_checkpoint puts the dataloader
    (torch.save(train_dataloader.state_dict(), data.pt)) and comes back, as in _load_checkpoint,
    when the next iterator is made: the resumed estimator then selects exactly as the original."""
    rows = [5, 0, 9, 2, 7, 3]
    lze = LZEAdvantage(10, LZEConfig(keep_ratio=0.5, noise_scale=0.1, seed=4))
    checkpoint.register("estimator", lze)
    data = StatefulDataLoader(rlhf_dataset_rows(10), batch_size=2, drop_last=True)
    for step in range(2):
        batch = fit_batch([0, 1, 2, 4, 3, 2], rows, seed=step)
        lze.bind_uids(batch.non_tensor_batch["uid"], batch.non_tensor_batch["index"])
        lze(batch.batch["token_level_rewards"], batch.batch["response_mask"],
            batch.non_tensor_batch["uid"])
    torch.save(data.state_dict(), tmp_path / "data.pt")
    batch = fit_batch([1, 1, 3, 0, 2, 4], rows, seed=9)
    expected = lze.compute(batch.batch["token_level_rewards"], batch.batch["response_mask"],
                           batch.non_tensor_batch["uid"],
                           prompt_index=batch.non_tensor_batch["index"]).keep_mask

    checkpoint.unregister("estimator")  # a resumed run is a fresh process
    resumed = LZEAdvantage(10, LZEConfig(keep_ratio=0.5, noise_scale=0.1, seed=4))
    checkpoint.register("estimator", resumed)
    data = StatefulDataLoader(rlhf_dataset_rows(10), batch_size=2, drop_last=True)
    data.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=False))
    iter(data)  # verl's fit makes the iterator: torchdata restores the dataset state
    got = resumed.compute(batch.batch["token_level_rewards"], batch.batch["response_mask"],
                          batch.non_tensor_batch["uid"],
                          prompt_index=batch.non_tensor_batch["index"]).keep_mask
    assert torch.equal(got, expected)
    checkpoint.unregister("estimator")
    fresh = LZEAdvantage(10, LZEConfig(keep_ratio=0.5, noise_scale=0.1, seed=4))
    assert not torch.equal(fresh.compute(batch.batch["token_level_rewards"],
                                         batch.batch["response_mask"],
                                         batch.non_tensor_batch["uid"],
                                         prompt_index=batch.non_tensor_batch["index"]).keep_mask,
                           expected)


def test_dataset_refuses_dataloader_workers():
    dataset = rlhf_dataset_rows(4)
    data = StatefulDataLoader(dataset, batch_size=2, num_workers=1)
    with pytest.raises(RuntimeError, match="dataloader_num_workers"):
        next(iter(data))

"""LZE and DAPO selection in verl 0.9.1's v1 trainer: LZEReplayBuffer over a real TransferQueue.

Runs where verl is installed (``make test-verl``); skipped elsewhere. A local Ray instance runs
TransferQueue (its controller and one storage unit, the store the v1 trainer reads); verl's own
``ReplayBuffer.sample`` waits for, evicts and materialises the groups, and verl's
``list_of_dict_to_tensordict`` packs the trajectories as its agent loop does. The boundary on a
CPU: the agent loop and its vLLM servers, so the test puts the finished groups into
TransferQueue itself, with the keys, tags and fields ``AgentLoopWorkerTQ`` writes
(``{uid}_{session}_{index}``, ``rm_scores`` token-level rewards, the dataset ``index``), and its
``refill_fn`` stands in for the trainer's ``_add_prompts_to_generate`` (next rows of the
dataloader, rolled out to groups of known rewards).
"""

import os
import types
import uuid
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from crafted_state import same  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels.config import num_keep  # noqa: E402
from lze_kernels.integrations.verl import checkpoint  # noqa: E402
from lze_kernels.integrations.verl.checkpoint import LZERLHFDataset  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402
from lze_kernels.integrations.verl.row_table import RowTable, prompt_keys  # noqa: E402
from lze_kernels.integrations.verl.rows import select_on_rows  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl.trainer.ppo.utils import create_rl_sampler  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn  # noqa: E402

GROUP, NUM_PROMPTS = 4, 16
# Pass counts (of GROUP) per dataset row: distinct mixed values so LZE's energies do not tie.
PASS_COUNT = {row: [1, 2, 3, 0, 4][row % 5] for row in range(1024)}


@pytest.fixture(scope="module")
def transfer_queue():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield
    tq.close()
    ray.shutdown()


class Rollouts:
    """The trainer's dispatch and the agent loop, for a dataloader that yields ``order`` (a
    list of rows, or verl's dataloader iterator fetching one prompt at a time)."""

    def __init__(self, order, step=1):
        self.order, self.step, self.refills = order, step, []

    def fetch(self, count):
        if isinstance(self.order, list):
            rows, self.order = self.order[:count], self.order[count:]
            return rows
        return [int(next(self.order)["index"][0]) for _ in range(count)]

    def dispatch(self, count, sizes=None):
        """Roll out ``count`` prompts, GROUP trajectories each (``sizes``: so many per prompt)."""
        rows = self.fetch(count)
        uids = [uuid.uuid4().hex for _ in rows]
        tq.kv_batch_put(keys=uids, partition_id="train", tags=[
            {"is_prompt": True, "status": "finished", "global_steps": self.step} for _ in rows])
        keys, fields = [], []
        for uid, row, size in zip(uids, rows, sizes or [GROUP] * len(rows)):
            for session in range(size):
                length = 3 + session
                reward = torch.zeros(length)
                reward[-1] = float(session < PASS_COUNT[row])
                keys.append(f"{uid}_{session}_0")
                fields.append({"rm_scores": reward, "index": row})
        tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields),
                        tags=[{"status": "success", "global_steps": self.step}] * len(keys))
        return dict(zip(uids, rows))

    def refill(self, count):
        self.refills.append(count)
        return len(self.dispatch(count))


def prompt_of(row):
    return [{"role": "user", "content": f"prompt {row}"}]


def stub_train_set(monkeypatch):
    """LZERLHFDataset over NUM_PROMPTS rows, RLHFDataset's item stubbed to its row and prompt
    (the tokenizer is the boundary), the row table of those prompts as its load reads it."""
    monkeypatch.setattr(RLHFDataset, "__getitem__", lambda self, item: {
        "index": item, "input_ids": torch.tensor([item]), "raw_prompt": prompt_of(item)})
    dataset = object.__new__(LZERLHFDataset)
    dataset.dataframe, dataset.is_train = list(range(NUM_PROMPTS)), True
    dataset.rows = TrainSet(NUM_PROMPTS).rows
    return dataset


def buffer(rollouts, refill_fn=None, **options):
    kwargs = OmegaConf.create({"num_prompts": NUM_PROMPTS, **options})
    return LZEReplayBuffer("sync", OmegaConf.create({}), None, "drop", kwargs,
                           poll_interval=0.01, refill_fn=refill_fn or rollouts.refill)


class UpdateShape:
    """The parts of verl's v1 trainer the buffer reads through its refill_fn (the trainer's own
    ``_add_prompts_to_generate``): the config, the actor's data-parallel ranks, and verl's own
    ``_get_required_batch_multiple`` (the rows its update takes without padding)."""

    _get_required_batch_multiple = PPOTrainerSync._get_required_batch_multiple

    def __init__(self, rollouts, mini_batch, data_parallel, train_batch=16):
        self.rollouts = rollouts
        self.config = OmegaConf.create({
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini_batch},
                                  "rollout": {"n": GROUP}},
            "trainer": {"critic_warmup": 0},
            "reward": {"reward_model": {"enable": False}},
            "data": {"train_batch_size": train_batch, "dataloader_num_workers": 0,
                     "custom_cls": {"path": "pkg://lze_kernels.integrations.verl.checkpoint",
                                    "name": "LZERLHFDataset"}}})
        self.use_critic, self.global_steps = False, 1
        self.actor_rollout_wg = types.SimpleNamespace(
            _dispatch_info={"actor": list(range(data_parallel))})

    def _add_prompts_to_generate(self, count):
        return self.rollouts.refill(count)


def batch_rows(batch):
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["index"])
    return sorted(set(int(r) for r in data["index"]))


def clear_train_partition():
    listed = tq.kv_list("train").get("train", {})
    if listed:
        tq.kv_clear(keys=list(listed), partition_id="train")


def rewards_of(rows):
    return torch.stack([(torch.arange(GROUP) < PASS_COUNT[r]).float() for r in rows])


def test_topk_updates_on_the_top_k_of_the_k_prompts_rolled_out(transfer_queue):
    """mode=topk (the default), K = 8 prompts at keep_ratio 0.5: no refill, verl's sample
    materialises the 8 groups, and the batch holds exactly the k = 4 an independent LZESelector
    keeps on the same rows and rewards; the others leave TransferQueue."""
    config = {"keep_ratio": 0.5, "noise_scale": 0.0}
    rows = [0, 1, 2, 5, 6, 7, 10, 11]
    rollouts = Rollouts(order=list(rows))
    rb = buffer(rollouts, lze=config)
    rollouts.dispatch(8)  # the trainer's prepare_step
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=8)
    assert rollouts.refills == []
    oracle = LZESelector(NUM_PROMPTS, LZEConfig(**config)).step(rewards_of(rows),
                                                                   torch.tensor(rows))
    assert batch_rows(batch) == sorted(rows[i] for i in oracle.kept_indices.tolist() if i >= 0)
    assert len(batch.keys) == 4 * GROUP
    assert sorted(tq.kv_list("train")["train"]) == sorted(batch.keys)  # the rest cleared
    assert metrics["lze/kept_groups"] == 4 and metrics["lze/groups_rolled_out"] == 8
    assert metrics["lze/score_mean_rolled_out"] == pytest.approx(
        float(rewards_of(rows).mean()))
    clear_train_partition()


def test_topk_fills_k_with_the_next_groups_by_energy(transfer_queue):
    """Rows 3 and 4 are all wrong / all right (energy 0): of K = 4 with k = 3, the two mixed
    groups and the next by energy (row 3, first in batch order) go to the update, so v1 adds no
    no-op padding rows; a batch with no mixed group hands over k groups the same way."""
    rollouts = Rollouts(order=[3, 1, 4, 2, 3, 4, 8, 9])
    rb = buffer(rollouts, lze={"keep_ratio": 0.75, "noise_scale": 0.0})
    rollouts.dispatch(4)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=4)
    assert batch_rows(batch) == [1, 2, 3] and metrics["lze/kept_groups"] == 3
    assert metrics["lze/keep_ratio_effective"] == 0.75
    clear_train_partition()
    rollouts.step = 2
    rollouts.dispatch(4)
    batch, _ = rb.sample(global_steps=2, partition_id="train", batch_size=4)
    assert batch_rows(batch) == [3, 4, 8]  # of 3, 4, 8, 9, all without a learning signal
    clear_train_partition()


@pytest.mark.parametrize("batch_size, mini_batch, data_parallel, keep_ratio, kept", [
    (1024, 256, 8, 0.4, 512),  # k0 = 409 rounds to 2 mini-batches: 0.5, within 0.4 +/- 0.125
    (16, 4, 2, 0.3, 4),  # k0 = 4 is one mini-batch
    (16, 16, 2, 0.5, 16)])  # ppo_mini_batch_size = train_batch_size: one mini-batch, all
def test_topk_keeps_whole_mini_batches_of_the_update(transfer_queue, batch_size, mini_batch,
                                                     data_parallel, keep_ratio, kept):
    """The buffer reads the rows verl's update takes without padding (the trainer's own
    _get_required_batch_multiple at its data-parallel size) and keeps floor(K x keep_ratio)
    groups rounded to the nearest whole number of mini-batches; the step logs the effective
    ratio. Where that is every group (one mini-batch holds the whole batch), the buffer warns
    when it is built, before any step."""
    rollouts = Rollouts(order=list(range(batch_size)))
    shape = UpdateShape(rollouts, mini_batch, data_parallel, batch_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rb = buffer(rollouts, refill_fn=shape._add_prompts_to_generate, num_prompts=batch_size,
                    lze={"keep_ratio": keep_ratio, "noise_scale": 0.0})
    said = [str(w.message) for w in caught if "selects nothing" in str(w.message)]
    assert len(said) == (kept == batch_size)
    rollouts.dispatch(batch_size)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=batch_size)
    assert metrics["lze/kept_groups"] == kept and len(batch.keys) == kept * GROUP
    assert metrics["lze/keep_ratio_effective"] == kept / batch_size
    assert abs(kept - num_keep(batch_size, keep_ratio)) <= mini_batch / 2 or kept == mini_batch
    assert len(batch.keys) % shape._get_required_batch_multiple(data_parallel) == 0
    clear_train_partition()


def test_topk_keeps_groups_of_unequal_size_whole_counted_by_rows(transfer_queue):
    """An agent loop that splits or drops trajectories leaves groups of 1 to 7 rows: the buffer
    keeps whole groups, in ranking order, whose rows come nearest to k groups' share of the rows
    (k = 4 of 8 groups, 32 rows: 16); v1 pads the remainder as it does for plain GRPO."""
    rows = [0, 1, 2, 5, 6, 7, 10, 11]
    sizes = [7, 1, 4, 2, 6, 4, 3, 5]
    rollouts = Rollouts(order=list(rows))
    rb = buffer(rollouts, lze={"keep_ratio": 0.5, "noise_scale": 0.0})
    rollouts.dispatch(8, sizes=sizes)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=8)
    kept_rows = batch_rows(batch)
    kept_sizes = [sizes[rows.index(r)] for r in kept_rows]
    assert len(batch.keys) == sum(kept_sizes) and abs(sum(kept_sizes) - 16) <= max(sizes) / 2
    assert metrics["lze/kept_groups"] == len(kept_rows)
    clear_train_partition()


def test_a_dataset_without_row_indices_is_refused_at_every_step(transfer_queue):
    """Every trajectory carries index 0 (verl's fill for a missing extra_info.index): refused
    with the fix at any step (here after a round of right rows), the selector untouched."""
    rollouts = Rollouts(order=[5, 0, 9, 2] + [0] * 4)
    rb = buffer(rollouts, lze={"keep_ratio": 0.5})
    try:
        rollouts.dispatch(4)
        rb.sample(global_steps=1, partition_id="train", batch_size=4)
        clear_train_partition()
        rollouts.dispatch(4)
        before = rb.selector.state_dict()
        with pytest.raises(ValueError, match=r"extra_info\.index.*with_indices=True"):
            rb.sample(global_steps=2, partition_id="train", batch_size=4)
        assert same(rb.selector.state_dict(), before)
    finally:
        clear_train_partition()
        checkpoint.unregister("replay_buffer")


def test_a_repeated_row_in_one_round_is_one_observation(transfer_queue):
    """verl's dataloader restarts its sampler between single-prompt fetches, so one round can
    hold a row twice: no error; the selector steps once on the distinct rows, the repeated
    row's rollouts side by side, and both its groups share its fate."""
    config = {"keep_ratio": 0.5, "noise_scale": 0.0}
    rows = [1, 2, 7, 1]  # energies: row 1 the highest (pass rate 1/2), rows 2 and 7 tie
    rollouts = Rollouts(order=list(rows))
    rb = buffer(rollouts, lze=config)
    rollouts.dispatch(4)
    batch, _ = rb.sample(global_steps=1, partition_id="train", batch_size=4)
    merged = torch.cat([rewards_of([1, 2, 7]),
                        torch.cat([rewards_of([1]), torch.zeros(2, GROUP)])], dim=1)
    valid = torch.cat([torch.ones(3, GROUP, dtype=torch.bool),
                       torch.tensor([[True], [False], [False]]).expand(3, GROUP)], dim=1)
    oracle = LZESelector(NUM_PROMPTS, LZEConfig(**config))
    expected = oracle.step(merged, torch.tensor([1, 2, 7]), valid)
    assert torch.equal(rb.selector.state.fstate, oracle.state.fstate)
    assert [[1, 2, 7][i] for i in expected.kept_indices.tolist() if i >= 0] == [1]
    assert batch_rows(batch) == [1] and len(batch.keys) == 2 * GROUP  # both its groups
    clear_train_partition()


def test_refill_batch_holds_the_selectors_pick(transfer_queue):
    """mode=refill, K = 4 groups at keep_ratio 0.5: the buffer rolls out 4 more through verl's
    refill, verl's sample materialises all 8, and the batch holds exactly the 4 groups an
    independent LZESelector keeps on the same rows and rewards; the others leave TransferQueue."""
    config = {"keep_ratio": 0.5, "noise_scale": 0.0}
    rollouts = Rollouts(order=[0, 1, 2, 5, 6, 7, 10, 11])
    rb = buffer(rollouts, mode="refill", lze=config)
    rollouts.dispatch(4)  # the trainer's prepare_step
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=4)
    assert rollouts.refills == [4]
    rows = [0, 1, 2, 5, 6, 7, 10, 11]
    oracle = LZESelector(NUM_PROMPTS, LZEConfig(**config)).step(rewards_of(rows),
                                                                   torch.tensor(rows))
    expected = sorted(rows[i] for i in oracle.kept_indices.tolist() if i >= 0)
    assert batch_rows(batch) == expected and len(expected) == 4
    assert len(batch.keys) == 4 * GROUP
    assert sorted(tq.kv_list("train")["train"]) == sorted(batch.keys)  # the rest cleared
    assert metrics["lze/kept_groups"] == 4 and metrics["lze/rounds"] == 1
    assert metrics["lze/groups_rolled_out"] == 8
    clear_train_partition()


def test_dapo_refills_until_the_batch_is_full(transfer_queue):
    """DAPO keeps groups with unequal rewards; verl's refill tops the batch up: 3 wanted, the
    first 3 prompts hold 1 mixed group (rows 3 and 4 are all wrong / all right), so 2 more are
    rolled out and both kept."""
    rollouts = Rollouts(order=[3, 4, 1, 2, 6])
    rb = buffer(rollouts, mode="refill", method="dapo")
    rollouts.dispatch(3)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=3)
    assert rollouts.refills == [2]
    assert batch_rows(batch) == [1, 2, 6]
    assert metrics["lze/rounds"] == 2
    clear_train_partition()


def test_state_travels_in_the_checkpoint_registry(transfer_queue):
    """The buffer's selector state is in checkpoint.state_dict() (what LZERLHFDataset puts in
    verl's data.pt); a buffer built after the restore (as verl builds it on resume) gets it and
    selects exactly what the original selects next."""
    config = {"keep_ratio": 0.5, "noise_scale": 0.1, "seed": 3}
    order = [0, 1, 2, 5, 6, 7, 10, 11] * 2
    first = Rollouts(order)
    rb = buffer(first, mode="refill", lze=config)
    first.dispatch(4)
    rb.sample(global_steps=1, partition_id="train", batch_size=4)
    clear_train_partition()
    saved = checkpoint.state_dict()
    assert set(saved) == {"replay_buffer"}
    first.step = 2
    first.dispatch(4)
    expected = batch_rows(rb.sample(global_steps=2, partition_id="train", batch_size=4)[0])
    clear_train_partition()

    checkpoint.unregister("replay_buffer")  # a resumed run is a fresh process
    checkpoint.load_state_dict(saved)
    second = Rollouts(order[8:], step=2)
    resumed = buffer(second, mode="refill", lze=config)  # registers itself, takes the state
    second.dispatch(4)
    assert batch_rows(resumed.sample(global_steps=2, partition_id="train",
                                     batch_size=4)[0]) == expected
    clear_train_partition()


def test_bad_settings_are_refused():
    rollouts = Rollouts([])
    with pytest.raises(ValueError, match="trainer_mode"):
        LZEReplayBuffer("colocate_async", {}, None, "drop", {}, refill_fn=rollouts.refill)
    with pytest.raises(ValueError, match="unknown options"):
        buffer(rollouts, keep=0.5)
    with pytest.raises(ValueError, match="sampler_kwargs.mode"):
        buffer(rollouts, mode="all")
    with pytest.raises(ValueError, match="refill_fn"):
        LZEReplayBuffer("sync", {}, None, "drop", {"mode": "refill"})
    with pytest.raises(ValueError, match="max_rounds"):
        buffer(rollouts, max_rounds=0)
    with pytest.raises(ValueError, match="keep_ratio"):
        buffer(rollouts, lze={"keep_ratio": 2.0})
    with pytest.raises(ValueError, match="forward: unknown options"):
        buffer(rollouts, forward={"method": "greso", "batch_size": 4, "temperature": 1.0})
    with pytest.raises(ValueError, match="pruner needs sampler_kwargs.method 'lze'"):
        buffer(rollouts, method="dapo", forward={"method": "pruner", "batch_size": 4})
    with pytest.raises(ValueError, match="embeddings"):
        buffer(rollouts, forward={"method": "dots", "batch_size": 4})
    with pytest.raises(ValueError, match="forward.embeddings: only method 'dots'"):
        buffer(rollouts, forward={"method": "greso", "batch_size": 4, "embeddings": "e.pt"})


def test_unknown_method_is_refused_naming_the_option():
    try:
        with pytest.raises(ValueError, match="sampler_kwargs.method: expected one of"):
            buffer(Rollouts([]), method="top")
    finally:
        checkpoint.unregister("replay_buffer")


def test_forward_dots_chooses_the_rows_verls_dataloader_fetches(transfer_queue, tmp_path,
                                                                  monkeypatch):
    """v1 forward selection: verl's train dataloader as _init_dataloader builds it (its own
    create_rl_sampler, single-prompt fetches as with DAPO's refill) over LZERLHFDataset serves
    the rows the buffer's DOTS sampler picks, and the buffer feeds it the groups verl generated.
    With one-hot embeddings an observed prompt is predicted at its own pass rate and an unseen
    one at the mean of the observed: the next batch starts with the prompts observed at 1/2 and
    holds none observed at 0 or 1. The tokenizer is the boundary: RLHFDataset's item is stubbed
    to its row."""
    dataset = stub_train_set(monkeypatch)
    loader = StatefulDataLoader(dataset, batch_size=1, drop_last=True, collate_fn=collate_fn,
                                sampler=create_rl_sampler(OmegaConf.create({"shuffle": False}),
                                                          dataset))
    torch.save(torch.eye(NUM_PROMPTS) * 20.0, tmp_path / "embeddings.pt")
    rollouts = Rollouts(iter(loader))
    rb = buffer(rollouts, method="dapo", forward={
        "method": "dots", "batch_size": 4, "embeddings": str(tmp_path / "embeddings.pt"),
        "tau": 1e-3, "attention_tau": 0.1})
    assert checkpoint.part(checkpoint.FORWARD) is rb.forward
    first = rollouts.dispatch(4).values()
    rb.sample(global_steps=1, partition_id="train", batch_size=4)
    clear_train_partition()
    observed = {r: PASS_COUNT[r] / GROUP for r in torch.nonzero(
        ~torch.isnan(rb.forward.labels)).view(-1).tolist()}
    assert set(first) <= set(observed)
    half = sorted(r for r, rate in observed.items() if rate == 0.5)
    assert half, "the first rows should include a prompt at pass rate 1/2"
    rollouts.step = 2
    nxt = list(rollouts.dispatch(4).values())
    assert sorted(nxt[:len(half)]) == half[:4]
    assert not {r for r, rate in observed.items() if rate in (0.0, 1.0)} & set(nxt)
    clear_train_partition()
    checkpoint.unregister(checkpoint.FORWARD)


# ----------------------------------------------------------------------------- pass boundaries


@pytest.mark.slow
def test_readme_scale_three_passes_twenty_seeds_never_stops():
    """v1 fetches prompts one at a time (data.gen_batch_size=1) from verl's create_rl_sampler and
    restarts it at the end of each pass, so the batch that spans two passes (at N = 7,473,
    B = 128: step 59, rows 7,424-7,551) can draw a row twice. For 20 sampler seeds over 3 passes
    the buffer's selection (select_on_rows on the step's rows) runs every step; the seeds whose
    batch repeats a row are the expected share (1 - exp(-49 x 79 / 7,473) ~ 0.40 of them)."""
    num_prompts, batch = 7473, 128
    config = LZEConfig(keep_ratio=0.5, seed=0)
    seeds_with_repeats = 0
    for seed in range(20):
        sampler = create_rl_sampler(OmegaConf.create({"shuffle": True, "seed": seed}),
                                    range(num_prompts))
        order = [row for _ in range(4) for row in sampler]  # passes as verl's restarts draw them
        selector = LZESelector(num_prompts, config)
        repeated = False
        for step in range(3 * num_prompts // batch):
            rows = np.array(order[step * batch:(step + 1) * batch], dtype=np.int64)
            rewards = torch.stack([(torch.arange(GROUP) < PASS_COUNT[r % NUM_PROMPTS]).float()
                                   for r in rows.tolist()])
            selection = select_on_rows("lze", selector, rewards, None, rows)
            repeated |= selection.repeats.any
            assert int(selection.keep.sum()) <= num_keep(batch, 0.5) + 1
        seeds_with_repeats += repeated
    assert 3 <= seeds_with_repeats <= 16


# ----------------------------------------------------------------------------- resume


class NoWorkers:
    """The actor's worker group at the Ray boundary: its checkpoint files are not this test's."""

    def save_checkpoint(self, *args, **kwargs):
        pass

    def load_checkpoint(self, *args, **kwargs):
        pass


def v1_trainer(loader, checkpoints):
    """verl's sync v1 trainer up to its Ray boundary: its own _next_train_batch (single-prompt
    fetches, the dataloader restarted at the end of a pass), _save_checkpoint, _load_checkpoint."""
    trainer = object.__new__(PPOTrainerSync)
    trainer.config = OmegaConf.create({
        "data": {"train_batch_size": BATCH, "gen_batch_size": 1},
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
        "trainer": {"default_local_dir": str(checkpoints), "default_hdfs_dir": None,
                    "resume_mode": "auto", "resume_from_path": None,
                    "del_local_ckpt_after_load": False}})
    trainer.train_dataloader, trainer.train_dataloader_it = loader, None
    trainer.actor_rollout_wg, trainer.use_critic, trainer.trainer_mode = NoWorkers(), False, "sync"
    trainer.checkpoint_callback = types.SimpleNamespace(on_save=lambda **kwargs: None)
    trainer.global_steps = 0
    return trainer


class V1Rollouts(Rollouts):
    """Rollouts of the prompts verl's v1 trainer fetches itself."""

    def __init__(self, trainer):
        super().__init__(order=None)
        self.trainer = trainer

    def fetch(self, count):
        return [int(row) for row in self.trainer._next_train_batch(count)["index"]]


BATCH = 4


def v1_run(monkeypatch, tmp_path, method, steps, save_at=None, start=0, record=None):
    """Fresh parts (a new process), then ``steps`` sync steps: prepare_step's fetch of K
    prompts, the buffer's sample (mode topk), verl's _save_checkpoint at ``save_at``; with
    ``start`` the run first resumes through verl's _load_checkpoint."""
    for name in ("replay_buffer", checkpoint.FORWARD):
        checkpoint.unregister(name)
    dataset = stub_train_set(monkeypatch)
    loader = StatefulDataLoader(dataset, batch_size=1, drop_last=True, collate_fn=collate_fn,
                                sampler=create_rl_sampler(
                                    OmegaConf.create({"shuffle": True, "seed": 1}), dataset))
    trainer = v1_trainer(loader, tmp_path)
    rollouts = V1Rollouts(trainer)
    options = {"lze": {"keep_ratio": 0.5, "noise_scale": 0.1, "seed": 2, "prune_after": 1}}
    if method != "none":
        options["forward"] = {"method": method, "batch_size": BATCH, "seed": 3}
    if method == "dots":
        torch.save(torch.randn(NUM_PROMPTS, 8, generator=torch.Generator().manual_seed(0)),
                   tmp_path / "embeddings.pt")
        options["forward"]["embeddings"] = str(tmp_path / "embeddings.pt")
    rb = buffer(rollouts, **options)  # built in the trainer's __init__, before the resume
    if start:
        trainer._load_checkpoint()
        assert trainer.global_steps == start
    record = [] if record is None else record
    for step in range(start + 1, steps + 1):
        trainer.global_steps = rollouts.step = step
        drawn = sorted(rollouts.dispatch(BATCH).values())
        batch, _ = rb.sample(global_steps=step, partition_id="train", batch_size=BATCH)
        record.append((drawn, batch_rows(batch)))
        clear_train_partition()
        if step == save_at:
            trainer._save_checkpoint()
    return record, rb.selector.state_dict()


@pytest.mark.parametrize("method", ["none", "pruner", "greso", "dots"])
@pytest.mark.parametrize("save_at", [4, 6])  # the end of a pass over the 16 prompts, mid-pass
def test_resume_continues_the_identical_selections(transfer_queue, tmp_path, monkeypatch,
                                                   method, save_at):
    """verl's v1 _save_checkpoint at ``save_at`` and a fresh process's _load_checkpoint (which
    restores data.pt at every step, an epoch boundary included): the resumed run draws and keeps
    exactly what the uninterrupted run does, for the estimator alone and every forward method."""
    record, state = v1_run(monkeypatch, tmp_path, method, 8, save_at=save_at)
    resumed, resumed_state = v1_run(monkeypatch, tmp_path, method, 8, start=save_at)
    assert resumed == record[save_at:]
    for key in ("fstate", "istate", "step_counter"):  # the selector's whole history
        assert torch.equal(resumed_state[key], state[key])
    for name in ("replay_buffer", checkpoint.FORWARD):
        checkpoint.unregister(name)


def test_dataset_refuses_dataloader_workers():
    dataset = object.__new__(LZERLHFDataset)
    dataset.dataframe = list(range(4))
    data = StatefulDataLoader(dataset, batch_size=2, num_workers=1)
    with pytest.raises(RuntimeError, match="dataloader_num_workers"):
        next(iter(data))


def test_verls_create_rl_dataset_builds_the_dataset_class(tmp_path):
    """verl builds data.custom_cls by keyword (create_rl_dataset: data_files, tokenizer,
    processor, config, max_samples): LZERLHFDataset takes them as RLHFDataset does and knows it
    serves the training files."""
    import pandas as pd
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo
    from verl.trainer.ppo.utils import create_rl_dataset

    train = str(tmp_path / "train.parquet")
    pd.DataFrame({"prompt": [[{"role": "user", "content": f"{i} + 1?"}] for i in range(5)],
                  "data_source": ["sums"] * 5,
                  "reward_model": [{"ground_truth": str(i + 1)} for i in range(5)],
                  "extra_info": [{"index": i} for i in range(5)]}).to_parquet(train)
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"data.train_files={train}", f"data.val_files={train}",
            "data.filter_overlong_prompts=false",
            "data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint",
            "data.custom_cls.name=LZERLHFDataset"])
    dataset = create_rl_dataset(config.data.train_files, config.data, None, None)
    assert isinstance(dataset, LZERLHFDataset) and len(dataset) == 5 and dataset.is_train


# ----------------------------------------------------------------------------- set-ups


def verl_config(**changes):
    """The parts of verl's config the buffer reads at start-up (its trainer's)."""
    config = OmegaConf.create({
        "reward": {"reward_model": {"enable": False, "enable_resource_pool": False}},
        "data": {"train_batch_size": 8, "dataloader_num_workers": 0,
                 "custom_cls": {"path": "pkg://lze_kernels.integrations.verl.checkpoint",
                                "name": "LZERLHFDataset"}},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": GROUP}}})
    for key, value in changes.items():
        OmegaConf.update(config, key, value)
    return config


class Trainer:
    """verl's v1 trainer as the buffer sees it at start-up: its config, through refill_fn."""

    def __init__(self, config):
        self.config = config

    def _add_prompts_to_generate(self, count):
        return count


def built(config, **options):
    try:
        return buffer(Rollouts([]), refill_fn=Trainer(config)._add_prompts_to_generate,
                      **options)
    finally:
        checkpoint.unregister("replay_buffer")


def test_setups_the_selection_cannot_serve_are_refused_at_start_up():
    """A colocated reward model (v1 scores after sample(): nothing to select on), a dataset
    class other than LZERLHFDataset, dataloader workers, a forward sampler with the train files
    as the validation set: refused when verl builds the buffer, each naming the setting and the
    way out."""
    with pytest.raises(ValueError, match=r"reward_model\.enable_resource_pool.*legacy"):
        built(verl_config(**{"reward.reward_model.enable": True}))
    built(verl_config(**{"reward.reward_model.enable": True,
                         "reward.reward_model.enable_resource_pool": True}))  # scored in time
    with pytest.raises(ValueError, match=r"data\.custom_cls.*LZERLHFDataset"):
        built(verl_config(**{"data.custom_cls.path": None}))
    with pytest.raises(ValueError, match=r"data\.custom_cls: .*needs LZERLHFDataset.*got "
                                         r"OwnDataset; set data\.custom_cls\.path="):
        built(verl_config(**{"data.custom_cls.path": USER_DATASETS,
                             "data.custom_cls.name": "OwnDataset"}))
    with pytest.raises(ValueError, match="dataloader_num_workers"):
        built(verl_config(**{"data.dataloader_num_workers": 2}))
    same_files = verl_config(**{"data.train_files": ["t.parquet"], "data.val_files": "t.parquet"})
    built(same_files)  # no forward sampler: the validation set may be the train files
    with pytest.raises(ValueError, match=r"data\.val_files: the same files as data\.train_files"):
        built(same_files, forward={"method": "greso"})


@pytest.mark.parametrize("changes, sync_step, warned", [
    ({}, 1, False),  # B = 8, mini-batches of 2: k = 4
    ({"data.train_batch_size": 2}, 1, True),  # one mini-batch holds the whole batch
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 8}, 1, True),
    ({}, 4, True)])  # parameter_sync_step 4: samples of 2 groups, one mini-batch each
def test_selection_that_cannot_act_warns_at_start_up(changes, sync_step, warned):
    """Where every group would be kept (k rounds up to all of a sample's whole mini-batches),
    building the buffer warns, naming what to change; the steps then log
    lze/keep_ratio_effective = 1.0."""
    trainer = Trainer(verl_config(**changes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            LZEReplayBuffer("sync", OmegaConf.create({"parameter_sync_step": sync_step}), None,
                            "drop", OmegaConf.create({"num_prompts": NUM_PROMPTS}),
                            refill_fn=trainer._add_prompts_to_generate)
        finally:
            checkpoint.unregister("replay_buffer")
    said = [str(w.message) for w in caught if "selects nothing" in str(w.message)]
    assert len(said) == warned
    if warned:
        assert "lze/keep_ratio_effective = 1.0" in said[0] and "ppo_mini_batch_size" in said[0]


class TrainSet:
    """What LZERLHFDataset reports: its size and each row's prompt and extra_info.index (its
    row)."""

    def __init__(self, size):
        self.rows = RowTable(prompt_keys([prompt_of(r) for r in range(size)]), np.arange(size))

    def __len__(self):
        return len(self.rows)


def test_num_prompts_comes_from_the_train_set_or_is_checked_against_it():
    """Left out, num_prompts is the train set's size (the selector is built then, and a state
    restored before takes effect); given, it must be that size."""
    rb = buffer(Rollouts([]), lze={"keep_ratio": 0.5}, num_prompts=None)
    try:
        assert rb.selector is None
        state = LZESelector(6, LZEConfig(keep_ratio=0.5)).state_dict()
        state["step_counter"] += 3
        rb.load_state_dict({"selector": state})
        rb.use_train_set(TrainSet(6))
        assert rb.selector.num_prompts == 6 and int(rb.selector.state.step_counter[0]) == 3
        with pytest.raises(ValueError, match=r"num_prompts: 16 given.*7 rows"):
            buffer(Rollouts([]), num_prompts=16).use_train_set(TrainSet(7))
    finally:
        checkpoint.unregister("replay_buffer")


def put_groups(rows, pass_counts, prompts, step=1, extra_infos=None):
    """Finished groups as the agent loop stores them: each trajectory with its dataset item's
    fields (``rows``: their ``index``, ``prompts``: their ``raw_prompt``, ``extra_infos``:
    their ``extra_info``)."""
    uids = [uuid.uuid4().hex for _ in rows]
    tq.kv_batch_put(keys=uids, partition_id="train", tags=[
        {"is_prompt": True, "status": "finished", "global_steps": step} for _ in rows])
    keys, fields = [], []
    for uid, row, count, prompt, extra in zip(uids, rows, pass_counts, prompts, extra_infos):
        for session in range(GROUP):
            reward = torch.zeros(3)
            reward[-1] = float(session < count)
            keys.append(f"{uid}_{session}_0")
            fields.append({"rm_scores": reward, "index": int(row), "raw_prompt": prompt,
                           "extra_info": extra})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields),
                    tags=[{"status": "success", "global_steps": step}] * len(keys))


USER_DATASETS = os.path.join(os.path.dirname(__file__), "verl_cpu", "user_datasets.py")


def test_a_subclass_handing_extra_info_index_is_refused_at_its_fetch(transfer_queue, tmp_path):
    """An LZERLHFDataset subclass that hands verl extra_info.index as the row (data.custom_cls,
    built by verl's create_rl_dataset, which reports it to the buffer), over two files whose
    indices restart at 0, its items fetched by verl's dataloader in order: the first batch
    (prompts 0-3, at their rows) is rolled out (stored as the agent loop stores it) and
    selected; the second holds prompts 6 and 7 of the second file as rows 0 and 1, which hold
    prompts 0 and 1: its fetch is refused naming the fix, before any rollout, the selector as
    after the first step. A row drawn in two groups of one round is one prompt's (the dataset
    checked it): selected as one observation."""
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl_cpu import task

    files = [str(task.write_dataset(tmp_path / "a.parquet", 12, rows=list(range(6)))),
             str(task.write_dataset(tmp_path / "b.parquet", 12, rows=list(range(6, 12)),
                                    indices=list(range(6))))]
    rb = buffer(Rollouts([]), num_prompts=None, lze={"keep_ratio": 0.5, "noise_scale": 0.0})
    try:
        config = OmegaConf.create({"train_files": files, "filter_overlong_prompts": False,
                                   "custom_cls": {"path": USER_DATASETS,
                                                  "name": "SourceIndexDataset"}})
        dataset = create_rl_dataset(config.train_files, config, None, None)
        assert rb.selector.num_prompts == 12
        items = iter(StatefulDataLoader(dataset, batch_size=4, collate_fn=collate_fn))
        first = next(items)
        put_groups(first["index"], [1, 2, 3, 1], first["raw_prompt"], 1, first["extra_info"])
        rb.sample(global_steps=1, partition_id="train", batch_size=4)
        after = rb.selector.state_dict()
        with pytest.raises(ValueError, match=r"index: a prompt arrives as row 0, but row 0 of "
                                             r"the train set holds another prompt.*custom_cls"):
            next(items)
        assert same(rb.selector.state_dict(), after)
        clear_train_partition()
        put_groups([1, 2, 1, 3], [1, 2, 3, 1], [first["raw_prompt"][i] for i in (1, 2, 1, 3)], 2,
                   [first["extra_info"][i] for i in (1, 2, 1, 3)])
        rb.sample(global_steps=2, partition_id="train", batch_size=4)
        assert int(rb.selector.state.step_counter[0]) == 2
    finally:
        clear_train_partition()
        checkpoint.unregister("replay_buffer")


def test_refill_that_runs_out_of_rounds_says_which_setting(transfer_queue):
    """Every group all right (no energy, equal rewards) for max_rounds rounds: ValueError naming
    sampler_kwargs.max_rounds; the rolled-out groups leave TransferQueue."""
    rollouts = Rollouts(order=[4, 9, 14, 4, 9, 14, 4, 9])  # pass count 4 of 4: always solved
    rb = buffer(rollouts, mode="refill", max_rounds=2, lze={"keep_ratio": 0.5})
    try:
        rollouts.dispatch(2)
        with pytest.raises(ValueError, match=r"sampler_kwargs\.max_rounds: no group.*2 rounds"):
            rb.sample(global_steps=1, partition_id="train", batch_size=2)
        assert not tq.kv_list("train").get("train")
    finally:
        clear_train_partition()
        checkpoint.unregister("replay_buffer")


@pytest.mark.parametrize("order, trained", [
    ([0, 4, 9, 14, 4, 9, 14, 4], [0, 4]),  # 1 group can learn: filled to one unit of 2
    ([0, 1, 2, 4, 9, 14, 4, 9, 14, 4, 9, 14], [0, 1])])  # 3 can: cut to one unit
def test_a_short_refill_batch_trains_short_in_whole_mini_batches(transfer_queue, order, trained):
    """K = 4 wanted, mini-batches of 2 groups (dp 2), one round: fewer groups with energy than
    K. The batch is whole mini-batches (no padding rows v1 would add): the kept groups cut to
    whole units, or one unit filled with the best of the others."""
    rollouts = Rollouts(order=list(order))
    shape = UpdateShape(rollouts, 2, 2, train_batch=4)
    rb = buffer(rollouts, refill_fn=shape._add_prompts_to_generate, mode="refill", max_rounds=1,
                num_prompts=NUM_PROMPTS, lze={"keep_ratio": 0.5, "noise_scale": 0.0})
    try:
        rollouts.dispatch(4)
        batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=4)
        assert metrics["lze/kept_groups"] == 2 and len(batch.keys) == 2 * GROUP
        assert batch_rows(batch) == trained
        assert len(batch.keys) % shape._get_required_batch_multiple(2) == 0
        assert sorted(tq.kv_list("train")["train"]) == sorted(batch.keys)
    finally:
        clear_train_partition()
        checkpoint.unregister("replay_buffer")

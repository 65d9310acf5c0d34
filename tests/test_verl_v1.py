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

import uuid

import pytest
import torch

pytest.importorskip("verl")

import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels.integrations.verl import checkpoint  # noqa: E402
from lze_kernels.integrations.verl.checkpoint import LZERLHFDataset  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from verl.trainer.ppo.utils import create_rl_sampler  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn  # noqa: E402

GROUP, NUM_PROMPTS = 4, 16
# Pass counts (of GROUP) per dataset row: distinct mixed values so LZE's energies do not tie.
PASS_COUNT = {row: [1, 2, 3, 0, 4][row % 5] for row in range(NUM_PROMPTS)}


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

    def dispatch(self, count):
        rows = self.fetch(count)
        uids = [uuid.uuid4().hex for _ in rows]
        tq.kv_batch_put(keys=uids, partition_id="train", tags=[
            {"is_prompt": True, "status": "finished", "global_steps": self.step} for _ in rows])
        keys, fields = [], []
        for uid, row in zip(uids, rows):
            for session in range(GROUP):
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


def buffer(rollouts, **options):
    kwargs = OmegaConf.create({"num_prompts": NUM_PROMPTS, **options})
    return LZEReplayBuffer("sync", OmegaConf.create({}), None, "drop", kwargs,
                           poll_interval=0.01, refill_fn=rollouts.refill)


def batch_rows(batch):
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["index"])
    return sorted(set(int(r) for r in data["index"]))


def clear_train_partition():
    listed = tq.kv_list("train").get("train", {})
    if listed:
        tq.kv_clear(keys=list(listed), partition_id="train")


def rewards_of(rows):
    return torch.stack([(torch.arange(GROUP) < PASS_COUNT[r]).float() for r in rows])


def test_lze_batch_holds_the_selectors_pick(transfer_queue):
    """K = 4 groups at keep_ratio 0.5: the buffer rolls out 4 more through verl's refill, verl's
    sample materialises all 8, and the batch holds exactly the 4 groups an independent
    LZESelector keeps on the same rows and rewards; the others leave TransferQueue."""
    config = {"keep_ratio": 0.5, "noise_scale": 0.0}
    rollouts = Rollouts(order=[0, 1, 2, 5, 6, 7, 10, 11])
    rb = buffer(rollouts, lze=config)
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
    clear_train_partition()


def test_dapo_refills_until_the_batch_is_full(transfer_queue):
    """DAPO keeps groups with unequal rewards; verl's refill tops the batch up: 3 wanted, the
    first 3 prompts hold 1 mixed group (rows 3 and 4 are all wrong / all right), so 2 more are
    rolled out and both kept."""
    rollouts = Rollouts(order=[3, 4, 1, 2, 6])
    rb = buffer(rollouts, policy="dapo")
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
    rb = buffer(first, lze=config)
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
    resumed = buffer(second, lze=config)  # registers itself and takes the pending state
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
    with pytest.raises(ValueError, match="max_rounds"):
        buffer(rollouts, max_rounds=0)
    with pytest.raises(ValueError, match="keep_ratio"):
        buffer(rollouts, lze={"keep_ratio": 2.0})
    with pytest.raises(ValueError, match="forward: unknown options"):
        buffer(rollouts, forward={"method": "greso", "batch_size": 4, "temperature": 1.0})
    with pytest.raises(ValueError, match="pruner needs policy 'lze'"):
        buffer(rollouts, policy="dapo", forward={"method": "pruner", "batch_size": 4})
    with pytest.raises(ValueError, match="embeddings"):
        buffer(rollouts, forward={"method": "dots", "batch_size": 4})


def test_forward_dots_chooses_the_rows_verls_dataloader_fetches(transfer_queue, tmp_path,
                                                                  monkeypatch):
    """v1 forward selection: verl's train dataloader as _init_dataloader builds it (its own
    create_rl_sampler, single-prompt fetches as with DAPO's refill) over LZERLHFDataset serves
    the rows the buffer's DOTS sampler picks, and the buffer feeds it the groups verl generated.
    With one-hot embeddings an observed prompt is predicted at its own pass rate and an unseen
    one at the mean of the observed: the next batch starts with the prompts observed at 1/2 and
    holds none observed at 0 or 1. The tokenizer is the boundary: RLHFDataset's item is stubbed
    to its row."""
    monkeypatch.setattr(RLHFDataset, "__getitem__",
                        lambda self, item: {"index": item, "input_ids": torch.tensor([item])})
    dataset = object.__new__(LZERLHFDataset)
    dataset.dataframe, dataset.is_train = list(range(NUM_PROMPTS)), True
    loader = StatefulDataLoader(dataset, batch_size=1, drop_last=True, collate_fn=collate_fn,
                                sampler=create_rl_sampler(OmegaConf.create({"shuffle": False}),
                                                          dataset))
    torch.save(torch.eye(NUM_PROMPTS) * 20.0, tmp_path / "embeddings.pt")
    rollouts = Rollouts(iter(loader))
    rb = buffer(rollouts, policy="dapo", forward={
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

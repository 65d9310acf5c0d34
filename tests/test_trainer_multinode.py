"""Several nodes without a shared filesystem, simulated by threads as ranks: the model is fetched
once per node (its local rank 0), and a run folder the ranks do not share is refused at start
with an error naming trainer.run_dir, on every rank (no hang, no missing checkpoint file)."""

import threading

import pytest
import torch

from lze_trainer import checkpoint, model_source
from lze_trainer import distributed as D


class ThreadRanks:
    """Collectives of ``size`` ranks that are threads of this process."""

    def __init__(self, size: int):
        self.size, self._barrier = size, threading.Barrier(size, timeout=30)
        self._slots: list = [None] * size
        self._rank = threading.local()

    @property
    def rank(self) -> int:
        """The calling thread's rank."""
        return self._rank.value

    def all_gather_object(self, obj):
        self._slots[self._rank.value] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def broadcast_object(self, obj, src=0):
        return self.all_gather_object(obj)[src]

    def barrier(self):
        self._barrier.wait()

    def run(self, fn, local_size: int):
        """``fn(world)`` on every rank; returns each rank's result or exception."""
        results: list = [None] * self.size

        def rank_main(rank):
            self._rank.value = rank
            world = D.World(rank=rank, local_rank=rank % local_size, size=self.size,
                            local_size=local_size, device=torch.device("cpu"))
            try:
                results[rank] = fn(world)
            except Exception as error:  # collected, compared by the test
                results[rank] = error

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank hangs"
        return results


@pytest.fixture
def ranks(monkeypatch):
    fake = ThreadRanks(4)  # 2 nodes x 2 local ranks
    for name in ("all_gather_object", "broadcast_object", "barrier"):
        monkeypatch.setattr(D, name, getattr(fake, name))
    return fake


def test_each_node_downloads_once_and_its_other_ranks_read_its_cache(ranks, monkeypatch, tmp_path):
    calls = []

    def download(repo_id, cached_only=False):
        calls.append((threading.current_thread().name, cached_only))
        return f"/hf-cache/{repo_id}"

    monkeypatch.setattr(model_source, "_download", download)
    results = ranks.run(lambda w: model_source.resolve("owner/model", tmp_path, w, list), 2)
    assert results == ["/hf-cache/owner/model"] * 4
    assert sorted(cached for _, cached in calls) == [False, False, True, True]


def test_a_failed_download_on_one_node_is_raised_on_every_rank(ranks, monkeypatch, tmp_path):
    def download(repo_id, cached_only=False):
        if ranks.rank == 2:  # node 1's local rank 0
            return model_source.ModelSourceError("model.path: the hub is unreachable")
        return "/hf-cache/m"

    monkeypatch.setattr(model_source, "_download", download)
    results = ranks.run(lambda w: model_source.resolve("owner/model", tmp_path, w, list), 2)
    assert all(isinstance(r, model_source.ModelSourceError) for r in results), results


def test_shared_run_dir_passes_and_leaves_no_file(ranks, tmp_path):
    run_dir = tmp_path / "run"
    assert ranks.run(lambda w: checkpoint.check_shared_run_dir(run_dir, w), 2) == [None] * 4
    assert list(run_dir.iterdir()) == []


def test_run_dir_not_shared_by_a_node_is_refused_on_every_rank(ranks, tmp_path):
    def node_local(world):  # node 1 sees another folder at the same path
        run_dir = tmp_path / f"node{world.rank // 2}" / "run"
        return checkpoint.check_shared_run_dir(run_dir, world, wait_s=0.2)

    results = ranks.run(node_local, 2)
    for error in results:
        assert isinstance(error, checkpoint.CheckpointError)
        assert "trainer.run_dir" in str(error) and "rank(s) [2, 3]" in str(error)

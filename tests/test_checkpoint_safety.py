"""Checkpoint files are loaded without running code from them: every file the trainer's resume
reads (trainer state, RNG state, each rank's state) and the TRL integration's LZE state is loaded
with ``torch.load(weights_only=True)``; a crafted file whose pickle would run code is refused with
an error naming the file, and its payload never runs. The states the methods save (SPEED's
carried groups, the DOTS predictor, the replay buffer, GRESO's streaks, the selector) and the
RNG states round-trip through that load; RNG files of the older format are refused with a way to
convert them."""

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from crafted_state import Payload, same
from lze_kernels.serialization import UnsafeStateFileError, load_state_file
from lze_trainer import checkpoint
from test_replay import MIXED, step_batch
from test_replay import build as build_replay
from test_trainer_methods import build, one_process_group, run_step  # noqa: F401


class FakeEngine:
    """DeepSpeed's save/load calls, which write and read no trainer file (the end-to-end resume
    tests run the real engine)."""

    def save_checkpoint(self, root, tag, client_state):
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)

    def load_checkpoint(self, root, tag, **_):
        return str(Path(root) / tag), {}


CONFIG = {"world_size": 1, "trainer": {"seed": 0}}
FILES = (checkpoint.TRAINER_STATE, "rng_rank0.pt", "state_rank0.pt")


def save(run_dir, method, step=2):
    state = {"step": step, "method": method.state_dict(), "config": CONFIG}
    return checkpoint.save(FakeEngine(), run_dir, step, state, keep=2, rank=0,
                           rank_state=method.rank_state_dict())


# ---------------------------------------------------------------- the premise

def test_the_payload_runs_under_an_unsafe_load(tmp_path):
    """Without weights_only the crafted file runs its code (what the refusals below prevent)."""
    marker = tmp_path / "ran"
    torch.save({"step": Payload(marker)}, tmp_path / "state.pt")
    torch.load(tmp_path / "state.pt", weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------- the trainer's files

@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("raw_pickle", [False, True], ids=["torch-save", "raw-pickle"])
def test_a_crafted_checkpoint_file_is_refused_and_never_runs(tmp_path, name, raw_pickle):
    folder = save(tmp_path / "run", build("lze"))
    marker = tmp_path / "ran"
    crafted = {"step": 2, "config": CONFIG, "method": {"selector": Payload(marker)}}
    if raw_pickle:
        (folder / name).write_bytes(pickle.dumps(crafted))
    else:
        torch.save(crafted, folder / name)
    with pytest.raises(UnsafeStateFileError, match="refused") as refused:
        checkpoint.load(FakeEngine(), folder, 0, CONFIG)
    assert str(folder / name) in str(refused.value)
    if not raw_pickle:
        assert "builtins.exec" in str(refused.value)
    assert not marker.exists()


@pytest.mark.parametrize("method_name", ["lze", "greso", "speed"])
def test_method_states_round_trip_through_the_safe_load(tmp_path, method_name):
    """The states that are saved (SPEED's carried groups are RolloutGroups in the rank file) are
    read back equal."""
    method = (build(method_name, "selection.fill.factor=1.0") if method_name == "speed"
              else build(method_name))
    run_step(method, 0)
    if method_name == "speed":
        assert method.rank_state_dict()["fill_ready"] + method.rank_state_dict()["fill_pending"]
    folder = save(tmp_path / "run", method)
    state = checkpoint.load(FakeEngine(), folder, 0, CONFIG)
    assert same(state["method"], method.state_dict())
    assert same(state["rank_state"], method.rank_state_dict())


def test_the_dots_predictor_round_trips_through_the_safe_load(tmp_path):
    method = build("dots", "selection.dots.reference_size=9", "selection.dots.predictor_prompts=24",
                   "selection.dots.predictor_hidden=8", "selection.dots.predictor_epochs=3")
    method.chooser.embeddings = torch.nn.functional.one_hot(torch.arange(30) % 3, 3).float() * 5
    run_step(method, 0)
    assert method.chooser.adapter is not None
    state = checkpoint.load(FakeEngine(), save(tmp_path / "run", method), 0, CONFIG)
    assert same(state["method"], method.state_dict())


def test_the_replay_buffer_round_trips_through_the_safe_load(tmp_path):
    method = build_replay()
    batch = step_batch(list(range(4)), [MIXED] * 4, local_rows={0, 1})
    method.observe(batch, method.select(batch, 0))
    assert method.buffer.entries and method.buffer.tokens
    state = checkpoint.load(FakeEngine(), save(tmp_path / "run", method), 0, CONFIG)
    assert same(state["method"], method.state_dict())
    assert same(state["rank_state"], method.rank_state_dict())


def test_rng_states_resume_every_stream(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    folder = save(tmp_path / "run", build("lze"))
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    checkpoint.load(FakeEngine(), folder, 0, CONFIG)
    resumed = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert resumed[:2] == expected[:2] and torch.equal(resumed[2], expected[2])


def test_an_older_rng_file_is_refused_with_the_way_to_convert_it(tmp_path, capsys):
    """Before the safe load, rng_rank<r>.pt held numpy's state as an array."""
    folder = save(tmp_path / "run", build("lze"))
    np.random.seed(5)
    older = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    torch.save(older, folder / "rng_rank0.pt")
    expected = np.random.random(4)
    with pytest.raises(UnsafeStateFileError, match="--convert-trusted") as refused:
        checkpoint.load(FakeEngine(), folder, 0, CONFIG)
    assert "rng_rank0.pt" in str(refused.value) and "numpy" in str(refused.value)

    checkpoint.main(["--convert-trusted", str(folder)])
    assert "rewrote 1 RNG file" in capsys.readouterr().out
    np.random.seed(0)
    checkpoint.load(FakeEngine(), folder, 0, CONFIG)
    assert np.random.random(4).tolist() == expected.tolist()


# ---------------------------------------------------------------- the kernels' loader

def test_load_state_file_names_the_role_and_the_hint(tmp_path):
    marker = tmp_path / "ran"
    torch.save([Payload(marker)], tmp_path / "e.pt")
    with pytest.raises(UnsafeStateFileError,
                       match=r"^embeddings .*e\.pt: refused .* builtins\.exec.*Make it again\.$"):
        load_state_file(tmp_path / "e.pt", "embeddings", hint="Make it again.")
    assert not marker.exists()
    torch.save({"x": torch.ones(2), "n": [1, (2, 3.0)]}, tmp_path / "ok.pt")
    assert same(load_state_file(tmp_path / "ok.pt", "state"),
                {"x": torch.ones(2), "n": [1, (2, 3.0)]})


# ---------------------------------------------------------------- TRL

def test_a_crafted_trl_lze_state_is_refused_and_never_runs(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig

    from lze_kernels.integrations.trl import LZEGRPOTrainer
    from lze_kernels.integrations.trl.trainer import STATE_FILE
    from lze_trainer import tiny_model

    prompts = [f"What is {row} + 1?" for row in range(4)]
    model_dir = tiny_model.build("tiny:qwen2?hidden=32&layers=1&heads=2&kv_heads=1&vocab=300"
                                 "&seed=0", tmp_path / "tiny", prompts)
    config = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                        num_generations=4, max_completion_length=4, report_to=[],
                        save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = LZEGRPOTrainer(model=str(model_dir), args=config,
                             reward_funcs=lambda completions, **_: [0.0] * len(completions),
                             train_dataset=Dataset.from_dict({"prompt": prompts}))
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    marker = tmp_path / "ran"
    torch.save({"selector": Payload(marker), "planner": None}, folder / STATE_FILE)
    with pytest.raises(UnsafeStateFileError, match="builtins.exec") as refused:
        trainer._load_optimizer_and_scheduler(str(folder))
    assert str(folder / STATE_FILE) in str(refused.value)
    assert not marker.exists()

"""The example launch script's overrides and the quick start in docs/verl.md compose against the
installed verl's own config, and the selection parts verl would build from them come up (runs
where verl is installed)."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np

import pytest

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402

from lze_kernels.integrations.verl import checkpoint  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402
from lze_kernels.integrations.verl.row_table import RowTable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "verl" / "run_lze_grpo.sh"
DOCS = ROOT / "docs" / "verl.md"


def script_overrides(**env):
    """The hydra overrides the script passes to ``python3 -m verl.trainer.main_ppo``."""
    shim = ('python3() { shift 2; printf "%s\\n" "$@"; }; export -f python3; bash "$0"')
    out = subprocess.run(["bash", "-c", shim, str(SCRIPT)], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return [line for line in out.stdout.split("\n") if line]


def quick_start_overrides():
    """The hydra overrides of the quick start block in docs/verl.md."""
    block = re.search(r"<!-- verl quick start: begin -->\n```bash\n(.*?)```", DOCS.read_text(),
                      re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    return words[3:]


def composed(overrides):
    import verl.trainer.main_ppo as main_ppo

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


class TrainSet:
    """A train set of ``size`` rows whose extra_info.index are their rows, as the buffer sees it."""

    def __init__(self, size):
        self.rows = RowTable(np.arange(size), np.arange(size))  # keys: any distinct values

    def __len__(self):
        return len(self.rows)


def built_buffer(config):
    """What verl's PPOTrainer._build_replay_buffer passes to a custom sampler."""
    sampler = config.trainer.v1.sampler
    assert sampler.custom_sampler.name == LZEReplayBuffer.__name__
    return LZEReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.sync,
                           max_off_policy_threshold=sampler.max_off_policy_threshold,
                           max_off_policy_strategy=sampler.max_off_policy_strategy,
                           sampler_kwargs=sampler.sampler_kwargs, refill_fn=lambda n: n)


@pytest.mark.parametrize("forward, mode", [("", "topk"), ("greso", "topk"), ("", "refill")])
def test_example_script_composes_and_builds_the_buffer(forward, mode):
    config = composed(script_overrides(FORWARD=forward, MODE=mode))
    assert config.trainer.use_v1 and config.trainer.v1.trainer_mode == "sync"
    try:
        buffer = built_buffer(config)
        assert buffer.num_prompts is None and buffer.keep_ratio == 0.5  # the train set's size
        buffer.use_train_set(TrainSet(7473))  # LZERLHFDataset reports it when verl loads it
        assert buffer.selector.num_prompts == 7473
        assert buffer.mode == mode and (buffer.forward is not None) == bool(forward)
        assert config.data.custom_cls.name == "LZERLHFDataset"
        assert config.data.dataloader_num_workers == 0
        assert (config.data.gen_batch_size == 1) == (mode == "refill")
        # k = 64 of 128 groups, whole mini-batches: v1 adds no padding rows.
        assert 64 % config.actor_rollout_ref.actor.ppo_mini_batch_size == 0
    finally:
        checkpoint.unregister("replay_buffer")
        checkpoint.unregister(checkpoint.FORWARD)


def test_example_script_passes_num_prompts_only_when_set():
    key = "+trainer.v1.sampler.sampler_kwargs.num_prompts="
    assert not [o for o in script_overrides() if o.startswith(key)]
    assert f"{key}7473" in script_overrides(NUM_PROMPTS="7473")


def test_example_script_passes_the_method():
    method = "+trainer.v1.sampler.sampler_kwargs.method="
    assert f"{method}dapo" in script_overrides(METHOD="dapo")


def test_docs_quick_start_composes_and_builds_the_buffer():
    config = composed(quick_start_overrides())
    assert config.trainer.use_v1 and config.algorithm.adv_estimator == "grpo"
    try:
        buffer = built_buffer(config)
        assert buffer.mode == "topk" and buffer.method == "lze"
        assert buffer.num_prompts is None and buffer.keep_ratio == 0.5  # the train set's size
        assert config.data.custom_cls.name == "LZERLHFDataset"
        assert config.data.dataloader_num_workers == 0
        k = config.data.train_batch_size // 2
        assert k % config.actor_rollout_ref.actor.ppo_mini_batch_size == 0
    finally:
        checkpoint.unregister("replay_buffer")

"""The README's verl quick start composes against the installed verl's own config, and the
selection parts verl would build from it come up (runs where verl is installed; its commands
run as printed through verl's first step in tests/test_verl_fit.py)."""

import os

import pytest

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402

from lze_kernels.integrations.verl import checkpoint  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402
from readme_blocks import block, verl_overrides  # noqa: E402


def test_readme_verl_block_composes_and_builds_the_buffer():
    import verl.trainer.main_ppo as main_ppo

    overrides = verl_overrides(block("verl"))
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    assert config.trainer.total_epochs == 1  # the README's own override arrived
    assert config.data.train_files.endswith("gsm8k/train.parquet")
    sampler = config.trainer.v1.sampler
    assert sampler.custom_sampler.name == LZEReplayBuffer.__name__
    buffer = LZEReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.sync,
                             max_off_policy_threshold=sampler.max_off_policy_threshold,
                             max_off_policy_strategy=sampler.max_off_policy_strategy,
                             sampler_kwargs=sampler.sampler_kwargs, refill_fn=lambda n: n)
    assert buffer.num_prompts is None  # LZERLHFDataset hands it the train set's size
    checkpoint.unregister("replay_buffer")
    checkpoint.unregister(checkpoint.FORWARD)

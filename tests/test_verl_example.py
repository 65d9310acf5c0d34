"""The example launch script's overrides compose against the installed verl's own config, and the
selection parts verl would build from them come up (runs where verl is installed)."""

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402

from lze_kernels.integrations.verl import checkpoint  # noqa: E402
from lze_kernels.integrations.verl.replay_buffer import LZEReplayBuffer  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "verl" / "run_lze_grpo.sh"


def script_overrides(**env):
    """The hydra overrides the script passes to ``python3 -m verl.trainer.main_ppo``."""
    shim = ('python3() { shift 2; printf "%s\\n" "$@"; }; export -f python3; bash "$0"')
    out = subprocess.run(["bash", "-c", shim, str(SCRIPT)], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return [line for line in out.stdout.split("\n") if line]


@pytest.mark.parametrize("forward", ["", "greso"])
def test_example_script_composes_and_builds_the_buffer(forward):
    import verl.trainer.main_ppo as main_ppo

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=script_overrides(FORWARD=forward))
    assert config.trainer.use_v1 and config.trainer.v1.trainer_mode == "sync"
    sampler = config.trainer.v1.sampler
    assert sampler.custom_sampler.name == LZEReplayBuffer.__name__
    # What verl's PPOTrainer._build_replay_buffer passes to a custom sampler.
    buffer = LZEReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.sync,
                             max_off_policy_threshold=sampler.max_off_policy_threshold,
                             max_off_policy_strategy=sampler.max_off_policy_strategy,
                             sampler_kwargs=sampler.sampler_kwargs, refill_fn=lambda n: n)
    assert buffer.selector.num_prompts == 7473 and buffer.keep_ratio == 0.5
    assert (buffer.forward is not None) == bool(forward)
    assert config.data.custom_cls.name == "LZERLHFDataset"
    assert config.data.dataloader_num_workers == 0
    checkpoint.unregister("replay_buffer")
    checkpoint.unregister(checkpoint.FORWARD)

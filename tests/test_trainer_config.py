"""The trainer config: presets load and validate, bad keys and values fail naming the key."""

import pytest

from lze_trainer import config as C
from lze_trainer.data import parse_reasoning_gym_source
from lze_trainer.main import main

PRESETS = sorted(p.stem for p in C.PRESETS_DIR.glob("*.yaml"))


def test_every_preset_named_by_the_issue_exists():
    assert {"tiny", "demo", "smollm2-135m", "qwen2.5-math-1.5b"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_validate(preset):
    cfg = C.load(preset)
    assert "{question}" in cfg.data.prompt_template
    for source in [cfg.data.train, *cfg.data.eval]:
        if source.startswith("reasoning-gym:"):
            parse_reasoning_gym_source(source.partition("#")[0])  # task and fields exist


def test_paper_preset_is_the_lze_setting():
    cfg = C.load("qwen2.5-math-1.5b")
    assert cfg.model.path == "Qwen/Qwen2.5-Math-1.5B" and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.n == 8 and cfg.selection.policy == "lze"
    assert cfg.selection.keep_ratio == 0.4 and cfg.trainer.device == "cuda"
    assert "MATH" in cfg.data.train
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens <= 4096  # the model's context
    for world in (8, 16, 64):  # one node of 8 GPUs and multi-node
        C.validate_world(cfg, world)


def test_overrides_and_yaml_roundtrip(tmp_path):
    cfg = C.load("tiny", ["selection.keep_ratio=0.25", "actor.loss_agg_mode=seq-mean-token-mean",
                          "data.eval=[a,b]"])
    assert cfg.selection.keep_ratio == 0.25 and cfg.data.eval == ["a", "b"]
    path = tmp_path / "resolved.yaml"
    path.write_text(C.to_yaml(cfg))
    assert C.load(str(path)) == cfg  # the saved config reproduces the run's config


@pytest.mark.parametrize("override, key, expected", [
    (["selection.keep_ration=0.4"], "keep_ration", "not in"),
    (["actor.lr=fast"], "actor.lr", "could not be converted"),
    (["selection.policy=topk"], "selection.policy", "expected one of"),
    (["selection.keep_ratio=0"], "selection.keep_ratio", "(0, 1]"),
    (["actor.zero_stage=4"], "actor.zero_stage", "0, 1, 2 or 3"),
    (["trainer.batch_size=0"], "trainer.batch_size", "> 0"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["rollout.allocation=true", "rollout.n=64"], "rollout.n", "allocation_min"),
    (["trainer.stop_after_steps=999"], "trainer.stop_after_steps", "total_steps"),
    (["selection.hive_keep_share=0"], "selection.hive_keep_share", "(0, 1]"),
])
def test_bad_values_name_the_key(override, key, expected):
    with pytest.raises(C.ConfigError) as err:
        C.load("tiny", override)
    assert key in str(err.value) and expected in str(err.value)


def test_world_checks():
    cfg = C.load("tiny", ["trainer.batch_size=6", "rollout.tensor_parallel_size=2"])
    C.validate_world(cfg, 2)  # one engine over two ranks: any B
    with pytest.raises(C.ConfigError, match="rollout.tensor_parallel_size"):
        C.validate_world(cfg, 3)
    with pytest.raises(C.ConfigError, match="trainer.batch_size.*rollout engines"):
        C.validate_world(C.load("tiny", ["trainer.batch_size=5"]), 2)
    with pytest.raises(C.ConfigError, match="sft_warmup.batch_size"):
        C.validate_world(C.load("tiny", ["sft_warmup.batch_size=33"]), 2)


def test_warm_up_refuses_fewer_examples_than_a_batch(tmp_path):
    """A warm-up step draws sft_warmup.batch_size distinct examples: a smaller warm-up set is a
    config error (exit 2 on every rank), found before any model is loaded."""
    from lze_trainer.prompts import PromptSet
    from lze_trainer.warmup import warm_up

    cfg = C.load("tiny", ["sft_warmup.batch_size=32"])
    too_few = PromptSet("sft_warmup", rows=[{"ground_truth": "1"}] * 31, token_ids=[[1]] * 31)
    with pytest.raises(C.ConfigError, match="sft_warmup.batch_size: 32 .* only 31"):
        warm_up(cfg, None, "unused", lambda: too_few, None, tmp_path, None)


def test_unknown_preset_lists_presets():
    with pytest.raises(C.ConfigError, match="presets: .*tiny"):
        C.load("no-such-preset")


def test_cli_reports_config_errors_before_starting(capsys):
    assert main(["--config", "tiny", "selection.policy=best"]) == 2
    err = capsys.readouterr().err
    assert "selection.policy" in err and "expected one of" in err

"""The trainer config: presets load and validate, bad keys and values fail naming the key; every
field has its help, --help lists the presets and --print-config prints every preset; defaults
that follow other settings."""

import dataclasses
import subprocess
import sys

import pytest
import yaml

from lze_trainer import config as C
from lze_trainer.data import parse_reasoning_gym_source
from lze_trainer.main import main

PRESETS = sorted(p.stem for p in C.PRESETS_DIR.glob("*.yaml"))


def test_the_documented_presets_exist():
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
    assert cfg.rollout.n == 8 and cfg.selection.method == "lze"
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
    (["selection.method=topk"], "selection.method", "expected one of"),
    (["selection.keep_ratio=0"], "selection.keep_ratio", "(0, 1]"),
    (["actor.zero_stage=4"], "actor.zero_stage", "0, 1, 2 or 3"),
    (["trainer.batch_size=0"], "trainer.batch_size", "> 0"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["rollout.allocation=true", "rollout.allocation_min=5"], "rollout.n", "allocation_min"),
    (["trainer.stop_after_steps=999"], "trainer.stop_after_steps", "total_steps"),
    (["selection.hive.keep_share=0"], "selection.hive.keep_share", "(0, 1]"),
    # Explicit values out of a range that another setting fixes still fail (the defaults follow).
    (["selection.method=speed", "selection.speed.screen_rollouts=4"],
     "selection.speed.screen_rollouts", "[2, rollout.n = 4)"),
    (["selection.method=speed", "selection.speed.screen_rollouts=1"],
     "selection.speed.screen_rollouts", "never mixed"),
    (["selection.method=speed", "rollout.n=2"], "selection.speed.screen_rollouts",
     "SPEED needs rollout.n >= 3"),
    (["selection.hive.keep_share=0.2", "selection.hive.pool_factor=4"],
     "selection.hive.pool_factor", ">= 1 / selection.hive.keep_share"),
    (["rollout.allocation=true", "rollout.allocation_max=3"], "rollout.n", "allocation_max"),
    (["selection.dots.reference_size=0"], "selection.dots.reference_size", "> 0"),
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
    assert main(["--config", "tiny", "selection.method=best"]) == 2
    err = capsys.readouterr().err
    assert "selection.method" in err and "expected one of" in err


# ---------------------------------------------------------------- help, --help, --print-config

def _sections(cls=C.Config):
    """Every config dataclass reachable from ``cls``."""
    found = [cls]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            found += _sections(f.default_factory)
    return found


def test_every_field_has_its_help():
    missing = [f"{cls.__name__}.{f.name}" for cls in _sections() for f in dataclasses.fields(cls)
               if len(f.metadata.get("help", "").strip()) < 8]
    assert not missing, f"fields without help text: {missing}"
    assert len(_sections()) == 16  # 9 sections, 6 method groups under selection, and Config


def test_help_lists_every_preset_with_a_line_and_explains_overrides(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for preset in PRESETS:
        line = next(line for line in out.splitlines() if line.strip().startswith(preset + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # the preset's first comment line
    for text in C.preset_descriptions().values():  # a whole line, not one cut mid-sentence
        assert text.endswith((".", ")")), text
    assert "--print-config" in out and "section.key=value" in out and "docs/config.md" in out


@pytest.mark.parametrize("preset", PRESETS)
def test_print_config_prints_the_resolved_yaml_with_help_and_exits(preset, tmp_path):
    """Plain python, no torchrun: exit 0 and YAML that loads back to the same config."""
    result = subprocess.run([sys.executable, "-m", "lze_trainer", "--config", preset,
                             "--print-config", "selection.method=speed"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch" not in result.stderr.lower() and result.stderr == ""
    printed = result.stdout
    assert yaml.safe_load(printed)["selection"]["method"] == "speed"
    assert "  # G, responses per prompt\n  n: " in printed  # the help above its key
    assert "[grpo | dapo | lze | dots | greso | speed]" in printed  # a Literal's choices
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert C.load(str(path)) == C.load(preset, ["selection.method=speed"])


def test_commented_yaml_of_every_value_kind_loads_back(tmp_path):
    cfg = C.load("tiny", ["data.eval=[a.jsonl,'b: c']",
                          "data.prompt_template='{question} \\boxed{}'",
                          "trainer.eval_at_flops=[1e9,2.5e9]", "sft_warmup.seed=null"])
    path = tmp_path / "c.yaml"
    path.write_text(C.commented_yaml(cfg, "two\nlines"))
    assert path.read_text().startswith("# two\n# lines\n")
    assert C.load(str(path)) == cfg


# ---------------------------------------------------------------- defaults that follow

@pytest.mark.parametrize("n, screen", [(3, 2), (4, 2), (6, 2), (8, 3), (12, 4), (24, 8)])
def test_speed_screening_default_is_a_third_of_the_group(n, screen):
    cfg = C.load("tiny", ["selection.method=speed", f"rollout.n={n}"])
    assert cfg.selection.speed.screen_rollouts == screen
    explicit = C.load("tiny", ["selection.method=speed", f"rollout.n={n}",
                               "selection.speed.screen_rollouts=2"])
    assert explicit.selection.speed.screen_rollouts == 2


def test_derived_defaults_follow_their_settings():
    cfg = C.load("tiny", ["trainer.batch_size=64", "rollout.n=12",
                          "selection.hive.keep_share=0.25"])
    assert cfg.selection.dots.reference_size == 32  # B / 2, the official 256 of 512
    assert cfg.rollout.allocation_max == 24  # 2 x rollout.n
    assert cfg.selection.hive.pool_factor == 8.0  # twice the shortlist of B / keep_share
    assert C.load("tiny", ["trainer.batch_size=5"]).selection.dots.reference_size == 3


# Every method switch with its defaults on the tiny and demo presets (those with a derived
# default also train on tiny: tests/test_trainer_methods_e2e.py::test_every_derived_default_runs).
SWITCHES = {
    "grpo": ["selection.method=grpo"],
    "dapo": ["selection.method=dapo"],
    "lze": ["selection.method=lze"],
    "lze-refill": ["selection.method=lze", "selection.refill=true"],
    "lze-release": ["selection.method=lze", "selection.keep_ratio_schedule=release"],
    "lze-prune": ["selection.method=lze", "selection.prune=true"],
    "lze-allocation": ["selection.method=lze", "rollout.allocation=true"],
    "dots": ["selection.method=dots"],
    "dots-replay": ["selection.method=dots", "replay.ratio=0.5"],
    "greso": ["selection.method=greso"],
    "speed": ["selection.method=speed"],
    "speed-greso": ["selection.method=speed", "selection.speed.prefilter=greso"],
    "greso-keep-top-energy": ["selection.method=greso", "selection.keep_top_energy=true"],
    "lze-hive": ["selection.method=lze", "selection.entropy_filter=true"],
    "grpo-hive": ["selection.method=grpo", "selection.entropy_filter=true"],
}


@pytest.mark.parametrize("preset", ["tiny", "demo"])
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_every_method_switch_loads_with_its_defaults(switch, preset):
    cfg = C.load(preset, SWITCHES[switch])
    C.validate_world(cfg, 2)


# ---------------------------------------------------------------- the generated key reference

def test_docs_config_md_lists_every_key_as_the_command_writes_it():
    from pathlib import Path

    from lze_trainer.config_reference import MARKER, written

    page = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert page == written(page), ("docs/config.md is out of date: run "
                                   "`python -m lze_trainer.config_reference docs/config.md`")
    listed = page.split(MARKER, 1)[1]
    keys = _dotted_keys(C.Config())
    assert [k for k in keys if f"| `{k}` |" not in listed] == [] and len(keys) > 100


def _dotted_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        keys += (_dotted_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value)
                 else [prefix + f.name])
    return keys

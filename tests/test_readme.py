"""Every code block of the README runs, or is checked as far as this machine allows; how each one
is treated is the list ``RULES`` in tests/readme_blocks.py. The README stays a front page: at most
300 lines."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from readme_blocks import HUB_MODEL, README, ROOT, RULES, block, blocks, rule_of, run_bash

TESTS = Path(__file__).resolve().parent
# What the slow trainer run adds to the README's overrides: one CPU rank, Hugging Face generation,
# two small steps, nothing written but the run folder.
SHRINK = ("rollout.engine=hf trainer.device=cpu trainer.total_steps=2 trainer.batch_size=2 "
          "rollout.n=4 rollout.max_new_tokens=8 trainer.eval_every=0 trainer.save_hf_model=false "
          "trainer.progress_bar=false")


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 300


def test_every_block_has_exactly_one_rule_and_every_rule_a_block():
    unmatched = [str(b) for b in blocks() if rule_of(b) is None]
    assert unmatched == [], "blocks no rule (or more than one) in tests/readme_blocks.py covers"
    used = [rule_of(b).name for b in blocks()]
    assert sorted(used) == sorted(r.name for r in RULES)


def scratch(tmp_path: Path) -> Path:
    """A folder holding what the quick starts create before the block under test."""
    out = run_bash(block("prompts").text, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (tmp_path / "my_reward.py").write_text(block("reward").text)
    return tmp_path


def environment(tmp_path: Path) -> dict:
    """``python`` is this interpreter; the scratch folder is where my_reward.py is found."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {"PATH": path, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS)]),
            "TRITON_INTERPRET": "1"}


# ----------------------------------------------------------------------------- fast


def test_kernels_block_prints_what_its_comments_show(tmp_path, capsys, monkeypatch):
    text = block("kernels").text
    monkeypatch.chdir(tmp_path)
    exec(compile(text, "README kernels block", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    shown = [re.search(r"#.*?(tensor\(\[[^\]]*\]\))", line).group(1)
             for line in text.splitlines() if line.startswith("print(")]
    assert printed == shown
    assert (tmp_path / "selector.pt").exists()


def test_prompts_block_writes_json_lines(tmp_path):
    import json

    rows = [json.loads(line) for line in (scratch(tmp_path) / "prompts.jsonl").read_text().split(
        "\n") if line]
    assert rows and all(set(r) == {"question", "answer"} for r in rows)


def test_reward_block_is_a_reward_function(tmp_path, monkeypatch):
    """reward.function=my_reward:score resolves through the trainer's own loader."""
    from lze_trainer.reward import import_function

    monkeypatch.syspath_prepend(str(scratch(tmp_path)))
    score = import_function("my_reward:score")
    assert score("so the answer is 42", "42", "prompts.jsonl", {}) == 1.0
    assert score("41", "42", "prompts.jsonl", {}) == 0.0


def test_trl_block_compiles_and_names_what_exists():
    pytest.importorskip("trl")
    tree = ast.parse(block("trl").text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = __import__(node.module, fromlist=[a.name for a in node.names])
            assert all(hasattr(module, a.name) for a in node.names), node.module


def test_trainer_block_runs_with_a_checking_torchrun(tmp_path):
    """python runs for real (--print-config); each torchrun line is parsed and its config loaded
    and validated for its world size."""
    prelude = f'torchrun() {{ python "{TESTS / "readme_torchrun.py"}" "$@"; }}\n'
    out = run_bash(prelude + block("trainer").text, cwd=scratch(tmp_path),
                   env=environment(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.findall(r"^world=(\d+)$", out.stdout, re.M) == ["8", "16"]
    assert "reward:" in out.stdout and "my_reward:score" in out.stdout  # the printed config


def test_verl_block_passes_the_selection_overrides():
    from readme_blocks import verl_overrides

    overrides = verl_overrides(block("verl"))
    assert "trainer.v1.sampler.custom_sampler.name=LZEReplayBuffer" in overrides
    assert "data.custom_cls.name=LZERLHFDataset" in overrides
    assert "trainer.total_epochs=1" == overrides[-1]  # the README's own extra override, last


def test_make_block_names_makefile_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = [line.split("#")[0].split() for line in block("make").text.splitlines()]
    assert [c[1] for c in commands if c] == ["demo", "test", "bench"]
    assert {c[1] for c in commands if c} <= targets


# ----------------------------------------------------------------------------- slow


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from lze_trainer import tiny_model

    corpus = ["What is 17 + 25?", "42", "What is 9 * 8?", "72"] + [str(n) for n in range(100)]
    spec = "tiny:qwen2?hidden=64&layers=1&heads=2&kv_heads=1&vocab=300&seed=0"
    return tiny_model.build(spec, tmp_path_factory.mktemp("tiny"), corpus)


@pytest.mark.slow
def test_trl_block_trains(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    text = block("trl").text.replace(HUB_MODEL, str(tiny_model_dir))
    (scratch(tmp_path) / "trl_quick_start.py").write_text(text)
    out = subprocess.run([sys.executable, "trl_quick_start.py"], cwd=tmp_path,
                         env={**os.environ, **environment(tmp_path)}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'lze/kept_groups'" in out.stdout + out.stderr


@pytest.mark.slow
def test_trainer_block_trains_on_the_jsonl_with_the_reward_function(tmp_path, tiny_model_dir):
    """The first torchrun line for real: one CPU rank, 2 small steps (SHRINK), the tiny model."""
    prelude = (f'export README_TORCHRUN_RUN=1 README_TORCHRUN_MODEL="{tiny_model_dir}" '
               f'README_TORCHRUN_EXTRA="{SHRINK}"\n'
               f'torchrun() {{ python "{TESTS / "readme_torchrun.py"}" "$@"; '
               f'unset README_TORCHRUN_RUN; }}\n')
    out = run_bash(prelude + block("trainer").text, cwd=scratch(tmp_path),
                   env=environment(tmp_path), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    from lze_trainer.metrics import read_jsonl

    steps = read_jsonl(tmp_path / "runs" / "my-lze" / "metrics.jsonl")
    assert [s["step"] for s in steps if "step" in s][-1] == 2
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)

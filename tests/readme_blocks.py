"""The README's fenced code blocks, and how the tests run each one (tests/test_readme.py, and
tests/test_verl_readme.py in verl's environment).

Every block must match exactly one rule of :data:`RULES` by a marker it contains, and every rule
must match a block: a new block fails the tests until a rule says how it is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    line: int  # 1-based line of the opening fence

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.language})"


@dataclass(frozen=True)
class Rule:
    name: str
    language: str
    marker: str  # a substring only this block contains
    how: str  # what the tests do with it


RULES = (
    Rule("kernels", "python", "selector = LZESelector(",
         "run (fast); every printed tensor equals the one its comment shows"),
    Rule("prompts", "python", 'open("prompts.jsonl", "w")',
         "run in a scratch folder (fast); the file is the data of the next blocks"),
    Rule("trl", "python", "LZEGRPOTrainer(",
         "compiled (fast); run as written, its imports too, with the lines of trl-small before "
         "its `trainer = ` line (slow)"),
    Rule("trl-small", "python", 'resolve("warm:demo")',
         "its imports checked (fast); added to the trl block for its run (slow), as the README "
         "says"),
    Rule("reward", "bash", "cat > my_reward.py",
         "run by bash in a scratch folder (fast): it writes my_reward.py, whose function is "
         "called"),
    Rule("trainer-cpu", "bash", "trainer.device=cpu",
         "run by bash after the prompts and reward blocks (fast): python runs for real "
         "(--print-config), torchrun is a stand-in that records its launch, then parsed with "
         "torch.distributed.run's parser, the config of its overrides loaded and validated for "
         "its world size, and the data checked to fill a step; and run as pasted, with the real "
         "torchrun and nothing added to the environment: two steps on one CPU rank (slow)"),
    Rule("trainer-gpu", "bash", "--nproc_per_node=8 -m lze_trainer",
         "run by bash after the prompts and reward blocks with the stand-in torchrun, its launch "
         "checked as the CPU block's (fast): it cannot run on a CPU"),
    Rule("verl", "bash", "examples/verl/run_lze_grpo.sh",
         "run by bash with python3 a stand-in that records verl's overrides (fast); "
         "tests/test_verl_readme.py composes them against the installed verl's config, "
         "tests/test_verl_fit.py runs it through verl's first step"),
    Rule("make", "bash", "make demo",
         "each command names a target of the Makefile (fast; the targets are the suite itself)"),
)

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def rule_of(block: Block) -> Rule | None:
    matches = [r for r in RULES if r.language == block.language and r.marker in block.text]
    return matches[0] if len(matches) == 1 else None


def block(name: str) -> Block:
    (found,) = [b for b in blocks() if (r := rule_of(b)) and r.name == name]
    return found


def run_bash(script: str, cwd: Path, env: dict | None = None, timeout: float = 300):
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


# A stand-in for torchrun that records each launch, one line of bash-quoted arguments a launch, for
# tests/readme_torchrun.py to check (read back by shlex).
RECORD_TORCHRUN = 'torchrun() { printf "%q " "$@" >> "$LAUNCHES"; echo >> "$LAUNCHES"; }\n'

# A stand-in for python3 that prints the arguments verl's launch would get, one a line, instead
# of starting verl (the example script calls `python3 -m verl.trainer.main_ppo ...`); the verl
# block's install and data lines (pip, python) do nothing here: tests/test_verl_fit.py runs them.
RECORD_PYTHON3 = ('pip() { :; }; python() { :; }; export -f pip python\n'
                  'python3() { shift 2; printf "%s\\n" "$@"; }; export -f python3\n')


def verl_overrides(verl_block: Block) -> list[str]:
    """The hydra overrides the README's verl block passes to verl's main_ppo."""
    out = run_bash(RECORD_PYTHON3 + verl_block.text, cwd=ROOT)
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    return [line for line in out.stdout.split("\n") if line]

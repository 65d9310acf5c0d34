"""Launching the trainer and its distributed checks under torchrun, for the end-to-end tests."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_command(nproc: int, *args: str) -> list[str]:
    # --standalone: a free rendezvous port, so concurrent runs never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *args]


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(nproc, *args), cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=timeout)


def train(run_dir: Path, *overrides: str, nproc: int = 2, preset: str = "tiny",
          timeout: float = 600) -> subprocess.CompletedProcess:
    return run(nproc, "-m", "lze_trainer", "--config", preset, f"trainer.run_dir={run_dir}",
               *overrides, timeout=timeout)


def tail(result: subprocess.CompletedProcess, lines: int = 60) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])

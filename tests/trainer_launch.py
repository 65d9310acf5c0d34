"""Launching the trainer and its distributed checks under torchrun, for the end-to-end tests."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# A 4-step run of the tiny preset with vLLM engines, checkpoints at step 2 and its rollouts dumped,
# rewarded for response-length parity (mixed groups every step), no held-out evaluation or HF
# save: what the end-to-end tests of a method switch run twice to check resume.
RESUME_CHECK_STEPS = 4
RESUME_CHECK_RUN = ["rollout.engine=vllm", f"trainer.total_steps={RESUME_CHECK_STEPS}",
                    "trainer.dump_rollouts=true", "trainer.save_every=2",
                    "trainer.save_hf_model=false", "trainer.eval_every=0", "data.eval=[]",
                    "reward.function=trainer_rewards:even_length"]


def torchrun_command(nproc: int, *args: str) -> list[str]:
    # --standalone: a free rendezvous port, so concurrent runs never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *args]


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def run(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(nproc, *args), cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=timeout)


def train(run_dir: Path, *overrides: str, nproc: int = 2, preset: str = "tiny",
          timeout: float = 600) -> subprocess.CompletedProcess:
    return run(nproc, "-m", "lze_trainer", "--config", preset, f"trainer.run_dir={run_dir}",
               f"trainer.threads_per_rank={threads_per_rank(nproc)}", *overrides,
               timeout=timeout)


def threads_per_rank(nproc: int) -> int:
    """Each rank's share of the cores when pytest-xdist runs other tests beside this one: the
    trainer's default (all of the machine's cores over the node's ranks) would oversubscribe
    them, and busy-waiting intra-op threads then ran a 1-rank warm-up 5x slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // (nproc * workers))


def tail(result: subprocess.CompletedProcess, lines: int = 60) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def rerun_from_checkpoint(run_dir: Path, step: int, *overrides: str, **launch) -> Path:
    """Resume a finished run from its checkpoint at ``step`` in a copy of its folder (later
    checkpoints dropped): one launch proves exact resume against the run itself, where a
    stop-and-resume pair would need a third launch for the reference."""
    import shutil

    from lze_trainer.checkpoint import checkpoints_dir, tag

    copy = run_dir.parent / f"{run_dir.name}-from-{step}"
    shutil.copytree(run_dir, copy)
    for folder in checkpoints_dir(copy).glob("step_*"):
        if folder.name > tag(step):
            shutil.rmtree(folder)
    result = train(copy, *overrides, "trainer.resume=auto", **launch)
    if result.returncode != 0:
        raise AssertionError(tail(result))
    return copy


def assert_same_steps(run_dir: Path, other_dir: Path, steps) -> None:
    """Two runs' ``rollouts.jsonl`` (``trainer.dump_rollouts=true``) agree on ``steps``: the same
    prompts, rewards, kept groups, responses and update."""
    import pytest

    from lze_trainer.metrics import read_jsonl

    expected = {r["step"]: r for r in read_jsonl(run_dir / "rollouts.jsonl")}
    actual = {r["step"]: r for r in read_jsonl(other_dir / "rollouts.jsonl")}
    for step in steps:
        for key in ("prompt_ids", "rewards", "kept_rows", "responses", "update_tokens"):
            assert actual[step][key] == expected[step][key], (step, key)
        assert actual[step]["pg_loss"] == pytest.approx(expected[step]["pg_loss"], abs=1e-6)

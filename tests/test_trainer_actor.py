"""The DeepSpeed actor under torchrun: the update is the same on 1 and 2 ranks (global token
normalisation, zero-weight padding), dropped groups change nothing, non-finite losses are skipped."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from lze_trainer import tiny_model
from trainer_launch import run, tail

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    return str(tiny_model.build("tiny:qwen2?hidden=64&layers=2&heads=2&kv_heads=1&vocab=300",
                                folder, ["Calculate 1 + 2.", "3"] * 50))


def _check(nproc, modes, model_dir, out):
    out.mkdir(exist_ok=True)
    result = run(nproc, "tests/distributed/actor_checks.py", modes, model_dir, str(out))
    assert result.returncode == 0, tail(result)
    return out


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    """One 2-rank launch runs both checks (a launch is mostly start-up)."""
    return _check(2, "update,nonfinite", model_dir, tmp_path_factory.mktemp("two_ranks"))


def test_update_is_the_same_on_one_and_two_ranks(model_dir, two_ranks, tmp_path):
    paths = [_check(1, "update", model_dir, tmp_path / "one") / "update", two_ranks / "update"]
    one, two = (torch.load(p) for p in paths)
    info = [json.loads(p.with_name("update.json").read_text()) for p in paths]
    # Adam's first step moves a weight by lr g / (|g| + eps): by +-lr (0.01) wherever |g| >> eps,
    # whatever g's rounding, but where a gradient cancels to within a few eps (1e-8) the fp32
    # rounding of another summation order (gradients equal to 4e-7 of their scale) moves it by
    # up to some 1e-5 (measured); a wrong gradient moves weights by up to 2 lr.
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-4)
    # Adam hides a global scale error in the weights; the gradient norm does not.
    assert info[1]["grad_norm"] == pytest.approx(info[0]["grad_norm"], rel=1e-4)
    for i in info:
        assert i["update_tokens"] == i["kept_tokens"]  # whole kept groups, nothing else
        assert not i["dropped_groups_changed_weights"]
        assert i["objective_gain"] > 0  # the update moves the policy up the objective
        # ppo_epochs=2 x mini_batches=2: four steps; after the first the policy has moved away
        # from the recomputed old log-probs (lr 0.01), so the clip is active on some tokens.
        assert i["multi_updates"] == 4 and i["multi_clipped_tokens"] > 0


def test_nonfinite_loss_skips_the_update(two_ranks):
    results = json.loads((two_ranks / "nonfinite").read_text())
    assert set(results) == {"0", "2", "3"}
    for stage, r in results.items():
        assert r == {"skipped": 1, "unchanged": True, "finite_skipped": 0, "trained_after": True}, stage


def test_deepspeed_starts_beside_a_stale_extension_lock(tmp_path):
    """An interrupted JIT build of DeepSpeed's shared-memory op leaves torch's lock file behind;
    the trainer's DeepSpeed never builds that op, so a start still finishes (it waited forever)."""
    extensions = tmp_path / "torch_extensions"  # TORCH_EXTENSIONS_DIR/<op name>/lock
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    code = ("import os\n"
            "os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',"
            " MASTER_PORT=os.environ['PORT'])\n"
            "from lze_trainer import distributed\n"
            "distributed.import_deepspeed().init_distributed(dist_backend='gloo')\n"
            "print('started')\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PORT": str(_free_port())}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0 and "started" in result.stdout, result.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

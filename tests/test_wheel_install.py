"""The wheel as a user installs it: `pip install lze_kernels-<ver>-<tags>.whl` into a fresh venv
whose PATH holds no C/C++ compiler, nvcc or CMake, beside a torch of today and one over a year
older, and the kernel tests then pass against the installed wheel (the cpu backend, and Triton
interpreted where the Triton installed beside that torch is one the package supports).

`make test-wheel` runs this file on the wheels of `make wheel` (LZE_TEST_WHEELS=dist); those
tests are skipped otherwise, since they install two torch builds (one a CUDA build from PyPI,
several GB) and take minutes: `make test` builds no wheel. It runs the first test, which loads the
compiled modules of this venv's build without torch. The wheel's own checks (modules, fatbin
architectures, no libtorch linked, size) are tools/check_wheel.py's, which `make wheel` runs.
"""

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = os.environ.get("LZE_TEST_WHEELS")
needs_wheels = pytest.mark.skipif(not WHEELS, reason="make test-wheel runs it (LZE_TEST_WHEELS)")

# torch and what goes beside it -> the kernel tests' extra pytest arguments. 2.13.0 is the CPU
# build (a local wheel here, PyTorch's CPU index elsewhere) with the Triton its CUDA build pins.
# 2.5.1 (October 2024) is the oldest torch the package runs on (2.4's torch.library.custom_op
# rejects the string annotations of lze_kernels/native.py): PyPI's CUDA 12 build, which runs on a
# CPU too; the Triton 3.1 it pins is below the package's (requirements/triton.in), so the Triton
# cases are left out there.
TORCH_SETS = {
    "2.13.0": (["torch==2.13.0", "triton==3.7.1"], []),
    "2.5.1": (["torch==2.5.1", "numpy<2"], ["-k", "not triton"]),
}
TEST_TOOLS = ["numpy", "pytest", "hypothesis"]
COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "nvcc", "cmake")
KERNEL_TESTS = ["tests/test_backends.py", "tests/test_reference.py", "tests/test_selector.py",
                "tests/test_ops_bad_input.py", "tests/test_topk_linear.py", "tests/test_dots.py"]
# Where and what the installed package is, asked from the clone's root with `python -P`.
PROBE = """\
import shutil, lze_kernels, torch
from lze_kernels import dispatch
print(lze_kernels.__file__)
print(torch.__version__, dispatch.BACKENDS["cpu"].available())
print([c for c in {compilers!r} if shutil.which(c)])
"""


# Loads each compiled module given by path, in an interpreter started with -S -I (no
# site-packages, so no torch), then prints the torch libraries mapped into the process. Python
# loads extension modules with RTLD_NOW: a module that used any libtorch symbol fails to load.
LOAD_WITHOUT_TORCH = """\
import importlib.util, sys
for path in sys.argv[1:]:
    name = "lze_kernels." + path.rsplit("/", 1)[-1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
maps = open("/proc/self/maps").read().splitlines()
print(sorted({line.rsplit("/", 1)[-1] for line in maps if "libtorch" in line or "libc10" in line}))
"""


def load_without_torch(python: str, modules: list) -> str:
    """What :data:`LOAD_WITHOUT_TORCH` prints for ``modules`` under ``python``: ``[]`` when they
    all loaded with no torch library in the process."""
    return subprocess.run([python, "-S", "-I", "-c", LOAD_WITHOUT_TORCH, *map(str, modules)],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_compiled_modules_load_without_torch():
    """This venv's build of every compiled module (the wheel's are checked in the same way
    below): raw pointers in and out, so nothing of libtorch is linked or used."""
    names = ("_lze_cpu", "_lze_cuda", "_lze_cuda_emu")
    specs = [importlib.util.find_spec(f"lze_kernels.{n}") for n in names]
    built = [spec.origin for spec in specs if spec is not None]
    assert any("_lze_cpu" in path for path in built), "the CPU module is not built (make build)"
    assert load_without_torch(sys.executable, built) == "[]"


def the_wheel() -> Path:
    """The wheel of `make wheel` for this interpreter."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = sorted(Path(WHEELS).glob(f"lze_kernels-*-{tag}-{tag}-manylinux*.whl"))
    assert found, f"no {tag} wheel in {WHEELS} (make wheel)"
    return found[-1]


def bare_env(venv: Path) -> dict:
    """The venv's bin folder as the whole PATH: no compiler, nvcc or CMake can be found."""
    keep = ("HOME", "LANG", "TMPDIR", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_CERT",
            "PIP_DEFAULT_TIMEOUT", "PIP_EXTRA_INDEX_URL", "CI")
    env = {k: v for k, v in os.environ.items() if k in keep}
    return {**env, "PATH": str(venv / "bin"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module", params=sorted(TORCH_SETS), ids=lambda v: f"torch-{v}")
def installed(request, tmp_path_factory):
    """A fresh venv with the wheel and one torch set installed through the bare PATH."""
    venv = tmp_path_factory.mktemp(f"torch-{request.param}") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = bare_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run([*pip, str(the_wheel()), *TORCH_SETS[request.param][0], *TEST_TOOLS],
                   env=env, check=True, timeout=3600)
    return request.param, venv, env


@needs_wheels
def test_the_wheel_serves_the_compiled_kernels_without_a_compiler(installed):
    torch_version, venv, env = installed
    probe = PROBE.format(compilers=COMPILERS)
    out = subprocess.run([str(venv / "bin" / "python"), "-P", "-c", probe], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    site = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    assert Path(out[0]).parent == Path(site) / "lze_kernels"
    assert out[1].split("+")[0] == torch_version and out[1].endswith("True")
    assert out[2] == "[]", f"compilers on the PATH: {out[2]}"
    modules = sorted((Path(site) / "lze_kernels").glob("_lze_*.so"))
    assert [m.name.split(".")[0] for m in modules] == ["_lze_cpu", "_lze_cuda"]
    assert load_without_torch(str(venv / "bin" / "python"), modules) == "[]"


@needs_wheels
def test_the_kernel_tests_pass_against_the_wheel(installed):
    """`python -P`: the clone's root is not on sys.path, so `lze_kernels` is the wheel's."""
    torch_version, venv, env = installed
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *TORCH_SETS[torch_version][1], *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    print(f"torch {torch_version}: {result.stdout.strip().splitlines()[-1]}")

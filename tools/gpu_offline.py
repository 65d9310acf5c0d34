"""The GPU check's offline path, for its maintainers (tools/README.md): a machine with one GPU,
a fixed Python 3.12 image and no network gets this package's source tree and a folder of wheels
(what the image lacks, and this package's own cp312 wheel from `make wheel`), small enough to
travel with the tree, and a time budget for the whole command. A user with pip does not need any
of this: ``make test-gpu`` (docs/gpu-check.md).

    python tools/gpu_offline.py wheels [--dest wheels]   # with PyPI: download/build the wheels
    python tools/gpu_offline.py travel                   # what travels, against its budget
    WHEELS=wheels GPU_CHECK_BUDGET_S=420 bash tools/gpu_check.sh REPORT_DIR   # on the machine

With ``--wheels`` the check's install stage installs the wheels into ``<work>/site``
(``pip --no-index --no-deps --no-compile --target``), this package's wheel among them, instead of
checking what is installed; only where the folder holds no wheel of this package that the
machine can install does it build the package there from a copy of the tree (the tree may be
read-only), and the report says so.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_workload import logged  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The device's limits: what travels with one call (tracked + untracked-not-ignored files + the
# carried wheels/) and the whole command's time. The copy stays under the budget
# (tests/test_gpu_offline.py fails above it), a margin under the limit.
TRAVEL_LIMIT_MIB = 64
TRAVEL_BUDGET_MIB = 48
CARRY = ("wheels",)  # copied over with the tree (ignored here, so never committed)
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# The whole command, install included, on a machine held for a quarter of an hour with its start:
# 7 minutes. The peer stage's Qwen2.5-0.5B size does not fit beside the other stages; run it in a
# second call (--stages preflight,install,peer).
BUDGET_S = 420
# What each stage took on the H100 runs of 2026-11-27 (docs/gpu-runs/), rounded up: the plan
# the budget is checked against (tests/test_gpu_offline.py).
# The hazards stage has not run on a GPU: its estimate is six child processes that import torch
# (item 1, some 5 s each there) and a few seconds of steps.
STAGE_ESTIMATE_S = {"preflight": 8, "install": 45, "hazards": 40, "kernels": 45, "trainer": 40,
                    "bench": 50, "sanitizer": 55, "memory": 25, "peer": 150}


@dataclass(frozen=True)
class Wheel:
    requirement: str  # pinned as in requirements/constraints-cuda.txt
    how: str  # "binary": a cp312 manylinux or pure wheel from PyPI; "built": sdist built here
    size: int  # bytes, as downloaded (2026-11-26): the travel budget counts these
    if_older: bool = False  # installed only where the image's copy is older than the pin


# Only what the image lacks (IMAGE_PACKAGES lists the rest: never
# copy those, they would shadow the image's own copies).
WHEELS = (
    Wheel("deepspeed==0.19.8", "built", 2_168_853),  # DS_BUILD_OPS=0: no op compiled, ever
    Wheel("hjson==3.1.0", "binary", 54_018),  # deepspeed's config parser
    # DeepSpeed 0.19.8 imports pydantic (runtime/config_utils.py) with `import deepspeed`.
    Wheel("pydantic==2.14.3", "binary", 494_071),
    Wheel("pydantic-core==2.50.4", "binary", 2_261_727),
    Wheel("annotated-types==0.8.0", "binary", 13_427),
    Wheel("typing-inspection==0.4.5", "binary", 14_874),
    Wheel("typing-extensions==4.16.0", "binary", 45_571, if_older=True),  # pydantic needs >=4.16
    Wheel("omegaconf==2.4.0", "binary", 254_152),
    Wheel("antlr4-python3-runtime==4.13.2", "binary", 144_462),
    Wheel("math-verify==0.9.0", "binary", 29_967),
    Wheel("latex2sympy2-extended==1.11.0", "binary", 209_050),
    # The trainer's data (load_dataset("json")) and TRL; pyarrow, pandas, xxhash, fsspec,
    # huggingface-hub and requests are on the image.
    Wheel("datasets==5.2.0", "binary", 608_276),
    Wheel("dill==0.4.1", "binary", 120_019),
    Wheel("multiprocess==0.70.19", "binary", 150_281),
    Wheel("trl==1.16.0", "binary", 948_205),
)
# The GPU machine image's Python packages (its documented list, read 2026-11-17):
# never copied. tests/test_gpu_check.py checks that WHEELS and these cover what the wheels need.
IMAGE_PACKAGES = frozenset((
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal",
    "annotated-doc", "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer",
    "chex", "click", "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-bindings",
    "cuda-core", "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax",
    "e3nn", "einops", "equinox", "etils", "execnet", "filelock", "flatbuffers", "flax",
    "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py",
    "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio",
    "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib",
    "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader", "lightning",
    "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py",
    "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas",
    "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript",
    "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx", "optimistix",
    "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow",
    "pybind11", "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions",
    "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist",
    "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu",
    "safetensors", "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn",
    "sentencepiece", "sentence-transformers", "setuptools", "shellingham", "simplejson", "six",
    "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm",
    "tokenizers", "toolz", "torch", "torchaudio", "torchdiffeq", "torch-geometric",
    "torchmetrics", "torchvision", "tqdm", "transformers", "treescope", "triton", "typer",
    "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig", "werkzeug",
    "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
))
# The maintainers' plan for the device: two calls, each within BUDGET_S by the estimates.
CALLS = (("preflight", "install", "hazards", "kernels", "trainer", "bench", "sanitizer", "memory"),
         ("preflight", "install", "peer"))


# ============================================================================ travel


def travel_files(root: Path = ROOT, carry=CARRY) -> list[Path]:
    """The files copied to the GPU machine: tracked, untracked-not-ignored (``git ls-files -co
    --exclude-standard``), and everything under the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode().split("\0")
    files = {root / name for name in listed if name and (root / name).is_file()}
    for path in carry:
        folder = root / path
        if folder.is_dir():
            files.update(p for p in folder.rglob("*") if p.is_file())
    return sorted(files)


def travel_report(root: Path = ROOT, budget_mib: float = TRAVEL_BUDGET_MIB) -> dict:
    """Bytes that would travel: the tree, the carried wheels as they are on disk, and the wheels
    of :data:`WHEELS` not downloaded yet (their recorded sizes), against the budget."""
    files = travel_files(root)
    wheel_dir = root / CARRY[0]
    on_disk = sum(p.stat().st_size for p in files if wheel_dir in p.parents)
    tree = sum(p.stat().st_size for p in files) - on_disk
    wheels = on_disk if on_disk else sum(w.size for w in WHEELS)
    total = tree + wheels
    return {"tree_bytes": tree, "wheel_bytes": wheels, "wheels_on_disk": bool(on_disk),
            "total_bytes": total, "budget_bytes": int(budget_mib * 2**20),
            "limit_bytes": TRAVEL_LIMIT_MIB * 2**20, "within_budget": total <= budget_mib * 2**20}


def format_travel(report: dict) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    source = "on disk" if report["wheels_on_disk"] else "recorded sizes, not downloaded"
    verdict = "within" if report["within_budget"] else "OVER"
    return (f"tree {mib(report['tree_bytes'])} + wheels {mib(report['wheel_bytes'])} ({source}) "
            f"= {mib(report['total_bytes'])}: {verdict} the budget of "
            f"{mib(report['budget_bytes'])} (the device's limit: {mib(report['limit_bytes'])})")


# ============================================================================ wheels


def download_wheels(dest: Path) -> int:
    """Fetch the binary wheels and build the sdist-only ones into ``dest``; fail when a file's
    size strays from the recorded one by more than 10 % (update :data:`WHEELS`) or the travel
    is over budget."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {**os.environ, "PIP_CONSTRAINT": "", "DS_BUILD_OPS": "0"}
    binary = [w.requirement for w in WHEELS if w.how == "binary"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*pip, "download", "--only-binary=:all:", "--no-deps", "--implementation",
                    "cp", "--python-version", PYTHON_VERSION, *platforms, "-d", str(dest),
                    *binary], check=True, env=env)
    built = [w.requirement for w in WHEELS if w.how == "built"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), *built],
                   check=True, env=env)
    strays = []
    for wheel in WHEELS:
        path = wheel_file(dest, wheel)
        size = path.stat().st_size if path else 0
        print(f"{size / 1e6:8.2f} MB  {path.name if path else wheel.requirement + ' MISSING'}")
        if abs(size - wheel.size) > 0.1 * wheel.size:
            strays.append(f"{wheel.requirement}: {size} bytes, recorded {wheel.size}")
    report = travel_report(ROOT)
    print(format_travel(report))
    for stray in strays:
        print(f"size changed: {stray} (update WHEELS in tools/gpu_offline.py)", file=sys.stderr)
    return 0 if report["within_budget"] and not strays else 1


def wheel_file(folder: Path, wheel: Wheel):
    """The file of ``wheel`` in ``folder`` (names normalised as wheels spell them), or None."""
    name, version = wheel.requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for path in Path(folder).glob("*.whl"):
        parts = path.name.split("-")
        if re.sub(r"[-_.]+", "_", parts[0]).lower() == stem and parts[1] == version:
            return path
    return None


# ============================================================================ the install stage


def install_wheels(folder: Path, site: Path, log) -> dict:
    """``pip install --no-index --no-deps --no-compile --target`` of the wheels of
    :data:`WHEELS` found in ``folder`` that this interpreter can install (any others present,
    e.g. a test's, too), skipping ``if_older`` ones where the image's copy is new enough."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    files = sorted(Path(folder).glob("*.whl")) if Path(folder).is_dir() else []
    listed = {wheel_file(folder, w): w for w in WHEELS}
    chosen, skipped = [], {}
    for path in files:
        wheel = listed.get(path)
        if not supported & set(parse_wheel_filename(path.name)[3]):
            skipped[path.name] = "not for this interpreter"
        elif wheel is not None and wheel.if_older and _installed_at_least(wheel.requirement):
            skipped[path.name] = "the image's copy is new enough"
        else:
            chosen.append(path)
    missing = [w.requirement for w, p in ((w, wheel_file(folder, w)) for w in WHEELS) if p is None]
    if chosen:
        logged([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                "--no-compile", "--upgrade", "--target", str(site), *map(str, chosen)], log)
    return {"installed": [p.name for p in chosen], "skipped": skipped, "missing": missing}


def _installed_at_least(requirement: str) -> bool:
    import importlib.metadata as md

    from packaging.version import Version

    name, version = requirement.split("==")
    try:
        return Version(md.version(name)) >= Version(version)
    except md.PackageNotFoundError:
        return False


# What of the tree the package's build reads.
BUILD_SOURCES = ("pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "csrc", "lze_kernels",
                 "trainer", "requirements", "tools/requirements_extras.py")
PACKAGE = "lze_kernels"  # this package's wheels: lze_kernels-<version>-<tags>.whl


def build_package(work: Path, site: Path, log, root: Path = ROOT,
                  sources: tuple = BUILD_SOURCES) -> int:
    """This package from a copy of ``root``'s ``sources`` into ``site``: CMake, Ninja, nvcc for
    sm_90, verbose into the log. Returns pip's exit code."""
    source = work / "src"
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    for name in sources:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.so", "*.pyc"))
        elif path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    for path in source.rglob("*"):  # a read-only tree's copy stays read-only otherwise
        path.chmod(path.stat().st_mode | 0o200)
    env = {**os.environ, "CMAKE_GENERATOR": "Ninja", "LZE_BUILD_CUDA_EMULATED": "0",
           "LZE_CUDA_ARCHS": os.environ.get("LZE_CUDA_ARCHS", "90")}
    return logged([sys.executable, "-m", "pip", "install", "-v", "--no-index", "--no-deps",
                   "--no-build-isolation", "--no-compile", "--upgrade", "--target", str(site),
                   str(source)], log, env=env, cwd=work)


def package_wheel(installed: list[str]):
    """The name of this package's wheel among the ``installed`` ones, or None."""
    return next((name for name in installed if name.split("-")[0] == PACKAGE), None)


def install(wheels: Path, site: Path, work: Path, log) -> dict:
    """The offline install stage's work: the wheels, this package's among them; without one
    for this machine, the package's build from the tree instead, timed."""
    import time

    result = {"wheels": install_wheels(wheels, site, log)}
    result["package_wheel"] = package_wheel(result["wheels"]["installed"])
    if result["package_wheel"] is None:
        begin = time.monotonic()
        result["build_exit"] = build_package(work, site, log)
        result["build_seconds"] = round(time.monotonic() - begin, 1)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_offline", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download/build the wheels (needs PyPI)")
    wheels.add_argument("--dest", type=Path, default=ROOT / "wheels")
    travel = sub.add_parser("travel", help="what is copied to the GPU machine, against the budget")
    travel.add_argument("--budget-mib", type=float, default=TRAVEL_BUDGET_MIB)
    args = parser.parse_args(argv)
    if args.command == "wheels":
        return download_wheels(args.dest)
    report = travel_report(budget_mib=args.budget_mib)
    print(format_travel(report))
    return 0 if report["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""One command for a machine with one GPU (no network needed): preflight, install, then the
checks on the device, within a time budget, writing a report after every stage.

Run it as ``bash tools/gpu_check.sh REPORT_DIR`` (no ``make`` needed). It needs Python 3.12 with a
CUDA build of torch, Triton, transformers, accelerate, pytest, CMake, ninja, pybind11 and the rest
of :data:`IMAGE_PACKAGES` (the environment it was last run in, its versions :data:`EXPECTED`);
what that environment lacks comes as the wheels of :data:`WHEELS` (``make gpu-wheels`` on a
machine with PyPI, into the ignored ``wheels/``).

Layout: the tree may be read-only and is never written to; all work (site packages, the build,
models, runs) happens in ``$GPU_CHECK_DIR`` (default /tmp/gpu_check); the few small files of
:data:`REPORT_FILES` are copied to the report folder after every stage, so a timeout still leaves
what finished.

Stages, in order, each a child process (``python -P``: the source tree is never on ``sys.path``,
so every import resolves to the installed package) with a time cap, all inside one budget:

  preflight  versions (python, torch, triton, transformers, nvcc, driver) and tools, checked
             against the versions of the last run (:data:`EXPECTED`)
  install    the wheels (``pip --no-index --no-deps --no-compile --target``), this package built
             from a copy of the tree (nvcc, sm_90; log in install.log), every import of IMPORTS
  kernels    tests/test_gpu.py on the device: cuda, triton, torch backends, none skipped
  trainer    5 GRPO steps, rollout.engine=hf, bf16, ZeRO-2, real vocabulary; peak memory per phase
  bench      benchmarks/gpu_bench.py: every variant and B, launch and HBM floors, DOTS at 1M
  sanitizer  compute-sanitizer memcheck and racecheck over the CUDA kernels
  memory     one update-only pass, Qwen2.5-1.5B shape at 8 x 4096 tokens, vs docs/gpu-memory.md
  peer       TRL's GRPOTrainer against lze_trainer (hf engine), same model, prompts and sizes, at
             the trainer stage's size and Qwen2.5-0.5B's shape at 64 x 8 x 256 tokens
             (tools/gpu_peer.py; also without CUDA, shrunken, so the dry run runs it)

Sub-commands: ``check`` (all of the above), ``stage NAME`` (one stage, in the child), ``wheels``
(download/build the wheels, with PyPI), ``travel`` (what is copied to the machine, against the
budget).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402  (standard library only)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path("/tmp/gpu_check")
# The whole command, install included: 7 minutes (the peer stage's two sizes take up to 2.5 of
# them), so that a machine's start and one full run fit in a quarter of an hour.
BUDGET_S = 420
# The copy of the tree to a GPU machine (tracked + untracked-not-ignored files + wheels/) stays
# small: under the budget (tests/test_gpu_check.py fails above it), a margin under the limit.
TRAVEL_LIMIT_MIB = 64
TRAVEL_BUDGET_MIB = 48
# Copied over with the tree (ignored here, so `git add -A` never commits them).
CARRY = ("wheels",)
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


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
# The versions of the last full run (prefixes of the real versions); others are reported, not refused.
EXPECTED = {"python": "3.12", "torch": "2.11", "triton": "3.6", "transformers": "5.17.0",
            "accelerate": "1.15.0", "nvcc": "13.0"}
# Versions worth a line in the report (the preinstalled packages the wheels lean on).
VERSION_PACKAGES = ("torch", "triton", "transformers", "accelerate", "tokenizers",
                    "huggingface-hub", "safetensors", "numpy", "pyarrow", "pandas", "fsspec",
                    "typing-extensions", "setuptools", "pybind11", "cmake", "ninja", "pytest",
                    "tensorboard", "matplotlib", "psutil", "packaging", "pyyaml", "sympy")
TOOLS = ("nvcc", "nvidia-smi", "compute-sanitizer", "cmake", "ninja", "gcc", "make")
# Imported after the install; lze_kernels._lze_cuda makes a silently skipped CUDA build loud.
IMPORTS = ("deepspeed", "omegaconf", "math_verify", "datasets", "trl", "matplotlib.pyplot",
           "torch.utils.tensorboard", "lze_kernels", "lze_kernels._lze_cpu",
           "lze_kernels._lze_cuda", "lze_trainer.trainer")
STAGES = ("preflight", "install", "kernels", "trainer", "bench", "sanitizer", "memory", "peer")
# The peer stage runs without CUDA too, shrunken (the dry run): tools/gpu_peer.py.
NEEDS_CUDA = ("kernels", "trainer", "bench", "sanitizer", "memory")
# Cap per stage in seconds, and the estimate it was sized from: what each stage took on the
# first H100 runs (2026-11-27, docs/gpu-results.md), rounded up. The sum of estimates is 377 s
# of the 420 s budget; a stage gets min(cap, what is left).
STAGE_CAP_S = {"preflight": 30, "install": 120, "kernels": 90, "trainer": 90, "bench": 110,
               "sanitizer": 90, "memory": 75, "peer": 150}
STAGE_ESTIMATE_S = {"preflight": 7,  # nvidia-smi, nvcc --version, one torch import: 6 s
                    "install": 45,  # wheels, CMake + nvcc -j16 (build 28-38 s): 44-57 s
                    "kernels": 30,  # Triton JIT of step/topk/dots, 65,536 x 64 references: 27 s
                    "trainer": 50,  # 152k-vocab model build and save, DS init, 3 steps: 43 s (now 5)
                    # 5 B x 5 variants, 2 torch.compile, DOTS at 1M: 65-78 s; now 7 B (to 1M)
                    # x 9 variants, one dynamic-shape compile, inputs drawn on the device
                    "bench": 75,
                    "sanitizer": 40,  # memcheck ~12 s, racecheck up to B = 1,024: 31-42 s
                    "memory": 35,  # 1.5B random model, DS init, two 32k-token passes: 34 s
                    # TRL at 16 x 8 x 64 tokens (27 s in the first runs, its import and init
                    # included), then a Qwen2.5-0.5B shape's random weights (about 8 s) and TRL
                    # and lze_trainer at 64 x 8 x 256 tokens, 3 steps each, each in its own
                    # process (import and init about 15 s): not measured yet
                    "peer": 95}
# Shares of the sanitizer stage's cap: racecheck's start under instrumentation is the slow part.
SANITIZER_SHARE = {"memcheck": 0.35, "racecheck": 0.6}
MIN_STAGE_S = 10  # a stage with less left than this is skipped ("out of time")
# The files that come back (the device returns at most 8, 16 MiB each); logs keep their tail.
REPORT_FILES = ("gpu_check.json", "gpu_check.md", "console.log", "install.log", "kernels.xml",
                "sanitizer.log", "trainer.log", "peer.log")
MAX_REPORT_BYTES = 15 * 2**20

VOCAB = 151_936  # Qwen2.5's vocabulary
MODEL_SPEC = "tiny:qwen2?hidden=256&layers=2&heads=4&kv_heads=2&vocab=512"
# The trainer stage: 5 steps of the tiny preset on the device, at a size where the vocabulary
# dominates memory (16 prompts x 8 rollouts x 64 new tokens; micro-batches of 8 sequences). The
# peer stage takes the median of the steps after the first: with 3 steps that was 2 steps, one of
# them with a 2.2 s update (the first GPU runs), so 5.
TRAINER_STEPS, TRAINER_PROMPTS, TRAINER_GROUP, TRAINER_TOKENS = 5, 16, 8, 64
KEEP_RATIO = 0.4  # LZE's share of the groups trained on (TRL's peer run trains on all)


def lze_overrides(steps: int, prompts: int, group: int, tokens: int, on_gpu: bool) -> tuple:
    """lze_trainer's settings on the tiny preset for ``steps`` steps of ``prompts`` x ``group``
    rollouts of at most ``tokens`` new tokens: hf engine, LZE at :data:`KEEP_RATIO`, bf16 and
    ZeRO-2 on a GPU, micro-batches sized by memory (the default; the preset fixes 8), no
    evaluation or checkpoints."""
    return (
        "rollout.engine=hf", f"model.dtype={'bfloat16' if on_gpu else 'float32'}",
        "actor.zero_stage=2", "actor.micro_batch_size=null",
        f"trainer.device={'cuda' if on_gpu else 'cpu'}",
        f"trainer.total_steps={steps}", f"trainer.batch_size={prompts}", f"rollout.n={group}",
        f"rollout.max_new_tokens={tokens}", "selection.method=lze",
        f"selection.keep_ratio={KEEP_RATIO}", "sft_warmup.steps=0", "data.eval=[]",
        "reward.function=gpu_check:coin_flip",  # mixed groups from a random model
        "trainer.eval_every=0", "trainer.save_every=0", "trainer.save_hf_model=false",
        "trainer.progress_bar=false",
    )


TRAINER_OVERRIDES = lze_overrides(TRAINER_STEPS, TRAINER_PROMPTS, TRAINER_GROUP, TRAINER_TOKENS,
                                  on_gpu=True)
# The memory stage: Qwen2.5-1.5B's shape (config.json of Qwen/Qwen2.5-1.5B), random weights.
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=4096, tie_word_embeddings=True)
MEMORY_ROWS, MEMORY_LENGTH, MEMORY_RESPONSE = 8, 4096, 3072


# ============================================================================ arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download/build the wheels (needs PyPI)")
    wheels.add_argument("--dest", type=Path, default=ROOT / "wheels")
    travel = sub.add_parser("travel", help="what is copied to the GPU machine, against the budget")
    travel.add_argument("--budget-mib", type=float, default=TRAVEL_BUDGET_MIB)
    check = sub.add_parser("check", help="every stage, within the budget (the device command)")
    check.add_argument("--work", type=Path, default=DEFAULT_WORK)
    check.add_argument("--report", type=Path, required=True,
                       help="folder of the report files (gpu_check.json, gpu_check.md, logs), "
                       "written after every stage")
    check.add_argument("--wheels", type=Path, default=ROOT / "wheels")
    check.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything")
    check.add_argument("--stages", type=_stages, default=list(STAGES),
                       help=f"comma-separated subset of {','.join(STAGES)}")
    check.add_argument("--batches", type=_ints, default=None, help="benchmark B values")
    check.add_argument("--rounds", type=int, default=20, help="timed rounds per benchmark case")
    stage = sub.add_parser("stage", help=argparse.SUPPRESS)
    stage.add_argument("name", choices=STAGES)
    stage.add_argument("--work", type=Path, required=True)
    return parser.parse_args(argv)


def _stages(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--stages: expected a comma-separated subset of "
                                         f"{','.join(STAGES)}, got {text!r}")
    return names


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches: expected comma-separated ints, got {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--batches: every B must be >= 1, got {text!r}")
    return values


# ============================================================================ travel and wheels


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
        print(f"size changed: {stray} (update WHEELS in tools/gpu_check.py)", file=sys.stderr)
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


# ============================================================================ the parent


def check(args) -> int:
    """Every stage in order, each a child process with min(cap, time left); the report is
    rewritten and copied to the report folder after each stage."""
    start = time.monotonic()
    work = args.work.resolve()
    report_dir = args.report.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    options = {"wheels": str(args.wheels.resolve()), "batches": args.batches,
               "rounds": args.rounds}
    (work / "options.json").write_text(json.dumps(options))
    results = {"schema": 1, "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "budget_s": args.budget, "stages": {}}
    for stage in args.stages:
        left = args.budget - (time.monotonic() - start)
        reason = _skip_reason(stage, results["stages"], left)
        if reason:
            result = {"status": "skipped", "reason": reason}
        else:
            cap = min(stage_cap(stage), left)
            print(f"== {stage} (cap {cap:.0f} s)", flush=True)
            result = run_stage(stage, work, cap)
        results["stages"][stage] = result
        results["elapsed_s"] = round(time.monotonic() - start, 1)
        write_report(results, work, report_dir)
        print(f"== {stage}: {result['status']} {gpu_report._notes(stage, result)}", flush=True)
    print(gpu_report.render(results))
    print(f"report: {report_dir}")
    return 0 if all(r["status"] == "passed" for r in results["stages"].values()) else 1


def stage_cap(stage: str) -> float:
    """The stage's cap, times ``GPU_CHECK_CAP_SCALE`` (default 1; the CPU dry run on a busy
    2-core machine raises it, with GPU_CHECK_BUDGET_S)."""
    scale = os.environ.get("GPU_CHECK_CAP_SCALE", "1")
    try:
        factor = float(scale)
    except ValueError:
        factor = 0.0
    if not factor > 0:
        raise ValueError(f"GPU_CHECK_CAP_SCALE: expected a number > 0, got {scale!r}")
    return STAGE_CAP_S[stage] * factor


def _skip_reason(stage: str, done: dict, left: float) -> str:
    if left < MIN_STAGE_S:
        return f"out of time ({left:.0f} s left of the budget)"
    if stage in NEEDS_CUDA and not done.get("preflight", {}).get("cuda_available", True):
        return "no CUDA device (torch.cuda.is_available() is False): needs a GPU"
    return ""


def run_stage(stage: str, work: Path, timeout: float) -> dict:
    """``python -P tools/gpu_check.py stage NAME`` in its own session (a timeout kills it and its
    children); its JSON, or what went wrong with the tail of its log."""
    result_file, log = work / f"{stage}.json", work / "logs" / f"{stage}.log"
    result_file.unlink(missing_ok=True)
    log.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "stage", stage, "--work", str(work)]
    begin = time.monotonic()
    with open(log, "w") as out:
        env = {**child_env(work), "GPU_CHECK_STAGE_S": str(round(timeout))}
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
    result = json.loads(result_file.read_text()) if result_file.exists() else {}  # or partial
    if code is None:
        result = {**result, "status": "timeout", "reason": f"killed after {timeout:.0f} s"}
    elif not result:
        result = {"status": "error", "error": f"exit {code}: {_tail(log, 600)}"}
    result["seconds"] = round(time.monotonic() - begin, 1)
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


def _tail(path: Path, chars: int) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return " ".join(text[-chars:].split())


def site_dir(work: Path) -> Path:
    return Path(work) / "site"


def child_env(work: Path) -> dict:
    """Every stage's environment: the installed packages first on the path (the tree itself never
    is), tools/ (the reward function) and tests/ (conftest's helpers); compiled Triton (the CPU
    tests' conftest defaults TRITON_INTERPRET to 1); nothing written into the tree."""
    path = [str(site_dir(work)), str(ROOT / "tools"), str(ROOT / "tests"),
            os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "PATH": os.pathsep.join([str(site_dir(work) / "bin"), os.environ.get("PATH", "")]),
            "TRITON_INTERPRET": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "NCCL_SOCKET_IFNAME": "lo", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "GPU_CHECK_DIR": str(work)}


def write_report(results: dict, work: Path, report_dir: Path) -> Path:
    """``gpu_check.json`` and ``gpu_check.md`` in the work folder, then :data:`REPORT_FILES` that
    exist there copied to ``report_dir`` (logs cut to their last :data:`MAX_REPORT_BYTES`)."""
    (work / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (work / "gpu_check.md").write_text(gpu_report.render(results))
    if report_dir != work:
        for name in REPORT_FILES:
            source = work / name
            if source.is_file():
                _copy_tail(source, report_dir / name)
    return work / "gpu_check.json"


def _copy_tail(source: Path, dest: Path) -> None:
    size = source.stat().st_size
    with open(source, "rb") as src, open(dest, "wb") as out:
        src.seek(max(0, size - MAX_REPORT_BYTES))
        shutil.copyfileobj(src, out)


# ============================================================================ stages (children)


def stage_main(args) -> int:
    """In the child: run one stage and write ``<work>/<stage>.json``."""
    work = args.work.resolve()
    options = json.loads((work / "options.json").read_text())
    try:
        result = STAGE_FUNCTIONS[args.name](work, options)
    except Exception as exc:  # the parent records it; the next stages still run
        import traceback

        traceback.print_exc()
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    (work / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return 0


def stage_preflight(work: Path, options: dict) -> dict:
    """Versions and tools, and the versions that differ from the expected ones."""
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    versions["nvcc"] = _nvcc_version()
    import torch

    cuda = torch.cuda.is_available()
    result = {"versions": versions, "expected": EXPECTED, "cuda_available": cuda,
              "torch_cuda": torch.version.cuda,
              "tools": {t: shutil.which(t) for t in TOOLS}, "device": _device(),
              "python_h": _python_h(), "cpus": os.cpu_count()}
    result["mismatches"] = [f"{k} {versions.get(k)} (expected: {v})" for k, v in EXPECTED.items()
                            if not str(versions.get(k) or "").startswith(v)]
    result["status"] = "passed" if cuda else "failed"
    return result


def _nvcc_version():
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc or not Path(nvcc).exists():
        return None
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else text.strip()[-80:]


def _device() -> dict:
    if not shutil.which("nvidia-smi"):
        return {}
    query = "--query-gpu=name,driver_version,memory.total"
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
    if not out:
        return {}
    name, driver, memory = [s.strip() for s in out.splitlines()[0].split(",")]
    return {"name": name, "driver": driver, "memory_mib": memory}


def _python_h() -> bool:
    import sysconfig

    return Path(sysconfig.get_paths()["include"], "Python.h").exists()


def stage_install(work: Path, options: dict) -> dict:
    """The wheels into ``<work>/site``, this package built there from a copy of the tree (the
    tree may be read-only), then every import of :data:`IMPORTS` in a fresh process."""
    site, log_path = site_dir(work), work / "install.log"
    site.mkdir(parents=True, exist_ok=True)
    result = {}
    with open(log_path, "w") as log:
        result["wheels"] = install_wheels(Path(options["wheels"]), site, log)
        begin = time.monotonic()
        build = build_package(work, site, log)
        result["build_seconds"] = round(time.monotonic() - begin, 1)
        result["build_exit"] = build
    result["imports"] = check_imports(work)
    result["lze_kernels_from"] = result["imports"].get("lze_kernels", "")
    failed = [m for m, v in result["imports"].items() if not v.startswith("ok")]
    missing = result["wheels"]["missing"]
    from_site = str(site) in result["lze_kernels_from"]
    result["status"] = "passed" if build == 0 and not failed and not missing and from_site \
        else "failed"
    if not from_site:
        result["reason"] = f"lze_kernels not imported from {site}: {result['lze_kernels_from']}"
    elif missing:
        result["reason"] = (f"{len(missing)} wheels missing from {options['wheels']} (make "
                            f"gpu-wheels here; copy wheels/ with the tree)")
    return result


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
        _logged([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
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


def build_package(work: Path, site: Path, log) -> int:
    """This package from a copy of the tree (sources only) into ``site``: CMake, Ninja, nvcc for
    sm_90, verbose into the log. Returns pip's exit code."""
    source = work / "src"
    if source.exists():
        shutil.rmtree(source)
    keep = ("setup.py", "pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "csrc",
            "lze_kernels", "trainer", "requirements")
    source.mkdir()
    for name in keep:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.so", "*.pyc"))
        elif path.is_file():
            shutil.copy2(path, source / name)
    for path in source.rglob("*"):  # a read-only tree's copy stays read-only otherwise
        path.chmod(path.stat().st_mode | 0o200)
    env = {**os.environ, "CMAKE_GENERATOR": "Ninja", "LZE_BUILD_CUDA_EMULATED": "0",
           "LZE_CUDA_ARCHS": os.environ.get("LZE_CUDA_ARCHS", "90")}
    return _logged([sys.executable, "-m", "pip", "install", "-v", "--no-index", "--no-deps",
                    "--no-build-isolation", "--no-compile", "--upgrade", "--target", str(site),
                    str(source)], log, env=env, cwd=work)


def _logged(cmd: list[str], log, timeout=None, **kwargs) -> int:
    """``cmd``'s exit code, its output into ``log``; past ``timeout`` its whole process group is
    killed (a sanitizer's target too, which would otherwise keep the GPU) and TimeoutExpired
    raised."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=timeout is not None, **kwargs)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise


def check_imports(work: Path) -> dict:
    """``{module: "ok <file>" | "<error>"}`` for :data:`IMPORTS`, in a fresh process."""
    code = ("import importlib, json, sys\nout = {}\nfor m in sys.argv[1:]:\n"
            "    try:\n        out[m] = 'ok ' + str(getattr(importlib.import_module(m), "
            "'__file__', ''))\n"
            "    except BaseException as e:\n        out[m] = f'{type(e).__name__}: {e}'\n"
            "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-P", "-c", code, *IMPORTS], env=child_env(work),
                          cwd=work, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {m: f"import check crashed: {proc.stderr[-300:]}" for m in IMPORTS}


def stage_kernels(work: Path, options: dict) -> dict:
    """tests/test_gpu.py on the device; every backend of the device must be there to pass and
    nothing may be skipped."""
    from lze_kernels import available_backends

    xml = work / "kernels.xml"
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           str(ROOT / "tests" / "test_gpu.py"), f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=work, env=child_env(work))
    counts = junit_counts(xml) if xml.exists() else {}
    backends = available_backends("cuda")
    missing = [b for b in ("cuda", "triton", "torch") if b not in backends]
    ok = proc.returncode == 0 and counts.get("skipped", 1) == 0 and not missing
    return {"status": "passed" if ok else "failed", "backends": backends,
            "missing_backends": missing, **counts}


def junit_counts(path: Path) -> dict:
    """Totals of a pytest JUnit XML report: tests, failures, errors, skipped."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def stage_bench(work: Path, options: dict) -> dict:
    """benchmarks/gpu_bench.py on the device: the DOTS prediction, then each B's floors and step
    variants; the partial result is written after each part, so a timeout keeps what ran."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench
    import torch

    device = torch.device("cuda")
    result = {"status": "running", "device": torch.cuda.get_device_name(0), "rows": [],
              "floors": {}}
    result["dots"] = gpu_bench.dots_benchmark(device)
    _write_partial(work, "bench", result)
    for batch in options.get("batches") or gpu_bench.BATCHES:
        result["floors"][str(batch)] = gpu_bench.floors(batch, gpu_bench.GROUP, device)
        result["rows"] += gpu_bench.run(device, [batch], rounds=options.get("rounds") or 20)
        _write_partial(work, "bench", result)
    return {**result, "status": "passed"}


def _write_partial(work: Path, stage: str, result: dict) -> None:
    (work / f"{stage}.json").write_text(json.dumps(result, indent=1))


def stage_sanitizer(work: Path, options: dict) -> dict:
    """compute-sanitizer's memcheck and racecheck over tools/gpu_sanitize.py (the CUDA backend's
    kernels at every shape class, racecheck at fewer and smaller ones, checked against the torch
    backend). Some sandboxed runtimes refuse the tool the device: then both tools fail."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"status": "failed", "reason": "compute-sanitizer not on PATH"}
    tools, log_path = {}, work / "sanitizer.log"
    stage_s = float(os.environ.get("GPU_CHECK_STAGE_S", stage_cap("sanitizer")))
    with open(log_path, "w") as log:
        for name, shapes in (("memcheck", []), ("racecheck", ["--racecheck"])):
            each = SANITIZER_SHARE[name] * stage_s
            cmd = [tool, "--tool", name, "--error-exitcode", "3", sys.executable, "-P",
                   str(ROOT / "tools" / "gpu_sanitize.py"), *shapes]
            try:
                tools[name] = {"exit": _logged(cmd, log, env=child_env(work), cwd=work,
                                               timeout=each)}
            except subprocess.TimeoutExpired:
                tools[name] = {"exit": None, "summary": f"timed out after {each:.0f} s"}
    text = log_path.read_text(errors="replace")
    summaries = iter(re.findall(r"========= (?:ERROR|RACECHECK) SUMMARY: (.*)", text))
    for name in tools:
        if tools[name]["exit"] is not None:
            tools[name]["summary"] = next(summaries, "no summary").strip()
    ok = all(t["exit"] == 0 for t in tools.values())
    return {"status": "passed" if ok else "failed", "tools": tools}


STAGE_FUNCTIONS = {"preflight": stage_preflight, "install": stage_install,
                   "kernels": stage_kernels, "bench": stage_bench, "sanitizer": stage_sanitizer}


# ============================================================================ trainer stage


def stage_trainer(work: Path, options: dict) -> dict:
    """5 trainer steps (this process is the child: a fresh CUDA context); its log is
    trainer.log, its metrics summarised per step, its peak memory per phase."""
    out = work / "trainer"
    if out.exists():
        shutil.rmtree(out)
    data = write_arithmetic_jsonl(out / "train.jsonl", 256)
    model = build_model(out / "model", _texts(data), VOCAB)
    run = run_lze(out / "run", model, data, TRAINER_OVERRIDES, work / "trainer.log")
    ok = run["exit_code"] == 0 and len(run["steps"]) == TRAINER_STEPS
    return {"status": "passed" if ok else "failed", **run, "vocab": VOCAB, "model": str(model),
            "data": str(data)}


def run_lze(run_dir: Path, model: Path, data: Path, overrides: tuple, log: Path) -> dict:
    """lze_trainer on the tiny preset with ``overrides`` in this process, as one rank, printing
    to ``log``: its exit code, its metrics per step and its peak memory per phase."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    memory: dict = {}
    from lze_trainer import main as trainer_main
    from lze_trainer.run_log import output_to

    with phase_memory(memory), output_to(log):
        code = trainer_main.main(["--config", "tiny", f"model.path={model}",
                                  f"data.train={data}", f"trainer.run_dir={run_dir}",
                                  *overrides])
    return {"exit_code": code, "steps": _step_summary(run_dir / "metrics.jsonl"),
            "peak_memory_gib": {k: round(v / 2**30, 3) for k, v in memory.items()}}


def coin_flip(response: str, ground_truth: str, data_source: str, meta: dict) -> float:
    """The trainer stage's reward: a fair coin per response. The random model mostly samples ids
    past its tokenizer's few hundred tokens, which decode to nothing, so any reward of the text
    would give every group one value and no step would run an update."""
    return float(random.random() < 0.5)


def write_arithmetic_jsonl(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` two-term sums as question/answer rows (a known column layout of the trainer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"question": f"Calculate {a} + {b}.", "answer": str(a + b)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _texts(jsonl: Path) -> list[str]:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return [text for r in rows for text in (r["question"], r["answer"])]


def build_model(out_dir: Path, texts: list[str], vocab: int, spec: str = MODEL_SPEC) -> Path:
    """The tiny Qwen2 of ``spec`` (lze_trainer.tiny_model, offline), its embedding (tied to the
    LM head) resized to ``vocab`` rows: a real-size vocabulary, so logits and their
    log-softmax cost what they cost for Qwen2.5."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from lze_trainer import tiny_model

    base = tiny_model.build(spec, Path(out_dir) / "base", texts)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    target = Path(out_dir) / "resized"
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    GenerationConfig.from_pretrained(base).save_pretrained(target)
    return target


@contextmanager
def phase_memory(record: dict):
    """Peak CUDA memory per trainer phase: wraps ``lze_trainer.metrics.Timer`` so that every
    phase boundary (start-up phases, step phases, nested ones) closes a stretch whose
    ``max_memory_allocated`` goes to the phase that ran in it, then resets the peak. A phase's
    value is its largest stretch over the run; memory outside any phase goes to ``"outside"``."""
    import torch

    from lze_trainer import metrics

    if not torch.cuda.is_available():
        yield
        return
    original = metrics.Timer.__call__

    def close_stretch(phase: str) -> None:
        record[phase] = max(record.get(phase, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def timed(self, phase: str, inclusive: bool = False):
        if inclusive:  # the whole step: its own peak is the max of its phases
            with original(self, phase, inclusive=True):
                yield
            return
        close_stretch(self._open[-1][0] if self._open else "outside")
        try:
            with original(self, phase):
                yield
        finally:
            close_stretch(phase)

    torch.cuda.reset_peak_memory_stats()
    metrics.Timer.__call__ = timed
    try:
        yield
    finally:
        metrics.Timer.__call__ = original
        close_stretch("outside")


def _step_summary(path: Path) -> list[dict]:
    keys = ("timing_s/step", "timing_s/rollout", "rollout/compile_s", "timing_s/update",
            "sa/kept_groups", "actor/update_tokens", "reward/mean")
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # Rows without a step time (step 0: the evaluation before training) are not steps.
    return [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows
            if "timing_s/step" in r]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STAGE_FUNCTIONS["trainer"] = stage_trainer


# ============================================================================ memory stage


def stage_memory(work: Path, options: dict) -> dict:
    """One update-only pass of lze_trainer's Actor (bf16, ZeRO-2, gradient checkpointing, as the
    qwen2.5-math-1.5b preset) on a random model of Qwen2.5-1.5B's shape, one micro-batch of
    8 x 4096 tokens (3072 of them response), twice: the second's peak against
    docs/gpu-memory.md's arithmetic (the first GPU run measured the first update only, 31.0 GiB
    against 44.9: no Adam state yet)."""
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    model_dir = random_model(work / "qwen1.5b", QWEN_1_5B)
    actor, params = update_only_actor(model_dir)
    batch, norm = synthetic_batch(MEMORY_ROWS, MEMORY_LENGTH, MEMORY_RESPONSE, QWEN_1_5B["vocab_size"])
    peaks, seconds = [], []
    # Two updates: Adam's m and v (8 B a parameter) are allocated by the first optimizer step,
    # after the first backward, so only the second update has every term of the arithmetic.
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        begin = time.monotonic()
        actor.update([[batch]], [norm])
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        seconds.append(time.monotonic() - begin)
    predicted = memory_arithmetic(params, MEMORY_ROWS, MEMORY_LENGTH, QWEN_1_5B)
    return {"status": "passed", "peak_gib": round(peaks[1], 3),
            "first_update_peak_gib": round(peaks[0], 3), "update_seconds":
            round(seconds[1], 2), "parameters": params,
            "predicted_gib": {k: round(v, 3) for k, v in predicted.items()},
            "shape": f"hidden {QWEN_1_5B['hidden_size']}, {QWEN_1_5B['num_hidden_layers']} layers,"
                     f" V = {QWEN_1_5B['vocab_size']:,}, {MEMORY_ROWS} x {MEMORY_LENGTH} tokens"}


def random_model(out_dir: Path, shape: dict) -> Path:
    """A Qwen2 with ``shape`` and random bf16 weights, saved for ``from_pretrained``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    return out_dir


def update_only_actor(model_dir: Path, overrides: tuple = ()):
    """lze_trainer's Actor on the qwen2.5-math-1.5b preset's actor settings (one rank)."""
    from lze_trainer import config as C
    from lze_trainer import distributed as D
    from lze_trainer.actor import Actor, Schedule

    cfg = C.load("qwen2.5-math-1.5b", [f"model.path={model_dir}", "rollout.engine=hf",
                                       "actor.mini_batches=1", *overrides])
    world = D.init(cfg.trainer.device)
    actor = Actor(cfg, world, str(model_dir), Schedule.of_actor(cfg.actor, 1))
    return actor, actor.num_parameters


def synthetic_batch(rows: int, length: int, response: int, vocab: int):
    """One micro-batch of ``rows`` full-length sequences, ``response`` tokens of each trained."""
    import torch

    from lze_trainer.batch import SequenceBatch
    from lze_trainer.loss import Normaliser

    gen = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, length - response:] = 1.0
    batch = SequenceBatch(
        input_ids=torch.randint(0, vocab, (rows, length), generator=gen),
        attention_mask=torch.ones(rows, length, dtype=torch.long), loss_mask=loss_mask,
        advantages=torch.randn(rows, generator=gen), engine_logprobs=torch.zeros(rows, length),
        off_policy=torch.zeros(rows, dtype=torch.bool))
    return batch, Normaliser(tokens=float(rows * response), sequences=float(rows),
                             max_response_length=response)


def memory_arithmetic(params: int, rows: int, length: int, shape: dict) -> dict:
    """GiB of docs/gpu-memory.md's terms for one micro-batch on one rank, and their total:
    model states under ZeRO-2 on one rank (bf16 weights and gradients, fp32 master, Adam m and
    v: 16 bytes a parameter), the bf16 logits and their gradient, the bounded log-softmax's
    float32 chunks (3 of C = 2**26 // V rows), and the checkpointed layer inputs (gradient
    checkpointing: one bf16 hidden state per layer)."""
    from lze_trainer.loss import CHUNK_ELEMENTS

    gib, tokens, vocab = 2**30, rows * length, shape["vocab_size"]
    terms = {"model states (16 B/parameter)": 16 * params / gib,
             "logits, bf16": tokens * vocab * 2 / gib,
             "logit gradient, bf16": tokens * vocab * 2 / gib,
             "float32 chunks (3)": 3 * (CHUNK_ELEMENTS // vocab) * vocab * 4 / gib,
             "checkpointed layer inputs": shape["num_hidden_layers"] * tokens
             * shape["hidden_size"] * 2 / gib}
    terms["total"] = sum(terms.values())
    return terms


STAGE_FUNCTIONS["memory"] = stage_memory


# ============================================================================ peer stage


def stage_peer(work: Path, options: dict) -> dict:
    """TRL's GRPOTrainer against lze_trainer at two sizes (tools/gpu_peer.py)."""
    import gpu_peer

    return gpu_peer.stage_peer(work, options)


STAGE_FUNCTIONS["peer"] = stage_peer


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "wheels":
        return download_wheels(args.dest)
    if args.command == "travel":
        report = travel_report(budget_mib=args.budget_mib)
        print(format_travel(report))
        return 0 if report["within_budget"] else 1
    if args.command == "stage":
        return stage_main(args)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())

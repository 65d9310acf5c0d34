"""The GPU check: one command on a machine with one NVIDIA GPU that runs the whole GPU path
against what is installed and writes a report after every stage (docs/gpu-check.md).

    make test-gpu GPU_REPORT=my-report      # the CUDA set into .venv (make setup-gpu), then this
    bash tools/gpu_check.sh my-report       # the same against the Python of $PYTHON (python3)

The tree is never written to: the work (models, runs, logs) happens in ``$GPU_CHECK_DIR``
(default /tmp/gpu_check); the report folder gets :data:`REPORT_FILES` after every stage, so a run
cut short still leaves what finished.

Stages, in order, each a child process (``python -P``: the source tree is never on ``sys.path``,
so every import resolves to the installed package) with a cap that only stops a hang:

  preflight  versions (python, glibc, torch, triton, transformers, nvcc, driver) and tools,
             against the pinned CUDA set (requirements/constraints-cuda.txt), the offline path's
             too: others are named, not refused
  install    every import of :data:`IMPORTS` (the compiled CUDA module too) and where it is from
  hazards    tools/gpu_hazards.py: each GPU-only hazard of the CUDA backend on the device, one JSON
             line an item (the opt-in at its boundaries in a fresh process each, the fault word
             and queued steps, capture, plans, streams, devices, alignment, NaN, host memory)
  kernels    tests/test_gpu.py on the device: cuda, triton, torch backends, none skipped
  trainer    5 GRPO steps, rollout.engine=hf, bf16, ZeRO-2, real vocabulary; peak memory per phase
  bench      benchmarks/gpu_bench.py: every variant and B, launch and HBM floors, DOTS at 1M
  sanitizer  compute-sanitizer memcheck and racecheck over the CUDA kernels
  memory     one update-only pass, Qwen2.5-1.5B shape at 8 x 4096 tokens, vs docs/gpu-memory.md
  peer       TRL's GRPOTrainer against lze_trainer (hf engine), same model, prompts and sizes, at
             the trainer stage's size and Qwen2.5-0.5B's shape at 64 x 8 x 256 tokens
             (tools/gpu_peer.py; also without CUDA, shrunken, so the dry run runs it)

``--wheels DIR`` and ``--budget S`` are the maintainers' offline path (tools/gpu_offline.py,
tools/README.md): the install stage then installs the wheels, this package's own wheel among
them (`make wheel`), and the stages share one time budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402  (standard library only)
import gpu_workload as W  # noqa: E402  (standard library at import)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORK = Path("/tmp/gpu_check")
PINNED_SET = ROOT / "requirements" / "constraints-cuda.txt"
# Versions worth a line in the report; the first ones are compared with the pinned set.
COMPARED_PACKAGES = ("torch", "triton", "transformers", "accelerate", "deepspeed", "trl")
VERSION_PACKAGES = (*COMPARED_PACKAGES, "tokenizers", "huggingface-hub", "safetensors", "numpy",
                    "pyarrow", "pandas", "fsspec", "typing-extensions", "setuptools", "pybind11",
                    "cmake", "ninja", "pytest", "tensorboard", "matplotlib", "psutil", "packaging",
                    "pyyaml", "sympy")
TOOLS = ("nvcc", "nvidia-smi", "compute-sanitizer", "cmake", "ninja", "gcc", "make")
# Imported by the install stage; lze_kernels._lze_cuda makes a silently skipped CUDA build loud.
IMPORTS = ("deepspeed", "omegaconf", "math_verify", "datasets", "trl", "matplotlib.pyplot",
           "torch.utils.tensorboard", "lze_kernels", "lze_kernels._lze_cpu",
           "lze_kernels._lze_cuda", "lze_trainer.trainer")
STAGES = ("preflight", "install", "hazards", "kernels", "trainer", "bench", "sanitizer", "memory",
          "peer")
# The peer stage runs without CUDA too, shrunken (the dry run): tools/gpu_peer.py.
NEEDS_CUDA = ("hazards", "kernels", "trainer", "bench", "sanitizer", "memory")
# Cap per stage in seconds: several times what it took on an H100 (docs/gpu-runs/), so that only
# a hang meets it; the peer stage's two sizes took some 5 minutes there.
STAGE_CAP_S = {"preflight": 60, "install": 600, "hazards": 300, "kernels": 600, "trainer": 600, "bench": 600,
               "sanitizer": 600, "memory": 600, "peer": 1200}
# Shares of the sanitizer stage's cap: racecheck's start under instrumentation is the slow part.
SANITIZER_SHARE = {"memcheck": 0.35, "racecheck": 0.6}
MIN_STAGE_S = 10  # under a budget, a stage with less left than this is skipped ("out of time")
# The report folder's files; logs keep their last MAX_REPORT_BYTES.
REPORT_FILES = ("gpu_check.json", "gpu_check.md", "console.log", "install.log", "kernels.xml",
                "sanitizer.log", "trainer.log", "peer.log")
MAX_REPORT_BYTES = 15 * 2**20

# The memory stage: Qwen2.5-1.5B's shape (config.json of Qwen/Qwen2.5-1.5B), random weights.
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=W.VOCAB,
                 max_position_embeddings=4096, tie_word_embeddings=True)
MEMORY_ROWS, MEMORY_LENGTH, MEMORY_RESPONSE = 8, 4096, 3072


# ============================================================================ arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="every stage, against what is installed")
    check.add_argument("--work", type=Path, default=DEFAULT_WORK)
    check.add_argument("--report", type=Path, required=True,
                       help="folder of the report files (gpu_check.json, gpu_check.md, logs), "
                       "written after every stage")
    check.add_argument("--stages", type=_stages, default=list(STAGES),
                       help=f"comma-separated subset of {','.join(STAGES)}")
    check.add_argument("--batches", type=_ints, default=None, help="benchmark B values")
    check.add_argument("--rounds", type=int, default=20, help="timed rounds per benchmark case")
    check.add_argument("--peer-sizes", type=_peer_sizes, default=None,
                       help=f"comma-separated subset of {','.join(gpu_report.PEER_SIZES)}")
    check.add_argument("--wheels", type=Path, default=None,
                       help="offline path: install these wheels and build the package from a "
                       "copy of the tree (tools/gpu_offline.py)")
    check.add_argument("--budget", type=float, default=None,
                       help="offline path: seconds for every stage together")
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


def _peer_sizes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or set(names) - set(gpu_report.PEER_SIZES):
        raise argparse.ArgumentTypeError(f"--peer-sizes: expected a comma-separated subset of "
                                         f"{','.join(gpu_report.PEER_SIZES)}, got {text!r}")
    return names


# ============================================================================ the parent


def check(args) -> int:
    """Every stage in order, each a child process with its cap (under a budget, at most what is
    left of it); the report is rewritten and copied to the report folder after each stage."""
    start = time.monotonic()
    work = args.work.resolve()
    report_dir = args.report.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    options = {"wheels": str(args.wheels.resolve()) if args.wheels else None,
               "batches": args.batches, "rounds": args.rounds, "peer_sizes": args.peer_sizes}
    (work / "options.json").write_text(json.dumps(options))
    results = {"schema": 1, "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "commit": tree_commit(), "budget_s": args.budget, "stages": {}}
    for stage in args.stages:
        left = None if args.budget is None else args.budget - (time.monotonic() - start)
        reason = _skip_reason(stage, results["stages"], left)
        if reason:
            result = {"status": "skipped", "reason": reason}
        else:
            cap = stage_cap(stage) if left is None else min(stage_cap(stage), left)
            print(f"== {stage} (cap {cap:.0f} s)", flush=True)
            result = run_stage(stage, work, cap)
        results["stages"][stage] = result
        results["elapsed_s"] = round(time.monotonic() - start, 1)
        write_report(results, work, report_dir)
        print(f"== {stage}: {result['status']} {gpu_report._notes(stage, result)}", flush=True)
    print(gpu_report.render(results))
    print(f"report: {report_dir}")
    return 0 if all(r["status"] == "passed" for r in results["stages"].values()) else 1


def tree_commit():
    """The checked tree's commit (``+`` when it has changes), ``$GPU_CHECK_COMMIT`` for a copy
    without git, or None."""
    def git(*argv):
        return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True)

    head = git("rev-parse", "--short=7", "HEAD")
    if head.returncode != 0:
        return os.environ.get("GPU_CHECK_COMMIT") or None
    return head.stdout.strip() + ("+" if git("status", "--porcelain").stdout.strip() else "")


def stage_cap(stage: str) -> float:
    """The stage's cap, times ``GPU_CHECK_CAP_SCALE`` (default 1)."""
    scale = os.environ.get("GPU_CHECK_CAP_SCALE", "1")
    try:
        factor = float(scale)
    except ValueError:
        factor = 0.0
    if not factor > 0:
        raise ValueError(f"GPU_CHECK_CAP_SCALE: expected a number > 0, got {scale!r}")
    return STAGE_CAP_S[stage] * factor


def _skip_reason(stage: str, done: dict, left) -> str:
    if left is not None and left < MIN_STAGE_S:
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
            W.kill_group(proc)
            code = None
    result = json.loads(result_file.read_text()) if result_file.exists() else {}  # or partial
    if code is None:
        result = {**result, "status": "timeout", "reason": f"killed after {timeout:.0f} s"}
    elif not result:
        result = {"status": "error", "error": f"exit {code}: {_tail(log, 600)}"}
    result["seconds"] = round(time.monotonic() - begin, 1)
    return result


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
    """Versions and tools, and the versions that differ from the pinned CUDA set's (on the
    offline path too: what the check ran against, next to what a user's `make setup-gpu` gets)."""
    import importlib.metadata as md

    versions = {"python": platform.python_version(), "glibc": platform.libc_ver()[1]}
    for name in VERSION_PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    versions["nvcc"] = _nvcc_version()
    import torch

    cuda = torch.cuda.is_available()
    expected = expected_versions()
    result = {"versions": versions, "expected": expected,
              "expected_from": str(PINNED_SET.relative_to(ROOT)), "cuda_available": cuda,
              "torch_cuda": torch.version.cuda,
              "tools": {t: shutil.which(t) for t in TOOLS}, "device": _device(),
              "python_h": _python_h(), "cpus": os.cpu_count()}
    result["mismatches"] = [f"{k} {versions.get(k)} (expected: {v})" for k, v in expected.items()
                            if not str(versions.get(k) or "").startswith(v)]
    result["status"] = "passed" if cuda else "failed"
    return result


def expected_versions() -> dict:
    """What the preflight compares with (prefixes of versions): the pinned CUDA set that
    ``make setup-gpu`` installs."""
    pins = dict(re.findall(r"^([\w.-]+)==([^\s#]+)", PINNED_SET.read_text(), re.M))
    return {name: pins[name] for name in COMPARED_PACKAGES if name in pins}


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
    """Every import of :data:`IMPORTS` in a fresh process, from the installed packages (an
    editable install of this clone counts: ``make setup-gpu`` builds its CUDA module). On the
    offline path (``--wheels``) the wheels, this package's among them (else its build from the
    tree), into ``<work>/site`` first, and lze_kernels must then come from there."""
    result, site = {}, site_dir(work)
    if options.get("wheels"):
        import gpu_offline

        site.mkdir(parents=True, exist_ok=True)
        with open(work / "install.log", "w") as log:
            result = gpu_offline.install(Path(options["wheels"]), site, work, log)
    result["imports"] = check_imports(work)
    result["lze_kernels_from"] = result["imports"].get("lze_kernels", "")
    failed = [m for m, v in result["imports"].items() if not v.startswith("ok")]
    problems = [f"imports failed: {', '.join(failed)}"] if failed else []
    if options.get("wheels"):
        missing = result["wheels"]["missing"]
        if str(site) not in result["lze_kernels_from"]:
            problems.append(f"lze_kernels not imported from {site}: {result['lze_kernels_from']}")
        if missing:
            problems.append(f"{len(missing)} wheels missing from {options['wheels']} "
                            "(tools/gpu_offline.py wheels)")
        if result.get("build_exit", 0) != 0:
            problems.append(f"the build exited {result['build_exit']} (install.log)")
    result["status"] = "failed" if problems else "passed"
    if problems:
        result["reason"] = "; ".join(problems)
    return result


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


def stage_hazards(work: Path, options: dict) -> dict:
    """tools/gpu_hazards.py on the device: one JSON line an item, all must hold."""
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "tools" / "gpu_hazards.py")],
                          cwd=work, env=child_env(work), capture_output=True, text=True)
    items = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ok = proc.returncode == 0 and bool(items) and all(item["ok"] for item in items)
    return {"status": "passed" if ok else "failed", "items": items,
            **({} if ok else {"stderr": proc.stderr[-2000:]})}


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
    W.write_partial(work, "bench", result)
    for batch in options.get("batches") or gpu_bench.BATCHES:
        result["floors"][str(batch)] = gpu_bench.floors(batch, gpu_bench.GROUP, device)
        result["rows"] += gpu_bench.run(device, [batch], rounds=options.get("rounds") or 20)
        W.write_partial(work, "bench", result)
    return {**result, "status": "passed"}


def stage_sanitizer(work: Path, options: dict) -> dict:
    """compute-sanitizer's memcheck and racecheck over tools/gpu_sanitize.py (the CUDA backend's
    kernels at every shape class, racecheck at fewer and smaller ones, checked against the torch
    backend). Where a container runtime refuses the tool the device, both tools fail."""
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
                tools[name] = {"exit": W.logged(cmd, log, env=child_env(work), cwd=work,
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
                   "hazards": stage_hazards, "kernels": stage_kernels, "bench": stage_bench, "sanitizer": stage_sanitizer}


# ============================================================================ trainer stage


def stage_trainer(work: Path, options: dict) -> dict:
    """5 trainer steps (this process is the child: a fresh CUDA context); its log is
    trainer.log, its metrics summarised per step, its peak memory per phase."""
    out = work / "trainer"
    if out.exists():
        shutil.rmtree(out)
    data = W.write_arithmetic_jsonl(out / "train.jsonl", 256)
    model = W.build_model(out / "model", W.texts(data), W.VOCAB)
    run = W.run_lze(out / "run", model, data, W.TRAINER_OVERRIDES, work / "trainer.log")
    ok = run["exit_code"] == 0 and len(run["steps"]) == W.TRAINER_STEPS
    return {"status": "passed" if ok else "failed", **run, "vocab": W.VOCAB, "model": str(model),
            "data": str(data)}


# ============================================================================ memory stage


def stage_memory(work: Path, options: dict) -> dict:
    """One update-only pass of lze_trainer's Actor (bf16, ZeRO-2, gradient checkpointing, as the
    qwen2.5-math-1.5b preset) on a random model of Qwen2.5-1.5B's shape, one micro-batch of
    8 x 4096 tokens (3072 of them response), twice: the second's peak against
    docs/gpu-memory.md's arithmetic (the first GPU run measured the first update only, 31.0 GiB
    against 44.9: no Adam state yet)."""
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(W.free_port()))
    model_dir = W.random_model(work / "qwen1.5b", QWEN_1_5B)
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
    if args.command == "stage":
        return stage_main(args)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())

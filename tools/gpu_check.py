"""One command for a lent GPU: install from a folder of wheels, then check kernels, benchmark and
trainer on the device, in under 10 minutes, into one JSON and a short table.

The machine (../shared/ENVIRONMENT.md, last section): one H100/H200, no network, Python 3.12 with
torch, triton, transformers, accelerate and pytest. Everything else comes as the wheels of
:data:`WHEELS` (``make gpu-wheels`` on a machine with PyPI; at most :data:`BUDGET_MIB` MiB), is
installed with ``--no-deps --no-index`` into ``<out>/site`` (on ``PYTHONPATH``; torch is never
touched) and this package is built there from its sdist with nvcc. Sub-commands:

  wheels  --dest DIR        download / build the wheels here, print their sizes, fail over budget
  install --wheels DIR      install them and build this package on the GPU machine
  run     [--stages ...]    kernels: tests/test_gpu.py on the device (cuda, triton, torch backends)
                            bench:   benchmarks/gpu_bench.py, every variant and B in one run
                            trainer: 3 GRPO steps, rollout.engine=hf, bf16, ZeRO-2, a small Qwen2
                                     with the real vocabulary (151,936), peak memory per phase

``datasets`` (~67 MB with pyarrow and pandas) and ``reasoning-gym`` (~34 MB with matplotlib's
stack... beside cmake's 30 MB) do not fit: the trainer stage trains on a JSONL file the check
writes (no reasoning-gym task, and the reward workers import reasoning-gym only where it is
installed), read through the offline stand-in of ``datasets`` in tools/gpu_stand_ins/ (used only
when the real package is missing; the JSON says so).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = ROOT / "tools" / "gpu_stand_ins"
BUDGET_MIB = 64
PYTHON_VERSION = "3.12"
# torch 2.11's own wheels need glibc 2.28, so manylinux_2_28 wheels run wherever it does.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
# What the GPU machine lacks, pinned as in requirements/constraints-cuda.txt. "binary": a cp312
# manylinux (or pure) wheel from PyPI; "built": PyPI has only an sdist, built here into a pure wheel.
WHEELS = (
    ("deepspeed==0.19.8", "built"),  # DS_BUILD_OPS=0: no op is compiled, at install or run time
    ("hjson==3.1.0", "binary"), ("msgpack==1.2.4", "binary"), ("einops==0.8.2", "binary"),
    ("py-cpuinfo==9.0.0", "binary"), ("ninja==1.13.2", "binary"),
    ("omegaconf==2.4.0", "binary"),
    ("math-verify==0.9.0", "binary"), ("latex2sympy2-extended==1.11.0", "binary"),
    ("antlr4-python3-runtime==4.13.2", "binary"),
    # The trainer's metrics: TensorBoard's writer (not its server: no grpcio) and the run's plot.
    ("tensorboard==2.21.0", "binary"), ("absl-py==2.5.1", "binary"),
    ("protobuf==7.36.2", "binary"),
    ("matplotlib==3.11.2", "binary"), ("contourpy==1.3.3", "binary"), ("cycler==0.12.1", "binary"),
    ("fonttools==4.68.0", "binary"), ("kiwisolver==1.5.1", "binary"), ("pillow==13.0.0", "binary"),
    ("pyparsing==3.3.3", "binary"), ("python-dateutil==4.0.0", "binary"),
    ("six==1.17.0", "binary"),
    # Building this package there: CMake drives nvcc; ninja is its generator there.
    ("cmake==4.4.4", "binary"), ("pybind11==3.1.0", "binary"), ("wheel==0.45.1", "binary"),
)
# Imported after the install: each must load from the machine's packages plus the wheels.
IMPORTS = ("deepspeed", "omegaconf", "math_verify", "matplotlib.pyplot", "torch.utils.tensorboard",
           "lze_kernels", "lze_trainer.trainer")
STAGES = ("kernels", "bench", "trainer")
VOCAB = 151_936  # Qwen2.5's vocabulary
MODEL_SPEC = "tiny:qwen2?hidden=256&layers=2&heads=4&kv_heads=2&vocab=512"
# The trainer stage: 3 steps of the tiny preset on the device, at a size where the vocabulary
# dominates memory (16 prompts x 8 rollouts x 64 new tokens; micro-batches of 8 sequences).
TRAINER_OVERRIDES = (
    "rollout.engine=hf", "model.dtype=bfloat16", "actor.zero_stage=2", "trainer.device=cuda",
    "trainer.total_steps=3", "trainer.batch_size=16", "rollout.n=8", "rollout.max_new_tokens=64",
    "actor.micro_batch_size=8", "sft_warmup.steps=0", "data.eval=[]",
    "reward.function=gpu_check:coin_flip",  # mixed groups from a random model
    "trainer.eval_every=0", "trainer.save_every=0", "trainer.save_hf_model=false",
    "trainer.progress_bar=false",
)


# ============================================================================ arguments


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="download/build the wheels (needs PyPI)")
    wheels.add_argument("--dest", type=Path, default=ROOT / "wheels")
    wheels.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    install = sub.add_parser("install", help="install the wheels (no network)")
    install.add_argument("--wheels", type=Path, default=ROOT / "wheels")
    install.add_argument("--out", type=Path, default=ROOT / "gpu_check")
    run = sub.add_parser("run", help="the checks on the device")
    run.add_argument("--out", type=Path, default=ROOT / "gpu_check")
    run.add_argument("--stages", type=_stages, default=list(STAGES),
                     help=f"comma-separated subset of {','.join(STAGES)}")
    run.add_argument("--batches", type=_ints, default=None, help="benchmark B values")
    run.add_argument("--rounds", type=int, default=30, help="timed rounds per benchmark case")
    run.add_argument("--timeout", type=float, default=540.0, help="seconds for all stages")
    child = sub.add_parser("trainer-child", help=argparse.SUPPRESS)
    child.add_argument("--out", type=Path, required=True)
    child.add_argument("overrides", nargs="*")
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


# ============================================================================ wheels


def wheel_budget(folder: Path, budget_mib: float = BUDGET_MIB) -> dict:
    """Sizes of the files in ``folder``, their total, and whether it is within the budget."""
    files = sorted((p for p in Path(folder).iterdir() if p.is_file()),
                   key=lambda p: -p.stat().st_size)
    sizes = {p.name: p.stat().st_size for p in files}
    total = sum(sizes.values())
    return {"files": sizes, "total_bytes": total, "budget_bytes": int(budget_mib * 2**20),
            "within_budget": total <= budget_mib * 2**20}


def format_budget(report: dict) -> str:
    lines = [f"{size / 1e6:8.2f} MB  {name}" for name, size in report["files"].items()]
    total, budget = report["total_bytes"], report["budget_bytes"]
    verdict = "within" if report["within_budget"] else "OVER"
    lines.append(f"{total / 2**20:8.2f} MiB in {len(report['files'])} files: {verdict} the "
                 f"budget of {budget / 2**20:.0f} MiB")
    return "\n".join(lines)


def download_wheels(dest: Path, budget_mib: float) -> int:
    """Fetch the binary wheels, build the sdist-only ones and this package's sdist into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {**os.environ, "PIP_CONSTRAINT": "", "DS_BUILD_OPS": "0"}
    binary = [req for req, how in WHEELS if how == "binary"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*pip, "download", "--only-binary=:all:", "--no-deps", "--implementation",
                    "cp", "--python-version", PYTHON_VERSION, *platforms, "-d", str(dest),
                    *binary], check=True, env=env)
    built = [req for req, how in WHEELS if how == "built"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), *built],
                   check=True, env=env)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dest)], cwd=ROOT,
                   check=True, env=env, stdout=subprocess.DEVNULL)
    report = wheel_budget(dest, budget_mib)
    print(format_budget(report))
    return 0 if report["within_budget"] else 1


# ============================================================================ install


def site_dir(out: Path) -> Path:
    return Path(out) / "site"


def check_env(out: Path) -> dict:
    """Environment of every step after the install: the wheels' folder first on the path (for
    modules) and PATH (cmake, ninja), the repository's tests/ for the reward module."""
    site = site_dir(out)
    path = [str(site), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "PATH": os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])}


def install(wheels: Path, out: Path) -> int:
    """``pip install --no-index --no-deps`` of every wheel into ``<out>/site``, then this package
    from its sdist (CUDA module with nvcc, sm_90 for H100/H200), then an import of each module."""
    wheel_files = sorted(str(p) for p in Path(wheels).glob("*.whl"))
    sdists = sorted(str(p) for p in Path(wheels).glob("lze_kernels-*.tar.gz"))
    if not wheel_files or len(sdists) != 1:
        print(f"gpu_check install: {wheels} must hold the wheels and one lze_kernels sdist "
              f"(make gpu-wheels)", file=sys.stderr)
        return 2
    env = {**check_env(out), "CMAKE_GENERATOR": "Ninja", "LZE_BUILD_CUDA_EMULATED": "0",
           "LZE_CUDA_ARCHS": os.environ.get("LZE_CUDA_ARCHS", "90")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-index",
           "--no-deps", "--upgrade", "--target", str(site_dir(out))]
    subprocess.run([*pip, *wheel_files], check=True, env=env)
    subprocess.run([*pip, "--no-build-isolation", *sdists], check=True, env=env, cwd=out)
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m); print('ok', m)"
    return subprocess.run([sys.executable, "-c", code, *IMPORTS], env=env, cwd=out).returncode


# ============================================================================ run


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.timeout
    results = {"machine": machine_info(), "stages": {}}
    for stage in args.stages:
        left = deadline - time.monotonic()
        if left <= 0:
            results["stages"][stage] = {"status": "skipped", "reason": "out of time"}
            continue
        start = time.monotonic()
        print(f"== {stage}", flush=True)
        try:
            result = STAGE_FUNCTIONS[stage](args, out, left)
        except Exception as exc:  # one stage failing must not hide the others' results
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - start, 1)
        results["stages"][stage] = result
    json_path, table = write_report(results, out)
    print(table)
    print(f"results: {json_path}")
    return 0 if all(r["status"] == "passed" for r in results["stages"].values()) else 1


def machine_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["driver_free_total_gib"] = [round(x / 2**30, 1) for x in torch.cuda.mem_get_info()]
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def stage_kernels(args, out: Path, timeout: float) -> dict:
    """tests/test_gpu.py on the device; every backend of the device must be there to pass."""
    from lze_kernels import available_backends

    xml = out / "kernels.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py",
           f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=check_env(out), timeout=timeout)
    counts = junit_counts(xml) if xml.exists() else {}
    backends = available_backends("cuda") if _cuda() else []
    missing = [b for b in ("cuda", "triton", "torch") if b not in backends]
    ok = proc.returncode == 0 and counts.get("skipped", 0) == 0 and not missing
    return {"status": "passed" if ok else "failed", "backends": backends,
            "missing_backends": missing, **counts}


def junit_counts(path: Path) -> dict:
    """Totals of a pytest JUnit XML report: tests, failures, errors, skipped."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def stage_bench(args, out: Path, timeout: float) -> dict:
    """benchmarks/gpu_bench.py on the device (or the CPU, where it only shows that it runs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench
    import torch

    device = torch.device("cuda" if _cuda() else "cpu")
    rows = gpu_bench.run(device, args.batches or gpu_bench.BATCHES, rounds=args.rounds)
    status = "passed" if device.type == "cuda" else "failed"  # the stage is for the device
    return {"status": status, "device": device.type, "rows": rows}


def stage_trainer(args, out: Path, timeout: float) -> dict:
    """3 trainer steps in a child process (a fresh CUDA context); its JSON carries the result."""
    child_out = out / "trainer"
    if child_out.exists():
        shutil.rmtree(child_out)
    child_out.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "trainer-child", "--out", str(child_out)]
    with open(child_out / "console.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=check_env(out), timeout=timeout,
                              stdout=log, stderr=subprocess.STDOUT)
    result_file = child_out / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    ok = proc.returncode == 0 and result.get("exit_code") == 0
    return {"status": "passed" if ok else "failed", "log": str(child_out / "console.log"),
            **result}


STAGE_FUNCTIONS = {"kernels": stage_kernels, "bench": stage_bench, "trainer": stage_trainer}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ============================================================================ trainer child


def trainer_child(args) -> int:
    """Runs in its own process: data, model, stand-ins, memory hook, then lze_trainer's main."""
    out = Path(args.out)
    data = write_arithmetic_jsonl(out / "train.jsonl", 256)
    model = build_model(out / "model", _texts(data), VOCAB)
    sys.path.append(str(STAND_INS))  # last: installed packages win (see gpu_stand_ins/)
    stand_ins = stand_ins_used()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    memory: dict = {}
    from lze_trainer import main as trainer_main

    with phase_memory(memory):
        code = trainer_main.main(["--config", "tiny", f"model.path={model}",
                                  f"data.train={data}", f"trainer.run_dir={out / 'run'}",
                                  *TRAINER_OVERRIDES, *args.overrides])
    result = {"exit_code": code, "stand_ins": stand_ins, "vocab": VOCAB,
              "peak_memory_gib": {k: round(v / 2**30, 3) for k, v in memory.items()},
              "steps": _step_summary(out / "run" / "metrics.jsonl")}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return code


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
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    GenerationConfig.from_pretrained(base).save_pretrained(target)
    return target


def stand_ins_used() -> list[str]:
    """The stand-in modules (tools/gpu_stand_ins) that imports resolve to, because the real
    package is not installed."""
    import importlib.util

    used = []
    for path in sorted(STAND_INS.glob("*.py")):
        spec = importlib.util.find_spec(path.stem)
        if spec is not None and spec.origin and Path(spec.origin).resolve() == path.resolve():
            used.append(path.stem)
    return used


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
    keys = ("timing_s/step", "timing_s/rollout", "timing_s/update", "sa/kept_groups",
            "actor/update_tokens", "reward/mean")
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ============================================================================ report


def write_report(results: dict, out: Path) -> tuple[Path, str]:
    """``<out>/gpu_check.json`` (everything) and ``<out>/gpu_check.md`` (the short table)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "gpu_check.json"
    json_path.write_text(json.dumps(results, indent=1))
    table = format_table(results)
    (out / "gpu_check.md").write_text(table + "\n")
    return json_path, table


def format_table(results: dict) -> str:
    m = results.get("machine", {})
    lines = [f"GPU check on {m.get('device')} (torch {m.get('torch')}, triton {m.get('triton')})",
             "", "| stage | status | s | notes |", "|---|---|---|---|"]
    for name, r in results["stages"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {_notes(name, r)} |")
    bench = results["stages"].get("bench", {}).get("rows")
    if bench:
        variants = list(dict.fromkeys(r["variant"] for r in bench))
        lines += ["", "time / fused (launches, syncs) per step",
                  "| B | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for batch in dict.fromkeys(r["B"] for r in bench):
            cells = {r["variant"]: f"{r['ratio_to_fused']:.2f}x ({r['launches']}, {r['syncs']})"
                     for r in bench if r["B"] == batch}
            lines.append(f"| {batch} | " + " | ".join(cells.get(v, "") for v in variants) + " |")
    memory = results["stages"].get("trainer", {}).get("peak_memory_gib")
    if memory:
        lines += ["", "| trainer phase | peak GiB |", "|---|---|"]
        lines += [f"| {phase} | {gib:.2f} |" for phase, gib in memory.items()]
    return "\n".join(lines)


def _notes(name: str, r: dict) -> str:
    if "error" in r:
        return r["error"][:120]
    if name == "kernels":
        return (f"{r.get('tests', 0)} tests, {r.get('failures', 0)} failed, "
                f"{r.get('skipped', 0)} skipped; backends {','.join(r.get('backends', []))}")
    if name == "trainer":
        stand_ins = ", ".join(r.get("stand_ins", [])) or "none"
        return f"exit {r.get('exit_code')}; {len(r.get('steps', []))} steps; stand-ins: {stand_ins}"
    if name == "bench":
        return f"{len(r.get('rows', []))} cases on {r.get('device')}"
    return r.get("reason", "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "wheels":
        return download_wheels(args.dest, args.budget_mib)
    if args.command == "install":
        return install(args.wheels, args.out)
    if args.command == "trainer-child":
        return trainer_child(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

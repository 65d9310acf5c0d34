"""Warmed models shipped with the trainer, so that a preset starts from the same weights on every
machine (``model.path: warm:<name>``).

The supervised warm-up (:mod:`lze_trainer.warmup`) of a tiny model is a chaotic computation:
float rounding differs between CPUs, thread counts and library builds, and where the model's
accuracy jumps moves with it, so the same preset warmed on two machines starts GRPO from
different models (held-out greedy 0.376 on one, 0.419 on another for the study preset) and
measures a different task. The presets that need a reproducible start (``study``,
``study-many-pass``, ``demo``) therefore load a warmed model that ships in this folder: the
safetensors weights, config and tokenizer (the tiny tokenizer is trained on the task's text, so it
ships too), with their SHA-256 sums in ``SHA256SUMS``, checked whenever a run loads them.

``sft_warmup`` stays the way to make them; :data:`RECIPES` records, per warm start, the preset and
the overrides that warm it up, and::

    python -m lze_trainer.warm_starts --export study trainer/warm_starts/study

runs that warm-up under torchrun (through the trainer, which then takes one GRPO step and
evaluates the warmed model; both discarded) and writes the folder and its sums again. A machine
other than the one that made the shipped files gets different bytes (the reason they ship).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEME = "warm:"
FOLDER = Path(__file__).resolve().parent
CHECKSUMS = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` format
ORIGIN = "origin.json"  # how the files were made, and the warmed model's held-out accuracy
# Files of a warmed model that do not ship: the warm-up cache's completion marker and the tiny
# model builder's marker (they describe the folder they were written in).
NOT_SHIPPED = {"SFT_COMPLETE", "lze_tiny_spec.json"}

# Warm start -> (preset, overrides that make it with sft_warmup). The preset's own model.path is
# this warm start and its sft_warmup.steps 0; the overrides put back the tiny model and the
# warm-up it was made with.
RECIPES: dict[str, tuple[str, list[str]]] = {
    "study": ("study", ["model.path=tiny:qwen2?hidden=128&layers=2&heads=4&kv_heads=1&vocab=512",
                        "sft_warmup.steps=800"]),
    # make demo's warm-up on seed 0 (the demo's warm-up seed is the run's seed + 1).
    "demo": ("demo", ["model.path=tiny:qwen2?hidden=128&layers=2&heads=4&kv_heads=2&vocab=512",
                      "sft_warmup.steps=900", "sft_warmup.seed=1"]),
}


class WarmStartError(ValueError):
    pass


def is_warm_start(path: str) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def resolve(path: str) -> Path:
    """``warm:<name>`` -> the shipped folder, its files checked against ``SHA256SUMS``."""
    name = path[len(SCHEME):]
    folder = FOLDER / name
    if not name or not (folder / CHECKSUMS).is_file():
        shipped = sorted(p.parent.name for p in FOLDER.glob(f"*/{CHECKSUMS}"))
        raise WarmStartError(f"model.path: {path!r} names no shipped warm start (expected "
                             f"warm:<name> with name one of {shipped})")
    check(folder)
    return folder


def check(folder: Path) -> None:
    """Raise unless every file listed in ``folder/SHA256SUMS`` is there with that SHA-256, and no
    other file is (a stale or partly regenerated folder)."""
    expected = read_sums(folder)
    actual = {p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS}
    if actual != set(expected):
        raise WarmStartError(f"warm start {folder}: files {sorted(actual)} differ from those in "
                             f"{CHECKSUMS} ({sorted(expected)})")
    for name, digest in expected.items():
        if sha256(folder / name) != digest:
            raise WarmStartError(f"warm start {folder}: {name} does not match its SHA-256 in "
                                 f"{CHECKSUMS} (a changed or truncated file: restore it, or "
                                 f"regenerate with python -m lze_trainer.warm_starts --export)")


def read_sums(folder: Path) -> dict[str, str]:
    sums = {}
    for line in (folder / CHECKSUMS).read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*")] = digest
    return sums


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export(name: str, out_dir: Path, nproc: int = 2) -> Path:
    """Warm up ``RECIPES[name]`` from scratch under torchrun and write the warmed model, its
    origin and its SHA-256 sums to ``out_dir`` (replacing what was there)."""
    preset, overrides = RECIPES[name]
    with tempfile.TemporaryDirectory(prefix=f"warm-start-{name}-") as tmp:
        cache, run_dir = Path(tmp) / "cache", Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "lze_trainer", "--config", preset,
               *overrides, f"sft_warmup.cache_dir={cache}", f"trainer.run_dir={run_dir}",
               "trainer.total_steps=1", "trainer.eval_every=0", "trainer.save_every=0",
               "trainer.save_hf_model=false", "trainer.resume=never"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"warm start {name}: the warm-up run failed (exit "
                             f"{result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
        (warmed,) = cache.glob("sft_model-*")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        for f in sorted(warmed.iterdir()):
            if f.is_file() and f.name not in NOT_SHIPPED:
                shutil.copyfile(f, out_dir / f.name)
        origin = {"preset": preset, "overrides": overrides,
                  "command": f"python -m lze_trainer.warm_starts --export {name} {out_dir}",
                  "nproc": nproc, **_start(run_dir)}
        (out_dir / ORIGIN).write_text(json.dumps(origin, indent=1) + "\n")
    write_sums(out_dir)
    return out_dir


def write_sums(folder: Path) -> None:
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text("".join(f"{sha256(folder / n)}  {n}\n" for n in names))


def _start(run_dir: Path) -> dict:
    """The warmed model as the export run met it: its held-out accuracies before the GRPO step,
    and that step's shares of zero-variance groups (all right, all wrong)."""
    from ..metrics import read_metrics

    rows = read_metrics(run_dir)
    held_out = next(({k: v for k, v in r.items() if k.startswith("eval/")} for r in rows
                     if r.get("step") == 0 and any(k.startswith("eval/") for k in r)), {})
    first = next((r for r in rows if r.get("step") == 1 and "reward/zero_std_frac" in r), {})
    return {"held_out_at_start": held_out,
            "first_step_groups": {k: first[f"reward/{k}_frac"] for k in
                                  ("zero_std", "all_correct", "all_wrong") if first}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lze_trainer.warm_starts",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", nargs=2, metavar=("NAME", "DIR"),
                        help=f"warm up NAME ({', '.join(RECIPES)}) and write it to DIR")
    parser.add_argument("--check", action="store_true", help="check every shipped warm start")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the warm-up run")
    args = parser.parse_args(argv)
    if args.export:
        name, out = args.export
        if name not in RECIPES:
            parser.error(f"--export: NAME must be one of {sorted(RECIPES)}, got {name!r}")
        print(f"warm start {name}: {export(name, Path(out), args.nproc)}")
    if args.check or not args.export:
        for sums in sorted(FOLDER.glob(f"*/{CHECKSUMS}")):
            check(sums.parent)
            print(f"warm start {sums.parent.name}: every file matches {CHECKSUMS}")
    return 0

"""Checkpoints: DeepSpeed's save/load of weights and optimizer, plus everything else a resumed run
needs to continue exactly where the interrupted one was.

Layout: ``<run_dir>/checkpoints/step_000040/`` holds DeepSpeed's files, ``trainer_state.pt`` (the
step, the sampler position, the selector's state_dict, run counters, the resolved config) and
``rng_rank<r>.pt`` per rank (python, numpy and torch RNG states) and ``state_rank<r>.pt`` (what
only that rank holds, e.g. the tokens of the replay buffer's groups its engine generated). A
``COMPLETE`` file is written last, so a checkpoint cut short by a crash is never resumed from.
Rollout engines are reseeded from (seed, step, shard) at every step
(:func:`lze_trainer.rollout.reseed`), so they need no state.

These three kinds of file are loaded with ``torch.load(weights_only=True)``
(:func:`lze_kernels.serialization.load_state_file`): they hold tensors, plain Python values and
the carried rollout groups (:class:`RolloutGroup`, :class:`Completion`), so a file asking for
anything else is refused before it can run code. DeepSpeed's files are loaded by DeepSpeed
(docs/checkpoints.md says which files a resume trusts).
"""

from __future__ import annotations

import argparse
import random
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from lze_kernels.serialization import UnsafeStateFileError, load_state_file

from . import distributed as D
from .batch import RolloutGroup
from .rollout import Completion

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
# The classes a safe load allows besides tensors and plain values: the rollout groups that SPEED
# and replay carry in each rank's state file.
STATE_CLASSES = (RolloutGroup, Completion)
UNEXPECTED_HINT = ("lze_trainer writes nothing else into this file: it was written by another "
                   "program or changed since. Resume only from checkpoints you trust "
                   "(docs/checkpoints.md).")
OLDER_RNG_HINT = ("RNG files of versions before the safe load hold numpy arrays: if this "
                  "checkpoint is your own, `python -m lze_trainer.checkpoint --convert-trusted "
                  "{folder}` rewrites them (it loads them unsafely: only for files you trust).")

# Settings a checkpoint must agree on to be resumed: they fix the prompt ids, the selector's
# state table, the shapes of a step and the partitioning of DeepSpeed's optimizer state.
COMPATIBILITY_KEYS = (
    "model.path", "data.train", "data.train_limit", "data.prompt_template", "data.system_prompt",
    "rollout.n", "rollout.allocation", "rollout.allocation_max", "trainer.batch_size",
    "trainer.seed", "selection.method", "selection.keep_ratio", "selection.noise_scale",
    "selection.beta", "selection.d_min", "selection.alpha", "selection.prune",
    "selection.prune_after", "selection.replay_ratio", "replay.ratio", "replay.buffer_size",
    "selection.speed.screen_rollouts",  # SPEED's carried screenings (methods.fill)
    "actor.zero_stage",
    "actor.norm_adv_by_std", "sft_warmup.steps",
)
# Keys that count only while their switch is on (switch key, value): their defaults follow
# rollout.n (config.resolve_derived), so a run without the switch may see another value.
SWITCHED_KEYS = {"selection.speed.screen_rollouts": ("selection.method", "speed"),
                 "rollout.allocation_max": ("rollout.allocation", True)}


class CheckpointError(ValueError):
    pass


def check_shared_run_dir(run_dir: Path, world: D.World, wait_s: float = 5.0) -> None:
    """Fail on every rank, naming ``trainer.run_dir``, unless every rank sees the same folder.

    A checkpoint is written in parts (DeepSpeed's shards by every rank; the trainer state and
    ``COMPLETE`` by rank 0) and read back by every rank on resume, so on several nodes the run
    folder must live on a filesystem all of them mount at the same path. Rank 0 writes a file
    with a fresh random name and content; each rank looks for it for up to ``wait_s`` seconds
    (a network filesystem may show a new file late)."""
    token = D.broadcast_object(secrets.token_hex(8) if world.is_main else None)
    probe = Path(run_dir) / f".shared_check_{token}"
    if world.is_main:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    D.barrier()
    seen = D.all_gather_object(_read_within(probe, wait_s) == token)
    if world.is_main:
        probe.unlink()
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(
            f"trainer.run_dir: {str(run_dir)!r} is not one folder shared by all ranks: rank(s) "
            f"{blind} do not see the file rank 0 wrote there. Checkpoints are written in parts by "
            f"different ranks and read by all of them on resume, so on several nodes "
            f"trainer.run_dir must be on a filesystem every node mounts at the same path (NFS, "
            f"Lustre, ...).")


def _read_within(path: Path, wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return path.read_text()
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag(step: int) -> str:
    return f"step_{step:06d}"


def save(engine, run_dir: Path, step: int, trainer_state: dict, keep: int, rank: int,
         rank_state: dict) -> Path:
    """Every rank calls this (DeepSpeed's save is collective); ``trainer_state`` is rank 0's,
    ``rank_state`` each rank's own."""
    root = checkpoints_dir(run_dir)
    engine.save_checkpoint(str(root), tag=tag(step), client_state={"step": step})
    folder = root / tag(step)
    torch.save(_rng_state(), folder / f"rng_rank{rank}.pt")
    torch.save(rank_state, folder / f"state_rank{rank}.pt")
    if rank == 0:
        torch.save(trainer_state, folder / TRAINER_STATE)
    D.barrier()
    if rank == 0:
        (folder / COMPLETE).touch()
        _prune_old(root, keep)
    D.barrier()
    return folder


def find_resume_folder(run_dir: Path, resume: str) -> Optional[Path]:
    """``auto``: the newest complete checkpoint of the run (None: start fresh); ``never``: None;
    otherwise the named checkpoint folder, which must exist and be complete."""
    if resume == "never":
        return None
    if resume != "auto":
        folder = Path(resume)
        if not (folder / COMPLETE).exists():
            raise CheckpointError(f"trainer.resume: {resume!r} is not a complete checkpoint "
                                  f"folder (expected a step_NNNNNN folder with a {COMPLETE} file)")
        return folder
    complete = sorted(p.parent for p in checkpoints_dir(run_dir).glob(f"step_*/{COMPLETE}"))
    return complete[-1] if complete else None


def load(engine, folder: Path, rank: int, config_dict: dict) -> dict:
    """Restore DeepSpeed's state and this rank's RNGs; returns the trainer state, with this rank's
    own under ``rank_state``."""
    trainer_state = read_state(folder / TRAINER_STATE)
    check_compatible(trainer_state["config"], config_dict, folder)
    path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"trainer.resume: DeepSpeed could not load {folder}")
    rng_file = folder / f"rng_rank{rank}.pt"
    if rng_file.exists():
        _set_rng_state(read_state(rng_file))
    rank_file = folder / f"state_rank{rank}.pt"  # absent in checkpoints of older versions
    trainer_state["rank_state"] = read_state(rank_file) if rank_file.exists() else {}
    return trainer_state


def read_state(path: Path) -> Any:
    """A trainer state, RNG or rank state file, loaded without running code from it (refused
    with :class:`UnsafeStateFileError` if it holds anything but what :func:`save` writes)."""
    hint = (OLDER_RNG_HINT.format(folder=path.parent) if path.name.startswith("rng_rank")
            else UNEXPECTED_HINT)
    return load_state_file(path, "trainer.resume: checkpoint file", map_location="cpu",
                           allowed=STATE_CLASSES, hint=hint)


def check_compatible(saved: dict, current: dict, folder: Path) -> None:
    differ = [k for k in COMPATIBILITY_KEYS if _get(saved, k) != _get(current, k)
              and _switched_on(k, current)]
    if saved.get("world_size") != current.get("world_size"):
        differ.append("world size (number of ranks)")
    if differ:
        details = "; ".join(f"{k}: checkpoint {_get(saved, k)!r}, now {_get(current, k)!r}"
                            for k in differ if "." in k)
        raise CheckpointError(
            f"trainer.resume: the checkpoint {folder} was written by an incompatible config "
            f"({', '.join(differ)} differ{': ' + details if details else ''}). Resume with the same "
            f"settings, or start a new run (trainer.run_dir=... or trainer.resume=never).")


def _switched_on(key: str, config: dict) -> bool:
    switch, on = SWITCHED_KEYS.get(key, (None, None))
    return switch is None or _get(config, switch) == on


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _prune_old(root: Path, keep: int) -> None:
    complete = sorted(p.parent for p in root.glob(f"step_*/{COMPLETE}"))
    for folder in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(folder, ignore_errors=True)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": _plain_numpy_state(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["key"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain_numpy_state(legacy: tuple) -> dict:
    """numpy's global RNG state (``np.random.get_state()``: MT19937's 624-word key as a numpy
    array, position, cached Gaussian) as a tensor and plain values, which a safe load reads."""
    _, key, pos, has_gauss, gauss = legacy
    return {"key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def convert_trusted(folder: Path) -> list[Path]:
    """Rewrite the RNG files of a checkpoint written before the safe load (numpy arrays inside)
    in today's format; returns the files rewritten. They are loaded with ``weights_only=False``,
    which runs whatever the file asks for: only for checkpoints you trust. Every state file is
    then read safely, so a file that still asks for more is named."""
    rewritten = []
    for path in sorted(Path(folder).glob("rng_rank*.pt")):
        try:
            read_state(path)
        except UnsafeStateFileError:
            # The unsafe load this function exists for: the caller vouches for the file.
            state = torch.load(path, map_location="cpu", weights_only=False)
            torch.save({**state, "numpy": _plain_numpy_state(state["numpy"])}, path)
            rewritten.append(path)
    for path in [*sorted(Path(folder).glob("*rank*.pt")), Path(folder) / TRAINER_STATE]:
        read_state(path)
    return rewritten


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lze_trainer.checkpoint",
        description="Rewrite a trusted checkpoint of an older version for the safe load.")
    parser.add_argument("--convert-trusted", type=Path, required=True, metavar="FOLDER",
                        help="a step_NNNNNN checkpoint folder you trust")
    folder = parser.parse_args(argv).convert_trusted
    rewritten = convert_trusted(folder)
    print(f"{folder}: rewrote {len(rewritten)} RNG file(s); every state file now loads safely")


if __name__ == "__main__":
    main()

"""Turn ``model.path`` into a local checkpoint folder every rank (actor and engine) loads from."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from . import distributed as D
from . import tiny_model, warm_starts


class ModelSourceError(ValueError):
    pass


def resolve(path: str, run_dir: Path, world: D.World, corpus: Callable[[], Iterable[str]]) -> str:
    """A local folder: ``tiny:`` specs are built in the run folder (rank 0 builds, every rank
    waits), ``warm:<name>`` is a warmed model shipped with the trainer (its SHA-256 sums checked,
    :mod:`lze_trainer.warm_starts`), local folders are used as they are, anything else is fetched
    from the Hugging Face hub once per node (its local rank 0) into that node's cache. ``corpus``
    yields the texts a tiny tokenizer is trained on."""
    if tiny_model.is_tiny_spec(path):
        tiny_model.TinySpec.parse(path)  # a bad spec fails on every rank, before any collective
        target = Path(run_dir) / "tiny_model"
        if world.is_main:
            tiny_model.build(path, target, corpus())
        D.barrier()
        return str(target)
    if warm_starts.is_warm_start(path):
        try:
            return str(warm_starts.resolve(path))
        except warm_starts.WarmStartError as e:
            raise ModelSourceError(str(e)) from None
    if Path(path).is_dir():
        _check_local(Path(path))
        return path
    if Path(path).exists() or path.startswith(("/", "./", "../")):
        raise ModelSourceError(f"model.path: {path!r} is not a model folder (expected a folder "
                               "with config.json and weights, a hub id like 'owner/name', or "
                               "a tiny:qwen2?... spec)")
    # Each node's local rank 0 downloads into that node's cache (nodes need not share a
    # filesystem); the node's other ranks then find it there. Every rank raises the same error
    # if any rank failed (none waits forever).
    downloaded = _raise_on_every_rank(_download(path) if world.local_rank == 0 else None)
    return _raise_on_every_rank(downloaded or _download(path, cached_only=True))


def _raise_on_every_rank(outcome):
    """``outcome`` once every rank has one; the first failed rank's error raised on all."""
    errors = [o for o in D.all_gather_object(outcome) if isinstance(o, ModelSourceError)]
    if errors:
        raise errors[0]
    return outcome


def _check_local(folder: Path) -> None:
    if not (folder / "config.json").exists():
        raise ModelSourceError(f"model.path: {str(folder)!r} has no config.json (expected a Hugging "
                               "Face checkpoint folder)")


def _download(repo_id: str, cached_only: bool = False) -> str | ModelSourceError:
    """The snapshot's local folder, fetched from the hub (``cached_only``: from this node's cache
    alone), or the error to raise."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=cached_only,
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                 "*.jinja", "*.py"])
    except Exception as e:  # hub unreachable, unknown repo, gated model, ...
        return ModelSourceError(
            f"model.path: {repo_id!r} is not a local folder and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"On a machine with access run `huggingface-cli download {repo_id} --local-dir DIR`, "
            f"copy DIR here and set model.path=DIR (or pre-fill the HF cache and set "
            f"HF_HUB_OFFLINE=1).")

"""Turn ``model.path`` into a local checkpoint folder every rank (actor and engine) loads from."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from . import distributed as D
from . import tiny_model


class ModelSourceError(ValueError):
    pass


def resolve(path: str, run_dir: Path, world: D.World, corpus: Callable[[], Iterable[str]]) -> str:
    """A local folder: ``tiny:`` specs are built in the run folder (rank 0 builds, every rank
    waits), local folders are used as they are, anything else is fetched from the Hugging Face
    hub once (rank 0) into its cache. ``corpus`` yields the texts a tiny tokenizer is trained on."""
    if tiny_model.is_tiny_spec(path):
        tiny_model.TinySpec.parse(path)  # a bad spec fails on every rank, before any collective
        target = Path(run_dir) / "tiny_model"
        if world.is_main:
            tiny_model.build(path, target, corpus())
        D.barrier()
        return str(target)
    if Path(path).is_dir():
        _check_local(Path(path))
        return path
    if Path(path).exists() or path.startswith(("/", "./", "../")):
        raise ModelSourceError(f"model.path: {path!r} is not a model folder (expected a folder "
                               "with config.json and weights, a hub id like 'owner/name', or "
                               "a tiny:qwen2?... spec)")
    # Rank 0 downloads; every rank raises the same error if it fails (none waits forever).
    outcome = _download(path) if world.is_main else None
    outcome = D.broadcast_object(outcome)
    if isinstance(outcome, ModelSourceError):
        raise outcome
    return outcome


def _check_local(folder: Path) -> None:
    if not (folder / "config.json").exists():
        raise ModelSourceError(f"model.path: {str(folder)!r} has no config.json (expected a Hugging "
                               "Face checkpoint folder)")


def _download(repo_id: str) -> str | ModelSourceError:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                          "*.model", "*.jinja", "*.py"])
    except Exception as e:  # hub unreachable, unknown repo, gated model, ...
        return ModelSourceError(
            f"model.path: {repo_id!r} is not a local folder and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"On a machine with access run `huggingface-cli download {repo_id} --local-dir DIR`, "
            f"copy DIR here and set model.path=DIR (or pre-fill the HF cache and set "
            f"HF_HUB_OFFLINE=1).")

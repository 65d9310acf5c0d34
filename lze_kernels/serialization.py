"""Loading state files (checkpoints, embeddings) without running code from them.

``torch.load(weights_only=True)`` unpickles only tensors, plain Python values (dict, list,
tuple, str, int, float, bool, None, OrderedDict) and the classes a caller allows; any other
global a pickle names (``builtins.exec``, ``os.system``, a class whose ``__reduce__`` runs code)
is refused before it is called. :func:`load_state_file` turns that refusal into an error naming
the file and what it asked for, instead of torch's advice to retry with ``weights_only=False``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Iterable

import torch


class UnsafeStateFileError(ValueError):
    """A state file holds objects a safe load refuses (loading it could run code)."""


def load_state_file(path: str | os.PathLike, what: str, map_location: Any = None,
                    allowed: Iterable[type] = (), hint: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` with the classes ``allowed`` besides tensors and
    plain Python values. ``what`` names the file's role in the error; ``hint`` is appended to it
    (what to do about a file an older version wrote, say)."""
    allowed = list(allowed)
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            refused = _refused_globals(path)
    asks = (f"asks for {', '.join(refused)}" if refused
            else "holds pickle instructions a safe load refuses")
    extra = f" and {', '.join(c.__qualname__ for c in allowed)}" if allowed else ""
    raise UnsafeStateFileError(
        f"{what} {os.fspath(path)}: refused to load it: it {asks}, and loading could run code "
        f"from it (a safe load reads only tensors, plain Python values{extra})."
        + (f" {hint}" if hint else "")) from None


def _refused_globals(path) -> list[str]:
    """The globals torch's safe loader refuses in a ``torch.save`` file (empty for another kind
    of file), read from the pickle's opcodes without unpickling anything."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError):
        return []

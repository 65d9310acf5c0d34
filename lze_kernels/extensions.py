"""Loading the compiled modules (``_lze_cpu``, ``_lze_cuda``, ``_lze_cuda_emu``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path


def load_module(name: str):
    """The compiled module ``lze_kernels.<name>``; ImportError when it was not built.

    ``LZE_EXTENSION_DIR`` points at another build of the modules to load instead (e.g. the
    coverage-instrumented build of tools/emu_gcov.sh), each loaded once, so that every caller
    shares one module (the emulator's state lives in it)."""
    override = os.environ.get("LZE_EXTENSION_DIR")
    if override:
        return _load_from(Path(override), name)
    return importlib.import_module(f"lze_kernels.{name}")


_LOADED: dict[tuple[str, str], object] = {}


def _load_from(directory: Path, name: str):
    key = (str(directory), name)
    if key in _LOADED:
        return _LOADED[key]
    candidates = sorted(directory.glob(f"{name}.*.so")) + sorted(directory.glob(f"{name}.so"))
    if not candidates:
        raise ImportError(f"LZE_EXTENSION_DIR={directory} holds no {name} module")
    spec = importlib.util.spec_from_file_location(f"lze_kernels.{name}", candidates[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED[key] = module
    return module

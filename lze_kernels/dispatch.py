"""Backend registry and the ``backend="auto"`` rule.

Every backend exposes the same functions with the semantics of :mod:`lze_kernels.reference`:

* ``step(rewards, valid, prompt_ids, state, params) -> StepStats`` (one fused launch)
* ``topk(energy, k, noise_scale, seed, step_counter) -> Selection`` (one launch or a few)
* ``runner(state, params, selection, faults)``: what runs a selector's steps
  (:mod:`lze_kernels.runners`: one native call a step on the compiled backends)

and may expose ``predict(query_emb, ref_emb, ref_pass, scale) -> [N] fp32`` (the DOTS
prediction, :mod:`lze_kernels.dots`; ``has_op("predict")`` says whether it does).

``auto`` picks ``cuda`` (else ``triton``) for GPU tensors and ``cpu`` for CPU tensors, falling back
to ``torch`` when an extension is missing, with a warning (once per device type) naming what is
missing. A compiled module is chosen only after one probe launch on the device succeeded (once
per process and device): the CUDA module imports even under a driver too old for its runtime. The environment variable ``LZE_BACKEND`` overrides ``auto``. ``cuda_emulated`` runs the
CUDA kernel sources on CPU threads (test support).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from pathlib import Path

import torch

from . import native, reference, runners, runtime

NAMES = ("auto", "torch", "triton", "cuda", "cpu", "cuda_emulated")


class TorchBackend:
    """The readable reference, any device."""

    name = "torch"
    device_types = None  # any

    @staticmethod
    def available() -> bool:
        return True

    @staticmethod
    def runtime(device) -> runtime.HostRuntime:
        return runtime.for_device(device)

    @staticmethod
    def step(rewards, valid, prompt_ids, state, params, fault_mirror=None):
        stats = reference.lze_step(rewards, valid, prompt_ids, state, params)
        if fault_mirror is not None:  # host memory: on a GPU a copy behind the step
            fault_mirror.copy_(state.fault, non_blocking=True)
        return stats

    @staticmethod
    def topk(energy, k, noise_scale, seed, step_counter):
        return reference.topk_select(energy, k, noise_scale, seed, step_counter[0])

    def runner(self, state, params, selection, faults, pool_outputs=True):
        return runners.OpsRunner(self, state, params, selection, faults)

    @staticmethod
    def predict(query_emb, ref_emb, ref_pass, scale):
        return reference.predict_pass_rates_reference(query_emb, ref_emb, ref_pass, scale)

    @staticmethod
    def has_op(op: str) -> bool:
        return True


class TritonBackend:
    """Fused Triton kernels (GPU tensors; CPU tensors under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    @property
    def device_types(self):
        return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)

    @staticmethod
    def available() -> bool:
        if importlib.util.find_spec("triton") is None:
            return False
        try:
            importlib.import_module("lze_kernels.triton_kernels")
        except ImportError:
            return False
        return True

    @staticmethod
    def unavailable_reason() -> str:
        return "triton cannot be imported (pip install triton)"

    @staticmethod
    def runtime(device) -> runtime.HostRuntime:
        return runtime.for_device(device)

    @staticmethod
    def step(rewards, valid, prompt_ids, state, params, fault_mirror=None):
        return importlib.import_module("lze_kernels.triton_kernels").step(
            rewards, valid, prompt_ids, state, params, fault_mirror
        )

    def runner(self, state, params, selection, faults, pool_outputs=True):
        return runners.OpsRunner(self, state, params, selection, faults)

    @staticmethod
    def topk(energy, k, noise_scale, seed, step_counter):
        return importlib.import_module("lze_kernels.triton_kernels").topk(
            energy, k, noise_scale, seed, step_counter
        )

    @staticmethod
    def predict(query_emb, ref_emb, ref_pass, scale):
        return importlib.import_module("lze_kernels.triton_kernels").predict_pass_rates(
            query_emb, ref_emb, ref_pass, scale
        )

    @staticmethod
    def has_op(op: str) -> bool:
        return True


class _Native:
    """Adapter giving a :class:`native.NativeBackend` the registry's interface."""

    def __init__(self, backend: native.NativeBackend):
        self._backend = backend
        self.name = backend.name
        self.device_types = (backend.device_type,)
        self.step = backend.step
        self.topk = backend.topk
        self.predict = backend.predict
        self.has_op = backend.has_op
        self.unavailable_reason = backend.unavailable_reason
        self.launch_error = backend.launch_error

    def available(self) -> bool:
        return self._backend.available()

    def runtime(self, device) -> runtime.HostRuntime:
        return self._backend.runtime

    def runner(self, state, params, selection, faults, pool_outputs=True):
        return runners.NativeRunner(self._backend, state, params, selection, faults,
                                    pool_outputs)


BACKENDS = {
    "torch": TorchBackend(),
    "triton": TritonBackend(),
    "cuda": _Native(native.CUDA),
    "cpu": _Native(native.CPU),
    "cuda_emulated": _Native(native.CUDA_EMULATED),
}


def supports(backend, device: torch.device) -> bool:
    return backend.device_types is None or device.type in backend.device_types


def available_backends(device) -> list[str]:
    """Names of the backends that can run on ``device`` in this installation."""
    device = torch.device(device)
    return [n for n, b in BACKENDS.items() if b.available() and supports(b, device)]


def resolve(name: str, device) -> object:
    """The backend object for ``name`` (``"auto"`` resolved) on ``device``."""
    device = torch.device(device)
    if name not in NAMES:
        raise ValueError(f"backend: expected one of {list(NAMES)}, got {name!r}")
    if name == "auto":
        name = os.environ.get("LZE_BACKEND") or _auto_name(device)
        if name not in NAMES or name == "auto":
            raise ValueError(f"LZE_BACKEND: expected one of {list(NAMES[1:])}, got {name!r}")
    backend = BACKENDS[name]
    if not backend.available():
        raise ValueError(f"backend: {name!r} is not available in this installation: "
                         f"{backend.unavailable_reason()} (available on {device}: "
                         f"{available_backends(device)})")
    if not supports(backend, device):
        raise ValueError(f"backend: {name!r} cannot run on device {device} "
                         f"(it runs on {list(backend.device_types)})")
    return backend


def resolve_op(name: str, device, op: str) -> object:
    """:func:`resolve` for an op that not every backend has (``"predict"``): ``auto`` (and
    ``LZE_BACKEND``) skip backends without a kernel for it, e.g. CUDA for the DOTS prediction,
    which Triton then runs; naming such a backend explicitly is an error."""
    device = torch.device(device)
    if name == "auto":
        override = os.environ.get("LZE_BACKEND")
        usable = override in BACKENDS and BACKENDS[override].has_op(op)
        name = override if usable else _auto_name(device, op)
    backend = resolve(name, device)
    if not backend.has_op(op):
        having = [n for n in available_backends(device) if BACKENDS[n].has_op(op)]
        raise ValueError(f"backend: {name!r} has no {op} kernel (backends with one on "
                         f"{device}: {having})")
    return backend


def _auto_name(device: torch.device, op: str = "step") -> str:
    preference = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    for name in preference:
        backend = BACKENDS[name]
        if (backend.available() and supports(backend, device) and backend.has_op(op)
                and _launches(backend, device)):
            return name
    _warn_slow_fallback(device, [BACKENDS[name] for name in preference])
    return "torch"


def _launches(backend, device: torch.device) -> bool:
    """Whether ``backend`` runs on ``device``: a compiled module must pass its probe launch;
    when it fails, ``auto`` warns once, naming the error, and tries the next backend."""
    probe = getattr(backend, "launch_error", None)
    error = probe(device) if probe is not None else None
    if error is None:
        return True
    if (backend.name, str(device)) not in _warned_probes:
        _warned_probes.add((backend.name, str(device)))
        warnings.warn(
            f"lze_kernels: backend='auto' skips {backend.name!r} on {device}: its probe launch "
            f"failed ({error}). Error code 35 (cudaErrorInsufficientDriver) means the NVIDIA "
            f"driver is older than the CUDA toolkit lze_kernels was built with: update the "
            f"driver or rebuild with a matching toolkit (`pip install -e .`).",
            RuntimeWarning, stacklevel=5)  # the caller of LZESelector(...) / ops.*
    return False


# (backend, device) pairs whose failed probe launch was already reported.
_warned_probes: set[tuple[str, str]] = set()


# Device types whose fallback to the reference was already reported.
_warned_fallbacks: set[str] = set()


def _warn_slow_fallback(device: torch.device, missing) -> None:
    """Tell the user, once per device type, that ``auto`` runs the slow reference and why."""
    if device.type in _warned_fallbacks:
        return
    _warned_fallbacks.add(device.type)
    reasons = "; ".join(backend.unavailable_reason() for backend in missing)
    warnings.warn(
        f"lze_kernels: backend='auto' falls back to the PyTorch reference on {device.type} "
        f"tensors, about 10x slower than the fused kernels: {reasons}. Build the compiled "
        f"modules with `pip install -e .` (or `make build`) in the source tree; after a "
        f"non-editable `pip install .`, a source tree without the built modules shadows the "
        f"installed package when Python runs from its root (lze_kernels was imported from "
        f"{Path(__file__).parent}). Pass backend='torch' to choose the reference explicitly.",
        RuntimeWarning, stacklevel=5)  # the caller of LZESelector(...) / ops.*

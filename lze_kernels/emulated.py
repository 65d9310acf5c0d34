"""The CUDA emulator's controls, for tests (the ``cuda_emulated`` backend: csrc/emu/).

The emulated module runs the CUDA kernel sources on CPU threads under a GPU's rules
(csrc/emu/cuda_emu.h). This module is its Python face, in torch's idiom: a current stream per
host thread (``stream``), the devices' architectures (``architectures``), how launches run
(``mode``: ``"immediate"``, ``"worker"`` or ``"held"``), the order blocks start in
(``block_order``). Everything is also reachable as functions of ``module()``.

    with emulated.architectures(86), emulated.mode("held"):
        sel = LZESelector(1000, device="cpu", backend="cuda_emulated")
        out = sel.step(rewards, ids)      # queued, not run
        emulated.synchronize()            # now it has run
"""

from __future__ import annotations

import contextlib
import threading

from .extensions import load_module

ARCHITECTURES = (80, 86, 89, 90)

_local = threading.local()


def module():
    """The emulated module (``lze_kernels._lze_cuda_emu``); ImportError when it was not built."""
    return load_module("_lze_cuda_emu")


def current_stream() -> int:
    """This host thread's current emulated stream (0: the device's default stream)."""
    return getattr(_local, "stream", 0)


def launch_arg(device) -> tuple[int, int]:
    """The emulated module's (stream, device) for a launch from this host thread."""
    return current_stream(), module().current_device()


def new_stream() -> int:
    return module().stream_create()


@contextlib.contextmanager
def stream(handle: int):
    """Makes ``handle`` this host thread's current emulated stream inside the block."""
    previous = current_stream()
    _local.stream = handle
    try:
        yield handle
    finally:
        _local.stream = previous


def synchronize() -> None:
    """Waits for everything queued on the current device (cudaDeviceSynchronize)."""
    status = module().synchronize()
    if status != 0:
        raise RuntimeError(f"cuda_emulated: error code {status} ({module().fault()[1]})")


@contextlib.contextmanager
def mode(name: str):
    """Launches run as ``name`` says inside the block (the emulator synchronises first)."""
    m = module()
    previous = m.mode()
    m.set_mode(name)
    try:
        yield
    finally:
        m.set_mode(previous)


@contextlib.contextmanager
def architectures(*archs: int):
    """Devices with these architectures' limits inside the block (one per entry), every kernel
    attribute at its default, as in a fresh process; then one sm_90 device again."""
    m = module()
    m.set_devices(list(archs))
    try:
        yield
    finally:
        m.set_devices([90])


@contextlib.contextmanager
def block_order(order: str, seed: int = 0, workers: int = 0):
    """Blocks start in ``order`` (forward, reverse, random by ``seed``) with at most ``workers``
    resident at once (0: the default) inside the block."""
    m = module()
    m.set_block_order(order, seed)
    m.set_workers(workers)
    try:
        yield
    finally:
        m.set_block_order("forward", 0)
        m.set_workers(0)

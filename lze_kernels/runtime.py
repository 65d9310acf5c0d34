"""Where a backend's work runs and how the host waits for it: one object per (backend, device).

A selector's host code (lze_kernels/selector.py, runners.py, captured.py) never calls
``torch.cuda`` directly for ordering; it asks its runtime:

* :class:`HostRuntime`: the CPU kernels, the reference and interpreted Triton on CPU tensors. A
  call has run when it returns: nothing to wait for.
* :class:`CudaRuntime`: a GPU. Launches are asynchronous on the current stream; torch ops on the
  same stream are ordered after them; graphs are ``torch.cuda.CUDAGraph``.
* :class:`EmulatedRuntime`: the CUDA kernel sources on the CPU emulator (``cuda_emulated``,
  lze_kernels/emulated.py). In the emulator's immediate mode a call has run when it returns; in
  its worker and held modes launches run after the call, as on a GPU, on the emulated current
  stream, but the host's torch ops on the same (CPU) tensors are not ordered after them: the
  runtime's ``zero_`` and ``copy_`` are queued on the stream instead, and host reads wait for
  it (``before_host_access``). Its graphs are the emulator's stream capture.

The methods: ``asynchronous`` (whether the default value check is deferred), ``synchronize``,
``capturing``, ``stream`` (an int handle, compared to keep a selector on one stream),
``order_after`` (make the current stream wait for work queued on another), ``zero_`` and
``copy_`` (stream-ordered writes of a selector's state), ``keep_alive`` (tensors a queued launch
still reads: the caching allocator keeps a GPU's safe, a CPU tensor must be held),
``before_host_access`` (the host reads or writes state with torch ops next), ``pinned_word`` (the
fault word's host memory the device can write) and ``new_graph`` / ``capture``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

from . import emulated


class HostRuntime:
    """Calls that have run when they return."""

    asynchronous = False
    supports_graphs = False

    def synchronize(self, device) -> None:
        pass

    def capturing(self, device) -> bool:
        return False

    def stream(self, device) -> int:
        return 0

    def order_after(self, device, stream: int) -> None:
        pass

    @staticmethod
    def zero_(tensor: torch.Tensor) -> None:
        tensor.zero_()

    @staticmethod
    def copy_(target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def keep_alive(self, *objects) -> None:
        pass

    def before_host_access(self, device) -> None:
        pass

    @staticmethod
    def pinned_word() -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32)


class CudaRuntime(HostRuntime):
    """A GPU: torch's current stream, torch's CUDA graphs."""

    asynchronous = True
    supports_graphs = True

    def synchronize(self, device) -> None:
        torch.cuda.current_stream(device).synchronize()

    def capturing(self, device) -> bool:
        return torch.cuda.is_current_stream_capturing()

    # The raw cudaStream_t, as inductor's generated code reads it (a fraction of
    # torch.cuda.current_stream(device).cuda_stream's host time, which builds a Stream object).
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def stream(self, device) -> int:
        index = torch.cuda.current_device() if device.index is None else device.index
        if self._raw_stream is None:
            return torch.cuda.current_stream(index).cuda_stream
        return self._raw_stream(index)

    def order_after(self, device, stream: int) -> None:
        torch.cuda.current_stream(device).wait_stream(torch.cuda.ExternalStream(stream, device))

    @staticmethod
    def pinned_word() -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32, pin_memory=True)

    @staticmethod
    def new_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    def capture(graph):
        return torch.cuda.graph(graph)


class EmulatedRuntime(HostRuntime):
    """The CUDA emulator (``cuda_emulated``): its mode says whether launches run in the call."""

    supports_graphs = True

    def __init__(self):
        self._held: list = []  # what queued launches read, released at the next sync
        self._captured: Optional[list] = None

    @staticmethod
    def _module():
        return emulated.module()

    @property
    def asynchronous(self) -> bool:
        return self._module().mode() != "immediate"

    def synchronize(self, device) -> None:
        status = self._module().stream_synchronize(self.stream(device))
        self._held.clear()
        if status != 0:
            fault = self._module().fault()[1]
            raise RuntimeError(f"lze_kernels: cuda_emulated: synchronisation failed (error code "
                               f"{status}{': ' + fault if fault else ''})")

    def capturing(self, device) -> bool:
        return self._module().is_capturing(self.stream(device))

    def stream(self, device) -> int:
        return emulated.current_stream()

    def order_after(self, device, stream: int) -> None:
        module = self._module()
        event = module.event_create()
        module.event_record(event, stream)
        module.stream_wait_event(self.stream(device), event)

    def _runs_in_the_call(self, device) -> bool:
        """Whether work issued now runs before the call returns (immediate mode, no capture)."""
        return not self.asynchronous and not self.capturing(device)

    def zero_(self, tensor: torch.Tensor) -> None:
        if self._runs_in_the_call(tensor.device):
            tensor.zero_()
            return
        self._module().memset_async(tensor.data_ptr(), 0, _nbytes(tensor),
                                    self.stream(tensor.device))

    def copy_(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if self._runs_in_the_call(target.device):
            target.copy_(source)
            return
        source = source.to(target.dtype).contiguous()
        self.keep_alive(source)
        self._module().memcpy_async(target.data_ptr(), source.data_ptr(), _nbytes(target),
                                    self.stream(target.device))

    def keep_alive(self, *objects) -> None:
        if self._captured is not None:
            self._captured.extend(objects)
        elif self.asynchronous:
            self._held.extend(objects)

    def before_host_access(self, device) -> None:
        if self.asynchronous:
            self.synchronize(device)

    def pinned_word(self) -> torch.Tensor:
        """A host word registered with the emulator as pinned, mapped memory (unregistered when
        the tensor is freed)."""
        word = torch.zeros(1, dtype=torch.int32)
        module = self._module()
        module.host_register(word.data_ptr(), 4)
        weakref.finalize(word, module.host_unregister, word.data_ptr())
        return word

    def new_graph(self):
        return EmulatedGraph(self)

    @contextlib.contextmanager
    def capture(self, graph: "EmulatedGraph"):
        stream = self.stream(torch.device("cpu"))
        module = self._module()
        if module.begin_capture(stream) != 0:
            raise RuntimeError("lze_kernels: cuda_emulated: the stream is already capturing")
        self._captured, graph.kept = [], []
        try:
            yield graph
        finally:
            status, handle = module.end_capture(stream)
            graph.kept, self._captured = self._captured, None
            if status == 0:
                graph.adopt(handle)
        if status != 0:
            raise RuntimeError(f"lze_kernels: cuda_emulated: the capture failed (error code "
                               f"{status}: a synchronisation or a wait on outside work)")


class EmulatedGraph:
    """A stream capture of the emulator, replayed on the current emulated stream; it keeps what
    its launches read alive (the workspace and outputs allocated during the capture)."""

    def __init__(self, runtime: EmulatedRuntime):
        self._module = runtime._module()
        self.handle: Optional[int] = None
        self.kept: list = []

    def adopt(self, handle: int) -> None:
        """The captured graph; destroyed with this object (not at exit: the process ends)."""
        self.handle = handle
        weakref.finalize(self, self._module.graph_destroy, handle).atexit = False

    def replay(self) -> None:
        status = self._module.graph_launch(self.handle, emulated.current_stream())
        if status != 0:
            raise RuntimeError(f"lze_kernels: cuda_emulated: graph launch failed ({status})")


def _nbytes(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("lze_kernels: a stream-ordered write needs a contiguous tensor")
    return tensor.numel() * tensor.element_size()


HOST = HostRuntime()
CUDA = CudaRuntime()
EMULATED = EmulatedRuntime()


def for_device(device: torch.device) -> HostRuntime:
    """The runtime of torch's own ops (and Triton's) on ``device``."""
    return CUDA if device.type == "cuda" else HOST

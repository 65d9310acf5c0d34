"""The host's copy of a selector's fault word, written by the step kernel itself.

A step records the faults of its bad rows (docs/spec.md §1) in a device word. Reading that word
right after the step would stall the host until the step has run (a host sync, 89-288 us a step
on an H200 at 416255b). Instead the step kernel's last block copies the word into this one,
which lives in host memory the device can write: on a GPU, pinned memory mapped into the
device's address space (the kernel writes it through its mapped device pointer,
``cudaHostGetDevicePointer``; memory the device cannot address is refused, never written), so
the host reads it with no copy launch, no event and no sync, and a CUDA graph that captured the
step keeps writing it at every replay; on a CPU, plain memory, written before the call returns.

It holds the device word as of the last step that has run: a later step, or
:meth:`LZESelector.raise_if_faulted <lze_kernels.LZESelector.raise_if_faulted>`, reads it. Whoever
clears it first waits for the steps still queued (they would write the old bits back).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes


class FaultWord:
    """A ``[1]`` int32 host word the kernels copy the fault word into (``tensor``), read here
    without touching the device; ``runtime`` (lze_kernels/runtime.py) provides its memory."""

    def __init__(self, runtime):
        # Real host memory even while a dispatch mode (FakeTensorMode) is active.
        with _disable_current_modes():
            self.tensor = runtime.pinned_word()
            try:  # a numpy view: reading it is a load from host memory (~0.1 us)
                self._word = self.tensor.numpy()
            except RuntimeError:  # torch without numpy: read through the tensor (~1 us)
                self._word = self.tensor

    def bits(self) -> int:
        """The fault bits of the last step that has run (0 while none has faulted)."""
        return int(self._word[0])

    def set(self, bits: int) -> None:
        """Only once no step is queued: one would write its own copy over it."""
        self._word[0] = bits

    def clear(self) -> None:
        self.set(0)

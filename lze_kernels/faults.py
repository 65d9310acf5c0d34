"""The fault word of a selector's steps, read without waiting for the device.

A step on a GPU records the faults of its bad rows (docs/spec.md §1) in a device word. Reading it
back right away would stall the host until the step has run (a host sync, some 100-300 us a step
on an H200). :class:`DeferredFaults` instead copies it to pinned host memory asynchronously after
each step and records an event; a later call checks whether the copy has arrived (the event's
query does not wait) and raises its bits then. On a CPU the copy is immediate.
"""

from __future__ import annotations

import torch


class DeferredFaults:
    """The host's copy of a device fault word, refreshed after every step without a sync."""

    def __init__(self, device: torch.device):
        on_gpu = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=on_gpu)
        self._arrived = torch.cuda.Event() if on_gpu else None

    def copy_after_step(self, fault: torch.Tensor) -> None:
        """Queue a copy of ``fault`` behind the step just launched (no wait)."""
        self._host.copy_(fault, non_blocking=True)
        if self._arrived is not None:
            self._arrived.record()

    def arrived_bits(self) -> int:
        """The fault bits of the last copy that has arrived; 0 while it is still in flight."""
        if self._arrived is not None and not self._arrived.query():
            return 0
        return int(self._host[0])  # host memory: no device read

    def clear(self) -> None:
        self._host.zero_()

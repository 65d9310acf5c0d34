"""A selector's step over a fixed ``(B, G)`` as a replayable CUDA graph
(``LZESelector.capture_step``), in the idiom of ``torch.cuda.CUDAGraph``: static input tensors
the caller copies each batch into, ``replay()``, and static outputs that the next replay
overwrites.

    step = sel.capture_step(rewards, prompt_ids, valid)   # a step on this first batch, then
    out = step.output                                     # the capture; its outputs
    for rewards, prompt_ids, valid in batches:
        step.rewards.copy_(rewards)
        step.prompt_ids.copy_(prompt_ids)
        step.valid.copy_(valid)
        out = step.replay()        # the same StepOutput object and tensors, new values

A replay is one graph launch: the step's two to five kernels with no host work between them
(docs/kernels.md, "Captured steps"). The default value check keeps working: the step kernel
copies the fault word into host-mapped memory at every replay, and ``replay()`` raises what an
earlier replay found before it launches, as ``LZESelector.step`` does (``check_inputs=True``
cannot be captured: it synchronises). Faults of steps before the capture are raised by
``capture_step`` itself, before it captures (a capture records its work without running it: a
fault word cleared inside it would stay set). The graph keeps its selector (its state, its
fault word's host memory, its workspace) alive as long as the graph lives, ``step.graph`` held
alone included. The emulated CUDA backend captures in the emulator's graphs. On a CPU there is
no graph: ``replay()`` runs the step on the static inputs and copies its outputs into the static
ones, so the same code runs anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


class CapturedStep:
    """``LZESelector.capture_step``'s result: ``rewards``, ``prompt_ids`` and ``valid`` (None
    when captured without one) are the static inputs, ``output`` the static ``StepOutput``."""

    def __init__(self, selector, rewards: torch.Tensor, prompt_ids: torch.Tensor,
                 valid: Optional[torch.Tensor], check_inputs: Optional[bool], sorted: bool):
        runtime = selector._runtime
        if check_inputs is True and runtime.supports_graphs:
            raise ValueError("check_inputs: expected None or False for a captured step (True "
                             "reads the fault word after the step: a host sync, which a CUDA "
                             "graph cannot hold), got True")
        self._selector = selector
        self._options = dict(check_inputs=check_inputs, sorted=sorted)
        self.rewards = rewards.clone()
        self.prompt_ids = prompt_ids.clone()
        self.valid = None if valid is None else valid.clone()
        self._graph = None
        if runtime.supports_graphs:
            selector.raise_if_faulted()  # earlier steps' faults: raised now, not in the capture
            first = self._warm_up()
            selector.raise_if_faulted()
            self._graph = runtime.new_graph()
            with runtime.capture(self._graph):
                self.output = self._run()
            self._graph._lze_selector = selector  # the graph writes its state and fault word
            self._copy_output(first)
        else:
            first = self._run()
            self.output = dataclasses.replace(first, **{
                f.name: getattr(first, f.name).clone() for f in dataclasses.fields(first)})

    @property
    def graph(self):
        """The captured ``torch.cuda.CUDAGraph`` (the emulator's graph on the emulated backend;
        None on a CPU)."""
        return self._graph

    def replay(self):
        """The step on the static inputs' current contents; returns ``output``. Raises the
        faults an earlier replay recorded (default check) before launching; a replay on
        another stream than the selector's steps raises ``ValueError``."""
        if self._graph is None:
            self._copy_output(self._run())
            return self.output
        selector = self._selector
        with selector._lock:
            selector._claim_stream()
            selector._raise_arrived_faults()
            self._graph.replay()
        return self.output

    def _run(self):
        return self._selector.step(self.rewards, self.prompt_ids, self.valid, **self._options)

    def _warm_up(self):
        """The first step; on a GPU on a side stream, as torch's CUDA graph warm-up asks: it
        also compiles and loads every kernel the capture will record (Triton's JIT)."""
        selector = self._selector
        if selector.device.type != "cuda":
            return self._run()
        side = torch.cuda.Stream(selector.device)
        side.wait_stream(torch.cuda.current_stream(selector.device))
        with torch.cuda.stream(side):
            selector.use_current_stream()
            first = self._run()
        selector.use_current_stream()  # the current stream, ordered after the side one
        return first

    def _copy_output(self, step_output) -> None:
        for field in dataclasses.fields(step_output):
            getattr(self.output, field.name).copy_(getattr(step_output, field.name))

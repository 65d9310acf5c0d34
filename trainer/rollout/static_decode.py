"""Decoding from a static KV cache with a fixed-shape step, one CUDA graph replay a token on a GPU.

transformers' ``generate`` launches every kernel of every decoded token from the host (152 a
token for a two-layer Qwen2 on an H200, 69 ms of GPU time inside 237 ms of host time for
128 x 64 tokens: launch-bound). Here the prompt is prefilled into a
:class:`transformers.StaticCache` eagerly, and every later token is one call of a step
whose tensors never move (the cache, the fed token, its position, the attention mask, the
outputs), so on a GPU the step is captured once as a CUDA graph and each token is one replay.
The step samples and computes the sampled token's log-prob itself (:func:`choose`), in the
logits' dtype: no float32 copy of the vocabulary per token.

The same step runs eagerly on a CPU (``capture=eager``), which is how it is tested: greedy tokens
and sampled tokens under the same seed equal ``generate``'s (tests/test_static_decode.py).

Shapes are bucketed (:func:`bucket_up`: sizes 2^k and 3 * 2^k) so a run captures a handful of
graphs: rows to the next bucket (extra rows repeat the first prompt and are dropped), cache
length (prompt width + new tokens) likewise, at least :data:`MIN_LENGTH`. One shape's cache and
graphs are kept between calls (a new shape frees the previous one: memory is sized per call).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

MIN_LENGTH = 64  # smallest cache length: SDPA's masked kernel wants lengths in multiples of 16
CHECK_EVERY = 16  # tokens between the host's checks that every row ended (each check syncs)
WARMUP_STEPS = 2  # eager steps before a capture (cuBLAS handles, SDPA's kernel choice)

Step = Callable[[], None]
Capture = Callable[[Step], Step]  # a step -> what runs it: itself, or a graph's replay


def bucket_up(n: int, minimum: int = 1) -> int:
    """The smallest 2^k or 3 * 2^k that is at least ``max(n, minimum)``."""
    n = max(n, minimum, 1)
    power = 1 << (n - 1).bit_length()  # the smallest power of two >= n
    three_quarters = 3 * power // 4
    return three_quarters if power >= 4 and three_quarters >= n else power


def bucket_down(n: int) -> int:
    """The largest 2^k or 3 * 2^k that is at most ``n`` (``n >= 1``)."""
    power = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    return 3 * power // 2 if power >= 2 and 3 * power // 2 <= n else power


@dataclass(frozen=True)
class DecodeShape:
    """What a captured step is specialised to: rows and cache length (both bucketed)."""

    rows: int
    length: int

    @staticmethod
    def of(rows: int, width: int, new_tokens: int) -> "DecodeShape":
        return DecodeShape(bucket_up(rows), bucket_up(width + new_tokens, MIN_LENGTH))


@dataclass(frozen=True)
class Sampling:
    """How a step picks the next token: temperature 0 is greedy (raw logits, top-p unused)."""

    temperature: float
    top_p: float

    @staticmethod
    def of(temperature: float, top_p: float) -> "Sampling":
        return Sampling(0.0, 1.0) if temperature <= 0 else Sampling(float(temperature),
                                                                    float(top_p))


def choose(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row ``[rows]`` and its float32 log-prob under the processed
    distribution (after temperature and top-p), from ``logits`` ``[rows, V]`` in their own dtype.

    The log-prob is ``log`` of the chosen token's softmax probability, gathered first: the
    softmax accumulates in float32 inside its kernel, so in bfloat16 it is within 2^-8 of the
    exact value of the rounded scores. A sampled token is ``torch.multinomial``'s own draw
    (the argmax of p / q with q ~ Exp(1), in p's dtype) without its validity check, which reads
    back to the host. Temperature divides the distance to the row's largest logit, which is
    exact in bfloat16 for the logits that matter (the tokens near the top)."""
    scores = logits
    if sampling.temperature > 0:
        if sampling.temperature != 1.0:
            scores = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
        if sampling.top_p < 1.0:
            from transformers import TopPLogitsWarper

            scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    probs = scores.softmax(dim=-1)
    if sampling.temperature > 0:
        token = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    else:
        token = scores.argmax(dim=-1)
    logprob = probs.gather(-1, token[:, None]).squeeze(-1).float().log()
    return token, logprob


class DecodeState:
    """The tensors of one shape that a step reads and writes in place: the KV cache, the token
    fed to the next step with its position and cache slot, the slots each row attends to, which
    rows ended, and the tokens and log-probs decoded so far."""

    def __init__(self, config, shape: DecodeShape, device: torch.device):
        from transformers import StaticCache

        rows, length = shape.rows, shape.length
        self.cache = StaticCache(config=config, max_cache_len=length)
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.visible = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, length, dtype=torch.float32, device=device)
        self.steps: dict[Sampling, Step] = {}  # captured (or eager) steps of this shape


class StaticDecoder:
    """Decodes left-padded prompts with a static cache (see the module docstring).

    ``capture`` turns an eager step into what runs it: :func:`eager` (CPU, or
    ``rollout.enforce_eager``) or :func:`cuda_graph`; ``check_every``: decoded tokens between
    checks that every row ended (1 on a CPU, where a check costs nothing)."""

    def __init__(self, model, eos_ids, pad_id: int, capture: Capture, check_every: int):
        self.model = model
        self.device = model.device
        self.eos = torch.tensor(sorted(eos_ids), device=self.device)
        self.pad_id = pad_id
        self.capture = capture
        self.check_every = check_every
        self.states: dict[DecodeShape, DecodeState] = {}
        self.captures = 0  # steps built (graphs, with cuda_graph)
        self.capture_failures = 0  # of them, steps that run eagerly: their capture failed
        self.capture_seconds = 0.0  # spent building them (prefill, warm-up, capture)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, attention: torch.Tensor, temperature: float,
               top_p: float, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host ``[rows, steps]`` tokens and log-probs for ``input_ids`` ``[rows, width]`` (left
        padded, ``attention`` 0 on the padding); ``steps <= new_tokens``: fewer when every row
        ended earlier (rows that ended carry ``pad_id``)."""
        rows, width = input_ids.shape
        shape = DecodeShape.of(rows, width, new_tokens)
        sampling = Sampling.of(temperature, top_p)
        state = self._state(shape)
        ids, mask = _pad_rows(input_ids, attention, shape.rows, self.device)
        step = self._step_of(state, sampling, ids, mask) if new_tokens > 1 else None
        self._prefill(state, sampling, ids, mask)
        decoded = 1
        while decoded < new_tokens and not (decoded % self.check_every == 0
                                            and bool(state.done[:rows].all())):
            step()
            decoded += 1
        return state.tokens[:rows, :decoded].cpu(), state.logprobs[:rows, :decoded].cpu()

    def _state(self, shape: DecodeShape) -> DecodeState:
        if shape not in self.states:
            self.states.clear()  # one shape's cache and graphs at a time
            self.states[shape] = DecodeState(self.model.config, shape, self.device)
        return self.states[shape]

    def _step_of(self, state: DecodeState, sampling: Sampling, ids: torch.Tensor,
                 mask: torch.Tensor) -> Step:
        """The shape's step for ``sampling``, built on first use: from a prefilled state (the
        warm-up steps decode from it), with the random generators restored afterwards so that
        building a step never changes what a seed samples."""
        if sampling not in state.steps:
            begin = time.perf_counter()
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                self._prefill(state, sampling, ids, mask)
                state.steps[sampling] = self._captured(lambda: self._step(state, sampling))
            self.captures += 1
            self.capture_seconds += time.perf_counter() - begin
        return state.steps[sampling]

    def _captured(self, step: Step) -> Step:
        """``capture(step)``, or the step itself where capturing fails, with a warning on the
        console: decoding goes on, at the host's pace (the next prefill resets what the attempt
        left in the state)."""
        try:
            return self.capture(step)
        except RuntimeError as error:
            self.capture_failures += 1
            warnings.warn(f"lze_trainer: hf engine: capturing the decode step failed, this shape "
                          f"decodes eagerly: {error}", RuntimeWarning, stacklevel=2)
            return step

    def _prefill(self, state: DecodeState, sampling: Sampling, ids: torch.Tensor,
                 mask: torch.Tensor) -> None:
        """The prompts into the cache (transformers makes the causal, padded mask) and the first
        token chosen from their last logits; position ids count the prompt's own tokens, as
        ``generate`` counts them."""
        width = ids.shape[1]
        state.cache.reset()
        state.visible.zero_()
        state.visible[:, :width] = mask.bool()
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            past_key_values=state.cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        state.position.copy_(positions[:, -1:])
        state.slot.fill_(width - 1)
        state.done.zero_()
        state.count.zero_()
        self._record(state, *choose(logits, sampling))

    def _step(self, state: DecodeState, sampling: Sampling) -> None:
        """One token for every row, in place on ``state``: no host reads, fixed shapes."""
        state.position += 1
        state.slot += 1
        state.visible.index_fill_(1, state.slot, True)
        logits = self.model(input_ids=state.token, position_ids=state.position,
                            attention_mask=state.visible[:, None, None, :],
                            past_key_values=state.cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        self._record(state, *choose(logits, sampling))

    def _record(self, state: DecodeState, token: torch.Tensor, logprob: torch.Tensor) -> None:
        """Keep the chosen tokens (``pad_id`` for rows that ended, as ``generate`` writes) and
        log-probs at the next output column, and feed the tokens to the next step."""
        token = torch.where(state.done, self.pad_id, token)
        state.tokens.index_copy_(1, state.count, token[:, None])
        state.logprobs.index_copy_(1, state.count, logprob[:, None])
        state.count += 1
        state.done |= torch.isin(token, self.eos)
        state.token.copy_(token[:, None])


def _pad_rows(input_ids: torch.Tensor, attention: torch.Tensor, rows: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention`` on ``device`` with ``rows`` rows: the extra rows repeat
    the first (a real prompt: no row is all padding), and their outputs are dropped."""
    extra = rows - input_ids.shape[0]
    if extra:
        input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
        attention = torch.cat([attention, attention[:1].expand(extra, -1)])
    return input_ids.to(device), attention.to(device)


def eager(step: Step) -> Step:
    """Run the step as it is (CPU, or ``rollout.enforce_eager``)."""
    return step


def cuda_graph(step: Step) -> Step:
    """Capture ``step`` as a CUDA graph after :data:`WARMUP_STEPS` eager runs on a side stream
    (torch's recipe); every call replays it. The state the warm-up leaves is reset by the next
    prefill. ``thread_local``: other threads' CUDA calls during the capture (NCCL's watchdog in
    the trainer's process group) do not invalidate it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay

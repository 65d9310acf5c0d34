"""Fallback engine: transformers on this rank's own copy of the policy.

Slower than vLLM (no paged attention or continuous batching) but needs nothing beyond
transformers; it receives weights through the same ``load_weights`` call as vLLM, so both engines
are interchangeable and tested against the actor alike. It decodes from a static KV cache with
each token one CUDA graph replay on a GPU (:mod:`.static_decode`, ``rollout.hf_static_cache``,
the default), or with ``generate`` (:mod:`.generate_decode`). Either way log-probs are those of
the processed distribution (after temperature and top-p), as vLLM's ``processed_logprobs``.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import torch

from . import grouped_attention
from .base import Completion, SamplingSpec, Specs, per_prompt, reseed
from .generate_decode import generate_decode
from .static_decode import (CHECK_EVERY, MIN_LENGTH, StaticDecoder, bucket_down, bucket_up,
                            cuda_graph, eager)

CPU_ROWS_PER_CALL = 64  # sequences per decoding call on a CPU: bounds the padded KV cache
# On a GPU one call's padded KV cache and scores may take this share of the free memory.
GPU_MEMORY_SHARE = 0.25


class HFEngine:
    def __init__(self, cfg, model_dir: str, world):
        from transformers import AutoModelForCausalLM, GenerationConfig

        on_gpu = world.device.type == "cuda"
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else (
            "bfloat16" if on_gpu else "float32")
        static = cfg.rollout.hf_static_cache
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), trust_remote_code=cfg.model.trust_remote_code,
            **({"attn_implementation": grouped_attention.register()} if static else {}),
        ).to(world.device).eval()
        self.device = world.device
        generation = GenerationConfig.from_model_config(self.model.config)
        eos = generation.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)
        self.decoder = None
        if static:
            require_static_decoding(self.model)
            graphs = on_gpu and not cfg.rollout.enforce_eager
            self.decoder = StaticDecoder(self.model, self.eos_ids, self.pad_id,
                                         capture=cuda_graph if graphs else eager,
                                         check_every=CHECK_EVERY if on_gpu else 1)
        self._reported_capture_seconds = 0.0

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], counts: Sequence[int], spec: Specs,
                 seed: int) -> list[list[Completion]]:
        specs = per_prompt(spec, len(prompts))
        rows = [i for i, n in enumerate(counts) for _ in range(n)]
        reseed(seed)
        completions: list[Completion] = []
        # one sampling per call: rows in runs of one spec, in order
        for run_spec, run in itertools.groupby(rows, key=lambda i: specs[i]):
            run = list(run)
            longest = max(len(prompts[i]) for i in run) + run_spec.max_new_tokens
            step = self._rows_per_call(longest)
            for start in range(0, len(run), step):
                chunk = [prompts[i] for i in run[start:start + step]]
                completions += self._generate_rows(chunk, run_spec)
        results: list[list[Completion]] = [[] for _ in prompts]
        for i, completion in zip(rows, completions):
            results[i].append(completion)
        return results

    def _rows_per_call(self, tokens: int) -> int:
        """Sequences per decoding call. On a GPU, decoding a small batch is bound by the
        per-token latency, so one call of 128 rows takes about what a call of 64 takes: as many
        rows as :data:`GPU_MEMORY_SHARE` of the free memory holds, rounded down to a row bucket
        (the first GPU check ran two 64-row calls where TRL ran one, docs/gpu-check.md). On a
        CPU, where time grows with the rows, :data:`CPU_ROWS_PER_CALL`."""
        if self.device.type != "cuda":
            return CPU_ROWS_PER_CALL
        free, _ = torch.cuda.mem_get_info(self.device)
        per_row = generate_bytes_per_row(self.model.config, self.model.dtype,
                                         bucket_up(tokens, MIN_LENGTH))
        return bucket_down(max(1, int(GPU_MEMORY_SHARE * free) // per_row))

    def _generate_rows(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        sampling = (spec.temperature, spec.top_p, spec.max_new_tokens)
        if self.decoder is not None:
            tokens, logprobs = self.decoder.decode(input_ids, attention, *sampling)
        else:
            tokens, logprobs = generate_decode(self.model, input_ids, attention, *sampling,
                                               self.pad_id, sorted(self.eos_ids))
        return [self._cut(tokens[row].tolist(), logprobs[row].tolist())
                for row in range(len(prompts))]

    def _cut(self, tokens: list[int], logprobs: list[float]) -> Completion:
        """The response up to and including its first end-of-sequence token."""
        for position, token in enumerate(tokens):
            if token in self.eos_ids:
                return Completion(tokens[:position + 1], logprobs[:position + 1], truncated=False)
        return Completion(tokens, logprobs, truncated=True)

    def take_compile_seconds(self) -> float:
        """Seconds spent capturing decode steps since the last call (the first steps of a run
        and new shapes; counted inside their rollout time)."""
        total = self.decoder.capture_seconds if self.decoder is not None else 0.0
        seconds, self._reported_capture_seconds = total - self._reported_capture_seconds, total
        return seconds

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In place: the captured steps keep reading the same parameter tensors."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def require_static_decoding(model) -> None:
    """Stop, saying what to do, for a model the static-cache decoder does not serve: one with
    sliding-window layers (their cache and masks are not the full ones it builds) or whose
    forward cannot return the last position's logits alone."""
    import inspect

    layers = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    reasons = []
    if any(t != "full_attention" for t in layers):
        reasons.append(f"sliding-window layers ({sorted(set(layers))})")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        reasons.append("no logits_to_keep argument in its forward")
    if reasons:
        raise ValueError(f"rollout.hf_static_cache: {type(model).__name__} has "
                         f"{' and '.join(reasons)}; set rollout.hf_static_cache=false to decode "
                         "with transformers generate")


def generate_bytes_per_row(config, dtype: torch.dtype, tokens: int) -> int:
    """Device bytes one sequence of ``tokens`` (prompt and response) holds while it decodes:
    its padded KV cache (keys and values of every layer, ``2 x layers x KV heads x head dim``
    elements a token) and three float32 rows of scores (``generate``'s logits, processed scores
    and the recorder's copy of the previous step; a bound on the static decoder's logits,
    probabilities and draws in the logits' dtype)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * tokens * dtype.itemsize
    return kv + 3 * config.vocab_size * 4

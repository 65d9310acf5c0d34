"""Fallback engine: transformers ``generate`` on this rank's own copy of the policy.

Slower than vLLM (no paged attention or continuous batching) but needs nothing beyond
transformers; it receives weights through the same ``load_weights`` call as vLLM, so both engines
are interchangeable and tested against the actor alike. Log-probs are taken from the processed
scores (after temperature and top-p), the same distribution vLLM's ``processed_logprobs`` gives,
by :class:`SampledLogProbs` at each step: nothing keeps every step's scores
(``output_scores=True`` would hold steps x rows x V x 4 bytes, 120 GB at 3072 x 64 x 151,936).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import torch

from .base import Completion, SamplingSpec, Specs, per_prompt, reseed

CPU_ROWS_PER_CALL = 64  # sequences per generate() call on a CPU: bounds the padded KV cache
# On a GPU one call's padded KV cache and scores may take this share of the free memory.
GPU_MEMORY_SHARE = 0.25


class HFEngine:
    def __init__(self, cfg, model_dir: str, world):
        from transformers import AutoModelForCausalLM, GenerationConfig

        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else (
            "bfloat16" if world.device.type == "cuda" else "float32")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), trust_remote_code=cfg.model.trust_remote_code,
        ).to(world.device).eval()
        self.device = world.device
        generation = GenerationConfig.from_model_config(self.model.config)
        eos = generation.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], counts: Sequence[int], spec: Specs,
                 seed: int) -> list[list[Completion]]:
        specs = per_prompt(spec, len(prompts))
        rows = [i for i, n in enumerate(counts) for _ in range(n)]
        reseed(seed)
        completions: list[Completion] = []
        # transformers samples one way per call: rows in runs of one spec, in order
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
        """Sequences per ``generate`` call. On a GPU, decoding a small batch is bound by the
        per-token latency, so one call of 128 rows takes about what a call of 64 takes: as many
        rows as :data:`GPU_MEMORY_SHARE` of the free memory holds (the first GPU check ran two
        64-row calls where TRL ran one, docs/gpu-check.md). On a CPU, where time grows with the
        rows, :data:`CPU_ROWS_PER_CALL`."""
        if self.device.type != "cuda":
            return CPU_ROWS_PER_CALL
        free, _ = torch.cuda.mem_get_info(self.device)
        per_row = generate_bytes_per_row(self.model.config, self.model.dtype, tokens)
        return max(1, int(GPU_MEMORY_SHARE * free) // per_row)

    def _generate_rows(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        sampled = spec.temperature > 0
        recorder = SampledLogProbs()
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            do_sample=sampled, temperature=1.0 if sampled else None,
            top_p=1.0 if sampled else None, top_k=0 if sampled else None,
            logits_processor=_warpers(spec) + [recorder],
            max_new_tokens=spec.max_new_tokens, return_dict_in_generate=True,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
        )
        tokens = out.sequences[:, width:]
        chosen = recorder.finish(tokens).cpu()
        tokens = tokens.cpu()
        return [self._cut(tokens[row].tolist(), chosen[row].tolist()) for row in range(len(prompts))]

    def _cut(self, tokens: list[int], logprobs: list[float]) -> Completion:
        """The response up to and including its first end-of-sequence token."""
        for position, token in enumerate(tokens):
            if token in self.eos_ids:
                return Completion(tokens[:position + 1], logprobs[:position + 1], truncated=False)
        return Completion(tokens, logprobs, truncated=True)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def generate_bytes_per_row(config, dtype: torch.dtype, tokens: int) -> int:
    """Device bytes one sequence of ``tokens`` (prompt and response) holds during ``generate``:
    its padded KV cache (keys and values of every layer, ``2 x layers x KV heads x head dim``
    elements a token) and three float32 rows of scores (the logits, the processed scores and the
    recorder's copy of the previous step)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * tokens * dtype.itemsize
    return kv + 3 * config.vocab_size * 4


def _warpers(spec: SamplingSpec) -> list:
    """Temperature and top-p as our own processors: ``generate`` appends its own warpers after
    the processors it is given, so the recorder must come after these for the processed scores.
    ``generate`` gets temperature 1, top-p 1 and top-k 0 (none of its own; a checkpoint's
    generation config would otherwise add its defaults)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    if spec.temperature <= 0:  # greedy: the raw distribution, as before
        return []
    warpers = [TemperatureLogitsWarper(spec.temperature)]
    if spec.top_p < 1.0:
        warpers.append(TopPLogitsWarper(spec.top_p))
    return warpers


class SampledLogProbs:
    """A logits processor, last in the list, that keeps the sampled tokens' log-probs under the
    processed scores and nothing else: at step k+1 the token drawn at step k is the last of
    ``input_ids``, so it gathers ``log_softmax(scores_k)[token]`` from the one step of scores it
    holds. Memory: one step's scores (rows x V x 4 bytes, 39 MB at 64 x 151,936) and rows x steps
    float32 log-probs."""

    def __init__(self):
        self.previous: torch.Tensor | None = None  # the last step's processed scores [rows, V]
        self.logprobs: list[torch.Tensor] = []  # [rows] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self._take(input_ids[:, -1])
        self.previous = scores
        return scores

    def _take(self, token: torch.Tensor) -> None:
        chosen = self.previous.gather(-1, token[:, None]).squeeze(-1)
        self.logprobs.append(chosen.float() - torch.logsumexp(self.previous.float(), dim=-1))
        self.previous = None

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs of ``generated`` [rows, steps] (the tokens after the prompt)."""
        self._take(generated[:, -1])
        return torch.stack(self.logprobs, dim=1)

"""Fallback engine: transformers ``generate`` on this rank's own copy of the policy.

Slower than vLLM (no paged attention or continuous batching) but needs nothing beyond
transformers; it receives weights through the same ``load_weights`` call as vLLM, so both engines
are interchangeable and tested against the actor alike. Log-probs are taken from the processed
scores (after temperature and top-p), the same distribution vLLM's ``processed_logprobs`` gives.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .base import Completion, SamplingSpec, reseed

_ROWS_PER_CALL = 64  # sequences per generate() call: bounds the padded KV cache


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
    def generate(self, prompts: Sequence[list[int]], counts: Sequence[int], spec: SamplingSpec,
                 seed: int) -> list[list[Completion]]:
        rows = [i for i, n in enumerate(counts) for _ in range(n)]
        reseed(seed)
        completions: list[Completion] = []
        for start in range(0, len(rows), _ROWS_PER_CALL):
            chunk = [prompts[i] for i in rows[start:start + _ROWS_PER_CALL]]
            completions += self._generate_rows(chunk, spec)
        results: list[list[Completion]] = [[] for _ in prompts]
        for i, completion in zip(rows, completions):
            results[i].append(completion)
        return results

    def _generate_rows(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        sampled = spec.temperature > 0
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            do_sample=sampled, temperature=spec.temperature if sampled else None,
            top_p=spec.top_p if sampled else None, top_k=0 if sampled else None,
            max_new_tokens=spec.max_new_tokens, output_scores=True, return_dict_in_generate=True,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
        )
        tokens = out.sequences[:, width:].cpu()
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        chosen = logprobs.gather(-1, tokens[:, :logprobs.shape[1]].unsqueeze(-1).to(
            logprobs.device)).squeeze(-1).cpu()
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

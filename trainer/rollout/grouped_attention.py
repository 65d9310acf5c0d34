"""Grouped-query attention for one decoded token without copying the KV cache per query head.

transformers' ``sdpa`` attention repeats every KV head for its query heads (``repeat_kv``) before
calling SDPA whenever there is an attention mask on CUDA, since SDPA's masked kernels have no
grouped-query mode. Decoding from a padded static cache always has a mask, so each step would
copy the whole cache, ``heads / kv_heads`` times over (7x for Qwen2.5-0.5B's 14 / 2 heads). With
one query token the query heads that share a KV head are just several queries against the same
keys under the same mask: :func:`grouped_decode_attention` reshapes them that way, so SDPA reads
each KV head once. Everything else (the prefill, models without grouped heads) is transformers'
own ``sdpa`` attention, and the masks are its ``sdpa`` masks.
"""

from __future__ import annotations

import torch

NAME = "lze_grouped_decode_sdpa"  # the attention implementation a model is loaded with


def register() -> str:
    """Register :data:`NAME` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, grouped_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """``[rows, 1, heads, head_dim]`` attention output (and no weights), as transformers'
    attention functions return it, for ``query`` ``[rows, heads, q, head_dim]`` and ``key`` /
    ``value`` ``[rows, kv_heads, kv, head_dim]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows, heads, _, head_dim = query.shape
    # Query head h reads KV head h // groups (repeat_kv's order).
    grouped = query.reshape(rows, heads // groups, groups, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(rows, 1, heads, head_dim), None

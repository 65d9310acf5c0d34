"""DOTS pass-rate prediction (docs/spec.md §8) over N prompts and K = 256 references, d = 384.

Variants: ``fused`` (``ops.predict_pass_rates``, backend ``auto``: the C++ kernel on a CPU,
Triton on a GPU), ``torch_reference`` (the chunked reference, ``backend="torch"``), ``naive``
(``softmax(Q R^T * scale) @ y`` with the whole ``[N, K]`` matrix) and ``floor`` (a copy of the
query embeddings). The floor of a one-pass kernel is the time to read the queries once,
``N d 4`` bytes at the copy's bandwidth (a copy moves twice that), recorded as
``extra_info["memory_floor_s"]``; the score products (``2 N K d`` flops) are recorded as
``extra_info["gflop"]``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lze_kernels import ops

K, DIM = 256, 384
SIZES = (10_000, 100_000)
VARIANTS = ("fused", "torch_reference", "naive", "floor")


def _inputs(n: int, device):
    gen = torch.Generator().manual_seed(n)
    q = torch.nn.functional.normalize(torch.randn(n, DIM, generator=gen), dim=1)
    r = torch.nn.functional.normalize(torch.randn(K, DIM, generator=gen), dim=1)
    return q.to(device), r.to(device), torch.rand(K, generator=gen).to(device)


def _naive(q, r, y):
    return torch.softmax((q @ r.T) / math.sqrt(DIM), dim=1) @ y


def _variant(name):
    return {
        "fused": lambda q, r, y: ops.predict_pass_rates(q, r, y),
        "torch_reference": lambda q, r, y: ops.predict_pass_rates(q, r, y, backend="torch"),
        "naive": _naive,
        "floor": lambda q, r, y: q.clone(),
    }[name]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"N{n}")
def test_dots_predict(benchmark, device, n, variant):
    q, r, y = _inputs(n, device)
    fn = _variant(variant)

    def call():
        out = fn(q, r, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    call()  # warm-up (thread pool, Triton compile)
    benchmark.extra_info.update(n=n, k=K, d=DIM, gflop=2 * n * K * DIM / 1e9,
                                query_bytes=q.numel() * q.element_size())
    out = benchmark.pedantic(call, rounds=3 if n >= 100_000 else 5, iterations=1)
    if variant == "floor":
        benchmark.extra_info["memory_floor_s"] = benchmark.stats.stats.min / 2
    else:
        torch.testing.assert_close(out, _naive(q, r, y), rtol=1e-4, atol=1e-5)

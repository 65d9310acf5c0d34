"""DOTS pass-rate prediction as one Triton launch (docs/spec.md §8; ``reference.predict_pass_rates_reference``).

``p_hat_q = sum_j softmax_j(s_qj) y_j`` with ``s_qj = <z_q, z_j> * scale``, FlashAttention's
forward pass (Dao et al. 2022) with a value of width one: program ``t`` owns queries
``[t BLOCK_N, (t+1) BLOCK_N)`` and sweeps the K references in blocks of ``BLOCK_K``. Per block it
forms the ``[BLOCK_N, BLOCK_K]`` score tile with ``tl.dot`` over d in chunks of ``BLOCK_D``,
then folds it into a running max ``m``, normaliser ``l`` and weighted sum ``acc`` (online
softmax, Milakov & Gimelshein 2018):

    m' = max(m, max_j s_j),  l' = l e^(m - m') + sum_j e^(s_j - m'),
    acc' = acc e^(m - m') + sum_j e^(s_j - m') y_j,   p_hat = acc / l.

Every exponent is <= 0, so scores of any size (|s| ~ 1e4) neither overflow nor give NaN; no
``[N, K]`` matrix exists anywhere. Grid: ``cdiv(N, BLOCK_N)`` programs; work ``2 N K d`` flops,
the queries are read once from DRAM (each program re-reads its own tile per reference block from
L1/L2). Masked reference columns score ``-inf`` and weigh 0; K >= 1 makes the first block's max
finite. fp32 embeddings use ``tf32x3`` dot products on a GPU (three TF32 tensor-core products,
about fp32 accuracy); bf16/fp16 ones their native tensor-core products, accumulated in fp32.

Tiles: GPU ``[64 queries, 64 refs, 16 dims]``, 8 warps: no spills on sm_80 and sm_90 under
Triton 3.7.1 (fp32 with tf32x3: 177 / 130 registers; bf16/fp16: 104 / 64); 32 dims per chunk
spilled on sm_80. The interpreter, which pays per operation, takes one tile as large as the problem
allows: up to 1024 queries, 256 references and 512 dimensions (every side at least 16, the
minimum of ``tl.dot``). ``UPCAST`` converts bf16 tiles to fp32 before the dot product in the
interpreter only: Triton 3.7's interpreted ``tl.dot`` multiplies bf16 tiles as raw bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig, interpreting

GPU_BLOCK_N, GPU_BLOCK_K, GPU_BLOCK_D = 64, 64, 16
INTERPRETER_MAX_N, INTERPRETER_MAX_K, INTERPRETER_MAX_D = 1024, 256, 512
MIN_BLOCK = 16  # tl.dot's smallest tile side
NUM_WARPS = 8
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
# fp32: three TF32 products (~fp32 accuracy); halves: ignored (their native tensor-core path).
_DOT_PRECISION = {torch.float32: "tf32x3", torch.bfloat16: "ieee", torch.float16: "ieee"}


@triton.jit
def _score_tile(q_ptr, r_ptr, rows, refs, row_ok, ref_ok, dim,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` fp32 dot products of the query rows with the reference rows."""
    s = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    q_rows = rows.to(tl.int64)[:, None] * dim
    r_rows = refs.to(tl.int64)[:, None] * dim
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = (cols < dim)[None, :]
        q = tl.load(q_ptr + q_rows + cols[None, :], mask=row_ok[:, None] & col_ok, other=0.0)
        r = tl.load(r_ptr + r_rows + cols[None, :], mask=ref_ok[:, None] & col_ok, other=0.0)
        if UPCAST:
            q, r = q.to(tl.float32), r.to(tl.float32)
        s = tl.dot(q, tl.trans(r), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _dots_predict_kernel(
    q_ptr, r_ptr, y_ptr, out_ptr, n_queries, n_refs, dim, scale,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_queries
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_N,), tl.float32)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, n_refs, BLOCK_K):
        refs = k0 + tl.arange(0, BLOCK_K)
        ref_ok = refs < n_refs
        s = _score_tile(q_ptr, r_ptr, rows, refs, row_ok, ref_ok, dim,
                        BLOCK_N, BLOCK_K, BLOCK_D, DOT_PRECISION, UPCAST)
        s = tl.where(ref_ok[None, :], s * scale, float("-inf"))
        y = tl.load(y_ptr + refs, mask=ref_ok, other=0.0)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        rescale = tl.exp(m - m_new)
        w = tl.exp(s - m_new[:, None])
        l = l * rescale + tl.sum(w, axis=1)
        acc = acc * rescale + tl.sum(w * y[None, :], axis=1)
        m = m_new
    tl.store(out_ptr + rows, tl.div_rn(acc, l), mask=row_ok)


def block_shape(n_queries: int, n_refs: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, BLOCK_D) of a launch: fixed on a GPU, problem-sized in the
    interpreter."""
    if not interpreting():
        return GPU_BLOCK_N, GPU_BLOCK_K, GPU_BLOCK_D

    def side(size, cap):
        return max(MIN_BLOCK, min(cap, triton.next_power_of_2(max(size, 1))))

    return (side(n_queries, INTERPRETER_MAX_N), side(n_refs, INTERPRETER_MAX_K),
            side(dim, INTERPRETER_MAX_D))


def predict_pass_rates(query_emb, ref_emb, ref_pass, scale: float) -> torch.Tensor:
    """One launch of :func:`lze_kernels.reference.predict_pass_rates_reference`."""
    query_emb, ref_emb = query_emb.contiguous(), ref_emb.contiguous()
    n_queries, dim = query_emb.shape
    n_refs = ref_emb.shape[0]
    out = torch.empty(n_queries, dtype=torch.float32, device=query_emb.device)
    if n_queries == 0:
        return out
    block_n, block_k, block_d = block_shape(n_queries, n_refs, dim)
    _dots_predict_kernel[(triton.cdiv(n_queries, block_n),)](
        query_emb, ref_emb, ref_pass.float().contiguous(), out, n_queries, n_refs, dim,
        float(scale), BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=block_d,
        DOT_PRECISION=_DOT_PRECISION[query_emb.dtype],
        UPCAST=interpreting() and query_emb.dtype == torch.bfloat16, num_warps=NUM_WARPS,
    )
    return out


def aot_configs():
    """Every variant :func:`predict_pass_rates` launches on a GPU: one per embedding dtype."""
    for dtype, pointer in _POINTER_TYPES.items():
        types = {"q_ptr": pointer, "r_ptr": pointer, "y_ptr": "*fp32", "out_ptr": "*fp32",
                 "n_queries": "i32", "n_refs": "i32", "dim": "i32", "scale": "fp32"}
        yield LaunchConfig(
            name=f"dots_predict[{pointer[1:]}]", fn=_dots_predict_kernel,
            signature={arg: types.get(arg, "constexpr")
                       for arg in _dots_predict_kernel.arg_names},
            constexprs={"BLOCK_N": GPU_BLOCK_N, "BLOCK_K": GPU_BLOCK_K, "BLOCK_D": GPU_BLOCK_D,
                        "DOT_PRECISION": _DOT_PRECISION[dtype], "UPCAST": False},
            num_warps=NUM_WARPS, options={})

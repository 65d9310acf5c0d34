"""Fixed-shape top-k selection as one Triton launch (docs/spec.md §4; ``reference.topk_select``).

Launch math: rank by counting. Row ``i`` is a candidate when ``E_i > 0``; its rank is
``#{candidate j : s_j > s_i or (s_j == s_i and j < i)}`` (descending score, ties to the smaller
position, a strict total order, so candidate ranks are exactly 0..C-1). The grid is
``max(1, cdiv(B, BLOCK_I))`` programs; program ``t`` ranks rows ``[t BLOCK_I, (t+1) BLOCK_I)``
by sweeping all B rows in chunks of ``BLOCK_J``, one ``[BLOCK_I, BLOCK_J]`` compare tile per
chunk, and writes ``kept_indices[rank_i] = i`` for ``rank_i < k``. Total work is ``B^2``
compares in ``cdiv(B, BLOCK_I) * cdiv(B, BLOCK_J) = O(B^2 / (BLOCK_I BLOCK_J))`` tile steps;
each program takes ``cdiv(B, BLOCK_J)`` of them, so with enough SMs the latency is
``O(B / BLOCK_J)`` steps. With noise every program also recomputes the noise of every chunk
(``B^2 / BLOCK_I`` Philox draws in all) and first reduces max/min E over all B rows (the Gumbel
scale needs them before any score exists). Tiles: ``[16, 256]`` with 8 warps on a GPU (16
compares per thread and step; at most 128 registers and no spills on sm_80/sm_90 under Triton
3.7.1 and 3.9.0); in the interpreter, which pays per operation, ``[min(512, B'), min(1024, B')]``
with ``B' = next_pow2(B)``.

Why not a radix select: a multi-block radix select needs dependent histogram passes (the digit
of pass t+1 depends on the prefix sums of pass t over the whole grid), i.e. a grid-wide sync
per pass, which one launch cannot have without spin-waiting; a single-program select would
leave the GPU idle for large B. Counting ranks is embarrassingly parallel and also yields the
exact position of each kept row, which ``kept_indices`` (descending score order) requires.
No atomics: every output element has exactly one writer, so the result is deterministic.

Noise: ``u = ((bits >> 9) + 0.5) 2^-23`` with ``bits = tl.randint(seed64, row)``,
``seed64 = (step << 32) | seed``, so Philox key = (seed, step) as in
``reference.philox_4x32_10``; ``step = step_counter[0]`` is read in the kernel (no host sync).
The bits match the reference exactly; the two logs run in float64 and round once to fp32, as
in ``lze_math.h``, so the noise agrees with every backend's libm (fp32 logs differ by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import Selection
from ._launch import LaunchConfig, interpreting

GPU_BLOCK_I, GPU_BLOCK_J = 16, 256
INTERPRETER_BLOCK_I, INTERPRETER_BLOCK_J = 512, 1024
NUM_WARPS = 8
_TWO_POW_MINUS_23 = tl.constexpr(1.1920928955078125e-07)


@triton.jit
def _candidate_spread(energy_ptr, num_rows, BLOCK_J: tl.constexpr):
    """max E - min E over the candidates (E > 0); -inf when there is none."""
    high = tl.full((BLOCK_J,), float("-inf"), tl.float32)
    low = tl.full((BLOCK_J,), float("inf"), tl.float32)
    for start in range(0, num_rows, BLOCK_J):
        rows = start + tl.arange(0, BLOCK_J)
        e = tl.load(energy_ptr + rows, mask=rows < num_rows, other=0.0)
        high = tl.maximum(high, tl.where(e > 0, e, float("-inf")))
        low = tl.minimum(low, tl.where(e > 0, e, float("inf")))
    return tl.max(high, axis=0) - tl.min(low, axis=0)


@triton.jit
def _standard_gumbel(seed64, rows):
    """``-log(-log u)`` with ``u`` in (0, 1) from the top 23 Philox bits (``lze_math.h``)."""
    bits = tl.randint(seed64, rows)
    u = ((bits >> 9).to(tl.float32) + 0.5) * _TWO_POW_MINUS_23
    return (-tl.log(-tl.log(u.to(tl.float64)))).to(tl.float32)


@triton.jit
def _load_scores(energy_ptr, rows, num_rows, gumbel_scale, seed64, HAS_NOISE: tl.constexpr):
    """(score, is_candidate) of ``rows``; rows past the batch are not candidates."""
    e = tl.load(energy_ptr + rows, mask=rows < num_rows, other=0.0)
    score = e
    if HAS_NOISE:
        score = e + gumbel_scale * _standard_gumbel(seed64, rows)
    return score, e > 0


# `seed` is a runtime scalar: the JIT would compile a seed of 1 as the constant 1 (a Python int,
# with no `.to`), and a new kernel for it; every other seed shares one compiled kernel.
@triton.jit(do_not_specialize=["seed"])
def _topk_kernel(
    energy_ptr, keep_mask_ptr, kept_indices_ptr, num_kept_ptr, step_counter_ptr,
    num_rows, k, noise_scale, seed,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, HAS_NOISE: tl.constexpr,
):
    gumbel_scale = 0.0
    seed64 = 0
    if HAS_NOISE:
        gumbel_scale = noise_scale * tl.maximum(_candidate_spread(energy_ptr, num_rows, BLOCK_J),
                                                0.01)
        # `seed` arrives as a signed 32-bit int: keep its 32 bits, below the step.
        seed64 = (tl.load(step_counter_ptr) << 32) | (seed.to(tl.int64) & 0xFFFFFFFF)

    rows_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    score_i, candidate_i = _load_scores(energy_ptr, rows_i, num_rows, gumbel_scale, seed64,
                                        HAS_NOISE)
    rank = tl.zeros((BLOCK_I,), tl.int32)
    num_candidates = 0
    for start in range(0, num_rows, BLOCK_J):
        rows_j = start + tl.arange(0, BLOCK_J)
        score_j, candidate_j = _load_scores(energy_ptr, rows_j, num_rows, gumbel_scale, seed64,
                                            HAS_NOISE)
        ahead = (score_j[None, :] > score_i[:, None]) | (
            (score_j[None, :] == score_i[:, None]) & (rows_j[None, :] < rows_i[:, None]))
        rank += tl.sum((ahead & candidate_j[None, :]).to(tl.int32), axis=1)
        num_candidates += tl.sum(candidate_j.to(tl.int32), axis=0)

    kept = candidate_i & (rank < k)
    tl.store(keep_mask_ptr + rows_i, kept.to(tl.uint8), mask=rows_i < num_rows)
    tl.store(kept_indices_ptr + rank, rows_i.to(tl.int64), mask=kept)
    if tl.program_id(0) == 0:
        _write_quota_tail(kept_indices_ptr, num_kept_ptr, tl.minimum(num_candidates, k), k,
                          BLOCK_I)


@triton.jit
def _write_quota_tail(kept_indices_ptr, num_kept_ptr, num_kept, k, BLOCK: tl.constexpr):
    """``num_kept`` and the -1 padding of ``kept_indices[num_kept:k]``."""
    tl.store(num_kept_ptr, num_kept.to(tl.int64))
    for start in range(0, k, BLOCK):
        positions = start + tl.arange(0, BLOCK)
        tl.store(kept_indices_ptr + positions, tl.full((BLOCK,), -1, tl.int64),
                 mask=(positions >= num_kept) & (positions < k))


def block_shape(num_rows: int) -> tuple[int, int]:
    """(BLOCK_I, BLOCK_J) of the top-k kernel for a batch of ``num_rows``."""
    if not interpreting():
        return GPU_BLOCK_I, GPU_BLOCK_J
    rows = triton.next_power_of_2(max(num_rows, 1))
    return min(INTERPRETER_BLOCK_I, rows), min(INTERPRETER_BLOCK_J, rows)


def as_int32_bits(seed: int) -> int:
    """The 32-bit seed as a signed int32 value, so the kernel signature never changes with it."""
    seed &= 0xFFFFFFFF
    return seed - (1 << 32) if seed >= (1 << 31) else seed


def topk(energy, k: int, noise_scale: float, seed: int, step_counter) -> Selection:
    """One launch of :func:`lze_kernels.reference.topk_select` with ``step = step_counter[0]``."""
    energy = energy.to(torch.float32).contiguous()
    num_rows = energy.shape[0]
    device = energy.device
    keep_mask = torch.empty(num_rows, dtype=torch.bool, device=device)
    kept_indices = torch.empty(k, dtype=torch.int64, device=device)
    num_kept = torch.empty((), dtype=torch.int64, device=device)
    block_i, block_j = block_shape(num_rows)
    grid = (max(1, triton.cdiv(num_rows, block_i)),)
    _topk_kernel[grid](
        energy, keep_mask.view(torch.uint8), kept_indices, num_kept, step_counter,
        num_rows, k, float(noise_scale), as_int32_bits(seed),
        BLOCK_I=block_i, BLOCK_J=block_j, HAS_NOISE=noise_scale > 0,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
    return Selection(keep_mask, kept_indices, num_kept)


_ARG_TYPES = {
    "energy_ptr": "*fp32", "keep_mask_ptr": "*u8", "kept_indices_ptr": "*i64",
    "num_kept_ptr": "*i64", "step_counter_ptr": "*i64",
    "num_rows": "i32", "k": "i32", "noise_scale": "fp32", "seed": "i32",
}


def aot_configs():
    """Every variant :func:`topk` can launch on a GPU: with and without exploration noise."""
    for has_noise in (False, True):
        yield LaunchConfig(
            name=f"topk[{'noise' if has_noise else 'no_noise'}]",
            fn=_topk_kernel,
            signature={arg: _ARG_TYPES.get(arg, "constexpr") for arg in _topk_kernel.arg_names},
            constexprs={"BLOCK_I": GPU_BLOCK_I, "BLOCK_J": GPU_BLOCK_J, "HAS_NOISE": has_noise},
            num_warps=NUM_WARPS)

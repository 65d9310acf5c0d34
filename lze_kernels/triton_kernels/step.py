"""The fused LZE step as one Triton launch (docs/spec.md §2, §3, §5; semantics of ``reference.lze_step``).

Launch math: the batch is cut into tiles of ``BLOCK_ROWS`` rows x ``BLOCK_G`` rollouts, with
``BLOCK_G = next_pow2(G)``; the grid is ``max(1, cdiv(B, BLOCK_ROWS))`` programs (at least one,
so the step counter advances even for an empty batch). Each program reads its rewards once and
gathers/scatters one 16-byte state row per table and row: O(B G) work in one pass.
``BLOCK_ROWS`` depends on where the kernel runs (:func:`tile_shape`):

* GPU: ``min(256, 2048 // BLOCK_G)`` rows (at least 1), 8 warps: at most 8 rewards and one
  row's state per thread. ptxas then spills nothing for any ``BLOCK_G`` up to 4096, on sm_80
  and sm_90, under Triton 3.7.1 (torch 2.13's pin) and 3.9.0, with at most 164 registers (see
  ``benchmarks/results/triton_resources_*.json``). The advantages are divided right after the
  group statistics and stored before the state update: each IEEE division (``div_rn``) has a
  slow path that ptxas calls as a subroutine, and every value live across those calls must sit
  in a preserved register or be spilled; divided after the state update, with its values
  live, 3.7.1's PTX spilled on sm_80.
* Interpreter: one big tile of ``65536 // BLOCK_G`` rows, capped at ``next_pow2(B)``: it pays
  per tensor operation, not per element.

Every row's state update is independent of the others except for duplicate ids, which are
resolved by an atomic claim: each claimable row does ``atomic_max(records[id, 4 + CLAIM], stamp)``
with ``stamp = step + 1``; the first claimant of an id sees an older stamp and owns the row, any
later one sees ``stamp`` and is faulted as a duplicate. In the (sequential) interpreter the first
claimant is the smallest batch position, exactly as in the reference; on a GPU it is whichever
program gets there first (still exactly one owner per id).

A prompt's state is one 32-byte record (``layout.py``), read as its float half and its int half
(two 16-byte loads of one sector) through two typed pointers into the same table.

The step counter advances without a grid-wide barrier: every program reads ``step_counter[0]``
up front, then takes a ticket from ``step_counter[1]``; the program drawing the last ticket knows
all others have read the counter and writes ``step + 1``, resets the ticket counter to 0 and,
given a fault mirror (a selection step's host-mapped word, ``faults.FaultWord``), copies the
fault word into it: the host reads the faults without a copy launch or an event.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout as L
from ..layout import KernelParams, SelectorState
from ..reference import StepStats
from ._launch import LaunchConfig, interpreting
from ._tiles import pack4, unpack4

GPU_TILE_ELEMENTS = 2048
GPU_MAX_ROWS = 256
INTERPRETER_TILE_ELEMENTS = 65536
NUM_WARPS = 8
# Largest group the single-tile row reduction supports (BLOCK_G = G rounded up to a power of 2).
MAX_GROUP_SIZE = 4096
# Kernels may only read globals that are constexpr: the layout constants, re-exported as such.
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_FAULT_ID = tl.constexpr(L.FAULT_ID_OUT_OF_RANGE)
_FAULT_DUPLICATE = tl.constexpr(L.FAULT_DUPLICATE_ID)
_FAULT_NONFINITE = tl.constexpr(L.FAULT_NONFINITE_REWARD)
_FAULT_OUTSIDE = tl.constexpr(L.FAULT_REWARD_OUT_OF_RANGE)
_FLAG_PRUNED = tl.constexpr(L.FLAG_PRUNED)
_SOLVED_THRESHOLD = tl.constexpr(L.SOLVED_THRESHOLD)
_NUM_FIELDS = tl.constexpr(L.NUM_FIELDS)
_RECORD_WORDS = tl.constexpr(L.RECORD_WORDS)
_CLAIM = tl.constexpr(L.CLAIM)


@triton.jit
def _group_stats(r, valid):
    """Count, mean, unbiased std and centred rewards of each row, in the reference's op order."""
    count = tl.sum(valid.to(tl.int32), axis=1)
    count_f = count.to(tl.float32)
    total = tl.sum(tl.where(valid, r, 0.0), axis=1)
    # div_rn / sqrt_rn: IEEE-rounded on a GPU too (plain `/` and tl.sqrt are approximate there).
    mean = tl.where(count > 0, tl.div_rn(total, tl.maximum(count_f, 1.0)), 0.0)
    centred = tl.where(valid, r - mean[:, None], 0.0)
    sum_sq_dev = tl.sum(centred * centred, axis=1)
    std = tl.where(count >= 2, tl.sqrt_rn(tl.div_rn(sum_sq_dev, tl.maximum(count_f - 1.0, 1.0))),
                   0.0)
    return count, mean, centred, std


@triton.jit
def _row_faults(r, valid, prompt_ids, num_prompts):
    """``layout.FAULT_*`` bits of each row before duplicate detection (``reference.row_faults``)."""
    finite = tl.abs(r) <= _FLT_MAX  # false for NaN and +-inf
    nonfinite = tl.max((valid & ~finite).to(tl.int32), axis=1)
    outside = tl.max((valid & finite & ((r < 0.0) | (r > 1.0))).to(tl.int32), axis=1)
    bad_id = ((prompt_ids < 0) | (prompt_ids >= num_prompts)).to(tl.int32)
    return bad_id * _FAULT_ID | nonfinite * _FAULT_NONFINITE | outside * _FAULT_OUTSIDE


@triton.jit
def _energy_update(p, first, d_init_before, ema_before, streak_before,
                   beta, one_minus_beta, d_min, alpha, prune_after):
    """docs/spec.md §3 and §5 for one row, in the operation order of ``csrc/lze_math.h``."""
    # The interpreter passes float arguments as Python floats, and one below fp32's normal range
    # (d_min = 1e-300) becomes an fp64 constant, which Triton 3.7's interpreted tl.maximum
    # carries into the fp32 tile. The cast gives the value a compiled kernel receives (the JIT
    # types float arguments fp32): a no-op there.
    d_init = tl.where(first, tl.maximum(1.0 - p, tl.cast(d_min, tl.float32)), d_init_before)
    momentum = tl.where(first, 0.0, tl.minimum(2.0 * tl.abs(p - ema_before), 1.0))
    uncertainty = (4.0 * p) * (1.0 - p)
    energy = (d_init * uncertainty) * (1.0 + alpha * momentum)
    ema = tl.where(first, p, beta * ema_before + one_minus_beta * p)
    solved = p >= tl.full(p.shape, _SOLVED_THRESHOLD, tl.float32)
    streak = tl.where(solved, streak_before + 1, 0)
    flags = tl.where(streak >= prune_after, _FLAG_PRUNED, 0)
    return d_init, ema, energy, momentum, streak, flags


@triton.jit
def _lze_step_kernel(
    rewards_ptr, valid_ptr, prompt_ids_ptr,
    fstate_ptr, istate_ptr, step_counter_ptr, fault_ptr, fault_mirror_ptr,
    advantages_ptr, pass_rate_ptr, energy_ptr, momentum_ptr,
    num_rows, group_size, num_prompts,
    beta, one_minus_beta, d_min, alpha, eps, norm_by_std, prune_after,
    BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
):
    step = tl.load(step_counter_ptr)  # steps completed before this one
    stamp = (step + 1).to(tl.int32)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_G)
    row_in_batch = rows < num_rows
    in_tile = row_in_batch[:, None] & (cols < group_size)[None, :]
    offsets = rows.to(tl.int64)[:, None] * group_size + cols[None, :]

    r = tl.load(rewards_ptr + offsets, mask=in_tile, other=0.0).to(tl.float32)
    valid = in_tile
    if valid_ptr is not None:  # None is a compile-time constant: all rollouts valid
        valid = valid & (tl.load(valid_ptr + offsets, mask=in_tile, other=0) != 0)
    count, mean, centred, std = _group_stats(r, valid)
    # Divided here, while few values are live (the module docstring says why).
    scaled = tl.where(norm_by_std != 0, tl.div_rn(centred, std[:, None] + eps), centred)
    prompt_ids = tl.load(prompt_ids_ptr + rows, mask=row_in_batch, other=0)
    faults = _row_faults(r, valid, prompt_ids, num_prompts)

    claimable = row_in_batch & (faults == 0) & (count > 0)
    # Masked lanes may carry bad ids: clamp every state index to row 0 so no address is wild.
    slot = tl.where(claimable, prompt_ids, 0)
    previous = tl.atomic_max(istate_ptr + slot * _RECORD_WORDS + _CLAIM, stamp, mask=claimable)
    duplicate = claimable & (previous >= stamp)
    active = claimable & ~duplicate
    faults = faults | tl.where(duplicate, _FAULT_DUPLICATE, 0)
    tl.atomic_or(fault_ptr + rows * 0, faults, mask=faults != 0)
    advantages = tl.where((active & (count >= 2))[:, None], scaled, 0.0)
    tl.store(advantages_ptr + offsets, advantages, mask=in_tile)

    fields = tl.arange(0, _NUM_FIELDS)
    state_offsets = slot[:, None] * _RECORD_WORDS + fields[None, :]
    row_mask = active[:, None]
    # A record's two 16-byte halves (layout.py), each split into its four fields.
    d_init_before, ema_before, _, _ = unpack4(
        tl.load(fstate_ptr + state_offsets, mask=row_mask, other=0.0))
    seen, streak_before, _, _ = unpack4(tl.load(istate_ptr + state_offsets, mask=row_mask, other=0))
    p = tl.where(active, mean, 0.0)
    d_init, ema, energy, momentum, streak, flags = _energy_update(
        p, seen == 0, d_init_before, ema_before, streak_before,
        beta, one_minus_beta, d_min, alpha, prune_after)
    energy = tl.where(active, energy, 0.0)
    momentum = tl.where(active, momentum, 0.0)
    tl.store(fstate_ptr + state_offsets, pack4(d_init, ema, p, energy), mask=row_mask)
    tl.store(istate_ptr + state_offsets,
             pack4(seen + 1, streak, flags, tl.zeros_like(seen) + stamp),
             mask=row_mask)

    tl.store(pass_rate_ptr + rows, p, mask=row_in_batch)
    tl.store(energy_ptr + rows, energy, mask=row_in_batch)
    tl.store(momentum_ptr + rows, momentum, mask=row_in_batch)
    _finish_program(step_counter_ptr, step, fault_ptr, fault_mirror_ptr)


@triton.jit
def _finish_program(step_counter_ptr, step, fault_ptr, fault_mirror_ptr):
    """The last program to finish writes ``step + 1``, resets the ticket counter and copies the
    fault word to its mirror (the fault word itself when the caller has none: one variant)."""
    # Every thread of this program has read step_counter[0] and ORed its faults before the
    # ticket is taken (the barrier), and the acq_rel ticket orders those before the last
    # program's reads and writes.
    tl.debug_barrier()
    ticket = tl.atomic_add(step_counter_ptr + 1, 1)
    is_last = ticket == tl.num_programs(0) - 1
    tl.store(step_counter_ptr, step + 1, mask=is_last)
    tl.atomic_xchg(step_counter_ptr + 1, 0, mask=is_last)  # a count: atomic, like its tickets
    faults = tl.atomic_or(fault_ptr, 0, mask=is_last)
    tl.store(fault_mirror_ptr, faults, mask=is_last)


# Argument types as the JIT derives them at launch (Python ints below 2**31 are i32).
_REWARD_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_FIXED_ARG_TYPES = {
    "prompt_ids_ptr": "*i64", "fstate_ptr": "*fp32", "istate_ptr": "*i32",
    "step_counter_ptr": "*i64", "fault_ptr": "*i32", "fault_mirror_ptr": "*i32",
    "advantages_ptr": "*fp32",
    "pass_rate_ptr": "*fp32", "energy_ptr": "*fp32", "momentum_ptr": "*fp32",
    "num_rows": "i32", "group_size": "i32", "num_prompts": "i32",
    "beta": "fp32", "one_minus_beta": "fp32", "d_min": "fp32", "alpha": "fp32", "eps": "fp32",
    "norm_by_std": "i32", "prune_after": "i32",
}


def gpu_tile_shape(group_size: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_G) on a GPU: a function of G only, so :func:`aot_configs` covers it."""
    block_g = triton.next_power_of_2(max(group_size, 1))
    return max(1, min(GPU_MAX_ROWS, GPU_TILE_ELEMENTS // block_g)), block_g


def tile_shape(num_rows: int, group_size: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_G) of the step kernel for a ``[num_rows, group_size]`` batch."""
    if not interpreting():
        return gpu_tile_shape(group_size)
    block_g = triton.next_power_of_2(max(group_size, 1))
    block_rows = max(1, INTERPRETER_TILE_ELEMENTS // block_g)
    return min(block_rows, triton.next_power_of_2(max(num_rows, 1))), block_g


def step(rewards, valid, prompt_ids, state: SelectorState, params: KernelParams,
         fault_mirror=None) -> StepStats:
    """One fused launch of :func:`lze_kernels.reference.lze_step` (same outputs, same state).
    ``fault_mirror``: a ``[1]`` int32 host-visible tensor (pinned, mapped memory on a GPU) the
    last program copies the fault word into, or None."""
    num_rows, group_size = rewards.shape
    if rewards.dtype not in _REWARD_POINTER_TYPES:
        raise ValueError(f"rewards: expected one of {list(_REWARD_POINTER_TYPES)}, "
                         f"got {rewards.dtype}")
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(f"rewards: expected at most {MAX_GROUP_SIZE} rollouts per group for the "
                         f"triton backend, got {group_size}")
    rewards = rewards.contiguous()
    if valid is not None:
        valid = valid.to(torch.bool).contiguous().view(torch.uint8)
    device = rewards.device
    advantages = torch.empty((num_rows, group_size), dtype=torch.float32, device=device)
    pass_rate, energy, momentum = (
        torch.empty(num_rows, dtype=torch.float32, device=device) for _ in range(3))
    block_rows, block_g = tile_shape(num_rows, group_size)
    grid = (max(1, triton.cdiv(num_rows, block_rows)),)
    # Two typed views of the one record table: the float half at word 0, the int half at 4.
    records = state.records
    _lze_step_kernel[grid](
        rewards, valid, prompt_ids.contiguous(),
        records.view(torch.float32), records[:, L.NUM_FIELDS:], state.step_counter, state.fault,
        state.fault if fault_mirror is None else fault_mirror, advantages, pass_rate, energy,
        momentum,
        num_rows, group_size, state.num_prompts,
        params.beta, params.one_minus_beta, params.d_min, params.alpha, params.eps,
        int(params.norm_by_std), params.prune_after,
        BLOCK_ROWS=block_rows, BLOCK_G=block_g, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
    return StepStats(advantages, pass_rate, energy, momentum)


def aot_configs():
    """Every variant :func:`step` can launch on a GPU: each tile shape, reward dtype and
    valid mask."""
    block_g = 1
    while block_g <= MAX_GROUP_SIZE:
        block_rows, _ = gpu_tile_shape(block_g)
        for reward_type in _REWARD_POINTER_TYPES.values():
            for has_valid in (False, True):
                types = {"rewards_ptr": reward_type,
                         "valid_ptr": "*u8" if has_valid else "constexpr", **_FIXED_ARG_TYPES}
                constexprs = {"BLOCK_ROWS": block_rows, "BLOCK_G": block_g}
                if not has_valid:
                    constexprs["valid_ptr"] = None
                yield LaunchConfig(
                    name=f"lze_step[BLOCK_G={block_g},{reward_type[1:]},"
                         f"{'valid' if has_valid else 'no_valid'}]",
                    fn=_lze_step_kernel,
                    signature={arg: types.get(arg, "constexpr")
                               for arg in _lze_step_kernel.arg_names},
                    constexprs=constexprs, num_warps=NUM_WARPS)
        block_g *= 2

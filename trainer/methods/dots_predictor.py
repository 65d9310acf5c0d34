"""DOTS's adaptive difficulty predictor, trained offline before RL and then frozen (Sun et al.
2025; ASTRAL-Group/data-efficient-llm-rl at 59df918: ``adaptive_difficulty_prediction/train.py``
trains :class:`lze_kernels.dots_adapter.DifficultyAdapter`'s official counterpart once, with
binary cross-entropy against pass rates, a fresh random reference set per batch, 20 epochs at
lr 1e-3; ``teacher_utils.py``:219-228 loads it frozen for RL).

Labels. The official predictor learns from pass rates of several models on the training set,
precomputed. Here the only pass rates the project can produce offline are its own policy's: before
the first RL step, ``selection.dots.predictor_prompts`` random training prompts are rolled out
``rollout.n`` times by the step-0 policy (the warmed-up model) and labelled with their mean
reward. These rollouts are booked in the compute ledger under the purpose ``predictor`` (never
trained on), so the study counts them. A share ``selection.dots.predictor_holdout`` is held out.

Training (:func:`train_adapter`): AdamW on the held-in prompts, shuffled batches of
``dots.predictor_batch`` queries, each against a fresh uniform draw of ``K`` references from the
held-in prompts (``K = selection.dots.reference_size``, capped; a query never attends to itself),
BCE of the calibrated prediction against the query's pass rate; at most
``dots.predictor_epochs`` epochs and ``dots.predictor_time_s`` seconds, whichever ends first.
Rank 0 trains; every rank receives its weights (all ranks must predict alike).

Quality (:func:`held_out_quality`): on the held-out prompts, averaged over random reference draws
with the per-round in-sample linear fit of RL time: Pearson correlation of the prediction with the
pass rate, and the share of groups with mixed rewards among the quarter of held-out prompts the
predictor would pick (closest to 1/2) against the held-out share at random, for the trained
predictor and for the untrained kernel regression on the raw embeddings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lze_kernels import ops
from lze_kernels.dots_adapter import DifficultyAdapter

from .. import distributed as D

QUALITY_DRAWS = 8  # reference draws averaged by held_out_quality


@dataclass
class LabelledPrompts:
    """Prompts rolled out offline: their pass rates and whether their group had mixed rewards."""

    prompt_ids: torch.Tensor  # [M] int64 on the device
    pass_rate: torch.Tensor  # [M] float32
    mixed: torch.Tensor  # [M] bool

    def split(self, holdout: float, generator: torch.Generator):
        """(held-in, held-out) index tensors into the M prompts, a seeded random split."""
        order = torch.randperm(len(self.prompt_ids), generator=generator).to(
            self.prompt_ids.device)
        held_out = max(1, round(holdout * len(order))) if holdout > 0 else 0
        return order[held_out:], order[:held_out]


def fit_predictor(ctx, embeddings: torch.Tensor, labelled: LabelledPrompts
                  ) -> tuple[DifficultyAdapter, dict[str, float]]:
    """Train the adapter on rank 0 (bounded in time), share it, freeze it; measure it."""
    s = ctx.cfg.selection
    generator = torch.Generator().manual_seed(ctx.cfg.trainer.seed)
    held_in, held_out = labelled.split(s.dots.predictor_holdout, generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.cfg.trainer.seed)  # the same initial weights on every rank
        adapter = DifficultyAdapter(embeddings.shape[1], s.dots.predictor_hidden,
                                    s.dots.predictor_layers).to(embeddings.device)
    stats: dict[str, float] = {}
    if ctx.generation.world.rank == 0:
        cuda = [embeddings.device] if embeddings.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # the run's own random streams stay as they are
            torch.manual_seed(ctx.cfg.trainer.seed)  # dropout
            stats = train_adapter(adapter, embeddings[labelled.prompt_ids[held_in]],
                                  labelled.pass_rate[held_in], s.dots.reference_size,
                                  epochs=s.dots.predictor_epochs, time_s=s.dots.predictor_time_s,
                                  lr=s.dots.predictor_lr, batch_size=s.dots.predictor_batch,
                                  generator=generator)
    state = D.broadcast_object({k: v.cpu() for k, v in adapter.state_dict().items()})
    adapter.load_state_dict(state)
    adapter.eval().requires_grad_(False)
    if len(held_out):
        stats.update(held_out_quality(adapter, embeddings, labelled, held_in, held_out,
                                      s.dots.reference_size, s.dots.attention_tau,
                                      torch.Generator().manual_seed(ctx.cfg.trainer.seed + 1)))
    return adapter, D.broadcast_object(stats)


def train_adapter(adapter: DifficultyAdapter, embeddings: torch.Tensor, labels: torch.Tensor,
                  reference_size: int, *, epochs: int, time_s: float, lr: float, batch_size: int,
                  generator: torch.Generator) -> dict[str, float]:
    """BCE training of ``adapter`` on ``embeddings [M, d]`` with pass rates ``labels [M]``:
    shuffled query batches, each against a fresh uniform draw of ``min(reference_size, M - 1)``
    references (the query itself masked out). Returns the first and last epoch's mean loss, the
    epochs run and the seconds spent."""
    M = embeddings.shape[0]
    if M < 2:
        raise ValueError(f"DOTS predictor: expected at least 2 labelled prompts, got {M} "
                         "(raise selection.dots.predictor_prompts)")
    K = min(reference_size, M - 1)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=lr)
    adapter.train()
    start, losses, epoch = time.monotonic(), [], 0
    while epoch < epochs and time.monotonic() - start < time_s:
        total, count = 0.0, 0
        for batch in torch.randperm(M, generator=generator).split(batch_size):
            batch = batch.to(embeddings.device)
            refs = torch.randperm(M, generator=generator)[:K].to(embeddings.device)
            exclude = batch.unsqueeze(1) == refs.unsqueeze(0)
            pred = adapter(embeddings[batch], embeddings[refs], labels[refs], exclude)
            loss = F.binary_cross_entropy(pred, labels[batch].float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, count = total + float(loss.detach()) * len(batch), count + len(batch)
        losses.append(total / count)
        epoch += 1
    adapter.eval()
    return {"dots/predictor_bce_first_epoch": losses[0] if losses else float("nan"),
            "dots/predictor_bce_last_epoch": losses[-1] if losses else float("nan"),
            "dots/predictor_epochs": float(epoch),
            "dots/predictor_train_s": time.monotonic() - start}


def predict_with_references(adapter: DifficultyAdapter | None, embeddings: torch.Tensor,
                            refs: torch.Tensor, labels: torch.Tensor, attention_tau: float,
                            calibrate: bool) -> tuple[torch.Tensor, tuple]:
    """[N] every prompt's prediction from the labelled references ``refs`` (the trained adapter,
    or the kernel regression on raw embeddings when ``adapter`` is None), then the official
    per-round linear fit of the references' own (in-sample) predictions against their labels
    (``teacher_utils.py``:256-269), applied to every prompt. Returns it and (slope, intercept)."""
    if adapter is None:
        predicted = ops.predict_pass_rates(embeddings, embeddings[refs], labels, attention_tau)
    else:
        predicted = adapter.predict(embeddings, embeddings[refs], labels)
    if not calibrate or refs.numel() < 2:
        return predicted, (1.0, 0.0)
    slope, intercept = ops.calibrate_linear(predicted[refs], labels)
    return ops.apply_calibration(predicted, slope, intercept), (slope, intercept)


def held_out_quality(adapter: DifficultyAdapter, embeddings: torch.Tensor,
                     labelled: LabelledPrompts, held_in: torch.Tensor, held_out: torch.Tensor,
                     reference_size: int, attention_tau: float, generator: torch.Generator
                     ) -> dict[str, float]:
    """The trained and the untrained predictor on the held-out prompts (module docstring)."""
    K = min(reference_size, len(held_in))
    picks = max(1, len(held_out) // 4)
    truth = labelled.pass_rate[held_out].double()
    mixed = labelled.mixed[held_out].double()
    out = {"dots/heldout_prompts": float(len(held_out)),
           "dots/heldout_mixed_share_random": float(mixed.mean())}
    for name, model in (("trained", adapter), ("untrained", None)):
        pearson, share = 0.0, 0.0
        for _ in range(QUALITY_DRAWS):
            chosen = held_in[torch.randperm(len(held_in), generator=generator)[:K].to(
                held_in.device)]
            refs = labelled.prompt_ids[chosen]
            predicted, _ = predict_with_references(model, embeddings, refs,
                                                   labelled.pass_rate[chosen], attention_tau, True)
            guess = predicted[labelled.prompt_ids[held_out]].double()
            pearson += pearson_r(guess, truth)
            nearest = (guess - 0.5).abs().argsort()[:picks]
            share += float(mixed[nearest].mean())
        out[f"dots/heldout_pearson_{name}"] = pearson / QUALITY_DRAWS
        out[f"dots/heldout_mixed_share_{name}"] = share / QUALITY_DRAWS
    return out


def pearson_r(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation (0 when either side is constant)."""
    dx, dy = x - x.mean(), y - y.mean()
    denominator = float((dx.square().sum() * dy.square().sum()).sqrt())
    return float((dx * dy).sum()) / denominator if denominator > 0 else 0.0

"""The policy under training: a Hugging Face causal LM in a DeepSpeed engine (ZeRO 0-3).

DeepSpeed runs with ``managed_gradient_accumulation: false``: the trainer owns the boundary, so
a step may have any number of micro-batches (it depends on how many groups selection kept), each
``backward`` only accumulates, and ``step()`` reduces and updates. Losses arrive already divided
by the global normaliser of their mini-batch (:mod:`lze_trainer.loss`); DeepSpeed averages
gradients over ranks, so each rank's loss is multiplied by the world size to make the result the
exact gradient of the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from . import distributed as D
from .batch import SequenceBatch
from .loss import (Normaliser, aggregate, behaviour_weights, clipped_surrogate, kl_penalty,
                   token_log_probs, token_log_probs_and_entropy)


# tokens: response tokens with a loss; sequence_tokens: every token (prompt and response) of the
# trained sequences, which the update's forward and backward run through (the FLOPs proxy's)
UPDATE_SUMS = ("pg_loss", "kl", "entropy", "clipped_tokens", "tokens", "sequence_tokens")


@dataclass
class UpdateStats:
    """Sums over this rank's kept tokens, kept on the device until the step ends (the caller
    reduces them over ranks), plus the optimizer's per-update results."""

    sums: torch.Tensor  # [len(UPDATE_SUMS)] in the order of UPDATE_SUMS
    engine_logprob_abs_diff_max: torch.Tensor  # |actor - engine| log-prob, before any update
    grad_norms: list[float] = field(default_factory=list)
    skipped_updates: int = 0
    entropy_measured: bool = False  # whether sums["entropy"] was measured (actor.entropy_every)

    @classmethod
    def zeros(cls, device) -> "UpdateStats":
        return cls(torch.zeros(len(UPDATE_SUMS), dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device))

    def add(self, name: str, value: torch.Tensor) -> None:
        self.sums[UPDATE_SUMS.index(name)] += value.detach().double()

    def as_dict(self) -> dict[str, float]:
        return dict(zip(UPDATE_SUMS, self.sums.tolist()))


@dataclass(frozen=True)
class Schedule:
    """Learning rate over the optimizer steps of one phase (transformers.get_scheduler)."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "constant"  # constant | cosine | linear

    @classmethod
    def of_actor(cls, actor_cfg, total_steps: int) -> "Schedule":
        return cls(actor_cfg.lr, total_steps, actor_cfg.lr_warmup_steps, actor_cfg.lr_schedule)


class Actor:
    def __init__(self, cfg, world: D.World, model_dir: str, schedule: Schedule):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.world = world
        self.on_gpu = world.device.type == "cuda"
        self.bf16 = cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and self.on_gpu)
        # Loaded in the training dtype: DeepSpeed's bf16 mode casts the module to bf16 anyway and
        # keeps its own fp32 master copy in the optimizer, so an fp32 load only costs host RAM
        # (4 bytes x P per rank, 6 GB at 1.5B parameters).
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if self.bf16 else torch.float32,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.reference = self._frozen_copy(model) if cfg.actor.kl_coef > 0 else None
        self.schedule = schedule
        self.engine, *_ = D.import_deepspeed().initialize(
            model=model, optimizer=self._client_optimizer(), config=self._deepspeed_config(),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            lr_scheduler=lambda opt: _scheduler(schedule, opt),
        )
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.updates = 0  # update() calls so far: the actor.entropy_every cadence

    # ------------------------------------------------------------------ set-up

    def _deepspeed_config(self) -> dict:
        a = self.cfg.actor
        zero = {"stage": a.zero_stage}
        if a.offload and a.zero_stage >= 1:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.on_gpu}
            if a.zero_stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": self.on_gpu}
        config = {
            "train_micro_batch_size_per_gpu": a.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": a.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16, "check_grad_overflow": True},
            "steps_per_print": 2**31,
            "wall_clock_breakdown": False,
        }
        if self._uses_deepspeed_optimizer():
            config["optimizer"] = {"type": "AdamW", "params": {
                "lr": self.schedule.lr, "betas": list(a.betas), "weight_decay": a.weight_decay}}
        else:
            config["zero_force_ds_cpu_optimizer"] = False
        return config

    def _uses_deepspeed_optimizer(self) -> bool:
        choice = self.cfg.actor.optimizer
        # DeepSpeed's FusedAdam (GPU) and DeepSpeedCPUAdam build a C++/CUDA op at run time: the
        # first needs nvcc of torch's CUDA major version, both take about a minute. torch's AdamW
        # (fused kernel on GPU) needs nothing; only ZeRO-Offload wants DeepSpeed's CPU Adam.
        return choice == "deepspeed" or (choice == "auto" and self.cfg.actor.offload)

    def _client_optimizer(self) -> Optional[Callable[[list], torch.optim.Optimizer]]:
        """torch's AdamW, built by DeepSpeed from the parameters once they are on the device
        (``fused=True`` there on CUDA), or None for DeepSpeed's own optimizer."""
        if self._uses_deepspeed_optimizer():
            return None
        a, fused = self.cfg.actor, self.on_gpu
        return lambda params: torch.optim.AdamW(params, lr=self.schedule.lr, betas=tuple(a.betas),
                                                weight_decay=a.weight_decay, fused=fused)

    def _frozen_copy(self, model):
        import copy

        reference = copy.deepcopy(model).to(self.world.device)  # already in the training dtype
        reference.requires_grad_(False)
        return reference.eval()

    # ------------------------------------------------------------------ forward

    def _logits(self, module, batch: SequenceBatch) -> torch.Tensor:
        return module(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      use_cache=False).logits

    @torch.no_grad()
    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """[n, L] log-probs of the batch's tokens under the current policy (no gradient)."""
        batch = batch.to(self.world.device)
        logits = self._logits(self.engine, batch)
        return token_log_probs(logits, batch.input_ids, self.cfg.rollout.temperature).cpu()

    @torch.no_grad()
    def _reference_log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        logits = self._logits(self.reference, batch)
        return token_log_probs(logits, batch.input_ids, self.cfg.rollout.temperature)

    # ------------------------------------------------------------------ update

    def update(self, mini_batches: list[list[SequenceBatch]], norms: list[Normaliser]) -> UpdateStats:
        """``ppo_epochs`` passes; one optimizer step per mini-batch. Old log-probs are recomputed
        before the first update when there is more than one (else the policy's own, detached)."""
        a = self.cfg.actor
        stats = UpdateStats.zeros(self.world.device)
        stats.entropy_measured = a.entropy_coef != 0 or (
            a.entropy_every > 0 and self.updates % a.entropy_every == 0)
        self.updates += 1
        self.engine.train()
        if a.ppo_epochs * len(mini_batches) > 1:
            for micro in (m for mb in mini_batches for m in mb):
                micro.old_logprobs = self.log_probs(micro)
                _compare_with_engine(stats, micro.old_logprobs, micro)
        for _ in range(a.ppo_epochs):
            for micro_list, norm in zip(mini_batches, norms):
                finite = torch.stack([self._backward(m, norm, stats) for m in micro_list]).all()
                self._optimizer_step(bool(finite), stats)
        return stats

    def _backward(self, micro: SequenceBatch, norm: Normaliser, stats: UpdateStats) -> torch.Tensor:
        """Accumulate one micro-batch's gradient; returns whether its loss was finite (0-dim).
        Log-probs and entropy never build a float32 copy of the logits (:mod:`lze_trainer.loss`);
        the entropy is computed only when measured (``stats.entropy_measured``) and takes part in
        the gradient only when ``actor.entropy_coef != 0``."""
        a = self.cfg.actor
        batch = micro.to(self.world.device)
        logp, entropy = token_log_probs_and_entropy(
            self._logits(self.engine, batch), batch.input_ids, self.cfg.rollout.temperature,
            entropy=stats.entropy_measured)
        mask = batch.loss_mask
        old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        pg, clipped = clipped_surrogate(logp, old, batch.advantages, a.clip_ratio_low,
                                        a.clip_ratio_high)
        pg = pg * behaviour_weights(old, batch.engine_logprobs, batch.off_policy)
        loss = aggregate(pg, mask, a.loss_agg_mode, norm)
        if a.entropy_coef != 0:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg_mode, norm)
        if self.reference is not None:
            kl = kl_penalty(logp, self._reference_log_probs(batch), a.kl_estimator)
            loss = loss + a.kl_coef * aggregate(kl, mask, a.loss_agg_mode, norm)
            stats.add("kl", (kl * mask).sum())
        self.engine.backward(loss * self.world.size, scale_wrt_gas=False)
        self._accumulate(stats, pg, clipped, entropy, logp, batch)
        return torch.isfinite(loss.detach())

    @staticmethod
    def _accumulate(stats: UpdateStats, pg, clipped, entropy, logp, batch: SequenceBatch) -> None:
        mask = batch.loss_mask
        kept = mask > 0
        stats.add("pg_loss", (pg * mask).sum())
        if entropy is not None:
            stats.add("entropy", (entropy * mask).sum())
        stats.add("clipped_tokens", (clipped & kept).sum())
        stats.add("tokens", mask.sum())
        trained = kept.any(dim=1)  # padding sequences (zero weight) are not the method's
        stats.add("sequence_tokens", batch.attention_mask.sum(dim=1)[trained].sum())
        if batch.old_logprobs is None:  # the policy before any update: the engine's
            _compare_with_engine(stats, logp, batch)

    def _optimizer_step(self, finite_loss: bool, stats: UpdateStats) -> None:
        """Step, or skip on a non-finite loss or gradient on any rank (never trained on)."""
        stage0 = self.cfg.actor.zero_stage == 0
        # ZeRO 1-3 detect non-finite gradients themselves and skip the step; stage 0 does not.
        bad = D.any_rank(not finite_loss or (stage0 and not self._local_grads_finite()))
        if bad and stage0:
            self.engine.zero_grad()
            stats.skipped_updates += 1
            return
        self.engine.step()
        if bad or not self.engine.was_step_applied():
            stats.skipped_updates += 1
        else:
            stats.grad_norms.append(float(self.engine.get_global_grad_norm() or 0.0))

    def _local_grads_finite(self) -> bool:
        return all(torch.isfinite(p.grad).all() for p in self.engine.module.parameters()
                   if p.grad is not None)

    def sft_update(self, micro_batches: list[SequenceBatch], norm: Normaliser) -> tuple[float, int]:
        """One supervised step: token-mean cross-entropy of the masked (answer) tokens over all
        ranks. Returns (this rank's summed token loss, skipped updates)."""
        stats = UpdateStats.zeros(self.world.device)
        self.engine.train()
        finite = []
        for micro in micro_batches:
            batch = micro.to(self.world.device)
            logp = token_log_probs(self._logits(self.engine, batch), batch.input_ids)
            loss = -aggregate(logp, batch.loss_mask, "token-mean", norm)
            self.engine.backward(loss * self.world.size, scale_wrt_gas=False)
            stats.add("pg_loss", -(logp * batch.loss_mask).sum())
            finite.append(torch.isfinite(loss.detach()))
        self._optimizer_step(bool(torch.stack(finite).all()), stats)
        return stats.as_dict()["pg_loss"], stats.skipped_updates

    # ------------------------------------------------------------------ weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name, whole, one at a time (gathered under ZeRO-3).
        Tied weights are yielded under both names: engines that load ``lm_head`` separately (vLLM
        on CPU) would otherwise keep the initial one."""
        import deepspeed

        for name, param in self.engine.module.named_parameters(remove_duplicate=False):
            if hasattr(param, "ds_id"):  # ZeRO-3 partitioned
                with deepspeed.zero.GatheredParameters([param]):
                    yield name, param.data.detach().clone()
            else:
                yield name, param.data.detach()

    def save_pretrained(self, out_dir: str, tokenizer) -> None:
        """The current policy as a Hugging Face checkpoint (every rank calls; rank 0 writes)."""
        weights = {name: t.cpu() for name, t in self.named_weights()}
        if self.world.is_main:
            self.engine.module.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
            tokenizer.save_pretrained(out_dir)
        D.barrier()

    @property
    def num_parameters(self) -> int:
        """P of the FLOPs proxy (:mod:`lze_trainer.compute`); whole sizes under ZeRO-3."""
        return sum(getattr(p, "ds_numel", p.numel())
                   for p in self.engine.module.parameters())

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]


def _compare_with_engine(stats: UpdateStats, logp: torch.Tensor, batch: SequenceBatch) -> None:
    """Largest |actor - engine| log-prob over kept tokens: after a weight sync both must hold the
    same policy, so this stays at float noise unless the sync or the sampling setup is wrong.
    Replayed sequences were sampled by an older policy and are left out."""
    kept = (batch.loss_mask > 0) & ~batch.off_policy.to(logp.device).unsqueeze(-1)
    engine = batch.engine_logprobs.to(logp.device)
    diff = torch.where(kept, (logp.detach() - engine).abs(), 0.0).amax()
    torch.maximum(stats.engine_logprob_abs_diff_max, diff.double(),
                  out=stats.engine_logprob_abs_diff_max)


def _scheduler(schedule: Schedule, optimizer):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}[
        schedule.kind]
    return get_scheduler(name, optimizer, num_warmup_steps=schedule.warmup_steps,
                         num_training_steps=max(schedule.total_steps, 1))

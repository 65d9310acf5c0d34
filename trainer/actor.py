"""The policy under training: a Hugging Face causal LM in a DeepSpeed engine (ZeRO 0-3).

DeepSpeed runs with ``managed_gradient_accumulation: false``: the trainer owns the boundary, so
a step may have any number of micro-batches (it depends on how many groups selection kept), each
``backward`` only accumulates, and ``step()`` reduces and updates. Losses arrive already divided
by the global normaliser of their mini-batch (:mod:`lze_trainer.loss`); DeepSpeed averages
gradients over ranks, so each rank's loss is multiplied by the world size to make the result the
exact gradient of the global loss.

A micro-batch runs each distinct prompt once and its sequences on top of the prompt's keys and
values (:meth:`Actor.sequence_logits`): a group's G responses share one pass over their prompt, in
the forward and in the backward. Its size follows the free memory
(:meth:`Actor.micro_batch_tokens`) unless the config fixes it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from . import distributed as D
from .batch import SequenceBatch
from .loss import (CHUNK_ELEMENTS, Normaliser, aggregate, behaviour_weights, clipped_surrogate,
                   kl_penalty, token_log_probs, token_log_probs_and_entropy)
from .metrics import Timer


# tokens: response tokens with a loss; sequence_tokens: every token (prompt and response) of the
# trained sequences, each sequence counted whole (the FLOPs proxy's, lze_trainer.compute)
UPDATE_SUMS = ("pg_loss", "kl", "entropy", "clipped_tokens", "tokens", "sequence_tokens")

# Share of the free memory (GPU: the device's free memory and the caching allocator's free
# blocks; CPU: the available RAM over the node's ranks) one micro-batch's activations, logits and
# their gradients may take. The estimate (update_bytes_per_token) is within some 6 % of what
# autograd saves for Qwen2-shaped models, measured on a CPU, and the GPU check found the
# gradient-checkpointed arithmetic 5 % above the measured peak; the other half is for what it
# leaves out (the allocator's fragmentation, the optimizer's temporaries).
UPDATE_MEMORY_SHARE = 0.5


@dataclass
class UpdateStats:
    """Sums over this rank's kept tokens, kept on the device until the step ends (the caller
    reduces them over ranks), plus the optimizer's per-update results."""

    sums: torch.Tensor  # [len(UPDATE_SUMS)] in the order of UPDATE_SUMS
    engine_logprob_abs_diff_max: torch.Tensor  # |actor - engine| log-prob, before any update
    grad_norms: list[float] = field(default_factory=list)
    skipped_updates: int = 0
    micro_batches: int = 0  # this update's micro-batches (the same count on every rank)
    micro_batch_tokens: int = 0  # the cap they were packed under (Actor.micro_batch_tokens)
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
        self.shares_prefix = _shares_prefix(model.config, cfg.model.gradient_checkpointing)
        self.bytes_per_token = update_bytes_per_token(model.config, model.dtype,
                                                      cfg.model.gradient_checkpointing)
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
            # Only counts samples here: the trainer owns the micro-batches and the boundary.
            "train_micro_batch_size_per_gpu": a.micro_batch_size or 1,
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

    def sequence_logits(self, module, batch: SequenceBatch, share: bool = True) -> torch.Tensor:
        """[n, L, V] logits at every position of ``batch.input_ids``, each sequence read after its
        prefix. Shared (``share`` and :attr:`shares_prefix`): each prefix runs once with
        ``use_cache=True``, its keys and values are gathered for its sequences
        (``DynamicCache.batch_select_indices``, so the backward sums their gradients into the
        one pass), and the sequences run on top at their own positions. Otherwise whole
        sequences run, with logits only at ``input_ids``' positions (``logits_to_keep``).

        The choice never depends on the batch: under ZeRO-2 every rank reduces gradients in the
        order its backward produces them, so every rank's micro-batches must run the same
        passes (two ranks taking different paths for one micro-batch summed mismatched
        gradients). A row whose prefix is empty (a one-token prompt) is all padding in the
        prefix pass; ``scaled_dot_product_attention`` gives such fully masked rows zeros."""
        length = batch.input_ids.shape[1]
        if not (share and self.shares_prefix and batch.prefix_ids is not None):
            ids, mask, positions = batch.whole_sequences()
            return module(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=False, logits_to_keep=length).logits
        cache = module(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                       use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_select_indices(batch.prefix_index)
        mask = torch.cat([batch.prefix_mask[batch.prefix_index], batch.attention_mask], dim=1)
        return module(input_ids=batch.input_ids, attention_mask=mask,
                      position_ids=batch.positions(), past_key_values=cache,
                      use_cache=True).logits

    @torch.no_grad()
    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """[n, L] log-probs of the batch's tokens under the current policy (no gradient)."""
        batch = batch.to(self.world.device)
        logits = self.sequence_logits(self.engine, batch)
        return token_log_probs(logits, batch.input_ids, self.cfg.rollout.temperature).cpu()

    @torch.no_grad()
    def _reference_log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        logits = self.sequence_logits(self.reference, batch)
        return token_log_probs(logits, batch.input_ids, self.cfg.rollout.temperature)

    # ------------------------------------------------------------------ update

    def micro_batch_tokens(self) -> int:
        """The cap on a micro-batch's padded tokens (rows x longest prefix and suffix):
        ``actor.max_tokens_per_micro_batch``, or as many tokens as :data:`UPDATE_MEMORY_SHARE`
        of the free memory holds at ``update_bytes_per_token`` beyond the bounded log-softmax's
        float32 chunks, the least over ranks (collective: every rank calls), floored to a power of
        two, so that the small swings of free memory from step to step leave the packing (and
        the float rounding of the sums) as it was."""
        if self.cfg.actor.max_tokens_per_micro_batch is not None:
            return self.cfg.actor.max_tokens_per_micro_batch
        vocab = self.engine.module.config.vocab_size
        chunks = 3 * max(1, CHUNK_ELEMENTS // vocab) * vocab * 4
        tokens = int(UPDATE_MEMORY_SHARE * free_memory(self.world) - chunks) // self.bytes_per_token
        tokens = int(D.all_reduce(max(tokens, 1), "min"))
        return 1 << (tokens.bit_length() - 1)

    def update(self, mini_batches: list[list[SequenceBatch]], norms: list[Normaliser],
               timer: Optional[Timer] = None) -> UpdateStats:
        """``ppo_epochs`` passes; one optimizer step per mini-batch. Old log-probs are recomputed
        before the first update when there is more than one (else the policy's own, detached).
        ``timer`` gets the seconds of the forward passes (old log-probs included), the backward
        passes and the optimizer steps as ``update_forward``, ``update_backward`` and
        ``update_optimizer`` (inclusive phases: they split the caller's ``update``)."""
        a = self.cfg.actor
        timer = timer or Timer()
        stats = UpdateStats.zeros(self.world.device)
        stats.entropy_measured = a.entropy_coef != 0 or (
            a.entropy_every > 0 and self.updates % a.entropy_every == 0)
        self.updates += 1
        self.engine.train()
        if a.ppo_epochs * len(mini_batches) > 1:
            with self._phase(timer, "update_forward"):
                for micro in (m for mb in mini_batches for m in mb):
                    micro.old_logprobs = self.log_probs(micro)
                    _compare_with_engine(stats, micro.old_logprobs, micro)
        for _ in range(a.ppo_epochs):
            for micro_list, norm in zip(mini_batches, norms):
                finite = torch.stack([self._backward(m, norm, stats, timer) for m in micro_list])
                with self._phase(timer, "update_optimizer"):
                    self._optimizer_step(bool(finite.all()), stats)
        return stats

    @contextmanager
    def _phase(self, timer: Timer, name: str):
        """``timer``'s inclusive phase ``name``, closed once the device has finished its work."""
        with timer(name, inclusive=True):
            yield
            if self.on_gpu:
                torch.cuda.synchronize(self.world.device)

    def _backward(self, micro: SequenceBatch, norm: Normaliser, stats: UpdateStats,
                  timer: Timer) -> torch.Tensor:
        """Accumulate one micro-batch's gradient; returns whether its loss was finite (0-dim)."""
        with self._phase(timer, "update_forward"):
            loss = self._loss(micro.to(self.world.device), norm, stats)
        with self._phase(timer, "update_backward"):
            self.engine.backward(loss * self.world.size, scale_wrt_gas=False)
        return torch.isfinite(loss.detach())

    def _loss(self, batch: SequenceBatch, norm: Normaliser, stats: UpdateStats) -> torch.Tensor:
        """One micro-batch's share of the mini-batch loss, its sums added to ``stats``.
        Log-probs and entropy never build a float32 copy of the logits (:mod:`lze_trainer.loss`);
        the entropy is computed only when measured (``stats.entropy_measured``) and takes part in
        the gradient only when ``actor.entropy_coef != 0``."""
        a = self.cfg.actor
        logp, entropy = token_log_probs_and_entropy(
            self.sequence_logits(self.engine, batch), batch.input_ids,
            self.cfg.rollout.temperature, entropy=stats.entropy_measured)
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
        self._accumulate(stats, pg, clipped, entropy, logp, batch)
        return loss

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
        stats.add("sequence_tokens", batch.sequence_lengths()[trained].sum())
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
            # One answer per prompt: nothing to share, whole sequences on every rank.
            logits = self.sequence_logits(self.engine, batch, share=False)
            logp = token_log_probs(logits, batch.input_ids)
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


def _shares_prefix(config, gradient_checkpointing: bool) -> bool:
    """Whether a prompt's keys and values can be computed once and read by its sequences: not
    under gradient checkpointing (it drops caches), and only where every layer attends to the
    whole past (a sliding-window cache would keep only its window)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (not gradient_checkpointing and getattr(config, "sliding_window", None) is None
            and all(kind == "full_attention" for kind in layer_types))


def update_bytes_per_token(config, dtype: torch.dtype, gradient_checkpointing: bool) -> int:
    """Bytes one token of a micro-batch holds through its forward and backward, from the model's
    shape (hidden size h, KV width kv, MLP width i, vocabulary V): what autograd saves in each
    layer, about 10 h + 2 kv + 4 i elements in a Llama/Qwen2 layer (measured: within 6 % for
    Qwen2 shapes from h = 128 to 896), or only the layer's input h under gradient checkpointing;
    one layer's worth again for the backward's temporaries (or the layer it recomputes); the
    logits and their gradient, 2 V; and a few hidden-sized vectors (embedding, final norm)."""
    heads = config.num_attention_heads
    hidden = config.hidden_size
    kv = (getattr(config, "num_key_value_heads", None) or heads) * (
        getattr(config, "head_dim", None) or hidden // heads)
    layer = 10 * hidden + 2 * kv + 4 * config.intermediate_size
    saved = hidden if gradient_checkpointing else layer
    elements = config.num_hidden_layers * saved + layer + 2 * config.vocab_size + 4 * hidden
    return elements * dtype.itemsize


def free_memory(world: D.World) -> int:
    """Bytes this rank may still use: on a GPU the device's free memory plus the caching
    allocator's free blocks, on a CPU the available RAM shared by the node's ranks."""
    if world.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(world.device)
        return free + torch.cuda.memory_reserved(world.device) - torch.cuda.memory_allocated(
            world.device)
    import psutil

    return psutil.virtual_memory().available // world.local_size


def _scheduler(schedule: Schedule, optimizer):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}[
        schedule.kind]
    return get_scheduler(name, optimizer, num_warmup_steps=schedule.warmup_steps,
                         num_training_steps=max(schedule.total_steps, 1))

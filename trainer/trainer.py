"""The GRPO trainer: one step reads top to bottom as prompts, rollout, reward, select, update,
sync, log.

Data parallelism: the global batch of B prompts is split over the rollout engines (one per rank,
or per group of ``tensor_parallel_size`` consecutive ranks); every rank all-gathers the step's
``[B, G]`` rewards and runs the same LZE selector on the device; the kept groups (whole groups,
never sequences cut out of one) are spread evenly over the ranks for the DeepSpeed update, whose
loss is normalised by the kept tokens of all ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import torch

from . import checkpoint, methods, metrics, model_source, prompts
from . import distributed as D
from .actor import UPDATE_SUMS, Actor, Schedule, UpdateStats
from .batch import RolloutGroup
from .compute import ComputeLedger
from .dispatch import dispatch_kept_groups, update_batches
from .config import Config, ConfigError, to_yaml
from .data import PromptSampler
from .evaluate import evaluate
from .generation import Generation
from .reward import RewardScorer
from .rollout import build_engine
from .selection import GroupSelector, Selection
from .summary import PHASES, UPDATE_PARTS, run_summary
from .warmup import warm_up


ROLLOUTS_FILE = "rollouts.jsonl"


class GRPOTrainer:
    def __init__(self, cfg: Config, world: D.World):
        self.cfg, self.world = cfg, world
        self.run_dir = Path(cfg.trainer.run_dir)
        self.config_dict = {**asdict(cfg), "world_size": world.size}
        self.resume_from = checkpoint.find_resume_folder(self.run_dir, cfg.trainer.resume)
        self.step = 0
        self.totals = {"total/update_groups": 0.0, "total/zero_variance_generated": 0.0,
                       "total/zero_variance_trained": 0.0}
        self.ledger = ComputeLedger()
        if world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        D.barrier()
        self.startup = metrics.Timer()
        self.eval_notes: list[str] = []
        model_dir = self._load_data_and_model()
        self.metrics = metrics.MetricsLogger(
            self.run_dir, world.is_main, resume_step=self._resume_step(),
            total_steps=cfg.trainer.total_steps, wandb_project=cfg.trainer.wandb_project,
            progress_bar=cfg.trainer.progress_bar, config_dict=self.config_dict)
        for note in self.eval_notes:
            self.metrics.write(note)
        if cfg.sft_warmup.steps:
            with self.startup("sft_warmup"):
                model_dir = warm_up(cfg, world, model_dir, self._warmup_examples,
                                    self.tokenizer, self.run_dir, self._log_warmup)
        self._build_engine_and_actor(model_dir)
        self.scorer = RewardScorer(cfg.reward.function, cfg.reward.timeout_s,
                                   cfg.reward.num_workers)
        self.generation = Generation(cfg, world, self.engine, self.scorer, self.train,
                                     self.tokenizer, self.ledger, self.metrics.write)
        self.method = methods.build(methods.MethodContext(
            cfg=cfg, num_prompts=len(self.train), device=world.device,
            selector=GroupSelector(cfg, len(self.train), world.device),
            sampler=PromptSampler(len(self.train), seed=cfg.trainer.seed),
            generation=self.generation, actor=self.actor))
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _load_data_and_model(self) -> str:
        """Training and held-out prompts, tokenized with the model's chat template; returns the
        model's local folder (a tiny model is built from the training prompts' text)."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        with self.startup("data"):
            train_rows = prompts.load(cfg.data.train, cfg.data, cfg.data.train_limit)
        with self.startup("model"):
            model_dir = model_source.resolve(cfg.model.path, self.run_dir, self.world,
                                             lambda: prompts.corpus(train_rows))
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        limit = cfg.data.max_prompt_tokens
        with self.startup("data"):
            self.train = prompts.tokenize("train", train_rows, self.tokenizer, limit)
            _check_batch_fits(cfg, len(self.train))
            self.eval_sets = [self._eval_set(source, train_rows) for source in cfg.data.eval]
        return model_dir

    def _eval_set(self, source: str, train_rows: list[dict]) -> prompts.PromptSet:
        cfg = self.cfg
        rows = prompts.load(source, cfg.data, cfg.data.eval_limit)
        name = prompts.set_name(source, rows)
        if cfg.data.eval_drop_train_prompts:
            unseen = prompts.without_prompts_of(rows, train_rows)
            if not unseen:
                raise ConfigError(f"data.eval: every prompt of {source!r} is also a training "
                                  "prompt (choose another seed or set, or set "
                                  "data.eval_drop_train_prompts=false)")
            dropped = len(rows) - len(unseen)
            self.eval_notes.append(f"held-out {name}: {len(unseen)} prompts ({dropped} dropped: "
                                   "also training prompts)")
            rows = unseen
        return prompts.tokenize(name, rows, self.tokenizer, cfg.data.max_prompt_tokens)

    def _warmup_examples(self) -> prompts.PromptSet:
        """What the supervised warm-up learns from: ``sft_warmup.data`` without the held-out
        prompts, or the training prompts (loaded inside the warm-up's start-up phase)."""
        cfg = self.cfg
        if not cfg.sft_warmup.data:
            return self.train
        rows = prompts.load(cfg.sft_warmup.data, cfg.data)
        if cfg.data.eval_drop_train_prompts:
            heldout = [row for eval_set in self.eval_sets for row in eval_set.rows]
            kept = prompts.without_prompts_of(rows, heldout)
            self.metrics.write(f"warm-up examples: {len(kept)} ({len(rows) - len(kept)} "
                               "dropped: held-out prompts)")
            rows = kept
        return prompts.tokenize("sft_warmup", rows, self.tokenizer, cfg.data.max_prompt_tokens)

    def _build_engine_and_actor(self, model_dir: str) -> None:
        """The rollout engine first, then DeepSpeed (the order colocated vLLM needs)."""
        cfg, world = self.cfg, self.world
        self.tp = cfg.rollout.tensor_parallel_size
        self.shard = world.rank // self.tp  # this rank's rollout engine
        max_model_len = cfg.rollout.max_model_len or (cfg.data.max_prompt_tokens
                                                      + cfg.rollout.max_new_tokens)
        with self.startup("engine"):
            self.engine = build_engine(cfg, model_dir, world, max_model_len)
        a = cfg.actor
        with self.startup("actor"):
            self.actor = Actor(cfg, world, model_dir, Schedule.of_actor(
                a, cfg.trainer.total_steps * a.ppo_epochs * a.mini_batches))

    # ================================================================== the loop

    def fit(self) -> None:
        cfg = self.cfg.trainer
        if self.resume_from is not None:
            self._load(self.resume_from)
        self.metrics.write("start-up: " + ", ".join(
            f"{phase} {s:.1f} s" for phase, s in self.startup.seconds.items()))
        if self.resume_from is None:
            self._evaluate_and_log()
        self.metrics.start_clock()
        while not self.finished:
            spent_before = self.ledger.totals["flops"]
            step_metrics = self.train_step()
            self.step += 1
            if self.step == 1:
                self.metrics.write(_zero_variance_line(step_metrics))
            stop = D.any_rank(self.stop_requested) or self.step == cfg.stop_after_steps
            if self.finished and cfg.flops_budget is not None:
                self.metrics.write(f"FLOPs budget {cfg.flops_budget:.4g} reached at step "
                                   f"{self.step} ({self.ledger.totals['flops']:.4g} spent)")
            evaluated = bool(self.eval_sets) and (self._eval_due(spent_before) or self.finished)
            if evaluated:
                step_metrics.update(self._evaluate())
                self.metrics.write(_eval_line(self.step, step_metrics))
            if evaluated or self._due(cfg.log_every):
                self.metrics.log(self.step, step_metrics)
            self.metrics.advance(self.step, step_metrics)
            if self._due(cfg.save_every) or self.finished or stop:
                self._save()
            if stop and not self.finished:
                self.metrics.write(f"stopping after step {self.step} (checkpoint saved)")
                break
        self._finish()

    @property
    def finished(self) -> bool:
        """The run is done: its step cap, or its FLOPs budget (the same on every rank: the
        ledger's totals are reduced over ranks)."""
        budget = self.cfg.trainer.flops_budget
        return (self.step >= self.cfg.trainer.total_steps
                or (budget is not None and self.ledger.totals["flops"] >= budget))

    def _eval_due(self, spent_before: float) -> bool:
        """Held-out evaluation after this step: every ``eval_every`` steps, or, with
        ``eval_at_flops``, when this step's FLOPs crossed one of its points (so runs of different
        cost per step are evaluated at the same compute)."""
        points = self.cfg.trainer.eval_at_flops
        if not points:
            return self._due(self.cfg.trainer.eval_every)
        spent = self.ledger.totals["flops"]
        return any(spent_before < point <= spent for point in points)

    def train_step(self) -> dict[str, float]:
        """One step, phase by phase; the method decides what each phase rolls out and keeps
        (:mod:`lze_trainer.methods`)."""
        timer = metrics.Timer()
        self.generation.begin_step(self.step, timer)
        with timer("step", inclusive=True):
            with timer("prompts"):
                plan = self.method.plan(self.step)
            with timer("rollout"):
                groups = self.method.collect(plan)
                self.engine.sleep()
            with timer("wait"):  # for the slowest engine's rollouts: imbalance, not selection
                D.barrier()
            with timer("select"):
                batch, selection, kept_rows = self._select(plan, groups)
                self.method.observe(batch, selection)
            update = self._update(batch, selection, kept_rows, timer)
            with timer("sync"):
                self.engine.load_weights(self.actor.named_weights())
        step_metrics = self._step_metrics(timer, batch, selection, kept_rows, update)
        if self.cfg.trainer.dump_rollouts:
            self._dump(batch, kept_rows, step_metrics)
        return step_metrics

    # ================================================================== 4. select

    def _select(self, plan: methods.PromptPlan, groups: list[RolloutGroup]):
        """All-gather the step's rewards, let the method select (same on every rank), read the
        kept rows to the host (the one sync of selection: the update needs them there)."""
        gathered = self.generation.gather(groups, len(plan.counts), self._group_width())
        batch = methods.StepBatch(plan, groups, gathered)
        selection = self.method.select(batch, self.step)
        kept_rows = selection.keep_mask.nonzero().flatten().tolist()
        self.method.ctx.selector.raise_if_faulted()
        return batch, selection, kept_rows

    def _group_width(self) -> int:
        r = self.cfg.rollout
        return r.allocation_max if r.allocation else r.n

    # ================================================================== 5. update

    def _update(self, batch: methods.StepBatch, selection: Selection,
                kept_rows: list[int], timer) -> UpdateStats:
        with timer("dispatch"):
            # ceil(rows / engines) on every rank (with replay the last slice may be shorter)
            rows_per_shard = -(-len(batch.plan.counts) // self.generation.num_shards)
            mine = dispatch_kept_groups(batch.groups, selection.advantages.cpu(), kept_rows,
                                        rows_per_shard, self.world, self.tp)
        with timer("update"):
            a = self.cfg.actor
            cap = self.actor.micro_batch_tokens()
            batches, norms = update_batches(mine, a.mini_batches, a.micro_batch_size,
                                            self.cfg.rollout.max_new_tokens, self.actor.pad_id,
                                            max_tokens=cap)
            stats = self.actor.update(batches, norms, timer)
            stats.micro_batches, stats.micro_batch_tokens = sum(map(len, batches)), cap
        # The FLOPs proxy's update tokens: every trained sequence whole, prompt included
        # (lze_trainer.compute; the pass itself runs each prompt once for its responses).
        local_tokens = float(stats.sums[UPDATE_SUMS.index("sequence_tokens")])
        self.ledger.add("update", "train", local_tokens)
        if a.ppo_epochs * len(batches) > 1:  # old log-probs were recomputed: one more forward
            self.ledger.add("forward", "old_logprobs", local_tokens / a.ppo_epochs)
        return stats

    # ================================================================== 6-7. log, eval, save

    def _step_metrics(self, timer, batch: methods.StepBatch, selection: Selection,
                      kept_rows: list[int], update: UpdateStats) -> dict[str, float]:
        g = batch.gathered
        rewards, valid = g.rewards, g.valid
        B = len(batch.plan.counts)
        responded = valid.any(dim=1) & batch.generated_rows()  # replayed rows generate nothing
        sums = dict(zip(UPDATE_SUMS, D.all_reduce_tensor(update.sums).tolist()))
        diff = D.all_reduce(float(update.engine_logprob_abs_diff_max), "max")
        grad_norms = update.grad_norms
        tokens = max(sums["tokens"], 1.0)
        lengths = self._response_lengths([grp for grp in batch.groups if not grp.off_policy])
        zero_variance = g.zero_variance()
        kept = torch.zeros(B, dtype=torch.bool)
        kept[kept_rows] = True
        m = {
            "reward/mean": float(rewards[valid & responded[:, None]].mean())
            if responded.any() else 0.0,
            "reward/zero_std_frac": float(zero_variance[responded].float().mean())
            if responded.any() else 0.0,
            "select/zero_variance_trained_frac": float(zero_variance[kept].float().mean())
            if kept_rows else 0.0,
            **_solved_shares(g, responded),
            **self.generation.take_scorer_counts(),
            "rollout/compile_s": D.all_reduce(self.engine.take_compile_seconds(), "max"),
            "sa/kept_groups": float(len(kept_rows)),
            "sa/kept_ratio": len(kept_rows) / self.cfg.trainer.batch_size,
            "sa/energy_mean": float(selection.energy.cpu()[responded].mean()) if responded.any() else 0.0,
            "sa/pass_rate_mean": float(selection.pass_rate.cpu()[responded].mean()) if responded.any() else 0.0,
            "sa/skipped_rollouts": float(sum(1 for c in batch.plan.counts if c == 0)),
            "sa/pruned": float(self.method.ctx.selector.num_pruned()),
            "actor/pg_loss": sums["pg_loss"] / tokens,
            "actor/kl": sums["kl"] / tokens,
            **({"actor/entropy": sums["entropy"] / tokens} if update.entropy_measured else {}),
            "actor/clipfrac": sums["clipped_tokens"] / tokens,
            "actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "actor/lr": self.actor.lr,
            "actor/skipped_updates": float(update.skipped_updates),
            "actor/update_tokens": sums["tokens"],
            "actor/micro_batches": float(update.micro_batches),
            "actor/micro_batch_tokens": float(update.micro_batch_tokens),
            "rollout/engine_logprob_diff_max": diff,
            **lengths,
        }
        self.totals["total/update_groups"] += len(kept_rows)
        self.totals["total/zero_variance_generated"] += float(zero_variance[responded].sum())
        self.totals["total/zero_variance_trained"] += float(zero_variance[kept].sum())
        m.update(self._compute_metrics())
        m.update(self.method.step_metrics())
        m.update(self.totals)
        # Every phase on every step: one that did not run took 0 s (e.g. no reward when SPEED's
        # carried groups fill a step without generating).
        m.update({f"timing_s/{phase}": 0.0 for phase in PHASES + UPDATE_PARTS})
        m.update(timer.as_metrics())
        step_s = timer.seconds["step"]
        m["timing_s/select_share"] = timer.seconds["select"] / step_s
        m["perf/tokens_per_s"] = m["compute/generated_tokens"] / step_s
        return m

    def _compute_metrics(self) -> dict[str, float]:
        """The step's compute ledger summed over ranks (``compute/<kind>/<purpose>``), running
        totals, and the sums over purposes the summary and the plots read."""
        reduced: dict = {}
        for counts in D.all_gather_object(dict(self.ledger.step)):
            for key, value in counts.items():
                reduced[key] = reduced.get(key, 0.0) + value
        m = self.ledger.close_step(reduced, self.actor.num_parameters)
        for kind in ("rollouts", "generated", "prefill", "update", "groups", "zero_variance"):
            step = sum(v for k, v in m.items() if k.startswith(f"compute/{kind}/"))
            total = sum(v for k, v in m.items() if k.startswith(f"total/{kind}/"))
            name = f"{kind}_tokens" if kind in ("generated", "prefill", "update") else kind
            m[f"compute/{name}"], m[f"total/{name}"] = step, total
        # Zero-variance share of every group generated this step, whatever its purpose (SPEED's
        # screening and DOTS's reference groups included).
        m["compute/zero_variance_generated_frac"] = (m["compute/zero_variance"]
                                                     / max(m["compute/groups"], 1.0))
        return m

    def _response_lengths(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """This step's responses over all engines (tensor-parallel peers count once)."""
        responses = [c for g in groups for c in g.responses] if self.world.rank % self.tp == 0 else []
        total, count, clipped = D.all_reduce_many([sum(len(c.token_ids) for c in responses),
                                                   len(responses),
                                                   sum(c.truncated for c in responses)])
        return {"response_length/mean": total / max(count, 1), "response_length/sum": total,
                "response_length/clip_ratio": clipped / max(count, 1)}

    def _dump(self, batch: methods.StepBatch, kept_rows, step_metrics) -> None:
        """One JSON line per step (rank 0): what was rolled out, scored, kept and trained on,
        with the responses of rank 0's engine as text (like verl's rollout_data_dir)."""
        if not self.world.is_main:
            return
        g = batch.gathered
        record = {
            "step": self.step + 1,
            "prompt_ids": batch.plan.prompt_ids.tolist(),
            "rewards": [r[v].tolist() for r, v in zip(g.rewards, g.valid)],
            "response_tokens": [n[v].tolist() for n, v in zip(g.lengths, g.valid)],
            "kept_rows": kept_rows,
            "pg_loss": step_metrics["actor/pg_loss"],
            "update_tokens": step_metrics["actor/update_tokens"],
            "responses": [[self.tokenizer.decode(c.token_ids) for c in grp.responses]
                          for grp in batch.groups],
        }
        with open(self.run_dir / ROLLOUTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _evaluate(self) -> dict[str, float]:
        return evaluate(self.engine, self.eval_sets, self.scorer, self.tokenizer, self.cfg,
                        self.world, self.shard, seed=self.generation.seed("eval"))

    def _evaluate_and_log(self) -> None:
        """Step 0: held-out accuracy before training, and what start-up cost."""
        results = {f"startup_s/{k}": v for k, v in self.startup.seconds.items()}
        if self.eval_sets:
            results.update(self._evaluate())
            self.metrics.write(_eval_line(self.step, results))
        self.metrics.log(self.step, results)

    def _save(self) -> None:
        method_state = self.method.state_dict()
        checksums = D.all_gather_object(_checksum(method_state["selector"]))
        if len(set(checksums)) != 1:  # the invariant all-gathered selection rests on
            raise RuntimeError(f"ranks hold different selector states (checksums {checksums})")
        state = {"step": self.step, "method": method_state, "totals": dict(self.totals),
                 "compute": self.ledger.state_dict(), "config": self.config_dict,
                 "selector_checksums": checksums}
        checkpoint.save(self.actor.engine, self.run_dir, self.step, state,
                        self.cfg.trainer.keep_checkpoints, self.world.rank,
                        self.method.rank_state_dict())

    def _load(self, folder: Path) -> None:
        state = checkpoint.load(self.actor.engine, folder, self.world.rank, self.config_dict)
        self.step = state["step"]
        self.method.load_state_dict(state["method"])
        self.method.load_rank_state_dict(state["rank_state"])
        self.totals.update(state["totals"])
        self.ledger.load_state_dict(state["compute"])
        self.engine.load_weights(self.actor.named_weights())
        if self.world.is_main:
            metrics.truncate_jsonl(self.run_dir / ROLLOUTS_FILE, self.step)
        self.metrics.write(f"resumed from {folder} at step {self.step}")

    def _resume_step(self) -> Optional[int]:
        return int(self.resume_from.name.split("_")[1]) if self.resume_from else None

    def _finish(self) -> None:
        if self.finished and self.cfg.trainer.save_hf_model:
            self.actor.save_pretrained(str(self.run_dir / "hf_model"), self.tokenizer)
        self.scorer.close()
        D.barrier()
        self.engine.close()
        if self.world.is_main:
            metrics.plot_run(self.run_dir)
            wall = time.time() - psutil.Process().create_time()
            self.metrics.write(run_summary(self.run_dir, wall))
        self.metrics.close()

    def _log_warmup(self, step: int, values: dict[str, float]) -> None:
        if self.metrics.enabled:
            for key, value in values.items():
                self.metrics.tensorboard.add_scalar(key, value, step)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True  # acted on at the end of the step, on every rank at once


def _check_batch_fits(cfg: Config, rows: int) -> None:
    """A step draws distinct prompts: B (and the candidates or reference set the policy draws)
    cannot exceed the data."""
    s, B = cfg.selection, cfg.trainer.batch_size
    if s.method == "dots":
        drawn = max(s.dots.reference_size, B * s.dots.every)
        what = (f"max(selection.dots.reference_size, trainer.batch_size x selection.dots.every) "
                f"= {drawn}")
    elif s.prune:
        drawn = math.ceil(B * s.candidate_factor)
        what = f"trainer.batch_size x selection.candidate_factor = {drawn}"
    else:
        drawn, what = B, f"trainer.batch_size = {B}"
    if drawn > rows:
        raise ConfigError(f"trainer.batch_size: {what} prompts per step, but data.train has only "
                          f"{rows} rows")


def _zero_variance_line(m: dict[str, float]) -> str:
    return (f"[step 1] zero-variance groups: {100 * m['reward/zero_std_frac']:.0f} % (all right "
            f"{100 * m['reward/all_correct_frac']:.0f} %, all wrong "
            f"{100 * m['reward/all_wrong_frac']:.0f} %)")


def _solved_shares(g, responded: torch.Tensor) -> dict[str, float]:
    """Shares of the step's groups with responses that are all right and all wrong (the two
    kinds of zero-variance group; binary rewards)."""
    if not responded.any():
        return {"reward/all_correct_frac": 0.0, "reward/all_wrong_frac": 0.0}
    low = torch.where(g.valid, g.rewards, torch.inf).amin(dim=1)
    high = torch.where(g.valid, g.rewards, -torch.inf).amax(dim=1)
    n = float(responded.sum())
    return {"reward/all_correct_frac": float(((low == 1) & responded).sum()) / n,
            "reward/all_wrong_frac": float(((high == 0) & responded).sum()) / n}


def _checksum(state: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        data = value.cpu().numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value)
        digest.update(key.encode() + (data if isinstance(data, bytes) else data.encode()))
    return digest.hexdigest()


def _eval_line(step: int, results: dict[str, float]) -> str:
    parts = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(results.items())
             if k.endswith(("pass@1", "sampled_acc"))]
    return f"[step {step}] held-out: " + ", ".join(parts)

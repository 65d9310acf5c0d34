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

from . import checkpoint, metrics, model_source, prompts
from . import distributed as D
from .actor import UPDATE_SUMS, Actor, Schedule, UpdateStats
from .batch import RolloutGroup
from .dispatch import dispatch_kept_groups, update_batches
from .config import Config, ConfigError, to_yaml
from .data import PromptSampler
from .evaluate import evaluate
from .reward import RewardScorer, as_correctness
from .rollout import SamplingSpec, build_engine
from .selection import GroupSelector, Selection, candidates_per_step
from .summary import run_summary
from .warmup import warm_up


ROLLOUTS_FILE = "rollouts.jsonl"


class GRPOTrainer:
    def __init__(self, cfg: Config, world: D.World):
        self.cfg, self.world = cfg, world
        self.run_dir = Path(cfg.trainer.run_dir)
        self.config_dict = {**asdict(cfg), "world_size": world.size}
        self.resume_from = checkpoint.find_resume_folder(self.run_dir, cfg.trainer.resume)
        self.step = 0
        self.totals = {"total/rollouts": 0.0, "total/update_tokens": 0.0,
                       "total/update_groups": 0.0, "total/generated_tokens": 0.0}
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
        self.selector = GroupSelector(cfg, len(self.train), world.device)
        self.sampler = PromptSampler(len(self.train), seed=cfg.trainer.seed)
        self.scorer = RewardScorer(cfg.reward.function, cfg.reward.timeout_s,
                                   cfg.reward.num_workers)
        self.sampling = SamplingSpec(cfg.rollout.temperature, cfg.rollout.top_p,
                                     cfg.rollout.max_new_tokens)
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
        self.rows_per_shard = cfg.trainer.batch_size // (world.size // self.tp)
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
        while self.step < cfg.total_steps:
            step_metrics = self.train_step()
            self.step += 1
            stop = D.any_rank(self.stop_requested) or self.step == cfg.stop_after_steps
            evaluated = bool(self.eval_sets) and (self._due(cfg.eval_every)
                                                  or self.step == cfg.total_steps)
            if evaluated:
                step_metrics.update(self._evaluate())
                self.metrics.write(_eval_line(self.step, step_metrics))
            if evaluated or self._due(cfg.log_every):
                self.metrics.log(self.step, step_metrics)
            self.metrics.advance(self.step, step_metrics)
            if self._due(cfg.save_every) or self.step == cfg.total_steps or stop:
                self._save()
            if stop:
                self.metrics.write(f"stopping after step {self.step} (checkpoint saved)")
                break
        self._finish()

    def train_step(self) -> dict[str, float]:
        timer = metrics.Timer()
        with timer("step"):
            with timer("prompts"):
                prompt_ids, counts = self._next_prompts()
            with timer("rollout"):
                groups = self._rollout(prompt_ids, counts)
                self.engine.sleep()
            with timer("reward"):
                scoring = self._score(groups)
            with timer("select"):
                selection, kept_rows, gathered = self._select(prompt_ids, groups)
            update = self._update(groups, selection, kept_rows, timer)
            with timer("sync"):
                self.engine.load_weights(self.actor.named_weights())
        step_metrics = self._step_metrics(timer, groups, gathered, selection, kept_rows, scoring,
                                          update, counts)
        if self.cfg.trainer.dump_rollouts:
            self._dump(prompt_ids, groups, gathered, kept_rows, step_metrics)
        return step_metrics

    # ================================================================== 1. prompts

    def _next_prompts(self) -> tuple[torch.Tensor, list[int]]:
        """The step's B prompt ids (identical on every rank) and each one's rollout count."""
        B = self.cfg.trainer.batch_size
        epoch_before = self.sampler.epoch
        candidates = torch.tensor(self.sampler.next(self.selector.num_candidates(B)))
        if self.sampler.epoch != epoch_before:
            self.selector.begin_epoch()
        prompt_ids, eligible = self.selector.choose_prompts(candidates, B)
        r = self.cfg.rollout
        if r.allocation:
            counts = self.selector.lze.allocate_rollouts(
                prompt_ids, total=B * r.n, tau=r.allocation_tau, n_min=r.allocation_min,
                n_max=r.allocation_max)
        else:
            counts = torch.full((B,), r.n, dtype=torch.int64)
        counts = torch.where(eligible.to(counts.device), counts, 0)
        return prompt_ids.cpu(), counts.tolist()

    # ================================================================== 2. rollout

    def _shard_rows(self) -> range:
        return range(self.shard * self.rows_per_shard, (self.shard + 1) * self.rows_per_shard)

    def _rollout(self, prompt_ids: torch.Tensor, counts: list[int]) -> list[RolloutGroup]:
        rows = self._shard_rows()
        ids = [int(prompt_ids[i]) for i in rows]
        completions = self.engine.generate(
            [self.train.token_ids[i] for i in ids], [counts[i] for i in rows], self.sampling,
            seed=self._seed("rollout"))
        return [RolloutGroup(row=row, prompt_id=pid, prompt=self.train.token_ids[pid],
                             responses=c, rewards=[]) for row, pid, c in zip(rows, ids, completions)]

    def _seed(self, purpose: str) -> int:
        """Engine seed of this step and shard: a resumed run samples what the lost one did."""
        offset = {"rollout": 0, "eval": 1}[purpose]
        return (self.cfg.trainer.seed * 1_000_003 + self.step * 7919 + self.shard * 104_729
                + offset) % 2**31

    # ================================================================== 3. reward

    def _score(self, groups: list[RolloutGroup]) -> dict[str, float]:
        texts, rows = [], []
        for g in groups:
            for c in g.responses:
                texts.append(self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                rows.append(self.train.rows[g.prompt_id])
        result = self.scorer.score(texts, rows)
        rewards = iter(as_correctness(result.rewards, self.cfg.reward.correct_threshold))
        for g in groups:
            g.rewards = [next(rewards) for _ in g.responses]
        if result.first_error:
            self.metrics.write(f"rank {self.world.rank}: {result.errors} scorer errors this step, "
                               f"first: {result.first_error}")
        return {"reward/scorer_errors": D.all_reduce(result.errors),
                "reward/scorer_timeouts": D.all_reduce(result.timeouts)}

    # ================================================================== 4. select

    def _select(self, prompt_ids: torch.Tensor, groups: list[RolloutGroup]):
        """All-gather the step's rewards, run the selector (same on every rank), read the kept rows
        to the host (the one sync of selection: the update needs them there)."""
        width = self._group_width()
        rewards = torch.zeros(len(groups), width, dtype=torch.float32)
        lengths = torch.zeros(len(groups), width, dtype=torch.int32)
        for i, g in enumerate(groups):
            rewards[i, :len(g.rewards)] = torch.tensor(g.rewards, dtype=torch.float32)
            lengths[i, :len(g.responses)] = torch.tensor([len(c.token_ids) for c in g.responses],
                                                         dtype=torch.int32)
        valid = torch.arange(width) < torch.tensor([[len(g.responses)] for g in groups])
        rewards, valid, lengths = (self._gather_rows(t.to(self.world.device))
                                   for t in (rewards, valid, lengths))
        selection = self.selector.select(rewards, prompt_ids.to(self.world.device), valid, self.step)
        kept_rows = selection.keep_mask.nonzero().flatten().tolist()
        self.selector.raise_if_faulted()
        return selection, kept_rows, (rewards.cpu(), valid.cpu(), lengths.cpu())

    def _group_width(self) -> int:
        r = self.cfg.rollout
        return r.allocation_max if r.allocation else r.n

    def _gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[B, ...] from every engine's [B / engines, ...] (tensor-parallel peers hold copies)."""
        rows, rest = local.shape[0], tuple(local.shape[1:])
        gathered = torch.empty((self.world.size * rows,) + rest, dtype=local.dtype,
                               device=local.device)
        D.all_gather_rows(gathered, local)
        return gathered.view((self.world.size, rows) + rest)[::self.tp].flatten(0, 1)

    # ================================================================== 5. update

    def _update(self, groups: list[RolloutGroup], selection: Selection,
                kept_rows: list[int], timer) -> UpdateStats:
        with timer("dispatch"):
            mine = dispatch_kept_groups(groups, selection.advantages.cpu(), kept_rows,
                                        self.rows_per_shard, self.world, self.tp)
        with timer("update"):
            a = self.cfg.actor
            batches, norms = update_batches(mine, a.mini_batches, a.micro_batch_size,
                                            self.cfg.rollout.max_new_tokens, self.actor.pad_id)
            return self.actor.update(batches, norms)

    # ================================================================== 6-7. log, eval, save

    def _step_metrics(self, timer, groups, gathered, selection: Selection, kept_rows: list[int],
                      scoring: dict, update: UpdateStats, counts: list[int]) -> dict[str, float]:
        rewards, valid, _ = gathered
        B = self.cfg.trainer.batch_size
        responded = valid.any(dim=1)
        sums = dict(zip(UPDATE_SUMS, D.all_reduce_tensor(update.sums).tolist()))
        diff = D.all_reduce(float(update.engine_logprob_abs_diff_max), "max")
        grad_norms = update.grad_norms
        tokens = max(sums["tokens"], 1.0)
        lengths = self._response_lengths(groups)
        m = {
            "reward/mean": float(rewards[valid].mean()) if valid.any() else 0.0,
            "reward/zero_std_frac": float(_zero_std(rewards, valid)[responded].float().mean())
            if responded.any() else 0.0,
            **scoring,
            "sa/kept_groups": float(len(kept_rows)),
            "sa/kept_ratio": len(kept_rows) / B,
            "sa/energy_mean": float(selection.energy.cpu()[responded].mean()) if responded.any() else 0.0,
            "sa/pass_rate_mean": float(selection.pass_rate.cpu()[responded].mean()) if responded.any() else 0.0,
            "sa/skipped_rollouts": float(sum(1 for c in counts if c == 0)),
            "sa/pruned": float(self.selector.num_pruned()),
            "actor/pg_loss": sums["pg_loss"] / tokens,
            "actor/kl": sums["kl"] / tokens,
            "actor/entropy": sums["entropy"] / tokens,
            "actor/clipfrac": sums["clipped_tokens"] / tokens,
            "actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "actor/lr": self.actor.lr,
            "actor/skipped_updates": float(update.skipped_updates),
            "actor/update_tokens": sums["tokens"],
            "rollout/engine_logprob_diff_max": diff,
            **lengths,
        }
        self.totals["total/rollouts"] += float(valid.sum())
        self.totals["total/update_tokens"] += sums["tokens"]
        self.totals["total/update_groups"] += len(kept_rows)
        self.totals["total/generated_tokens"] += lengths["response_length/sum"]
        m.update(self.totals)
        m.update(timer.as_metrics())
        step_s = timer.seconds["step"]
        m["timing_s/select_share"] = timer.seconds["select"] / step_s
        m["perf/tokens_per_s"] = lengths["response_length/sum"] / step_s
        return m

    def _response_lengths(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """This step's responses over all engines (tensor-parallel peers count once)."""
        responses = [c for g in groups for c in g.responses] if self.world.rank % self.tp == 0 else []
        total, count, clipped = D.all_reduce_many([sum(len(c.token_ids) for c in responses),
                                                   len(responses),
                                                   sum(c.truncated for c in responses)])
        return {"response_length/mean": total / max(count, 1), "response_length/sum": total,
                "response_length/clip_ratio": clipped / max(count, 1)}

    def _dump(self, prompt_ids, groups, gathered, kept_rows, step_metrics) -> None:
        """One JSON line per step (rank 0): what was rolled out, scored, kept and trained on,
        with the responses of rank 0's engine as text (like verl's rollout_data_dir)."""
        if not self.world.is_main:
            return
        rewards, valid, lengths = gathered
        record = {
            "step": self.step + 1,
            "prompt_ids": prompt_ids.tolist(),
            "rewards": [r[v].tolist() for r, v in zip(rewards, valid)],
            "response_tokens": [n[v].tolist() for n, v in zip(lengths, valid)],
            "kept_rows": kept_rows,
            "pg_loss": step_metrics["actor/pg_loss"],
            "update_tokens": step_metrics["actor/update_tokens"],
            "responses": [[self.tokenizer.decode(c.token_ids) for c in g.responses] for g in groups],
        }
        with open(self.run_dir / ROLLOUTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _evaluate(self) -> dict[str, float]:
        return evaluate(self.engine, self.eval_sets, self.scorer, self.tokenizer, self.cfg,
                        self.world, self.shard, seed=self._seed("eval"))

    def _evaluate_and_log(self) -> None:
        """Step 0: held-out accuracy before training, and what start-up cost."""
        results = {f"startup_s/{k}": v for k, v in self.startup.seconds.items()}
        if self.eval_sets:
            results.update(self._evaluate())
        self.metrics.log(self.step, results)
        self.metrics.write(_eval_line(self.step, results))

    def _save(self) -> None:
        selector_state = self.selector.state_dict()
        checksums = D.all_gather_object(_checksum(selector_state))
        if len(set(checksums)) != 1:  # the invariant all-gathered selection rests on
            raise RuntimeError(f"ranks hold different selector states (checksums {checksums})")
        state = {"step": self.step, "sampler": self.sampler.state_dict(),
                 "selector": selector_state, "totals": dict(self.totals),
                 "config": self.config_dict, "selector_checksums": checksums}
        checkpoint.save(self.actor.engine, self.run_dir, self.step, state,
                        self.cfg.trainer.keep_checkpoints, self.world.rank)

    def _load(self, folder: Path) -> None:
        state = checkpoint.load(self.actor.engine, folder, self.world.rank, self.config_dict)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.selector.load_state_dict(state["selector"])
        self.totals.update(state["totals"])
        self.engine.load_weights(self.actor.named_weights())
        if self.world.is_main:
            metrics.truncate_jsonl(self.run_dir / ROLLOUTS_FILE, self.step)
        self.metrics.write(f"resumed from {folder} at step {self.step}")

    def _resume_step(self) -> Optional[int]:
        return int(self.resume_from.name.split("_")[1]) if self.resume_from else None

    def _finish(self) -> None:
        if self.step == self.cfg.trainer.total_steps and self.cfg.trainer.save_hf_model:
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
    """A step draws distinct prompts: B (and the pruner's candidates) cannot exceed the data."""
    s = cfg.selection
    drawn = candidates_per_step(s.prune, s.candidate_factor, cfg.trainer.batch_size)
    if drawn > rows:
        what = (f"trainer.batch_size x selection.candidate_factor = {drawn}" if s.prune
                else f"trainer.batch_size = {drawn}")
        raise ConfigError(f"trainer.batch_size: {what} prompts per step, but data.train has only "
                         f"{rows} rows")


def _zero_std(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    high = torch.where(valid, rewards, -math.inf).amax(dim=1)
    low = torch.where(valid, rewards, math.inf).amin(dim=1)
    return high == low


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

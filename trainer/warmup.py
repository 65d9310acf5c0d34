"""Supervised warm-up: a few steps of prompt -> answer training before GRPO (``sft_warmup``).

A model that never produces a correct answer gets zero GRPO gradient (every group has p = 0), so a
small or base model is first taught the task's answer format: on the training prompts, or on
``sft_warmup.data``, examples from elsewhere (a separate stream of the same procedural task, say,
so that the warm-up teaches the task rather than the answers of the GRPO prompts). The result
is written as a Hugging Face checkpoint in the run folder and the GRPO actor and the rollout
engines load it from there; a run with the same warm-up settings (a resumed one, or the same
preset run again) finds it and skips the warm-up; changed settings redo it.
"""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from . import distributed as D
from .actor import Actor, Schedule
from .batch import RolloutGroup, micro_batches, num_micro_batches
from .config import ConfigError
from .data import PromptSampler
from .loss import Normaliser
from .prompts import PromptSet
from .rollout import Completion

DONE = "SFT_COMPLETE"


def warm_up(cfg, world: D.World, model_dir: str, load_examples: Callable[[], PromptSet],
            tokenizer, run_dir: Path, log) -> str:
    """Train ``sft_warmup.steps`` steps from ``model_dir`` on ``load_examples()`` (prompts with
    their reference answers, loaded only when there is no warmed model to reuse); returns the
    warmed model's folder."""
    identity = _identity(cfg)
    out_dir = _cache_folder(cfg, identity, run_dir)
    if (out_dir / DONE).exists() and json.loads((out_dir / DONE).read_text() or "{}") == identity:
        return str(out_dir)
    s = cfg.sft_warmup
    examples = load_examples()
    if len(examples) < s.batch_size:  # a step draws sft_warmup.batch_size distinct examples
        raise ConfigError(f"sft_warmup.batch_size: {s.batch_size} examples per step, but the "
                          f"warm-up has only {len(examples)}")
    actor = Actor(cfg, world, model_dir, Schedule(s.lr, s.steps, warmup_steps=max(1, s.steps // 10),
                                                  kind=s.lr_schedule))
    sampler = PromptSampler(len(examples), seed=_seed(cfg))
    per_rank = s.batch_size // world.size
    eos = [tokenizer.eos_token_id]
    for step in range(1, s.steps + 1):
        rows = sampler.next(s.batch_size)[world.rank * per_rank:(world.rank + 1) * per_rank]
        groups = [_example(examples, i, tokenizer, s.answer_template, eos) for i in rows]
        cap = actor.micro_batch_tokens()
        count = int(D.all_reduce(num_micro_batches(groups, cfg.actor.micro_batch_size, cap), "max"))
        tokens = D.all_reduce(sum(len(g.responses[0].token_ids) for g in groups))
        loss_sum, skipped = actor.sft_update(
            micro_batches(groups, cfg.actor.micro_batch_size, count, actor.pad_id, cap),
            Normaliser(tokens=tokens, sequences=s.batch_size, max_response_length=1))
        loss = D.all_reduce(loss_sum) / max(tokens, 1.0)
        log(step, {"sft/loss": loss, "sft/lr": actor.lr, "sft/skipped_updates": skipped})
    actor.save_pretrained(str(out_dir), tokenizer)
    if world.is_main:
        (out_dir / DONE).write_text(json.dumps(identity))
    D.barrier()
    del actor
    gc.collect()
    return str(out_dir)


def _identity(cfg) -> dict:
    """What the warmed model depends on: its start, its data and the warm-up settings."""
    held_out = cfg.data.eval if cfg.sft_warmup.data and cfg.data.eval_drop_train_prompts else []
    settings = {k: v for k, v in asdict(cfg.sft_warmup).items() if k != "cache_dir"}
    return {"model": cfg.model.path, "train": cfg.data.train, "seed": _seed(cfg),
            "sft_warmup": settings, "dropped_held_out": held_out}


def _seed(cfg) -> int:
    return cfg.trainer.seed + 1 if cfg.sft_warmup.seed is None else cfg.sft_warmup.seed


def _cache_folder(cfg, identity: dict, run_dir: Path) -> Path:
    """The run's own ``sft_model``, or a folder of ``sft_warmup.cache_dir`` named by a digest of
    the settings, which every run with the same settings reuses."""
    if cfg.sft_warmup.cache_dir is None:
        return Path(run_dir) / "sft_model"
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.sft_warmup.cache_dir) / f"sft_model-{digest}"


def _example(examples: PromptSet, i: int, tokenizer, template: str, eos: list[int]) -> RolloutGroup:
    """The prompt and its reference answer as a one-response group (loss on the answer only)."""
    answer = tokenizer(template.format(answer=examples.rows[i]["ground_truth"]),
                       add_special_tokens=False)["input_ids"] + eos
    return RolloutGroup(row=i, prompt_id=i, prompt=examples.token_ids[i],
                        responses=[Completion(answer, [0.0] * len(answer), truncated=False)],
                        rewards=[0.0], advantages=[0.0])

"""LZE and DAPO selection in verl's v1 trainer: a ReplayBuffer that picks each batch's groups.

verl 0.9.1's default trainer (``trainer.use_v1``) asks its ReplayBuffer for each batch
(``sample(global_steps, partition_id, batch_size)``) and trains on exactly the trajectories it
returns; the estimator it calls afterwards sees only fresh uuid4 uids. So v1's selection point is
the buffer (``trainer.v1.sampler.custom_sampler.{path,name}``): it sees every finished group with
its rewards and its dataset row (the ``index`` field the agent loop stores with each trajectory),
and the groups it leaves out cost no log-prob pass and no actor update at all.

:class:`LZEReplayBuffer` (sync trainer only), ``sampler_kwargs.mode``:

* ``topk`` (the default; LZE as its paper runs it, docs/spec.md §4): the trainer has dispatched
  K = ``batch_size`` prompts (``prepare_step``); verl's own ``ReplayBuffer.sample`` waits for
  them and materialises the groups; the selection method keeps whole groups: LZE
  ``floor(K x keep_ratio)`` rounded to the nearest whole number of the mini-batches verl's
  update takes without padding rows (:mod:`.minibatch`, from the trainer's own
  ``_get_required_batch_multiple``), the top by energy (:class:`~lze_kernels.LZESelector`, its
  state keyed by dataset row) and, when fewer groups can learn, the next by energy; DAPO the
  groups whose rewards are not all equal, filled the same way to a whole mini-batch. So v1 adds
  no no-op rows (``upsample_batch_to_divisible_size``) where plain GRPO adds none. Groups of
  unequal size (an agent loop that splits or drops trajectories) are kept whole and counted by
  rows: the leading groups whose rows come nearest to k groups' share of the rows; v1 pads the
  rest as it does for plain GRPO. The dropped groups' trajectories leave TransferQueue.
* ``refill``: trains on K selected groups, paying more rollouts for a full update: the buffer
  dispatches ``ceil(K / keep_ratio) - K`` more prompts through verl's ``refill_fn``, keeps the
  method's pick, and while fewer than K groups are kept it refills the shortfall
  (``ceil(missing / keep_ratio)`` prompts for LZE, ``missing`` for DAPO) and selects again, at
  most ``max_rounds`` rounds. LZE rolls out at least K / keep_ratio prompts per step (more when
  many groups have zero energy).

A dataset row that comes in two groups of one round (verl's dataloader restarts its sampler
between ``gen_batch_size`` fetches, so a round can span two passes) is one observation of the
row (:mod:`.rows`); rounds of one step are separate selector steps, in dispatch order.

Options come from ``trainer.v1.sampler.sampler_kwargs``: ``mode`` (``topk`` / ``refill``),
``method`` (``lze`` / ``dapo``), ``num_prompts`` (dataset size, LZE), ``lze`` (a dict of
:class:`~lze_kernels.LZEConfig` fields), ``success_threshold`` (LZE's pass rate counts a response
as solved when its reward exceeds it; default: the reward itself, which must lie in [0, 1]),
``index_field`` (default ``index``), ``forward`` (forward selection, below), and for ``refill``
``max_rounds`` (default 4) and ``gen_batch_size`` (the refill granularity, must equal
``data.gen_batch_size``; default 1). The selector state is :meth:`state_dict` /
:meth:`load_state_dict`; in a run it travels in verl's ``data.pt`` (the buffer registers itself
in :mod:`.checkpoint`; set ``data.custom_cls`` to its ``LZERLHFDataset``), which v1's loader
restores at every step, an epoch boundary included.

Forward selection in v1 (``sampler_kwargs.forward``: the pruner with replay, GRESO or DOTS): v1
has no sampler hook (``create_rl_sampler`` makes a random or sequential sampler) and dispatches
each step's first ``batch_size`` prompts before the buffer runs, so the choice of prompts has to
be made where the dataloader fetches them: the buffer builds a
:class:`~lze_kernels.integrations.verl.forward.ForwardSampler`, registers it, and
``LZERLHFDataset`` serves the row it picks for every train item verl fetches (the first batch
and every refill). The buffer feeds it every group verl generated, before selecting, so the
next fetch (a refill in this step or the next step's batch) sees them.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from ...config import LZEConfig
from ...selector import LZESelector
from ...greso import GresoConfig, GresoFilter
from ...serialization import load_state_file
from ..selection import check_method, selection_metrics, unit_scores
from . import checkpoint
from .estimator import _layout, group_by_uid
from .forward import ForwardSampler
from .minibatch import group_unit, groups_to_train, leading_groups_near
from .rows import INDEX_FIX, check_row_range, host_rows, select_on_rows

REWARD_FIELD = "rm_scores"  # verl's token-level reward of each trajectory (the canonical one)
MODES = ("topk", "refill")


class LZEReplayBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer whose batches hold the groups LZE (or DAPO) keeps."""

    def __init__(self, trainer_mode: str, trainer_config, max_off_policy_threshold,
                 max_off_policy_strategy: str, sampler_kwargs, poll_interval: float = 2.0,
                 refill_fn=None):
        if trainer_mode != "sync":
            raise ValueError(f"trainer.v1.trainer_mode: LZEReplayBuffer selects on-policy groups "
                             f"of the sync trainer; expected 'sync', got {trainer_mode!r}")
        options = dict(sampler_kwargs or {})
        self.mode = options.pop("mode", "topk")
        if self.mode not in MODES:
            raise ValueError(f"sampler_kwargs.mode: expected one of {MODES}, got {self.mode!r}")
        if self.mode == "refill" and refill_fn is None:
            raise ValueError("refill_fn: LZEReplayBuffer's refill mode needs verl's refill to "
                             "roll out its extra candidates")
        method = check_method(options.pop("method", "lze"), "sampler_kwargs.method")
        super().__init__(trainer_mode, trainer_config, max_off_policy_threshold,
                         max_off_policy_strategy, sampler_kwargs, poll_interval, refill_fn)
        self.method = method
        self.max_rounds = _positive_int(options.pop("max_rounds", 4), "max_rounds")
        self.refill_size = _positive_int(options.pop("gen_batch_size", 1), "gen_batch_size")
        self.index_field = str(options.pop("index_field", "index"))
        threshold = options.pop("success_threshold", None)
        self.score_fn = None if threshold is None else (lambda r: (r > float(threshold)).float())
        num_prompts = options.pop("num_prompts", None)
        config = LZEConfig.from_dict(dict(options.pop("lze", None) or {}))
        forward = options.pop("forward", None)
        if options:
            raise ValueError(f"sampler_kwargs: unknown options {sorted(options)}; expected mode, "
                             "method, num_prompts, lze, max_rounds, gen_batch_size, "
                             "success_threshold, index_field, forward")
        self.keep_ratio = config.keep_ratio if self.method == "lze" else 1.0
        self.selector: Optional[LZESelector] = None
        if self.method == "lze":
            self.selector = LZESelector(num_prompts, config, "cpu")
        self.forward = None if forward is None else self._forward_sampler(dict(forward),
                                                                          num_prompts)
        self.last_metrics: dict = {}
        self._rolled_out_scores: list = []  # every response's score in this step's rounds
        checkpoint.register("replay_buffer", self)
        if self.forward is not None:
            checkpoint.register(checkpoint.FORWARD, self.forward)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        """verl's ``sample``: ``(KVBatchMeta, metrics)`` of the groups the update gets (topk:
        ``floor(batch_size x keep_ratio)`` in whole mini-batches; refill: up to
        ``batch_size``)."""
        if partition_id == "val":
            return super().sample(global_steps, partition_id, batch_size)
        self._rolled_out_scores = []
        if self.mode == "topk":
            batch, metrics = super().sample(global_steps, partition_id, batch_size)
            keys, tags, kept = self._select(batch)
            return self._batch(partition_id, keys, tags, metrics, kept, 1, batch_size)
        return self._sample_with_refills(global_steps, partition_id, batch_size)

    def state_dict(self) -> dict:
        return {} if self.selector is None else {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.selector is not None:
            self.selector.load_state_dict(state["selector"])

    # ------------------------------------------------------------------------- internals

    def _sample_with_refills(self, global_steps: int, partition_id: str, batch_size: int):
        keys, tags, metrics = [], [], {}
        # prepare_step dispatched batch_size prompts; roll out LZE's extra candidates beside them.
        candidates = batch_size + self._refill(self._candidates(batch_size) - batch_size)
        kept_groups = rounds = rolled_out = 0
        while True:
            rounds += 1
            rolled_out += candidates
            batch, round_metrics = super().sample(global_steps, partition_id, candidates)
            _add_counts(metrics, round_metrics)
            round_keys, round_tags, num_kept = self._select(batch, batch_size - kept_groups)
            keys += round_keys
            tags += round_tags
            kept_groups += num_kept
            if kept_groups >= batch_size or rounds >= self.max_rounds:
                break
            candidates = self._refill(self._candidates(batch_size - kept_groups))
        if kept_groups == 0:
            raise RuntimeError(f"LZEReplayBuffer: no group kept in {rounds} rounds (every group "
                               "had equal rewards); raise sampler_kwargs.max_rounds")
        return self._batch(partition_id, keys, tags, metrics, kept_groups, rounds, rolled_out)

    def _batch(self, partition_id, keys, tags, metrics, kept_groups, rounds, rolled_out):
        # verl's own critic/score/* metrics describe the kept groups only.
        score_mean = torch.cat(self._rolled_out_scores).mean().item()
        metrics.update({"lze/rounds": rounds, "lze/kept_groups": kept_groups,
                        "lze/groups_rolled_out": rolled_out,
                        "lze/keep_ratio_effective": kept_groups / rolled_out,
                        "lze/score_mean_rolled_out": score_mean, **self.last_metrics})
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), metrics

    def _candidates(self, groups: int) -> int:
        """Prompts to roll out so that the method can keep ``groups`` of them, rounded up to
        whole dataloader fetches beyond the trainer's own batch."""
        return math.ceil(groups / self.keep_ratio - 1e-9)

    def _refill(self, prompts: int) -> int:
        """Dispatch ``prompts`` (rounded up to whole ``gen_batch_size`` fetches) through verl."""
        if prompts <= 0:
            return 0
        prompts = -(-prompts // self.refill_size) * self.refill_size
        self.refill_fn(prompts)
        return prompts

    def _select(self, batch: KVBatchMeta, wanted: Optional[int] = None):
        """``(keys, tags, num_kept)``: topk (``wanted`` None) the groups the step trains on
        (module docstring); refill the best ``wanted`` of the groups the method selects. The
        others leave TransferQueue."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=[REWARD_FIELD, self.index_field])
        scores = torch.stack([reward.sum() for reward in data[REWARD_FIELD]]).float()
        self._rolled_out_scores.append(scores)
        groups = group_by_uid(np.array([key.split("_")[0] for key in batch.keys], dtype=object),
                              "cpu")
        raw, valid = _layout(scores, groups)
        rows = self._group_rows(data[self.index_field], groups)
        if self.forward is not None:  # every group verl generated, kept or not
            self.forward.observe(torch.as_tensor(rows), unit_scores(raw, valid, self.score_fn),
                                 valid)
        selection = select_on_rows(self.method, self.selector, raw, valid, rows, self.score_fn)
        order, num_selected = selection.ranking()
        if wanted is None:
            groups_wanted = groups_to_train(self.method, len(order), self.keep_ratio,
                                            num_selected, self._update_unit())
            rows_wanted = groups_wanted * len(batch.keys) / len(order)
            count = leading_groups_near(np.bincount(groups.host_row)[order], rows_wanted)
        else:
            count = min(wanted, num_selected)
        self.last_metrics = selection_metrics(selection.selection, self.selector)
        keep_group = np.zeros(len(order), dtype=bool)
        keep_group[order[:count]] = True
        keep = keep_group[groups.host_row]
        dropped = [key for key, kept in zip(batch.keys, keep) if not kept]
        if dropped:
            tq.kv_clear(keys=dropped, partition_id=batch.partition_id)
        keys = [key for key, kept in zip(batch.keys, keep) if kept]
        tags = [tag for tag, kept in zip(batch.tags, keep) if kept]
        return keys, tags, count

    def _update_unit(self) -> int:
        """The fewest groups of ``rollout.n`` rows verl's v1 update takes without padding rows
        (the rows its ``_get_required_batch_multiple`` asks at the actor's data-parallel size,
        read as its ``_balance_batch`` reads it), from the trainer whose
        ``_add_prompts_to_generate`` is the buffer's ``refill_fn``; 1 without one."""
        trainer = getattr(self.refill_fn, "__self__", None)
        if not hasattr(trainer, "_get_required_batch_multiple"):
            return 1
        workers = trainer.actor_rollout_wg
        if "actor" not in workers._dispatch_info:
            workers._dispatch_info["actor"] = workers._query_dispatch_info("actor")
        data_parallel = max(workers._dispatch_info["actor"]) + 1
        return group_unit(trainer._get_required_batch_multiple(data_parallel),
                          trainer.config.actor_rollout_ref.rollout.n)

    def _forward_sampler(self, options: dict, num_prompts) -> ForwardSampler:
        """``sampler_kwargs.forward``: ``method`` (pruner / greso / dots), ``batch_size``
        (``${data.train_batch_size}``), ``seed``; GRESO: ``greso`` (GresoConfig fields); DOTS:
        ``embeddings`` (a torch file of [num_prompts, d] prompt embeddings), ``tau``,
        ``attention_tau``."""
        method = options.pop("method", None)
        if method == "pruner" and self.selector is None:
            raise ValueError("sampler_kwargs.forward.method: the pruner needs "
                             "sampler_kwargs.method 'lze' (its state is LZE's selector)")
        greso = (GresoFilter(num_prompts, GresoConfig(**dict(options.pop("greso", None) or {})))
                 if method == "greso" else None)
        embeddings = options.pop("embeddings", None)
        if embeddings is not None and method != "dots":
            raise ValueError(f"sampler_kwargs.forward.embeddings: only method 'dots' uses prompt "
                             f"embeddings, got method {method!r}")
        if embeddings is not None:
            embeddings = load_state_file(embeddings, "sampler_kwargs.forward.embeddings:")
        unknown = sorted(set(options) - {"batch_size", "seed", "tau", "attention_tau"})
        if unknown:
            raise ValueError(f"sampler_kwargs.forward: unknown options {unknown}; expected method, "
                             "batch_size, seed, greso, embeddings, tau, attention_tau")
        return ForwardSampler(num_prompts, options.pop("batch_size", None), method,
                              selector=self.selector, greso=greso, embeddings=embeddings,
                              **options)

    def _group_rows(self, values, groups) -> np.ndarray:
        """[num_groups] dataset row of each group, checked to be one row per group."""
        if values is None:
            raise ValueError(f"index_field: the trajectories carry no {self.index_field!r} field "
                             f"(the dataset row, from extra_info.index); {INDEX_FIX}")
        listed = values.tolist() if hasattr(values, "tolist") else list(values)
        rows = host_rows(listed, f"index_field ({self.index_field!r})")
        group_rows = rows[groups.host_first]
        if (rows != group_rows[groups.host_row]).any():
            raise ValueError(f"index_field: trajectories of one uid carry different "
                             f"{self.index_field!r} rows")
        if self.selector is not None:
            check_row_range(group_rows, self.selector.num_prompts,
                            f"index_field ({self.index_field!r})")
        return group_rows


def _add_counts(total: dict, new: dict) -> None:
    for key, value in new.items():
        total[key] = total.get(key, 0) + value if isinstance(value, (int, float)) else value


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sampler_kwargs.{name}: expected an int >= 1, got {value!r}")
    return value

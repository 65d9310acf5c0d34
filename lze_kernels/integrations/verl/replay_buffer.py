"""LZE and DAPO selection in verl's v1 trainer: a ReplayBuffer that picks each batch's groups.

verl 0.9.1's default trainer (``trainer.use_v1``) asks its ReplayBuffer for each batch
(``sample(global_steps, partition_id, batch_size)``) and trains on exactly the trajectories it
returns; the estimator it calls afterwards sees only fresh uuid4 uids. So v1's selection point is
the buffer (``trainer.v1.sampler.custom_sampler.{path,name}``): it sees every finished group with
its rewards and its dataset row (the ``index`` field the agent loop stores with each trajectory,
which :class:`~.checkpoint.LZERLHFDataset` sets to the prompt's row in the train set), and the
groups it leaves out cost no log-prob pass and no actor update at all.

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
  most ``max_rounds`` rounds. A batch still short trains short in whole mini-batches (no padding
  rows); rounds that keep no group at all raise a ``ValueError`` naming ``max_rounds``.

Each round's trajectories are read in one order (by row, then session) whatever order the agent
loop finished them in, so ties in the selection fall the same way in every run. A dataset row that
comes in two groups of one round is one observation of the row (:mod:`.rows`); rounds of one step
are separate selector steps, in dispatch order.

**Start-up** (the buffer is built in the trainer's constructor, and reads the trainer's config
through its ``refill_fn``): a colocated reward model is refused (v1 scores it after ``sample``),
as are a dataset class other than ``LZERLHFDataset`` and dataloader workers; a sample that holds
no whole mini-batch to leave out (k would be every group) is said in a warning. The train set,
when verl loads it, reports its size (:meth:`LZEReplayBuffer.use_train_set`): ``num_prompts``
defaults to it. Every prompt's row was checked against the train set's prompt at that row when
``LZERLHFDataset`` served it (:meth:`~.checkpoint.LZERLHFDataset.__getitems__`, before the
rollout), so groups that share a row are taken as draws of one prompt.

Options come from ``trainer.v1.sampler.sampler_kwargs``: ``mode`` (``topk`` / ``refill``),
``method`` (``lze`` / ``dapo``), ``num_prompts`` (the train set's size; default: taken from it),
``lze`` (a dict of :class:`~lze_kernels.LZEConfig` fields), ``success_threshold`` (LZE's pass rate
counts a response as solved when its reward exceeds it; default: the reward itself, which must lie
in [0, 1]), ``index_field`` (default ``index``), ``forward`` (forward selection, below),
``poll_interval`` (seconds between ``sample``'s looks at TransferQueue; default verl's), and for
``refill`` ``max_rounds`` (default 4) and ``gen_batch_size`` (the refill granularity, must equal
``data.gen_batch_size``; default 1). The selector state is :meth:`state_dict` /
:meth:`load_state_dict`; in a run it travels in verl's ``data.pt`` (the buffer registers itself in
:mod:`.checkpoint`; set ``data.custom_cls`` to its ``LZERLHFDataset``), which v1's loader restores
at every step, an epoch boundary included.

Forward selection in v1 (``sampler_kwargs.forward``: the pruner with replay, GRESO or DOTS): v1
has no sampler hook (``create_rl_sampler`` makes a random or sequential sampler) and dispatches
each step's first ``batch_size`` prompts before the buffer runs, so the choice of prompts has to
be made where the dataloader fetches them: the buffer builds a
:class:`~lze_kernels.integrations.verl.forward.ForwardSampler`, registers it, and
``LZERLHFDataset`` serves the row it picks for every train item verl fetches (the first batch
and every refill). The buffer feeds it every group verl generated, after checking the
observation and before the next fetch (a refill in this step or the next step's batch).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
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
from .minibatch import group_unit, groups_to_train, leading_groups_near, no_selection_warning
from .row_table import DATASET_FIX
from .rows import INDEX_FIX, check_row_range, host_rows, select_on_rows

REWARD_FIELD = "rm_scores"  # verl's token-level reward of each trajectory (the canonical one)
MODES = ("topk", "refill")


@dataclass
class Group:
    """One uid group of a round: its trajectories' keys and tags, and how it ranks."""

    keys: list
    tags: list
    varied: bool  # its rewards are not all equal
    energy: float  # LZE energy of its row (0 for DAPO)


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
        poll = options.pop("poll_interval", None)
        super().__init__(trainer_mode, trainer_config, max_off_policy_threshold,
                         max_off_policy_strategy, sampler_kwargs,
                         poll_interval if poll is None else _positive_float(poll, "poll_interval"),
                         refill_fn)
        self.method = method
        self.max_rounds = _positive_int(options.pop("max_rounds", 4), "max_rounds")
        self.refill_size = _positive_int(options.pop("gen_batch_size", 1), "gen_batch_size")
        self.index_field = str(options.pop("index_field", "index"))
        threshold = options.pop("success_threshold", None)
        self.score_fn = None if threshold is None else (lambda r: (r > float(threshold)).float())
        num_prompts = options.pop("num_prompts", None)
        self.num_prompts = None if num_prompts is None else _positive_int(num_prompts,
                                                                         "num_prompts")
        self.lze_config = LZEConfig.from_dict(dict(options.pop("lze", None) or {}))
        forward = options.pop("forward", None)
        if options:
            raise ValueError(f"sampler_kwargs: unknown options {sorted(options)}; expected mode, "
                             "method, num_prompts, lze, max_rounds, gen_batch_size, "
                             "success_threshold, index_field, forward, poll_interval")
        self.keep_ratio = self.lze_config.keep_ratio if self.method == "lze" else 1.0
        self.forward_options = None if forward is None else dict(forward)
        if self.forward_options is not None:
            self._check_forward_options(self.forward_options)
        self.selector: Optional[LZESelector] = None
        self.forward: Optional[ForwardSampler] = None
        self.rows = None  # the train set's RowTable, once the dataset reports it
        self.last_metrics: dict = {}
        self._rolled_out_scores: list = []  # every response's score in this step's rounds
        self._warned = False
        self._restored: Optional[dict] = None  # a state restored before the parts were built
        config = getattr(self._trainer(), "config", None)
        if config is not None:
            self._check_setup(config)
        checkpoint.unregister(checkpoint.FORWARD)  # none of an earlier buffer's in this process
        if self.num_prompts is not None:
            self._build_parts(self.num_prompts)
        checkpoint.register(checkpoint.REPLAY_BUFFER, self)

    def use_train_set(self, dataset) -> None:
        """The train set verl built (:class:`~.checkpoint.LZERLHFDataset` calls this when it
        loads): its size is ``num_prompts`` (taken when not given, else checked), its row table
        holds each row's prompt key (the dataset checks every prompt it serves against it)."""
        size = len(dataset)
        if self.num_prompts is None:
            self.num_prompts = size
            self._build_parts(size)
        elif self.num_prompts != size:
            raise ValueError(f"sampler_kwargs.num_prompts: {self.num_prompts} given, but the "
                             f"train set has {size} rows (after its files are joined and "
                             "data.filter_overlong_prompts has run); leave num_prompts out to "
                             "take the train set's size")
        self.rows = checkpoint.row_table(dataset)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        """verl's ``sample``: ``(KVBatchMeta, metrics)`` of the groups the update gets (topk:
        ``floor(batch_size x keep_ratio)`` in whole mini-batches; refill: ``batch_size``, or
        fewer whole mini-batches when ``max_rounds`` ran out)."""
        if partition_id == "val":
            return super().sample(global_steps, partition_id, batch_size)
        if self.method == "lze" and self.selector is None:
            raise ValueError("sampler_kwargs.num_prompts: LZE needs the train set's size; give "
                             "it, or load the train set with data.custom_cls LZERLHFDataset, "
                             "which reports it")
        self._rolled_out_scores = []
        if self.mode == "topk":
            batch, metrics = super().sample(global_steps, partition_id, batch_size)
            ranked, num_selected = self._rank(batch)
            unit = self._update_unit()
            wanted = groups_to_train(self.method, len(ranked), self.keep_ratio, num_selected,
                                     unit)
            self._warn_once(len(ranked), unit)
            rows_wanted = wanted * len(batch.keys) / len(ranked)
            count = leading_groups_near(np.array([len(g.keys) for g in ranked]), rows_wanted)
            _clear(ranked[count:], partition_id)
            return self._batch(partition_id, ranked[:count], metrics, 1, len(ranked))
        return self._sample_with_refills(global_steps, partition_id, batch_size)

    def state_dict(self) -> dict:
        return {} if self.selector is None else {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.method == "lze" and self.selector is None:  # built when the train set loads
            self._restored = state
        elif self.selector is not None:
            self.selector.load_state_dict(state["selector"])

    # ------------------------------------------------------------------------- internals

    def _trainer(self):
        """The v1 trainer whose ``_add_prompts_to_generate`` is the buffer's ``refill_fn``."""
        return getattr(self.refill_fn, "__self__", None)

    def _check_setup(self, config) -> None:
        """Refuse at start-up what the selection cannot serve, and say when it cannot act."""
        reward_model = config.reward.reward_model
        if reward_model.enable and not reward_model.get("enable_resource_pool", False):
            raise ValueError(
                "reward.reward_model.enable_resource_pool: with a colocated reward model verl's "
                "v1 trainer scores each batch after the replay buffer's sample(), so "
                "LZEReplayBuffer would select before any reward exists. Give the reward model "
                "its own pool (reward.reward_model.enable_resource_pool=true: the agent loop "
                "scores each rollout before sample()), or use the legacy trainer "
                "(LZERayPPOTrainer scores before it selects)")
        dataset_cls = _dataset_class(config.data)
        if not (isinstance(dataset_cls, type) and issubclass(dataset_cls, checkpoint.LZERLHFDataset)):
            raise ValueError(f"data.custom_cls: LZEReplayBuffer needs LZERLHFDataset (the "
                             f"selection state travels in its data.pt entry, and it keys each "
                             f"prompt by its row), got {getattr(dataset_cls, '__name__', None)}; "
                             f"set {DATASET_FIX}")
        train_files = checkpoint.file_list(config.data.get("train_files"))
        if (self.forward_options is not None and train_files
                and checkpoint.file_list(config.data.get("val_files")) == train_files):
            raise ValueError("data.val_files: the same files as data.train_files; with "
                             "sampler_kwargs.forward, LZERLHFDataset serves the forward sampler's "
                             "rows to every item of a dataset of the train files, the validation "
                             "set's too (its draws would leave the sampler's sequence): give the "
                             "validation set files of its own")
        if config.data.get("dataloader_num_workers", 0) != 0:
            raise ValueError(f"data.dataloader_num_workers: LZE selection needs 0, got "
                             f"{config.data.dataloader_num_workers} (a worker's copy of the "
                             "dataset would select on stale state)")
        if self.mode == "topk":
            sync_step = int(self.trainer_config.get("parameter_sync_step", 1) or 1)
            mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
            self._warn_once(config.data.train_batch_size // sync_step, mini)

    def _warn_once(self, num_groups: int, unit: int) -> None:
        message = no_selection_warning(self.method, num_groups, self.keep_ratio, unit)
        if message is not None and not self._warned:
            self._warned = True
            warnings.warn(f"LZEReplayBuffer: {message}", stacklevel=3)

    def _build_parts(self, num_prompts: int) -> None:
        """The selector (LZE) and the forward sampler for a train set of ``num_prompts``."""
        if self.method == "lze":
            self.selector = LZESelector(num_prompts, self.lze_config, "cpu")
            if self._restored is not None:
                self.selector.load_state_dict(self._restored.pop("selector"))
                self._restored = None
        if self.forward_options is not None:
            self.forward = self._forward_sampler(dict(self.forward_options), num_prompts)
            checkpoint.register(checkpoint.FORWARD, self.forward)

    def _sample_with_refills(self, global_steps: int, partition_id: str, batch_size: int):
        kept, others, metrics = [], [], {}
        # prepare_step dispatched batch_size prompts; roll out LZE's extra candidates beside them.
        candidates = batch_size + self._refill(self._candidates(batch_size) - batch_size)
        rounds = rolled_out = 0
        while True:
            rounds += 1
            rolled_out += candidates
            batch, round_metrics = super().sample(global_steps, partition_id, candidates)
            _add_counts(metrics, round_metrics)
            ranked, num_selected = self._rank(batch)
            count = min(batch_size - len(kept), num_selected)
            kept += ranked[:count]
            others += ranked[count:]
            if len(kept) >= batch_size or rounds >= self.max_rounds:
                break
            candidates = self._refill(self._candidates(batch_size - len(kept)))
        if not kept:
            _clear(others, partition_id)
            raise ValueError(
                f"sampler_kwargs.max_rounds: no group could be kept in {rounds} rounds "
                f"({rolled_out} prompts rolled out, every group's rewards equal); raise "
                f"max_rounds (it is {self.max_rounds}), or use mode=topk")
        trained = self._whole_units(kept, others, batch_size)
        chosen = {id(g) for g in trained}
        _clear([g for g in kept + others if id(g) not in chosen], partition_id)
        return self._batch(partition_id, trained, metrics, rounds, rolled_out)

    def _whole_units(self, kept: list, others: list, batch_size: int) -> list:
        """A short refill batch trains short, in whole mini-batches (no padding rows): the kept
        groups cut to whole units, or filled to one unit with the best of the other groups
        rolled out (groups whose rewards differ first, then by energy)."""
        if len(kept) >= batch_size:
            return kept
        unit = self._update_unit()
        if len(kept) >= unit:
            return kept[: len(kept) // unit * unit]
        best = sorted(others, key=lambda g: (not g.varied, -g.energy))
        return kept + best[: unit - len(kept)]

    def _batch(self, partition_id, groups: list, metrics, rounds, rolled_out):
        # verl's own critic/score/* metrics describe the kept groups only.
        score_mean = torch.cat(self._rolled_out_scores).mean().item()
        metrics.update({"lze/rounds": rounds, "lze/kept_groups": len(groups),
                        "lze/groups_rolled_out": rolled_out,
                        "lze/keep_ratio_effective": len(groups) / rolled_out,
                        "lze/score_mean_rolled_out": score_mean, **self.last_metrics})
        keys = [key for g in groups for key in g.keys]
        tags = [tag for g in groups for tag in g.tags]
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

    def _rank(self, batch: KVBatchMeta) -> tuple[list, int]:
        """``(groups, num_selected)``: the round's uid groups best first
        (:meth:`~.rows.RowSelection.ranking`) and how many the method selects. The forward
        sampler observes every group, after both its and the selection's checks passed."""
        keys, tags, scores, row_values = self._read(batch)
        self._rolled_out_scores.append(scores)
        groups = group_by_uid(np.array([key.split("_")[0] for key in keys], dtype=object), "cpu")
        raw, valid = _layout(scores, groups)
        rows = self._group_rows(row_values, groups)
        # The train set's LZERLHFDataset checked each prompt against its row when it served it.
        group_keys = None if self.rows is None else self.rows.prompt_key[rows]
        observed = None
        if self.forward is not None:  # every group verl generated, kept or not
            observed = (torch.as_tensor(rows), unit_scores(raw, valid, self.score_fn), valid)
            self.forward.check_observation(*observed)
        selection = select_on_rows(self.method, self.selector, raw, valid, rows, self.score_fn,
                                   group_keys)
        if observed is not None:
            self.forward.observe(*observed)
        order, num_selected = selection.ranking()
        self.last_metrics = selection_metrics(selection.selection, self.selector)
        energy = selection.group_energy()
        energy = (np.zeros(len(order)) if energy is None else energy.float().numpy())
        varied = selection.varied.cpu().numpy()
        members = [[] for _ in order]
        for position, group in enumerate(groups.host_row.tolist()):
            members[group].append(position)
        ranked = [Group([keys[i] for i in members[g]], [tags[i] for i in members[g]],
                        bool(varied[g]), float(energy[g])) for g in order]
        return ranked, num_selected

    def _read(self, batch: KVBatchMeta):
        """The round's trajectories ``(keys, tags, scores, rows)`` in one order whatever order
        TransferQueue got them in (the agent loop's rollouts finish in any order): by dataset
        row, then session. So ties in the selection (equal energies, the groups that fill k by
        energy) fall the same way in every run, a resumed one included."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=[REWARD_FIELD, self.index_field])
        values = data[self.index_field]
        if values is None:
            raise ValueError(f"index_field: the trajectories carry no {self.index_field!r} field "
                             f"(the dataset row, from extra_info.index); {INDEX_FIX}")
        rows = host_rows(values.tolist() if hasattr(values, "tolist") else list(values),
                         f"index_field ({self.index_field!r})")
        sessions = np.array([int(key.split("_")[1]) for key in batch.keys])
        order = np.lexsort((sessions, rows)).tolist()
        rewards = list(data[REWARD_FIELD])
        scores = torch.stack([rewards[i].sum() for i in order]).float()
        return ([batch.keys[i] for i in order], [batch.tags[i] for i in order], scores,
                rows[order])

    def _update_unit(self) -> int:
        """The fewest groups of ``rollout.n`` rows verl's v1 update takes without padding rows
        (the rows its ``_get_required_batch_multiple`` asks at the actor's data-parallel size,
        read as its ``_balance_batch`` reads it), from the trainer whose
        ``_add_prompts_to_generate`` is the buffer's ``refill_fn``; 1 without one."""
        trainer = self._trainer()
        if not hasattr(trainer, "_get_required_batch_multiple"):
            return 1
        workers = trainer.actor_rollout_wg
        if "actor" not in workers._dispatch_info:
            workers._dispatch_info["actor"] = workers._query_dispatch_info("actor")
        data_parallel = max(workers._dispatch_info["actor"]) + 1
        return group_unit(trainer._get_required_batch_multiple(data_parallel),
                          trainer.config.actor_rollout_ref.rollout.n)

    def _check_forward_options(self, options: dict) -> None:
        method = options.get("method")
        if method == "pruner" and self.method != "lze":
            raise ValueError("sampler_kwargs.forward.method: the pruner needs "
                             "sampler_kwargs.method 'lze' (its state is LZE's selector)")
        if options.get("embeddings") is not None and method != "dots":
            raise ValueError(f"sampler_kwargs.forward.embeddings: only method 'dots' uses prompt "
                             f"embeddings, got method {method!r}")
        unknown = sorted(set(options) - {"method", "batch_size", "seed", "greso", "embeddings",
                                         "tau", "attention_tau"})
        if unknown:
            raise ValueError(f"sampler_kwargs.forward: unknown options {unknown}; expected method, "
                             "batch_size, seed, greso, embeddings, tau, attention_tau")

    def _forward_sampler(self, options: dict, num_prompts: int) -> ForwardSampler:
        """``sampler_kwargs.forward``: ``method`` (pruner / greso / dots), ``batch_size``
        (default ``data.train_batch_size``, which it must equal), ``seed``; GRESO: ``greso``
        (GresoConfig fields); DOTS: ``embeddings`` (a torch file of [num_prompts, d] prompt
        embeddings), ``tau``, ``attention_tau``."""
        method = options.pop("method", None)
        greso = (GresoFilter(num_prompts, GresoConfig(**dict(options.pop("greso", None) or {})))
                 if method == "greso" else None)
        embeddings = options.pop("embeddings", None)
        if embeddings is not None:
            embeddings = load_state_file(embeddings, "sampler_kwargs.forward.embeddings:")
        config = getattr(self._trainer(), "config", None)
        batch = None if config is None else config.data.train_batch_size
        batch_size = options.pop("batch_size", batch)
        if batch is not None and batch_size != batch:
            raise ValueError(f"sampler_kwargs.forward.batch_size: {batch_size}, but "
                             f"data.train_batch_size is {batch}; the forward sampler draws each "
                             "step's batch (leave it out to take train_batch_size)")
        return ForwardSampler(num_prompts, batch_size, method, selector=self.selector,
                              greso=greso, embeddings=embeddings, **options)

    def _group_rows(self, rows: np.ndarray, groups) -> np.ndarray:
        """[num_groups] dataset row of each group, checked to be one row per group."""
        group_rows = rows[groups.host_first]
        if (rows != group_rows[groups.host_row]).any():
            raise ValueError(f"index_field: trajectories of one uid carry different "
                             f"{self.index_field!r} rows")
        if self.num_prompts is not None:
            check_row_range(group_rows, self.num_prompts, f"index_field ({self.index_field!r})")
        return group_rows


def _clear(groups: list, partition_id: str) -> None:
    """The groups' trajectories leave TransferQueue."""
    keys = [key for g in groups for key in g.keys]
    if keys:
        tq.kv_clear(keys=keys, partition_id=partition_id)


def _dataset_class(data_config):
    """The dataset class verl's ``create_rl_dataset`` will build (``data.custom_cls``)."""
    from verl.utils.dataset.rl_dataset import get_dataset_class

    return get_dataset_class(data_config)


def _add_counts(total: dict, new: dict) -> None:
    for key, value in new.items():
        total[key] = total.get(key, 0) + value if isinstance(value, (int, float)) else value


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sampler_kwargs.{name}: expected an int >= 1, got {value!r}")
    return value


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"sampler_kwargs.{name}: expected a number > 0, got {value!r}")
    return float(value)

"""LZE selection in verl's legacy trainer (``RayPPOTrainer``, ``trainer.use_v1=false``).

The order of one step of ``RayPPOTrainer.fit`` in verl 0.9.1: rollout, with the rewards scored
beside it by the agent loop's reward workers (``rm_scores``); ``_balance_batch`` (when
``trainer.balance_batch``); ``global_token_num`` from the attention masks; a colocated reward
model, if any; old log-probs; reference log-probs; advantages (the estimator); the actor update.
``_balance_batch`` is the one overridable method between the rewards and the first log-prob
pass, so :class:`LZERayPPOTrainer` selects there and **drops the rows** of the groups it does
not keep: only the kept groups' ``k x n`` rows reach the old-log-prob pass, the reference pass
and the update, and every count verl takes afterwards (``global_token_num``, the loss's token
normaliser, which the actor worker sums from each mini-batch's ``response_mask``) counts kept
tokens only, so the update is plain GRPO on a batch of the kept groups. The overrides:

* ``__init__`` checks the settings and the train set (:func:`check_settings`,
  :func:`check_train_set`): the selection parts sized to it, its rows what LZE keys prompts by;
* ``_get_gen_batch`` (right after ``fit`` makes the step's uids, while the batch still holds
  the dataset rows, ``index``, and the prompts, ``raw_prompt``) checks each prompt against the
  train set's prompt at its row (:meth:`~.row_table.RowTable.check`, before the rollout) and
  remembers uid -> row and prompt key (not while ``_validate`` runs);
* ``_balance_batch``: a colocated reward model scores the batch here instead of after it (fit
  then finds ``rm_scores`` and does not score again); the registered
  :class:`~.estimator.LZEAdvantage`
  (``algorithm.adv_estimator=<its name>``) selects, which uses up the step's binding (one
  selector step per batch, whatever raises after it); a :class:`~.forward.ForwardSampler` given
  as ``train_sampler`` observes every group generated (its observation checked before the
  selection); the batch is cut in place to the kept groups, and the estimator is told which
  groups remain (:meth:`~.estimator.LZEAdvantage.expect_selected`: ``compute_advantage`` then
  computes verl's GRPO advantages of those groups, with no second selection); then verl's own
  ``_balance_batch`` on the cut batch;
* ``init_workers`` prints the kept-group count and the effective keep ratio, and warns when
  the selection cannot leave any group out (k rounds up to every group);
* ``_save_checkpoint`` / ``_load_checkpoint`` keep the selection state in
  ``global_step_N/lze_selection.pt``, beside verl's ``data.pt``, which verl skips on a resume at
  an epoch boundary (``global_steps % steps_per_epoch == 0``).

How many groups go on (fixed per step for LZE, :mod:`.minibatch`): verl splits the update into
mini-batches of ``ppo_mini_batch_size x n`` rows and the batch over the data-parallel ranks (with
``actor.use_prefix_grouper``, whole groups per rank), so LZE keeps ``floor(B x keep_ratio)``
groups rounded to the nearest whole number of mini-batches (``lze/keep_ratio_effective`` logs
the result every step). The groups are the selector's top-k by energy, in the order of
:meth:`~.rows.RowSelection.ranking`; when fewer groups than k can learn (groups whose rewards are
all equal have zero advantages), the rest of the k are the next groups by energy, as plain GRPO
on a batch of k groups would train on them. DAPO keeps the groups whose rewards are not all
equal, filled the same way up to the next whole mini-batch. Every group must have ``rollout.n``
responses (verl's legacy ``fit`` joins the rollout to the batch row by row).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Optional

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from ...serialization import load_state_file
from ..selection import selection_metrics, unit_scores
from .estimator import LZEAdvantage, Selected, UidRows, _layout, group_by_uid
from .checkpoint import LZERLHFDataset, row_table
from .forward import ForwardSampler
from .minibatch import group_unit, groups_to_train, no_selection_warning
from .row_table import DATASET_FIX
from .rows import INDEX_FIX

SELECTION_FILE = "lze_selection.pt"
_FORMAT = "lze_kernels.verl.legacy/1"


class LZERayPPOTrainer(RayPPOTrainer):
    """verl's legacy ``RayPPOTrainer`` that trains only on the groups LZE (or DAPO) keeps and
    feeds a forward sampler. Takes ``RayPPOTrainer``'s arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._binding: Optional[UidRows] = None
        self._validating = False
        estimator = self._estimator()
        check_settings(self.config, self.train_dataloader, estimator)
        self.rows = None
        if estimator is not None or self._forward_sampler() is not None:
            self.rows = check_train_set(self.train_dataset, self.train_dataloader, estimator)

    def init_workers(self):
        super().init_workers()
        estimator = self._estimator()
        if estimator is None:
            return
        batch = self.config.data.train_batch_size
        if estimator.method == "lze":
            kept = self.groups_to_keep(batch, estimator, 0)
            print(f"LZE keeps {kept} of {batch} groups per step ({kept * self._rollout_n()} "
                  f"rows past the reward): keep_ratio_effective {kept / batch:.4g} for keep_ratio "
                  f"{estimator.selector.config.keep_ratio}, in whole mini-batches of "
                  f"ppo_mini_batch_size groups")
        message = no_selection_warning(estimator.method, batch, _keep_ratio(estimator),
                                       update_unit(self.config, self._dp_size()))
        if message is not None:
            warnings.warn(f"LZERayPPOTrainer: {message}", stacklevel=2)

    def _get_gen_batch(self, batch):
        if not self._validating:  # validation batches are not selected on
            self.bind_rows(batch)
        return super()._get_gen_batch(batch)

    def _validate(self, *args, **kwargs):
        self._validating = True
        try:
            return super()._validate(*args, **kwargs)
        finally:
            self._validating = False

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        self.select_rows(batch, metrics)
        return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)

    def _save_checkpoint(self):
        super()._save_checkpoint()
        state = self.selection_state_dict()
        if len(state) > 1:
            torch.save(state, os.path.join(self.config.trainer.default_local_dir,
                                           f"global_step_{self.global_steps}", SELECTION_FILE))

    def _load_checkpoint(self):
        resumed = super()._load_checkpoint()
        if self.global_steps > 0 and len(self.selection_state_dict()) > 1:
            path = os.path.join(self._resumed_folder(), SELECTION_FILE)
            if not os.path.exists(path):
                raise ValueError(f"{path}: the checkpoint holds no LZE selection state (was it "
                                 "written by LZERayPPOTrainer?); resuming without it would "
                                 "start the selection afresh")
            self.load_selection_state_dict(load_state_file(path, "LZE selection state"))
        return resumed

    # ------------------------------------------------------------------------- the hooks' work

    def bind_rows(self, batch) -> None:
        """Remember the step's uid -> dataset row and prompt key (``non_tensor_batch`` ``uid``,
        ``index`` and ``raw_prompt``), each prompt checked against the train set's prompt at
        its row first: a batch whose rows are not the train set's is refused before its
        rollout, nothing changed."""
        data = batch.non_tensor_batch
        if "index" not in data:
            raise ValueError(f"index: the batch carries no dataset rows (non_tensor_batch"
                             f"['index'], from extra_info.index); {INDEX_FIX}")
        if "raw_prompt" not in data:
            raise ValueError("raw_prompt: the batch carries no prompts (non_tensor_batch"
                             "['raw_prompt'], which verl's RLHFDataset sets); LZE checks every "
                             "step's rows by their prompts")
        binding = UidRows(data["uid"], data["index"], data["raw_prompt"])
        if getattr(self, "rows", None) is not None:
            self.rows.check(binding.rows, binding.keys)
        self._binding = binding

    def select_rows(self, batch, metrics: dict) -> None:
        """Feed the forward sampler, select, and cut ``batch`` in place to the kept groups. The
        selector's step and the use of the step's uid binding commit together: whatever raises
        after the step, a second call on the same step's batch is refused, not selected again;
        the sampler's observation is checked before the step, so a bad one changes nothing."""
        estimator, sampler = self._estimator(), self._forward_sampler()
        if estimator is None and sampler is None:
            return
        self._score_with_reward_model(batch)
        uids = batch.non_tensor_batch["uid"]
        rows, keys = self._response_rows(uids)
        groups = group_by_uid(uids, "cpu")
        group_rows = rows[groups.host_first]
        rewards = batch.batch["rm_scores"]
        score_fn = None if estimator is None else estimator.score_fn
        observation = None
        if sampler is not None:
            raw, valid = _layout(rewards.sum(dim=-1).float().cpu(), groups)
            observation = _observation(group_rows, raw, valid, score_fn)
            sampler.check_observation(*observation)
        if estimator is None:
            self._binding = None
            sampler.observe(*observation)
            return
        selected = estimator.select(rewards, batch.batch["response_mask"], uids,
                                    prompt_index=rows, equal_groups=True, prompt_keys=keys)
        self._binding = None  # the step is taken: the binding goes with it
        if sampler is not None:
            sampler.observe(*observation)
        rolled_out = selected.groups.host_first.shape[0]
        kept_groups, kept_rows = self._cut_to_kept(batch, selected, estimator)
        estimator.expect_selected(batch.non_tensor_batch["uid"], selected)
        metrics.update(selection_metrics(selected.rows.selection, estimator.selector))
        # verl's own critic/score/* metrics describe the kept rows from here on.
        metrics.update({"lze/groups_rolled_out": rolled_out,
                        "lze/rows_past_reward": kept_rows,
                        "lze/keep_ratio_effective": kept_groups / rolled_out,
                        "lze/score_mean_rolled_out": float(selected.scores.mean())})

    def groups_to_keep(self, num_groups: int, estimator: LZEAdvantage, num_selected: int) -> int:
        """The groups one step keeps (module docstring): whole mini-batches whose rows divide
        among the data-parallel ranks."""
        return groups_to_keep(self.config, num_groups, estimator, num_selected, self._dp_size())

    def selection_state_dict(self) -> dict:
        """The selection parts' state (what ``lze_selection.pt`` holds)."""
        state = {"format": _FORMAT}
        estimator, sampler = self._estimator(), self._forward_sampler()
        if estimator is not None and estimator.selector is not None:
            state["estimator"] = estimator.state_dict()
        if sampler is not None:
            state["forward_sampler"] = sampler.state_dict()
        return state

    def load_selection_state_dict(self, state: dict) -> None:
        expected = set(self.selection_state_dict())
        if not isinstance(state, dict) or state.get("format") != _FORMAT or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state: expected an LZERayPPOTrainer selection state with "
                             f"{sorted(expected)}, got {got}")
        if "estimator" in state:
            self._estimator().load_state_dict(state["estimator"])
        if "forward_sampler" in state:
            self._forward_sampler().load_state_dict(state["forward_sampler"])

    # ------------------------------------------------------------------------- internals

    def _estimator(self) -> Optional[LZEAdvantage]:
        estimator = _registered_estimator(self.config.algorithm.adv_estimator)
        return estimator if isinstance(estimator, LZEAdvantage) else None

    def _forward_sampler(self) -> Optional[ForwardSampler]:
        sampler = self.train_dataloader.sampler
        return sampler if isinstance(sampler, ForwardSampler) else None

    def _rollout_n(self) -> int:
        return self.config.actor_rollout_ref.rollout.n

    def _dp_size(self) -> int:
        return self._get_dp_size(self.actor_rollout_wg, "actor")

    def _response_rows(self, uids) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, prompt keys)`` [bs] of the responses, by the step's binding."""
        uids = uids.tolist()
        missing = uids if self._binding is None else self._binding.missing(uids)
        if missing:
            raise ValueError(f"uid: {len(missing)} responses carry uids with no dataset row bound "
                             f"(e.g. {missing[0]!r}); LZERayPPOTrainer binds each step's uids in "
                             "_get_gen_batch and its selection uses the binding up, so "
                             "_balance_batch selects once per step")
        return self._binding.lookup(uids)

    def _score_with_reward_model(self, batch) -> None:
        """A colocated reward model scores after ``_balance_batch`` in ``fit``: score here."""
        if "rm_scores" in batch.batch.keys():
            return
        if not self.use_rm:
            raise ValueError("rm_scores: the batch reached _balance_batch without rewards and "
                             "no reward model is configured; LZE selects on the rewards the "
                             "agent loop's reward workers (or a reward model) give each rollout")
        batch.union(self._compute_reward_colocate(batch))


    def _cut_to_kept(self, batch, selected: Selected,
                     estimator: LZEAdvantage) -> tuple[int, int]:
        """Keep the rows of the step's first k groups by the method's ranking (in batch order);
        returns the groups and the rows kept."""
        order, num_selected = selected.rows.ranking()
        count = self.groups_to_keep(len(order), estimator, num_selected)
        chosen = np.zeros(len(order), dtype=bool)
        chosen[order[:count]] = True
        rows = np.flatnonzero(chosen[selected.groups.host_row])
        batch.reorder(torch.from_numpy(rows))
        return count, rows.shape[0]

    def _resumed_folder(self) -> str:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from."""
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            return os.path.abspath(trainer.resume_from_path)
        return os.path.join(os.path.abspath(trainer.default_local_dir),
                            f"global_step_{self.global_steps}")


def check_settings(config, dataloader, estimator: Optional[LZEAdvantage]) -> None:
    """Refuse the settings under which the selection would act late or on stale state."""
    sampler = dataloader.sampler if isinstance(dataloader.sampler, ForwardSampler) else None
    if sampler is not None and dataloader.num_workers != 0:
        raise ValueError(f"data.dataloader_num_workers: the forward sampler needs 0 (got "
                         f"{dataloader.num_workers}): worker processes prefetch batches drawn "
                         "before the previous step's rewards are observed")
    if (estimator is not None or sampler is not None) and not config.trainer.balance_batch:
        raise ValueError("trainer.balance_batch: LZERayPPOTrainer selects in _balance_batch, "
                         "the one step of fit between the rewards and the log-prob passes; set "
                         "it to true")
    if sampler is not None and sampler.method == "pruner" and (
            estimator is None or sampler.selector is not estimator.selector):
        raise ValueError("train_sampler: the pruner skips the prompts the registered "
                         "LZEAdvantage's selector has pruned; build it with "
                         "selector=<that estimator>.selector")


def check_train_set(dataset, dataloader, estimator: Optional[LZEAdvantage]):
    """The train set's :class:`~.row_table.RowTable`, after checking at start-up that the
    selection parts are sized to it and that its rows are what LZE keys prompts by: a dataset
    class that is no verl ``RLHFDataset`` is refused (``data.custom_cls``); an ``RLHFDataset``
    other than :class:`~.checkpoint.LZERLHFDataset` hands verl ``extra_info.index`` as the row,
    which must then be each row's position (one file, nothing filtered)."""
    rows = row_table(dataset)
    if not isinstance(dataset, LZERLHFDataset) and not rows.positions_are_indices():
        raise ValueError(f"train_dataset: verl's dataset hands each prompt's extra_info.index to "
                         f"the selection as its row, and here it is not the row's position "
                         f"({rows.describe()}): LZE would keep a prompt's history under another "
                         f"prompt. Fix: {DATASET_FIX}")
    sizes = {"the train set": len(rows)}
    if estimator is not None and estimator.selector is not None:
        sizes["the LZEAdvantage's num_prompts"] = estimator.selector.num_prompts
    sampler = dataloader.sampler
    if isinstance(sampler, ForwardSampler):
        sizes["the train_sampler's num_prompts"] = sampler.num_prompts
        if sampler.batch_size != dataloader.batch_size:
            raise ValueError(f"train_sampler: its batch_size is {sampler.batch_size}, the "
                             f"dataloader's (data.train_batch_size) {dataloader.batch_size}; "
                             "build the ForwardSampler with the train batch size")
    if len(set(sizes.values())) > 1:
        raise ValueError("num_prompts: the selection parts and the train set disagree on its "
                         f"size ({', '.join(f'{k} {v}' for k, v in sizes.items())}); build them "
                         "with num_prompts=len(train_dataset), after filtering")
    return rows


def _observation(group_rows, raw, valid, score_fn):
    """A forward sampler's ``observe`` arguments for a step's groups."""
    rewards = unit_scores(raw, valid, score_fn).float().cpu()
    return torch.from_numpy(group_rows), rewards, None if valid is None else valid.cpu()


def update_unit(config, dp: int) -> int:
    """The fewest groups an update takes at a data-parallel size ``dp``: whole
    ``ppo_mini_batch_size`` mini-batches whose rows divide by ``dp`` (with
    ``use_prefix_grouper``, whose groups do)."""
    actor, n = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout.n
    return group_unit(math.lcm(actor.ppo_mini_batch_size * n, dp), n, dp,
                      whole_groups_per_rank=bool(actor.get("use_prefix_grouper", False)))


def _keep_ratio(estimator: LZEAdvantage) -> float:
    return estimator.selector.config.keep_ratio if estimator.selector is not None else 1.0


def groups_to_keep(config, num_groups: int, estimator: LZEAdvantage, num_selected: int,
                   dp: int) -> int:
    """:meth:`LZERayPPOTrainer.groups_to_keep` for a data-parallel size ``dp`` (units of
    :func:`update_unit`)."""
    return groups_to_train(estimator.method, num_groups, _keep_ratio(estimator), num_selected,
                           update_unit(config, dp))


def _registered_estimator(name):
    try:
        return get_adv_estimator_fn(name)
    except ValueError:  # verl's built-in branches (gae, grpo) are not in the registry
        return None

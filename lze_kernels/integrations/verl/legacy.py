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

* ``_get_gen_batch`` (right after ``fit`` makes the step's uids, while the batch still holds
  the dataset rows, ``index``) remembers uid -> row;
* ``_balance_batch``: a colocated reward model scores the batch here instead of after it (fit
  then finds ``rm_scores`` and does not score again); a :class:`~.forward.ForwardSampler` given
  as ``train_sampler`` observes every group generated; the registered
  :class:`~.estimator.LZEAdvantage` (``algorithm.adv_estimator=<its name>``) selects, the batch is
  cut in place to the kept groups, and the estimator is told which groups remain
  (:meth:`~.estimator.LZEAdvantage.expect_selected`: ``compute_advantage`` then computes verl's
  GRPO advantages of those groups, with no second selection); then verl's own ``_balance_batch``
  on the cut batch;
* ``init_workers`` checks the kept-group count against the data-parallel size;
* ``_save_checkpoint`` / ``_load_checkpoint`` keep the selection state in
  ``global_step_N/lze_selection.pt``, beside verl's ``data.pt``, which verl skips on a resume at
  an epoch boundary (``global_steps % steps_per_epoch == 0``).

How many groups go on (fixed per step for LZE): verl splits the update into mini-batches of
``ppo_mini_batch_size x n`` rows and the batch over the data-parallel ranks, so the count k must
be a multiple of ``ppo_mini_batch_size`` and ``k x n`` of the data-parallel size. LZE keeps
``k`` = the largest such multiple not above ``floor(B x keep_ratio)`` (an error at start-up names
the numbers when there is none). The groups are the selector's top-k by energy; when fewer than
k groups have energy > 0 (groups whose rewards are all equal, with no learning signal), the
rest of the k are the next groups by energy, as plain GRPO on a batch of k groups would train
on them. DAPO keeps the groups whose rewards are not all equal, filled the same way up to the
next such multiple.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from ...config import num_keep
from ...serialization import load_state_file
from ..selection import selection_metrics, unit_scores
from .estimator import LZEAdvantage, Selected, _layout, group_by_uid, rows_by_uid
from .forward import ForwardSampler

SELECTION_FILE = "lze_selection.pt"
_FORMAT = "lze_kernels.verl.legacy/1"


class LZERayPPOTrainer(RayPPOTrainer):
    """verl's legacy ``RayPPOTrainer`` that trains only on the groups LZE (or DAPO) keeps and
    feeds a forward sampler. Takes ``RayPPOTrainer``'s arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rows_by_uid: dict = {}
        check_settings(self.config, self.train_dataloader, self._estimator())

    def init_workers(self):
        super().init_workers()
        estimator = self._estimator()
        if estimator is not None and estimator.method == "lze":
            batch = self.config.data.train_batch_size
            kept = self.groups_to_keep(batch, estimator, 0)
            print(f"LZE keeps {kept} of {batch} groups per step ({kept * self._rollout_n()} "
                  "rows past the reward)")

    def _get_gen_batch(self, batch):
        self.bind_rows(batch)
        return super()._get_gen_batch(batch)

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
        """Remember the step's uid -> dataset row (``non_tensor_batch`` ``uid`` and ``index``)."""
        self._rows_by_uid = rows_by_uid(batch.non_tensor_batch["uid"],
                                        batch.non_tensor_batch["index"])

    def select_rows(self, batch, metrics: dict) -> None:
        """Feed the forward sampler, select, and cut ``batch`` in place to the kept groups."""
        estimator, sampler = self._estimator(), self._forward_sampler()
        if estimator is None and sampler is None:
            return
        self._score_with_reward_model(batch)
        uids = batch.non_tensor_batch["uid"]
        rows = self._response_rows(uids)
        rewards = batch.batch["rm_scores"]
        if estimator is None:
            groups = group_by_uid(uids, "cpu")
            raw, valid = _layout(rewards.sum(dim=-1).float().cpu(), groups)
            self._observe(sampler, rows[groups.host_first], raw, valid, None)
            return
        selected = estimator.select(rewards, batch.batch["response_mask"], uids,
                                    prompt_index=rows)
        if sampler is not None:
            self._observe(sampler, rows[selected.groups.host_first], selected.raw,
                          selected.valid, estimator.score_fn)
        kept_rows = self._cut_to_kept(batch, selected, estimator)
        estimator.expect_selected(batch.non_tensor_batch["uid"], selected)
        metrics.update(selection_metrics(selected.rows.selection, estimator.selector))
        # verl's own critic/score/* metrics describe the kept rows from here on.
        metrics.update({"lze/groups_rolled_out": selected.groups.host_first.shape[0],
                        "lze/rows_past_reward": kept_rows,
                        "lze/score_mean_rolled_out": float(selected.scores.mean())})

    def groups_to_keep(self, num_groups: int, estimator: LZEAdvantage, num_positive: int) -> int:
        """The groups one step keeps (module docstring): a multiple of ``ppo_mini_batch_size``
        whose rows divide among the data-parallel ranks."""
        dp = self._get_dp_size(self.actor_rollout_wg, "actor")
        return groups_to_keep(self.config, num_groups, estimator, num_positive, dp)

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

    def _response_rows(self, uids) -> np.ndarray:
        missing = [uid for uid in uids.tolist() if uid not in self._rows_by_uid]
        if missing:
            raise ValueError(f"uid: {len(missing)} responses carry uids _get_gen_batch never saw "
                             f"(e.g. {missing[0]!r}); LZERayPPOTrainer binds each step's uids "
                             "to their dataset rows there")
        return np.fromiter(map(self._rows_by_uid.__getitem__, uids.tolist()), np.int64,
                           len(uids))

    def _score_with_reward_model(self, batch) -> None:
        """A colocated reward model scores after ``_balance_batch`` in ``fit``: score here."""
        if "rm_scores" in batch.batch.keys():
            return
        if not self.use_rm:
            raise ValueError("rm_scores: the batch reached _balance_batch without rewards and "
                             "no reward model is configured; LZE selects on the rewards the "
                             "agent loop's reward workers (or a reward model) give each rollout")
        batch.union(self._compute_reward_colocate(batch))

    @staticmethod
    def _observe(sampler: ForwardSampler, group_rows, raw, valid, score_fn) -> None:
        rewards = unit_scores(raw, valid, score_fn).float().cpu()
        sampler.observe(torch.from_numpy(group_rows), rewards,
                        None if valid is None else valid.cpu())

    def _cut_to_kept(self, batch, selected: Selected, estimator: LZEAdvantage) -> int:
        """Keep the rows of the step's first k groups by the method's ranking (in batch order);
        returns the rows kept."""
        order, positive = selected.rows.ranking()
        count = self.groups_to_keep(len(order), estimator, positive)
        chosen = np.zeros(len(order), dtype=bool)
        chosen[order[:count]] = True
        rows = np.flatnonzero(chosen[selected.groups.host_row])
        batch.reorder(torch.from_numpy(rows))
        return rows.shape[0]

    def _resumed_folder(self) -> str:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from."""
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            return os.path.abspath(trainer.resume_from_path)
        return os.path.join(os.path.abspath(trainer.default_local_dir),
                            f"global_step_{self.global_steps}")


def check_settings(config, dataloader, estimator: Optional[LZEAdvantage]) -> None:
    """Refuse the settings under which the selection would act late or on stale state, or keep
    no whole mini-batch (the data-parallel size is checked once the workers exist)."""
    sampler = dataloader.sampler if isinstance(dataloader.sampler, ForwardSampler) else None
    if sampler is not None and dataloader.num_workers != 0:
        raise ValueError(f"data.dataloader_num_workers: the forward sampler needs 0 (got "
                         f"{dataloader.num_workers}): worker processes prefetch batches drawn "
                         "before the previous step's rewards are observed")
    if (estimator is not None or sampler is not None) and not config.trainer.balance_batch:
        raise ValueError("trainer.balance_batch: LZERayPPOTrainer selects in _balance_batch, "
                         "the one step of fit between the rewards and the log-prob passes; set "
                         "it to true")
    if estimator is not None and estimator.method == "lze":  # the mini-batch part, before dp
        groups_to_keep(config, config.data.train_batch_size, estimator, 0, dp=1)
    if sampler is not None and sampler.method == "pruner" and (
            estimator is None or sampler.selector is not estimator.selector):
        raise ValueError("train_sampler: the pruner skips the prompts the registered "
                         "LZEAdvantage's selector has pruned; build it with "
                         "selector=<that estimator>.selector")


def groups_to_keep(config, num_groups: int, estimator: LZEAdvantage, num_positive: int,
                   dp: int) -> int:
    """:meth:`LZERayPPOTrainer.groups_to_keep` for a data-parallel size ``dp``."""
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    n = config.actor_rollout_ref.rollout.n
    unit = math.lcm(mini, dp // math.gcd(dp, n))
    if estimator.method == "dapo":
        return min(num_groups, max(unit, -(-num_positive // unit) * unit))
    ratio = estimator.selector.config.keep_ratio
    most = num_keep(num_groups, ratio)
    if most < unit:
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: LZE keeps at most {most} of "
            f"{num_groups} groups per step (keep_ratio {ratio}); verl needs the kept groups in "
            f"whole mini-batches of ppo_mini_batch_size ({mini}) groups, and their rows (groups "
            f"x rollout.n = {n}) divisible by the data-parallel size ({dp}), so a multiple of "
            f"{unit} groups: lower ppo_mini_batch_size or raise keep_ratio")
    return most // unit * unit


def _registered_estimator(name):
    try:
        return get_adv_estimator_fn(name)
    except ValueError:  # verl's built-in branches (gae, grpo) are not in the registry
        return None

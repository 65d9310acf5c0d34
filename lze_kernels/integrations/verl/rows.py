"""The dataset rows of a verl step's groups: their checks, and groups that share a row.

LZE keys its per-prompt state by dataset row (verl's ``non_tensor_batch["index"]``; which row a
prompt is, and the train set's table of each row's prompt: :mod:`.row_table`). A row can come
twice in one batch: a batch that spans two passes of the sampler (the pruner's or GRESO's
permutation, verl's own sampler under ``data.gen_batch_size`` fetches) may draw a row at the end
of one pass and again early in the next. Such groups are two samples of the same prompt under
the same policy, so the selection takes them as what the data says: **one observation of the
row, its pass rate over the rollouts of all its groups**. The row's state is updated once, its
energy is shared by its groups, and each group keeps its own GRPO advantages (its own uid). Which
groups take the step's kept slots is decided group by group (:meth:`RowSelection.ranking`): a
group whose own rewards are all equal (zero advantages: no gradient) ranks after every group
whose rewards differ, so a row with an all-wrong and an all-right group (merged pass rate 1/2)
does not take two slots from groups that can learn. A batch without repeats takes exactly the
selector's single step on its groups.

**Rows that cannot be right** are refused at every LZE step, before the selector steps
(:func:`check_repeated_rows`): groups that share a row but carry different prompts (their
prompt keys, where the caller knows them), and, where the prompts are not known, two or more
groups that all carry one row, which is what a dataset without ``extra_info.index`` gives (verl
fills a missing index with 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ... import ops
from ...selector import LZESelector
from ..selection import GroupSelection, ScoreFn, select_groups

INDEX_FIX = ("write each example's row number into its extra_info.index when preparing the "
             "dataset (verl's examples/data_preprocess scripts do: extra_info={'index': idx} in "
             "the function they map over the dataset with with_indices=True)")


def host_rows(values, name: str = "prompt_index") -> np.ndarray:
    """[n] int64 dataset rows on the host from what verl holds (a numpy object array of ints, a
    tensor, a list). Fractional, non-finite or non-numeric values are refused, not truncated."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype == object:
        array = np.asarray(array.tolist())
    array = array.reshape(-1)
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer)
                                   or np.issubdtype(array.dtype, np.floating)):
        raise ValueError(f"{name}: expected integer dataset rows, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.floating):
        bad = ~np.isfinite(array) | (array != np.floor(array))
        if bad.any():
            got = array[bad][0].item()
            raise ValueError(f"{name}: expected integer dataset rows, got {got!r}")
    return array.astype(np.int64)


def check_row_range(rows: np.ndarray, num_prompts: int, name: str = "prompt_index") -> None:
    """Rows in [0, N), checked on the host where verl keeps them."""
    low, high = int(rows.min()), int(rows.max())
    if low < 0 or high >= num_prompts:
        raise ValueError(f"{name}: expected dataset rows in [0, {num_prompts}), got rows in "
                         f"[{low}, {high}]")


def check_rows_differ(group_rows: np.ndarray, steps_taken: Callable[[], int],
                      name: str = "prompt_index") -> None:
    """At the first step (``steps_taken()`` = 0, read only when needed), two or more groups
    that all carry one dataset row mean the rows are missing or wrong: refused with the fix.
    (Later a batch can legitimately repeat a row, e.g. a pruner with one prompt left; a forward
    sampler's observations come from a trainer that has checked the rows' prompts.)"""
    if group_rows.shape[0] < 2 or (group_rows != group_rows[0]).any() or steps_taken() > 0:
        return
    raise ValueError(f"{name}: all {group_rows.shape[0]} groups of the first step carry dataset "
                     f"row {int(group_rows[0])}; LZE keeps each prompt's history by its row, and "
                     f"verl fills a missing extra_info.index with 0. Fix: {INDEX_FIX}")


def check_repeated_rows(group_rows: np.ndarray, group_keys: Optional[np.ndarray],
                        repeats: Repeats, name: str = "prompt_index") -> None:
    """Groups that share a dataset row must be draws of one prompt: with the groups' prompt keys
    (``group_keys``, :func:`~.row_table.prompt_key`), groups of one row with different prompts
    are refused; without them, two or more groups that all carry one row (a dataset without
    ``extra_info.index``: verl fills 0). Any step, O(num_groups) on the host."""
    if not repeats.any:
        return
    if group_keys is None:
        if repeats.rows.shape[0] == 1:
            raise ValueError(
                f"{name}: all {group_rows.shape[0]} groups of the step carry dataset row "
                f"{int(group_rows[0])}; LZE keeps each prompt's history by its row, and verl "
                f"fills a missing extra_info.index with 0. Fix: {INDEX_FIX}. (Where one prompt "
                f"is drawn for every group, pass the prompts: the rows are then checked by them.)")
        return
    row_key = np.empty(repeats.rows.shape[0], np.int64)
    row_key[repeats.of_group] = group_keys
    clash = np.flatnonzero(row_key[repeats.of_group] != group_keys)
    if clash.size:
        row = int(group_rows[clash[0]])
        rows = np.unique(group_rows[clash]).shape[0]
        raise ValueError(
            f"{name}: groups with different prompts carry dataset row {row} ({rows} row(s) of "
            f"the step are shared by different prompts); LZE keeps each prompt's history by its "
            f"row, so two prompts would share one. The rows must be each prompt's row in the "
            f"train set: {INDEX_FIX}")


@dataclass
class Repeats:
    """How a step's groups map to their distinct rows (numbered in order of first appearance)."""

    rows: np.ndarray  # [U] distinct dataset rows
    of_group: np.ndarray  # [num_groups] position of each group's row in ``rows``
    occurrence: np.ndarray  # [num_groups] how many earlier groups share its row

    @classmethod
    def none(cls, group_rows: np.ndarray) -> "Repeats":
        """Every group its own row (what a per-group method takes the groups as)."""
        count = group_rows.shape[0]
        return cls(group_rows, np.arange(count), np.zeros(count, np.int64))

    @property
    def any(self) -> bool:
        return self.rows.shape[0] != self.of_group.shape[0]


def find_repeats(group_rows: np.ndarray) -> Repeats:
    """O(num_groups) host work: one dict numbers the rows, a stable sort counts occurrences."""
    listed = group_rows.tolist()
    numbers = dict(zip(dict.fromkeys(listed), itertools.count()))
    if len(numbers) == len(listed):
        return Repeats.none(group_rows)
    of_group = np.fromiter(map(numbers.__getitem__, listed), np.int64, len(listed))
    order = np.argsort(of_group, kind="stable")
    counts = np.bincount(of_group)
    occurrence = np.empty_like(of_group)
    occurrence[order] = np.arange(len(listed)) - np.repeat(np.cumsum(counts) - counts, counts)
    return Repeats(np.fromiter(numbers, np.int64, len(numbers)), of_group, occurrence)


def merge_groups(rewards: torch.Tensor, valid: Optional[torch.Tensor], repeats: Repeats):
    """``(merged [U, m * G], merged_valid)``: each row's groups side by side (m = the most
    groups one row has), in batch order; unfilled cells are invalid."""
    num_groups, width = rewards.shape
    span = int(repeats.occurrence.max()) + 1
    base = torch.as_tensor(repeats.of_group * span * width + repeats.occurrence * width,
                           device=rewards.device)
    cells = (base[:, None] + torch.arange(width, device=rewards.device)).view(-1)
    size = repeats.rows.shape[0] * span * width
    merged = rewards.new_zeros(size).index_copy_(0, cells, rewards.reshape(-1))
    filled = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    merged_valid = torch.zeros(size, dtype=torch.bool, device=rewards.device).index_copy_(
        0, cells, filled.reshape(-1))
    return merged.view(-1, span * width), merged_valid.view(-1, span * width)


@dataclass
class RowSelection:
    """A selection method's pick among a step's groups, their rows possibly repeated."""

    keep: torch.Tensor  # [num_groups] bool: the method keeps the group (LZE: its row)
    selection: GroupSelection  # over the distinct rows (LZE) or the groups (DAPO)
    repeats: Repeats
    rewards: torch.Tensor  # [num_groups, G] the step's rewards
    valid: Optional[torch.Tensor]
    _varied: Optional[torch.Tensor] = None

    @property
    def varied(self) -> torch.Tensor:
        """[num_groups] bool: the group's own rewards are not all equal (computed when a
        trainer ranks the groups; the estimator alone never needs it)."""
        if self._varied is None:
            self._varied = ops.dapo_keep_mask(self.rewards, self.valid)
        return self._varied

    @property
    def merged(self) -> bool:
        """The selector saw merged rows (so its per-row outputs are not per group)."""
        return self.selection.keep.shape[0] != self.keep.shape[0]

    def group_energy(self) -> Optional[torch.Tensor]:
        """[num_groups] LZE energy of each group's row (None for DAPO)."""
        step = self.selection.step
        if step is None:
            return None
        return step.energy[torch.as_tensor(self.repeats.of_group, device=step.energy.device)]

    def ranking(self) -> tuple[list[int], int]:
        """``(order, num_selected)``: every group, best first, and how many the method selects
        (kept, with rewards that differ). The order: the groups whose own rewards differ before
        those whose rewards are all equal; within each, the kept groups first (LZE: the rows the
        selector keeps), then by descending energy (LZE), then batch order. One host copy; it
        reads the selector's keep mask, never the order of its kept indices."""
        energy = self.group_energy()
        flags = torch.stack([self.keep, self.varied]).cpu().numpy()
        keep, varied = flags[0], flags[1]
        energy = (np.zeros(keep.shape[0], np.float32) if energy is None
                  else energy.float().cpu().numpy())
        order = np.lexsort((np.arange(keep.shape[0]), -energy, ~keep, ~varied))
        return order.tolist(), int((keep & varied).sum())


def select_on_rows(method: str, selector: Optional[LZESelector], rewards: torch.Tensor,
                   valid: Optional[torch.Tensor], group_rows: np.ndarray,
                   score_fn: Optional[ScoreFn] = None,
                   group_keys: Optional[np.ndarray] = None) -> RowSelection:
    """Apply ``method`` to the groups ``rewards`` [num_groups, G] whose dataset rows are
    ``group_rows`` (checked in range by the caller; repeats allowed) and whose prompts have the
    keys ``group_keys`` (None: not known). LZE runs one selector step on the distinct rows, a
    repeated row's groups merged (module docstring), after refusing rows that cannot be right
    (:func:`check_repeated_rows`); DAPO is per group."""
    if method == "dapo":  # per group: its rows are only reported
        repeats = Repeats.none(group_rows)
    else:
        repeats = find_repeats(group_rows)
        check_repeated_rows(group_rows, group_keys, repeats)
    if not repeats.any:
        ids = torch.as_tensor(group_rows, device=rewards.device)
        selection = select_groups(method, selector, rewards, ids, valid, score_fn,
                                  ids_checked=True)
        varied = selection.keep if method == "dapo" else None  # DAPO's pick is exactly that
        return RowSelection(selection.keep, selection, repeats, rewards, valid, varied)
    merged, merged_valid = merge_groups(rewards, valid, repeats)
    selection = select_groups(method, selector, merged,
                              torch.as_tensor(repeats.rows, device=rewards.device), merged_valid,
                              score_fn, ids_checked=True)
    of_group = torch.as_tensor(repeats.of_group, device=selection.keep.device)
    return RowSelection(selection.keep.index_select(0, of_group), selection, repeats, rewards,
                        valid)

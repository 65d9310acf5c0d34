"""The verl train set the selection keys prompts by, and the v1 selection state inside verl's own
checkpoint (``global_step_N/data.pt``).

:class:`LZERLHFDataset` (``data.custom_cls``, both trainers) is verl's ``RLHFDataset`` whose items
carry their row in the train set (after the files are joined and filtered) as ``index``, with
each row's prompt key and ``extra_info.index`` read at load (:class:`~.row_table.RowTable`) for
the selection to check every step's rows against.

Both verl trainers save ``train_dataloader.state_dict()`` to ``data.pt``; v1's loader restores it
at every step (the legacy loader skips it at an epoch boundary, so
:class:`~.legacy.LZERayPPOTrainer` writes its own ``lze_selection.pt`` instead). torchdata's
``StatefulDataLoader`` puts the dataset's ``state_dict()`` into that state when the dataset has
one, and gives it back through ``load_state_dict`` when the next epoch iterator is made (on
resume: before the first batch, so before the first selection; a state saved at the end of an
epoch comes back the same way). :class:`LZERLHFDataset`'s state is the state of the selection
parts registered in this process (:func:`register`: the v1 replay buffer and its forward
sampler), so the selector's history resumes exactly with the weights and the dataloader. A part
registered after a restore gets its state on registration.

The dataset must live in the trainer's process (``data.dataloader_num_workers=0``): a worker holds
a copy whose state the selection never updates, so ``__getitem__`` refuses to run in one.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from .row_table import RowTable

FORWARD = "forward_sampler"  # the name a v1 forward sampler is registered under
REPLAY_BUFFER = "replay_buffer"  # the name the v1 replay buffer is registered under
logger = logging.getLogger(__name__)
_PARTS: dict = {}
_PENDING: dict = {}


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def register(name: str, part: Stateful) -> None:
    """Make ``part``'s state travel in verl's checkpoint under ``name`` (one part per name in
    this process; a later registration replaces the earlier one). A state restored before the
    part existed is loaded into it now."""
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(part, method, None)):
            raise ValueError(f"part: expected an object with {method}(), got "
                             f"{type(part).__name__}")
    _PARTS[name] = part
    if name in _PENDING:
        part.load_state_dict(_PENDING.pop(name))


def part(name: str):
    """The part registered under ``name``, or None."""
    return _PARTS.get(name)


def unregister(name: str) -> None:
    _PARTS.pop(name, None)
    _PENDING.pop(name, None)


def state_dict() -> dict:
    """``{name: part.state_dict()}`` of the registered parts."""
    return {name: part.state_dict() for name, part in _PARTS.items()}


def load_state_dict(state: dict) -> None:
    """Restore :func:`state_dict`; parts not registered yet get theirs on registration."""
    if not isinstance(state, dict):
        raise ValueError(f"state: expected a dict of part states, got {type(state).__name__}")
    for name, part_state in state.items():
        if name in _PARTS:
            _PARTS[name].load_state_dict(part_state)
        else:
            _PENDING[name] = part_state


def _dataset_base():
    from verl.utils.dataset.rl_dataset import RLHFDataset

    return RLHFDataset


class LZERLHFDataset(_dataset_base()):
    """verl's ``RLHFDataset`` whose items name their row, carrying the selection state in the
    dataloader checkpoint (``data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint``,
    ``data.custom_cls.name=LZERLHFDataset``; both trainers).

    Each item's ``index`` (what verl hands the selection as the prompt's row) is its position in
    the train set after the files are joined and ``data.filter_overlong_prompts`` has dropped rows,
    the position verl's samplers yield; ``extra_info`` is untouched. :attr:`rows` holds each
    position's prompt key and ``extra_info.index`` (:class:`~.row_table.RowTable`): the selection
    checks every step's rows by the prompts they carry; where the two numberings differ (several
    files whose indices restart at 0, filtered rows) the load says so once. A train set's size
    reaches a replay buffer registered in this process
    (:meth:`~.replay_buffer.LZEReplayBuffer.use_train_set`), which checks or takes it as
    ``num_prompts``.

    In v1 it is also where forward selection acts: verl builds the train dataloader's sampler
    itself (``create_rl_sampler``: random or sequential, no hook), so when a forward sampler is
    registered (:class:`~.replay_buffer.LZEReplayBuffer` with ``sampler_kwargs.forward``), each
    item the train dataloader fetches is the row that sampler chooses next, whatever position
    verl's sampler asked for. The validation set (other ``data_files``) is never remapped."""

    def __init__(self, data_files, tokenizer, config, processor=None, *args, **kwargs):
        super().__init__(data_files, tokenizer, config, processor, *args, **kwargs)
        train_files = config.get("train_files") if hasattr(config, "get") else None
        self.is_train = file_list(data_files) == file_list(train_files)
        self.rows = RowTable.of(self)
        if self.is_train and not self.rows.positions_are_indices():
            logger.warning("LZERLHFDataset: LZE keys each prompt by its row in the train set, "
                           "and extra_info.index differs from it (%s); every step's rows are "
                           "checked by their prompts", self.rows.describe())
        buffer = part(REPLAY_BUFFER) if self.is_train else None
        if buffer is not None:
            buffer.use_train_set(self)

    def __getitem__(self, item):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("data.dataloader_num_workers: LZE selection needs 0 (the dataset "
                               "and its selection state must live in the trainer's process; a "
                               "worker's copy would be stale)")
        forward = part(FORWARD) if getattr(self, "is_train", False) else None
        row = item if forward is None else forward.next_row()
        row_dict = super().__getitem__(row)
        row_dict["index"] = row
        return row_dict

    def __getitems__(self, items: list) -> list:
        """The items of one dataloader fetch (torch's fetcher asks for a batch's items together),
        each as this class, or a subclass, hands it over, checked against the train set's prompt
        at the row it names (the field the registered replay buffer reads, else ``index``): a
        prompt at another prompt's row is refused at its fetch, before its rollout."""
        batch = [self[item] for item in items]
        if getattr(self, "is_train", False):
            self.rows.check_items(batch, getattr(part(REPLAY_BUFFER), "index_field", "index"))
        return batch

    def state_dict(self) -> dict:
        return {"lze_selection": state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_state_dict(state.get("lze_selection", {}))


def row_table(dataset) -> RowTable:
    """The :class:`~.row_table.RowTable` of a train set: :attr:`LZERLHFDataset.rows`, or read
    from any verl ``RLHFDataset`` (another dataset class: ``ValueError`` naming
    ``data.custom_cls``)."""
    rows = getattr(dataset, "rows", None)
    return rows if isinstance(rows, RowTable) else RowTable.of(dataset)


def file_list(files) -> list:
    """A ``data.*_files`` setting as a list of paths (one file may be given bare)."""
    if files is None:
        return []
    return [str(f) for f in files] if not isinstance(files, str) else [files]

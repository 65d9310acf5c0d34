"""The train set's rows as LZE keys prompts by, and each row's prompt, to check every step against.

verl's samplers yield positions in the train set as it stands after its files are joined and
``data.filter_overlong_prompts`` has dropped rows; ``extra_info.index`` is what the preprocessing
wrote, which restarts at 0 in each file and keeps its value when rows before it are dropped. LZE
keys a prompt by its position (:class:`~.checkpoint.LZERLHFDataset` puts it in each item's
``index``). Whatever a dataset class or an index column says, a row's state must only ever hold
one prompt's history, so :class:`RowTable` holds, read once at load, each position's **prompt
key** (:func:`prompt_key`, a 64-bit hash of the prompt's text) and its ``extra_info.index``; every
step's rows are checked against the prompt keys of the prompts the step carries
(:meth:`RowTable.check`). A train set whose ``extra_info.index`` *is* its positions (one file,
nothing filtered) needs no custom dataset class (:meth:`RowTable.positions_are_indices`).

The key is of the text a prompt shows the model: each message's role and text, the text parts of
a multi-part content joined and verl's ``<image>`` / ``<video>`` / ``<audio>`` placeholders left
out, so the train file's ``prompt`` column and the ``raw_prompt`` verl's ``RLHFDataset`` builds
from it (placeholders replaced by media parts) give one key. A dataset class that changes a
prompt's text in ``__getitem__`` fails the check: write that text into the train files instead.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from .rows import check_row_range, host_rows

DATASET_FIX = ("data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint "
               "data.custom_cls.name=LZERLHFDataset (it keys each prompt by its row in the train "
               "set after the files are joined and filtered)")
NO_INDEX = -1  # a row without extra_info.index in RowTable
_PLACEHOLDERS = re.compile("<image>|<video>|<audio>")


def prompt_key(prompt) -> int:
    """A signed 64-bit key of a prompt's text (BLAKE2b, the same in every process): ``prompt``
    a list of chat messages (verl's ``raw_prompt``, the train file's ``prompt``) or a string."""
    text = _prompt_text(getattr(prompt, "data", prompt))  # TransferQueue's NonTensorData
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prompt_keys(prompts) -> np.ndarray:
    """[n] int64 :func:`prompt_key` of each prompt."""
    return np.fromiter(map(prompt_key, prompts), np.int64, len(prompts))


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return _text(prompt)
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    fields = []
    for message in prompt:
        if not isinstance(message, dict):
            raise ValueError(f"raw_prompt: expected chat messages (dicts with role and content) "
                             f"or a string, got a {type(message).__name__} in a prompt")
        fields += (str(message.get("role")), _content_text(message.get("content")))
    return "\x1f".join(fields)


def _content_text(content) -> str:
    if isinstance(content, str):
        return _text(content)
    if content is None:
        return ""
    return "".join(part.get("text") or "" for part in content
                   if isinstance(part, dict) and part.get("type") == "text")


def _text(text: str) -> str:
    return _PLACEHOLDERS.sub("", text) if "<" in text else text


class RowTable:
    """Each train-set row's prompt key and ``extra_info.index`` (:data:`NO_INDEX` where it has
    none), read once from verl's ``RLHFDataset`` (its ``dataframe`` after concatenation and
    filtering)."""

    def __init__(self, prompt_key: np.ndarray, source_index: np.ndarray, files: int = 1):
        self.prompt_key = prompt_key
        self.source_index = source_index
        self.files = files

    @classmethod
    def of(cls, dataset) -> "RowTable":
        """The table of a verl ``RLHFDataset``; any other dataset class is refused, naming
        ``data.custom_cls`` and the fix."""
        frame = getattr(dataset, "dataframe", None)
        column = getattr(dataset, "prompt_key", "prompt")
        if column not in (getattr(frame, "column_names", None) or ()):
            raise ValueError(
                f"data.custom_cls: {type(dataset).__name__} is not a verl RLHFDataset (it has no "
                f"dataframe with a {column!r} column): LZE keys each prompt's history by its row "
                f"in the train set and checks every step's rows against the rows' prompts, read "
                f"from that dataframe. Fix: {DATASET_FIX}")
        extra = frame["extra_info"] if "extra_info" in frame.column_names else [None] * len(frame)
        values = [_int_or_none((e or {}).get("index")) for e in extra]
        index = np.array([NO_INDEX if v is None else v for v in values], dtype=np.int64)
        return cls(prompt_keys(frame[column]), index, len(getattr(dataset, "data_files", [None])))

    def __len__(self) -> int:
        return self.prompt_key.shape[0]

    def positions_are_indices(self) -> bool:
        """``extra_info.index`` equals the row everywhere (what verl's own dataset keys by)."""
        return bool(np.array_equal(self.source_index, np.arange(len(self))))

    def describe(self) -> str:
        """Why the rows and ``extra_info.index`` differ, for a message."""
        index = self.source_index
        missing = int((index == NO_INDEX).sum())
        present = index[index != NO_INDEX]
        repeated = present.shape[0] - np.unique(present).shape[0]
        shifted = int(((index != np.arange(len(self))) & (index != NO_INDEX)).sum())
        return (f"{len(self)} rows from {self.files} file(s): {repeated} repeat an "
                f"extra_info.index of another row (indices restarting in each file), {shifted} "
                f"sit at another position than their extra_info.index (rows before them filtered "
                f"out, or a later file), {missing} have none")

    def check(self, rows: np.ndarray, keys: np.ndarray, name: str = "index") -> None:
        """The prompts a step carries (``keys``, their :func:`prompt_key`) are those the train
        set holds at their ``rows``. A mismatch: the rows are not this train set's positions
        (LZE would keep two prompts' histories under one row)."""
        check_row_range(rows, len(self), name)
        wrong = np.flatnonzero(self.prompt_key[rows] != keys)
        if wrong.size:
            row = int(rows[wrong[0]])
            raise ValueError(
                f"{name}: a prompt arrives as row {row}, but row {row} of the train set holds "
                f"another prompt ({wrong.size} of {rows.shape[0]} prompts of the step differ from "
                f"their row's): the rows LZE keys its state by are not this train set's "
                f"positions, and two prompts would share one row's history. Fix: {DATASET_FIX}; "
                f"a subclass must keep the index it sets and each prompt's text")

    def check_items(self, items: list, field: str = "index") -> None:
        """:meth:`check` of dataset items as a dataset class hands them to verl's dataloader
        (dicts with the row in ``field`` and the prompt in ``raw_prompt``)."""
        rows = host_rows(_field(items, field), field)
        self.check(rows, prompt_keys(_field(items, "raw_prompt")), field)


def _field(items: list, name: str) -> list:
    if any(name not in item for item in items):
        raise ValueError(f"{name}: the dataset's items carry no {name!r} (verl's RLHFDataset sets "
                         f"it); LZE checks every step's rows by their prompts")
    return [item[name] for item in items]


def _int_or_none(value):
    if isinstance(value, (bool, np.bool_)) or value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    return None

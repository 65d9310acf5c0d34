"""Offline stand-in for the part of Hugging Face ``datasets`` that lze_trainer.data uses on a local
JSONL file and on in-memory rows, for the GPU check on a machine where ``datasets`` cannot come
(with pyarrow and pandas it is ~67 MB, over the check's 64 MiB of wheels).

tools/gpu_check.py puts this folder at the END of ``sys.path``, so an installed ``datasets`` always
wins. Rows stay Python dicts; ``features`` are the first row's nested keys, which is all the
column resolution reads."""

from __future__ import annotations

import json
from pathlib import Path


class Dataset:
    def __init__(self, rows: list[dict]):
        self._rows = rows

    @classmethod
    def from_list(cls, rows: list[dict], features=None) -> "Dataset":
        return cls([dict(r) for r in rows])

    @property
    def column_names(self) -> list[str]:
        return list(self._rows[0]) if self._rows else []

    @property
    def features(self) -> dict:
        return _features_of(self._rows[0]) if self._rows else {}

    def __len__(self) -> int:
        return len(self._rows)

    def select(self, indices) -> "Dataset":
        return Dataset([self._rows[i] for i in indices])

    def map(self, function, with_indices=False, remove_columns=(), **_) -> "Dataset":
        out = []
        for i, row in enumerate(self._rows):
            new = function(row, i) if with_indices else function(row)
            out.append({**{k: v for k, v in row.items() if k not in remove_columns}, **new})
        return Dataset(out)

    def to_list(self) -> list[dict]:
        return [dict(r) for r in self._rows]


def _features_of(value):
    if isinstance(value, dict):
        return {k: _features_of(v) for k, v in value.items()}
    return type(value).__name__


def load_dataset(builder: str, data_files: str, split: str = "train", **_) -> Dataset:
    if builder != "json":
        raise ValueError(f"the offline datasets stand-in reads JSONL only, not {builder!r}")
    lines = Path(data_files).read_text().splitlines()
    return Dataset([json.loads(line) for line in lines if line.strip()])


def Features(fields: dict) -> dict:  # noqa: N802 (the datasets name)
    return fields


def List(feature):  # noqa: N802
    return [feature]


def Value(dtype: str) -> str:  # noqa: N802
    return dtype

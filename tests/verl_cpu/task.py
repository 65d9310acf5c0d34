"""The task the fit-loop tests train on: a tiny Qwen2 model, a parquet dataset in verl's format,
and a rule reward that verl's reward loop calls (``reward.custom_reward_function``).

The model is the project's own offline tiny Qwen2 (``trainer/tiny_model.py``, loaded by path:
the verl venv does not install the trainer package), randomly initialised, so its responses are
random strings; the reward asks for a response of at least ``ground_truth`` characters, with a
threshold per prompt, so the prompts' pass rates spread over (0, 1) and groups of one prompt
differ in reward. That is what the selection methods act on; what the model learns is not the
point of these tests.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[2]
MODEL_SPEC = "tiny:qwen2?hidden=64&layers=2&heads=2&kv_heads=1&vocab=320&seed=0"
DATA_SOURCE = "lze_verl_cpu"


def prompts(count: int) -> list[str]:
    return [f"Write {n} letters:" for n in range(count)]


def thresholds(count: int, solved_every: int = 0) -> list[int]:
    """Per-prompt minimum response length in characters: the tiny model's sampled 8-token
    responses are 8 characters long at the median (0 to 17 seen), so thresholds of 7 to 10 give
    pass rates of about 0.8, 0.5, 0.4 and 0.2, and most groups of 4 mixed rewards.
    ``solved_every``: every so many rows (row 0 first) threshold 0, always solved."""
    return [0 if solved_every and n % solved_every == 0 else 7 + n % 4 for n in range(count)]


def load_trainer_module(name: str):
    """``trainer/<name>.py`` of this repository, loaded by path (the verl venv does not install
    the trainer package; the modules used here import nothing of it)."""
    module_name = f"lze_trainer_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "trainer" / f"{name}.py")
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])  # dataclasses need it in sys.modules
    return sys.modules[module_name]


def build_model(out_dir: Path) -> Path:
    """The tiny model's checkpoint directory (tokenizer with a ChatML template, weights)."""
    return load_trainer_module("tiny_model").build(MODEL_SPEC, out_dir, prompts(64))


def write_dataset(path: Path, count: int, rows: Optional[list[int]] = None,
                  solved_every: int = 0, indices: Optional[list] = None,
                  long_rows: Iterable[int] = ()) -> Path:
    """verl's RL parquet layout: chat prompt, data source, ground truth, ``extra_info.index``
    (verl copies it into each sample's ``index``). ``rows``: only these prompts of the
    ``count`` (default all), in this order; ``indices``: their ``extra_info.index`` (default the
    prompt's number; None: no index); ``solved_every``: as :func:`thresholds`; ``long_rows``:
    prompts made longer than the fit tests' ``data.max_prompt_length`` (dropped by
    ``data.filter_overlong_prompts``)."""
    import pandas as pd

    rows = list(range(count)) if rows is None else rows
    indices = rows if indices is None else indices
    texts, minimums, long_rows = prompts(count), thresholds(count, solved_every), set(long_rows)
    records = [{"data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": texts[number] + (
                    " please" * 60 if number in long_rows else "")}],
                "ability": "length",
                "reward_model": {"style": "rule", "ground_truth": str(minimums[number])},
                "extra_info": {"split": "train", **({} if index is None else {"index": index})}}
               for number, index in zip(rows, indices)]
    pd.DataFrame(records).to_parquet(path)
    return path


def row_of_text(text: str) -> int:
    """The dataset row whose prompt ``text`` (chat-formatted or not) contains."""
    found = re.search(r"Write (\d+) letters:", text)
    if found is None:
        raise ValueError(f"text: expected a prompt of this task, got {text!r}")
    return int(found.group(1))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 when the response has at least ``ground_truth`` characters, else 0.0."""
    return float(len(solution_str) >= int(ground_truth))

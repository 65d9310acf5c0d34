"""GSM8K in verl's RL parquet layout, for the verl quick start (README.md, "4. verl").

    python examples/verl/prepare_data.py [--local-dir ~/data/gsm8k] [--source openai/gsm8k]

Writes ``train.parquet`` and ``test.parquet``: each row a chat prompt (the question and verl's
instruction to put the final answer after ``####``), ``data_source`` ``openai/gsm8k`` (verl's
rule reward for GSM8K scores it), ``reward_model.ground_truth`` (the number after ``####`` in the
reference answer) and ``extra_info`` with ``index``, the row number, as verl's own
``examples/data_preprocess/gsm8k.py`` writes it (that script is not in verl's wheel).

``--source``: a dataset on the Hugging Face hub (``openai/gsm8k``, config ``main``, the default)
or a local folder holding ``train.jsonl`` and ``test.jsonl`` with ``question`` and ``answer``
fields (the hub's GSM8K rows); the environment variable ``GSM8K_SOURCE`` sets the default, so a
machine without the hub (the project's tests) runs the command as printed.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference answer, without thousands separators."""
    found = re.search(r"#### (-?[0-9.,]+)", answer)
    if found is None:
        raise ValueError(f"answer: expected a GSM8K answer ending in '#### <number>', got "
                         f"{answer[-80:]!r}")
    return found.group(1).replace(",", "")


def to_verl(example: dict, index: int, split: str) -> dict:
    """One GSM8K row in verl's layout (``extra_info.index`` = the row number)."""
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(example["answer"])},
            "extra_info": {"split": split, "index": index, "answer": example["answer"],
                           "question": example["question"]}}


def load(source: str):
    """GSM8K's splits as ``datasets`` datasets: a local folder of ``<split>.jsonl`` files, or
    the hub (``source``, config ``main``)."""
    import datasets

    folder = Path(source).expanduser()
    if folder.is_dir():
        files = {split: str(folder / f"{split}.jsonl") for split in SPLITS}
        missing = [f for f in files.values() if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"--source: {folder} lacks {missing}")
        return datasets.load_dataset("json", data_files=files)
    return datasets.load_dataset(source, "main")


def prepare(source: str, local_dir: Path) -> dict:
    """Write ``<local_dir>/{train,test}.parquet``; returns their paths by split."""
    raw = load(source)
    local_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        rows = raw[split].map(to_verl, with_indices=True, fn_kwargs={"split": split},
                              remove_columns=raw[split].column_names)
        written[split] = local_dir / f"{split}.parquet"
        rows.to_parquet(str(written[split]))
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-dir", default="~/data/gsm8k",
                        help="where train.parquet and test.parquet go (default ~/data/gsm8k)")
    parser.add_argument("--source", default=os.environ.get("GSM8K_SOURCE", DATA_SOURCE),
                        help="hub dataset id, or a folder of train.jsonl and test.jsonl "
                             "(default $GSM8K_SOURCE or openai/gsm8k)")
    args = parser.parse_args(argv)
    for split, path in prepare(args.source, Path(args.local_dir).expanduser()).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()

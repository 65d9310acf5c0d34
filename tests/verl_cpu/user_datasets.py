"""Dataset classes a verl user may hand ``data.custom_cls`` (loaded by verl from this file's
path), for the tests of what the selection does with each:

* :class:`OwnDataset`: a plain ``torch.utils.data.Dataset``, no ``RLHFDataset`` (verl accepts any
  dataset class whose items carry the fields its loop reads);
* :class:`SourceIndexDataset`: an ``LZERLHFDataset`` whose items hand verl each prompt's
  ``extra_info.index`` as its row instead of its position.
"""

from __future__ import annotations

import pandas as pd
import torch

from lze_kernels.integrations.verl.checkpoint import LZERLHFDataset


class OwnDataset(torch.utils.data.Dataset):
    """The prompts of verl's parquet files, each item with its position as ``index``."""

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        files = [data_files] if isinstance(data_files, str) else list(data_files)
        self.frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, item) -> dict:
        row = self.frame.iloc[item]
        return {"raw_prompt": [dict(m) for m in row["prompt"]], "index": item,
                "extra_info": dict(row["extra_info"]), "data_source": row["data_source"],
                "reward_model": dict(row["reward_model"]),
                "dummy_tensor": torch.zeros(1, dtype=torch.uint8)}


class SourceIndexDataset(LZERLHFDataset):
    """``LZERLHFDataset`` with verl's own choice of row: ``extra_info.index``."""

    def __getitem__(self, item) -> dict:
        row_dict = super().__getitem__(item)
        row_dict["index"] = row_dict["extra_info"]["index"]
        return row_dict

"""model.path forms: tiny specs, local folders, hub ids, and the errors of each."""

import pytest
import torch

from lze_trainer import model_source
from lze_trainer.distributed import World

SINGLE = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("path, message", [
    ("/no/such/model", "is not a model folder"),
    ("./relative/missing", "is not a model folder"),
    ("tiny:qwen2?depth=3", "unknown key 'depth'"),
])
def test_bad_model_paths_are_named(path, message, tmp_path):
    with pytest.raises(ValueError, match=message) as err:
        model_source.resolve(path, tmp_path, SINGLE, corpus=lambda: [])
    assert path in str(err.value) or "depth" in str(err.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(model_source.ModelSourceError, match="no config.json"):
        model_source.resolve(str(tmp_path), tmp_path, SINGLE, corpus=lambda: [])


def test_unreachable_hub_id_says_how_to_fix_it(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(model_source.D, "all_gather_object", lambda obj: [obj])
    assert not dist.is_initialized()
    with pytest.raises(model_source.ModelSourceError) as err:
        model_source.resolve("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path, SINGLE,
                             corpus=lambda: [])
    assert "huggingface-cli download" in str(err.value) and "model.path" in str(err.value)

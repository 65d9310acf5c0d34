"""Where a warmed model is kept and when it is reused (the warm-up itself runs in the e2e
tests)."""

from pathlib import Path

from lze_trainer import config as C
from lze_trainer.warmup import _cache_folder, _identity, _seed


def _cfg(*overrides):
    return C.load("tiny", list(overrides))


def test_default_is_the_run_folder_and_seed_follows_the_run():
    cfg = _cfg("trainer.seed=3")
    assert _cache_folder(cfg, _identity(cfg), Path("/r")) == Path("/r/sft_model")
    assert _seed(cfg) == 4


def test_shared_cache_is_keyed_by_settings_not_by_run_seed(tmp_path):
    def folder(*overrides):
        cfg = _cfg(f"sft_warmup.cache_dir={tmp_path}", *overrides)
        return _cache_folder(cfg, _identity(cfg), Path("/run"))

    fixed = folder("sft_warmup.seed=1", "trainer.seed=0")
    assert fixed.parent == tmp_path and fixed.name.startswith("sft_model-")
    assert folder("sft_warmup.seed=1", "trainer.seed=7") == fixed  # one warm-up for all seeds
    assert folder("sft_warmup.seed=2") != fixed
    assert folder("sft_warmup.seed=1", "sft_warmup.steps=21") != fixed
    assert folder("trainer.seed=0") != folder("trainer.seed=1")  # seed unset: per run seed

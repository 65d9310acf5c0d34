"""The warmed models shipped with the trainer (lze_trainer.warm_starts): their hashes, and the
presets that start from them."""

import shutil

import pytest
import torch

from lze_trainer import model_source, warm_starts
from lze_trainer.config import load
from lze_trainer.distributed import World

SINGLE = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"))
PRESETS = {"study": "warm:study", "study-many-pass": "warm:study", "demo": "warm:demo"}


def test_every_recipe_ships_and_matches_its_sha256_sums():
    shipped = {p.parent.name for p in warm_starts.FOLDER.glob(f"*/{warm_starts.CHECKSUMS}")}
    assert shipped == set(warm_starts.RECIPES)
    for name in shipped:
        folder = warm_starts.FOLDER / name
        warm_starts.check(folder)
        assert {"model.safetensors", "config.json", "tokenizer.json",
                warm_starts.ORIGIN} <= set(warm_starts.read_sums(folder))
        # A few MB each: the tree travels with the GPU check.
        assert sum(f.stat().st_size for f in folder.iterdir()) < 4 * 2**20


@pytest.mark.parametrize("preset, path", PRESETS.items())
def test_presets_start_from_the_shipped_model_without_a_warm_up(preset, path, tmp_path):
    cfg = load(preset)
    assert cfg.model.path == path and cfg.sft_warmup.steps == 0
    folder = model_source.resolve(cfg.model.path, tmp_path, SINGLE, corpus=lambda: [])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("123", add_special_tokens=False)["input_ids"] == [
        tokenizer.convert_tokens_to_ids(d) for d in "123"]  # one token per digit
    assert model.config.vocab_size >= len(tokenizer)


@pytest.mark.parametrize("name", list(warm_starts.RECIPES))
def test_the_recipe_that_regenerates_a_warm_start_loads(name):
    preset, overrides = warm_starts.RECIPES[name]
    cfg = load(preset, overrides)
    assert cfg.model.path.startswith("tiny:") and cfg.sft_warmup.steps > 0


def test_a_changed_or_extra_file_is_refused(tmp_path):
    folder = tmp_path / "study"
    shutil.copytree(warm_starts.FOLDER / "study", folder)
    warm_starts.check(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(warm_starts.WarmStartError, match="model.safetensors does not match"):
        warm_starts.check(folder)
    shutil.copy2(warm_starts.FOLDER / "study" / "model.safetensors", weights)
    (folder / "stray.bin").write_bytes(b"x")
    with pytest.raises(warm_starts.WarmStartError, match="differ from those in SHA256SUMS"):
        warm_starts.check(folder)


def test_an_unknown_warm_start_names_the_shipped_ones(tmp_path):
    with pytest.raises(model_source.ModelSourceError, match=r"'warm:nope'.*\['demo', 'study'\]"):
        model_source.resolve("warm:nope", tmp_path, SINGLE, corpus=lambda: [])

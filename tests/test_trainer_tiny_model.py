"""The project's offline tiny models: deterministic files, digit tokens, clear spec errors."""

import hashlib

import pytest

from lze_trainer import tiny_model

CORPUS = [f"Calculate {a} + {b}." for a in range(30) for b in range(0, 90, 7)] + ["12", "345"]
SPEC = "tiny:qwen2?hidden=64&layers=1&heads=2&kv_heads=1&vocab=320"


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_spec_and_corpus_give_the_same_files(tmp_path):
    a = tiny_model.build(SPEC, tmp_path / "a", CORPUS)
    b = tiny_model.build(SPEC, tmp_path / "b", list(reversed(CORPUS)))  # order does not matter
    assert _digests(a) == _digests(b)
    assert tiny_model.build(SPEC, a, CORPUS) == a  # an existing build is reused


def test_another_corpus_rebuilds_the_tokenizer(tmp_path):
    folder = tiny_model.build(SPEC, tmp_path / "m", CORPUS)
    before = _digests(folder)
    tiny_model.build(SPEC, folder, CORPUS + ["Calculate 987654321 * 123456789."] * 50)
    assert _digests(folder)["tokenizer.json"] != before["tokenizer.json"]


def test_tokenizer_splits_digits_and_roundtrips(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    folder = tiny_model.build(SPEC, tmp_path / "m", CORPUS)
    tok = AutoTokenizer.from_pretrained(folder)
    pieces = tok.convert_ids_to_tokens(tok("Calculate 1234 + 56.")["input_ids"])
    digits = [p.lstrip("Ġ") for p in pieces if p.lstrip("Ġ").isdigit()]
    assert digits == ["1", "2", "3", "4", "5", "6"]  # every digit its own token
    text = "any text: ünïcode, -17 and \\boxed{3}"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing is unknown
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tok)
    assert config.hidden_size // config.num_attention_heads == 32  # a head_dim vLLM's CPU runs
    assert tok.eos_token == "<|im_end|>" and config.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("spec, message", [
    ("tiny:qwen2?width=3", "unknown key 'width'"),
    ("tiny:qwen2?hidden=abc", "hidden must be an int"),
    ("tiny:llama", "only the 'qwen2'"),
    ("tiny:qwen2?hidden=100&heads=3", "must divide"),
    ("tiny:qwen2?vocab=10", "vocab must be >= 300"),
    ("qwen2", "expected a spec"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        tiny_model.TinySpec.parse(spec)

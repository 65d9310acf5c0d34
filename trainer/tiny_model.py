"""Small Qwen2 models and their tokenizers, built offline and deterministically by the project.

No hub is needed: the tokenizer is a byte-level BPE trained on the task's own text with every
digit its own token (``pre_tokenizers.Digits(individual_digits=True)``, so numbers are written
digit by digit, which small models learn arithmetic with far more easily), wrapped in a ChatML
template; the model is a randomly initialised ``Qwen2ForCausalLM`` that vLLM and DeepSpeed load
like any checkpoint directory.

A model is named by a spec, usable wherever a model path is::

    tiny:qwen2?hidden=128&layers=2&heads=4&kv_heads=2&vocab=512&seed=0

Same spec and same corpus give the same files, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable
from urllib.parse import parse_qsl, urlsplit

SCHEME = "tiny:"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_MARKER = "lze_tiny_spec.json"


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny Qwen2 model (attention head_dim = hidden / heads; vLLM's CPU attention
    wants head_dim in {32, 64, 80, 96, 112, 128, ...})."""

    hidden: int = 128  # hidden size
    layers: int = 2  # decoder layers
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate: int = 0  # MLP width; 0 = 4 * hidden
    vocab: int = 512  # BPE vocabulary size to train (the embedding is padded to a multiple of 64)
    max_positions: int = 1024  # max_position_embeddings
    tie_embeddings: bool = True  # tie lm_head to the input embedding, like small Qwen2.5 models
    seed: int = 0  # weight initialisation seed

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or value < 0):
                raise ValueError(f"tiny model spec: {f.name} must be an int >= 0, got {value!r}")
        if self.hidden % self.heads or self.heads % max(self.kv_heads, 1) or self.kv_heads < 1:
            raise ValueError(f"tiny model spec: hidden ({self.hidden}) must divide by heads "
                             f"({self.heads}) and heads by kv_heads ({self.kv_heads})")
        if self.vocab < 300:
            raise ValueError(f"tiny model spec: vocab must be >= 300 (256 bytes + specials), "
                             f"got {self.vocab}")

    @classmethod
    def parse(cls, spec: str) -> "TinySpec":
        """``tiny:qwen2?hidden=128&layers=2`` -> TinySpec (unknown keys are an error)."""
        if not is_tiny_spec(spec):
            raise ValueError(f"model path: expected a spec like 'tiny:qwen2?hidden=128', got {spec!r}")
        parts = urlsplit(spec[len(SCHEME):])
        if parts.path not in ("qwen2", ""):
            raise ValueError(f"model path {spec!r}: only the 'qwen2' architecture is built")
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, raw in parse_qsl(parts.query, keep_blank_values=True):
            if key not in known:
                raise ValueError(f"model path {spec!r}: unknown key {key!r}; expected one of "
                                 f"{sorted(known)}")
            values[key] = _parse_value(key, raw, known[key].type)
        return cls(**values)


def is_tiny_spec(path: str) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def build_tokenizer(corpus: Iterable[str], vocab_size: int):
    """Byte-level BPE with single-digit tokens and a ChatML template, trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = sorted(corpus)  # the trained merges must not depend on the corpus order
    # The chat roles appear once per turn in every formatted conversation: give them merges.
    texts += ["user\nassistant\nsystem\n"] * max(1, len(texts) // 2)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=1 << 20,
    )


def build(spec: str | TinySpec, out_dir: str | Path, corpus: Iterable[str]) -> Path:
    """Write tokenizer, config and weights of ``spec`` to ``out_dir``; reuse it if it is there.

    ``corpus``: texts the tokenizer is trained on (prompts and answers of the task)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = TinySpec.parse(spec) if isinstance(spec, str) else spec
    out_dir = Path(out_dir)
    texts = list(corpus)
    # The tokenizer depends on the corpus too: a different task rebuilds the model.
    identity = {**asdict(spec), "corpus_sha256": hashlib.sha256(
        "\0".join(sorted(texts)).encode()).hexdigest()}
    marker = out_dir / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return out_dir
    tokenizer = build_tokenizer(texts, spec.vocab)
    config = Qwen2Config(
        vocab_size=_round_up(len(tokenizer), 64), hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 4 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_embeddings, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    marker.write_text(json.dumps(identity))
    return out_dir


def _parse_value(key: str, raw: str, annotation) -> int | bool:
    if annotation in ("bool", bool):
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"tiny model spec: {key} must be true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"tiny model spec: {key} must be an int, got {raw!r}") from None


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple

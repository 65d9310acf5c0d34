"""Prompt datasets as the trainer uses them: rows, chat-formatted token ids, and answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .data import load_prompts


@dataclass
class PromptSet:
    name: str
    rows: list[dict]  # normalised rows (messages, ground_truth, data_source, index, meta)
    token_ids: list[list[int]]  # the chat-formatted prompt, ready for generation

    def __len__(self) -> int:
        return len(self.rows)


def load(source: str, data_cfg, limit: Optional[int] = None):
    """The normalised rows of ``source`` (``#name`` at the end names a held-out set)."""
    source, _, _ = source.partition("#")
    dataset = load_prompts(source, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
                           prompt_template=data_cfg.prompt_template,
                           system_prompt=data_cfg.system_prompt, limit=limit)
    return dataset.to_list()


def without_prompts_of(rows: list[dict], train_rows: list[dict]) -> list[dict]:
    """``rows`` minus those whose prompt (the whole message list) is a training prompt: procedural
    tasks repeat problems across seeds (reasoning-gym's small-number arithmetic does, heavily), and
    a held-out score must be on prompts the policy never trained on."""
    seen = {_prompt_key(row) for row in train_rows}
    return [row for row in rows if _prompt_key(row) not in seen]


def _prompt_key(row: dict) -> tuple:
    return tuple((m["role"], m["content"]) for m in row["messages"])


def set_name(source: str, rows: list[dict]) -> str:
    _, _, name = source.partition("#")
    return name or (rows[0]["data_source"] if rows else source)


def tokenize(name: str, rows: list[dict], tokenizer, max_prompt_tokens: int) -> PromptSet:
    """Apply the model's chat template; a prompt longer than ``data.max_prompt_tokens`` is an
    error at start-up, not a silent truncation mid-run."""
    token_ids = [list(_chat_ids(tokenizer, row["messages"])) for row in rows]
    too_long = [len(t) for t in token_ids if len(t) > max_prompt_tokens]
    if too_long:
        raise ValueError(f"data.max_prompt_tokens: {len(too_long)} prompts of {name!r} are longer "
                         f"than {max_prompt_tokens} tokens (longest {max(too_long)}); raise the "
                         "limit or filter the data")
    return PromptSet(name, rows, token_ids)


def corpus(rows: list[dict]) -> list[str]:
    """Texts a tiny tokenizer is trained on: every turn and every answer."""
    texts = [m["content"] for row in rows for m in row["messages"]]
    return texts + [row["ground_truth"] for row in rows]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids

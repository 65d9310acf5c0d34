"""Prompt datasets for the trainer: every source normalised to one schema, and a resumable sampler.

Sources (``load_prompts(source)``)::

    hf://openai/gsm8k?config=main&split=train             the Hugging Face hub (load_dataset)
    https://huggingface.co/datasets/openai/gsm8k?config=main          the same, as a web address
    data/train.parquet  data/train.jsonl  data/all.json?split=test    local files
    reasoning-gym:basic_arithmetic?size=2000&seed=1&max_digits=2      procedural tasks, offline

Hub query keys: ``config`` (the dataset's configuration name), ``split`` (default ``train``),
``revision``; ``hf://datasets/owner/name`` (huggingface_hub's form) is accepted too. A local
``.json`` file may hold several splits as top-level keys
(``{"train": [...], "test": [...]}``): ``?split=`` names the key. A reasoning-gym query sets the
task's config fields (``size``, ``seed`` and the task's own); ``seed`` defaults to 0, not to
reasoning-gym's random seed, so every rank and every resumed run sees the same prompts.

Query strings are URI queries, not HTML form data: ``+`` is a literal plus (``operators=+``
means the operator ``+``), ``%2B`` is a plus too, and a space is written ``%20``. Lists are
comma-separated (``operators=+,-``) or JSON (``operators=["+","-"]``).

Every row of the returned dataset has:

- ``messages``: the chat prompt, an optional system turn then the user turn
  (``prompt_template`` with ``{question}`` replaced by the question; other braces, such as a
  ``\\boxed{}`` in an instruction, are kept as written),
- ``ground_truth`` (str), ``data_source`` (str: hub id, file name or ``reasoning-gym:<task>``),
- ``index`` (int64): the row's position in the source, 0..N-1, the selector's prompt id,
- ``meta`` (str, JSON): for reasoning-gym ``{"source": <the source>, "entry": <the generated
  entry>}``, which the task's scorer needs (``decode_meta`` reads it back); ``"{}"`` otherwise.

Columns are found by the source's layout (names matched case-insensitively, first match wins):

=====================================  ===========================================================
layout                                 ground truth
=====================================  ===========================================================
``prompt`` + ``reward_model``          ``reward_model.ground_truth``; ``prompt`` is a chat (verl
                                       parquet files, DAPO-Math-17k)
``problem`` + ``answer``               the answer (MATH-500, AIME, AMC)
``problem`` + ``solution``             the last ``\\boxed{}`` of the solution (hendrycks MATH)
``question`` + ``answer``              the text after ``####`` (GSM8K)
=====================================  ===========================================================

``prompt_key`` / ``answer_key`` name other columns (a dotted key reaches into a struct column:
``reward_model.ground_truth``). Any ground-truth text is reduced the same way: the text after
the last ``####`` if there is one, else the content of the last ``\\boxed{}``, else the text.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import numpy as np

if TYPE_CHECKING:
    import datasets

HF_SCHEME = "hf://"
HF_WEB_PREFIX = "https://huggingface.co/datasets/"
REASONING_GYM_SCHEME = "reasoning-gym:"
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json")
DEFAULT_HUB_SPLIT = "train"
DEFAULT_REASONING_GYM_SEED = 0

# (prompt column, answer column) of well-known layouts, tried in order (see the module docstring).
KNOWN_LAYOUTS = (
    ("prompt", "reward_model.ground_truth"),
    ("problem", "answer"),
    ("problem", "solution"),
    ("question", "answer"),
)

_HUB_REPO = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_TUPLE_TAG = "__tuple__"


class DataSourceError(ValueError):
    """A prompt source that cannot be loaded as asked; the message names the source."""


# ---------------------------------------------------------------------------------------------
# Loading


def load_prompts(source: str, *, prompt_key: str | None = None, answer_key: str | None = None,
                 prompt_template: str = "{question}", system_prompt: str | None = None,
                 limit: int | None = None) -> datasets.Dataset:
    """Load ``source`` (see the module docstring) as a dataset of normalised prompt rows.

    ``limit`` keeps the first rows only (their ``index`` is unchanged: 0..limit-1)."""
    if "{question}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
    if not isinstance(source, str) or not source.strip():
        raise DataSourceError(f"data source must be a non-empty string, got {source!r}")
    source = source.strip()
    render = _PromptRenderer(prompt_template, system_prompt)
    if source.startswith(REASONING_GYM_SCHEME):
        return _load_reasoning_gym(source, render, limit)
    table, label = _load_table(source)
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    if len(table) == 0:
        raise DataSourceError(f"data source {source!r}: the split is empty")
    prompt_path, answer_path = _resolve_columns(source, table, prompt_key, answer_key)
    return _normalise_table(source, table, label, prompt_path, answer_path, render)


def _load_table(source: str) -> tuple[datasets.Dataset, str]:
    """The raw table of a hub or local source, and its ``data_source`` label."""
    if source.startswith(HF_SCHEME):
        repo = source[len(HF_SCHEME):]
        if repo.startswith("datasets/"):  # huggingface_hub's HfFileSystem form
            repo = repo[len("datasets/"):]
        return _load_hub(source, repo)
    if source.startswith(HF_WEB_PREFIX):
        return _load_hub(source, source[len(HF_WEB_PREFIX):])
    if "://" in source:
        raise DataSourceError(
            f"data source {source!r}: unsupported address; expected hf://owner/name?config=.., "
            f"{HF_WEB_PREFIX}owner/name?.., a local {'/'.join(LOCAL_SUFFIXES)} file, "
            f"or {REASONING_GYM_SCHEME}<task>?..")
    return _load_local(source)


def _load_hub(source: str, address: str) -> tuple[datasets.Dataset, str]:
    import datasets

    repo, query = _split_query(source, address)
    repo = repo.rstrip("/")
    if not _HUB_REPO.match(repo):
        raise DataSourceError(f"data source {source!r}: expected a hub dataset id 'owner/name', "
                              f"got {repo!r}")
    options = _query_options(source, query, allowed=("config", "split", "revision"))
    split = options.get("split", DEFAULT_HUB_SPLIT)
    try:
        table = datasets.load_dataset(repo, name=options.get("config"), split=split,
                                      revision=options.get("revision"))
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise DataSourceError(f"data source {source!r}: no dataset {repo!r} on the hub "
                              f"(or it is gated/private): {exc}") from exc
    except (ConnectionError, OSError) as exc:
        raise DataSourceError(_unreachable_hub_message(source, repo, options, exc)) from exc
    except ValueError as exc:  # unknown config or split: datasets lists the valid ones
        raise DataSourceError(f"data source {source!r}: {_describe_load_error(exc)}") from exc
    return table, repo


def _unreachable_hub_message(source: str, repo: str, options: dict, exc: Exception) -> str:
    config = options.get("config")
    args = ", ".join([repr(repo)] + ([repr(config)] if config else []))
    return (
        f"data source {source!r}: cannot reach the Hugging Face hub ({exc}). To use it offline, "
        f"on a machine with network run `datasets.load_dataset({args})` (or "
        f"`huggingface-cli download --repo-type dataset {repo}`), copy the Hugging Face cache "
        f"(~/.cache/huggingface) to this machine and set HF_DATASETS_OFFLINE=1 and "
        f"HF_HUB_OFFLINE=1; or save the split as a parquet file "
        f"(`load_dataset(...).to_parquet('train.parquet')`) and use its path as the source.")


def _load_local(source: str) -> tuple[datasets.Dataset, str]:
    import datasets

    location, query = _split_query(source, source)
    path = Path(location).expanduser()
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise DataSourceError(
            f"data source {source!r}: expected hf://owner/name, {HF_WEB_PREFIX}owner/name, "
            f"{REASONING_GYM_SCHEME}<task>, or a local file ending in {', '.join(LOCAL_SUFFIXES)}")
    if not path.is_file():
        raise DataSourceError(f"data source {source!r}: file {str(path)!r} not found")
    options = _query_options(source, query, allowed=("split",) if suffix == ".json" else ())
    builder = "parquet" if suffix == ".parquet" else "json"
    kwargs = {"field": options["split"]} if "split" in options else {}
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as exc:  # datasets raises many types for unreadable files; all mean "bad file"
        hint = f" (no top-level key {options['split']!r}?)" if "split" in options else ""
        raise DataSourceError(f"data source {source!r}: cannot read it as {builder}{hint}: "
                              f"{_describe_load_error(exc)}") from exc
    return table, path.name


def _describe_load_error(exc: Exception) -> str:
    # datasets reports a split without rows as a slicing error: say what it means.
    if "corresponds to no data" in str(exc):
        return "the split is empty"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------
# Normalisation


@dataclasses.dataclass(frozen=True)
class _PromptRenderer:
    """Turns a question (text or chat) into the normalised ``messages``."""

    template: str
    system_prompt: str | None

    def __call__(self, question: str | list[dict]) -> list[dict]:
        if isinstance(question, str):
            messages = [{"role": "user", "content": self.template.replace("{question}", question)}]
        else:  # a chat: the template applies to its last user turn
            messages = [{"role": m["role"], "content": m["content"]} for m in question]
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last_user]["content"] = self.template.replace(
                "{question}", messages[last_user]["content"])
        if self.system_prompt is not None:
            if messages[0]["role"] == "system":  # the configured one replaces the source's
                messages = messages[1:]
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return messages


def _features() -> datasets.Features:
    from datasets import Features, List, Value

    return Features({
        "messages": List({"role": Value("string"), "content": Value("string")}),
        "ground_truth": Value("string"),
        "data_source": Value("string"),
        "index": Value("int64"),
        "meta": Value("string"),
    })


def _resolve_columns(source: str, table: datasets.Dataset, prompt_key: str | None,
                     answer_key: str | None) -> tuple[list[str], list[str]]:
    """Key paths (column, then struct fields) of the prompt and the answer."""
    if prompt_key is None or answer_key is None:
        for default_prompt, default_answer in KNOWN_LAYOUTS:
            prompt = _find_path(table.features, prompt_key or default_prompt)
            answer = _find_path(table.features, answer_key or default_answer)
            if prompt and answer:
                return prompt, answer
        raise DataSourceError(
            f"data source {source!r}: no known column layout (question/answer, problem/answer, "
            f"problem/solution, prompt/reward_model.ground_truth); set data.prompt_key and "
            f"data.answer_key. Available columns: {_describe_columns(table.features)}")
    prompt, answer = _find_path(table.features, prompt_key), _find_path(table.features, answer_key)
    for setting, key, path in (("prompt_key", prompt_key, prompt),
                               ("answer_key", answer_key, answer)):
        if path is None:
            raise DataSourceError(f"data source {source!r}: {setting}={key!r} is not a column; "
                                  f"available columns: {_describe_columns(table.features)}")
    return prompt, answer


def _find_path(features: dict, dotted: str) -> list[str] | None:
    """The actual key path for a dotted key, matching names case-insensitively; None if absent."""
    path, level = [], features
    for part in dotted.split("."):
        if not isinstance(level, dict):
            return None
        names = {name.lower(): name for name in level}
        name = part if part in level else names.get(part.lower())
        if name is None:
            return None
        path.append(name)
        level = level[name]
    return path


def _describe_columns(features: dict) -> str:
    def describe(name, feature):
        if isinstance(feature, dict):
            return f"{name} {{{', '.join(describe(k, v) for k, v in feature.items())}}}"
        return name
    return ", ".join(describe(name, feature) for name, feature in features.items())


def _normalise_table(source: str, table: datasets.Dataset, label: str, prompt_path: list[str],
                     answer_path: list[str], render: _PromptRenderer) -> datasets.Dataset:
    def normalise(row: dict, index: int) -> dict:
        question, answer = _get_path(row, prompt_path), _get_path(row, answer_path)
        if not (isinstance(question, str) or _is_chat(question)):
            raise DataSourceError(
                f"data source {source!r}, row {index}: column {'.'.join(prompt_path)!r} must hold "
                f"text or a chat (a list of {{role, content}} with a user turn), "
                f"got {question!r:.200}")
        if answer is None:
            raise DataSourceError(f"data source {source!r}, row {index}: column "
                                  f"{'.'.join(answer_path)!r} is empty")
        return {"messages": render(question), "ground_truth": reduce_ground_truth(str(answer)),
                "data_source": label, "index": index, "meta": "{}"}

    return table.map(normalise, with_indices=True, remove_columns=table.column_names,
                     features=_features(), desc=f"normalising {label}")


def _get_path(row: Mapping, path: list[str]) -> Any:
    value = row
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _is_chat(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in value)
            and any(m["role"] == "user" for m in value))


def reduce_ground_truth(text: str) -> str:
    """The final answer inside a ground-truth text: after the last ``####``, else the last
    ``\\boxed{}``, else the stripped text."""
    final = after_last_hashes(text)
    if final is None:
        final = last_boxed(text)
    return (text if final is None else final).strip()


def after_last_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's final-answer marker), or None."""
    head, hashes, tail = text.rpartition("####")
    if not hashes:
        return None
    return tail.strip().splitlines()[0].strip() if tail.strip() else None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``)."""
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        rest = text[start:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            content = _braced(text, start + len(rest) - len(stripped))
            if content is not None:
                return content
        elif stripped and len(stripped) < len(rest):  # "\boxed 5": up to a space or a $
            token = re.match(r"[^\s$]+", stripped)
            if token:
                return token.group(0)
    return None


def _braced(text: str, open_at: int) -> str | None:
    """Content of the brace group opening at ``open_at`` (escaped braces do not count)."""
    depth = 0
    for i in range(open_at, len(text)):
        char = text[i]
        if char in "{}" and i > 0 and text[i - 1] == "\\":
            continue
        depth += 1 if char == "{" else -1 if char == "}" else 0
        if depth == 0:
            return text[open_at + 1:i]
    return None


# ---------------------------------------------------------------------------------------------
# reasoning-gym


def _load_reasoning_gym(source: str, render: _PromptRenderer,
                        limit: int | None) -> datasets.Dataset:
    import datasets

    task, config = parse_reasoning_gym_source(source)
    generator = reasoning_gym_dataset(source, task, config)
    count = len(generator) if limit is None else min(limit, len(generator))
    if count == 0:
        raise DataSourceError(f"data source {source!r}: size=0 gives an empty dataset")
    label = REASONING_GYM_SCHEME + task
    rows = []
    for index in range(count):
        entry = generator[index]
        answer = entry.get("answer")
        rows.append({
            "messages": render(entry["question"]),
            "ground_truth": "" if answer is None else str(answer),
            "data_source": label,
            "index": index,
            "meta": encode_meta({"source": source, "entry": entry}),
        })
    return datasets.Dataset.from_list(rows, features=_features())


def parse_reasoning_gym_source(source: str) -> tuple[str, dict[str, Any]]:
    """``reasoning-gym:<task>?k=v&...`` -> (task, config keyword arguments with typed values)."""
    from reasoning_gym.factory import DATASETS

    task, query = _split_query(source, source[len(REASONING_GYM_SCHEME):])
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise DataSourceError(f"data source {source!r}: unknown reasoning-gym task {task!r}{hint} "
                              f"({len(DATASETS)} tasks: reasoning_gym.factory.DATASETS)")
    config_cls = DATASETS[task][1]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    config: dict[str, Any] = {}
    for key, raw in _query_options(source, query, allowed=None).items():
        if key not in fields:
            raise DataSourceError(f"data source {source!r}: {task} has no config field {key!r}; "
                                  f"fields: {', '.join(fields)}")
        try:
            config[key] = _coerce(raw, hints.get(key, fields[key].type))
        except (ValueError, TypeError) as exc:
            raise DataSourceError(f"data source {source!r}: {key}={raw!r}: {exc}") from None
    if "seed" in fields:
        config.setdefault("seed", DEFAULT_REASONING_GYM_SEED)
    return task, config


def reasoning_gym_dataset(source: str, task: str, config: dict[str, Any]):
    """The reasoning-gym dataset object of ``task`` built with ``config``."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, **config)
    except (AssertionError, ValueError, TypeError) as exc:  # reasoning-gym validates with assert
        raise DataSourceError(f"data source {source!r}: reasoning-gym rejected the config "
                              f"{config}: {type(exc).__name__}: {exc}") from exc


def _coerce(raw: Any, annotation: Any) -> Any:
    """``raw`` (query text, or a value decoded from a JSON list) as a value of ``annotation``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return _guess_scalar(raw) if isinstance(raw, str) else raw
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and isinstance(raw, str) and raw.lower() in ("none", "null"):
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _coerce(raw, option)
                except (ValueError, TypeError):
                    continue
        raise ValueError(f"expected {annotation}")
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == str(raw):
                return choice
        raise ValueError(f"expected one of {list(args)}")
    if annotation in (list, tuple) or origin in (list, tuple, Sequence):
        return _coerce_sequence(raw, annotation)
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("true", "1", "yes"):
            return True
        if str(raw).lower() in ("false", "0", "no"):
            return False
        raise ValueError("expected true or false")
    if annotation is int:
        if isinstance(raw, bool) or isinstance(raw, float):
            raise ValueError("expected an int")
        return int(raw)
    if annotation is float:
        return float(raw)
    if annotation is str:
        return str(raw)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        for member in annotation:
            if str(raw) in (member.name, str(member.value)):
                return member
        raise ValueError(f"expected one of {[m.name for m in annotation]}")
    if annotation in (datetime.date, datetime.time, datetime.datetime):
        return annotation.fromisoformat(str(raw))
    raise TypeError(f"a field of type {annotation} cannot be set from a query string")


def _coerce_sequence(raw: Any, annotation: Any) -> list | tuple:
    if isinstance(raw, str):
        items = json.loads(raw) if raw.lstrip().startswith("[") else raw.split(",")
    else:
        items = raw
    if not isinstance(items, list):
        raise ValueError("expected a comma-separated or JSON list")
    origin = typing.get_origin(annotation) or annotation
    args = typing.get_args(annotation)
    if origin is tuple and args and args[-1] is not Ellipsis:  # fixed-length tuple[A, B, ...]
        if len(items) != len(args):
            raise ValueError(f"expected {len(args)} values")
        return tuple(_coerce(item, arg) for item, arg in zip(items, args))
    element = args[0] if args else Any
    values = [_coerce(item, element) for item in items]
    return tuple(values) if origin is tuple else values


def _guess_scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------
# Query strings and metadata


def _split_query(source: str, text: str) -> tuple[str, str]:
    head, _, query = text.partition("?")
    if not head:
        raise DataSourceError(f"data source {source!r}: the dataset, file or task name is missing")
    return head, query


def _query_options(source: str, query: str, allowed: tuple[str, ...] | None) -> dict[str, str]:
    """``k=v&k2=v2`` -> {k: v}, percent-decoded, ``+`` kept as a plus (RFC 3986, not form data)."""
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, equals, value = part.partition("=")
        key, value = unquote(key), unquote(value)
        if not equals or not key:
            raise DataSourceError(f"data source {source!r}: expected key=value in the query, "
                                  f"got {part!r}")
        if key in options:
            raise DataSourceError(f"data source {source!r}: {key!r} is given twice")
        if allowed is not None and key not in allowed:
            expected = f"one of {', '.join(allowed)}" if allowed else "no query"
            raise DataSourceError(f"data source {source!r}: unknown query key {key!r}; expected "
                                  f"{expected}")
        options[key] = value
    return options


def encode_meta(value: dict) -> str:
    """JSON text of ``value``, with tuples tagged so that ``decode_meta`` gives them back (some
    reasoning-gym scorers compare tuples, e.g. ARC grids)."""
    return json.dumps(_tag_tuples(value))


def decode_meta(text: str) -> dict:
    """The dict that ``encode_meta`` wrote (``"{}"`` -> ``{}``)."""
    value = json.loads(text) if text else {}
    if not isinstance(value, dict):
        raise ValueError(f"meta must be a JSON object, got {text!r:.100}")
    return value if _TUPLE_TAG not in text else _untag_tuples(value)


def _tag_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_tag_tuples(v) for v in value]}
    if isinstance(value, list):
        return [_tag_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: _tag_tuples(v) for k, v in value.items()}
    return value


def _untag_tuples(value: Any) -> Any:
    if isinstance(value, dict):
        if value.keys() == {_TUPLE_TAG}:
            return tuple(_untag_tuples(v) for v in value[_TUPLE_TAG])
        return {k: _untag_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag_tuples(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Seeded, resumable epoch sampler of row indices, identical on every rank given the seed.

    Epoch ``e`` visits the rows in the order ``permutation(seed, e)`` (numpy's PCG64 seeded with
    ``SeedSequence([seed, e])``; ``0..N-1`` when ``shuffle=False``). ``next(n)`` continues across
    epoch ends, and never returns a row twice in one call: when a draw crosses into a new epoch,
    rows of the new epoch already taken from the old epoch's tail are deferred to the start of the
    next draw. So every epoch still serves every row exactly once, and a batch of prompt ids never
    holds duplicates (the selector requires distinct ids)."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, bool(shuffle)
        self.epoch = 0  # epochs started so far
        self._position = num_rows  # next position in the epoch's order (num_rows: none started)
        self._deferred: list[int] = []  # rows of the current epoch to serve before _position
        self._order_cache: tuple[int, np.ndarray] | None = None

    def next(self, n: int) -> list[int]:
        """The next ``n`` distinct row indices (1 <= n <= num_rows)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_rows:
            raise ValueError(f"n must be an int in [1, num_rows={self.num_rows}], got {n!r}")
        drawn: list[int] = []
        taken: set[int] = set()
        pending, self._deferred = self._deferred, []
        while len(drawn) < n:
            if pending:
                row = pending.pop(0)
            else:
                if self._position == self.num_rows:
                    self.epoch += 1
                    self._position = 0
                row = int(self._order()[self._position])
                self._position += 1
                if row in taken:  # already drawn from the previous epoch's tail in this call
                    self._deferred.append(row)
                    continue
            drawn.append(row)
            taken.add(row)
        self._deferred = pending + self._deferred
        return drawn

    def _order(self) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            if self.shuffle:
                seeds = np.random.SeedSequence([self.seed, self.epoch])
                order = np.random.Generator(np.random.PCG64(seeds)).permutation(self.num_rows)
            else:
                order = np.arange(self.num_rows)
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def state_dict(self) -> dict:
        return {"num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self._position, "deferred": list(self._deferred)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; refuses a state of another dataset size, seed or shuffle."""
        for key in ("num_rows", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"sampler state: {key}={state.get(key)!r} does not match this "
                                 f"sampler's {key}={getattr(self, key)!r} (another dataset?)")
        position, deferred = state["position"], [int(r) for r in state["deferred"]]
        if not 0 <= position <= self.num_rows or any(not 0 <= r < self.num_rows for r in deferred):
            raise ValueError(f"sampler state: position or deferred rows outside "
                             f"[0, {self.num_rows}]")
        self.epoch, self._position, self._deferred = int(state["epoch"]), int(position), deferred

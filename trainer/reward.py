"""Rewards of rollouts, scored in worker processes under a per-response time limit.

Default scorer (``default_score``), by the row's ``data_source``:

- ``reasoning-gym:<task>``: the task's own ``score_answer`` on the response's answer, which is the
  last ``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``, reasoning-gym's prompt
  format), else a math final-answer marker (below), else the last non-empty line.
- anything else: math-verify, ``verify(parse(gold), parse(answer))``. The answer is the last
  ``\\boxed{}`` of the response, else the text after GSM8K's ``####``, else the rest of an
  ``Answer:`` line; a response with none of these scores 0 (math-verify would otherwise pick some
  number out of free text). Before parsing, both gold and answer are reduced to one LaTeX
  expression: the last ``$...$`` span if there is one (``Final Answer: The final answer is $3$.``),
  a number followed by plain words is the number (``12 dollars``, ``3/4 cup``; LaTeX units such
  as ``12\\text{ cm}`` are math-verify's), then the result is wrapped in ``$...$``. Two plain
  integers are compared directly (the verdict math-verify gives, checked by the tests, without
  sympy); parses and verdicts are cached per worker.

``RewardScorer(function="pkg.module:fn")`` scores with ``fn(response, ground_truth, data_source,
meta) -> float`` instead (``meta`` decoded to a dict, see ``lze_trainer.data.decode_meta``); it
may call ``default_score`` for the rows it does not handle. Rewards must lie in [0, 1] (the
selector's pass rate is their mean).

Faults never stop the run: a scorer that raises, returns a non-number or a value outside [0, 1],
or kills its process scores 0 and counts as an error; one that runs past ``timeout_s`` is killed
(its worker replaced) and scores 0 as a timeout. math-verify's own time limits use
``signal.alarm``, so they are off here (``parsing_timeout=None, timeout_seconds=None``) and the
limit is this module's: a deadline per response, held by the parent process.

The workers are forked from a ``forkserver`` that has the scorers' modules imported (the trainer
process holds vLLM and torch threads and must not be forked itself), so a replacement worker is
ready in milliseconds; they start once and are reused across batches.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from lze_trainer.data import (
    REASONING_GYM_SCHEME, after_last_hashes, decode_meta, last_boxed, parse_reasoning_gym_source,
    reasoning_gym_dataset,
)

ScoreFn = Callable[[str, str, str, dict], float]

# Modules the forkserver imports once, so that forked workers start with them loaded.
# Imported once per worker (or by the forkserver) so that scoring starts warm; reasoning-gym only
# where it is installed (its tasks' scorers need it; a JSONL or hub dataset does not).
_PRELOAD = ["lze_trainer.reward", "math_verify"] + (
    ["reasoning_gym"] if importlib.util.find_spec("reasoning_gym") else [])
_START_TIMEOUT_S = 120.0  # a worker that is not ready by then means a broken environment
_ANSWER_LINE = re.compile(r"\banswer\s*\**\s*:\s*\**\s*(.*\S)", re.IGNORECASE)
_MATH_SPAN = re.compile(r"(?<!\\)\$\$?(.+?)(?<!\\)\$\$?", re.DOTALL)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_INTEGER = re.compile(r"^-?(?:0|[1-9]\d*)$")
_NUMBER_THEN_WORDS = re.compile(r"^([-+]?\d[\d,]*(?:\.\d+)?(?:/\d+)?)\s+[A-Za-z]{2,}[A-Za-z\s.]*$")


@dataclass
class ScoreResult:
    """Rewards of one batch (0 for failed items) and how many items failed, by cause."""

    rewards: list[float]
    errors: int = 0  # the scorer raised, returned a bad value, or its process died
    timeouts: int = 0  # the scorer ran past timeout_s and was killed
    first_error: str | None = None  # message of the first error, for the log


# ---------------------------------------------------------------------------------------------
# Scoring one response (runs in the workers)


def extract_math_answer(response: str) -> str | None:
    """The final answer of a math response: last ``\\boxed{}``, else ``#### x``, else
    ``Answer: x``; None if there is none."""
    for extract in (last_boxed, after_last_hashes, _after_answer_label):
        answer = extract(response)
        if answer is not None:
            return answer
    return None


def _after_answer_label(text: str) -> str | None:
    matches = _ANSWER_LINE.findall(text)
    return matches[-1] if matches else None


def extract_reasoning_gym_answer(response: str) -> str | None:
    """The answer reasoning-gym scores: ``<answer>...</answer>``, else a math final-answer
    marker, else the last non-empty line; None for an empty response."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(response)
    if answer is None:
        answer = extract_math_answer(response)
    if answer is None:
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        answer = lines[-1] if lines else None
    return answer


def answer_expression(text: str) -> str:
    """One answer text reduced to one expression for math-verify (see the module docstring)."""
    spans = _MATH_SPAN.findall(text)
    text = (spans[-1] if spans else _UNESCAPED_DOLLAR.sub("", text)).strip()
    number = _NUMBER_THEN_WORDS.match(text)
    return number.group(1) if number else text


def math_score(response: str, ground_truth: str) -> float:
    """1.0 if the response's final answer equals ``ground_truth`` by math-verify, else 0.0."""
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    gold, predicted = answer_expression(ground_truth), answer_expression(answer)
    gold_integer, predicted_integer = _as_integer(gold), _as_integer(predicted)
    if gold_integer is not None and predicted_integer is not None:
        return float(gold_integer == predicted_integer)  # math-verify's verdict, without sympy
    return float(_verify(gold, predicted))


@lru_cache(maxsize=4096)
def _verify(gold: str, predicted: str) -> bool:
    """math-verify on two expressions, cached: a group often repeats a wrong symbolic answer,
    whose comparison runs sympy's simplify (tens of ms)."""
    from math_verify import verify

    return verify(list(_parse_math(f"${gold}$")), list(_parse_math(f"${predicted}$")),
                  timeout_seconds=None)


def _as_integer(expression: str) -> int | None:
    """The value of a canonical integer (``-72``; no ``+``, commas, spaces or leading zeros, on
    which math-verify has quirks of its own), else None. Two integers are compared directly, with the
    verdict math-verify gives, so GSM8K-style batches skip latex2sympy (~3 ms a string)."""
    return int(expression) if _INTEGER.match(expression) else None


@lru_cache(maxsize=4096)
def _parse_math(text: str) -> tuple:
    """math-verify's parse, cached: a group's gold and its common answers repeat, and parsing
    (latex2sympy, ~3 ms) is most of the cost; math-verify's own cache holds 20 entries."""
    from math_verify import parse

    return tuple(parse(text, parsing_timeout=None))


def reasoning_gym_score(response: str, meta: dict) -> float:
    """reasoning-gym's own score of the response for the entry in ``meta``."""
    task = _reasoning_gym_task(meta["source"])
    return float(task.score_answer(extract_reasoning_gym_answer(response), meta["entry"]))


@lru_cache(maxsize=64)
def _reasoning_gym_task(source: str):
    """The task object of a ``reasoning-gym:`` source (some scorers read its config)."""
    return reasoning_gym_dataset(source, *parse_reasoning_gym_source(source))


def default_score(response: str, ground_truth: str, data_source: str, meta: dict) -> float:
    """reasoning-gym's scorer for its tasks, math-verify for everything else."""
    if data_source.startswith(REASONING_GYM_SCHEME):
        return reasoning_gym_score(response, meta)
    return math_score(response, ground_truth)


def _score_item(score_fn: ScoreFn, item: tuple[str, str, str, str]) -> tuple[str, Any]:
    """("ok", reward) or ("error", message): never raises for a scorer's fault."""
    response, ground_truth, data_source, meta = item
    try:
        value = score_fn(response, ground_truth, data_source, decode_meta(meta))
    except Exception as exc:  # any scorer fault is an error item, never a crash
        return "error", f"{type(exc).__name__}: {exc}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        return "error", f"the scorer returned {value!r:.80}; expected a float in [0, 1]"
    return "ok", float(value)


def _serve(conn: Connection, function: str | None, sys_path: list[str]) -> None:
    """Worker process: score items from ``conn`` until it closes or sends None."""
    # A preemption is the trainer's to handle: torchrun sends SIGTERM to each rank's whole
    # process group, and the rank still scores the step in flight before it checkpoints and
    # stops. In a group of its own the worker ends when the trainer stops it or exits (its pipe
    # closes); Ctrl-C is the trainer's too.
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = sys_path  # the forkserver has the trainer's path of when it started
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings
    for module in _PRELOAD:  # no-ops when the forkserver preloaded them
        importlib.import_module(module)
    score_fn = import_function(function) if function else default_score
    math_score("\\boxed{1}", "1")  # warm math-verify's regex and parser caches
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if item is None:
            return
        conn.send(_score_item(score_fn, item))


def import_function(spec: str) -> ScoreFn:
    """``"package.module:function"`` -> the function; ValueError naming ``reward.function``."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"reward.function: expected 'module:function', got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # ImportError, AttributeError, or the module's own import error
        raise ValueError(f"reward.function={spec!r} cannot be imported: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not callable(function):
        raise ValueError(f"reward.function={spec!r} is not callable")
    return function


# ---------------------------------------------------------------------------------------------
# The pool (runs in the trainer)


class _Worker:
    """One scoring process, the pipe to it, and the item it is scoring."""

    def __init__(self, context, function: str | None):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn, function, list(sys.path)),
                                       name="lze-reward", daemon=True)
        self.process.start()
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False
        self.item: int | None = None  # index in the batch of the item being scored
        self.deadline = math.inf

    def send(self, index: int, item: tuple, timeout_s: float) -> None:
        self.conn.send(item)
        self.item, self.deadline = index, time.monotonic() + timeout_s

    def finish(self) -> int:
        index, self.item, self.deadline = self.item, None, math.inf
        return index

    def stop(self, graceful: bool) -> None:
        if graceful and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(timeout=1.0)
            except (OSError, ValueError):  # pipe already broken
                pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def as_correctness(rewards: list[float], threshold: float | None) -> list[float]:
    """1.0 where a reward reaches ``threshold``, else 0.0 (None: the rewards as they are).

    Pass rates and held-out accuracy mean "answered correctly": partial credit, such as
    reasoning-gym's ``len(answer) / len(response)`` for a response that merely contains the
    answer, is not a correct answer (and a policy would learn to pad its answers for it)."""
    if threshold is None:
        return list(rewards)
    return [1.0 if r >= threshold else 0.0 for r in rewards]


class RewardScorer:
    """Scores batches of responses in ``num_workers`` processes with a per-response time limit.

    ``function``: ``"module:function"`` with the signature of ``default_score`` (None: the
    default). ``timeout_s``: limit per response, from when a worker receives it."""

    def __init__(self, function: str | None = None, timeout_s: float = 5.0, num_workers: int = 1):
        if function is not None:
            import_function(function)  # fail now, in the trainer, naming the setting
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not 0 < timeout_s < math.inf):
            raise ValueError(f"reward.timeout_s must be a finite number > 0, got {timeout_s!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"reward.num_workers must be an int >= 1, got {num_workers!r}")
        self.function, self.timeout_s = function, float(timeout_s)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(_PRELOAD)  # applies when the forkserver starts
        self._workers = [_Worker(self._context, function) for _ in range(num_workers)]

    def score(self, responses: list[str], rows: list[dict]) -> ScoreResult:
        """Reward of each response for its row (a normalised dataset row: ground_truth,
        data_source, meta)."""
        if len(responses) != len(rows):
            raise ValueError(f"responses and rows must have the same length, got "
                             f"{len(responses)} and {len(rows)}")
        if not self._workers:
            raise RuntimeError("RewardScorer.score called after close()")
        items = [(response, row["ground_truth"], row["data_source"], row.get("meta") or "{}")
                 for response, row in zip(responses, rows)]
        result = ScoreResult(rewards=[0.0] * len(items))
        queue = deque(range(len(items)))
        while queue or any(w.item is not None for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.item is None and queue:
                    index = queue.popleft()
                    try:
                        worker.send(index, items[index], self.timeout_s)
                    except OSError:  # it died while idle: the item was never scored, retry it
                        queue.appendleft(index)
                        self._replace(worker, result)
            self._collect(result, timeout=self._wait_time())
            self._enforce_deadlines(result)
        return result

    def _wait_time(self) -> float:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        deadlines += [w.started_at + _START_TIMEOUT_S for w in self._workers if not w.ready]
        return max(0.0, min(deadlines) - now) if deadlines else 0.0

    def _collect(self, result: ScoreResult, timeout: float) -> None:
        waiting = {w.conn: w for w in self._workers if not w.ready or w.item is not None}
        for conn in wait(list(waiting), timeout=timeout):
            worker = waiting[conn]
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):  # the process died (a scorer exited, OOM kill, ...)
                self._replace(worker, result)
                continue
            if kind == "ready":
                worker.ready = True
            elif kind == "ok":
                result.rewards[worker.finish()] = value
            else:
                worker.finish()
                self._count_error(result, value)

    def _enforce_deadlines(self, result: ScoreResult) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.item is not None and now >= worker.deadline:
                result.timeouts += 1
                worker.finish()
                self._replace(worker, result)
            elif not worker.ready and now >= worker.started_at + _START_TIMEOUT_S:
                raise RuntimeError(f"reward worker not ready after {_START_TIMEOUT_S:.0f} s")

    def _replace(self, worker: _Worker, result: ScoreResult) -> None:
        """Kill ``worker`` and start another. An item it still holds was lost with its process:
        an error."""
        held = worker.item
        worker.stop(graceful=False)
        code = worker.process.exitcode
        if not worker.ready:
            raise RuntimeError(f"a reward worker failed to start (exit code {code}); see its "
                               f"traceback above")
        if held is not None:
            self._count_error(result, f"the scoring process died (exit code {code})")
        self._workers[self._workers.index(worker)] = _Worker(self._context, self.function)

    @staticmethod
    def _count_error(result: ScoreResult, message: str | None) -> None:
        result.errors += 1
        if result.first_error is None:
            result.first_error = message

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop(graceful=True)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

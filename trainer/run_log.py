"""The console keeps the run's progress, held-out results and summary; what libraries print goes
to the run folder's log, ``<run_dir>/logs/rank<r>.txt`` (appended across resumes).

Three routes lead there: Python logging (vLLM's loggers, left unconfigured so that they reach
the root logger; DeepSpeed's, whose own stdout handler is bypassed by a filter), Python warnings
(this package's own also reach the console), and, while the libraries start up (process group,
DeepSpeed op builds, engine construction), file descriptors 1 and 2 themselves, which also
catches C++ warnings and plain prints. :func:`console` is the terminal throughout.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, TextIO

LOG_DIR = "logs"
OWN_WARNINGS = ("lze_kernels:", "lze_trainer:")

_console: dict[str, TextIO] = {}  # "out" / "err": duplicates of the original stdout / stderr
_log_path: Optional[Path] = None


def console(stream: str = "out") -> TextIO:
    """The terminal's stdout (``"err"``: stderr), also while library output goes to the log."""
    return _console.get(stream) or (sys.stdout if stream == "out" else sys.stderr)


def setup(run_dir: Path, rank: int) -> Path:
    """Route library logging and warnings of this rank to its log file; call before DeepSpeed
    or vLLM is imported. Returns the file's path."""
    global _log_path
    _log_path = Path(run_dir) / LOG_DIR / f"rank{rank}.txt"
    _log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(_log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    warnings.showwarning = _show_warning
    logging.getLogger("DeepSpeed").addFilter(_ForwardTo(handler))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # vLLM's records propagate to the root logger
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' load/save bars
    for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
        if name not in _console:
            _console[name] = open(os.dup(stream.fileno()), "w", buffering=1)
    return _log_path


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Python warnings into the log; this package's own (``lze_kernels: ...``, e.g. a backend
    fallback) also on the console."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    logging.getLogger("py.warnings").warning(text.rstrip())
    if str(message).startswith(OWN_WARNINGS):
        console("err").write(text)


class _ForwardTo(logging.Filter):
    """A logger filter that hands every record to ``handler`` and drops it from the logger's
    own handlers (DeepSpeed adds a stdout handler when it is imported)."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        self.handler.handle(record)
        return False


@contextmanager
def libraries_to_log() -> Iterator[None]:
    """File descriptors 1 and 2 into the log file (after :func:`setup`; a no-op before)."""
    if _log_path is None:
        yield
        return
    with output_to(_log_path):
        yield


@contextmanager
def output_to(path) -> Iterator[None]:
    """File descriptors 1 and 2 appended to ``path`` (so what C++ code and child processes
    print goes there too), restored after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)

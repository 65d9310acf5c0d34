"""Every figure the README and the docs show, rendered from a results file in the repo.

    python tools/render_docs.py              # rewrite every rendered block and generated page
    python tools/render_docs.py --check      # exit 1 naming each stale block, changed source
                                             # or figure in prose without a source
    python tools/render_docs.py --record benchmarks/results/step_cpu.md [--name step_cpu]
                                             [--commit abc1234] [--machine "a 2-core x86-64 CPU"]
    python tools/render_docs.py --record benchmarks/runs/20261128-101500
                                             # a `make bench` run: its files into
                                             # benchmarks/results/, the registered ones recorded

**Sources.** docs/figure-sources.toml lists the results files the pages may quote, each under a
name with what measured it: the commit whose tree ran it, the machine by its hardware (a GPU
run's card is read from its preflight), and the file's SHA-256 when that was recorded. A file
rewritten since (a benchmark run again) fails the render until ``--record`` records it again
(default commit: HEAD; default machine: this computer's CPU, as :func:`describe_cpu` words it).
A source is read by its kind: a ``.md`` file's tables (:class:`MarkdownSource`), a ``.csv``
(one table), a ``.json`` (:class:`JsonSource`), or a folder of docs/gpu-runs/ (:class:`RunSource`).

**Blocks.** A page holds a figure between markers, its template in the opening comment:

    <!-- render: `LZEGRPOTrainer` took {trl_peer[trl LZEGRPOTrainer][ratio]} of `GRPOTrainer`'s
    step ({trl_peer.at}) -->
    ...what the template renders to, rewritten by this command...
    <!-- end render -->

A long template can live in docs/figure-templates.toml under a name, the marker then naming it:
``<!-- render: @readme-gpu -->``; it renders as lines of its own.

The template is Python's ``str.format`` over the sources by name: ``{src[row][column]}`` reads a
Markdown or CSV table's cell by the row's label (its first cell, or its first cells joined by
spaces) and the column's header, ``{src.table}`` quotes a file's first table whole, ``{src[a][b]:.2f}``
reads JSON, and a run's methods (``{gpu.speedup_table}``) render what needs arithmetic. Each block
must name the commit and machine of every source it reads (``{src.at}``: "at `a2423ce` on a 2-core
x86-64 CPU", or ``{src.commit}`` and ``{src.machine}``). A template that starts with a newline
renders as lines of its own; otherwise in line. Whole pages rendered here: :data:`PAGES`.

To add a figure: put its results file in the repo, ``--record`` it, write a block that quotes it,
and run this command; tests/test_render_docs.py then fails whenever the block goes stale.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import re
import shutil
import string
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402
import gpu_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = "docs/figure-sources.toml"
TEMPLATES = "docs/figure-templates.toml"
OPEN, CLOSE = "<!-- render:", "<!-- end render -->"
BLOCK = re.compile(r"<!-- render:(.*?)-->(.*?)<!-- end render -->", re.S)
# Pages whose figures are all rendered here or by another generator (their own headers say so).
GENERATED = ("docs/gpu-results.md", "docs/config.md", "docs/study.md", "docs/study_search/study.md",
             "docs/study_many_pass/study.md", "docs/study_many_pass_search/study.md")


class RenderError(Exception):
    pass


# ============================================================================ sources


class Source:
    """A results file under its registry name, with its provenance. Reading it (``[key]``) marks
    it read; ``.at`` (or ``.commit`` and ``.machine``) marks it named: a block must name every
    source it reads."""

    def __init__(self, name: str, entry: dict, root: Path):
        self.name, self.root, self.path = name, root, root / entry["path"]
        self._commit, self._machine = entry.get("commit", "?"), entry.get("machine")
        self._sha256, self._verified = entry.get("sha256"), False
        self.read = self.named_commit = self.named_machine = False

    def reset(self) -> None:
        self.read = self.named_commit = self.named_machine = False

    @property
    def commit(self) -> str:
        self.named_commit = True
        return " and ".join(f"`{c}`" for c in self._commit.split())

    @property
    def machine(self) -> str:
        self.named_machine = True
        return self._machine or "?"

    @property
    def at(self) -> str:
        return f"at {self.commit} on {self.machine}"

    @property
    def named(self) -> bool:
        return self.named_commit and self.named_machine

    def _mark(self):
        """A read: the file must still be what was recorded (checked once, at the first read)."""
        if not self._verified:
            if digest(self.path) != self._sha256:
                relative = self.path.relative_to(self.root).as_posix()
                raise RenderError(f"{relative} changed since {REGISTRY} recorded it: record what "
                                  f"measured it (python tools/render_docs.py --record {relative}),"
                                  f" or restore it (git checkout -- {relative})")
            self._verified = True
        self.read = True
        return self


class Table:
    """A Markdown (or CSV) table: rows by label, cells by column header."""

    def __init__(self, header: list[str], rows: list[list[str]], text: str):
        self.header, self.rows, self.text = header, rows, text

    def has(self, label: str) -> bool:
        return any(label in _labels(row) for row in self.rows)

    def row(self, label):
        if isinstance(label, int):
            return Row(self.header, self.rows[label])
        found = [row for row in self.rows if label in _labels(row)]
        if len(found) != 1:
            raise RenderError(f"{len(found)} rows labelled {label!r} (labels: "
                              f"{[r[0] for r in self.rows]})")
        return Row(self.header, found[0])

    def __getitem__(self, label):
        return self.row(label)

    def __format__(self, spec: str) -> str:
        return self.text


def _labels(row: list[str]) -> set[str]:
    return {" ".join(row[:n]) for n in range(1, min(len(row), 3) + 1)}


class Row:
    def __init__(self, header: list[str], cells: list[str]):
        self.header, self.cells = header, cells

    def __getitem__(self, column):
        if isinstance(column, int):
            return self.cells[column]
        if column not in self.header:
            raise RenderError(f"no column {column!r} (columns: {self.header})")
        return self.cells[self.header.index(column)]


def parse_tables(text: str) -> list[Table]:
    """The Markdown tables of ``text``, in order."""
    return [table for _, table in _headed_tables(text)]


def _headed_tables(text: str) -> list[tuple[str, Table]]:
    """(the heading above it, or "", the table) for each Markdown table of ``text``, in order."""
    tables, lines, i, heading = [], text.splitlines(), 0, ""
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i].lstrip("#").strip()
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$",
                                                                         lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            cells = [_cells(line) for line in lines[i:j]]
            tables.append((heading, Table(cells[0], cells[2:], "\n".join(lines[i:j]))))
            i = j
        else:
            i += 1
    return tables


class Tables:
    """Several tables read as one: ``[label]`` is a row whose ``[column]`` is that cell of the
    first table having both the row and the column."""

    def __init__(self, name: str, tables: list[Table]):
        self.name, self.tables = name, tables

    def __getitem__(self, label):
        having = [table for table in self.tables if isinstance(label, str) and table.has(label)]
        if not having:
            raise RenderError(f"{self.name}: no table has a row labelled {label!r}")
        return CrossRow(label, having)


class CrossRow:
    def __init__(self, label: str, tables: list[Table]):
        self.label, self.tables = label, tables

    def __getitem__(self, column):
        for table in self.tables:
            if column in table.header:
                return table.row(self.label)[column]
        raise RenderError(f"no column {column!r} beside row {self.label!r} (columns: "
                          f"{[t.header for t in self.tables]})")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


class MarkdownSource(Source):
    """A Markdown results file: ``[label][column]`` is that cell of the first table with that row
    and column; ``.table`` the first table, ``.tables[n]`` the n-th, ``.sections[heading]`` the
    tables under a heading read the same way, and ``.says[words]`` what the file's prose gives
    after ``words`` (up to the next comma, semicolon or bracket: ``says[load average]``)."""

    def __init__(self, name, entry, root):
        super().__init__(name, entry, root)
        self._headed = self._load()

    def _load(self) -> list[tuple[str, Table]]:
        return _headed_tables(self.path.read_text())

    @property
    def tables(self) -> list[Table]:
        self._mark()
        return [table for _, table in self._headed]

    @property
    def table(self) -> Table:
        return self.tables[0]

    @property
    def sections(self) -> dict[str, Tables]:
        headings = dict.fromkeys(heading for heading, _ in self._headed)
        self._mark()
        return {h: Tables(f"{self.name} {h!r}", [t for g, t in self._headed if g == h])
                for h in headings}

    @property
    def says(self) -> Said:
        self._mark()
        prose = "\n".join(line for line in self.path.read_text().splitlines()
                          if not line.startswith("|"))
        return Said(self.name, prose)

    def __getitem__(self, label):
        return Tables(self.name, self.tables)[label]


class Said:
    def __init__(self, name: str, prose: str):
        self.name, self.prose = name, prose

    def __getitem__(self, words: str) -> str:
        found = re.search(re.escape(words) + r"\s+([^,;()\n]+)", self.prose)
        if not found:
            raise RenderError(f"{self.name}: its prose says nothing after {words!r}")
        return found.group(1).strip()


class CsvSource(MarkdownSource):
    def _load(self) -> list[tuple[str, Table]]:
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        return [("", Table(rows[0], rows[1:], ""))]


class Json:
    """JSON read through ``[key]`` (an integer key of a dict is tried as a string too)."""

    def __init__(self, value):
        self.value = value

    def __getitem__(self, key):
        value = self.value
        if isinstance(value, dict) and key not in value and str(key) in value:
            key = str(key)
        try:
            item = value[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise RenderError(f"no JSON item {key!r}") from exc
        return Json(item) if isinstance(item, (dict, list)) else item

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class JsonSource(Source):
    """A JSON results file: ``[key]`` reads it; ``.table`` is a Markdown table of its rows (a list
    of flat objects, or an object whose ``rows`` is one, its ``columns`` naming their order)."""

    def __init__(self, name, entry, root):
        super().__init__(name, entry, root)
        self._data = Json(json.loads(self.path.read_text()))

    def __getitem__(self, key):
        self._mark()
        return self._data[key]

    @property
    def table(self) -> Table:
        self._mark()
        data = self._data.value
        rows = data.get("rows") if isinstance(data, dict) else data
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
            raise RenderError(f"{self.name}: no rows to tabulate (a list of objects, or 'rows')")
        columns = (data.get("columns") if isinstance(data, dict) else None) or list(
            dict.fromkeys(k for r in rows for k in r))
        cells = [[str(r.get(c, "")) for c in columns] for r in rows]
        text = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
                          *("| " + " | ".join(c) + " |" for c in cells)])
        return Table(columns, cells, text)


class RunSource(Source):
    """A GPU run (tools/gpu_runs.py); its machine is its card. ``[key]`` reads the merged
    record; the methods render its tables and ranges. Its registry entry's ``kernels_changed``
    names the first commit after the run that changed the kernel sources (:data:`KERNEL_SOURCES`;
    tests/test_render_docs.py checks it against git), ``kernels_changed_what`` what it changed."""

    def __init__(self, name, entry, root):
        self.run = gpu_runs.GpuRun(root / entry["path"])
        super().__init__(name, entry, root)
        self._machine = self.run.card
        self.record = Json(self.run.results)
        self._changed, self._changed_what = entry.get("kernels_changed"), entry.get(
            "kernels_changed_what")

    @property
    def code(self) -> str:
        """Whether today's kernels are the code this run measured, in words (marks the run's
        commit named)."""
        self.named_commit = True
        if not self._changed:
            return "today's kernels are this code"
        what = f" ({self._changed_what})" if self._changed_what else ""
        return (f"today's kernels are not this code: `{self._changed}` changed them{what}, and "
                "neither it nor any later change of the kernels has run on a GPU")

    def __getitem__(self, key):
        self._mark()
        return self.record[key]

    def __getattr__(self, name):
        """The run's own methods and properties (speedup_table, triton_line, ...), read."""
        if name.startswith("_") or name in ("run", "record"):
            raise AttributeError(name)
        value = getattr(self.run, name)
        self._mark()
        return value() if callable(value) else value


# The sources of the kernels a GPU run measures (a change here after a run's commit makes the
# run's figures those of older kernels).
KERNEL_SOURCES = ("csrc", "lze_kernels", ":!lze_kernels/integrations")


def load_sources(root: Path = ROOT) -> dict[str, Source]:
    """Every source of the registry, by name; a file changed since it was recorded is refused
    when a block reads it."""
    registry = tomllib.loads((root / REGISTRY).read_text())
    sources = {}
    for name, entry in registry.items():
        path = root / entry["path"]
        if not path.exists():
            raise RenderError(f"{REGISTRY}: {name}: {entry['path']} does not exist")
        kind = (RunSource if path.is_dir() else CsvSource if path.suffix == ".csv" else
                JsonSource if path.suffix == ".json" else MarkdownSource)
        sources[name] = kind(name, entry, root)
    return sources


def digest(path: Path) -> str:
    """SHA-256 of a file, or of a folder's files (names and contents, in order)."""
    sha = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        sha.update(file.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        sha.update(file.read_bytes())
    return sha.hexdigest()


# ============================================================================ blocks


def render_template(template: str, sources: dict[str, Source], where: str) -> str:
    """``template`` formatted over the sources (and ``gpu_runs``, the table of every GPU run);
    fails when it reads a source it does not name."""
    for source in sources.values():
        source.reset()
    try:
        text = string.Formatter().vformat(template, (), {**sources, "gpu_runs": Runs(sources)})
    except (KeyError, AttributeError, IndexError, ValueError, RenderError) as exc:
        raise RenderError(f"{where}: {type(exc).__name__}: {exc}") from exc
    unnamed = [s.name for s in sources.values() if s.read and not s.named]
    if unnamed:
        raise RenderError(f"{where}: reads {', '.join(unnamed)} without naming the commit and "
                          f"machine ({{{unnamed[0]}.at}})")
    return text


def render_page(text: str, sources: dict[str, Source], page: str,
                templates: dict[str, str]) -> str:
    """``text`` with every block's output replaced by its template's rendering."""
    def block(match: re.Match) -> str:
        template = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        named = re.fullmatch(r"\s*@([\w-]+)\s*", template)
        if named and named.group(1) not in templates:
            raise RenderError(f"{page}:{line}: no template {named.group(1)!r} in {TEMPLATES}")
        source = templates[named.group(1)] if named else template
        body = render_template(source.strip(), sources, f"{page}:{line}")
        if named or template.startswith("\n"):
            return f"{OPEN}{template}-->\n{wrap(body)}\n{CLOSE}"
        return f"{OPEN}{template}-->{body}{CLOSE}"
    return BLOCK.sub(block, text)


WIDTH = 120  # rendered prose is wrapped to this width (tables and code are left as they are)


def wrap(markdown: str, width: int = WIDTH) -> str:
    """Each paragraph of ``markdown`` wrapped to ``width``; tables, code, lists, headings kept."""
    out, paragraph, fenced = [], [], False

    def flush():
        if paragraph:
            # a number and its unit stay on one line, and inline code on one line
            text = re.sub(r"(\d) (?=%|x\b|ms\b|µs\b|s\b|GiB\b)", "\\1\0", " ".join(paragraph))
            text = re.sub(r"`[^`]*`", lambda m: m.group().replace(" ", "\0"), text)
            out.extend(line.replace("\0", " ") for line in textwrap.wrap(
                text, width, break_long_words=False, break_on_hyphens=False))
            paragraph.clear()

    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith("```") or not line.strip() or line.lstrip().startswith(
                ("|", "#", "- ", "* ", "<")):
            flush()
            out.append(line)
        else:
            paragraph.append(line.strip())
    flush()
    return "\n".join(out)


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def rendered(root: Path = ROOT) -> dict[Path, str]:
    """Every page as it should read: blocks rendered, generated pages written whole."""
    sources = load_sources(root)
    templates = tomllib.loads((root / TEMPLATES).read_text()) if (root / TEMPLATES).exists() else {}
    out = {}
    for page in pages(root):
        text = page.read_text()
        if BLOCK.search(text):
            out[page] = render_page(text, sources, page.relative_to(root).as_posix(), templates)
    for name, make in PAGES.items():
        out[root / name] = make(sources)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose text differs from their rendering, with the first line that differs."""
    found = []
    for page, text in rendered(root).items():
        current = page.read_text() if page.exists() else ""
        if current != text:
            old, new = current.splitlines(), text.splitlines()
            line = next((i for i, (a, b) in enumerate(zip(old, new), 1) if a != b),
                        min(len(old), len(new)) + 1)
            found.append(f"{page.relative_to(root)}:{line} is stale (python tools/render_docs.py)")
    return found


# ============================================================================ figures in prose

# A measured figure: a number or a range of numbers ("89-288 us", "0.99-1.09x", "-2.9 points")
# with a unit of time (CPU seconds too), memory, speed, share or score, or a ratio; or a count of
# test outcomes or kernel launches ("2,160 passed", "launches: 2").
_UNSIGNED = r"\d[\d,]*(?:\.\d+)?"
_UNIT = (r"(?:\s?(?:CPU\s)?(?:ms|us|µs|s|GiB|GB|MiB|MB|KiB|TFLOP/s|GB/s|tokens/s|min|minutes|"
         r"seconds|hours|points|nats)\b|\s?%|x\b|\s(?:passed|failed|skipped|errors?|failures|"
         r"hazards|kernel launches|launches|host syncs?|syncs)\b)")
FIGURE = re.compile(rf"(?<![\w.\-/])[-+−]?{_UNSIGNED}(?:\s?(?:-|–|to)\s?{_UNSIGNED})?{_UNIT}"
                    r"|\b(?:launches|syncs):?\s\d[\d,]*")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.M | re.S)
# A section still typed until its results file exists (tests/test_render_docs.py fails once the
# file exists): <!-- typed until benchmarks/results/step_cpu.md --> ... <!-- end typed -->
TYPED = re.compile(r"<!-- typed until \S+ -->.*?<!-- end typed -->", re.S)


def unsourced(text: str) -> list[tuple[int, str]]:
    """(line, figure) for each figure outside rendered blocks, typed sections, code and HTML
    comments."""
    hidden = [m.span() for pattern in (BLOCK, TYPED, CODE, re.compile(r"<!--.*?-->", re.S))
              for m in pattern.finditer(text)]
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in FIGURE.finditer(text)
            if not any(a <= m.start() < b for a, b in hidden)]


# ============================================================================ generated pages


def gpu_results_page(sources: dict[str, Source]) -> str:
    """docs/gpu-results.md: the newest GPU run (:func:`newest_run`) whole."""
    name = newest_run(sources)
    source = sources[name]._mark()
    run = source.run
    report = gpu_report.render(run.results, run.lean_pairs()).split("\n", 4)[4]  # its body
    head = render_template(
        "# GPU results\n\nGenerated by `python tools/render_docs.py` from "
        f"[{source.path.relative_to(source.root).as_posix()}](gpu-runs/{source.path.name}) ("
        "the GPU check of the tree {%s.at}, %s); do not edit by hand. Older runs: "
        "[gpu-check.md](gpu-check.md#runs).\n\n**Of which code**: {%s.code}.\n\n"
        "**Measured by**: {%s.measured_by}. **Conditions**: the check's benchmark: "
        "{%s.conditions[gpu_check.json]}.\n" % (name, run.date, name, name, name), sources,
        "docs/gpu-results.md")
    lean = ""
    if run.lean:
        timer, other = run.timers
        lean = ("\n## The fused step against the lean PyTorch step\n\n"
                f"Measured beside the check by a separate script on the installed package ("
                f"{run.provenance.get('lean-baseline.json', {}).get('script', 'not recorded')}; "
                f"G = 16, N = 4B prompts, keep 0.4, {timer}; {run.conditions.get(gpu_runs.LEAN_FILE)}). The "
                "lean step is the shortest plain PyTorch step a user would write: mean, std, "
                "advantages, gather and scatter of three state tensors, energy and "
                "`torch.topk(E, k, sorted=False)` (no ragged mask, noise, tie rule or streak state), "
                "eager and under `torch.compile(dynamic=False)`, compiled once per B; the strongest "
                "baseline measured. The check's own benchmark above compares with "
                "`PlainTorchSelector`, the same step with every feature of the fused one. The same "
                f"fused step's {other} figure (the check's benchmark) is in brackets: where the "
                "lead over the lean step is inside the two timers' spread, it is a tie.\n\n"
                f"{run.lean_table()}\n\n{run.triton_line()} {run.oracle_line()}\n")
    return f"{head}\n{report.rstrip()}\n{lean}"


def newest_run(sources: dict[str, Source]) -> str:
    runs = [name for name, s in sources.items() if isinstance(s, RunSource)]
    if not runs:
        raise RenderError("no GPU run among the sources")
    return max(runs, key=lambda n: sources[n].run.results.get("started_utc", ""))


def runs_table(sources: dict[str, Source]) -> str:
    """docs/gpu-check.md's list of runs: one line per GPU run, newest first."""
    lines = ["| run | card | commit | today's kernels | stages | goals |",
             "|---|---|---|---|---|---|"]
    for name in sorted((n for n, s in sources.items() if isinstance(s, RunSource)),
                       key=lambda n: sources[n].run.results.get("started_utc", ""), reverse=True):
        source = sources[name]._mark()
        link = f"[{source.path.name}](gpu-runs/{source.path.name})"
        today = f"changed since, in `{source._changed}`" if source._changed else "this code"
        lines.append(f"| {link} | {source.machine} | {source.commit} | {today} | "
                     f"{source.run.stages_line()} | {source.run.goals_met()} |")
    return "\n".join(lines)


PAGES = {"docs/gpu-results.md": gpu_results_page}


class Runs:
    """``{gpu_runs}`` in a template: the table of every GPU run (each row names its card and
    commit)."""

    def __init__(self, sources):
        self.sources = sources

    def __format__(self, spec: str) -> str:
        return runs_table(self.sources)


# ============================================================================ recording


def describe_cpu() -> str:
    """This computer's CPU in a reader's words, e.g. "a 2-core x86-64 CPU"."""
    arch = {"x86_64": "x86-64", "amd64": "x86-64", "aarch64": "ARM64", "arm64": "ARM64"}.get(
        platform.machine().lower(), platform.machine())
    return f"a {os.cpu_count()}-core {arch} CPU"


def record(path: str, name: str | None, commit: str | None, machine: str | None,
           root: Path = ROOT) -> str:
    """Add or update ``path``'s entry in the registry; its name."""
    registry_path = root / REGISTRY
    registry = tomllib.loads(registry_path.read_text()) if registry_path.exists() else {}
    name = name or next((n for n, e in registry.items() if e["path"] == path),
                        re.sub(r"\W", "_", Path(path).stem))
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    entry = {**registry.get(name, {}), "path": path, "commit": commit or head}
    if not (root / path).is_dir():
        entry["machine"] = machine or describe_cpu()
    entry["sha256"] = digest(root / path)
    registry[name] = entry
    registry_path.write_text(_toml(registry))
    return name


RESULTS = "benchmarks/results"


def record_run(folder: Path, root: Path = ROOT) -> list[str]:
    """A benchmark run folder (benchmarks/conftest.py: its results and run.json) recorded: every
    file copied into benchmarks/results/, each registered one recorded with the run's commit and
    machine; the names recorded. Refused when the run's tree had uncommitted changes (its
    figures would be of no commit)."""
    meta = json.loads((folder / "run.json").read_text())
    if meta["uncommitted_changes"]:
        raise RenderError(f"{folder}: the tree that ran it had uncommitted changes; commit them "
                          "and run the benchmarks again (make bench)")
    registry = tomllib.loads((root / REGISTRY).read_text())
    registered = {entry["path"]: name for name, entry in registry.items()}
    names = []
    for file in sorted(p for p in folder.iterdir() if p.is_file() and p.name != "run.json"):
        path = f"{RESULTS}/{file.name}"
        shutil.copyfile(file, root / path)
        if path in registered:
            names.append(record(path, registered[path], meta["commit"], meta["machine"], root))
    return names


REGISTRY_HEAD = """\
# The results files the README and docs quote (tools/render_docs.py), by name: the commit whose
# tree measured each, the machine by its hardware (a GPU run's card comes from its preflight),
# and the file's SHA-256 when recorded. Written by `python tools/render_docs.py --record PATH`.
"""


def _toml(registry: dict) -> str:
    blocks = []
    for name in sorted(registry):
        body = "".join(f'{key} = "{value}"\n' for key, value in registry[name].items())
        blocks.append(f"[{name}]\n{body}")
    return REGISTRY_HEAD + "\n" + "\n".join(blocks)


# ============================================================================ main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    parser.add_argument("--record", metavar="PATH", help="record a results file's provenance")
    parser.add_argument("--name")
    parser.add_argument("--commit")
    parser.add_argument("--machine")
    args = parser.parse_args(argv)
    if args.record and (Path(args.record) / "run.json").exists():
        try:
            names = record_run(Path(args.record).resolve())
        except RenderError as exc:
            print(f"render_docs: {exc}", file=sys.stderr)
            return 1
        print(f"recorded {', '.join(names) or 'no registered file'}; now run "
              "python tools/render_docs.py")
        return 0
    if args.record:
        print(f"recorded {record(args.record, args.name, args.commit, args.machine)}")
        return 0
    if args.check:
        return main_check(ROOT)
    try:
        pages_now = rendered()
    except RenderError as exc:
        print(f"render_docs: {exc}", file=sys.stderr)
        return 1
    for page, text in pages_now.items():
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


def main_check(root: Path = ROOT) -> int:
    """``--check``: print every stale page (or why nothing renders); 1 if any."""
    try:
        problems = stale(root)
    except RenderError as exc:
        problems = [str(exc)]
    print("\n".join(problems) or "every rendered block and page is up to date")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

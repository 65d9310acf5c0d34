"""The key reference of docs/config.md, generated from the config's dataclasses.

``python -m lze_trainer.config_reference docs/config.md`` rewrites everything below the page's
:data:`MARKER` line: the presets, then every key of every section with its default and its help
(the same help ``--print-config`` prints). The text above the marker is kept as written.
tests/test_trainer_config.py fails when the page differs from what this writes.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, is_dataclass
from pathlib import Path

from .config import Config, field_help, preset_descriptions, yaml_value

MARKER = ("<!-- Generated below this line by `python -m lze_trainer.config_reference "
          "docs/config.md` from trainer/config.py: not edited by hand. -->")


def reference() -> str:
    """The presets and every key, as Markdown."""
    lines = ["## Presets", "", "| preset | what |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in preset_descriptions().items()]
    lines += ["", "## Every key"]
    for f in fields(Config):
        _section(getattr(Config(), f.name), f.name, lines)
    return "\n".join(lines) + "\n"


def _section(node, prefix: str, lines: list[str]) -> None:
    """A table of ``node``'s own keys, then one section per group of keys under it."""
    lines += ["", f"### `{prefix}`", "", " ".join(type(node).__doc__.split()), "",
              "| key | default | help |", "|---|---|---|"]
    groups = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            groups.append((value, f"{prefix}.{f.name}"))
            continue
        help_text = _cell(field_help(type(node), f.name))
        lines.append(f"| `{prefix}.{f.name}` | `{yaml_value(value)}` | {help_text} |")
    for group, name in groups:
        _section(group, name, lines)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell (a pipe ends a cell, ``<name>`` reads as HTML)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def written(page: str) -> str:
    """``page`` (docs/config.md's text) with everything below :data:`MARKER` generated."""
    head = page.split(MARKER, 1)[0].rstrip("\n")
    return f"{head}\n\n{MARKER}\n\n{reference()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lze_trainer.config_reference",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="docs/config.md")
    page = parser.parse_args(argv).page
    page.write_text(written(page.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

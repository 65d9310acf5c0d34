"""The documentation holds together: every reference to the selection specification
(docs/spec.md §n) names a section that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("lze_kernels", "trainer", "tests", "benchmarks", "csrc", "tools", "docs", "examples",
               "requirements", ".ci")
TOP_FILES = ("README.md", "Makefile", "setup.py", "pyproject.toml", "CMakeLists.txt", "MANIFEST.in")
TEXT_SUFFIXES = {".py", ".md", ".h", ".cpp", ".cu", ".sh", ".yaml", ".yml", ".toml", ".txt", ".in",
                 ".cfg", ""}
SPEC = ROOT / "docs" / "spec.md"


def text_files() -> list[Path]:
    """The project's own text files: sources, tests, docs, configs (no build or venv folders)."""
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for folder in SOURCE_DIRS:
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def spec_sections() -> set[int]:
    return {int(n) for n in re.findall(r"^## (\d+)\. ", SPEC.read_text(), flags=re.M)}


# "docs/spec.md §4", "docs/spec.md §2-5", "docs/spec.md §3 and §5", "[spec.md](spec.md) §11"
SPEC_REFERENCE = re.compile(r"spec\.md\)? (§\d+(?:-\d+)?(?:(?:,| and) §\d+)*)")


def referenced_sections(text: str) -> set[int]:
    out = set()
    for group in SPEC_REFERENCE.findall(text):
        for first, last in re.findall(r"§(\d+)(?:-(\d+))?", group):
            out.update(range(int(first), int(last or first) + 1))
    return out


def test_spec_has_sections_one_to_eleven_at_least():
    assert set(range(1, 12)) <= spec_sections()


def test_every_spec_reference_resolves():
    sections = spec_sections()
    dangling = {str(p.relative_to(ROOT)): sorted(referenced_sections(p.read_text()) - sections)
                for p in text_files()}
    assert {p: s for p, s in dangling.items() if s} == {}


def test_no_bare_spec_references_remain():
    """The old form, the word in capitals and a number (it pointed outside the project), is gone."""
    word = "S" + "PEC"  # spelt in two parts so that this test does not find itself
    bare = re.compile(rf"\b{word}(?: §| )?\d|{word}\.md|{word}'s")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in text_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert hits == []


def test_references_are_found():
    assert referenced_sections("docs/spec.md §2-5 and docs/spec.md §3 and §9") == {2, 3, 4, 5, 9}
    assert len([p for p in text_files() if referenced_sections(p.read_text())]) > 20


# Names of the environment the project was built in, and of how its work was organised: none of
# them means anything to a user. (This file is the one place that spells them.)
DEVELOPMENT_NAMES = re.compile(
    r"\bissues? #?\d+|KINDS\.md|ENVIRONMENT\.md|METHOD\.md|HOPPER\.md|give_back|\.\./shared/"
    r"|/work/shared|coord\.md|brief\.md|\blent\b|\bdevice call|\bdevice tool"
    r"|\b(?:this|earlier|each|next|previous|later|the) session\b", re.IGNORECASE)


def test_no_development_process_language():
    this_file = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in text_files()
            if p.resolve() != this_file
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if DEVELOPMENT_NAMES.search(line)]
    assert hits == []


DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p != INDEX)


def test_index_lists_every_page():
    listed = {(DOCS / target).resolve() for target in LINK.findall(INDEX.read_text())}
    missing = [str(p.relative_to(ROOT)) for p in doc_pages() if p.resolve() not in listed]
    assert missing == []


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    titles = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_every_relative_link_resolves():
    broken = []
    for page in [ROOT / "README.md", INDEX, *doc_pages()]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code is not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md"
                                     and anchor not in heading_anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def _table_rows(text: str) -> dict[tuple[str, ...], list[str]]:
    """Markdown table rows as {label cells: number cells}, split at the first numeric cell."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells or set("".join(cells)) <= set("-: "):
            continue
        first_number = next((i for i, c in enumerate(cells) if re.fullmatch(r"[\d.]+", c)), None)
        if first_number:
            rows[tuple(cells[:first_number])] = cells[first_number:]
    return rows


def test_readme_verl_stage_table_quotes_the_fit_test():
    """The README's rows-per-stage table is the one tests/test_verl_fit.py writes."""
    measured = _table_rows((ROOT / "benchmarks/results/verl_stages.md").read_text())
    quoted = _table_rows(ROOT.joinpath("README.md").read_text().split("| verl trainer, method")[1]
                         .split("\n\n")[0])
    expected = {
        ("legacy or v1, plain GRPO",): [("legacy", "GRPO"), ("v1", "GRPO")],
        ("legacy, LZE",): [("legacy", "LZE")],
        ("v1, LZE `mode=topk`",): [("v1", "LZE top-k")],
        ("v1, LZE `mode=refill`",): [("v1", "LZE refill")],
    }
    assert set(quoted) == set(expected)
    for label, sources in expected.items():
        for source in sources:
            assert quoted[label] == measured[source], (label, source)

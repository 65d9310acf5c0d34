"""The documentation holds together: every reference to the selection specification
(docs/spec.md §n) names a section that exists, every page is listed and every link resolves, and
no text names the machines the project was built on."""

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("lze_kernels", "trainer", "tests", "benchmarks", "csrc", "tools", "docs", "examples",
               "requirements", ".ci")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "CMakeLists.txt")
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


# Words and word pairs that name the machines this project was built on, or how its work was
# organised: none of them means anything to a user. They are kept as SHA-256 digests of the word
# (lower case, or as written for a shell variable) or of two words joined by a space, so that this
# file does not name them either. To add one:
#   python -c "import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest())" WORD
BUILD_MACHINE_WORDS = frozenset((
    "c2d872a13438b3768c94bc023684e6dc78a5fe5fe4c629a9eee8396aa6cba742",
    "1f6d325084c7647bcd2a0352753a861a30a972c5ad6b75f6c2f1092961bb98f8",
    "87eec4bc2a68386a5db8bb99186b76f10ef5f49535c4b0ec0def4fc6e810f54f",
    "1784e41ee1e7db27f3848b8870719437db12f9c8dcc552d35ed9e32262f8e367",
    "f3963dc3adf4940db0f370ef8680ff6bdbab942ef133b39017a139e3dfbd5d1c",
    "92ab96532e4c45e3d4cc7500e9a3563997b7e00d9f8ce5e985fb92c76aaee661",
    "3ca4186da4fe3b282dbc621ccf47379e515f81f237ef7fea8ae6b8328aa7b524",
    "19949b0869d446eb4be96a4d1f8f62dcd33649fc2661cd877e4f0920f4dec1ba",
    "014c777fd4684e1994134767ade25b4db7b7e23d86379b6c01c2a2b22aac6641",
    "bbb7e4fdad15d6f059066da6afa561c0dcfb1685f0f08538f92aac4d0308762c",
    "db5a9e7a08e03a6b010ab2dca3af6e8a996ebcd7f9aae9eedf3d580d2c93d5fe",
    "028cdc72b35c1bc2fc16538708bc5569eef614ada6001086681dc3a8633dfca0",
    "b4d37d9491addd7f1bb9b4c419926010661e1a03df449d8da112c9b45c9349f7",
    "37c572855dd966cd8136ad40634e38444a77d6ab48e46a1f78917a07de2e7612",
    "43b18044d9ed67ff0fbfc0ae0dfb41e39eb3d80cab8187c60a6fad2171668bc8",
    "48207d2d39715bf267b15680e3d6566c225a5c1a86258dd83876354f0c679d4c",
    "8ce2f61040adbffc9ff2324a782d354df43b4dca645f74b3ae78aca01a0dc5be",
    "2c48580eec4cde74471f90f29c37a046bf877cf06b35e0865b18aec6468b2823",
    "23635864844ef4937e33c5b624abdbe0d2f35ff35aa6bd17c3011d70334d319f",
    "c700a5c376cbd6fa069d5449edf7604fdff226503b51f6af0df1aa91ce221866",
    "a0b57447f767e0306d41c95f2468fd536e8212b105da00c852b5a0ffc8cacf30",
    "4407fe746a1447015af09a977fa9363dd2dc2bc5aade318b509a1462e9098844",
    "197a8c31591925549966cb968e5caca3d17e6b2141590c044e9d15aa848b2de6",
    "1ee9158a865cddb8ae3a6e45eedceabb8cb12128a007854ac1ac04a2011faecf",
    "e25cbaacc1acfefa55435954812c37650eac8852e0b731fb346d18ff1bfbf2f1",
    "3b6a6a049d9a9ab1d03930374dbbeebcca0c64c54a6964641e94d4bac056112a",
))
# On the pages a reader reads (the README and docs), also the words that point at the computer the
# text was written on: a page names a machine by its hardware (docs/figure-sources.toml).
PAGE_WORDS = frozenset((
    "e223809dba24571909e423afdde88d4fbad202eda47f139c98cfc5936a514e3a",
    "a95fd1d8cc385bd476aef7dda4ad3004d01501bba1a51fff09971758247feaa4",
    "df154660eb8e921242712596eeb4bd028bd9442f476a1b01f8c3bc2e002d0c49",
))
TOKEN = re.compile(r"\$?[\w'-]+(?:\.md)?")
# A reference to an issue of a tracker the reader cannot see.
ISSUE_REFERENCE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def build_machine_words(line: str, digests: frozenset = BUILD_MACHINE_WORDS) -> list[str]:
    """The words and word pairs of ``line`` whose SHA-256 digests are in ``digests``, and the
    issue references."""
    tokens = TOKEN.findall(line)
    pairs = [f"{a.lower()} {b.lower()}" for a, b in zip(tokens, tokens[1:])]
    found = {w for w in [*tokens, *(t.lower() for t in tokens), *pairs]
             if hashlib.sha256(w.encode()).hexdigest() in digests}
    return sorted(found) + ISSUE_REFERENCE.findall(line)


def test_no_words_of_the_build_machines():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in text_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if build_machine_words(line)]
    assert hits == []


def test_pages_name_machines_by_their_hardware():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if build_machine_words(line, PAGE_WORDS)]
    assert hits == []


def test_words_are_found_by_their_digests():
    made_up = frozenset(hashlib.sha256(w.encode()).hexdigest()
                        for w in ("$ZORB", "quux", "blue moon"))
    assert build_machine_words("results in $ZORB, a Quux folder", made_up) == ["$ZORB", "quux"]
    assert build_machine_words("zorb=build; ls $zorb/cmake", made_up) == []  # as written only
    assert build_machine_words("once in a Blue Moon", made_up) == ["blue moon"]
    reference = "issue" + " #12"  # spelt in two parts so that this line is no reference
    assert build_machine_words(f"see {reference}", made_up) == [reference]


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

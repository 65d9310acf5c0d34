"""The package's extras from requirements/<extra>.in (scikit-build-core dynamic metadata).

pyproject.toml names the extras; each file holds one requirement a line, with `#` comments.
The same files feed tools/lock.sh and `make setup`, so an extra and its pinned set cannot drift.
"""

from pathlib import Path

REQUIREMENTS = Path("requirements")


def dynamic_metadata(settings, project):
    extras = settings["extras"]
    return {"optional-dependencies": {e: requirements(REQUIREMENTS / f"{e}.in") for e in extras}}


def requirements(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]

"""The README's install has no trap: it installs the clone editable (as `make setup` does), so a
fresh Python started in the clone's root, where ``import lze_kernels`` finds the clone's folder
first, gets the compiled kernels as one started anywhere else does, and ``auto`` picks the
compiled backend without falling back to torch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Warnings are errors once imported: the torch fallback would warn, naming what is missing.
PROBE = """\
import warnings, torch
from lze_kernels import dispatch
warnings.simplefilter("error")
print(dispatch.resolve("auto", torch.device("cpu")).name, dispatch.__file__)
"""


def readme_installs() -> list[str]:
    """The install table's commands of this package (``pip install`` of ``.`` or ``.[extras]``)."""
    section = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    commands = re.findall(r"`(pip install [^`]*)`", table)
    return [c for c in commands if re.search(r"""\s"?\.(\[[\w,]+\])?"?$""", c)]


def test_the_readme_and_make_setup_install_the_clone_editable():
    assert len(readme_installs()) >= 4
    assert [c for c in readme_installs() if " -e " not in c] == []
    recipe = re.search(r"^\$\(VENV\)/\.built:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(),
                       re.M)
    assert recipe and re.search(r"^\t.*\binstall\b.* -e \.$", recipe.group(1), re.M)


@pytest.mark.parametrize("start_in", ["the clone's root", "another folder"])
def test_a_fresh_python_picks_the_compiled_backend(start_in, tmp_path):
    cwd = ROOT if start_in == "the clone's root" else tmp_path
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LZE_BACKEND", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    backend, module = out.stdout.split()
    assert backend == "cpu"  # the compiled C++ module, not the torch fallback
    assert Path(module).resolve().parent == ROOT / "lze_kernels"

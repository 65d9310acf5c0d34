"""Checks built wheels of lze-kernels: what `make wheel` promises about each one.

Per wheel: the CPU module and the CUDA module are in it and the emulated one (a test build) is
not; no native module links or imports libtorch (they take raw pointers, so one wheel serves
every torch); the CUDA module's fatbin holds SASS for every architecture of ``SASS_ARCHS`` and
PTX for ``PTX_ARCHS`` (``cuobjdump --list-elf`` / ``--list-ptx``, from PATH); the wheel is under
``MAX_BYTES``. Prints one line per wheel, writes them as a JSON table with ``--json`` (one row a
wheel: benchmarks/results/wheel.json, which docs/install.md quotes) and exits 1 when a wheel breaks
a promise.

    python tools/check_wheel.py [--json report.json] dist/*.whl
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

REQUIRED_MODULES = ("_lze_cpu", "_lze_cuda")
TEST_ONLY_MODULES = ("_lze_cuda_emu",)
SASS_ARCHS = (80, 86, 89, 90)
PTX_ARCHS = (90,)
MAX_BYTES = 20 * 2**20
# The libraries of torch's own wheels (libtorch_cpu.so, libc10.so, ...), and the mangled names of
# its C++ namespaces at::, c10:: and torch:: (a nested name: N, qualifiers, then the namespace).
TORCH_LIBRARY = re.compile(r"^lib(torch|c10|shm)")
TORCH_SYMBOL = re.compile(r"N[rVKRO]*(2at|3c10|5torch)\d")


def module_name(path: str) -> str:
    """``lze_kernels/_lze_cpu.cpython-311-x86_64-linux-gnu.so`` -> ``_lze_cpu``."""
    return Path(path).name.split(".", 1)[0]


def torch_links(so: Path) -> list[str]:
    """The libtorch libraries ``so`` needs and the torch C++ symbols it leaves undefined."""
    with so.open("rb") as stream:
        elf = ELFFile(stream)
        dynamic = next(s for s in elf.iter_sections() if isinstance(s, DynamicSection))
        needed = [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        undefined = [s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()
                     if s["st_shndx"] == "SHN_UNDEF" and s.name]
    return ([n for n in needed if TORCH_LIBRARY.match(n)]
            + [s for s in undefined if TORCH_SYMBOL.search(s)])


def fatbin_archs(so: Path) -> dict[str, list[int]]:
    """The SM architectures of the fatbin's SASS (``elf``) and PTX (``ptx``) entries."""
    found = {}
    for kind, suffix in (("elf", "cubin"), ("ptx", "ptx")):
        listing = subprocess.run(["cuobjdump", f"--list-{kind}", str(so)], capture_output=True,
                                 text=True, check=True).stdout
        found[kind] = sorted({int(a) for a in re.findall(rf"\.sm_(\d+)\.{suffix}\b", listing)})
    return found


def check(wheel: Path, unpacked: Path) -> tuple[dict, list[str]]:
    """The findings on one wheel, and what it breaks (empty when nothing)."""
    with zipfile.ZipFile(wheel) as archive:
        modules = {module_name(n): n for n in archive.namelist()
                   if n.startswith("lze_kernels/_lze_") and n.endswith(".so")}
        archive.extractall(unpacked, members=modules.values())
    findings = {"bytes": wheel.stat().st_size, "modules": sorted(modules),
                "torch_links": {m: torch_links(unpacked / p) for m, p in modules.items()}}
    problems = [f"{m} is missing" for m in REQUIRED_MODULES if m not in modules]
    problems += [f"{m} is a test build and must not ship" for m in TEST_ONLY_MODULES
                 if m in modules]
    problems += [f"{m} links torch: {', '.join(links[:5])}"
                 for m, links in findings["torch_links"].items() if links]
    if "_lze_cuda" in modules:
        findings["fatbin"] = fatbin_archs(unpacked / modules["_lze_cuda"])
        for kind, wanted in (("elf", SASS_ARCHS), ("ptx", PTX_ARCHS)):
            missing = sorted(set(wanted) - set(findings["fatbin"][kind]))
            problems += [f"_lze_cuda has no {kind.upper()} for sm_{a}" for a in missing]
    if findings["bytes"] > MAX_BYTES:
        problems.append(f"{findings['bytes'] / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return findings, problems


def row(wheel: Path, findings: dict, problems: list[str]) -> dict:
    """One wheel's line of the report."""
    fatbin = findings.get("fatbin", {})
    return {"wheel": wheel.name, "MiB": f"{findings['bytes'] / 2**20:.2f}",
            "modules": " ".join(findings["modules"]),
            "SASS": " ".join(f"sm_{a}" for a in fatbin.get("elf", [])),
            "PTX": " ".join(f"sm_{a}" for a in fatbin.get("ptx", [])),
            "torch symbols or libraries": sum(map(len, findings["torch_links"].values())),
            "problems": "; ".join(problems) or "none"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    rows = []
    for wheel in args.wheels:
        with tempfile.TemporaryDirectory() as unpacked:
            findings, problems = check(wheel, Path(unpacked))
        rows.append(row(wheel, findings, problems))
        print(", ".join(f"{k} {v}" for k, v in rows[-1].items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 1 if any(r["problems"] != "none" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

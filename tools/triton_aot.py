"""Compile every Triton kernel variant of lze_kernels for real GPUs, without a GPU.

For each :class:`LaunchConfig` of ``lze_kernels.triton_kernels.aot_configs()`` and each target
architecture, runs ``triton.compile`` down to a cubin, then the bundled ``ptxas -v`` on the PTX
(with the flags Triton uses) to read registers and spills, and prints one JSON document:

    {"triton": "3.9.0", "kernels": [{"name", "arch", "num_warps", "shared_bytes",
      "registers", "spill_stores", "spill_loads", "stack_bytes"}, ...],
     "scalars_as_one": [...]}   (with --with-scalars-as-one)

Both steps are cached in Triton's cache directory (``TRITON_CACHE_DIR``, ``~/.triton/cache``):
``triton.compile`` by Triton itself, the ``ptxas -v`` report by the hash of the PTX, the ptxas
version and its flags (the same inputs give the same report).

Must run without ``TRITON_INTERPRET=1`` (under the interpreter ``@triton.jit`` functions cannot
be compiled). Usage: ``python tools/triton_aot.py [--arch 80 90] [--output FILE] [--jobs N]
[--scalars-as-one | --with-scalars-as-one]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _configs():
    from lze_kernels.triton_kernels import aot_configs

    return list(aot_configs())


def compile_config(index: int, capability: int, scalars_as_one: bool = False) -> dict:
    """Compile config ``index`` for ``sm_<capability>`` and measure its resources.

    ``scalars_as_one``: compile it as the JIT does when every integer argument it may
    specialise is 1 (B = 1, k = 1, seed = 1, ...): such an argument becomes the compile-time
    constant 1, a Python int inside the kernel, where ``.to()`` and other tensor methods fail.
    Arguments in the kernel's ``do_not_specialize`` stay runtime scalars."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = _configs()[index]
    signature, constexprs = dict(config.signature), dict(config.constexprs)
    if scalars_as_one:
        for arg in _specialisable_ints(config):
            signature[arg], constexprs[arg] = "constexpr", 1
    # Torch allocations are 16-byte aligned; the JIT assumes so for pointers, and so do we.
    attrs = {(config.fn.arg_names.index(arg),): [["tt.divisibility", 16]]
             for arg in config.pointer_args()}
    source = ASTSource(fn=config.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # A compile that misses Triton's cache runs ptxas -v itself: its log (printed with
    # TRITON_DUMP_PTXAS_LOG) is the report, so ptxas runs once a config, not twice.
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    with contextlib.redirect_stdout(io.StringIO()) as log:
        kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                options={"num_warps": config.num_warps, **config.options})
    return {"name": config.name, "arch": f"sm_{capability}",
            "num_warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared,
            **ptxas_resources(kernel.asm["ptx"], capability, config.options, log.getvalue())}


def _specialisable_ints(config) -> list[str]:
    """The integer arguments of ``config`` that the JIT turns into the constant 1 when they are 1."""
    kept = set(getattr(config.fn, "do_not_specialize", None) or ())
    return [arg for index, (arg, kind) in enumerate(config.signature.items())
            if kind in ("i32", "i64") and arg not in kept and index not in kept]


def one_config_per_variant() -> list[int]:
    """One config index per kernel and variant other than its tile shape (argument types, flags
    such as ``HAS_NOISE``): the ``--scalars-as-one`` pass compiles every code path once."""
    seen, indices = set(), []
    for index, config in enumerate(_configs()):
        flags = tuple(sorted((name, value) for name, value in config.constexprs.items()
                             if not name.startswith("BLOCK_")))
        variant = (config.fn, flags, tuple(config.signature.values()))
        if variant not in seen:
            seen.add(variant)
            indices.append(index)
    return indices


def ptxas_resources(ptx: str, capability: int, options: dict, compile_log: str = "") -> dict:
    """Registers, spills and stack of ``ptx`` from ``ptxas -v`` (Triton's own ptxas flags),
    cached by the hash of what determines them; ``compile_log``: the log of the ptxas run of
    Triton's compile, when it ran one."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.runtime.cache import get_cache_manager

    ptxas = get_ptxas(capability)
    fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
    flags = ["-v", *fmad, "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}"]
    key = hashlib.sha256("\0".join([ptx, str(ptxas.version), *flags]).encode()).hexdigest()
    cache = get_cache_manager(key)
    cached = cache.get_file(_REPORT)
    if cached is not None:
        return json.loads(Path(cached).read_text())
    report = (_parse_ptxas_log(compile_log) if _PTXAS_USAGE.search(compile_log)
              else _run_ptxas(ptxas.path, flags, ptx))
    cache.put(json.dumps(report), _REPORT, binary=False)
    return report


_REPORT = "lze_ptxas_resources.json"


def _run_ptxas(path: str, flags: list[str], ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = Path(tmp, "kernel.ptx")
        ptx_path.write_text(ptx)
        log = subprocess.run([path, *flags, str(ptx_path), "-o", str(Path(tmp, "kernel.cubin"))],
                             check=True, capture_output=True, text=True).stderr
    return _parse_ptxas_log(log)


def _parse_ptxas_log(log: str) -> dict:
    registers = _PTXAS_USAGE.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    stack, spill_stores, spill_loads = map(int, spills.groups())
    return {"registers": int(registers.group(1)), "spill_stores": spill_stores,
            "spill_loads": spill_loads, "stack_bytes": stack}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90],
                        help="compute capabilities to compile for (default: 80 90)")
    parser.add_argument("--output", type=Path, help="also write the JSON to this file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    passes = parser.add_mutually_exclusive_group()
    passes.add_argument("--scalars-as-one", action="store_true",
                        help="compile one config per kernel variant with every integer argument "
                             "the JIT may specialise set to the constant 1 (a B = 1 launch)")
    passes.add_argument("--with-scalars-as-one", action="store_true",
                        help="both: every config for every arch, then the --scalars-as-one pass "
                             "for the last arch (one process pool)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter cannot compile kernels")

    import triton

    indices = one_config_per_variant() if args.scalars_as_one else range(len(_configs()))
    tasks = [(index, arch, args.scalars_as_one) for index in indices for arch in args.arch]
    extra = ([(index, args.arch[-1], True) for index in one_config_per_variant()]
             if args.with_scalars_as_one else [])
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        compiled = list(pool.map(compile_config, *zip(*(tasks + extra))))
    document = {"triton": triton.__version__, "kernels": compiled[:len(tasks)]}
    if args.with_scalars_as_one:
        document["scalars_as_one"] = compiled[len(tasks):]
    if args.output:  # the resource table: the compiles as launched
        table = {"triton": document["triton"], "kernels": document["kernels"]}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(table, indent=1) + "\n")
    print(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The report of one GPU check (tools/gpu_check.py): its markdown from the check's JSON, and the
GPU goals judged on it. Standard library only: the check's parent process imports it before
anything is installed.

    python tools/gpu_report.py gpu_check.json [-o report.md]

The check writes ``gpu_check.md`` with it after every stage; tools/render_docs.py renders the
docs' runs (docs/gpu-runs/) with it into docs/gpu-results.md. Every figure comes from the JSON; a
goal whose figure is missing (its stage skipped, failed or ran out of time) reads "not
measured", never "met".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The GPU goals and their thresholds. The kernel bench's: the fused CUDA step against
# its floors and the strongest PyTorch a user could run, every B, host-inclusive (the bench's
# ``seconds``); graph replay against graph replay.
FLOOR_FACTOR = 2.0  # fused_cuda within 2x of max(launch floor, random-record floor)
LEAN_SPEEDUP = 2.0  # >= 2x the lean step's best torch.compile mode
DEFAULT_EXTRA_S = 5e-6  # the default call (value check on) within 5 us of check_inputs=False
TRITON_SPEED = 0.67  # fused_triton at least 0.67x fused_cuda's speed (CUDA time / Triton time)
MAX_LAUNCHES = {"fused_cuda": 4, "fused_triton": 7}  # the step and its selection's launches
DOTS_SPEEDUP = 1.5  # >= 1.5x the chunked torch reference
MEMORY_TOLERANCE = 0.15  # measured peak within 15 % of docs/gpu-memory.md's arithmetic
PEER_RATIO = 0.5  # lze_trainer's step <= 0.5x TRL's
PEER_SIZES = ("tiny", "qwen2.5-0.5b")  # the peer stage's sizes (tools/gpu_peer.py), a goal each
FUSED = ("fused_cuda", "fused_triton")
# Variant names of runs before the lean baselines (the 2026-11 H100 and H200 runs), read as now.
RENAMED = {"fused_cuda_checked": "fused_cuda_default", "fused_triton_checked":
           "fused_triton_default", "torch_plain": "parity_eager",
           "torch_plain_compile": "parity_compile"}


def goals(results: dict, lean: dict | None = None) -> list[dict]:
    """One row per goal: name, short (a few words), target, measured (text) and met (True,
    False, or None when not measured). A goal measured at some sizes only is not met when any of
    them misses it, else not measured. ``lean``: ``{B: (lean step compiled, fused CUDA step)}``
    seconds timed together by a script beside the check (a run's lean-baseline.json), which judges
    the lean goal where the check's bench did not time the lean step."""
    stages = results.get("stages", {})
    rows = _kernel_goals(stages.get("kernels", {})) + _bench_goals(stages.get("bench", {}), lean)
    rows += _memory_goals(stages.get("memory", {})) + _peer_goals(stages.get("peer", {}))
    return rows


def _goal(name: str, short: str, target: str, measured, met) -> dict:
    """``met`` None: not measured (also where ``measured`` says what was, at some sizes)."""
    return {"goal": name, "short": short, "target": target,
            "measured": "not measured" if measured is None else measured,
            "met": None if measured is None or met is None else bool(met)}


def _kernel_goals(kernels: dict) -> list[dict]:
    ran = "tests" in kernels
    text = (f"{kernels['tests']} tests, {kernels.get('failures', 0) + kernels.get('errors', 0)} "
            f"failed, {kernels.get('skipped', 0)} skipped" if ran else None)
    ok = ran and kernels.get("status") == "passed"
    return [_goal("kernel suite on the device (cuda, triton, torch; none skipped)",
                  "the kernel suite", "all pass", text, ok)]


def _timed(bench: dict) -> list[dict]:
    """The benchmark's rows that ran (a variant that raised has an ``error`` instead), with the
    variant names of earlier runs read as today's (:data:`RENAMED`)."""
    return [{**r, "variant": RENAMED.get(r["variant"], r["variant"])}
            for r in bench.get("rows") or [] if "seconds" in r]


def _bench_goals(bench: dict, lean: dict | None = None) -> list[dict]:
    rows = _timed(bench)
    by = {(r["variant"], r["B"]): r for r in rows}
    batches = sorted({r["B"] for r in rows})
    fused = [r for r in rows if r["variant"].startswith("fused_")]
    graphs = [r for r in fused if r["variant"].endswith("_graph")]
    out = [
        _goal("host syncs per fused step (off, default check, graph replay)", "no host sync", "0",
              _worst(fused, "syncs"), fused and all(r["syncs"] == 0 for r in fused)),
        _goal("kernel launches per fused step", "launches per step",
              ", ".join(f"{v} <= {n}" for v, n in MAX_LAUNCHES.items()),
              ", ".join(f"{v}: {n}" for v, n in _launch_ranges(
                  [r for r in fused if r["variant"] in MAX_LAUNCHES]).items()) or None,
              all(r["launches"] <= MAX_LAUNCHES[r["variant"]] for r in fused
                  if r["variant"] in MAX_LAUNCHES) and any(r["variant"] in MAX_LAUNCHES
                                                           for r in fused)),
        _floor_goal(bench.get("floors") or {}, by, batches),
    ]
    lean_name = ("fused_cuda speed-up over the lean PyTorch step under torch.compile "
                 "(lean_compile), every B")
    lean_short = f"{LEAN_SPEEDUP:g}x the lean step compiled"
    if lean and not any(v == "lean_compile" for v, _ in by):
        out += _ratio_goal(f"{lean_name} (lean-baseline.json, CUDA events)", lean_short,
                           _pairs_of(lean), max(len(batches), len(lean)), LEAN_SPEEDUP)
    else:
        out += _ratio_goal(lean_name, lean_short, _pairs(by, batches, "lean_compile",
                                                         "fused_cuda"), len(batches),
                           LEAN_SPEEDUP)
    out += _ratio_goal("captured fused_cuda replay over the lean step under "
                       "torch.compile(mode=\"reduce-overhead\") (lean_graph), every B",
                       f"{LEAN_SPEEDUP:g}x the lean step's CUDA graph",
                       _pairs(by, batches, "lean_graph", "fused_cuda_graph"), len(batches),
                       LEAN_SPEEDUP)
    out += _ratio_goal("fused_triton speed over fused_cuda's (CUDA time / Triton time), every B",
                       f"Triton at {TRITON_SPEED:g}x CUDA's speed",
                       _pairs(by, batches, "fused_cuda", "fused_triton"), len(batches),
                       TRITON_SPEED)
    out.append(_default_cost_goal(by, batches))
    out.append(_goal("captured step replays with the default check on, no host sync",
                     "captured replay", "replayed", _worst(graphs, "syncs"),
                     graphs and all(r["syncs"] == 0 for r in graphs)))
    dots = bench.get("dots") or {}
    speedup = dots.get("speedup")
    out.append(_goal("DOTS prediction (N = 1M, K = 1024, d = 384) vs chunked torch reference",
                     f"DOTS {DOTS_SPEEDUP:g}x its reference", f">= {DOTS_SPEEDUP:g}x",
                     None if speedup is None else f"{speedup:.2f}x",
                     speedup is not None and speedup >= DOTS_SPEEDUP))
    return out


def _worst(rows: list[dict], key: str):
    """"max N (variant@B)" over ``rows``, None without rows."""
    if not rows:
        return None
    top = max(rows, key=lambda r: r[key])
    return f"max {top[key]} ({top['variant']}@{top['B']:,})"


def _launch_ranges(rows: list[dict]) -> dict:
    """Launches per variant: "n" or "lo-hi" over its batch sizes."""
    spans = {}
    for r in rows:
        lo, hi = spans.get(r["variant"], (r["launches"], r["launches"]))
        spans[r["variant"]] = (min(lo, r["launches"]), max(hi, r["launches"]))
    return {v: f"{lo}" if lo == hi else f"{lo}-{hi}" for v, (lo, hi) in spans.items()}


def _floor_of(floor: dict):
    """max(launch floor, random-record floor) of one B, None unless both were measured."""
    if floor.get("launch_s") is None or floor.get("records_s") is None:
        return None
    return max(floor["launch_s"], floor["records_s"])


def _floor_goal(floors: dict, by: dict, batches: list) -> dict:
    pairs = [(b, by["fused_cuda", b]["seconds"] / _floor_of(floors[str(b)])) for b in batches
             if ("fused_cuda", b) in by and _floor_of(floors.get(str(b)) or {})]
    return _worst_goal("fused_cuda vs max(launch floor, random-record floor), every B",
                       f"within {FLOOR_FACTOR:g}x of the floors", f"<= {FLOOR_FACTOR:g}x",
                       [(b, r, r <= FLOOR_FACTOR) for b, r in pairs], len(batches),
                       lambda r: f"{r:.2f}x", worst=max)


def _pairs(by: dict, batches: list, slow: str, fast: str) -> list[tuple]:
    """(B, time(slow) / time(fast)) at each B of ``batches`` where the check's bench timed both."""
    return [(b, by[slow, b]["seconds"] / by[fast, b]["seconds"]) for b in batches
            if (slow, b) in by and (fast, b) in by]


def _pairs_of(lean: dict) -> list[tuple]:
    return [(b, slow / fast) for b, (slow, fast) in sorted(lean.items())]


def _ratio_goal(name: str, short: str, pairs: list[tuple], sizes: int,
                need: float) -> list[dict]:
    """time(slow) / time(fast) >= need at each of ``sizes`` batch sizes (``pairs``: the measured
    ones); the worst B is reported."""
    if not sizes:
        return []
    return [_worst_goal(name, short, f">= {need:.3g}x", [(b, r, r >= need) for b, r in pairs],
                        sizes, lambda r: f"{r:.2f}x", worst=min)]


def _worst_goal(name: str, short: str, target: str, judged: list[tuple], sizes: int, fmt,
                worst) -> dict:
    """A goal over ``sizes`` batch sizes from ``judged`` = [(B, value, met)] at the measured ones:
    not met when any measured size misses it, not measured when none was or some were not (the
    measured ones all meeting it), else met; the worst value reported with its B."""
    if not judged:
        return _goal(name, short, target, None, None)
    batch, value, _ = worst(judged, key=lambda row: row[1])
    missed = [b for b, _, ok in judged if not ok]
    where = (f" (measured at {len(judged)} of {sizes} sizes; missed at {len(missed)})"
             if len(judged) < sizes else "")
    met = False if missed else (None if len(judged) < sizes else True)
    return _goal(name, short, target, f"{fmt(value)} at worst (B = {batch:,}){where}", met)


def _default_cost_goal(by: dict, batches: list) -> dict:
    extra = [(b, by["fused_cuda_default", b]["seconds"] - by["fused_cuda", b]["seconds"])
             for b in batches if ("fused_cuda_default", b) in by and ("fused_cuda", b) in by]
    return _worst_goal("the default call's cost over check_inputs=False (fused_cuda), every B",
                       "the default check's cost", f"<= {DEFAULT_EXTRA_S * 1e6:.0f} us",
                       [(b, e, e <= DEFAULT_EXTRA_S) for b, e in extra], len(batches),
                       lambda e: f"{e * 1e6:.0f} us", worst=max)


def _memory_goals(memory: dict) -> list[dict]:
    measured, predicted = memory.get("peak_gib"), memory.get("predicted_gib", {}).get("total")
    text = None
    if measured is not None and predicted:
        text = f"{measured:.1f} GiB vs {predicted:.1f} GiB ({measured / predicted - 1:+.0%})"
    met = text is not None and abs(measured / predicted - 1) <= MEMORY_TOLERANCE
    return [_goal("update-only peak memory, Qwen2.5-1.5B shape, 8 x 4096 tokens, vs "
                  "docs/gpu-memory.md", "the update's memory against its arithmetic",
                  f"within {MEMORY_TOLERANCE:.0%}", text, met)]


def _peer_goals(peer: dict) -> list[dict]:
    return [_peer_goal(size) for size in _peer_sizes(peer)]


def _peer_sizes(peer: dict) -> list[dict]:
    """The peer stage's figures per size, every size of :data:`PEER_SIZES` (a run from before
    the second size has its one size at the top level)."""
    if "sizes" not in peer and "ratio" in peer:
        return [peer]
    ran = {size["name"]: size for size in peer.get("sizes", [])}
    return [ran.get(name, {"name": name}) for name in PEER_SIZES]


def _peer_goal(size: dict) -> dict:
    ratio = size.get("ratio")
    text = None if ratio is None else (f"{ratio:.2f}x ({size['lze_step_s']:.3f} s vs "
                                       f"{size['trl_step_s']:.3f} s)")
    name = f", {size['name']}" if "name" in size else ""
    return _goal(f"lze_trainer step / TRL GRPOTrainer step{name} (hf generation, same GPU)",
                 f"{PEER_RATIO:g}x TRL's step{name}", f"<= {PEER_RATIO:g}x", text,
                 ratio is not None and ratio <= PEER_RATIO)


# ============================================================================ rendering


def render(results: dict, lean: dict | None = None) -> str:
    """The whole markdown report: machine, stages, goals (``lean``: as :func:`goals`), then every
    figure."""
    pre = results.get("stages", {}).get("preflight", {})
    lines = ["# GPU results", "",
             "Generated by `tools/gpu_report.py` from the JSON of `bash tools/gpu_check.sh`. "
             "Do not edit by hand.", ""]
    lines += _machine(results, pre)
    lines += ["", "## Stages", "", "| stage | status | s | notes |", "|---|---|---|---|"]
    for name, r in results.get("stages", {}).items():
        lines.append(f"| {name} | {r.get('status')} | {r.get('seconds', '')} | "
                     f"{_notes(name, r)} |")
    lines += ["", "## Goals", "", "| goal | target | measured | met |",
              "|---|---|---|---|"]
    for g in goals(results, lean):
        met = {True: "yes", False: "NO", None: "not measured"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | {met} |")
    stages = results.get("stages", {})
    lines += _bench_tables(stages.get("bench", {}))
    lines += _memory_tables(stages.get("trainer", {}), stages.get("memory", {}))
    lines += _peer_table(stages.get("peer", {}))
    return "\n".join(lines) + "\n"


def _machine(results: dict, pre: dict) -> list[str]:
    versions, device = pre.get("versions", {}), pre.get("device", {})
    mismatches = pre.get("mismatches") or []
    return ["| | |", "|---|---|",
            f"| date (UTC) | {results.get('started_utc', '?')} |",
            f"| device | {device.get('name', '?')} ({device.get('memory_mib', '?')} MiB) |",
            f"| driver | {device.get('driver', '?')} |",
            f"| python / torch / triton | {versions.get('python', '?')} / "
            f"{versions.get('torch', '?')} / {versions.get('triton', '?')} |",
            f"| transformers / nvcc | {versions.get('transformers', '?')} / "
            f"{versions.get('nvcc', '?')} |",
            f"| versions unlike {pre.get('expected_from', 'the expected ones')} | "
            f"{'; '.join(mismatches) or 'none'} |",
            f"| command time | {results.get('elapsed_s', '?')} s of a {results.get('budget_s', '?')}"
            f" s budget |",
            *(f"| run {i} | {run} |" for i, run in enumerate(results.get("runs", []), 1))]


def _notes(name: str, r: dict) -> str:
    if r.get("reason"):
        return str(r["reason"])[:160]
    if r.get("error"):
        return str(r["error"])[:160]
    if name == "preflight":
        bits = [] if r.get("cuda_available") else ["no CUDA device"]
        return "; ".join(bits + [f"unlike the expected: {m}" for m in r.get("mismatches", [])])[:300]
    if name == "kernels" and "tests" in r:
        return (f"{r['tests']} tests, {r.get('failures', 0)} failed, {r.get('errors', 0)} errors, "
                f"{r.get('skipped', 0)} skipped; backends {','.join(r.get('backends', []))}")
    if name == "install":
        bad = [m for m, v in r.get("imports", {}).items() if not str(v).startswith("ok")]
        built = (f"wheel {r['package_wheel']}" if r.get("package_wheel")
                 else f"build {r['build_seconds']} s" if "build_seconds" in r
                 else "the installed packages")
        return f"{built}; " + (f"imports failed: {', '.join(bad)}" if bad else "all imports ok")
    if name == "sanitizer":
        return "; ".join(f"{tool}: {v.get('summary', '')}" for tool, v in
                         r.get("tools", {}).items())[:160]
    if name == "trainer":
        return f"exit {r.get('exit_code')}; {len(r.get('steps', []))} steps"
    return ""


FLOOR_COLUMNS = (("launch_s", "empty launch"), ("graph_launch_s", "graph launch"),
                 ("hbm_s", "memcpy of the step's bytes"),
                 ("records_s", "random gather + scatter of B records"))


def _bench_tables(bench: dict) -> list[str]:
    rows = _timed(bench)
    if not rows:
        return []
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    floors = bench.get("floors") or {}
    floor_columns = [(key, label) for key, label in FLOOR_COLUMNS
                     if any(key in floor for floor in floors.values())]
    lines = ["", "## Kernel benchmark", "",
             f"G = {rows[0]['G']}; microseconds per step, host-inclusive (median wall time of a "
             "call from a synchronised device to its end), then launches and host syncs per "
             "step; floors measured in the same run.", "",
             "| B | " + " | ".join(variants + [label for _, label in floor_columns]) + " |",
             "|---" * (len(variants) + len(floor_columns) + 1) + "|"]
    for batch in dict.fromkeys(r["B"] for r in rows):
        cells = {r["variant"]: f"{r['seconds'] * 1e6:.1f} ({r['launches']}, {r['syncs']})"
                 for r in rows if r["B"] == batch}
        floor = floors.get(str(batch), {})
        lines.append(f"| {batch:,} | " + " | ".join(cells.get(v, "") for v in variants)
                     + "".join(f" | {_us(floor.get(key))}" for key, _ in floor_columns) + " |")
    lines += _device_table(rows, variants)
    lines += _speedup_table(rows)
    lines += [f"\n{r['variant']} failed at B = {r['B']:,} and was not run again: {r['error']}"
              for r in bench.get("rows") or [] if "error" in r]
    skipped = [f"{r['B']:,}" for r in rows if r.get("cudagraph_skips")]
    if skipped:
        lines.append(f"\nlean_graph ran without CUDA graphs (inductor skipped them) at B = "
                     f"{', '.join(skipped)}.")
    dots = bench.get("dots")
    if dots:
        lines += ["", "DOTS prediction, N = {n:,}, K = {k:,}, d = {d} ({dtype}): kernel "
                  "{kernel_ms:.3f} ms, chunked torch reference {reference_ms:.3f} ms, speed-up "
                  "{speedup:.2f}x; {tflops:.0f} TFLOP/s, {peak_fraction:.1%} of the bf16 matrix "
                  "peak measured in the same run ({peak_tflops:.0f} TFLOP/s).".format(**dots)]
    return lines


def _device_table(rows: list[dict], variants: list[str]) -> list[str]:
    """Device time per step (CUDA events with the host's launches queued behind a sleep)."""
    timed = [r for r in rows if r.get("device_s") is not None]
    if not timed:
        return []
    columns = [v for v in variants if any(r["variant"] == v for r in timed)]
    lines = ["", "Device time, microseconds per step (CUDA events around the call, with "
             "`torch.cuda._sleep` queued first so the host has issued the call before the "
             "device runs it):", "", "| B | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for batch in dict.fromkeys(r["B"] for r in timed):
        cells = {r["variant"]: _us(r["device_s"]) for r in timed if r["B"] == batch}
        lines.append(f"| {batch:,} | " + " | ".join(cells.get(v, "") for v in columns) + " |")
    return lines


def _speedup_table(rows: list[dict]) -> list[str]:
    """Each fused call's speed-up over the strongest baseline of its kind, named (the bench's
    ``vs``), host-inclusive."""
    rated = [r for r in rows if "vs" in r]
    if not rated:
        return []
    columns = list(dict.fromkeys(r["variant"] for r in rated))
    lines = ["", "Speed-up of each fused call over the strongest baseline of its kind in the same "
             "run (host-inclusive; eager and default calls against the lean step eager and under "
             "torch.compile, graph replay against the lean step under mode=\"reduce-overhead\"):",
             "", "| B | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for batch in dict.fromkeys(r["B"] for r in rated):
        cells = {r["variant"]: f"{r['speedup']:.2f}x vs {r['vs']}" for r in rated
                 if r["B"] == batch}
        lines.append(f"| {batch:,} | " + " | ".join(cells.get(v, "") for v in columns) + " |")
    return lines


def _us(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


def _memory_tables(trainer: dict, memory: dict) -> list[str]:
    lines = []
    phases = trainer.get("peak_memory_gib")
    if phases:
        steps = len(trainer.get("steps", []))
        lines += ["", f"## Trainer: peak GPU memory per phase ({steps} GRPO steps, bf16, ZeRO-2)", "",
                  "| phase | peak GiB |", "|---|---|"]
        lines += [f"| {phase} | {gib:.2f} |" for phase, gib in phases.items()]
    if trainer.get("steps"):
        keys = [k for k in trainer["steps"][0] if k != "step"]
        lines += ["", "| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {s['step']} | " + " | ".join(_fmt(s.get(k)) for k in keys) + " |"
                  for s in trainer["steps"]]
    predicted = memory.get("predicted_gib")
    if memory.get("peak_gib") is not None and predicted:
        lines += ["", "## Update-only pass, Qwen2.5-1.5B shape", "",
                  f"{memory.get('shape')}: measured peak {memory['peak_gib']:.2f} GiB "
                  f"(max_memory_allocated).", "", "| term of the arithmetic | GiB |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in predicted.items()]
    return lines


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _peer_table(peer: dict) -> list[str]:
    sizes = [size for size in _peer_sizes(peer) if size.get("ratio") is not None]
    if not sizes:
        return []
    lines = ["", "## Peer: TRL GRPOTrainer and lze_trainer on the same GPU"]
    for size in sizes:
        name = f"{size['name']}, " if "name" in size else ""
        lines += ["", f"{name}{size.get('setting')}: TRL {size['trl_step_s']:.3f} s per step, "
                  f"lze_trainer {size['lze_step_s']:.3f} s per step (median after a warm-up "
                  f"step): {size['ratio']:.2f}x." + _first_steps(size)]
        lines += _peer_memory(size)
    return lines


def _first_steps(size: dict) -> str:
    if "lze_first_step_s" not in size:
        return ""
    compile_s = size.get("lze_first_step_compile_s")
    captured = "" if compile_s is None else f", {compile_s:.2f} s of it capturing decode steps"
    return (f" First steps: lze_trainer {size['lze_first_step_s']:.2f} s{captured}; TRL "
            f"{size['trl_first_step_s']:.2f} s.")


def _peer_memory(size: dict) -> list[str]:
    phases = size.get("lze_peak_memory_gib") or {}
    if not phases:
        return []
    trl = size.get("trl_peak_memory_gib")
    return ["", "| lze_trainer phase | peak GiB |", "|---|---|",
            *(f"| {phase} | {gib:.2f} |" for phase, gib in phases.items()),
            *([] if trl is None else [f"| TRL GRPOTrainer, whole run | {trl:.2f} |"])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("-o", "--output", type=Path, help="the markdown file (default: print it)")
    args = parser.parse_args(argv)
    markdown = render(json.loads(args.json.read_text()))
    if args.output is None:
        print(markdown, end="")
    else:
        args.output.write_text(markdown)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

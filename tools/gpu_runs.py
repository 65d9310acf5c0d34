"""A GPU run as the docs show it: a folder of docs/gpu-runs/ with the JSON of one or more calls of
the GPU check (``gpu_check.json`` first, then any other ``*.json`` of the same schema, e.g. a
second call that ran a stage the first ran out of time for) and, where measured beside it,
``lean-baseline.json``: the fused step against the shortest plain PyTorch step a user would write
(the "lean" step: mean, std, advantages, gather and scatter of the state, energy,
``torch.topk(E, k, sorted=False)``; eager and under ``torch.compile(dynamic=False)``), timed by a
separate script on the installed package; and ``provenance.json``: for each results file of the
folder, the script that wrote it, at which commit, and the conditions of its timings.

Standard library only (tools/render_docs.py renders docs/gpu-results.md, the README's GPU
figures and docs/gpu-check.md's list of runs from it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402

CHECK_FILE = "gpu_check.json"
LEAN_FILE = "lean-baseline.json"
PROVENANCE_FILE = "provenance.json"
# lean-baseline.json's names of what it timed (tools/gpu_lean_baseline.py), and each one's
# variant in the check's bench (benchmarks/gpu_bench.py).
LEAN_VARIANTS = {"fused_cuda": "fused_cuda", "fused_cuda_default": "fused_cuda_default",
                 "fused_triton": "fused_triton", "fused_triton_default": "fused_triton_default",
                 "torch_plain_eager": "lean_eager", "torch_plain_compile": "lean_compile",
                 "torch_topk_alone": "torch_topk"}


def article(name: str) -> str:
    """A device's name with its article: "an NVIDIA H100", "a GPU" ("an" where the first letter
    is said with a vowel sound)."""
    return ("an " if name[:1].upper() in "AEFHILMNORSX" else "a ") + name


def calls(folder: Path) -> list[tuple[str, dict]]:
    """The folder's check calls in order: gpu_check.json, then the other check JSONs by name."""
    files = sorted(p for p in Path(folder).glob("*.json")
                   if p.name not in (CHECK_FILE, LEAN_FILE, PROVENANCE_FILE))
    ordered = [Path(folder) / CHECK_FILE, *files]
    loaded = [(p.name, json.loads(p.read_text())) for p in ordered if p.exists()]
    return [(name, data) for name, data in loaded if "stages" in data]


def merge(parts: list[tuple[str, dict]]) -> dict:
    """One record of the calls: each stage as the first call that passed it ran it (else the
    last call's), the peer stage's sizes from whichever call measured each, and a line per call
    in ``runs`` (the report's machine table lists them)."""
    first = parts[0][1]
    merged = {**first, "stages": {}, "runs": list(first.get("runs", []))}
    for name, data in parts:
        for stage, result in data["stages"].items():
            held = merged["stages"].get(stage)
            if held is None or held.get("status") != "passed":
                merged["stages"][stage] = result
        if len(parts) > 1:
            merged["runs"].append(_call_line(name, data))
    peers = [data["stages"]["peer"] for _, data in parts if "peer" in data["stages"]]
    sizes = {}
    for peer in peers:
        for size in peer.get("sizes", []):
            if size.get("status") == "passed" or size["name"] not in sizes:
                sizes[size["name"]] = size
    if len(peers) > 1:
        ordered = [sizes[n] for n in gpu_report.PEER_SIZES if n in sizes]
        passed = all(s.get("status") == "passed" for s in ordered)
        merged["stages"]["peer"] = {"status": "passed" if passed else "failed", "sizes": ordered,
                                    "seconds": round(sum(p.get("seconds", 0) for p in peers), 1)}
    merged["elapsed_s"] = round(sum(d.get("elapsed_s", 0) for _, d in parts), 1)
    merged["budget_s"] = (sum(d["budget_s"] for _, d in parts)
                          if all(d.get("budget_s") for _, d in parts) else None)
    return merged


def _call_line(name: str, data: dict) -> str:
    stages = ", ".join(f"{s} ({r.get('status')})" for s, r in data["stages"].items())
    budget = f" of a {data['budget_s']:g} s budget" if data.get("budget_s") else ""
    return f"{name}: {data.get('started_utc', '?')} UTC, {stages}; {data.get('elapsed_s')} s{budget}"


class GpuRun:
    """One folder of docs/gpu-runs/: the merged record, its goals and the lean baseline."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.results = merge(calls(self.folder))
        lean = self.folder / LEAN_FILE
        self.lean = json.loads(lean.read_text()) if lean.exists() else None
        provenance = self.folder / PROVENANCE_FILE
        self.provenance = json.loads(provenance.read_text()) if provenance.exists() else {}

    @property
    def card(self) -> str:
        """The device as the preflight read it, e.g. "an NVIDIA H100 80GB HBM3"."""
        return article(self.results["stages"].get("preflight", {}).get("device", {}).get(
            "name", "GPU"))

    @property
    def date(self) -> str:
        return self.results.get("started_utc", "?").split()[0]

    def goals(self) -> list[dict]:
        """The report's goals, the lean goal judged on lean-baseline.json where the check's bench
        did not time the lean step."""
        return gpu_report.goals(self.results, self.lean_pairs())

    def goals_met(self) -> str:
        """"N of M goals met; not met: ...; not measured: ..." (each goal by its short name)."""
        goals = self.goals()
        line = f"{sum(g['met'] is True for g in goals)} of {len(goals)} goals met"
        for met, words in ((False, "not met"), (None, "not measured")):
            names = [g["short"] for g in goals if g["met"] is met]
            if names:
                line += f"; {len(names)} {words}: {', '.join(names)}"
        return line

    def measured_by(self) -> str:
        """Each results file with the script that wrote it and its commit, in words."""
        parts = []
        for name, entry in self.provenance.items():
            note = f"; {entry['note']}" if entry.get("note") else ""
            commits = " and ".join(f"`{c}`" for c in entry["commit"].split(" and "))
            parts.append(f"{name}: `{entry['script']}` at {commits}{note}")
        return "; ".join(parts) or "not recorded"

    @property
    def conditions(self) -> dict:
        """``{results file: how its timings were taken (warm or cold, the machine's load)}``."""
        return {name: entry.get("conditions", "conditions not recorded")
                for name, entry in self.provenance.items()}

    @property
    def stage_minutes(self) -> str:
        """All stages' seconds together, in minutes (one decimal)."""
        seconds = sum(r.get("seconds", 0) for r in self.results["stages"].values())
        return f"{seconds / 60:.1f} minutes"

    def stages_line(self) -> str:
        return ", ".join(f"{s} {r.get('status')}" for s, r in self.results["stages"].items())

    # ------------------------------------------------------------------------ the kernel step

    def bench_us(self) -> dict:
        """``{(variant, B): microseconds}`` of the check's bench, variants by today's names."""
        bench = self.results["stages"].get("bench", {})
        return {(r["variant"], r["B"]): r["seconds"] * 1e6 for r in gpu_report._timed(bench)}

    def lean_measured(self) -> dict:
        """``{B: {variant: microseconds}}`` of the lean baseline, and the timer both the fused
        and the lean step were timed with: lean-baseline.json where it was measured beside the
        check (CUDA events), else the check's own bench (its ``lean_*`` variants, host wall)."""
        if self.lean:
            return {int(b): {LEAN_VARIANTS[k]: v for k, v in us.items() if k in LEAN_VARIANTS}
                    for b, us in self.lean["bench_us"].items()}
        out: dict = {}
        for (variant, b), us in self.bench_us().items():
            out.setdefault(b, {})[variant] = us
        return {b: row for b, row in sorted(out.items())
                if "lean_compile" in row and "fused_cuda" in row}

    @property
    def timers(self) -> tuple[str, str]:
        """(the timer of the lean comparison, the other timer of the same fused step)."""
        return (EVENTS, HOST) if self.lean else (HOST, DEVICE)

    def other_timer_us(self) -> dict:
        """``{B: microseconds}`` of the fused CUDA step by the other timer of :attr:`timers`."""
        bench = self.bench_us()
        if self.lean:
            return {b: us for (v, b), us in bench.items() if v == "fused_cuda"}
        rows = gpu_report._timed(self.results["stages"].get("bench", {}))
        return {r["B"]: r["device_s"] * 1e6 for r in rows
                if r["variant"] == "fused_cuda" and r.get("device_s") is not None}

    def lean_pairs(self) -> dict:
        """``{B: (lean step compiled, fused CUDA)}`` seconds of lean-baseline.json (``{}`` without
        it), for the lean goal."""
        if not self.lean:
            return {}
        return {b: (us["lean_compile"] * 1e-6, us["fused_cuda"] * 1e-6)
                for b, us in self.lean_measured().items()}

    def lean_rows(self) -> list[dict]:
        """Per B of the lean measurement, in microseconds: the fused CUDA step by both timers,
        the lean step eager and compiled, the fused Triton step, and the check's bench at that B
        (fused CUDA against PlainTorchSelector: feature parity, host wall); each ratio is within
        one timer, and ``spread`` is how far the fused step's two timers disagree."""
        bench, other = self.bench_us(), self.other_timer_us()
        rows = []
        for b, us in self.lean_measured().items():
            row = {"B": b, "fused": us["fused_cuda"], "other": other.get(b),
                   "fused_default": us.get("fused_cuda_default"), "triton": us.get("fused_triton"),
                   "lean_eager": us.get("lean_eager"), "lean_compile": us["lean_compile"],
                   "topk": us.get("torch_topk"), "bench_fused": bench.get(("fused_cuda", b)),
                   "parity_eager": bench.get(("parity_eager", b)),
                   "parity_compile": bench.get(("parity_compile", b))}
            row["vs_lean_compile"] = row["lean_compile"] / row["fused"]
            if row["other"]:
                row["spread"] = max(row["fused"], row["other"]) / min(row["fused"], row["other"])
            if row["lean_eager"]:
                row["vs_lean_eager"] = row["lean_eager"] / row["fused"]
            if row["triton"]:
                row["triton_vs_lean_compile"] = row["lean_compile"] / row["triton"]
            if row["bench_fused"] and row["parity_eager"]:
                row["vs_parity_eager"] = row["parity_eager"] / row["bench_fused"]
            if row["bench_fused"] and row["parity_compile"]:
                row["vs_parity_compile"] = row["parity_compile"] / row["bench_fused"]
            rows.append(row)
        return rows

    def speedup_table(self) -> str:
        """The README's table: per B, the fused CUDA step by both timers of the run against the
        strongest baseline measured (the lean step under torch.compile), a ratio inside the two
        timers' spread shown as a tie; the fused Triton step against the same; and the check's
        bench against PlainTorchSelector (feature parity), its compiled form only where it was
        faster than its eager one."""
        timer, other = self.timers
        lines = [f"| B | fused CUDA, {timer} / {other} | lean step compiled, {timer} | fused CUDA "
                 f"vs lean | fused Triton, {timer} (vs lean) | `PlainTorchSelector` eager / "
                 f"compiled vs fused, {HOST} |", "|---:|---:|---:|---|---:|---:|"]
        for r in self.lean_rows():
            triton = (f"{_us(r['triton'])} ({r['triton_vs_lean_compile']:.2f}x)"
                      if r["triton"] else "-")
            lines.append(f"| {r['B']:,} | {_us(r['fused'])} / {_us(r['other'])} | "
                         f"{_us(r['lean_compile'])} | {_versus(r)} | {triton} | {_parity(r)} |")
        return "\n".join(lines)

    def ties(self) -> str:
        """"3 of 5" sizes where the fused CUDA step's lead over the lean step compiled is inside
        its own two timers' spread."""
        rows = self.lean_rows()
        return f"{sum(_tie(r) for r in rows)} of {len(rows)}"

    def triton_line(self) -> str:
        """Where the fused Triton step, ``auto``'s fallback, stood against the lean step
        compiled, in words."""
        rows = [r for r in self.lean_rows() if r["triton"]]
        slower = [r for r in rows if r["triton_vs_lean_compile"] < 1]
        if not rows:
            return "The fused Triton step was not timed against the lean step."
        return (f"The fused Triton step (`auto`'s fallback where the CUDA module is not built) "
                f"was slower than the lean step under `torch.compile` at {len(slower)} of "
                f"{len(rows)} sizes ({_span(r['triton_vs_lean_compile'] for r in rows)} its "
                "speed).")

    def lean_table(self) -> str:
        """docs/gpu-results.md's table of the lean measurement: every variant it timed."""
        timer, other = self.timers
        lines = [f"| B | fused CUDA, unchecked ({other}) | fused CUDA, default (deferred check) | "
                 "fused Triton, unchecked | lean step, eager | lean step, `torch.compile` | "
                 "`torch.topk` of B keys alone | fused CUDA vs lean compiled | vs lean eager |",
                 "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in self.lean_rows():
            lines.append(f"| {r['B']:,} | {_us(r['fused'])} ({_us(r['other'])}) | "
                         f"{_us(r['fused_default'])} | {_us(r['triton'])} | "
                         f"{_us(r['lean_eager'])} | {_us(r['lean_compile'])} | {_us(r['topk'])} | "
                         f"{_versus(r)} | {_x(r.get('vs_lean_eager'))} |")
        return "\n".join(lines)

    def oracle_line(self) -> str:
        """The lean script's float64 oracle, host-sync and deferred-fault checks, in words."""
        if not self.lean or not any(k.startswith("oracle_") for k in self.lean):
            return ""
        parts = []
        for backend in ("cuda", "triton"):
            oracle = self.lean.get(f"oracle_{backend}", {})
            if oracle:
                parts.append(f"{backend}: {oracle['n_fail']} failures, largest error "
                             f"{oracle['max_abs_err']:.2g}")
        syncs = [k for k in self.lean if k.startswith("nosync_")]
        nosync = all(self.lean[k] for k in syncs)
        faults = [k for k in self.lean if k.startswith("deferred_fault_") and self.lean[k]]
        return (f"Against a float64 oracle over multi-step runs: {'; '.join(parts)}. "
                + (f"Unchecked and default steps ran with no host sync under "
                   f"`torch.cuda.set_sync_debug_mode(\"error\")` ({len(syncs)} cases). "
                   if syncs and nosync else "")
                + (f"A NaN reward raised at a later default step on {len(faults)} backends."
                   if faults else ""))

    @property
    def peers(self) -> dict:
        """Per peer size, lze_trainer's step against TRL's in words, with the peak memory of
        each."""
        out = {}
        for name in gpu_report.PEER_SIZES:
            size = self.peer(name)
            out[name] = (f"{size['ratio']:.2f}x ({_s(size['lze_step_s'])} against "
                         f"{_s(size['trl_step_s'])} a step at {size['setting']}; "
                         f"{_peak_memory(size)})" if size else "not measured")
        return out

    def peer(self, name: str) -> dict:
        """The peer stage's figures at one size (``{}`` where not measured)."""
        for size in gpu_report._peer_sizes(self.results["stages"].get("peer", {})):
            if size.get("name") == name and size.get("ratio") is not None:
                return size
        return {}


EVENTS, HOST, DEVICE = "CUDA events", "host wall", "device time"  # the timers of a run


def _tie(row: dict) -> bool:
    """The lead over the lean step compiled inside the fused step's own two timers' spread."""
    spread = row.get("spread")
    return spread is not None and 1 / spread <= row["vs_lean_compile"] <= spread


def _versus(row: dict) -> str:
    ratio = row["vs_lean_compile"]
    if _tie(row):
        return f"tie: {ratio:.2f}x, inside its timers' {row['spread']:.2f}x"
    return f"**{ratio:.2f}x**" if ratio > 1 else f"{ratio:.2f}x (slower)"


def _parity(row: dict) -> str:
    if "vs_parity_eager" not in row:
        return "not measured"
    compiled = row.get("vs_parity_compile")
    slower = compiled is not None and row["parity_compile"] > row["parity_eager"]
    return (f"{row['vs_parity_eager']:.3g}x / " + ("-" if compiled is None else
            f"slower than its eager ({row['parity_compile'] / row['parity_eager']:.1f}x its time)"
            if slower else f"{compiled:.3g}x"))


def _span(values) -> str:
    values = list(values)
    low, high = min(values), max(values)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _peak_memory(size: dict) -> str:
    phases, trl = size.get("lze_peak_memory_gib") or {}, size.get("trl_peak_memory_gib")
    if not phases or trl is None:
        return "peak memory not recorded"
    phase = max(phases, key=phases.get)
    return (f"peak memory {phases[phase]:.1f} GiB (lze_trainer's {phase}) against TRL's "
            f"{trl:.1f} GiB")


def _us(value) -> str:
    return "-" if value is None else f"{value:,.0f} µs"


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 1 else f"{seconds:.2f} s"


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.3g}x"

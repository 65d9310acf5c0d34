"""A GPU run as the docs show it: a folder of docs/gpu-runs/ with the JSON of one or more calls of
the GPU check (``gpu_check.json`` first, then any other ``*.json`` of the same schema, e.g. a
second call that ran a stage the first ran out of time for) and, where measured beside it,
``lean-baseline.json``: the fused step against the shortest plain PyTorch step a user would write
(the "lean" step: mean, std, advantages, gather and scatter of the state, energy,
``torch.topk(E, k, sorted=False)``; eager and under ``torch.compile(dynamic=False)``), timed by a
separate script on the installed package.

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


def article(name: str) -> str:
    """A device's name with its article: "an NVIDIA H100", "a GPU" ("an" where the first letter
    is said with a vowel sound)."""
    return ("an " if name[:1].upper() in "AEFHILMNORSX" else "a ") + name


def calls(folder: Path) -> list[tuple[str, dict]]:
    """The folder's check calls in order: gpu_check.json, then the other check JSONs by name."""
    files = sorted(p for p in Path(folder).glob("*.json") if p.name not in (CHECK_FILE, LEAN_FILE))
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

    @property
    def card(self) -> str:
        """The device as the preflight read it, e.g. "an NVIDIA H100 80GB HBM3"."""
        return article(self.results["stages"].get("preflight", {}).get("device", {}).get(
            "name", "GPU"))

    @property
    def date(self) -> str:
        return self.results.get("started_utc", "?").split()[0]

    def goals(self) -> list[dict]:
        return gpu_report.goals(self.results)

    def goals_met(self) -> str:
        """"N of M goals met (K not measured)"."""
        goals = self.goals()
        met = sum(g["met"] is True for g in goals)
        unmeasured = sum(g["met"] is None for g in goals)
        return f"{met} of {len(goals)} goals met" + (
            f" ({unmeasured} not measured)" if unmeasured else "")

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
        """``{B: {variant: microseconds}}`` of the lean baseline: lean-baseline.json where it was
        measured beside the check, else the check's own bench (its ``lean_*`` variants)."""
        if self.lean:
            names = {"fused_cuda": "fused_cuda", "fused_cuda_default": "fused_cuda_default",
                     "fused_triton": "fused_triton", "torch_plain_eager": "lean_eager",
                     "torch_plain_compile": "lean_compile", "torch_topk_alone": "torch_topk"}
            return {int(b): {names[k]: v for k, v in us.items() if k in names}
                    for b, us in self.lean["bench_us"].items()}
        out: dict = {}
        for (variant, b), us in self.bench_us().items():
            out.setdefault(b, {})[variant] = us
        return {b: row for b, row in sorted(out.items())
                if "lean_compile" in row and "fused_cuda" in row}

    def lean_rows(self) -> list[dict]:
        """Per B of the lean measurement: the fused CUDA step, the lean step eager and compiled,
        and the check's bench at that B (fused CUDA against PlainTorchSelector: feature parity), in
        microseconds; each speed-up is within one measurement."""
        bench = self.bench_us()
        rows = []
        for b, us in self.lean_measured().items():
            row = {"B": b, "fused": us["fused_cuda"], "fused_default": us.get("fused_cuda_default"),
                   "triton": us.get("fused_triton"), "lean_eager": us.get("lean_eager"),
                   "lean_compile": us["lean_compile"], "topk": us.get("torch_topk"),
                   "bench_fused": bench.get(("fused_cuda", b)),
                   "parity_eager": bench.get(("parity_eager", b)),
                   "parity_compile": bench.get(("parity_compile", b))}
            row["vs_lean_compile"] = row["lean_compile"] / row["fused"]
            if row["lean_eager"]:
                row["vs_lean_eager"] = row["lean_eager"] / row["fused"]
            if row["bench_fused"] and row["parity_eager"] and row["parity_compile"]:
                row["vs_parity_eager"] = row["parity_eager"] / row["bench_fused"]
                row["vs_parity_compile"] = row["parity_compile"] / row["bench_fused"]
            rows.append(row)
        return rows

    def lean_speedups(self) -> str:
        """The fused CUDA step's speed-ups over the lean step under torch.compile, lowest to
        highest, e.g. "1.09-2.88x"."""
        ratios = [r["vs_lean_compile"] for r in self.lean_rows()]
        return f"{min(ratios):.3g}-{max(ratios):.3g}x" if ratios else "not measured"

    def speedup_table(self) -> str:
        """The README's table: per B, the fused CUDA step against the strongest baseline measured
        (the lean step under torch.compile) and against PlainTorchSelector (feature parity)."""
        lines = ["| B | fused CUDA step | lean PyTorch step, `torch.compile` | speed-up | "
                 "`PlainTorchSelector`, eager / `torch.compile` (feature parity) |",
                 "|---:|---:|---:|---:|---:|"]
        for r in self.lean_rows():
            parity = (f"{r['vs_parity_eager']:.3g}x / {r['vs_parity_compile']:.3g}x"
                      if "vs_parity_eager" in r else "not measured")
            lines.append(f"| {r['B']:,} | {_us(r['fused'])} | {_us(r['lean_compile'])} | "
                         f"**{r['vs_lean_compile']:.3g}x** | {parity} |")
        return "\n".join(lines)

    def lean_table(self) -> str:
        """docs/gpu-results.md's table of the lean script: every variant it timed."""
        lines = ["| B | fused CUDA, unchecked | fused CUDA, default (deferred check) | fused Triton, "
                 "unchecked | lean step, eager | lean step, `torch.compile` | `torch.topk` of B keys "
                 "alone | fused CUDA vs lean compiled | vs lean eager |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.lean_rows():
            lines.append(f"| {r['B']:,} | {_us(r['fused'])} | {_us(r['fused_default'])} | "
                         f"{_us(r['triton'])} | {_us(r['lean_eager'])} | {_us(r['lean_compile'])} | "
                         f"{_us(r['topk'])} | {r['vs_lean_compile']:.3g}x | "
                         f"{_x(r.get('vs_lean_eager'))} |")
        return "\n".join(lines)

    def oracle_line(self) -> str:
        """The lean script's float64 oracle, host-sync and deferred-fault checks, in words."""
        if not self.lean:
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

    def bench_ratios(self, baseline: str) -> str:
        """The fused CUDA step's speed-ups over ``baseline`` (a variant of the check's bench) at
        every B it timed, lowest to highest, e.g. "3.94-19.3x"."""
        rows = self.bench_us()
        ratios = [rows[baseline, b] / rows["fused_cuda", b] for v, b in rows
                  if v == "fused_cuda" and (baseline, b) in rows]
        return f"{min(ratios):.3g}-{max(ratios):.3g}x" if ratios else "not measured"

    @property
    def parity_eager(self) -> str:
        return self.bench_ratios("parity_eager")

    @property
    def parity_compile(self) -> str:
        return self.bench_ratios("parity_compile")

    @property
    def launches(self) -> str:
        """Kernel launches of the fused CUDA step by B, e.g. "2 up to B = 65,536, 7 above"."""
        rows = sorted((r["B"], r["launches"]) for r in
                      gpu_report._timed(self.results["stages"].get("bench", {}))
                      if r["variant"] == "fused_cuda" and "launches" in r)
        if not rows:
            return "not measured"
        spans = []
        for batch, count in rows:
            if spans and spans[-1][2] == count:
                spans[-1][1] = batch
            else:
                spans.append([batch, batch, count])
        return ", ".join(f"{count} at B = {lo:,}" if lo == hi else
                         f"{count} at B = {lo:,} to {hi:,}" for lo, hi, count in spans)

    @property
    def peers(self) -> dict:
        """Per peer size, lze_trainer's step against TRL's in words."""
        out = {}
        for name in gpu_report.PEER_SIZES:
            size = self.peer(name)
            out[name] = (f"{size['ratio']:.2f}x ({_s(size['lze_step_s'])} against "
                         f"{_s(size['trl_step_s'])} a step at {size['setting']})"
                         if size else "not measured")
        return out

    def peer(self, name: str) -> dict:
        """The peer stage's figures at one size (``{}`` where not measured)."""
        for size in gpu_report._peer_sizes(self.results["stages"].get("peer", {})):
            if size.get("name") == name and size.get("ratio") is not None:
                return size
        return {}


def _us(value) -> str:
    return "-" if value is None else f"{value:,.0f} µs"


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 1 else f"{seconds:.2f} s"


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.3g}x"

"""Turn the pytest-benchmark JSON of test_bench_step.py into a page of medians and ratios (each
named by its baseline, the strongest measured first) and a plot of time against B, and fold in
the per-kernel resources the GPU suites write (benchmarks/results/*_resources*.json).

Usage: python benchmarks/report.py RUN_FOLDER/benchmarks.json [--name NAME]
(writes NAME.md and NAME.png beside the JSON, in the run folder `make bench` made; NAME is by
default step_cpu or step_cuda, the device the steps ran on; docs/benchmarks.md renders
step_cpu.md once recorded: python tools/render_docs.py --record RUN_FOLDER)
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # the GPU suites' resource files
VARIANTS = ("fused", "torch_lean", "torch_lean_compile", "torch_plain", "torch_plain_compile",
            "python_loop", "floor")
# What a user could run instead of the fused step (the floor is a bound, not an alternative).
BASELINES = ("torch_lean", "torch_lean_compile", "torch_plain", "torch_plain_compile",
             "python_loop")
PHASES = ("fused_update", "fused_topk")  # test_bench_phases.py
LABELS = {"fused": "fused", "torch_lean": "lean PyTorch",
          "torch_lean_compile": "lean PyTorch, torch.compile",
          "torch_plain": "feature-parity PyTorch",
          "torch_plain_compile": "feature parity, torch.compile",
          "python_loop": "Python loop", "floor": "floor (rewards.sum)"}
# (B, G, description, measured ratio, how it compares, bound)
TARGETS = (
    (16384, 16, "fused step >= 3x faster than the plain PyTorch step", "eager", ">=", 3.0),
    (16384, 16, "fused step >= 3x faster than the plain step under torch.compile", "compile",
     ">=", 3.0),
    (16384, 16, "fused step >= 300x faster than the Python loop", "loop", ">=", 300.0),
    (65536, 16, "fused step within 3x of the floor", "floor", "<=", 3.0),
)
# test_bench_busy.py: the cpu step on the machine as it is and with every core busy.
BUSY_CASES = ("quiet single", "quiet default", "busy single", "busy default")
BUSY_TARGET = (16384, 16, 2.0)  # busy default <= 2x busy single-thread


# ----------------------------------------------------------------------------- loading


def step_seconds(bench: dict) -> float:
    """Median seconds of one step: device time (CUDA events) when recorded, else host time."""
    return bench["extra_info"].get("device_median_s", bench["stats"]["median"])


def device_of(data: dict) -> str:
    """"cuda" when any benchmark of the run ran on a GPU, else "cpu"."""
    devices = {b["extra_info"].get("device") for b in data["benchmarks"]}
    return "cuda" if "cuda" in devices else "cpu"


def load_times(data: dict) -> dict:
    """{(B, G): {variant: extra_info + seconds (median) + best (fastest round, host)}}."""
    table = defaultdict(dict)
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if "variant" not in info:  # a benchmark with a results file of its own (host cost)
            continue
        table[info["B"], info["G"]][info["variant"]] = {
            **info, "seconds": step_seconds(bench), "best": bench["stats"]["min"]}
    return dict(sorted(table.items()))


def ratios(row: dict, time_key: str = "seconds") -> dict:
    """Speed-ups of the fused step over eager, compile and the loop; fused time over floor."""
    seconds = {v: r[time_key] for v, r in row.items()}
    fused = seconds.get("fused")
    if fused is None:
        return {}
    out = {name: seconds[v] / fused for name, v in
           (("eager", "torch_plain"), ("compile", "torch_plain_compile"), ("loop", "python_loop"),
            ("lean", "torch_lean"), ("lean_compile", "torch_lean_compile"))
           if v in seconds}
    if "floor" in seconds:
        out["floor"] = fused / seconds["floor"]
    return out


# ----------------------------------------------------------------------------- markdown


def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def fmt_ratio(value) -> str:
    return "-" if value is None else f"{value:.3g}x"


def strongest(row: dict):
    """(label, its time / fused) of the fastest alternative measured in a row, or None."""
    measured = [v for v in BASELINES if v in row]
    if "fused" not in row or not measured:
        return None
    best = min(measured, key=lambda v: row[v]["seconds"])
    return LABELS[best], row[best]["seconds"] / row["fused"]["seconds"]


def time_table(times: dict) -> list[str]:
    """Median times, then each ratio named by its baseline: the strongest alternative measured
    at that size first."""
    head = ["B", "G", *(LABELS[v] for v in VARIANTS), "strongest baseline",
            "strongest / fused", "lean compile / fused", "parity compile / fused",
            "loop / fused", "fused / floor", "fused GB/s"]
    lines = [_row(head), _row(["---:"] * len(head))]
    for (batch, group), row in times.items():
        if not any(v in row for v in VARIANTS):
            continue
        r, best = ratios(row), strongest(row)
        fused = row.get("fused")
        bandwidth = f"{fused['bytes'] / fused['seconds'] / 1e9:.2f}" if fused else "-"
        cells = [fmt_time(row[v]["seconds"]) if v in row else "-" for v in VARIANTS]
        lines.append(_row([batch, group, *cells, best[0] if best else "-",
                           fmt_ratio(best[1] if best else None),
                           *(fmt_ratio(r.get(k)) for k in ("lean_compile", "compile", "loop",
                                                            "floor")),
                           bandwidth]))
    return lines


def phase_table(times: dict) -> list[str]:
    """The fused step's two launches timed apart, against the whole step and the floor."""
    rows = {key: row for key, row in times.items() if all(p in row for p in PHASES)}
    if not rows:
        return []
    head = ["B", "G", "update", "top-k", "update + top-k", "whole step", "floor"]
    lines = ["", "## Phases of the fused step", "", _row(head), _row(["---:"] * len(head))]
    for (batch, group), row in rows.items():
        update, topk = (row[p]["seconds"] for p in PHASES)
        rest = [fmt_time(row[v]["seconds"]) if v in row else "-" for v in ("fused", "floor")]
        lines.append(_row([batch, group, fmt_time(update), fmt_time(topk),
                           fmt_time(update + topk), *rest]))
    return lines


def busy_ratio(row: dict):
    """busy default / busy single-thread, the cost of threads on shared cores, from the calls
    taken in turn under the same spinners (None: not measured)."""
    case = row.get("cpu busy default") or {}
    if "interleaved_single_s" not in case:
        return None
    return case["interleaved_default_s"] / case["interleaved_single_s"]


def busy_table(times: dict) -> list[str]:
    """The cpu step with every core busy next to the quiet machine (test_bench_busy.py)."""
    rows = {key: row for key, row in times.items() if f"cpu {BUSY_CASES[0]}" in row}
    if not rows:
        return []
    head = ["B", "G", *BUSY_CASES, "busy default / busy single (calls in turn)",
            "busy default / quiet single",
            "load avg quiet / busy"]
    lines = ["", "## CPU step with every core busy", "",
             "`single`: `LZE_NUM_THREADS=1`; `default`: up to `torch.get_num_threads()` threads "
             "or the calling thread alone, whichever has been faster; `busy`: one busy-loop "
             "process per core for the duration of the case. Load average: 1 minute, at the end "
             "of each case (the machine may be shared).", "", _row(head),
             _row(["---:"] * len(head))]
    for (batch, group), row in rows.items():
        cells = {case: row.get(f"cpu {case}") for case in BUSY_CASES}
        quiet_single, busy_default = cells["quiet single"], cells["busy default"]
        vs_quiet = (busy_default["seconds"] / quiet_single["seconds"]
                    if quiet_single and busy_default else None)
        loads = "/".join(f"{cells[c]['load_average']:.1f}" if cells[c] else "-"
                         for c in ("quiet default", "busy default"))
        lines.append(_row([batch, group,
                           *(fmt_time(c["seconds"]) if c else "-" for c in cells.values()),
                           fmt_ratio(busy_ratio(row)), fmt_ratio(vs_quiet), loads]))
    return lines


def busy_target_line(times: dict) -> list[str]:
    batch, group, bound = BUSY_TARGET
    row = times.get((batch, group), {})
    if f"cpu {BUSY_CASES[0]}" not in row:
        return []
    ratio = busy_ratio(row)
    verdict = ("NOT MEASURED" if ratio is None else
               f"{'PASS' if ratio <= bound else 'FAIL'} ({ratio:.3g}x)")
    return [f"- B={batch}, G={group}: cpu step with every core busy <= {bound:g}x its "
            f"single-thread time with the cores busy: **{verdict}**"]


def launch_table(times: dict) -> list[str]:
    """Device kernel launches per step (GPU runs only; the fused backend should launch 2)."""
    if not any("kernel_launches" in r for row in times.values() for r in row.values()):
        return []
    head = ["B", "G", *(LABELS[v] for v in VARIANTS)]
    lines = ["", "Device kernel launches per step (torch.profiler; fused expected: 2):", "",
             _row(head), _row(["---:"] * len(head))]
    for (batch, group), row in times.items():
        lines.append(_row([batch, group, *(row.get(v, {}).get("kernel_launches", "-")
                                           for v in VARIANTS)]))
    return lines


def target_lines(times: dict) -> list[str]:
    lines = []
    for batch, group, text, key, op, bound in TARGETS:
        row = times.get((batch, group), {})
        value, best = ratios(row).get(key), ratios(row, "best").get(key)
        if value is None:
            verdict = "NOT MEASURED"
        else:
            ok = value >= bound if op == ">=" else value <= bound
            verdict = (f"{'PASS' if ok else 'FAIL'} (median {value:.3g}x; "
                       f"fastest rounds {best:.3g}x)")
        backend = row.get("fused", {}).get("backend")
        measured_on = f" [`{backend}`]" if backend else ""
        lines.append(f"- B={batch}, G={group}: {text}{measured_on}: **{verdict}**")
    return lines


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# ----------------------------------------------------------------------------- kernel resources


def demangle_nested(name: str) -> str:
    """``_ZN3lze9cuda_step15lze_step_kernelE...`` -> ``lze::cuda_step::lze_step_kernel``."""
    if not name.startswith("_ZN"):
        return name
    parts, rest = [], name[3:]
    while (m := re.match(r"(\d+)", rest)):
        length, rest = int(m[1]), rest[len(m[1]):]
        parts.append(rest[:length])
        rest = rest[length:]
    return "::".join(parts) or name


def resource_rows() -> list[dict]:
    """Per-kernel resources from results/triton_resources_<version>.json (one per Triton
    version tested) and results/cuda_resources.json, one dict per kernel and architecture:
    source, kernel, arch, registers, smem, spill_stores, spill_loads, stack."""
    rows = []
    for path in sorted(RESULTS.glob("triton_resources_*.json")):  # one per Triton version
        report = json.loads(path.read_text())
        source = f"triton {report['triton']}"
        for k in report["kernels"]:
            rows.append(dict(source=source, kernel=k["name"], arch=k["arch"],
                             registers=k["registers"], smem=k["shared_bytes"],
                             spill_stores=k["spill_stores"], spill_loads=k["spill_loads"],
                             stack=k["stack_bytes"]))
    cuda = RESULTS / "cuda_resources.json"
    if cuda.exists():
        for arch, kernels in json.loads(cuda.read_text()).items():
            for name, k in kernels.items():
                rows.append(dict(source="cuda", kernel=demangle_nested(name), arch=arch,
                                 registers=k["registers"], smem=k["smem_bytes"],
                                 spill_stores=k.get("spill_store_bytes", 0),
                                 spill_loads=k.get("spill_load_bytes", 0),
                                 stack=k.get("stack_bytes", 0)))
    return rows


def resource_table(rows: list[dict]) -> list[str]:
    """One line per (source, kernel family, arch): the worst case over its specialisations
    (Triton compiles one variant per BLOCK_G, dtype and mask)."""
    if not rows:
        return []
    families = defaultdict(list)
    for r in rows:
        families[r["source"], r["kernel"].split("[")[0], r["arch"]].append(r)
    head = ["source", "kernel", "arch", "variants", "max registers", "max smem (B)",
            "max spill stores", "max spill loads", "max stack (B)"]
    lines = ["", "## Kernel resources (ptxas, from the GPU test suites)", "",
             _row(head), _row(["---"] * 3 + ["---:"] * 6)]
    for (source, kernel, arch), group in sorted(families.items()):
        worst = [max(r[f] for r in group)
                 for f in ("registers", "smem", "spill_stores", "spill_loads", "stack")]
        lines.append(_row([source, f"`{kernel}`", arch, len(group), *worst]))
    return lines


# ----------------------------------------------------------------------------- output


def summary(data: dict, times: dict) -> str:
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {})
    dirty = " (dirty)" if commit.get("dirty") else ""
    timing = ("CUDA events" if any("device_median_s" in r for row in times.values()
                                   for r in row.values()) else "host perf_counter")
    lines = [
        "# LZE selection step: benchmark summary", "",
        f"{data.get('datetime', '?')}, commit {commit.get('id', '?')[:10]}{dirty}; "
        f"device {machine.get('device', '?')}, torch {machine.get('torch', '?')}, "
        f"fused backend `{machine.get('fused_backend', '?')}`; median of each case, "
        f"timed with {timing}. Load average (1/5/15 min) when the run ended: "
        f"{'/'.join(f'{x:.1f}' for x in machine.get('load_average', ()))} "
        f"(the benchmark itself adds up to its thread count).", "",
        "One step = `LZESelector.step(rewards, prompt_ids, check_inputs=False)` (fused "
        "statistics + state update + noisy top-k), N = 4B prompts, binary rewards. "
        "Ratios > 1 under `x / fused` mean the fused step is faster; `fused / floor` is the "
        "fused time over one `rewards.sum(dim=1)`.", "",
        "## Targets", "", *target_lines(times), *busy_target_line(times), "",
        "## Median step time and ratios", "", *time_table(times), *launch_table(times),
        *phase_table(times), *busy_table(times),
        *resource_table(resource_rows()),
    ]
    return "\n".join(lines) + "\n"


def plot(times: dict, path: Path) -> None:
    groups = sorted({g for _, g in times})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), sharey=True,
                             squeeze=False)
    for ax, group in zip(axes[0], groups):
        for variant in VARIANTS:
            points = [(b, row[variant]["seconds"]) for (b, g), row in times.items()
                      if g == group and variant in row]
            if points:
                ax.plot(*zip(*points), marker="o", label=LABELS[variant])
        ax.set(xscale="log", yscale="log", title=f"G = {group}", xlabel="B (prompt groups)")
        ax.set_xticks(sorted({b for b, g in times if g == group}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median time per step (s)")
    axes[0][0].legend()
    fig.suptitle("LZE selection step: time vs batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--name", help="writes NAME.md and NAME.png beside the JSON (default: "
                        "step_cpu or step_cuda, the device the steps ran on)")
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    times = load_times(data)
    if not times:  # no step benchmark ran: no page (a recorded one must not be emptied)
        print(f"{args.json}: no step benchmark in this run; no report written")
        return
    text = summary(data, times)
    name = args.name or f"step_{device_of(data)}"
    page, figure = (args.json.parent / f"{name}{suffix}" for suffix in (".md", ".png"))
    page.write_text(text)
    plot(times, figure)
    print(text)
    print(f"wrote {page} and {figure}")


if __name__ == "__main__":
    main()

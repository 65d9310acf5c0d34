"""The GPU check's kernel benchmark: every step variant at every B in one run, each against the
strongest thing a user could run instead, with the kernel launches and host syncs of one step
counted by ``torch.profiler``, and the hardware floors measured in the same run.

Variants (one call each on fresh binary rewards and ids per round, bench_common.RoundInputs; the
stateful ones keep N = 4 B prompts; noise on, as by default):

* ``fused_cuda``, ``fused_triton`` (``fused_cpu`` on a CPU): ``LZESelector.step(...,
  check_inputs=False)``, the unchecked call; ``fused_<backend>_default``: the default call (on a
  GPU its value check is the step kernel's copy of the fault word into host-mapped memory, read
  at a later step); ``fused_<backend>_graph`` (GPU): ``LZESelector.capture_step``, the inputs
  copied into its static buffers and ``replay()``, the default check on;
* ``lean_eager``, ``lean_compile``, ``lean_graph``: torch_baselines.LeanTorchStep, the shortest
  step a user would write (about twenty ops, ``torch.topk(E, k, sorted=False)``, ``torch.rand``
  Gumbel noise), eager, under ``torch.compile(fullgraph=True, dynamic=False)`` compiled per B, and
  (GPU) under ``mode="reduce-overhead"`` (CUDA graphs), the strongest PyTorch baselines;
* ``torch_topk``: ``torch.topk(keys, k, sorted=False)`` of B float keys alone;
* ``parity_eager`` ("feature parity"): torch_baselines.PlainTorchSelector, the same semantics as
  the fused step in plain PyTorch (ragged groups, the tie rule, the pruner's streaks).

Each figure is taken two ways (:func:`time_step`): host-inclusive, the wall time of a call from a
synchronised device to its last kernel's end (what a training loop waits: the host's launches and
the device's work, whichever is longer), and device time, the CUDA events around the call with
``torch.cuda._sleep`` queued first, so the host has issued the whole call before the device
starts it (no launch gaps). ``seconds`` is the host-inclusive median.

Floors (:func:`floors`), measured per B in the same run: an empty launch and one CUDA-graph launch
(host-inclusive), a device-to-device copy of the step's bytes (the HBM floor), and a random gather
and scatter of B 32-byte records of an N-row table (the floor of the state's random traffic).

The reference backend (``backend="torch"``) is the correctness oracle, not a speed anchor: it is
not timed. Launches are the device-side kernels, copies and memsets of one step; host syncs are
the CUDA runtime calls that block the host inside the step (``cudaStreamSynchronize`` and
friends: every ``.item()``, ``nonzero`` and device-to-host copy makes one). On a CPU there are no
device events: syncs are then counted as the ops that would block the host on a device
(``aten::_local_scalar_dense`` from ``.item()``, ``aten::nonzero``), which is what the CPU tests
check. :func:`dots_benchmark` times the DOTS prediction at N = 1M, K = 1024, d = 384 against the
chunked torch reference, and its share of the bf16 matrix peak measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from bench_common import RoundInputs, unchecked
from torch_baselines import LeanTorchStep, PlainTorchSelector

from lze_kernels import LZESelector, available_backends, num_keep

BATCHES = (256, 4096, 16384, 65536, 262144, 1048576)
GROUP = 16
KEEP_RATIO = 0.4
# DOTS at the study's embedding size and a large prompt pool.
DOTS_N, DOTS_K, DOTS_D = 1 << 20, 1024, 384
STEP_RANGE = "gpu_check.step"
# CUDA runtime/driver calls that block the host until the device has caught up.
CUDA_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                   "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2")
# Ops that block the host when their input is on a device (the CPU stand-in for the above).
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
FUSED_BACKENDS = {"cuda": ("cuda", "triton"), "cpu": ("cpu",)}
BASELINES = ("lean_eager", "lean_compile", "lean_graph", "torch_topk", "parity_eager")
COMPILED = ("lean_compile", "lean_graph")
GPU_ONLY = ("lean_graph",)
# What each fused call is held against: the strongest lean baseline of the same kind
# (host-inclusive eager calls against eager and compiled ones; graph replays against graphs).
BASELINES_OF = {"": ("lean_eager", "lean_compile"), "_default": ("lean_eager", "lean_compile"),
                "_graph": ("lean_graph",)}
# torch.cuda._sleep runs about this many cycles a second (SM clocks up to ~2 GHz): the sleep
# queued before a device timing covers three times the call's host time.
SLEEP_CYCLES_PER_S = 2e9
MAX_SLEEP_CYCLES = 2e8


def variants_for(device: torch.device, include_compile: bool = True) -> list[str]:
    """The variants that run on ``device``: its fused backends (the first also with its default
    check and, on a GPU, captured), then the baselines."""
    native = FUSED_BACKENDS[device.type]  # not the emulators or interpreters of other devices
    fused = []
    for name in native:
        if name in available_backends(device):
            fused += [f"fused_{name}", f"fused_{name}_default"]
            if device.type == "cuda":
                fused.append(f"fused_{name}_graph")
    baselines = [b for b in BASELINES if (include_compile or b not in COMPILED)
                 and (device.type == "cuda" or b not in GPU_ONLY)]
    return fused + baselines


def fused_parts(variant: str) -> tuple[str, str]:
    """``fused_<backend><kind>`` -> (backend, kind), kind one of "", "_default", "_graph"."""
    name = variant[len("fused_"):]
    for kind in ("_default", "_graph"):
        if name.endswith(kind):
            return name[:-len(kind)], kind
    return name, ""


def build_step(variant: str, num_prompts: int, device: torch.device, batch: int,
               inputs: RoundInputs | None = None) -> Callable:
    """A callable ``(rewards, prompt_ids) -> outputs`` for ``variant`` with fresh state
    (``inputs`` gives a captured step its first batch)."""
    if variant.startswith("fused_"):
        backend, kind = fused_parts(variant)
        selector = LZESelector(num_prompts, device=device, backend=backend)
        if kind == "_graph":
            return _replayed(selector, inputs or RoundInputs(batch, GROUP, device))
        return selector.step if kind == "_default" else unchecked(selector.step)
    if variant.startswith("lean_"):
        lean = LeanTorchStep(num_prompts, device=device)
        if variant == "lean_eager":
            return lean.step
        torch._dynamo.reset()  # compiled per B: a fresh cache, no recompile limit
        if variant == "lean_graph":
            # The state lives at fixed addresses, as a module's buffers would: CUDA graphs may
            # then update it in place (mutated inputs otherwise make inductor skip the graph).
            for state in (lean.d_init, lean.ema, lean.seen):
                torch._dynamo.mark_static_address(state)
            return torch.compile(lean.step, fullgraph=True, dynamic=False,
                                 mode="reduce-overhead")
        return torch.compile(lean.step, fullgraph=True, dynamic=False)
    if variant == "torch_topk":
        keys = torch.rand(batch, device=device)
        k = num_keep(batch, KEEP_RATIO)
        return lambda rewards, prompt_ids: torch.topk(keys, k, sorted=False)
    if variant == "parity_eager":
        return PlainTorchSelector(num_prompts, device=device).step
    raise ValueError(f"variant: expected one of {variants_for(device)}, got {variant!r}")


def _replayed(selector: LZESelector, inputs: RoundInputs) -> Callable:
    """The captured step as a user runs it: copy the batch into the static inputs, replay."""
    captured = selector.capture_step(*inputs()[0])

    def replay(rewards, prompt_ids):
        captured.rewards.copy_(rewards)
        captured.prompt_ids.copy_(prompt_ids)
        return captured.replay()

    return replay


def time_step(step: Callable, inputs: RoundInputs, rounds: int,
              device: torch.device) -> tuple[float, float | None]:
    """(host-inclusive, device) median seconds of one step over ``rounds`` fresh inputs, after a
    warm-up call; device time only on a GPU."""
    step(*inputs()[0])
    host = []
    for _ in range(rounds):
        args, _ = inputs()
        _synchronize(device)
        begin = time.perf_counter()
        step(*args)
        _synchronize(device)
        host.append(time.perf_counter() - begin)
    host_s = statistics.median(host)
    if device.type != "cuda":
        return host_s, None
    cycles = int(min(MAX_SLEEP_CYCLES, 3 * host_s * SLEEP_CYCLES_PER_S + 1e5))
    return host_s, _event_median(step, rounds, inputs=inputs, sleep_cycles=cycles)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step: Callable, inputs: RoundInputs, device: torch.device) -> dict:
    """Kernel launches and host syncs of one (warm) step, from torch.profiler."""
    args, _ = inputs()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP_RANGE):
            step(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # outside the step's range: not counted as a sync
    return count_step_events(prof.events(), device.type == "cuda")


def count_step_events(events, on_cuda: bool) -> dict:
    """``{"launches", "syncs"}`` of the events inside the :data:`STEP_RANGE` range: device-side
    kernels/copies/memsets, and host-blocking runtime calls (CUDA) or host-read ops (CPU)."""
    window = [e for e in events if e.name == STEP_RANGE and e.device_type
              == torch.autograd.DeviceType.CPU]
    if len(window) != 1:
        raise RuntimeError(f"expected one {STEP_RANGE!r} range in the profile, got {len(window)}")
    start, end = window[0].time_range.start, window[0].time_range.end
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
            and start <= e.time_range.start <= end]
    names = CUDA_SYNC_CALLS if on_cuda else HOST_READ_OPS
    # With CPU activity on, the profiler mirrors the record_function range onto the device
    # timeline (a "gpu_user_annotation" of the same name): an event, not a launch.
    launches = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.name != STEP_RANGE)
    return {"launches": launches, "syncs": sum(1 for e in host if e.name in names)}


def run(device: torch.device, batches=BATCHES, group: int = GROUP, rounds: int = 30,
        variants: list[str] | None = None, log=print) -> list[dict]:
    """Every variant at every B: one row per (B, variant) with its host-inclusive ``seconds``,
    ``device_s``, launches, syncs, and (fused rows) the ratio against the strongest baseline of
    its kind, named. A variant that raises (a compiler's error, say) gets a row with its
    ``error`` instead, and is not run again."""
    variants = list(variants or variants_for(device))
    rows = []
    for batch in batches:
        case = []
        for variant in list(variants):
            inputs = RoundInputs(batch, group, device)
            skips_before = _cudagraph_skip_count()
            try:
                step = build_step(variant, inputs.num_prompts, device, batch, inputs)
                host_s, device_s = time_step(step, inputs, rounds, device)
            except Exception as error:  # noqa: BLE001 (reported in the row)
                log(f"  B={batch:>7} {variant:<22} failed: {type(error).__name__}: {error}")
                rows.append({"B": batch, "G": group, "variant": variant,
                             "error": f"{type(error).__name__}: {str(error)[:400]}"})
                variants.remove(variant)
                continue
            case.append({"B": batch, "G": group, "variant": variant, "seconds": host_s,
                         "device_s": device_s, **profile_step(step, inputs, device),
                         **_cudagraph_skips(variant, skips_before)})
            device_text = "" if device_s is None else f" device {device_s * 1e6:9.1f} us"
            log(f"  B={batch:>7} {variant:<22} {host_s * 1e6:9.1f} us{device_text} "
                f"launches={case[-1]['launches']} syncs={case[-1]['syncs']}")
        rows += with_ratios(case)
    return rows


def _cudagraph_skip_count() -> int:
    """How often inductor has fallen back from CUDA graphs in this process (mutated inputs, CPU
    tensors, ...): a lean_graph row that added one ran without graphs."""
    from torch._dynamo.utils import counters

    return sum(counters["inductor"].get(key, 0) for key in counters["inductor"]
               if key.startswith("cudagraph_skips"))


def _cudagraph_skips(variant: str, before: int) -> dict:
    return {"cudagraph_skips": _cudagraph_skip_count() - before} if variant == "lean_graph" else {}


def with_ratios(case: list[dict]) -> list[dict]:
    """Each row of one B with ``ratio_to_fused`` (its time over the fastest unchecked fused
    variant's, 1.0 for that one; over the fastest row when none ran) and, for fused rows,
    ``vs``: the strongest baseline of its kind that ran and ``speedup`` = its time / the row's,
    both host-inclusive."""
    fused = [r["seconds"] for r in case
             if r["variant"].startswith("fused_") and fused_parts(r["variant"])[1] == ""]
    best = min(fused or [r["seconds"] for r in case])
    by = {r["variant"]: r for r in case}
    out = []
    for r in case:
        row = {**r, "ratio_to_fused": r["seconds"] / best}
        if r["variant"].startswith("fused_"):
            ran = [by[b] for b in BASELINES_OF[fused_parts(r["variant"])[1]] if b in by]
            if ran:
                strongest = min(ran, key=lambda b: b["seconds"])
                row.update(vs=strongest["variant"], speedup=strongest["seconds"] / r["seconds"])
        out.append(row)
    return out


# ----------------------------------------------------------------------------- floors


def step_bytes(batch: int, group: int, keep_ratio: float = 0.4) -> int:
    """The fewest bytes one fused step moves through device memory: fp32 rewards read and
    advantages written (8 B G), int64 ids read, the prompts' 32-byte state records read and
    written, pass rate, energy and momentum written, then the top-k reading the energies and
    writing the keep mask and the kept int64 indices."""
    state_row = 32
    per_row = 8 + 2 * state_row + 3 * 4 + 4 + 1 + 8 * keep_ratio
    return int(8 * batch * group + per_row * batch)


def floors(batch: int, group: int, device: torch.device, rounds: int = 50) -> dict:
    """Median seconds of the floors at B = ``batch``: ``launch_s``, one empty kernel
    (``torch.cuda._sleep(0)``) and ``graph_launch_s``, one CUDA graph of it replayed, both
    host-inclusive; ``hbm_s``, a device-to-device copy of half the step's bytes (read plus write
    move all of them); ``records_s``, a random gather and scatter of B 32-byte records of an
    N = 4 B row table (``index_select`` then ``index_copy_``: the state's random traffic), device
    time."""
    if device.type != "cuda":
        raise ValueError(f"device: the floors are CUDA timings, expected a CUDA device, got "
                         f"{device}")
    nbytes = step_bytes(batch, group)
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    table = torch.zeros(4 * batch, 8, dtype=torch.int32, device=device)
    ids = torch.randperm(4 * batch, device=device)[:batch]

    def records():
        table.index_copy_(0, ids, table.index_select(0, ids))

    graph = torch.cuda.CUDAGraph()
    torch.cuda._sleep(0)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        torch.cuda._sleep(0)
    return {"bytes": nbytes, "launch_s": _event_median(lambda: torch.cuda._sleep(0), rounds),
            "graph_launch_s": _event_median(graph.replay, rounds),
            "hbm_s": _event_median(lambda: dst.copy_(src), rounds),
            "records_s": _event_median(records, rounds, sleep_cycles=int(2e6)),
            "records_bytes": 2 * 32 * batch}


def _event_median(fn: Callable, rounds: int, inputs: RoundInputs | None = None,
                  sleep_cycles: int = 0) -> float:
    """Median seconds of ``fn`` between two CUDA events, after a warm-up call. With
    ``sleep_cycles``, a ``torch.cuda._sleep`` is queued before the first event so that the host
    has issued all of ``fn`` before the device reaches it: device time without launch gaps.
    With ``inputs``, ``fn`` takes fresh ``inputs()`` each round, made before the timing."""
    call = (lambda args: fn(*args)) if inputs is not None else (lambda args: fn())
    call(inputs()[0] if inputs is not None else None)
    times = []
    for _ in range(rounds):
        args = inputs()[0] if inputs is not None else None
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        call(args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------- DOTS


def bf16_peak_flops(device: torch.device, size: int = 8192, rounds: int = 10) -> float:
    """FLOP/s of a bf16 ``size``-cubed matrix product on random data (the device's practical compute ceiling)."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * size**3 / _event_median(lambda: a @ b, rounds)


def dots_benchmark(device: torch.device, n: int = DOTS_N, k: int = DOTS_K, d: int = DOTS_D,
                   dtype=torch.bfloat16, rounds: int = 10) -> dict:
    """The DOTS prediction's kernel (``backend="auto"``) against the chunked torch reference on
    the same bf16 embeddings: times, speed-up, the kernel's error against the reference, its
    FLOP/s (scores 2 N K d, weighted sum 2 N K) and share of the measured bf16 peak."""
    from lze_kernels import dispatch, dots, reference

    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(n, d, device=device, generator=gen).to(dtype)
    refs = torch.randn(k, d, device=device, generator=gen).to(dtype)
    labels = torch.rand(k, device=device, generator=gen)
    scale = dots.attention_scale(d, 1.0)
    kernel = lambda: dots.predict_pass_rates(query, refs, labels)  # noqa: E731
    oracle = lambda: reference.predict_pass_rates_reference(query, refs, labels, scale)  # noqa: E731
    error = (kernel() - oracle()).abs().max().item()
    kernel_s, reference_s = _event_median(kernel, rounds), _event_median(oracle, rounds)
    flops = 2 * n * k * d + 2 * n * k
    peak = bf16_peak_flops(device)
    return {"n": n, "k": k, "d": d, "dtype": str(dtype).replace("torch.", ""),
            "backend": dispatch.resolve_op("auto", device, "predict").name,
            "kernel_ms": kernel_s * 1e3, "reference_ms": reference_s * 1e3,
            "speedup": reference_s / kernel_s, "max_abs_error": error,
            "tflops": flops / kernel_s / 1e12, "peak_tflops": peak / 1e12,
            "peak_fraction": flops / kernel_s / peak}

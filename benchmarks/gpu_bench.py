"""The GPU check's kernel benchmark: every step variant at every B in one run, as ratios, with the
kernel launches and host syncs of one step counted by ``torch.profiler``.

Variants (one call each on fresh binary rewards and ids per round, bench_common.RoundInputs; the
stateful ones keep N = 4 B prompts):

* ``fused_cuda``, ``fused_triton`` (``fused_cpu`` on a CPU): ``LZESelector.step(...,
  check_inputs=False)``, the unchecked call; ``fused_cuda_checked`` (``fused_cpu_checked``): the
  default call (on a GPU its faults raise at a later step, with no sync; on a CPU right away);
* ``torch_plain``: torch_baselines.PlainTorchSelector, the same step in plain vectorised PyTorch as
  a user writes it (about twenty ops, ``torch.topk``), and ``torch_plain_compile``: the same
  under ``torch.compile(dynamic=True, fullgraph=True)``, one compile for every B;
* ``verl_vectorised``: torch_baselines.VectorisedSelector, verl's scatter-add grouping (host syncs);
* ``torch_topk``, ``torch_sort``: the library's top-k (k = 0.4 B) and stable descending sort of
  B float keys alone, what the selection's last step costs in a library call.

The reference backend (``backend="torch"``) is the correctness oracle, not a speed anchor: it is
not timed here. Each B also gets its two floors, measured in the same run (:func:`floors`): the
launch floor (two empty kernels, the fewest a step and a selection can take) and the HBM floor (a
device-to-device copy moving the step's bytes, :func:`step_bytes`). :func:`dots_benchmark` times
the DOTS prediction at N = 1M, K = 1024, d = 384 against the chunked torch reference, and its
share of the bf16 matrix peak measured in the same run.

Time per step is the median over rounds (CUDA events on a GPU, ``perf_counter`` on a CPU), each
round on fresh inputs made outside the timed region. Launches are the device-side kernels, copies
and memsets of one step; host syncs are the CUDA runtime calls that block the host inside the step
(``cudaStreamSynchronize`` and friends: every ``.item()``, ``nonzero`` and device-to-host copy
makes one). On a CPU there are no device events: syncs are then counted as the ops that would block
the host on a device (``aten::_local_scalar_dense`` from ``.item()``, ``aten::nonzero``), which is
what the CPU tests check.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from bench_common import RoundInputs, unchecked
from torch_baselines import PlainTorchSelector, VectorisedSelector

from lze_kernels import LZESelector, available_backends, num_keep

BATCHES = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
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
BASELINES = ("torch_plain", "torch_plain_compile", "verl_vectorised", "torch_topk", "torch_sort")


def variants_for(device: torch.device, include_compile: bool = True) -> list[str]:
    """The variants that run on ``device``: its fused backends (the first also checked), then
    the baselines."""
    native = FUSED_BACKENDS[device.type]  # not the emulators or interpreters of other devices
    fused = [f"fused_{name}" for name in native if name in available_backends(device)]
    checked = [f"{fused[0]}_checked"] if fused else []
    baselines = [b for b in BASELINES if include_compile or b != "torch_plain_compile"]
    return fused + checked + baselines


def build_step(variant: str, num_prompts: int, device: torch.device, batch: int) -> Callable:
    """A callable ``(rewards, prompt_ids) -> outputs`` for ``variant`` with fresh state."""
    if variant.startswith("fused_"):
        backend = variant[len("fused_"):].removesuffix("_checked")
        step = LZESelector(num_prompts, device=device, backend=backend).step
        return step if variant.endswith("_checked") else unchecked(step)
    if variant in ("torch_plain", "torch_plain_compile"):
        step = PlainTorchSelector(num_prompts, device=device).step
        return _compiled(step) if variant == "torch_plain_compile" else step
    if variant == "verl_vectorised":
        return VectorisedSelector(num_prompts, device=device).step
    if variant in ("torch_topk", "torch_sort"):
        keys = torch.rand(batch, device=device)
        if variant == "torch_topk":
            return lambda rewards, prompt_ids: torch.topk(keys, num_keep(batch, KEEP_RATIO))
        return lambda rewards, prompt_ids: torch.sort(keys, descending=True, stable=True)
    raise ValueError(f"variant: expected one of {variants_for(device)}, got {variant!r}")


def _compiled(step: Callable) -> Callable:
    """``step`` under torch.compile with dynamic shapes: one compile serves every B (dynamo
    reuses the graph for each new selector's step, whose state tensors differ only in size)."""
    return torch.compile(step, dynamic=True, fullgraph=True)


def time_step(step: Callable, inputs: RoundInputs, rounds: int, device: torch.device) -> float:
    """Median seconds of one step over ``rounds`` fresh inputs (after one warm-up call)."""
    step(*inputs()[0])
    times = []
    for _ in range(rounds):
        args, _ = inputs()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            step(*args)
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


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
    """Every variant at every B: one row per (B, variant) with seconds, launches, syncs and the
    ratio of its time to the fastest fused variant's at that B. A variant that raises (a
    compiler's error, say) gets a row with its ``error`` instead, and is not run again."""
    variants = list(variants or variants_for(device))
    rows = []
    for batch in batches:
        case = []
        for variant in list(variants):
            inputs = RoundInputs(batch, group, device)
            try:
                step = build_step(variant, inputs.num_prompts, device, batch)
                seconds = time_step(step, inputs, rounds, device)
            except Exception as error:  # noqa: BLE001 (reported in the row)
                log(f"  B={batch:>6} {variant:<16} failed: {type(error).__name__}: {error}")
                rows.append({"B": batch, "G": group, "variant": variant,
                             "error": f"{type(error).__name__}: {str(error)[:400]}"})
                variants.remove(variant)
                continue
            case.append({"B": batch, "G": group, "variant": variant, "seconds": seconds,
                         **profile_step(step, inputs, device)})
            log(f"  B={batch:>6} {variant:<16} {seconds * 1e6:10.1f} us "
                f"launches={case[-1]['launches']} syncs={case[-1]['syncs']}")
        rows += with_ratios(case)
    return rows


def with_ratios(case: list[dict]) -> list[dict]:
    """Each row's time over the fastest sync-free fused variant's in the same case (1.0 for that
    one); over the fastest row when no fused variant ran."""
    fused = [r["seconds"] for r in case
             if r["variant"].startswith("fused_") and not r["variant"].endswith("_checked")]
    best = min(fused or [r["seconds"] for r in case])
    return [{**r, "ratio_to_fused": r["seconds"] / best} for r in case]


# ----------------------------------------------------------------------------- floors


def step_bytes(batch: int, group: int, keep_ratio: float = 0.4) -> int:
    """The fewest bytes one fused step moves through device memory: fp32 rewards read and
    advantages written (8 B G), int64 ids read, the prompts' state rows (4 fp32 + 4 int32
    fields) read and written, pass rate, energy and momentum written, then the top-k reading the
    energies and writing the keep mask and the kept int64 indices."""
    state_row = 4 * 4 + 4 * 4
    per_row = 8 + 2 * state_row + 3 * 4 + 4 + 1 + 8 * keep_ratio
    return int(8 * batch * group + per_row * batch)


def floors(batch: int, group: int, device: torch.device, rounds: int = 50) -> dict:
    """Median seconds of the launch floor (two empty kernels, ``torch.cuda._sleep(0)``, back to
    back: a step and a selection) and of the HBM floor (a device-to-device copy of half the
    step's bytes: read plus write move all of them), timed like the steps."""
    if device.type != "cuda":
        raise ValueError(f"device: the floors are CUDA timings, expected a CUDA device, got "
                         f"{device}")
    nbytes = step_bytes(batch, group)
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def launches():
        torch.cuda._sleep(0)
        torch.cuda._sleep(0)

    return {"bytes": nbytes, "launch_s": _event_median(launches, rounds),
            "hbm_s": _event_median(lambda: dst.copy_(src), rounds)}


def _event_median(fn: Callable, rounds: int) -> float:
    """Median seconds of ``fn`` between two CUDA events, after a warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
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
    from lze_kernels import dots, dispatch

    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(n, d, device=device, generator=gen).to(dtype)
    refs = torch.randn(k, d, device=device, generator=gen).to(dtype)
    labels = torch.rand(k, device=device, generator=gen)
    scale = dots.attention_scale(d, 1.0)
    kernel = lambda: dots.predict_pass_rates(query, refs, labels)  # noqa: E731
    reference = lambda: dots.predict_pass_rates_reference(query, refs, labels, scale)  # noqa: E731
    error = (kernel() - reference()).abs().max().item()
    kernel_s, reference_s = _event_median(kernel, rounds), _event_median(reference, rounds)
    flops = 2 * n * k * d + 2 * n * k
    peak = bf16_peak_flops(device)
    return {"n": n, "k": k, "d": d, "dtype": str(dtype).replace("torch.", ""),
            "backend": dispatch.resolve_op("auto", device, "predict").name,
            "kernel_ms": kernel_s * 1e3, "reference_ms": reference_s * 1e3,
            "speedup": reference_s / kernel_s, "max_abs_error": error,
            "tflops": flops / kernel_s / 1e12, "peak_tflops": peak / 1e12,
            "peak_fraction": flops / kernel_s / peak}

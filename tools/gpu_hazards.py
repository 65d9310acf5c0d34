"""The GPU check's hazard stage: each GPU-only hazard of the CUDA backend run on the device, one
JSON line an item (``{"item", "name", "ok", "detail", "seconds"}``), the first thing a GPU
runs (tools/gpu_check.py, stage "hazards"). The same items run on the CPU through the CUDA
emulator with asynchronous launches (``--backend cuda_emulated``; tests/test_gpu_hazards.py
shows each there), so the script's logic is tested without a GPU.

Items: 1 the one-block top-k's shared-memory opt-in at B = 10,140 / 10,141 / 12,288 / 12,289 /
16,384 / 16,385, each in a fresh process (a kernel attribute raised by an earlier call would hide
a missing opt-in); 2 the fault word's host copy cleared after the queued steps; 3 a capture after
a faulted step; 4 the device's plans (shared memory, SMs) and a million rows against the
reference; 6 pooled outputs read on another stream, the reuse rule's baseline; 7 a second
device, when there is one; 8 misaligned state refused; 9 +inf energies with noise; 10 pageable
host memory refused and a graph that outlives its selector; 5 last (it races two streams on one
state through the module, under the selector's checks): a step on another stream refused, and
the last-block counter after two launches at once.

    python tools/gpu_hazards.py [--backend cuda|cuda_emulated] [--items 1,2,...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

ITEMS = (1, 2, 3, 4, 6, 7, 8, 9, 10, 5)  # 5 last: it races the device
OPT_IN_BATCHES = (10140, 10141, 12288, 12289, 16384, 16385)


class Device:
    """Where the items run: a GPU (``cuda``) or the emulator on the CPU (``cuda_emulated``)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.device = torch.device("cuda" if backend == "cuda" else "cpu")

    @contextlib.contextmanager
    def in_flight(self):
        """Steps queued inside the block have not run when it is left: on a GPU behind a long
        sleep on the stream, in the emulator held until a synchronisation."""
        if self.backend == "cuda":
            torch.cuda._sleep(int(2e8))  # some 0.1 s of the stream
            yield
        else:
            from lze_kernels import emulated

            with emulated.mode("held"):
                yield

    def synchronize(self):
        if self.backend == "cuda":
            torch.cuda.synchronize()
        else:
            from lze_kernels import emulated

            emulated.synchronize()

    def new_stream_context(self):
        if self.backend == "cuda":
            return torch.cuda.stream(torch.cuda.Stream())
        from lze_kernels import emulated

        return emulated.stream(emulated.new_stream())

    def copy_on_another_stream(self, source: torch.Tensor, ordered: bool) -> torch.Tensor:
        """A copy of ``source`` queued on a new stream behind a wait (so it has not run when
        the next step is queued); ``ordered``: the current stream then waits for it."""
        target = torch.empty_like(source)
        if self.backend == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(2e8))
                target.copy_(source)
            if ordered:
                torch.cuda.current_stream().wait_stream(side)
            return target
        from lze_kernels import emulated

        module, side = emulated.module(), emulated.new_stream()
        module.memcpy_async(target.data_ptr(), source.data_ptr(), source.numel() * 4, side)
        if ordered:
            done = module.event_create()
            module.event_record(done, side)
            module.stream_wait_event(emulated.current_stream(), done)
        return target


def batch(dev: Device, rows=64, group=8, num_prompts=200, seed=0, bad=False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_prompts, generator=gen)[:rows]
    if bad:
        ids[3] = 10**6
    rewards = (torch.rand(rows, group, generator=gen) < torch.rand(rows, 1, generator=gen)).float()
    return rewards.to(dev.device), ids.to(dev.device)


def selector(dev: Device, num_prompts=200, **config):
    from lze_kernels import LZEConfig, LZESelector

    return LZESelector(num_prompts, LZEConfig(**config), device=dev.device, backend=dev.backend)


def raises(fn, match: str) -> bool:
    try:
        fn()
    except ValueError as error:
        return match in str(error)
    return False


# ----------------------------------------------------------------------------- items


def opt_in_at(dev: Device, rows: int) -> tuple[bool, str]:
    """One step at ``rows`` against the reference on the device (in its own process)."""
    from lze_kernels import LZEConfig, LZESelector

    got = selector(dev, 2 * rows, noise_scale=0.05, seed=1)
    want = LZESelector(2 * rows, LZEConfig(noise_scale=0.05, seed=1), device=dev.device,
                       backend="torch")
    rewards, ids = batch(dev, rows, 2, 2 * rows, seed=rows)
    a, b = got.step(rewards, ids, check_inputs=True), want.step(rewards, ids)
    same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("energy", "kept_indices"))
    return same, f"B = {rows}: selection {'equals' if same else 'differs from'} the reference"


def item_1(dev: Device) -> tuple[bool, str]:
    details, ok = [], True
    for rows in OPT_IN_BATCHES:
        proc = subprocess.run([sys.executable, __file__, "--backend", dev.backend, "--opt-in",
                               str(rows)], capture_output=True, text=True, timeout=300)
        line = (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-300:]])[-1]
        ok &= proc.returncode == 0
        details.append(line)
    return ok, "; ".join(details)


def item_2(dev: Device) -> tuple[bool, str]:
    sel = selector(dev)
    bad, good, later = batch(dev, seed=1, bad=True), batch(dev, seed=2), batch(dev, seed=3)
    with dev.in_flight():
        sel.step(*bad, check_inputs=False)
        sel.step(*good, check_inputs=False)  # queued: it copies the word with bad's bits
        raised = raises(sel.raise_if_faulted, "prompt_ids")
    clean = not raises(lambda: sel.step(*later), "prompt_ids")
    dev.synchronize()
    return raised and clean, f"raised {raised}, next step ran {clean}"


def item_3(dev: Device) -> tuple[bool, str]:
    sel = selector(dev)
    with dev.in_flight():  # the faulty step has not run when the capture starts
        sel.step(*batch(dev, seed=1, bad=True), check_inputs=False)
        refused = raises(lambda: sel.capture_step(*batch(dev, seed=2)), "prompt_ids")
    step = sel.capture_step(*batch(dev, seed=2))
    step.replay()
    clean = not raises(lambda: sel.step(*batch(dev, seed=4)), "prompt_ids")
    dev.synchronize()
    return refused and clean, f"capture_step raised the fault {refused}, then clean {clean}"


def item_4(dev: Device) -> tuple[bool, str]:
    from lze_kernels import native, reference

    backend = native.CUDA if dev.backend == "cuda" else native.CUDA_EMULATED
    index = backend.launch_arg(dev.device)[1]
    _, shape = backend.module.device_shape(index)
    rows = 1 << 20
    gen = torch.Generator().manual_seed(5)
    energy = (torch.randint(0, 65, (rows,), generator=gen).float() / 64).to(dev.device)
    plan = backend.plan(rows, dev.device, "energy")
    got = backend.topk(energy, rows // 3, 0.05, 7, torch.tensor([2, 0], device=dev.device))
    want = reference.topk_select(energy, rows // 3, 0.05, 7, torch.tensor(2, device=dev.device))
    same = torch.equal(got.kept_indices, want.kept_indices)
    return same, (f"{shape.sms} SMs, {shape.shared_optin} B a block with the opt-in, one block "
                  f"to {shape.one_block_max_rows} rows, {shape.passes} digits; 1M rows: "
                  f"{plan.blocks} blocks of {plan.tile_rows}, selection "
                  f"{'equals' if same else 'differs from'} the reference")


def item_6(dev: Device) -> tuple[bool, str]:
    from lze_kernels import runners

    seen = {}
    for ordered in (False, True):
        sel = selector(dev)
        first = sel.step(*batch(dev, seed=1), check_inputs=False)
        dev.synchronize()
        want = first.energy.clone()
        with dev.in_flight():
            copy = dev.copy_on_another_stream(first.energy, ordered)
            del first  # the pool may now reuse the buffer the copy reads
            sel.step(*batch(dev, seed=2), check_inputs=False)
        dev.synchronize()
        seen[ordered] = torch.equal(copy, want)
    baseline = runners.unreferenced_count()
    return seen[True], (f"a consumer on another stream read its step's values: {seen[False]} "
                        f"unordered (the documented hazard), {seen[True]} with the selector's "
                        f"stream ordered after it; reuse-rule baseline {baseline}")


def item_7(dev: Device) -> tuple[bool, str]:
    from lze_kernels import LZESelector

    if dev.backend != "cuda" or torch.cuda.device_count() < 2:
        return True, "skipped: one device"
    with torch.cuda.device(0):
        sel = LZESelector(200, device="cuda:1", backend="cuda")
        rewards, ids = batch(dev, seed=1)
        out = sel.step(rewards.to("cuda:1"), ids.to("cuda:1"), check_inputs=True)
    return out.energy.device.index == 1, "a checked step on cuda:1 with cuda:0 current ran"


def item_8(dev: Device) -> tuple[bool, str]:
    from lze_kernels import ops

    state = ops.new_state(50, dev.device)
    buffer = torch.zeros(51 * 8 + 1, dtype=torch.int32, device=dev.device)
    state.records = buffer[1:].view(51, 8)
    rewards, ids = batch(dev, 8, num_prompts=50, seed=1)
    refused = raises(lambda: ops.lze_update(rewards, ids, state, backend=dev.backend),
                     "state.records: expected data aligned to 16 bytes")
    return refused, f"refused {refused}"


def item_9(dev: Device) -> tuple[bool, str]:
    from lze_kernels import ops

    energy = torch.tensor([0.2, float("inf"), 0.0, 0.5, float("inf"), 0.1] * 20, device=dev.device)
    same = all(torch.equal(ops.topk_mask(energy, 30, 0.1, s, backend=dev.backend).kept_indices,
                           ops.topk_mask(energy, 30, 0.1, s, backend="torch").kept_indices)
               for s in range(4))
    return same, f"selections {'equal' if same else 'differ from'} the reference's"


def item_10(dev: Device) -> tuple[bool, str]:
    from lze_kernels import native

    backend = native.CUDA if dev.backend == "cuda" else native.CUDA_EMULATED
    try:
        backend.kernel_address(torch.zeros(1, dtype=torch.int32))
        refused = False
    except RuntimeError:
        refused = True
    sel = selector(dev, noise_scale=0.05)
    step = sel.capture_step(*batch(dev, seed=1))
    graph, word = step.graph, weakref.ref(sel._faults)
    del sel, step
    gc.collect()
    kept = word() is not None
    graph.replay()
    dev.synchronize()
    return refused and kept, f"pageable memory refused {refused}, graph keeps its selector {kept}"


def item_5(dev: Device) -> tuple[bool, str]:
    sel = selector(dev)
    sel.step(*batch(dev, seed=1), check_inputs=False)
    with dev.new_stream_context():
        refused = raises(lambda: sel.step(*batch(dev, seed=2), check_inputs=False), "stream:")
    dev.synchronize()
    counter = int(sel.state.step_counter[1])
    return refused and counter == 0, f"another stream refused {refused}, counter {counter}"


def run_item(dev: Device, item: int) -> dict:
    start = time.perf_counter()
    try:
        ok, detail = globals()[f"item_{item}"](dev)
    except Exception as error:  # noqa: BLE001  (reported, the next item runs)
        ok, detail = False, f"{type(error).__name__}: {error}"
    return {"item": item, "name": globals()[f"item_{item}"].__name__, "ok": bool(ok),
            "detail": detail, "seconds": round(time.perf_counter() - start, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cuda_emulated"))
    parser.add_argument("--items", default=",".join(map(str, ITEMS)))
    parser.add_argument("--opt-in", type=int, help=argparse.SUPPRESS)  # item 1's child
    args = parser.parse_args(argv)
    dev = Device(args.backend)
    if args.opt_in:
        ok, detail = opt_in_at(dev, args.opt_in)
        print(detail)
        return 0 if ok else 1
    wanted = {int(i) for i in args.items.split(",")}
    results = [run_item(dev, item) for item in ITEMS if item in wanted]
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())

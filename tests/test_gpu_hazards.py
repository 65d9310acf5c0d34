"""Hazards only a GPU's asynchrony, limits or several devices show, each shown on the CPU through
the CUDA emulator (the ``cuda_emulated`` backend: the CUDA sources under a GPU's rules,
csrc/emu/cuda_emu.h) and fixed: the fault word's host copy cleared only once the queued steps
have run, faults before a capture raised before it, a batch no launch plan fits refused before
anything is queued, one stream and one step at a time a selector, pooled outputs and other
streams, the reuse rule whatever the interpreter counts, a launch on the tensors' device,
misaligned state refused, NaN scores ordered as on a GPU, host memory the device cannot address
refused, and a captured graph that keeps its selector alive. The plans' limits per architecture
are in tests/test_plans.py."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from conftest import backend_param, binary_rewards, ragged_valid
from lze_kernels import LZEConfig, LZESelector, available_backends, emulated, native, ops, runners

pytestmark = pytest.mark.skipif("cuda_emulated" not in available_backends("cpu"),
                                reason="the emulated CUDA module is not built")
EMU = "cuda_emulated"


def batch_of(batch=64, group=8, num_prompts=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_prompts, generator=gen)[:batch]
    return binary_rewards(batch, group, gen), ids, ragged_valid(batch, group, gen)


def with_bad_id(seed):
    rewards, ids, valid = batch_of(seed=seed)
    ids[3] = 10**6
    return rewards, ids, valid


# ----------------------------------------------------------------------------- the fault word


def test_raise_if_faulted_clears_the_host_copy_after_the_queued_steps_have_run():
    """A step still queued when raise_if_faulted() runs copies the (old) fault word to the host
    copy when it runs: cleared before, the copy came back and the next clean step raised the
    same error again and did not run."""
    with emulated.mode("held"):
        sel = LZESelector(200, backend=EMU)
        bad, good, later = with_bad_id(1), batch_of(seed=2), batch_of(seed=3)
        sel.step(*bad, check_inputs=False)
        sel.step(*good, check_inputs=False)  # queued: it copies the word with bad's bits
        with pytest.raises(ValueError, match="prompt_ids"):
            sel.raise_if_faulted()
        sel.step(*later)  # the default check: nothing to raise
        emulated.synchronize()
        assert int(sel.state.step_counter[0]) == 3


def test_load_state_dict_waits_for_the_queued_steps_before_it_writes_the_host_copy():
    with emulated.mode("held"):
        sel = LZESelector(200, backend=EMU)
        sel.step(*batch_of(seed=1))
        clean = sel.state_dict()
        bad = with_bad_id(2)
        sel.step(*bad, check_inputs=False)  # queued: it will write its fault bits
        sel.load_state_dict(clean)
        later = batch_of(seed=3)
        sel.step(*later)  # the loaded state has no fault: nothing raises
        sel.raise_if_faulted()
        assert int(sel.state.step_counter[0]) == 2


def test_capture_step_raises_earlier_faults_before_capturing():
    """A capture records its work without running it: a fault word zeroed inside it stays set,
    and the faults came back at the next eager step. capture_step raises them first, cleared."""
    with emulated.mode("held"):  # the faulty step has not run when the capture starts
        sel = LZESelector(200, backend=EMU)
        bad, first = with_bad_id(1), batch_of(seed=2)
        sel.step(*bad, check_inputs=False)
        with pytest.raises(ValueError, match="prompt_ids"):
            sel.capture_step(*first)
        emulated.synchronize()
        assert int(sel.state.fault[0]) == 0
        step = sel.capture_step(*first)
        step.replay()
        later = batch_of(seed=4)
        sel.step(*later)  # no stale fault
        sel.raise_if_faulted()


# ----------------------------------------------------------------------------- plans


def test_a_batch_no_plan_fits_is_refused_before_anything_is_queued():
    """A device whose shared memory a block fits no plan (4 KiB: the one-block kernel's static
    shared memory alone is 8.4 KiB): the step is refused with the limit and the backends that
    run it, nothing launched, the state and step counter as they were (a top-k launch that
    failed after the step kernel was queued left the step applied)."""
    module = emulated.module()
    try:
        module.set_device_optin(4096)
        sel = LZESelector(20000, backend=EMU)
        before = sel.state_dict()
        module.launches()
        with pytest.raises(ValueError, match=r"rewards: a selection over B = 2000 rows has no "
                                             r"launch plan.*4096 bytes.*backend='triton'"):
            sel.step(*batch_of(batch=2000, num_prompts=20000, seed=2))
        assert module.launches() == 0
        after = sel.state_dict()
        for key in ("fstate", "istate", "step_counter"):
            assert torch.equal(after[key], before[key]), key
        with pytest.raises(ValueError, match="energy: a selection over B = 2000"):
            ops.topk_mask(torch.rand(2000), 10, backend=EMU)
    finally:
        module.set_devices([90])


# ----------------------------------------------------------------------------- streams, threads


def test_a_step_on_another_stream_is_refused_until_the_selector_moves_there():
    """Two steps at once on one state (two streams) share its last-block counter and outputs:
    a step on another stream than the selector's raises, naming the stream; use_current_stream
    moves it, ordered after the earlier steps."""
    with emulated.mode("worker"):
        sel, twin = LZESelector(200, backend=EMU), LZESelector(200, backend="cpu")
        first, second = batch_of(seed=1), batch_of(seed=2)
        sel.step(*first, check_inputs=False)
        twin.step(*first, check_inputs=False)
        with emulated.stream(emulated.new_stream()):
            with pytest.raises(ValueError, match="stream: this selector's steps run on stream"):
                sel.step(*second, check_inputs=False)
            sel.use_current_stream()
            out = sel.step(*second, check_inputs=False)
            emulated.module().stream_synchronize(emulated.current_stream())
        want = twin.step(*second, check_inputs=False)
        assert torch.equal(out.kept_indices, want.kept_indices)
        assert torch.equal(sel.state.records, twin.state.records)
        assert int(sel.state.step_counter[1]) == 0


def test_two_threads_stepping_one_selector_never_share_a_pooled_buffer():
    """The native call releases the GIL: while one thread's step is inside it, another thread's
    step picked the same pooled buffer (nothing referenced it yet)."""
    module = emulated.module()
    sel = LZESelector(200, backend=EMU)
    sel.step(*batch_of(seed=0))  # the plan and its first buffer exist
    outputs, batches = {}, {1: batch_of(seed=1), 2: batch_of(seed=2)}

    def step(name):
        outputs[name] = sel.step(*batches[name], check_inputs=False)

    module.close_launch_gate()
    try:
        first = threading.Thread(target=step, args=(1,))
        first.start()
        while module.launch_gate_waiters() == 0:
            pass
        second = threading.Thread(target=step, args=(2,))
        second.start()
        second.join(timeout=0.5)  # blocked: on the selector's lock (fixed) or the gate (not)
    finally:
        module.open_launch_gate()
    first.join()
    second.join()
    ptr = {name: out.advantages.untyped_storage().data_ptr() for name, out in outputs.items()}
    assert ptr[1] != ptr[2]


def test_pooled_outputs_read_on_another_stream_need_that_stream_ordered_before_the_next_step():
    """Tensor.record_stream cannot protect a buffer the pool never frees: a consumer on another
    stream that has not run yet reads the next step's values. Ordering the selector's stream
    after the consumer, or pool_outputs=False, keeps its read right."""
    module = emulated.module()

    def consumed(order_first: bool, pool_outputs: bool):
        with emulated.mode("held"):
            sel = LZESelector(200, backend=EMU, pool_outputs=pool_outputs)
            first = sel.step(*batch_of(seed=1), check_inputs=False)
            emulated.synchronize()
            want = first.energy.clone()
            consumer, copy = emulated.new_stream(), torch.empty_like(first.energy)
            module.memcpy_async(copy.data_ptr(), first.energy.data_ptr(), copy.numel() * 4,
                                consumer)  # queued on another stream
            if order_first:
                done = module.event_create()
                module.event_record(done, consumer)
                module.stream_wait_event(emulated.current_stream(), done)
            # The caller drops its outputs, the copy still queued. The pool keeps its buffer;
            # torch's allocation is kept by record_stream on a GPU (here: held until consumed).
            recorded = None if pool_outputs else first.energy
            del first
            second = sel.step(*batch_of(seed=2), check_inputs=False)
            module.stream_synchronize(emulated.current_stream())
            module.stream_synchronize(consumer)
            del second, recorded
            return torch.equal(copy, want)

    assert not consumed(order_first=False, pool_outputs=True)  # the hazard: overwritten first
    assert consumed(order_first=True, pool_outputs=True)
    assert consumed(order_first=False, pool_outputs=False)


def test_the_reuse_rule_follows_the_interpreters_own_reference_count(monkeypatch):
    """CPython 3.14 counts a loop variable's reference as borrowed: getrefcount is one lower
    there than on 3.11-3.13, and a rule that expects 3 took outputs the caller still held for
    free. The rule measures its baseline in the running interpreter."""
    real = sys.getrefcount
    # One lower, as 3.14 counts (and one for this lambda's own argument).
    monkeypatch.setattr(sys, "getrefcount", lambda obj: real(obj) - 2)
    runners.unreferenced_count.cache_clear()
    try:
        sel = LZESelector(200, backend=EMU)
        held = sel.step(*batch_of(seed=1))
        kept = held.energy.clone()
        for seed in range(2, 6):
            sel.step(*batch_of(seed=seed))
        assert torch.equal(held.energy, kept)
    finally:
        monkeypatch.undo()
        runners.unreferenced_count.cache_clear()


# ----------------------------------------------------------------------------- several devices


def test_a_launch_runs_on_its_tensors_device_with_that_devices_opt_in():
    """Launch on device 1 while device 0 is current: the call makes device 1 current for its
    plan (the opt-in is per device) and launches, and restores device 0 (without the guard, a
    stream of device 1 is an invalid handle on device 0)."""
    module = emulated.module()
    with emulated.architectures(90, 86):
        module.set_device(1)
        stream_of_1 = emulated.new_stream()
        module.set_device(0)
        batch = 16384  # the one-block plan: 64 KiB of scores, past 48 KiB without the opt-in
        energy = torch.rand(batch)
        status, plan = module.plan_topk(batch, 1)
        assert status == 0 and plan.one_block == 1
        mask, kept, count = (torch.empty(batch, dtype=torch.bool), torch.empty(10, dtype=torch.int64),
                             torch.empty(1, dtype=torch.int64))
        step = torch.zeros(2, dtype=torch.int64)
        status = module.topk(energy.data_ptr(), batch, 10, 0.0, 0, step.data_ptr(), mask.data_ptr(),
                             kept.data_ptr(), count.data_ptr(), 0, plan, (stream_of_1, 1))
        assert status == 0 and module.current_device() == 0
        assert torch.equal(kept.sort().values, energy.topk(10).indices.sort().values)


# ----------------------------------------------------------------------------- values, memory


@pytest.mark.parametrize("backend", [backend_param("cpu"), backend_param(EMU)])
def test_misaligned_state_records_are_refused_naming_the_argument(backend):
    """The kernels read a record as two 16-byte vectors; records 4 bytes past a boundary are a
    "misaligned address" fault that ends a GPU's CUDA context (the emulated backend died with
    SIGSEGV)."""
    state = ops.new_state(50)
    buffer = torch.zeros(51 * 8 + 1, dtype=torch.int32)
    state.records = buffer[1:].view(51, 8)
    rewards, ids, _ = batch_of(batch=8, num_prompts=50, seed=1)
    with pytest.raises(ValueError, match="state.records: expected data aligned to 16 bytes"):
        ops.lze_update(rewards, ids, state, backend=backend)
    assert int(state.step_counter[0]) == 0


@pytest.mark.parametrize("backend", [backend_param("cpu"), backend_param(EMU),
                                     backend_param("triton")])
def test_infinite_energies_with_noise_order_as_on_a_gpu(backend):
    """+inf energies with noise make NaN scores (inf + inf * a draw <= 0): the GPU's canonical NaN
    orders above every score, x86's below; every backend forms the GPU's."""
    energy = torch.tensor([0.2, float("inf"), 0.0, 0.5, float("inf"), 0.1] * 20)
    for seed in range(4):
        got = ops.topk_mask(energy, 30, noise_scale=0.1, seed=seed, backend=backend)
        want = ops.topk_mask(energy, 30, noise_scale=0.1, seed=seed, backend="torch")
        assert torch.equal(got.keep_mask, want.keep_mask), seed
        assert torch.equal(got.kept_indices, want.kept_indices), seed


def test_host_memory_the_device_cannot_address_is_refused():
    pageable = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not pinned, mapped memory"):
        native.CUDA_EMULATED.kernel_address(pageable)


def test_a_captured_graph_keeps_its_selector_alive():
    """A graph replayed after its selector and step are gone wrote into a freed pinned block:
    the graph holds them."""
    sel = LZESelector(200, LZEConfig(noise_scale=0.05), backend=EMU)
    step = sel.capture_step(*batch_of(seed=1))
    graph, word = step.graph, weakref.ref(sel._faults)
    del sel, step
    gc.collect()
    assert word() is not None
    graph.replay()
    emulated.synchronize()


def test_the_gpu_checks_hazard_script_runs_its_items_on_the_emulator():
    """tools/gpu_hazards.py (the GPU check's hazard stage) on the emulator: one JSON line an item,
    each holding (items 1, 3 and 4 run above and in tests/test_plans.py: their processes and a
    million rows cost minutes here)."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_hazards.py"
    proc = subprocess.run([sys.executable, str(script), "--backend", EMU, "--items",
                           "2,5,6,7,8,9,10"], capture_output=True, text=True, timeout=600)
    items = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [i["item"] for i in items] == [2, 6, 7, 8, 9, 10, 5], proc.stderr[-2000:]
    assert proc.returncode == 0 and all(i["ok"] for i in items), items

"""The backend suite on a real GPU (skipped without CUDA). Run on a GPU machine by
`bash tools/gpu_check.sh` (stage "kernels", from the installed package, compiled Triton).

On a CUDA machine this checks what the CPU cannot: the cuda and triton backends against the
reference on the device up to B = 1,048,576, that the unchecked and the default `step` never
synchronise (sync debug mode "error") and the checked one once, that the default check reads the
step kernel's host-mapped fault word (no copy launch) also under CUDA-graph replay, that the step
can be captured and replayed (LZESelector.capture_step, and a raw torch.cuda.graph), and its
launches: CUDA two up to 16,384 groups (the step, the one-block selection) and above the step, a
histogram launch a digit of the device's plan and the write (module.select_step_launches of the
plan: two digits where 128 KiB of counters fit a block, three elsewhere); Triton two up to 4,096
(the step, one program) and seven above;
the DOTS prediction against its reference, and GRESO's filter and the forward pruner on the device
against the same code on the CPU (Philox draws: equal on any device), without a host sync.
"""

import math

import pytest
import torch

from conftest import (U32, advantage_error_bound, assert_within, binary_rewards, gamma,
                      ragged_valid, softmax_mean_error_bound)
from lze_kernels import LZEConfig, LZESelector, available_backends, dispatch, dots
from lze_kernels.greso import GresoFilter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_BACKENDS = ["cuda", "triton"]


def backend_or_skip(name):
    if name not in available_backends("cuda"):
        pytest.skip(f"{name} backend not available on this GPU machine")
    return name


def make_inputs(batch, group, num_prompts, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_prompts, generator=gen)[:batch]
    rewards, valid = binary_rewards(batch, group, gen), ragged_valid(batch, group, gen)
    return rewards.to(device), ids.to(device), valid.to(device)


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("batch,group", [(1, 8), (300, 3), (16384, 16), (65536, 64),
                                         (1 << 20, 16)])
def test_gpu_backend_matches_reference(name, batch, group):
    config = LZEConfig(noise_scale=0.05, seed=1)
    sel = LZESelector(2 * batch, config, device="cuda", backend=backend_or_skip(name))
    ref = LZESelector(2 * batch, config, device="cuda", backend="torch")
    for step in range(3):
        inputs = make_inputs(batch, group, 2 * batch, step)
        got, want = sel.step(*inputs), ref.step(*inputs)
        for field in ("pass_rate", "energy", "momentum", "keep_mask", "kept_indices", "num_kept"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert_within(got.advantages, want.advantages,
                      2 * advantage_error_bound(inputs[0], inputs[2], config.eps), "advantages")
    assert torch.equal(sel.state.records[:-1], ref.state.records[:-1])


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
@pytest.mark.parametrize("batch", [1024, 65536])
def test_step_never_synchronises(name, batch):
    sel = LZESelector(4 * batch, device="cuda", backend=backend_or_skip(name))
    inputs = make_inputs(batch, 16, 4 * batch, 0)
    sel.step(*inputs, check_inputs=False)  # warm-up: compile, allocate
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sel.step(*inputs, check_inputs=False)
        sel.rollout_mask(inputs[1], check_inputs=False)
        sel.allocate_rollouts(inputs[1], batch * 16, check_inputs=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.kept_indices.shape == (int(0.4 * batch),)


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_checked_step_synchronises_once_and_undoes_bad_input(name):
    sel = LZESelector(4096, device="cuda", backend=backend_or_skip(name))
    rewards, ids, valid = make_inputs(1024, 16, 4096, 0)
    sel.step(rewards, ids, valid, check_inputs=True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as caught:
            sel.step(rewards, ids, valid, check_inputs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    before = {key: t.clone() for key, t in sel.state_dict().items() if torch.is_tensor(t)}
    with pytest.raises(ValueError, match="expected every id in"):
        sel.step(rewards, torch.where(ids == ids[0], 10**6, ids), valid, check_inputs=True)
    after = sel.state_dict()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_default_step_never_synchronises_and_raises_a_later_step(name):
    """The default call on a GPU: no sync; a bad id is skipped on the device and the step
    kernel's copy of the fault word in host-mapped memory makes a later step raise, before it
    runs."""
    sel = LZESelector(4096, device="cuda", backend=backend_or_skip(name))
    rewards, ids, valid = make_inputs(1024, 16, 4096, 0)
    sel.step(rewards, ids, valid)  # warm-up: compile
    bad_ids = torch.where(ids == ids[0], 10**6, ids)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel.step(rewards, bad_ids, valid)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the faulty step has finished by the next step
    with pytest.raises(ValueError, match="found by an earlier step"):
        sel.step(rewards, ids, valid)
    sel.step(rewards, ids, valid)


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_default_check_launches_nothing_more_than_off(name):
    """The default check is the step kernel's own store into host-mapped memory: the same
    launches as check_inputs=False (no copy, no event)."""
    sel = LZESelector(8192, device="cuda", backend=backend_or_skip(name))
    inputs = make_inputs(2048, 16, 8192, 0)
    counts = []
    for check in (False, None):
        sel.step(*inputs, check_inputs=check)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sel.step(*inputs, check_inputs=check)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
@pytest.mark.parametrize("batch", [1024, 65536])
def test_step_in_cuda_graph(name, batch):
    config = LZEConfig(noise_scale=0.05, seed=3)
    num_prompts = 4 * batch
    sel = LZESelector(num_prompts, config, device="cuda", backend=backend_or_skip(name))
    ref = LZESelector(num_prompts, config, device="cuda", backend="torch")
    static = [t.clone() for t in make_inputs(batch, 16, num_prompts, 0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as CUDA graphs require
        sel.step(*static, check_inputs=False)
        ref.step(*static, check_inputs=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sel.step(*static)  # the default call: its mapped fault word is captured too
    for step in range(1, 4):  # replays read new inputs and advance the on-device step counter
        for dst, src in zip(static, make_inputs(batch, 16, num_prompts, step)):
            dst.copy_(src)
        graph.replay()
        want = ref.step(*static, check_inputs=False)
        assert torch.equal(out.kept_indices, want.kept_indices)
        assert torch.equal(out.energy, want.energy)


def expected_launches(name: str, batch: int) -> int:
    """CUDA: the module's count for its plan on this device (tests/test_plans.py checks the
    plans per architecture); Triton: one program up to 4,096 groups, six launches above."""
    if name == "cuda":
        from lze_kernels import native

        module = native.CUDA.module
        status, plan = module.plan_topk(batch, torch.cuda.current_device())
        assert status == 0
        return module.select_step_launches(plan, 0)
    return 2 if batch <= 4096 else 7


@pytest.mark.parametrize("name", ["cuda", "triton"])
@pytest.mark.parametrize("batch", (1024, 4096, 4097, 16384, 16385, 65537, 1 << 20))
def test_kernel_launches_per_step(name, batch):
    launches = expected_launches(backend_or_skip(name), batch)
    if name == "cuda" and batch <= 16384:
        assert launches == 2  # the step and the one-block selection, on every architecture
    sel = LZESelector(2 * batch, device="cuda", backend=name)
    inputs = make_inputs(batch, 16, 2 * batch, 0)
    sel.step(*inputs, check_inputs=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sel.step(*inputs, check_inputs=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == launches, [e.name for e in kernels]


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
@pytest.mark.parametrize("batch", [1024, 65536])
def test_captured_step_replays_the_step_and_keeps_checking(name, batch):
    """LZESelector.capture_step: the first batch runs as a step, the step is captured, and each
    replay equals a plain step on a twin selector, with the default check on: a bad id in a
    replay raises at the next replay, before it launches."""
    config = LZEConfig(noise_scale=0.05, seed=3)
    num_prompts = 4 * batch
    sel = LZESelector(num_prompts, config, device="cuda", backend=backend_or_skip(name))
    twin = LZESelector(num_prompts, config, device="cuda", backend="torch")
    first = make_inputs(batch, 16, num_prompts, 0)
    captured = sel.capture_step(*first)
    want = twin.step(*first)
    assert captured.graph is not None
    assert torch.equal(captured.output.kept_indices, want.kept_indices)
    for step in range(1, 4):
        rewards, ids, valid = make_inputs(batch, 16, num_prompts, step)
        for static, value in ((captured.rewards, rewards), (captured.prompt_ids, ids),
                              (captured.valid, valid)):
            static.copy_(value)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = captured.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = twin.step(rewards, ids, valid)
        for field in ("energy", "keep_mask", "kept_indices", "num_kept"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    captured.prompt_ids[0] = 10**6
    captured.replay()  # skips the bad row on the device
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="found by an earlier step"):
        captured.replay()
    with pytest.raises(ValueError, match="check_inputs"):
        sel.capture_step(*first, check_inputs=True)


# ----------------------------------------------------------------------------- DOTS


def predict_backend_or_skip(name):
    backend_or_skip(name)
    if not dispatch.BACKENDS[name].has_op("predict"):
        pytest.skip(f"{name} has no predict kernel")
    return name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,d", [(1, 1, 1), (37, 7, 10), (2049, 300, 384), (65536, 1024, 384)])
@pytest.mark.parametrize("name", ["triton", "torch"])
def test_dots_prediction_matches_fp64_oracle(name, n, k, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    q = torch.randn(n, d, device="cuda", generator=gen).to(dtype)
    r = torch.randn(k, d, device="cuda", generator=gen).to(dtype)
    y = torch.rand(k, device="cuda", generator=gen)
    got = dots.predict_pass_rates(q, r, y, backend=predict_backend_or_skip(name))
    s = (q.double() @ r.double().T) / math.sqrt(d)
    want = torch.softmax(s, dim=1) @ y.double()
    assert got.dtype == torch.float32 and got.shape == (n,)
    # Tensor cores may truncate their fp32 sums (twice the roundings); Triton's fp32 dot is
    # TF32x3 (three products of 11-bit halves: each within 12u of |q_i r_i|, over 3d terms).
    split = name == "triton" and dtype == torch.float32
    product_error = gamma(6 * d) + 12 * U32 if split else gamma(d)
    assert_within(got, want, softmax_mean_error_bound(q, r, y, 1 / math.sqrt(d), product_error))


def test_dots_prediction_never_synchronises():
    q, r = torch.randn(4096, 384, device="cuda"), torch.randn(256, 384, device="cuda")
    y = torch.rand(256, device="cuda")
    dots.predict_pass_rates(q, r, y)  # warm-up: compile
    torch.cuda.set_sync_debug_mode("error")
    try:
        pred = dots.predict_pass_rates(q, r, y)
        slope, intercept = dots.calibrate_linear(pred[:256], y)
        dots.sample_near_half(dots.apply_calibration(pred, slope, intercept), 64,
                              step=torch.zeros(1, dtype=torch.int64, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------- GRESO, pruner


def test_greso_filter_on_the_device_equals_the_cpu():
    num_prompts, batch, group = 5000, 1024, 8
    filters = {dev: GresoFilter(num_prompts, device=dev) for dev in ("cpu", "cuda")}
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        ids = torch.randperm(num_prompts, generator=gen)[:batch]
        rewards = binary_rewards(batch, group, gen, p_correct=(torch.rand(batch, 1, generator=gen)
                                                               > 0.5).float())
        valid = ragged_valid(batch, group, gen)
        masks = {}
        for dev, f in filters.items():
            masks[dev] = f.rollout_mask(ids.to(dev), step)
            f.observe(ids.to(dev), rewards.to(dev), valid.to(dev))
        assert torch.equal(masks["cuda"].cpu(), masks["cpu"])
        for key in ("streak", "kind", "p"):
            assert torch.equal(getattr(filters["cuda"], key).cpu(), getattr(filters["cpu"], key))


def test_greso_filter_never_synchronises():
    f = GresoFilter(4096, device="cuda")
    ids = torch.randperm(4096, device="cuda")[:1024]
    rewards = (torch.rand(1024, 8, device="cuda") < 0.5).float()
    valid = torch.ones(1024, 8, dtype=torch.bool, device="cuda")
    f.observe(ids, rewards, valid)
    torch.cuda.set_sync_debug_mode("error")
    try:
        f.rollout_mask(ids, 1)
        f.observe(ids, rewards, valid)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
def test_pruner_on_the_device_equals_the_cpu(name):
    """Prompts solved prune_after epochs in a row are pruned by the device's step kernel; the
    epoch's replay draw and the rollout mask then equal the CPU reference's."""
    config = LZEConfig(prune_after=2, replay_ratio=0.3, seed=5)
    sels = {"cuda": LZESelector(2048, config, device="cuda", backend=backend_or_skip(name)),
            "cpu": LZESelector(2048, config, device="cpu", backend="torch")}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(2048, generator=gen)[:1024]
    for epoch in range(3):
        rewards = binary_rewards(1024, 8, gen, p_correct=(torch.arange(1024) % 3 == 0)
                                 .float()[:, None])
        for dev, sel in sels.items():
            sel.begin_epoch()
            sel.step(rewards.to(dev), ids.to(dev))
    masks = {dev: sel.rollout_mask(ids.to(dev)) for dev, sel in sels.items()}
    assert torch.equal(masks["cuda"].cpu(), masks["cpu"])
    assert int(sels["cpu"].num_pruned()) > 0
    assert torch.equal(sels["cuda"].state.istate[:-1].cpu(), sels["cpu"].state.istate[:-1])

"""The backend suite on a real GPU (skipped without CUDA). Run: `make test-gpu`.

On a CUDA machine this checks what the CPU cannot: the cuda and triton backends against the
reference on the device, that `step` never synchronises (sync debug mode "error"), that it can be
captured and replayed in a CUDA graph, and that it is exactly two kernel launches.
"""

import pytest
import torch

from conftest import binary_rewards, ragged_valid
from lze_kernels import LZEConfig, LZESelector, available_backends

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
@pytest.mark.parametrize("batch,group", [(1, 8), (300, 3), (16384, 16), (65536, 64)])
def test_gpu_backend_matches_reference(name, batch, group):
    config = LZEConfig(noise_scale=0.05, seed=1)
    sel = LZESelector(2 * batch, config, device="cuda", backend=backend_or_skip(name))
    ref = LZESelector(2 * batch, config, device="cuda", backend="torch")
    for step in range(3):
        inputs = make_inputs(batch, group, 2 * batch, step)
        got, want = sel.step(*inputs), ref.step(*inputs)
        for field in ("pass_rate", "energy", "momentum", "keep_mask", "kept_indices", "num_kept"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        torch.testing.assert_close(got.advantages, want.advantages, rtol=2e-5, atol=2e-5)
    assert torch.equal(sel.state.fstate[:-1], ref.state.fstate[:-1])
    assert torch.equal(sel.state.istate[:-1], ref.state.istate[:-1])


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
def test_step_never_synchronises(name):
    sel = LZESelector(4096, device="cuda", backend=backend_or_skip(name))
    inputs = make_inputs(1024, 16, 4096, 0)
    sel.step(*inputs, check_inputs=False)  # warm-up: compile, allocate
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sel.step(*inputs, check_inputs=False)
        sel.rollout_mask(inputs[1], check_inputs=False)
        sel.allocate_rollouts(inputs[1], 1024 * 16, check_inputs=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.kept_indices.shape == (409,)


@pytest.mark.parametrize("name", GPU_BACKENDS + ["torch"])
def test_step_in_cuda_graph(name):
    config = LZEConfig(noise_scale=0.05, seed=3)
    sel = LZESelector(4096, config, device="cuda", backend=backend_or_skip(name))
    ref = LZESelector(4096, config, device="cuda", backend="torch")
    static = [t.clone() for t in make_inputs(1024, 16, 4096, 0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as CUDA graphs require
        sel.step(*static, check_inputs=False)
        ref.step(*static, check_inputs=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sel.step(*static, check_inputs=False)
    for step in range(1, 4):  # replays read new inputs and advance the on-device step counter
        for dst, src in zip(static, make_inputs(1024, 16, 4096, step)):
            dst.copy_(src)
        graph.replay()
        want = ref.step(*static, check_inputs=False)
        assert torch.equal(out.kept_indices, want.kept_indices)
        assert torch.equal(out.energy, want.energy)


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_two_kernel_launches_per_step(name):
    sel = LZESelector(4096, device="cuda", backend=backend_or_skip(name))
    inputs = make_inputs(1024, 16, 4096, 0)
    sel.step(*inputs, check_inputs=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sel.step(*inputs, check_inputs=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [e.name for e in kernels]

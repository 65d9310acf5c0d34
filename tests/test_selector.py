"""The user-facing LZESelector: API, backends, checkpoints, bad input."""

import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import advantage_error_bound, assert_within, binary_rewards, ragged_valid
from lze_kernels import LZEConfig, LZESelector, available_backends, dispatch, native, ops, runtime
from lze_kernels import emulated
from lze_kernels import layout as L
from lze_kernels import selector as selector_module
from lze_kernels.faults import FaultWord

CPU_BACKENDS = [b for b in ("torch", "cpu", "cuda_emulated", "triton")
                if b in available_backends("cpu")]
NATIVE_BACKENDS = [b for b in ("cpu", "cuda_emulated") if b in available_backends("cpu")]
DATA = Path(__file__).parent / "data"


def make_batch(batch=64, group=8, num_prompts=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_prompts, generator=gen)[:batch]
    return binary_rewards(batch, group, gen), ids, ragged_valid(batch, group, gen)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_outputs_shapes_and_backend_name(backend):
    sel = LZESelector(200, LZEConfig(keep_ratio=0.4, noise_scale=0.05, seed=0), backend=backend)
    rewards, ids, valid = make_batch()
    out = sel.step(rewards, ids, valid)
    assert sel.backend == backend
    assert out.advantages.shape == (64, 8) and out.advantages.dtype == torch.float32
    for t in (out.pass_rate, out.energy, out.momentum):
        assert t.shape == (64,)
    assert out.keep_mask.shape == (64,) and out.keep_mask.dtype == torch.bool
    assert out.kept_indices.shape == (25,) and out.kept_indices.dtype == torch.int64
    assert out.num_kept.shape == () and int(out.num_kept) == int(out.keep_mask.sum())


def test_auto_picks_cpu_kernels_for_cpu_tensors_and_env_overrides(monkeypatch):
    expected = "cpu" if "cpu" in available_backends("cpu") else "torch"
    assert LZESelector(10).backend == expected
    monkeypatch.setenv("LZE_BACKEND", "torch")
    assert LZESelector(10).backend == "torch"
    monkeypatch.setenv("LZE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LZE_BACKEND"):
        LZESelector(10)


@pytest.fixture
def without_cpu_module(monkeypatch):
    """A source tree without the built _lze_cpu: importing it fails, nothing warned yet."""
    monkeypatch.setitem(sys.modules, "lze_kernels._lze_cpu", None)  # import raises ImportError
    monkeypatch.setattr(native.CPU, "_module", None)
    monkeypatch.setattr(native.CPU, "_import_error", None)
    monkeypatch.setattr(dispatch, "_warned_fallbacks", set())
    monkeypatch.delenv("LZE_BACKEND", raising=False)
    monkeypatch.delenv("LZE_EXTENSION_DIR", raising=False)


def test_auto_warns_once_when_it_falls_back_to_the_reference(without_cpu_module):
    with pytest.warns(RuntimeWarning, match=r"lze_kernels\._lze_cpu is missing.*"
                                            r"`pip install -e \.` \(or `make build`\)") as record:
        sel = LZESelector(10)
    assert sel.backend == "torch"
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: neither a second selector nor the ops warn again
        LZESelector(10)
        ops.topk_mask(torch.ones(4), k=2)


def test_explicit_cpu_backend_without_its_module_is_an_error(without_cpu_module):
    with pytest.raises(ValueError, match=r"backend: 'cpu' is not available.*lze_kernels\._lze_cpu"):
        LZESelector(10, backend="cpu")


@pytest.mark.skipif("cpu" not in available_backends("cpu"), reason="_lze_cpu not built")
def test_auto_with_the_compiled_module_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LZESelector(10).backend == "cpu"


def test_unavailable_or_wrong_device_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend"):
        LZESelector(10, backend="cuda")
    with pytest.raises(ValueError, match="backend: expected one of"):
        LZESelector(10, backend="tpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_state_dict_resume_reproduces_selection_exactly(backend):
    config = LZEConfig(noise_scale=0.05, seed=123)
    batches = [make_batch(seed=s) for s in range(6)]
    straight = LZESelector(200, config, backend=backend)
    for b in batches[:3]:
        straight.step(*b)
    checkpoint = straight.state_dict()
    straight.begin_epoch()
    expected = [straight.step(*b) for b in batches[3:]]

    resumed = LZESelector(200, config, backend=backend)
    resumed.load_state_dict(checkpoint)
    resumed.begin_epoch()
    for out, b in zip(expected, batches[3:]):
        again = resumed.step(*b)
        assert torch.equal(again.kept_indices, out.kept_indices)
        assert torch.equal(again.energy, out.energy)
    assert torch.equal(resumed.state.fstate, straight.state.fstate)
    assert torch.equal(resumed.state.istate[:200], straight.state.istate[:200])


def test_state_dict_survives_torch_save(tmp_path):
    sel = LZESelector(50, backend="torch")
    sel.step(*make_batch(batch=20, num_prompts=50))
    torch.save(sel.state_dict(), tmp_path / "sel.pt")
    other = LZESelector(50, backend="torch")
    other.load_state_dict(torch.load(tmp_path / "sel.pt"))
    assert torch.equal(other.state.fstate[:50], sel.state.fstate[:50])


def test_load_state_dict_rejects_mismatch_and_keeps_state():
    sel = LZESelector(50, backend="torch")
    sel.step(*make_batch(batch=20, num_prompts=50))
    before = sel.state_dict()
    bad = dict(before, fstate=torch.zeros(49, 4))
    with pytest.raises(ValueError, match="fstate"):
        sel.load_state_dict(bad)
    with pytest.raises(ValueError, match="num_prompts"):
        sel.load_state_dict(LZESelector(51).state_dict())
    with pytest.raises(ValueError, match="config"):
        sel.load_state_dict(LZESelector(50, LZEConfig(alpha=0.5)).state_dict())
    assert torch.equal(sel.state_dict()["fstate"], before["fstate"])


def test_noise_is_reproducible_per_seed_and_varies_per_step():
    rewards, ids, _ = make_batch(batch=128)
    picks = []
    for seed in (0, 0, 1):
        sel = LZESelector(200, LZEConfig(noise_scale=0.5, seed=seed), backend="torch")
        picks.append(sel.step(rewards, ids).kept_indices)
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r, i, v: (r[0], i, v), "rewards: expected a 2-D"),
        (lambda r, i, v: (r.double(), i, v), "rewards: expected dtype"),
        (lambda r, i, v: (r, i.int(), v), "prompt_ids: expected dtype"),
        (lambda r, i, v: (r, i[:-1], v), "prompt_ids: expected shape"),
        (lambda r, i, v: (r, i, v.float()), "valid: expected dtype"),
        (lambda r, i, v: (r, i, v[:, :-1]), "valid: expected shape"),
        (lambda r, i, v: (r[:0], i[:0], v[:0]), "B >= 1"),
        (lambda r, i, v: (r, i + 1000, v), r"prompt_ids: expected every id in \[0, 200\)"),
        # Rows without valid rollouts are inert and may repeat an id: duplicates of full rows.
        (lambda r, i, v: (r, torch.cat([i[:1], i[:-1]]), None), "distinct"),
        (lambda r, i, v: (r.index_fill(0, torch.tensor([3]), float("nan")), i, None), "finite"),
        (lambda r, i, v: (r * 2 + 0.1, i, None), r"values in \[0, 1\]"),
    ],
)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_input_raises_and_state_is_unchanged(backend, mutate, message):
    sel = LZESelector(200, backend=backend)
    sel.step(*make_batch(seed=1))
    before = sel.state_dict()
    with pytest.raises(ValueError, match=message):
        sel.step(*mutate(*make_batch(seed=2)))
    after = sel.state_dict()
    for key in ("fstate", "istate", "step_counter", "fault"):
        assert torch.equal(after[key], before[key]), key


def test_invalid_padding_may_hold_garbage():
    sel = LZESelector(200, backend="torch")
    rewards, ids, valid = make_batch()
    rewards = torch.where(valid, rewards, float("nan"))
    out = sel.step(rewards, ids, valid)
    assert torch.isfinite(out.advantages).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unchecked_faults_are_raised_later(backend):
    sel = LZESelector(200, backend=backend)
    rewards, ids, _ = make_batch()
    ids[0] = 999
    sel.step(rewards, ids, check_inputs=False)  # no sync, no error yet
    with pytest.raises(ValueError, match=r"prompt_ids: expected every id in \[0, 200\)"):
        sel.step(*make_batch(seed=3))  # the next checked call raises
    sel.raise_if_faulted()  # cleared once raised
    sel.step(*make_batch(seed=3))


@pytest.mark.parametrize(
    "field, value",
    [("keep_ratio", 0.0), ("keep_ratio", 1.5), ("noise_scale", -1.0), ("seed", -1),
     ("beta", 1.0), ("prune_after", 0), ("replay_ratio", 2.0), ("eps", 0.0)],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LZEConfig(**{field: value})


def test_keep_count_depends_on_batch_only():
    config = LZEConfig(keep_ratio=0.4)
    assert [config.num_keep(b) for b in (1, 2, 3, 10, 16384)] == [1, 1, 1, 4, 6553]


def test_forward_pruner_flow():
    sel = LZESelector(4, LZEConfig(prune_after=2, replay_ratio=1.0), backend="torch")
    solved = torch.ones(2, 4)
    ids = torch.tensor([0, 1])
    for step in range(2):
        assert int(sel.num_pruned()) == 0
        sel.step(solved, ids)
    assert int(sel.num_pruned()) == 2
    assert sel.rollout_mask(torch.arange(4)).tolist() == [False, False, True, True]
    picked, eligible = sel.take_eligible(torch.arange(4), 3)
    assert picked.tolist() == [2, 3, 0] and eligible.tolist() == [True, True, False]
    sel.begin_epoch()  # replay_ratio = 1: every pruned prompt is replayed
    assert sel.rollout_mask(torch.arange(4)).all()
    with pytest.raises(ValueError, match="batch_size"):
        sel.take_eligible(torch.arange(4), 5)


def test_allocate_rollouts_api():
    sel = LZESelector(100, backend="torch")
    rewards, ids, _ = make_batch(batch=32, num_prompts=100)
    sel.step(rewards, ids)
    counts = sel.allocate_rollouts(ids, total=256, tau=0.2, n_min=2, n_max=32)
    assert counts.dtype == torch.int64 and counts.sum().item() == 256
    assert counts.min().item() >= 2 and counts.max().item() <= 32
    pr = sel.allocate_rollouts(ids, total=256, score="pass_rate")
    assert pr.sum().item() == 256
    with pytest.raises(ValueError, match="total"):
        sel.allocate_rollouts(ids, total=10)
    with pytest.raises(ValueError, match="score"):
        sel.allocate_rollouts(ids, total=256, score="nope")


def test_ops_building_blocks():
    rewards, ids, valid = make_batch()
    state = ops.new_state(200)
    stats = ops.lze_update(rewards, ids, state, valid)
    assert_within(stats.advantages, ops.grpo_advantages(rewards, valid),
                  2 * advantage_error_bound(rewards, valid, LZEConfig().eps))
    sel = ops.topk_mask(stats.energy, k=ops.num_keep(64, 0.4), step=state.step_counter)
    assert sel.kept_indices.shape == (25,)
    assert ops.dapo_keep_mask(rewards, valid).shape == (64,)
    assert ops.allocate_rollouts_by_score(stats.energy, 64 * 8).sum().item() == 512
    with pytest.raises(ValueError, match="k: expected"):
        ops.topk_mask(stats.energy, k=0)
    assert int(state.step_counter[0]) == 1 and int(state.fault[0]) == 0
    assert (state.istate[ids, L.SEEN] == (valid.sum(1) > 0).int()).all()


def test_device_is_named_as_tensors_name_it():
    # accelerate gives CPU processes "cpu:0"; tensors made there report "cpu".
    sel = LZESelector(8, device=torch.device("cpu:0"), backend="torch")
    assert sel.device == torch.zeros(1, device="cpu:0").device
    sel.step(torch.ones(1, 4), torch.tensor([3]))


@pytest.mark.skipif("cuda_emulated" not in available_backends("cpu"), reason="no emulator")
@pytest.mark.parametrize("mode", ["worker", "held"])
def test_default_check_on_a_gpu_raises_at_a_later_step(mode):
    """The default on a GPU, on the emulator with asynchronous launches: a step with a bad id
    runs without a sync, skips the bad row and applies the others; the next step raises before
    it runs, naming the argument, and the one after proceeds."""
    with emulated.mode(mode):
        sel = LZESelector(200, backend="cuda_emulated")
        rewards, ids, valid = make_batch(seed=4)
        ids[0] = 999
        sel.step(rewards, ids, valid)  # no error yet
        reference_sel = LZESelector(200, backend="cpu")
        reference_sel.step(rewards[1:], ids[1:], valid[1:], check_inputs=False)
        after_faulty = sel.state_dict()  # waits for the queued step
        assert torch.equal(after_faulty["fstate"], reference_sel.state_dict()["fstate"])
        later = make_batch(seed=5)
        with pytest.raises(ValueError, match=r"expected every id in \[0, 200\) \(found by an "
                                             r"earlier step"):
            sel.step(*later)
        for key in ("fstate", "istate", "step_counter"):  # the raising step did not run
            assert torch.equal(sel.state_dict()[key], after_faulty[key]), key
        sel.step(*later)
        sel.raise_if_faulted()


def test_fault_word_is_host_memory_the_kernels_write():
    faults = FaultWord(runtime.HOST)
    assert faults.bits() == 0
    faults.tensor.fill_(5)  # what a step kernel's last block writes
    assert faults.bits() == 5
    faults.clear()
    assert faults.bits() == 0 and int(faults.tensor[0]) == 0


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_check_inputs_is_true_false_or_none(value):
    sel = LZESelector(200, backend="torch")
    with pytest.raises(ValueError, match="check_inputs: expected True, False or None"):
        sel.step(*make_batch(), check_inputs=value)


# ----------------------------------------------------------------------------- checkpoints


def two_table_history(selector):
    """The steps tests/data/selector_state_two_tables.pt was written after, by LZESelector(20,
    LZEConfig(noise_scale=0.05, seed=7), backend="torch") of commit 7188962, whose state was two
    tables (fstate, istate [N + 1, 4])."""
    gen = torch.Generator().manual_seed(52)
    for _ in range(3):
        ids = torch.randperm(20, generator=gen)[:8]
        rewards = (torch.rand(8, 4, generator=gen) < torch.rand(8, 1, generator=gen)).float()
        selector.step(rewards, ids)
    selector.begin_epoch()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_checkpoint_of_the_two_table_layout_loads_and_matches(backend):
    """The one-record layout keeps the checkpoint format: a file written when the state was two
    tables loads, and the same steps on the new layout give the same state, bit for bit."""
    config = LZEConfig(noise_scale=0.05, seed=7)
    saved = torch.load(DATA / "selector_state_two_tables.pt", weights_only=True)
    loaded = LZESelector(20, config, backend=backend)
    loaded.load_state_dict(saved)
    replayed = LZESelector(20, config, backend=backend)
    two_table_history(replayed)
    again = replayed.state_dict()
    for key in ("fstate", "istate", "step_counter", "fault"):
        assert torch.equal(again[key], saved[key]), key
    assert again["epoch"] == saved["epoch"] and again["format"] == saved["format"]
    assert torch.equal(loaded.state.records, replayed.state.records)


# ----------------------------------------------------------------------------- native calls


class CountingModule:
    """A compiled module whose calls are counted, including the runs of its SelectStep calls."""

    def __init__(self, module):
        self._module, self.calls = module, []

    def __getattr__(self, name):
        attribute = getattr(self._module, name)
        if not callable(attribute):
            return attribute

        def counted(*args):
            self.calls.append(name)
            result = attribute(*args)
            return CountingCall(result, self.calls) if name == "select_step" else result
        return counted


class CountingCall:
    def __init__(self, call, calls):
        self._call, self._calls = call, calls

    def run(self, *args):
        self._calls.append("run")
        return self._call.run(*args)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_a_step_is_one_native_call(backend, monkeypatch):
    """After its first step over a (B, G), each step crosses into the compiled module once:
    the module checks the sizes and runs the step and the top-k (csrc/*/select_*)."""
    native_backend = {"cpu": native.CPU, "cuda_emulated": native.CUDA_EMULATED}[backend]
    module = CountingModule(native_backend.module)
    monkeypatch.setattr(native_backend, "_module", module)
    sel = LZESelector(200, backend=backend)
    for seed in range(4):
        rewards, ids, valid = make_batch(seed=seed)
        module.calls.clear()
        sel.step(rewards, ids, valid)  # the default check: on a CPU it reads the mirror
        if seed > 0:
            assert module.calls == ["run"], module.calls
    module.calls.clear()
    sel.step(*make_batch(batch=32, seed=9), check_inputs=False)  # a new (B, G): a new plan
    assert module.calls.count("run") == 1


@pytest.mark.skipif("cuda_emulated" not in available_backends("cpu"), reason="no emulator")
@pytest.mark.parametrize("arch", (80, 86, 89, 90))
@pytest.mark.parametrize("batch", [300, 16384, 16385])
def test_a_cuda_step_is_two_launches_to_16384_rows_and_a_launch_a_digit_and_the_write_above(
        arch, batch):
    """The emulated CUDA module counts its kernel launches: the step kernel, then the one-block
    top-k up to 16,384 rows, or above a histogram launch a digit (two 16-bit digits where
    128 KiB of counters fit a block, sm_80 and sm_90; three of 11, 11 and 10 bits on sm_86 and
    sm_89) and the write; a checked step adds its undo copy."""
    module = native.CUDA_EMULATED.module
    launches = 2 if batch <= 16384 else (4 if arch in (80, 90) else 5)
    with emulated.architectures(arch):
        sel = LZESelector(2 * batch, backend="cuda_emulated")
        gen = torch.Generator().manual_seed(batch)
        rewards = binary_rewards(batch, 1, gen)
        ids = torch.randperm(2 * batch, generator=gen)[:batch]
        module.launches()  # reset
        sel.step(rewards, ids, check_inputs=False)
        plan = module.plan_topk(batch, 0)[1]
        assert module.launches() == launches == module.select_step_launches(plan, 0)
        sel.step(rewards, (ids + 1) % (2 * batch), check_inputs=True)
        assert module.launches() == launches + 1 == module.select_step_launches(plan, 1)


@pytest.mark.skipif("cuda_emulated" not in available_backends("cpu"), reason="no emulator")
@pytest.mark.parametrize("group", [8, 40])
def test_a_row_touches_one_random_state_sector(group):
    """Each row's state is one 32-byte record: its gather (two 16-byte loads), claim and scatter
    (two 16-byte stores) touch one sector, counted by the emulator (LZE_NOTE_STATE_ACCESS); the
    two-table layout touched two a row."""
    batch = 300
    sel = LZESelector(4 * batch, backend="cuda_emulated")
    gen = torch.Generator().manual_seed(group)
    ids = torch.randperm(4 * batch, generator=gen)[:batch]
    native.CUDA_EMULATED.module.state_sectors()  # reset
    sel.step(binary_rewards(batch, group, gen), ids, check_inputs=False)
    accesses, sectors = native.CUDA_EMULATED.module.state_sectors()
    assert sectors == batch and accesses == 5 * batch
    assert sel.state.records.data_ptr() % 32 == 0 and sel.state.records.stride() == (8, 1)


# ----------------------------------------------------------------------------- output reuse


def storage_of(out):
    return out.advantages.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_outputs_are_reused_only_once_nothing_references_them(backend):
    sel = LZESelector(200, backend=backend)
    batches = [make_batch(seed=s) for s in range(8)]
    first = sel.step(*batches[0])
    kept = {f: getattr(first, f).clone() for f in ("advantages", "energy", "kept_indices")}
    second = sel.step(*batches[1])
    assert storage_of(second) != storage_of(first)  # `first` is still held
    for f, value in kept.items():
        assert torch.equal(getattr(first, f), value), f
    buffer = storage_of(first)
    del first
    third = sel.step(*batches[2])
    assert storage_of(third) == buffer  # released: its buffer comes back

    del second
    held = {"view": lambda out: out.advantages[:, 0], "alias": lambda out: out.energy.data,
            "tensor": lambda out: out.num_kept}
    for name, hold in held.items():
        reference = hold(third)
        values = reference.clone()
        buffer = storage_of(third)
        del third
        third = sel.step(*batches[4])
        assert storage_of(third) != buffer, name  # something still points into the buffer
        assert torch.equal(reference, values), name
        del reference
        gc.collect()


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_a_tensor_saved_for_backward_keeps_its_buffer(backend):
    sel = LZESelector(200, backend=backend)
    weight = torch.ones(8, requires_grad=True)
    out = sel.step(*make_batch(seed=0))
    loss = (out.advantages * weight).sum()  # autograd saves the advantages
    want = out.advantages.sum(dim=0)
    del out
    for seed in range(1, 4):
        sel.step(*make_batch(seed=seed))
    loss.backward()
    assert torch.equal(weight.grad, want)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_a_step_loop_alternates_between_two_buffers(backend):
    sel = LZESelector(200, backend=backend)
    buffers = set()
    out = None
    for seed in range(10):
        out = sel.step(*make_batch(seed=seed))
        buffers.add(storage_of(out))
    assert len(buffers) == 2


# ----------------------------------------------------------------------------- captured steps


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_captured_step_replays_equal_plain_steps(backend):
    """capture_step's static inputs, replay() and static output, as on a GPU: each replay
    equals a plain step on a twin selector, into the same output tensors. The emulated CUDA
    backend captures an emulator graph; the others run the plain step."""
    config = LZEConfig(noise_scale=0.05, seed=3)
    sel, twin = (LZESelector(200, config, backend=backend) for _ in range(2))
    first = make_batch(seed=0)
    captured = sel.capture_step(*first)
    assert (captured.graph is None) == (backend != "cuda_emulated")
    want = twin.step(*first)
    assert torch.equal(captured.output.kept_indices, want.kept_indices)
    output, energy = captured.output, captured.output.energy
    for seed in range(1, 4):
        rewards, ids, valid = make_batch(seed=seed)
        captured.rewards.copy_(rewards)
        captured.prompt_ids.copy_(ids)
        captured.valid.copy_(valid)
        got = captured.replay()
        want = twin.step(rewards, ids, valid)
        assert got is output and got.energy is energy
        for field in ("energy", "keep_mask", "kept_indices", "num_kept", "advantages"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(sel.state.records, twin.state.records)
    captured.prompt_ids[0] = 10**6  # a bad id
    before = sel.state.records.clone()
    if captured.graph is None:  # the default check on a CPU: raised and undone at once
        with pytest.raises(ValueError, match="prompt_ids"):
            captured.replay()
        assert torch.equal(sel.state.records, before)
    else:  # in a graph: found by the next replay, which does not run
        captured.replay()
        after = sel.state.records.clone()
        with pytest.raises(ValueError, match=r"prompt_ids.*found by an earlier step"):
            captured.replay()
        assert torch.equal(sel.state.records, after)


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_steps_over_many_batch_sizes_keep_the_last_plans(backend):
    """Each (B, G) gets its plan (outputs, undo buffer, workspace); past runners.MAX_PLANS the
    oldest goes, and steps keep matching the reference."""
    from lze_kernels import runners

    sel, twin = LZESelector(200, backend=backend), LZESelector(200, backend="torch")
    for batch in range(20, 20 + runners.MAX_PLANS + 3):
        rewards, ids, valid = make_batch(batch=batch, seed=batch)
        got, want = sel.step(rewards, ids, valid), twin.step(rewards, ids, valid)
        assert torch.equal(got.kept_indices, want.kept_indices)
    assert len(sel._runner._plans) == runners.MAX_PLANS
    assert torch.equal(sel.state.records[:200], twin.state.records[:200])

"""The user-facing LZESelector: API, backends, checkpoints, bad input."""

import sys
import warnings

import pytest
import torch

from conftest import advantage_error_bound, assert_within, binary_rewards, ragged_valid
from lze_kernels import LZEConfig, LZESelector, available_backends, dispatch, native, ops
from lze_kernels import layout as L
from lze_kernels import selector as selector_module
from lze_kernels.faults import DeferredFaults

CPU_BACKENDS = [b for b in ("torch", "cpu", "cuda_emulated", "triton")
                if b in available_backends("cpu")]


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


def test_default_check_on_a_gpu_raises_at_a_later_step(monkeypatch):
    """The default on a GPU, run here with the CPU's immediate copy: a step with a bad id runs
    without a sync, skips the bad row and applies the others; the next step raises before it
    runs, naming the argument, and the one after proceeds."""
    monkeypatch.setattr(selector_module, "_check_time",
                        lambda check_inputs, device: "later" if check_inputs is None else "now")
    sel = LZESelector(200, backend="cpu")
    rewards, ids, valid = make_batch(seed=4)
    ids[0] = 999
    sel.step(rewards, ids, valid)  # no error yet
    reference_sel = LZESelector(200, backend="cpu")
    reference_sel.step(rewards[1:], ids[1:], valid[1:], check_inputs=False)
    after_faulty = sel.state_dict()
    assert torch.equal(after_faulty["fstate"], reference_sel.state_dict()["fstate"])
    with pytest.raises(ValueError, match=r"expected every id in \[0, 200\) \(found by an "
                                         r"earlier step"):
        sel.step(*make_batch(seed=5))
    for key in ("fstate", "istate", "step_counter"):  # the raising step did not run
        assert torch.equal(sel.state_dict()[key], after_faulty[key]), key
    sel.step(*make_batch(seed=5))
    sel.raise_if_faulted()


def test_deferred_fault_copy_is_read_once_it_arrived():
    faults = DeferredFaults(torch.device("cpu"))
    assert faults.arrived_bits() == 0
    faults.copy_after_step(torch.tensor([5], dtype=torch.int32))
    assert faults.arrived_bits() == 5
    faults.clear()
    assert faults.arrived_bits() == 0


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_check_inputs_is_true_false_or_none(value):
    sel = LZESelector(200, backend="torch")
    with pytest.raises(ValueError, match="check_inputs: expected True, False or None"):
        sel.step(*make_batch(), check_inputs=value)

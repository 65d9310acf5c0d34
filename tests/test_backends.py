"""Every kernel backend against the PyTorch reference.

Binary rewards make every sum exact, so pass rates, energies, momenta and the whole state table
must agree bit for bit (the kernels evaluate csrc/lze_math.h in the reference's order, with FMA
contraction off); advantages involve a square root and a division of sums whose order differs per
backend, so they agree within twice their fp32 error bound (conftest.advantage_error_bound), and
so do the other statistics of continuous or low-precision rewards. Selections must be identical.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (KERNEL_BACKENDS, MAX_BATCH, advantage_error_bound, assert_within,
                      backend_param, binary_rewards, gamma, pass_rate_error_bound, ragged_valid)
from lze_kernels import dispatch, reference
from lze_kernels import layout as L
from lze_kernels.config import LZEConfig, num_keep
from lze_kernels.layout import KernelParams, SelectorState

BACKENDS = [backend_param(name) for name in KERNEL_BACKENDS]
BATCHES = (1, 7, 300, 4097)
GROUPS = (1, 2, 3, 8, 16, 64)
# Plus shapes that hit every CUDA lane mapping: segments of W = 1..32 lanes (several rows per
# warp), one warp per row (G > 32), and grids of one and of many blocks; and the selection's
# plans past their limits (Triton: one program to 4,096 rows; CUDA: one block to 16,384;
# tests/test_topk_linear.py runs the top-k alone to 1,048,576 rows).
KERNEL_EDGE_SHAPES = [(5, 3), (37, 8), (129, 5), (64, 32), (40, 33), (9, 100), (16385, 1),
                      (16385, 16)]
SHAPES = [(b, g) for b in BATCHES for g in GROUPS] + KERNEL_EDGE_SHAPES


def clone_state(state):
    return SelectorState(*(t.clone() for t in (state.records, state.step_counter, state.fault)))


def assert_states_equal(got, want):
    n = want.num_prompts  # row N is the reference's write sink
    assert torch.equal(got.fstate[:n], want.fstate[:n])
    assert torch.equal(got.istate[:n], want.istate[:n])
    assert torch.equal(got.step_counter, want.step_counter)
    assert torch.equal(got.fault, want.fault)


def assert_stats_equal(got, want, rewards, valid, params, exact=True):
    """Advantages within twice their fp32 error bound (each side is within it); pass rates,
    energies and momenta bit-equal (``exact``: binary rewards) or within :func:`stat_bounds`."""
    assert_within(got.advantages, want.advantages,
                  2 * advantage_error_bound(rewards, valid, params.eps, params.norm_by_std),
                  "advantages")
    bounds = stat_bounds(rewards, valid, params)
    for name in ("pass_rate", "energy", "momentum"):
        if exact:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        else:
            assert_within(getattr(got, name), getattr(want, name), bounds[name], name)


def stat_bounds(rewards, valid, params):
    """[B] bounds on |backend - reference| of a step's pass rate, energy and momentum when the
    rewards' sums round (continuous or low-precision rewards). The two sum a row in different
    orders, so their pass rates differ by up to twice pass_rate_error_bound (dp); the rest is
    the same formulas in the same order (csrc/lze_math.h) of that pass rate, so it differs by
    its Lipschitz constant in p times dp plus each side's roundings (gamma_8 of a value of at
    most 1 + alpha). E = D 4p(1-p) (1 + alpha m) with D = max(1 - p, d_min) <= 1 on first sight
    and m = min(2 |p - ema|, 1): |dE/dp| <= (1 + alpha) + 4 (1 + alpha) + 2 alpha; |dm/dp| <= 2."""
    dp = 2 * pass_rate_error_bound(rewards, valid)
    size = 1 + params.alpha
    return {"pass_rate": dp,
            "energy": (5 * size + 2 * params.alpha) * dp + 2 * gamma(8) * size,
            "momentum": 2 * dp + 2 * gamma(3)}


def assert_selection_equal(got, want):
    assert torch.equal(got.keep_mask, want.keep_mask)
    assert torch.equal(got.kept_indices, want.kept_indices)
    assert got.num_kept.shape == () and int(got.num_kept) == int(want.num_kept)


def run_both(backend_name, rewards, valid, ids, state, params, k, noise_scale=0.0, seed=0):
    """One step + top-k on the backend and on the reference, from copies of the same state."""
    backend = dispatch.BACKENDS[backend_name]
    ref_state = clone_state(state)
    got = backend.step(rewards, valid, ids, state, params)
    want = reference.lze_step(rewards, valid, ids, ref_state, params)
    got_sel = backend.topk(got.energy, k, noise_scale, seed, state.step_counter)
    want_sel = reference.topk_select(want.energy, k, noise_scale, seed,
                                     ref_state.step_counter[0])
    return (got, got_sel, state), (want, want_sel, ref_state)


def skip_if_too_big(backend_name, batch):
    if batch > MAX_BATCH[backend_name]:
        pytest.skip(f"{backend_name} runs kernels in an interpreter/emulator here; B <= "
                    f"{MAX_BATCH[backend_name]}")


@pytest.mark.parametrize("batch,group", SHAPES)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_step_matches_reference(backend_name, batch, group, params):
    skip_if_too_big(backend_name, batch)
    gen = torch.Generator().manual_seed(batch * 131 + group)
    rewards = binary_rewards(batch, group, gen)
    valid = ragged_valid(batch, group, gen) if batch % 2 else None
    ids = torch.randperm(4 * batch, generator=gen)[:batch]
    state = SelectorState.empty(4 * batch, "cpu")
    k = num_keep(batch, 0.4)
    (got, got_sel, state), (want, want_sel, ref_state) = run_both(
        backend_name, rewards, valid, ids, state, params, k
    )
    assert_stats_equal(got, want, rewards, valid, params)
    assert_selection_equal(got_sel, want_sel)
    assert_states_equal(state, ref_state)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("noise_scale", [0.0, 0.05])
def test_multi_step_with_repeated_prompts(backend_name, noise_scale, params):
    """Several steps over an overlapping pool: momentum, EMA, streaks, pruning, noise keys."""
    gen = torch.Generator().manual_seed(7)
    num_prompts, batch, group = 600, 256, 8
    difficulty = torch.rand(num_prompts, 1, generator=gen)
    state = SelectorState.empty(num_prompts, "cpu")
    ref_state = clone_state(state)
    backend = dispatch.BACKENDS[backend_name]
    for step in range(6):
        ids = torch.randperm(num_prompts, generator=gen)[:batch]
        rewards = binary_rewards(batch, group, gen, difficulty[ids])
        valid = ragged_valid(batch, group, gen) if step % 2 else None
        got = backend.step(rewards, valid, ids, state, params)
        want = reference.lze_step(rewards, valid, ids, ref_state, params)
        assert_stats_equal(got, want, rewards, valid, params)
        assert_states_equal(state, ref_state)
        got_sel = backend.topk(got.energy, 100, noise_scale, 11, state.step_counter)
        want_sel = reference.topk_select(want.energy, 100, noise_scale, 11,
                                         ref_state.step_counter[0])
        assert_selection_equal(got_sel, want_sel)
    assert (state.istate[:, L.FLAGS] & L.FLAG_PRUNED).any()  # the pruner was exercised


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_continuous_rewards_and_low_precision(backend_name, dtype, params):
    gen = torch.Generator().manual_seed(3)
    batch, group = 513, 12
    rewards = torch.rand(batch, group, generator=gen).to(dtype)
    valid = ragged_valid(batch, group, gen)
    ids = torch.randperm(batch, generator=gen)
    state = SelectorState.empty(batch, "cpu")
    (got, got_sel, state), (want, _, ref_state) = run_both(
        backend_name, rewards, valid, ids, state, params, 200
    )
    assert_stats_equal(got, want, rewards, valid, params, exact=False)
    n = state.num_prompts  # row N is the reference's write sink
    # First sight: D, EMA and last pass rate move with p at most one for one; last energy as E.
    bounds = stat_bounds(rewards, valid, params)
    row_bound = torch.zeros(n, L.NUM_FIELDS, dtype=torch.float64)
    row_bound[ids] = (torch.stack([bounds["pass_rate"]] * 3 + [bounds["energy"]], dim=1)
                      + 2 * gamma(3))
    assert_within(state.fstate[:n], ref_state.fstate[:n], row_bound, "state")
    # Selection from the backend's own energies must be exact, whatever their last ulp.
    assert_selection_equal(got_sel, reference.topk_select(got.energy, 200, 0.0, 0,
                                                          state.step_counter[0]))


@pytest.mark.parametrize("backend_name", BACKENDS)
# One-block plan of the GPU top-k, across its warps and the Triton tile sizes (1,024 / 4,096).
@pytest.mark.parametrize("batch", [1, 5, 128, 129, 1000, 1025, 4099])
@pytest.mark.parametrize("noise_scale", [0.0, 0.05, 1.0])
def test_topk_with_ties_and_zeros(backend_name, batch, noise_scale):
    skip_if_too_big(backend_name, batch)
    gen = torch.Generator().manual_seed(batch)
    # Few distinct values: many exact ties; a third are zero and must never be kept.
    energy = torch.randint(0, 4, (batch,), generator=gen).float() / 8
    backend = dispatch.BACKENDS[backend_name]
    counter = torch.tensor([5, 0])
    for k in sorted({1, max(1, batch // 3), batch}):
        got = backend.topk(energy, k, noise_scale, 9, counter)
        want = reference.topk_select(energy, k, noise_scale, 9, counter[0])
        assert_selection_equal(got, want)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_empty_batch_only_advances_the_step_counter(backend_name, params):
    state = SelectorState.empty(4, "cpu")
    ref_state = clone_state(state)
    empty = (torch.zeros(0, 8), None, torch.zeros(0, dtype=torch.int64))
    got = dispatch.BACKENDS[backend_name].step(*empty, state, params)
    reference.lze_step(*empty, ref_state, params)
    assert got.advantages.shape == (0, 8) and got.energy.shape == (0,)
    assert_states_equal(state, ref_state)
    assert state.step_counter.tolist() == [1, 0]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_topk_without_candidates(backend_name):
    got = dispatch.BACKENDS[backend_name].topk(torch.zeros(9), 3, 0.05, 0, torch.zeros(2).long())
    assert got.kept_indices.tolist() == [-1, -1, -1]
    assert int(got.num_kept) == 0 and not got.keep_mask.any()


@pytest.mark.parametrize("backend_name", BACKENDS)
# The interpreter's numpy evaluates inf - inf in the faulty rows it then masks out.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_faulty_rows_are_skipped_and_recorded(backend_name, params):
    """check_inputs=False path: bad ids (out of range, duplicates), NaN/inf and out-of-range
    rewards. The bad rows are skipped without touching memory out of bounds; the good rows are
    processed exactly as the reference does; the fault bits say what was wrong."""
    num_prompts = 50
    rewards = binary_rewards(8, 4, torch.Generator().manual_seed(0))
    rewards[2, 1] = float("nan")
    rewards[3, 0] = 1.5
    rewards[4, 3] = float("inf")
    rewards[6, 2] = float("nan")  # masked out: padding may hold anything, no fault
    valid = torch.ones(8, 4, dtype=torch.bool)
    valid[6, 2] = False
    ids = torch.tensor([0, 1_000_000, 2, 3, 4, -7, 6, 7])
    state = SelectorState.empty(num_prompts, "cpu")
    (got, _, state), (want, _, ref_state) = run_both(
        backend_name, rewards, valid, ids, state, params, 3
    )
    assert_stats_equal(got, want, rewards, valid, params)
    assert_states_equal(state, ref_state)
    assert state.fault.item() == (L.FAULT_ID_OUT_OF_RANGE | L.FAULT_NONFINITE_REWARD
                                  | L.FAULT_REWARD_OUT_OF_RANGE)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_duplicate_ids_are_detected(backend_name, params):
    ids = torch.tensor([3, 5, 3, 9, 5, 3])
    rewards = binary_rewards(6, 4, torch.Generator().manual_seed(1))
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # every row has a non-zero energy
    state = SelectorState.empty(10, "cpu")
    got = dispatch.BACKENDS[backend_name].step(rewards, None, ids, state, params)
    assert state.fault.item() == L.FAULT_DUPLICATE_ID
    # Exactly one row per distinct id was applied (which one is the GPU's race to win).
    assert int((got.energy > 0).sum()) == 3
    assert state.istate[[3, 5, 9], L.SEEN].tolist() == [1, 1, 1]


@pytest.mark.parametrize("threads", ["1", "3", "8", ""])  # "": adaptive, torch's thread count
def test_cpu_thread_counts_give_the_reference_exactly(threads, params, monkeypatch):
    """The C++ backend split into tasks over 1 to 8 threads (more than the cores here), with
    duplicates and faults in different tasks: identical outputs, state and fault bits."""
    if not dispatch.BACKENDS["cpu"].available():
        pytest.skip("cpu backend not built")
    monkeypatch.setenv("LZE_NUM_THREADS", threads)
    gen = torch.Generator().manual_seed(11)
    # 8 threads need B >= 8 * 4096 (csrc/cpu/parallel.h: kRowsPerThread).
    batch, group, num_prompts = 33_000, 4, 70_000
    state = SelectorState.empty(num_prompts, "cpu")
    for step in range(2):
        ids = torch.randperm(num_prompts, generator=gen)[:batch]
        ids[[30_000, 32_999]] = ids[[5, 20_000]]  # later rows repeat ids of earlier tasks
        rewards = binary_rewards(batch, group, gen)
        rewards[[100, 25_000], 1] = float("nan")
        ids[12_345] = num_prompts + step  # out of range
        valid = ragged_valid(batch, group, gen) if step == 1 else None
        (got, got_sel, state), (want, want_sel, ref_state) = run_both(
            "cpu", rewards, valid, ids, state, params, num_keep(batch, 0.4), 0.05, step)
        assert_stats_equal(got, want, rewards, valid, params)
        assert_selection_equal(got_sel, want_sel)
        assert_states_equal(state, ref_state)
    assert state.fault.item() == (L.FAULT_ID_OUT_OF_RANGE | L.FAULT_DUPLICATE_ID
                                  | L.FAULT_NONFINITE_REWARD)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_thread_count_is_a_clear_error(value, params, monkeypatch):
    if not dispatch.BACKENDS["cpu"].available():
        pytest.skip("cpu backend not built")
    monkeypatch.setenv("LZE_NUM_THREADS", value)
    with pytest.raises(ValueError, match="LZE_NUM_THREADS: expected an int >= 1"):
        dispatch.BACKENDS["cpu"].step(torch.ones(2, 2), None, torch.arange(2),
                                      SelectorState.empty(2, "cpu"), params)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("d_min", [1e-300, 1e-40])
def test_parameters_below_fp32_normal_range(backend_name, d_min):
    """Tiny float parameters (an fp64 constant in the Triton interpreter) round to fp32 as the
    reference rounds them: to 0 below fp32's subnormals, to a subnormal otherwise."""
    params = KernelParams.from_config(LZEConfig(d_min=d_min, beta=1e-300, alpha=1e-300))
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    state = SelectorState.empty(4, "cpu")
    (got, got_sel, state), (want, want_sel, ref_state) = run_both(
        backend_name, rewards, None, torch.arange(4), state, params, 2)
    assert_stats_equal(got, want, rewards, None, params)
    assert_states_equal(state, ref_state)
    assert state.fstate[0, L.D_INIT].item() == torch.tensor(d_min, dtype=torch.float32).item()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_property_random_configs(backend_name, data):
    """Random batches, groups, configs and multi-step histories agree with the reference."""
    batch = data.draw(st.integers(1, 70), label="batch")
    group = data.draw(st.integers(1, 40), label="group")
    config = LZEConfig(
        keep_ratio=data.draw(st.floats(0.01, 1.0)), beta=data.draw(st.floats(0.0, 0.99)),
        d_min=data.draw(st.floats(0.0, 1.0)), alpha=data.draw(st.floats(0.0, 2.0)),
        norm_by_std=data.draw(st.booleans()), prune_after=data.draw(st.integers(1, 3)),
    )
    params = KernelParams.from_config(config)
    seed = data.draw(st.integers(0, 2**32 - 1))
    noise = data.draw(st.sampled_from([0.0, 0.05]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    num_prompts = batch + data.draw(st.integers(0, 20))
    state = SelectorState.empty(num_prompts, "cpu")
    for _ in range(data.draw(st.integers(1, 3))):
        ids = torch.randperm(num_prompts, generator=gen)[:batch]
        rewards = binary_rewards(batch, group, gen)
        valid = ragged_valid(batch, group, gen) if data.draw(st.booleans()) else None
        (got, got_sel, state), (want, want_sel, ref_state) = run_both(
            backend_name, rewards, valid, ids, state, params, config.num_keep(batch), noise, seed
        )
        assert_stats_equal(got, want, rewards, valid, params)
        assert_selection_equal(got_sel, want_sel)
        assert_states_equal(state, ref_state)


@pytest.mark.parametrize("backend_name", [backend_param("triton")])
def test_triton_rejects_what_it_cannot_compile(backend_name, params):
    """The Triton wrappers name the argument: fp64 rewards, and G beyond its largest tile."""
    backend = dispatch.BACKENDS[backend_name]
    state = SelectorState.empty(4, "cpu")
    with pytest.raises(ValueError, match="rewards: expected one of"):
        backend.step(torch.zeros(2, 4, dtype=torch.float64), None, torch.arange(2), state, params)
    with pytest.raises(ValueError, match="rollouts per group"):
        backend.step(torch.zeros(1, 4097), None, torch.arange(1), state, params)
    assert state.step_counter.tolist() == [0, 0]

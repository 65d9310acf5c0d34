"""DOTS (docs/spec.md §8): the fused pass-rate prediction on every backend against the torch reference,
the linear calibration and the near-1/2 sampler (known values, properties, no host sync)."""

import ast
import math
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import U32, assert_within, predict_param, softmax_mean_error_bound
from lze_kernels import dots, ops, reference


BACKENDS = [predict_param(name) for name in ("torch", "cpu", "triton")]
KERNELS = [predict_param(name) for name in ("cpu", "triton")]
# (N, K, d): single query/reference, N and K not multiples of any block, d not a power of two,
# K across several reference blocks, and the study's d = 384.
SHAPES = [(1, 1, 1), (5, 1, 3), (37, 7, 10), (129, 33, 48), (300, 256, 384), (1000, 5, 17),
          (64, 64, 64), (513, 300, 100), (2049, 17, 7)]


def inputs(n, k, d, seed=0, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, d, generator=gen) * scale).to(dtype)
    r = (torch.randn(k, d, generator=gen) * scale).to(dtype)
    return q, r, torch.rand(k, generator=gen)


def oracle(q, r, y, tau=1.0):
    """fp64 softmax attention: the exact value both the reference and the kernels approximate."""
    s = (q.double() @ r.double().T) / (math.sqrt(q.shape[1]) * tau)
    return torch.softmax(s, dim=1) @ y.double()


def bound(q, r, y, tau=1.0):
    """[N] how far any fp32 evaluation may be from :func:`oracle` (conftest)."""
    return softmax_mean_error_bound(q, r, y, dots.attention_scale(q.shape[1], tau))


# ----------------------------------------------------------------------------- prediction


@pytest.mark.parametrize("n,k,d", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prediction_matches_reference(backend, n, k, d):
    q, r, y = inputs(n, k, d, seed=n + k + d)
    got = ops.predict_pass_rates(q, r, y, 0.7, backend=backend)
    want = ops.predict_pass_rates(q, r, y, 0.7, backend="torch")
    assert got.shape == (n,) and got.dtype == torch.float32
    tolerance = bound(q, r, y, 0.7)
    assert_within(got, oracle(q, r, y, 0.7), tolerance, "against the exact value")
    assert_within(got, want, 2 * tolerance, "against the reference")  # each within tolerance


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_reference_predicts_its_label(backend):
    q, r, _ = inputs(77, 1, 19)
    got = ops.predict_pass_rates(q, r, torch.tensor([0.375]), backend=backend)
    assert torch.equal(got, torch.full((77,), 0.375))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_references_average_their_labels(backend):
    """Identical reference embeddings tie every score: the prediction is the mean label."""
    q, r, y = inputs(50, 1, 24)
    refs = r.expand(40, 24).contiguous()
    labels = torch.linspace(0, 1, 40)
    got = ops.predict_pass_rates(q, refs, labels, backend=backend)
    assert_within(got, labels.double().mean().expand(50), bound(q, refs, labels))


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_stay_finite(backend):
    """|scores| ~ 1e4: a naive exp overflows; the running max keeps every weight in [0, 1].
    Each query is a copy of one reference (plus noise), which then wins the softmax outright."""
    gen = torch.Generator().manual_seed(3)
    k, d = 300, 40
    r = torch.randn(k, d, generator=gen) * 20  # <r, r> / sqrt(d) ~ 400 * 40 / 6.3 ~ 2.5e3
    pick = torch.randint(0, k, (333,), generator=gen)
    q = 4 * r[pick] + 0.01 * torch.randn(333, d, generator=gen)  # scores up to ~1e4
    scores = q @ r.T / math.sqrt(d)
    assert scores.abs().max() > 5e3
    y = torch.rand(k, generator=gen)
    got = ops.predict_pass_rates(q, r, y, backend=backend)
    assert torch.isfinite(got).all()
    exact = oracle(q, r, y)
    assert torch.equal(exact, y[scores.argmax(dim=1)].double())  # the winner takes it all
    assert_within(got, exact, bound(q, r, y))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_embeddings(backend, dtype):
    q, r, y = inputs(200, 50, 33, dtype=dtype)
    got = ops.predict_pass_rates(q, r, y, backend=backend)
    assert_within(got, oracle(q, r, y), bound(q, r, y))


@pytest.mark.parametrize("backend", KERNELS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), k=st.integers(1, 140), d=st.integers(1, 70),
       log_scale=st.floats(-3, 1.5), tau=st.floats(0.05, 5.0), seed=st.integers(0, 2**16))
# Scores up to ~350: reordering the references moved p_hat by 1e-5, past a fixed 2e-6.
@example(n=82, k=18, d=64, log_scale=1.0, tau=1.0, seed=1)
def test_prediction_properties(backend, n, k, d, log_scale, tau, seed):
    """Within the fp32 error bound of the exact value (conftest.softmax_mean_error_bound: the
    scores' rounding grows with their size); a convex combination of the labels up to that
    bound; invariant to the order of the references up to twice it (each order is within it)."""
    q, r, y = inputs(n, k, d, seed, scale=10.0**log_scale)
    got = ops.predict_pass_rates(q, r, y, tau, backend=backend)
    tolerance = bound(q, r, y, tau)
    assert_within(got, oracle(q, r, y, tau), tolerance, "against the exact value")
    assert (got >= y.min() - tolerance).all() and (got <= y.max() + tolerance).all()
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    assert_within(ops.predict_pass_rates(q, r[perm], y[perm], tau, backend=backend), got,
                  2 * tolerance, "references reordered")


def test_reference_is_chunked():
    """The reference never holds more than REFERENCE_CHUNK query rows of scores."""
    q, r, y = inputs(reference.REFERENCE_CHUNK + 3, 9, 5)
    assert_within(reference.predict_pass_rates_reference(q, r, y, 1 / math.sqrt(5)),
                  oracle(q, r, y),
                  bound(q, r, y))


def test_empty_query_set():
    q, r, y = inputs(0, 4, 8)
    assert ops.predict_pass_rates(q, r, y, backend="torch").shape == (0,)


@pytest.mark.parametrize("call,match", [
    (lambda q, r, y: ops.predict_pass_rates(q.numpy(), r, y), "query_emb: expected a torch"),
    (lambda q, r, y: ops.predict_pass_rates(q[0], r, y), "query_emb: expected a 2-D"),
    (lambda q, r, y: ops.predict_pass_rates(q.long(), r, y), "query_emb: expected dtype"),
    (lambda q, r, y: ops.predict_pass_rates(q, r.half(), y), "ref_emb: expected dtype"),
    (lambda q, r, y: ops.predict_pass_rates(q, r[:, :3], y), "ref_emb: expected dimension d"),
    (lambda q, r, y: ops.predict_pass_rates(q, r[:0], y[:0]), r"ref_emb: .*K >= 1"),
    (lambda q, r, y: ops.predict_pass_rates(q, r, y[:2]), "ref_pass: expected shape"),
    (lambda q, r, y: ops.predict_pass_rates(q, r, y.long()), "ref_pass: expected dtype"),
    (lambda q, r, y: ops.predict_pass_rates(q, r, y, 0.0), "attention_tau: expected"),
    (lambda q, r, y: ops.predict_pass_rates(q, r, y, backend="gpu"), "backend: expected"),
    (lambda q, r, y: ops.predict_pass_rates(q, r, y, backend="cuda_emulated"),
     "backend: .*(no predict kernel|not available)"),
])
def test_prediction_errors_name_the_argument(call, match):
    q, r, y = inputs(6, 4, 8)
    with pytest.raises(ValueError, match=match):
        call(q, r, y)


# ----------------------------------------------------------------------------- calibration


def test_calibration_recovers_a_line():
    x = torch.tensor([0.1, 0.2, 0.4, 0.8])
    slope, intercept = ops.calibrate_linear(x, 2 * x + 0.1)
    assert slope.shape == () and slope.dtype == torch.float32
    torch.testing.assert_close(slope, torch.tensor(2.0))
    torch.testing.assert_close(intercept, torch.tensor(0.1))


def test_calibration_is_least_squares():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(256, generator=gen), torch.rand(256, generator=gen)
    slope, intercept = ops.calibrate_linear(x, y)
    want = torch.from_numpy(np.polyfit(x.double().numpy(), y.double().numpy(), 1))
    # Fitted in fp64 (its error is far below fp32's) and rounded once to fp32.
    assert_within(torch.stack([slope, intercept]), want, 2 * U32 * want.abs())


@pytest.mark.parametrize("x", [torch.tensor([0.3]), torch.full((9,), 0.25)])
def test_degenerate_calibration_is_the_identity(x):
    slope, intercept = ops.calibrate_linear(x, torch.rand(x.shape[0]))
    assert float(slope) == 1.0 and float(intercept) == 0.0


def test_apply_calibration_clamps_to_unit_interval():
    pred = torch.tensor([0.0, 0.2, 0.5, 0.9])
    out = ops.apply_calibration(pred, torch.tensor(2.0), torch.tensor(-0.2))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.2, 0.8, 1.0]))


def test_calibration_errors_name_the_argument():
    with pytest.raises(ValueError, match="actual: expected shape"):
        ops.calibrate_linear(torch.rand(3), torch.rand(4))
    with pytest.raises(ValueError, match=r"predicted: .*K >= 1"):
        ops.calibrate_linear(torch.rand(0), torch.rand(0))


# ----------------------------------------------------------------------------- sampler


def step_key(step):
    return torch.tensor([step], dtype=torch.int64)


def test_samples_are_distinct_and_deterministic():
    pred = torch.rand(500, generator=torch.Generator().manual_seed(0))
    a = ops.sample_near_half(pred, 64, 0.05, 7, step_key(3))
    assert a.shape == (64,) and a.dtype == torch.int64
    assert a.unique().numel() == 64 and (a >= 0).all() and (a < 500).all()
    assert torch.equal(a, ops.sample_near_half(pred, 64, 0.05, 7, step_key(3)))
    assert not torch.equal(a, ops.sample_near_half(pred, 64, 0.05, 7, step_key(4)))
    assert not torch.equal(a, ops.sample_near_half(pred, 64, 0.05, 8, step_key(3)))


def test_samples_respect_eligibility():
    pred = torch.full((100,), 0.5)
    eligible = torch.arange(100) % 3 == 0  # 34 eligible
    got = ops.sample_near_half(pred, 30, 1e-3, 0, step_key(0), eligible)
    assert eligible[got].all() and got.unique().numel() == 30


def test_too_few_eligible_fills_with_the_rest_in_index_order():
    pred = torch.tensor([0.5, float("nan"), 0.1, 0.5, 0.9, 0.5])
    eligible = torch.tensor([False, True, True, False, True, True])
    got = ops.sample_near_half(pred, 6, 1e-3, 0, step_key(0), eligible)
    assert sorted(got[:3].tolist()) == [2, 4, 5]  # eligible with a prediction
    assert got[3:].tolist() == [0, 1, 3]  # then the rest (NaN and ineligible) by index


def test_extreme_tau_still_returns_distinct_indices():
    """tau tiny: every key is dominated by -|p - 1/2| / tau, many equal; still n distinct."""
    pred = torch.tensor([0.0, 1.0] * 50)
    got = ops.sample_near_half(pred, 100, 1e-300, 0, step_key(0))
    assert got.unique().numel() == 100


def test_sampler_prefers_predictions_near_half():
    """Gumbel-max (n = 1) draws prompt i with probability exp(-|p_i - 1/2| / tau) / Z: the
    empirical frequencies of 4000 seeded draws match it (chi-square, 10 bins)."""
    tau, bins, draws = 0.1, 10, 4000
    pred = (torch.arange(bins) + 0.5) / bins
    weights = torch.exp(-(pred - 0.5).abs() / tau)
    expected = draws * weights / weights.sum()
    picks = torch.stack([ops.sample_near_half(pred, 1, tau, 11, step_key(s)) for s in
                         range(draws)]).flatten()
    observed = torch.bincount(picks, minlength=bins).double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # chi-square(9 dof) 99.9 % quantile
    assert observed[4] + observed[5] > 0.5 * draws  # the two bins next to 1/2 dominate


def test_default_tau_picks_the_closest_to_half():
    pred = torch.linspace(0, 1, 1001)
    got = ops.sample_near_half(pred, 3, 1e-3, 0, step_key(0))
    assert (pred[got] - 0.5).abs().max() <= 0.02


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=0), "n: expected an int in"), (dict(n=11), "n: expected an int in"),
    (dict(tau=0.0), "tau: expected"), (dict(tau=float("nan")), "tau: expected"),
    (dict(seed=-1), "seed: expected"), (dict(step=torch.tensor([1], dtype=torch.int32)),
                                        "step: expected an int64 tensor"),
    (dict(step=3), "step: expected an int64 tensor"),
    (dict(eligible=torch.ones(9, dtype=torch.bool)), "eligible: expected shape"),
    (dict(eligible=torch.ones(10)), "eligible: expected dtype"),
])
def test_sampler_errors_name_the_argument(kwargs, match):
    args = dict(n=3, tau=0.1, seed=0, step=None, eligible=None) | kwargs
    with pytest.raises(ValueError, match=match):
        ops.sample_near_half(torch.rand(10), **args)


# ----------------------------------------------------------------------------- no host sync


def test_dots_runs_on_fake_tensors():
    with FakeTensorMode():
        q, r, y = torch.rand(100, 16), torch.rand(8, 16), torch.rand(8)
        pred = ops.predict_pass_rates(q, r, y, backend="torch")
        slope, intercept = ops.calibrate_linear(pred[:8], y)
        pred = ops.apply_calibration(pred, slope, intercept)
        ids = ops.sample_near_half(pred, 10, 1e-3, 0, torch.zeros(1, dtype=torch.int64),
                                   torch.ones(100, dtype=torch.bool))
        assert pred.shape == (100,) and ids.shape == (10,) and slope.shape == ()


def test_sampler_compiles_fullgraph():
    torch._dynamo.reset()

    def choose(pred, y, step, eligible):
        slope, intercept = ops.calibrate_linear(pred[:16], y)
        return ops.sample_near_half(ops.apply_calibration(pred, slope, intercept), 8, 1e-2, 5,
                                    step, eligible)

    compiled = torch.compile(choose, fullgraph=True, backend="eager")
    pred, y = torch.rand(200), torch.rand(16)
    eligible = torch.rand(200) < 0.5
    assert torch.equal(compiled(pred, y, step_key(2), eligible),
                       choose(pred, y, step_key(2), eligible))


@pytest.mark.parametrize("backend", [predict_param("torch"), predict_param("cpu")])
def test_prediction_traces_fullgraph(backend):
    """The reference and the C++ custom op trace without a graph break (the Triton launch runs
    in the interpreter here, which dynamo does not trace)."""
    torch._dynamo.reset()
    q, r, y = inputs(40, 6, 12)
    compiled = torch.compile(lambda a, b, c: ops.predict_pass_rates(a, b, c, backend=backend),
                             fullgraph=True, backend="eager")
    assert_within(compiled(q, r, y), oracle(q, r, y), bound(q, r, y))


def test_dots_module_has_no_sync_calls():
    path = pathlib.Path(dots.__file__)
    calls = [node.func.attr for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    assert not {"item", "tolist", "cpu", "nonzero", "numpy"} & set(calls)


@pytest.mark.parametrize("backend", [predict_param("cpu")])
def test_cpu_custom_op_passes_opcheck(backend):
    from lze_kernels import native

    q, r, y = inputs(40, 6, 12)
    torch.library.opcheck(native.CPU._predict_op, (q, r, y, 0.3))

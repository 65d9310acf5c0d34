"""Shared test setup. TRITON_INTERPRET must be set before any @triton.jit function is defined,
so it is set here, before lze_kernels is imported: the Triton kernels then run on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from lze_kernels import dispatch  # noqa: E402
from lze_kernels.config import LZEConfig  # noqa: E402
from lze_kernels.layout import KernelParams  # noqa: E402

# `make test`'s per-test time record and its spread over pytest-xdist workers.
pytest_plugins = ["timing_plugin", "scheduling_plugin"]

# Hypothesis profiles (docs/kernels.md, "Tests: tolerances and hypothesis profiles").
# "ci", selected when the environment variable CI is true (.ci/run sets it): derandomised, so
# each test's examples follow from the test itself and every machine and fresh clone replays the
# same ones; no examples database (a fresh clone has none) and nothing that depends on the
# machine's speed (no deadline, no too_slow health check). "local", otherwise: random
# exploration, with the database in .hypothesis/ replaying a found counterexample first; add it
# to its test as an explicit @example so that CI runs it too. `--hypothesis-profile` overrides.
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("local", deadline=None, print_blob=True)
settings.load_profile(
    "ci" if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes") else "local")

# Kernel backends that run here on CPU tensors, compared against the torch reference.
KERNEL_BACKENDS = ("cpu", "cuda_emulated", "triton")
# Largest batch each backend is run at by the step tests (tests/test_topk_linear.py runs the
# top-k alone up to 1,048,576 rows everywhere).
MAX_BATCH = {"cpu": 65536, "cuda_emulated": 65536, "triton": 65536, "torch": 65536}


def pytest_report_header(config):
    try:
        import triton
    except ImportError:
        return "triton: not installed"
    return f"triton {triton.__version__} ({os.path.dirname(triton.__file__)})"


def pytest_configure(config):
    """tools/test_triton_latest.sh sets LZE_EXPECT_TRITON: fail unless that Triton is the one
    imported (a PYTHONPATH mistake would otherwise test the venv's pinned Triton twice)."""
    expected = os.environ.get("LZE_EXPECT_TRITON")
    if not expected:
        return
    import triton

    if triton.__version__ != expected:
        raise pytest.UsageError(f"LZE_EXPECT_TRITON={expected}, but triton {triton.__version__} "
                                f"was imported from {os.path.dirname(triton.__file__)}")


def backend_param(name):
    """A pytest param for a kernel backend, skipped when it is not built/installed here."""
    backend = dispatch.BACKENDS[name]
    ok = backend.available() and dispatch.supports(backend, torch.device("cpu"))
    return pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"{name} not available"),
                        id=name)


def predict_param(name):
    """A backend param, skipped unless the backend runs the DOTS prediction here."""
    param = backend_param(name)
    has = dispatch.BACKENDS[name].available() and dispatch.BACKENDS[name].has_op("predict")
    return pytest.param(name, marks=[*param.marks, pytest.mark.skipif(
        not has, reason=f"{name} has no predict kernel")], id=name)


@pytest.fixture(scope="session")
def params():
    return KernelParams.from_config(LZEConfig())


def outside_make() -> dict[str, str]:
    """This environment without what an enclosing make passes down (CI runs the tests under
    `make test`, whose MAKELEVEL and MAKEFLAGS make a nested make print its directory)."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}


def binary_rewards(batch, group, generator, p_correct=None):
    """Binary rewards whose per-row success probability is spread over [0, 1]."""
    if p_correct is None:
        p_correct = torch.rand(batch, 1, generator=generator)
    return (torch.rand(batch, group, generator=generator) < p_correct).float()


def ragged_valid(batch, group, generator):
    """A valid mask with a random number of valid rollouts per row (some rows empty)."""
    counts = torch.randint(0, group + 1, (batch, 1), generator=generator)
    return torch.arange(group)[None, :] < counts


# ----------------------------------------------------------------------------- fp32 error bounds
# A kernel and its reference agree to the rounding of the arithmetic they do, no closer: the
# tolerances below follow from fp32's unit roundoff u times the size of the terms involved,
# times the number of terms where the order of a sum is free (Higham 2002, "Accuracy and
# Stability of Numerical Algorithms", 2nd ed., Lemma 3.1 and eq. (4.4)). They are worst-case
# bounds, so every machine and summation order gives the same verdict.

U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff, 2^-24


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): n roundings in a row, or a sum of n + 1 terms in any
    order, are off by at most gamma_n times the sum of the terms' magnitudes."""
    return n * U32 / (1 - n * U32)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str = "") -> None:
    """|got - want| <= bound elementwise (``bound`` a float or a broadcastable tensor; equal
    values pass whatever their bound); the message names the worst element. A NaN in ``got`` or
    ``want`` fails."""
    err = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    excess = torch.where(err == 0, 0.0, (err - bound).nan_to_num(nan=float("inf")))
    if not (excess <= 0).all():
        i = int(excess.flatten().argmax())
        raise AssertionError(f"{what}: |got - want| = {err.flatten()[i]:.3e} exceeds its bound "
                             f"{bound.flatten()[i]:.3e} at flat index {i} of {tuple(err.shape)}")


def advantage_error_bound(rewards: torch.Tensor, valid, eps: float, norm_by_std: bool = True
                          ) -> torch.Tensor:
    """[B, G] bound on |A - exact A| for any fp32 evaluation of the GRPO advantage
    ``A = (r - mean) / (std + eps)`` (two-pass unbiased std, lze_math.h) over a row's n valid
    rewards, to first order.

    mean: a sum of n terms and a division, off by dm = gamma_n sum|r| / n. centred c = r - mean:
    dc = dm + u |c|. Sum of squares V: the mean's shift adds at most n dm^2 (its first order
    cancels, sum c = 0), the centring 2u V, the squares and their sum gamma_n V. std =
    sqrt(V / (n - 1)) moves by min(dV / ((n - 1) std), sqrt(dV / (n - 1))) (|sqrt a - sqrt b| <=
    |a - b| / sqrt a and <= sqrt |a - b|), plus 2u std (division, root). Then
    dA = dc / (std + eps) + |A| (dstd + u (std + eps)) / (std + eps) + u |A|."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r = rewards.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # faulty rows give 0
    n = valid.sum(dim=1, keepdim=True).double()
    live = valid & (n >= 2)  # rows of fewer than two rewards get exactly 0 everywhere
    r = torch.where(valid, r, 0.0)
    mean = r.sum(dim=1, keepdim=True) / n.clamp_min(1)
    d_mean = _gamma_tensor(n) * r.abs().sum(dim=1, keepdim=True) / n.clamp_min(1)
    centred = torch.where(valid, r - mean, 0.0)
    d_centred = d_mean + U32 * centred.abs()
    if not norm_by_std:
        return torch.where(live, d_centred, 0.0)
    sum_sq = (centred * centred).sum(dim=1, keepdim=True)
    d_sum_sq = n * d_mean**2 + _gamma_tensor(n + 2) * sum_sq
    std = (sum_sq / (n - 1).clamp_min(1)).sqrt()
    d_var = d_sum_sq / (n - 1).clamp_min(1)
    d_std = torch.minimum(d_var / std.clamp_min(torch.finfo(torch.float64).tiny),
                          d_var.sqrt()) + 2 * U32 * std
    adv = centred / (std + eps)
    bound = ((d_centred + adv.abs() * (d_std + U32 * (std + eps))) / (std + eps)
             + U32 * adv.abs())
    return torch.where(live, bound, 0.0)


def _gamma_tensor(n: torch.Tensor) -> torch.Tensor:
    return n * U32 / (1 - n * U32)


def pass_rate_error_bound(rewards: torch.Tensor, valid) -> torch.Tensor:
    """[B] bound on |p - exact p| for a row's mean of n valid rewards summed in any order in fp32
    (binary rewards sum exactly, so there it is loose but never wrong)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r = torch.where(valid, rewards.double().nan_to_num(0.0, 0.0, 0.0), 0.0)
    n = valid.sum(dim=1).double()
    return _gamma_tensor(n) * r.abs().sum(dim=1) / n.clamp_min(1)


def softmax_mean_error_bound(q: torch.Tensor, r: torch.Tensor, y: torch.Tensor, scale: float,
                             product_error: float = 0.0) -> torch.Tensor:
    """[N] bound on |p_hat - exact| for any fp32 evaluation of the DOTS prediction
    ``p_hat_q = sum_j softmax_j(scale <q, r_j>) y_j`` (the kernels' online softmax over blocks
    of references in any order, or the reference's chunked softmax), to first order.

    Relative errors rho_j of the weights move p_hat by sum_j w_j rho_j (y_j - p_hat) over
    1 - sum_j w_j |rho_j|. rho_j collects: the score's rounding, exp(ds) - 1 for ds =
    gamma_{d+2} scale sum_i |q_i r_ji| (a dot product of d terms, the scale rounded to fp32
    and the product with it) plus
    ``product_error`` times the same magnitude (split products such as TF32x3); the rounding of
    s_j - max and of its product with log2(e) (3u |s_j - max|); the exponential (4 ulp, 8u);
    and the online softmax's rescalings, at most K, each as one more such exponential of a max
    difference (their differences telescope to the scores' spread). The sums of e_j y_j and
    e_j over K terms add gamma_{K+1} (sum_j w_j |y_j| + |p_hat|), the division u |p_hat|."""
    q64, r64, y64 = q.double(), r.double(), y.double()
    k, d = r.shape
    s = scale * (q64 @ r64.T)
    magnitude = scale * (q64.abs() @ r64.abs().T)
    top = s.amax(dim=1, keepdim=True)
    spread = top - s.amin(dim=1, keepdim=True)
    w = torch.softmax(s, dim=1)
    p = w @ y64
    rho = (torch.expm1((gamma(d + 2) + product_error) * magnitude)
           + 3 * U32 * ((top - s) + spread) + 8 * U32 * (k + 1))
    moved = (w * rho * (y64[None, :] - p[:, None]).abs()).sum(dim=1)
    first_order = moved / (1 - (w * rho).sum(dim=1)).clamp_min(0.5)
    return first_order + gamma(k + 1) * ((w * y64.abs()).sum(dim=1) + p.abs()) + U32 * p.abs()

"""Every public op with bad arguments (docs/kernels.md, "Public ops: checks and device faults").

A wrong dtype, shape, device (a meta tensor stands in for another device), size or host-known
index range raises a ValueError naming the argument before anything runs, leaves the state
bit-identical, and the same call with that argument intact then runs. Strided inputs are copied
(same result as contiguous ones). Values only the device knows (an id past the state, a NaN
reward) are skipped by the kernels and raised by ``ops.raise_if_faulted``.

Every mutation runs on every backend in every run (pytest parameters); hypothesis varies the
sizes around it. Run once against the C++ modules built with AddressSanitizer (docs/kernels.md).
"""

import re
from typing import Callable, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import KERNEL_BACKENDS, backend_param, predict_param
from lze_kernels import LZESelector, ops
from lze_kernels import layout as L
from lze_kernels.layout import SelectorState

STEP_BACKENDS = [backend_param(name) for name in ("torch", *KERNEL_BACKENDS)]
PREDICT_BACKENDS = [predict_param(name) for name in ("torch", "cpu", "triton")]
ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.uint8, torch.bool)
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
META = torch.device("meta")
# Two drawn argument sets a (mutation, backend): the checks are host code shared by every
# backend, and each intact call runs the backend's kernels (in the Triton interpreter, tens of
# milliseconds a call).
EXAMPLES = settings(max_examples=2, deadline=None)


class Mutation(NamedTuple):
    """One bad argument: ``apply(args)`` returns the bad arguments; the error names ``names``."""

    id: str
    names: tuple[str, ...]
    apply: Callable[[dict], dict]


def setting(key, make, names=None, id=None):
    """A mutation replacing ``args[key]`` by ``make(args)``."""
    return Mutation(id or key, names or (key,), lambda args: {**args, key: make(args)})


def tensor_mutations(key, allowed, meta=True, extra_dim=True, default=None):
    """The wrong dtypes, a Python list, (``extra_dim``) one dimension more and (``meta``)
    another device. ``default(args)`` stands in for an optional argument given as None."""
    def get(args):
        return default(args) if args[key] is None else args[key]

    out = [setting(key, lambda a, d=d: get(a).to(d), id=f"{key}-{str(d)[6:]}")
           for d in ALL_DTYPES if d not in allowed]
    out.append(setting(key, lambda a: get(a).tolist(), id=f"{key}-list"))
    if extra_dim:
        out.append(setting(key, lambda a: get(a)[None], id=f"{key}-extra-dim"))
    if meta:
        out.append(setting(key, lambda a: get(a).to(META), id=f"{key}-meta"))
    return out


def all_valid(args):
    return torch.ones_like(args["rewards"], dtype=torch.bool)


def step_zero(args):
    return torch.zeros(1, dtype=torch.int64)


def values(key, bad, name=None):
    return [setting(key, lambda a, v=v: v, (name or key,), f"{key}={v!r}") for v in bad]


def resized(tensor, rows):
    """``tensor`` with ``rows`` rows (cut, or padded with copies of its first row)."""
    if rows <= tensor.shape[0]:
        return tensor[:rows]
    return torch.cat([tensor, tensor[:1].expand(rows - tensor.shape[0], *tensor.shape[1:])])


def with_state_field(field, make):
    def apply(args):
        s = args["state"]
        fields = {f: getattr(s, f) for f in ("records", "step_counter", "fault")}
        return {**args, "state": SelectorState(**{**fields, field: make(fields[field])})}
    return apply


def strided(t):
    """The same values as a non-contiguous view."""
    return t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, t], 1)[:, 0]


# ----------------------------------------------------------------------------- argument sets


@st.composite
def step_args(draw, with_valid=None):
    n = draw(st.integers(1, 12))
    batch, group = draw(st.integers(1, n)), draw(st.integers(1, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    valid = torch.rand(batch, group, generator=gen) < 0.8
    use_valid = draw(st.booleans()) if with_valid is None else with_valid
    return dict(rewards=(torch.rand(batch, group, generator=gen) < 0.5).float(),
                prompt_ids=torch.randperm(n, generator=gen)[:batch],
                state=ops.new_state(n), valid=valid if use_valid else None)


def _rows(batch, extra=0):
    """Every per-row input cut or padded to ``batch(args) + extra`` rows."""
    def apply(a):
        rows = batch(a) + extra
        return {**a, "rewards": resized(a["rewards"], rows), "prompt_ids": torch.arange(rows),
                "valid": None if a["valid"] is None else resized(a["valid"], rows)}
    return apply


def _valid_or_ones(a):
    return all_valid(a) if a["valid"] is None else a["valid"]


STEP_INPUT_MUTATIONS = [
    *tensor_mutations("rewards", (torch.float32, torch.bfloat16, torch.float16)),
    setting("rewards", lambda a: a["rewards"][0], id="rewards-1d"),
    Mutation("rewards-no-rollouts", ("rewards",),
             lambda a: {**a, "rewards": a["rewards"][:, :0], "valid": None}),
    Mutation("rewards-no-groups", ("rewards",), _rows(lambda a: 0)),
    *tensor_mutations("prompt_ids", (torch.int64,)),
    setting("prompt_ids", lambda a: torch.arange(a["rewards"].shape[0] + 1),
            id="prompt_ids-one-more"),
    setting("prompt_ids", lambda a: a["prompt_ids"][:-1], id="prompt_ids-one-fewer"),
    Mutation("prompt_ids-more-than-the-state", ("prompt_ids",),
             _rows(lambda a: a["state"].num_prompts, 1)),
    *tensor_mutations("valid", (torch.bool,), default=all_valid),
    setting("valid", lambda a: torch.cat([_valid_or_ones(a)] * 2, 1), id="valid-wider"),
    setting("valid", lambda a: resized(_valid_or_ones(a), a["rewards"].shape[0] + 1),
            id="valid-longer"),
    setting("valid", lambda a: _valid_or_ones(a)[0], id="valid-1d"),
]
STATE_MUTATIONS = [
    setting("state", lambda a: vars(a["state"]), id="state-dict"),
    setting("state", lambda a: None, id="state-None"),
    setting("state", lambda a: SelectorState.empty(0, "cpu"), ("state.records",),
            "state-no-prompts"),
    Mutation("records-float32", ("state.records",),
             with_state_field("records", lambda t: t.view(torch.float32))),
    Mutation("records-int64", ("state.records",), with_state_field("records", torch.Tensor.long)),
    Mutation("records-7-columns", ("state.records",),
             with_state_field("records", lambda t: t[:, :7])),
    Mutation("records-two-tables", ("state.records",),
             with_state_field("records", lambda t: t.view(-1, 2, 4)[:, 0])),
    Mutation("records-strided", ("state.records",), with_state_field("records", strided)),
    # The state's device is the records': the other fields are then on another one.
    Mutation("records-meta", ("state.step_counter",),
             with_state_field("records", lambda t: t.to(META))),
    Mutation("step_counter-short", ("state.step_counter",),
             with_state_field("step_counter", lambda t: t[:1])),
    Mutation("step_counter-int32", ("state.step_counter",),
             with_state_field("step_counter", lambda t: t.int())),
    Mutation("step_counter-meta", ("state.step_counter",),
             with_state_field("step_counter", lambda t: t.to(META))),
    Mutation("fault-long", ("state.fault",), with_state_field("fault", lambda t: t.repeat(2))),
    Mutation("fault-meta", ("state.fault",), with_state_field("fault", lambda t: t.to(META))),
]
LZE_UPDATE_MUTATIONS = [
    *STEP_INPUT_MUTATIONS,
    *STATE_MUTATIONS,
    # A whole state on another device: the inputs are not on it.
    setting("state", lambda a: SelectorState(*(t.to(META) for t in vars(a["state"]).values())),
            ("rewards",), "state-meta"),
    *values("config", [{"keep_ratio": 0.4}, 0.4]),
    *values("backend", ["gpu", None]),
]


@st.composite
def topk_args(draw):
    batch = draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    energy = torch.rand(batch, generator=gen) * (torch.rand(batch, generator=gen) < 0.7)
    return dict(energy=energy, k=draw(st.integers(1, batch)),
                noise_scale=draw(st.sampled_from([0.0, 0.05])), seed=draw(st.integers(0, 99)),
                step=draw(st.sampled_from([None, torch.tensor([3, 0])])))


TOPK_MUTATIONS = [
    *tensor_mutations("energy", (torch.float32,), meta=False),
    setting("energy", lambda a: a["energy"][:0], id="energy-empty"),
    setting("k", lambda a: a["energy"].shape[0] + 1, id="k-past-B"),
    *values("k", [0, -1, True, 1.0, "1", None]),
    *values("noise_scale", [-0.1, float("inf"), float("nan"), "0.1", None]),
    *values("seed", [-1, 2**32, 1.5, True, None]),
    # Any int64 tensor with an element keys the stream (its first); extra dimensions are fine.
    *tensor_mutations("step", (torch.int64,), extra_dim=False, default=step_zero),
    setting("step", lambda a: torch.zeros(0, dtype=torch.int64), id="step-empty"),
    *values("step", [0, [0]]),
    *values("backend", ["gpu"]),
]


@st.composite
def predict_args(draw):
    n, k, d = draw(st.integers(1, 20)), draw(st.integers(1, 9)), draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return dict(query_emb=torch.randn(n, d, generator=gen),
                ref_emb=torch.randn(k, d, generator=gen), ref_pass=torch.rand(k, generator=gen),
                attention_tau=draw(st.sampled_from([0.5, 1.0])))


PREDICT_MUTATIONS = [
    *tensor_mutations("query_emb", (torch.float32, torch.bfloat16, torch.float16), meta=False),
    setting("query_emb", lambda a: a["query_emb"][:, :0], id="query_emb-d0"),
    *tensor_mutations("ref_emb", (torch.float32,)),
    setting("ref_emb", lambda a: a["ref_emb"][:, :-1], id="ref_emb-other-d"),
    Mutation("ref_emb-K0", ("ref_emb",),
             lambda a: {**a, "ref_emb": a["ref_emb"][:0], "ref_pass": a["ref_pass"][:0]}),
    *tensor_mutations("ref_pass", FLOATS),
    setting("ref_pass", lambda a: resized(a["ref_pass"], a["ref_pass"].shape[0] + 1),
            id="ref_pass-longer"),
    *values("attention_tau", [0.0, -1.0, float("inf"), "1", None]),
    *values("backend", ["gpu", "cuda_emulated"]),
]


@st.composite
def sampler_args(draw):
    size = draw(st.integers(1, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return dict(predicted=torch.rand(size, generator=gen), n=draw(st.integers(1, size)),
                tau=0.1, seed=draw(st.integers(0, 99)),
                step=draw(st.sampled_from([None, torch.tensor([2])])),
                eligible=draw(st.sampled_from([None, torch.rand(size, generator=gen) < 0.5])))


SAMPLER_MUTATIONS = [
    *tensor_mutations("predicted", FLOATS, meta=False),
    setting("n", lambda a: a["predicted"].shape[0] + 1, id="n-past-N"),
    *values("n", [0, True, 2.0]),
    *values("tau", [0.0, float("nan"), "0.1"]),
    *values("seed", [-1, 2**32, 0.5]),
    *tensor_mutations("step", (torch.int64,), extra_dim=False, default=step_zero),
    *tensor_mutations("eligible", (torch.bool,),
                      default=lambda a: torch.ones_like(a["predicted"], dtype=torch.bool)),
    setting("eligible", lambda a: torch.ones(a["predicted"].shape[0] + 1, dtype=torch.bool),
            id="eligible-longer"),
]


@st.composite
def calibration_args(draw):
    size = draw(st.integers(1, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return dict(predicted=torch.rand(size, generator=gen), actual=torch.rand(size, generator=gen))


CALIBRATION_MUTATIONS = [
    *tensor_mutations("predicted", FLOATS, meta=False),
    setting("predicted", lambda a: a["predicted"][:0], id="predicted-empty"),
    *tensor_mutations("actual", FLOATS),
    setting("actual", lambda a: resized(a["actual"], a["actual"].shape[0] + 1), id="actual-longer"),
]


@st.composite
def apply_calibration_args(draw):
    size = draw(st.integers(1, 30))
    return dict(pred=torch.rand(size), slope=draw(st.sampled_from([1.5, torch.tensor(0.5)])),
                intercept=draw(st.sampled_from([0.1, torch.tensor(-0.2)])))


APPLY_CALIBRATION_MUTATIONS = [
    *tensor_mutations("pred", FLOATS, meta=False),
    *values("slope", [None, "2", torch.ones(2), torch.tensor(2)]),
    *values("intercept", [None, torch.zeros(1), torch.tensor(True)]),
]


@st.composite
def allocation_args(draw):
    batch = draw(st.integers(1, 20))
    return dict(scores=torch.rand(batch), total=draw(st.integers(2 * batch, 32 * batch)),
                tau=0.2, n_min=2, n_max=32)


ALLOCATION_MUTATIONS = [
    # Prompt ids (int64) are the likeliest mistake: LZESelector.allocate_rollouts takes them.
    *tensor_mutations("scores", FLOATS, meta=False),
    setting("scores", lambda a: a["scores"][:0], id="scores-empty"),
    setting("total", lambda a: 32 * a["scores"].shape[0] + 1, id="total-over-budget"),
    setting("total", lambda a: 2 * a["scores"].shape[0] - 1, id="total-under-budget"),
    *values("total", [64.0, None]),
    *values("tau", [0.0, "0.2"]),
    *values("n_min", [-1, 2.0]),
    *values("n_max", [0, None]),
]


@st.composite
def reward_args(draw):
    return {k: v for k, v in draw(step_args()).items() if k in ("rewards", "valid")}


REWARD_MUTATIONS = [
    # One tensor on another device is no mismatch; valid beside it is ("valid-meta").
    *tensor_mutations("rewards", FLOATS, meta=False),
    setting("rewards", lambda a: a["rewards"][0], id="rewards-1d"),
    *[m for m in STEP_INPUT_MUTATIONS if m.id.startswith("valid")],
]


# ----------------------------------------------------------------------------- the checks


def snapshot(state):
    return [t.clone() for t in (state.records, state.step_counter, state.fault)]


def assert_unchanged(state, before):
    after = (state.records, state.step_counter, state.fault)
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the state changed"


# Backends whose kernels run interpreted or emulated here: a call costs tens of milliseconds.
SLOW_BACKENDS = ("triton", "cuda_emulated")


def check_refused(call, args, mutation, state=None, intact=True):
    """``call(**bad)`` raises an error naming the argument before it touches ``state``; the
    intact call runs (``intact``: on the slow backends every drawn argument set is run by
    test_drawn_arguments_run, once, not once a mutation)."""
    before = snapshot(state) if state is not None else None
    bad = mutation.apply(args)
    pattern = "|".join(re.escape(name) for name in mutation.names)
    with pytest.raises((ValueError, TypeError), match=rf"^({pattern}): "):
        call(**bad)
    if state is not None:
        assert_unchanged(state, before)
    if intact:
        call(**args)


def ids(mutations):
    return [pytest.param(m, id=m.id) for m in mutations]


@pytest.mark.parametrize("mutation", ids(LZE_UPDATE_MUTATIONS))
@pytest.mark.parametrize("backend", STEP_BACKENDS)
@EXAMPLES
@given(args=step_args())
def test_lze_update_refuses_bad_arguments(backend, mutation, args):
    args = {"backend": backend, **args}
    check_refused(ops.lze_update, args, mutation, args["state"],
                  intact=backend not in SLOW_BACKENDS)


@pytest.mark.parametrize("mutation", ids(STEP_INPUT_MUTATIONS))
@pytest.mark.parametrize("backend", STEP_BACKENDS)
@EXAMPLES
@given(args=step_args())
def test_selector_step_refuses_bad_arguments(backend, mutation, args):
    selector = LZESelector(args["state"].num_prompts, backend=backend)
    step = lambda rewards, prompt_ids, valid, state: selector.step(rewards, prompt_ids, valid)
    check_refused(step, args, mutation, selector.state, intact=backend not in SLOW_BACKENDS)


@pytest.mark.parametrize("op,strategy,mutation,backend", [
    pytest.param(op, strategy, m, backend.values[0], marks=backend.marks,
                 id=f"{op.__name__}-{backend.id}-{m.id}")
    for op, strategy, mutations, backends in (
        (ops.topk_mask, topk_args, TOPK_MUTATIONS, STEP_BACKENDS),
        (ops.predict_pass_rates, predict_args, PREDICT_MUTATIONS, PREDICT_BACKENDS))
    for backend in backends for m in mutations])
@EXAMPLES
@given(data=st.data())
def test_backend_ops_refuse_bad_arguments(op, strategy, mutation, backend, data):
    check_refused(op, {"backend": backend, **data.draw(strategy())}, mutation,
                  intact=backend not in SLOW_BACKENDS)


@pytest.mark.parametrize("op,strategy,backend", [
    pytest.param(op, strategy, backend.values[0], marks=backend.marks,
                 id=f"{name}-{backend.id}")
    for name, op, strategy, backends in (
        ("lze_update", ops.lze_update, step_args, STEP_BACKENDS),
        ("selector_step", None, step_args, STEP_BACKENDS),
        ("topk_mask", ops.topk_mask, topk_args, STEP_BACKENDS),
        ("predict_pass_rates", ops.predict_pass_rates, predict_args, PREDICT_BACKENDS))
    for backend in backends])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_drawn_arguments_run(op, strategy, backend, data):
    """The argument sets the refusal tests draw are accepted as they are, on every backend: a
    refusal is the mutation's doing (on the fast backends each refusal test also runs them)."""
    args = data.draw(strategy())
    if op is None:
        LZESelector(args["state"].num_prompts, backend=backend).step(
            args["rewards"], args["prompt_ids"], args["valid"])
    else:
        op(**{"backend": backend, **args})


@pytest.mark.parametrize("op,strategy,mutation", [
    *[pytest.param(ops.sample_near_half, sampler_args, m, id=f"sample_near_half-{m.id}")
      for m in SAMPLER_MUTATIONS],
    *[pytest.param(ops.calibrate_linear, calibration_args, m, id=f"calibrate_linear-{m.id}")
      for m in CALIBRATION_MUTATIONS],
    *[pytest.param(ops.apply_calibration, apply_calibration_args, m,
                   id=f"apply_calibration-{m.id}") for m in APPLY_CALIBRATION_MUTATIONS],
    *[pytest.param(ops.allocate_rollouts_by_score, allocation_args, m,
                   id=f"allocate_rollouts_by_score-{m.id}") for m in ALLOCATION_MUTATIONS],
    *[pytest.param(op, reward_args, m, id=f"{op.__name__}-{m.id}")
      for op in (ops.group_stats, ops.grpo_advantages, ops.dapo_keep_mask)
      for m in REWARD_MUTATIONS],
])
@EXAMPLES
@given(data=st.data())
def test_pytorch_ops_refuse_bad_arguments(op, strategy, mutation, data):
    check_refused(op, data.draw(strategy()), mutation)


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "4", None])
def test_new_state_refuses_a_bad_size(value):
    with pytest.raises(ValueError, match=r"^num_prompts: "):
        ops.new_state(value)


@pytest.mark.parametrize("value", [0.0, -1e-6, "1e-6"])
def test_grpo_advantages_refuses_a_bad_eps(value):
    with pytest.raises(ValueError, match=r"^eps: "):
        ops.grpo_advantages(torch.rand(3, 4), eps=value)


@pytest.mark.parametrize("mutation", ids(STATE_MUTATIONS))
def test_raise_if_faulted_refuses_a_bad_state(mutation):
    args = dict(rewards=torch.rand(2, 2), prompt_ids=torch.arange(2), state=ops.new_state(4),
                valid=None)
    check_refused(lambda state, **_: ops.raise_if_faulted(state), args, mutation, args["state"])


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("method", ["rollout_mask", "allocate_rollouts"])
@pytest.mark.parametrize("mutation", ids(
    [*tensor_mutations("prompt_ids", (torch.int64,)),
     setting("prompt_ids", lambda a: a["prompt_ids"][:0], id="prompt_ids-empty")]))
def test_selector_id_lookups_refuse_bad_ids(backend, method, mutation):
    selector = LZESelector(10, backend=backend)
    call = lambda prompt_ids: (selector.rollout_mask(prompt_ids) if method == "rollout_mask"
                               else selector.allocate_rollouts(prompt_ids, total=32))
    check_refused(call, {"prompt_ids": torch.arange(4)}, mutation, selector.state)


# ----------------------------------------------------------------------------- accepted input


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@EXAMPLES
@given(args=step_args(with_valid=True))
def test_strided_inputs_are_copied(backend, args):
    """Non-contiguous rewards, ids and valid give what their contiguous copies give."""
    state = args["state"]
    strided_state = SelectorState(*snapshot(state))
    want = ops.lze_update(**args, backend=backend)
    got = ops.lze_update(strided(args["rewards"]), strided(args["prompt_ids"]), strided_state,
                         strided(args["valid"]), backend=backend)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_unchanged(strided_state, snapshot(state))


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_device_faults_skip_the_row_and_are_raised_once(backend, data):
    """Ids past the state (either side, up to int64's range) and NaN/inf or out-of-range rewards
    pass the host checks; the kernels skip those rows, leave their state rows alone, and
    ``raise_if_faulted`` raises the recorded faults once, naming the argument."""
    args = data.draw(step_args())
    n, batch = args["state"].num_prompts, args["rewards"].shape[0]
    row = data.draw(st.integers(0, batch - 1))
    kind = data.draw(st.sampled_from(["id", "reward"]))
    rewards, prompt_ids = args["rewards"].clone(), args["prompt_ids"].clone()
    if kind == "id":
        prompt_ids[row] = data.draw(st.sampled_from([n, n + 1, -1, 2**31, -2**31 - 1, 2**62,
                                                     -2**63]))
    else:
        rewards[row, 0] = data.draw(st.sampled_from([float("nan"), float("inf"), -0.5, 1.5]))
        if args["valid"] is not None:
            args["valid"][row, 0] = True
    before = snapshot(args["state"])
    ops.lze_update(rewards, prompt_ids, args["state"], args["valid"], backend=backend)
    others = torch.ones(n + 1, dtype=torch.bool)  # rows no good row of the batch may write
    others[prompt_ids[torch.arange(batch) != row]] = False
    others[n] = False  # the reference's write sink (layout.SelectorState.empty)
    state = args["state"]
    assert torch.equal(state.records[others], before[0][others])  # the bad row wrote nothing
    expected = "prompt_ids" if kind == "id" else "rewards"
    with pytest.raises(ValueError, match=rf"{expected}: expected"):
        ops.raise_if_faulted(state)
    ops.raise_if_faulted(state)  # cleared once raised
    assert int(state.fault[0]) == 0


def test_ops_module_documents_the_fault_check():
    assert "raise_if_faulted" in ops.__all__ and "raise_if_faulted" in ops.lze_update.__doc__
    assert L.FAULT_MESSAGES  # every fault bit has a message that names its argument
    assert all(re.match(r"^(prompt_ids|rewards): expected", m) for m in L.FAULT_MESSAGES.values())


def test_checks_read_metadata_only():
    """The checked ops trace with torch.compile(fullgraph=True) (a value read would break the
    graph) and run on fake tensors, which have no values at all."""
    torch._dynamo.reset()

    def update_and_select(rewards, prompt_ids, valid, state):
        stats = ops.lze_update(rewards, prompt_ids, state, valid, backend="torch")
        return ops.topk_mask(stats.energy, 3, 0.05, 7, state.step_counter, backend="torch")

    gen = torch.Generator().manual_seed(0)
    inputs = ((torch.rand(8, 4, generator=gen) < 0.5).float(),
              torch.randperm(50, generator=gen)[:8], torch.rand(8, 4, generator=gen) < 0.8)
    state, twin = ops.new_state(50), ops.new_state(50)
    compiled = torch.compile(update_and_select, fullgraph=True, backend="eager")
    got, want = compiled(*inputs, state), update_and_select(*inputs, twin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with FakeTensorMode():
        selection = update_and_select(torch.rand(8, 4), torch.randperm(50)[:8],
                                      torch.rand(8, 4) < 0.8, ops.new_state(50))
        assert selection.kept_indices.shape == (3,)

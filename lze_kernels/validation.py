"""Input checks with errors that name the argument and what was expected.

Two tiers. The structural checks (``check_*_structure``, :func:`check_state`, :func:`check_topk`
and the DOTS checks) read only tensor metadata (shape, dtype, device, contiguity) and host
scalars, cost no device sync and always run before a kernel gets a raw pointer: every public op
and the selector call them. Values (id range, distinct ids, finite rewards in [0, 1]) are checked
by the kernels themselves, on the device: they skip a bad row and record its fault bits in
``state.fault``. A checked selector step reads that word once after the step (its one sync) and
undoes the step on a fault (``LZESelector.step``); :func:`raise_if_faulted` turns the faults of
unchecked steps into the same errors later. :func:`check_prompt_id_values` checks ids on the
host for the calls that have no kernel (pruner, rollout budget).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import layout as L

FLOAT_DTYPES = tuple(L.REWARD_DTYPE_CODES)
ANY_FLOAT_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(x, name: str, dtypes, ndim: int, device: Optional[torch.device]) -> None:
    """A tensor of ``ndim`` dimensions, one of ``dtypes``, on ``device`` (None: any device)."""
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__)
    if x.dim() != ndim:
        _fail(name, f"a {ndim}-D tensor", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        _fail(name, f"dtype in {[str(d) for d in dtypes]}", x.dtype)
    if device is not None and x.device != device:
        _fail(name, f"a tensor on {device}", f"one on {x.device}")


RECORD_ALIGNMENT = 16  # bytes: a record is read as two 16-byte vectors


def check_state(state) -> None:
    """A :class:`~lze_kernels.layout.SelectorState` the kernels can index and write in place:
    ``records [N + 1, 8]`` int32 with N >= 1, ``step_counter [2]`` int64 and ``fault [1]``
    int32, all contiguous and on one device (metadata only; the compiled backends also check the
    records' alignment, :func:`check_records_alignment`)."""
    if not isinstance(state, L.SelectorState):
        _fail("state", "a SelectorState (ops.new_state)", type(state).__name__)
    check_tensor(state.records, "state.records", (torch.int32,), 2, None)
    rows, device = state.records.shape[0], state.records.device
    if rows < 2:
        _fail("state.records", "N + 1 >= 2 rows (num_prompts >= 1)", f"{rows} rows")
    expected = {"records": (torch.int32, (rows, L.RECORD_WORDS)),
                "step_counter": (torch.int64, (2,)), "fault": (torch.int32, (1,))}
    for field, (dtype, shape) in expected.items():
        name, tensor = f"state.{field}", getattr(state, field)
        check_tensor(tensor, name, (dtype,), len(shape), device)
        if tuple(tensor.shape) != shape:
            _fail(name, f"shape {shape}", f"shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():  # the kernels write it in place through its pointer
            _fail(name, "a contiguous tensor", "a strided view")


def check_records_alignment(records: torch.Tensor) -> None:
    """The records' data 16-byte aligned, as the kernels read and write a record as two 16-byte
    vectors (a misaligned one is a "misaligned address" fault on a GPU, which ends the CUDA
    context). Reads the address: called where the tensors have data (the ops' kernels' side)."""
    misalignment = records.data_ptr() % RECORD_ALIGNMENT
    if misalignment:
        _fail("state.records", f"data aligned to {RECORD_ALIGNMENT} bytes (ops.new_state's "
              "are)", f"an address {misalignment} bytes past it")


def check_prompt_ids_structure(prompt_ids, device: torch.device, batch: Optional[int] = None):
    check_tensor(prompt_ids, "prompt_ids", (torch.int64,), 1, device)
    if batch is not None and prompt_ids.shape[0] != batch:
        _fail("prompt_ids", f"shape ({batch},) matching rewards' B", f"{tuple(prompt_ids.shape)}")
    if prompt_ids.shape[0] == 0:
        _fail("prompt_ids", "at least one prompt (B >= 1)", "B = 0")


def check_rewards_structure(rewards, valid, device: Optional[torch.device],
                            dtypes=ANY_FLOAT_DTYPES) -> None:
    """``rewards [B, G]`` of one of ``dtypes`` and ``valid`` (None or ``[B, G]`` bool) on
    ``device`` (None: ``rewards``' device)."""
    check_tensor(rewards, "rewards", dtypes, 2, device)
    device = rewards.device
    if valid is not None:
        check_tensor(valid, "valid", (torch.bool,), 2, device)
        if valid.shape != rewards.shape:
            _fail("valid", f"shape {tuple(rewards.shape)} like rewards", tuple(valid.shape))


def check_step_structure(rewards, prompt_ids, valid, device: torch.device,
                         num_prompts: int) -> None:
    """Shapes, dtypes and devices of one step's inputs over a state of ``num_prompts`` prompts
    (metadata only: no sync). B distinct ids in [0, N) need B <= N."""
    check_rewards_structure(rewards, valid, device, FLOAT_DTYPES)
    batch, group = rewards.shape
    if batch == 0:
        _fail("rewards", "at least one prompt group (B >= 1)", "B = 0")
    if group == 0:
        _fail("rewards", "at least one rollout per group (G >= 1)", "G = 0")
    check_prompt_ids_structure(prompt_ids, device, batch)
    if batch > num_prompts:
        _fail("prompt_ids", f"at most num_prompts = {num_prompts} distinct ids", f"B = {batch}")


def check_topk(energy, k, noise_scale, seed, step) -> None:
    """``energy [B]`` fp32 with B >= 1 (the kernels read fp32), ``k`` in [1, B], a finite
    ``noise_scale >= 0``, a 32-bit ``seed`` and ``step`` None or an int64 tensor on ``energy``'s
    device."""
    check_tensor(energy, "energy", (torch.float32,), 1, None)
    size = energy.shape[0]
    if size == 0:
        _fail("energy", "at least one group (B >= 1)", "B = 0")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= size:
        _fail("k", f"an int in [1, {size}]", repr(k))
    if not isinstance(noise_scale, (int, float)) or isinstance(noise_scale, bool) \
            or not 0 <= noise_scale < float("inf"):
        _fail("noise_scale", "a finite float >= 0", repr(noise_scale))
    check_seed(seed)
    check_step_tensor(step, energy.device)


def check_seed(seed) -> None:
    """A seed of the Philox streams: an int in [0, 2**32)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        _fail("seed", "an int in [0, 2**32)", repr(seed))


def check_step_tensor(step, device: torch.device) -> None:
    """None, or an int64 tensor with at least one element on ``device`` (its first element keys
    a noise stream; the kernels read it through a pointer)."""
    if step is None:
        return
    if not isinstance(step, torch.Tensor):
        _fail("step", "an int64 tensor", type(step).__name__)
    if step.dtype != torch.int64 or step.numel() < 1 or step.device != device:
        _fail("step", f"an int64 tensor with at least one element on {device}",
              f"{step.dtype} of shape {tuple(step.shape)} on {step.device}")


def check_rollout_scores(scores) -> None:
    """``scores [B]`` float with B >= 1. Integer tensors are refused: they are prompt ids, which
    :meth:`LZESelector.allocate_rollouts <lze_kernels.LZESelector.allocate_rollouts>` takes."""
    if isinstance(scores, torch.Tensor) and not scores.is_floating_point():
        _fail("scores", "float scores (energies, not prompt ids: LZESelector.allocate_rollouts "
                        "takes ids)", scores.dtype)
    check_tensor(scores, "scores", ANY_FLOAT_DTYPES, 1, None)
    if scores.shape[0] == 0:
        _fail("scores", "at least one prompt (B >= 1)", "B = 0")


def check_prompt_id_values(prompt_ids: torch.Tensor, num_prompts: int, distinct: bool) -> None:
    """Ids in [0, N) and, for a training step, distinct. Synchronises."""
    low, high = int(prompt_ids.min()), int(prompt_ids.max())
    if low < 0 or high >= num_prompts:
        _fail("prompt_ids", f"ids in [0, {num_prompts})", f"ids in [{low}, {high}]")
    if distinct and torch.unique(prompt_ids).numel() != prompt_ids.numel():
        _fail("prompt_ids", "distinct ids within one step", "duplicates")


# How a step's faults reached the error (raise_for_faults's ``found``).
FOUND_BY = {
    "now": "found by this step or an earlier unchecked one; this step was undone, the state is "
           "as before",
    "later": "found by an earlier step on the device, whose bad rows were skipped (its other "
             "rows were applied); this step did not run",
    "unchecked": "rows skipped by a step run without value checks: check_inputs=False, or "
                 "ops.lze_update",
}


def raise_for_faults(fault_bits: int, num_prompts: int, found: str = "unchecked") -> None:
    """Raise the error of the fault bits the kernels recorded (no-op for 0), saying how they
    were found (:data:`FOUND_BY`)."""
    if fault_bits:
        problems = "; ".join(msg.format(num_prompts=num_prompts)
                             for bit, msg in L.FAULT_MESSAGES.items() if fault_bits & bit)
        raise ValueError(f"{problems} ({FOUND_BY[found]})")


def raise_if_faulted(state: L.SelectorState) -> None:
    """Raise (and clear) the faults that unchecked steps recorded in ``state.fault``: ids past
    the state, duplicate ids, NaN/inf rewards, rewards outside [0, 1]. Synchronises once."""
    check_state(state)
    bits = int(state.fault[0])
    if bits:
        state.fault.zero_()
        raise_for_faults(bits, state.num_prompts)


def check_rollout_budget(batch: int, total, tau, n_min, n_max) -> None:
    """Host ints of a rollout-budget request (docs/spec.md §6): B n_min <= total <= B n_max."""
    if not isinstance(n_min, int) or n_min < 0:
        raise ValueError(f"n_min: expected an int >= 0, got {n_min!r}")
    if not isinstance(n_max, int) or n_max < max(n_min, 1):
        raise ValueError(f"n_max: expected an int >= max(n_min, 1), got {n_max!r}")
    if not isinstance(total, int) or not batch * n_min <= total <= batch * n_max:
        raise ValueError(f"total: expected an int in [B*n_min, B*n_max] = "
                         f"[{batch * n_min}, {batch * n_max}], got {total!r}")
    if not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau: expected a float > 0, got {tau!r}")


def check_unit_interval(name: str, value) -> None:
    """A float hyper-parameter in [0, 1]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        _fail(name, "a float in [0, 1]", value)


def check_positive_float(name: str, value) -> None:
    """A finite host float > 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or value == float("inf"):
        _fail(name, "a finite float > 0", repr(value))


def check_dots_prediction(query_emb, ref_emb, ref_pass, attention_tau) -> None:
    """Structure of a DOTS prediction (docs/spec.md §8): ``query_emb [N, d]``, ``ref_emb [K, d]``
    of the same float dtype with K >= 1, ``ref_pass [K]`` float, one device,
    ``attention_tau > 0``."""
    check_tensor(query_emb, "query_emb", FLOAT_DTYPES, 2, None)
    device = query_emb.device
    check_tensor(ref_emb, "ref_emb", (query_emb.dtype,), 2, device)
    check_tensor(ref_pass, "ref_pass", ANY_FLOAT_DTYPES, 1, device)
    if query_emb.shape[1] == 0:
        _fail("query_emb", "embeddings of dimension d >= 1", f"shape {tuple(query_emb.shape)}")
    if ref_emb.shape[0] == 0:
        _fail("ref_emb", "at least one reference (K >= 1)", "K = 0")
    if ref_emb.shape[1] != query_emb.shape[1]:
        _fail("ref_emb", f"dimension d = {query_emb.shape[1]} like query_emb",
              f"shape {tuple(ref_emb.shape)}")
    if ref_pass.shape[0] != ref_emb.shape[0]:
        _fail("ref_pass", f"shape ({ref_emb.shape[0]},) matching ref_emb's K",
              f"{tuple(ref_pass.shape)}")
    check_positive_float("attention_tau", attention_tau)


def check_calibration_points(predicted, actual) -> None:
    """``predicted [K]`` and ``actual [K]`` float tensors on one device, K >= 1."""
    check_tensor(predicted, "predicted", ANY_FLOAT_DTYPES, 1, None)
    check_tensor(actual, "actual", ANY_FLOAT_DTYPES, 1, predicted.device)
    if predicted.shape[0] == 0:
        _fail("predicted", "at least one point (K >= 1)", "K = 0")
    if actual.shape != predicted.shape:
        _fail("actual", f"shape {tuple(predicted.shape)} like predicted", tuple(actual.shape))


def check_calibration(pred, slope, intercept) -> None:
    """``pred [N]`` float; ``slope`` and ``intercept`` host floats or 0-dim float tensors."""
    check_tensor(pred, "pred", ANY_FLOAT_DTYPES, 1, None)
    for name, value in (("slope", slope), ("intercept", intercept)):
        if isinstance(value, torch.Tensor):
            check_tensor(value, name, ANY_FLOAT_DTYPES, 0, None)
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            _fail(name, "a float or a 0-dim float tensor", type(value).__name__)


def check_near_half_sampling(predicted, n, tau, seed, step, eligible) -> None:
    """Structure of a DOTS draw: ``predicted [N]`` float, ``n`` in [1, N], ``tau > 0``, a
    32-bit ``seed``, ``step`` an int64 tensor with >= 1 element and ``eligible [N]`` bool, all
    on ``predicted``'s device."""
    check_tensor(predicted, "predicted", ANY_FLOAT_DTYPES, 1, None)
    device = predicted.device
    size = predicted.shape[0]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= size:
        _fail("n", f"an int in [1, {size}] (the number of prompts)", repr(n))
    check_positive_float("tau", tau)
    check_seed(seed)
    check_step_tensor(step, device)
    if eligible is not None:
        check_tensor(eligible, "eligible", (torch.bool,), 1, device)
        if eligible.shape[0] != size:
            _fail("eligible", f"shape ({size},) like predicted", tuple(eligible.shape))

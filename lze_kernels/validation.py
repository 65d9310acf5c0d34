"""Input checks with errors that name the argument and what was expected.

Two tiers. :func:`check_step_structure` reads only tensor metadata (shape, dtype, device), costs
no device sync and always runs. :func:`check_step_values` reads values (id range, distinct ids,
finite rewards in [0, 1]) and so synchronises; it runs when ``check_inputs=True``. With value
checks off, the kernels detect the same faults on the device, skip the bad rows and record fault
bits that :func:`raise_for_faults` turns into the same errors later.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import layout as L

FLOAT_DTYPES = tuple(L.REWARD_DTYPE_CODES)
ANY_FLOAT_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(x, name: str, dtypes, ndim: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__)
    if x.dim() != ndim:
        _fail(name, f"a {ndim}-D tensor", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        _fail(name, f"dtype in {[str(d) for d in dtypes]}", x.dtype)
    if x.device != device:
        _fail(name, f"a tensor on {device}", f"one on {x.device}")


def check_prompt_ids_structure(prompt_ids, device: torch.device, batch: Optional[int] = None):
    check_tensor(prompt_ids, "prompt_ids", (torch.int64,), 1, device)
    if batch is not None and prompt_ids.shape[0] != batch:
        _fail("prompt_ids", f"shape ({batch},) matching rewards' B", f"{tuple(prompt_ids.shape)}")
    if prompt_ids.shape[0] == 0:
        _fail("prompt_ids", "at least one prompt (B >= 1)", "B = 0")


def check_step_structure(rewards, prompt_ids, valid, device: torch.device) -> None:
    """Shapes, dtypes and devices of one step's inputs (metadata only: no sync)."""
    check_tensor(rewards, "rewards", FLOAT_DTYPES, 2, device)
    batch, group = rewards.shape
    if batch == 0:
        _fail("rewards", "at least one prompt group (B >= 1)", "B = 0")
    if group == 0:
        _fail("rewards", "at least one rollout per group (G >= 1)", "G = 0")
    check_prompt_ids_structure(prompt_ids, device, batch)
    if valid is not None:
        check_tensor(valid, "valid", (torch.bool,), 2, device)
        if valid.shape != rewards.shape:
            _fail("valid", f"shape {tuple(rewards.shape)} like rewards", tuple(valid.shape))


def check_prompt_id_values(prompt_ids: torch.Tensor, num_prompts: int, distinct: bool) -> None:
    """Ids in [0, N) and, for a training step, distinct. Synchronises."""
    low, high = int(prompt_ids.min()), int(prompt_ids.max())
    if low < 0 or high >= num_prompts:
        _fail("prompt_ids", f"ids in [0, {num_prompts})", f"ids in [{low}, {high}]")
    if distinct and torch.unique(prompt_ids).numel() != prompt_ids.numel():
        _fail("prompt_ids", "distinct ids within one step", "duplicates")


def check_step_values(rewards, prompt_ids, valid, num_prompts: int) -> None:
    """Value checks of one step's inputs. Synchronises (used when ``check_inputs=True``)."""
    check_prompt_id_values(prompt_ids, num_prompts, distinct=True)
    r = rewards.float()
    if valid is not None:
        r = torch.where(valid, r, 0.0)  # padded entries may hold anything
    if not bool(torch.isfinite(r).all()):
        _fail("rewards", "finite values", "NaN or inf")
    if bool(((r < 0) | (r > 1)).any()):
        low, high = float(r.min()), float(r.max())
        _fail("rewards", "values in [0, 1]", f"values in [{low}, {high}]")


def raise_for_faults(fault_bits: int) -> None:
    """Raise the error of the fault bits the kernels recorded (no-op for 0)."""
    if fault_bits:
        problems = "; ".join(msg for bit, msg in L.FAULT_MESSAGES.items() if fault_bits & bit)
        raise ValueError(
            f"a step run with check_inputs=False skipped rows with bad input: {problems}"
        )


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


def _check_positive_float(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or value == float("inf"):
        _fail(name, "a finite float > 0", repr(value))


def check_dots_prediction(query_emb, ref_emb, ref_pass, attention_tau) -> None:
    """Structure of a DOTS prediction (docs/spec.md §8): ``query_emb [N, d]``, ``ref_emb [K, d]`` of the
    same float dtype with K >= 1, ``ref_pass [K]`` float, one device, ``attention_tau > 0``."""
    if not isinstance(query_emb, torch.Tensor):
        _fail("query_emb", "a torch.Tensor", type(query_emb).__name__)
    device = query_emb.device
    check_tensor(query_emb, "query_emb", FLOAT_DTYPES, 2, device)
    check_tensor(ref_emb, "ref_emb", (query_emb.dtype,), 2, device)
    check_tensor(ref_pass, "ref_pass", ANY_FLOAT_DTYPES, 1,
                 device)
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
    _check_positive_float("attention_tau", attention_tau)


def check_calibration_points(predicted, actual) -> None:
    """``predicted [K]`` and ``actual [K]`` float tensors on one device, K >= 1."""
    if not isinstance(predicted, torch.Tensor):
        _fail("predicted", "a torch.Tensor", type(predicted).__name__)
    check_tensor(predicted, "predicted", ANY_FLOAT_DTYPES, 1, predicted.device)
    check_tensor(actual, "actual", ANY_FLOAT_DTYPES, 1, predicted.device)
    if predicted.shape[0] == 0:
        _fail("predicted", "at least one point (K >= 1)", "K = 0")
    if actual.shape != predicted.shape:
        _fail("actual", f"shape {tuple(predicted.shape)} like predicted", tuple(actual.shape))


def check_near_half_sampling(predicted, n, tau, seed, step, eligible) -> None:
    """Structure of a DOTS draw: ``predicted [N]`` float, ``n`` in [1, N], ``tau > 0``, a
    32-bit ``seed``, ``step`` an int64 tensor with >= 1 element and ``eligible [N]`` bool, all
    on ``predicted``'s device."""
    if not isinstance(predicted, torch.Tensor):
        _fail("predicted", "a torch.Tensor", type(predicted).__name__)
    device = predicted.device
    check_tensor(predicted, "predicted", ANY_FLOAT_DTYPES, 1,
                 device)
    size = predicted.shape[0]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= size:
        _fail("n", f"an int in [1, {size}] (the number of prompts)", repr(n))
    _check_positive_float("tau", tau)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        _fail("seed", "an int in [0, 2**32)", repr(seed))
    if step is not None:
        if not isinstance(step, torch.Tensor):
            _fail("step", "an int64 tensor", type(step).__name__)
        if step.dtype != torch.int64 or step.numel() < 1 or step.device != device:
            _fail("step", f"an int64 tensor with at least one element on {device}",
                  f"{step.dtype} of shape {tuple(step.shape)} on {step.device}")
    if eligible is not None:
        check_tensor(eligible, "eligible", (torch.bool,), 1, device)
        if eligible.shape[0] != size:
            _fail("eligible", f"shape ({size},) like predicted", tuple(eligible.shape))

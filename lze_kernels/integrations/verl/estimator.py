"""LZE selection as a verl advantage estimator (verl's legacy ``RayPPOTrainer``); verl itself is
imported only by ``register``.

verl's trainer calls an advantage estimator once per step with the flat batch of ``bs`` responses:
``token_level_rewards`` [bs, T], ``response_mask`` [bs, T] and ``index``, the ``uid`` of each
response's prompt (a numpy object array of strings, or a tensor), plus ``epsilon``,
``norm_adv_by_std_in_grpo`` or an algorithm ``config`` holding it. :class:`LZEAdvantage` takes
exactly that, returns verl's ``(advantages, returns)`` [bs, T] and keeps a per-response
``keep_mask`` of the whole groups the selection method kept (``adapter.last``).

Group statistics, advantages, energy, the state update and the top-k run in the fused kernels on
a ``[B, G_max]`` layout. Besides the two ``[bs, T]`` passes verl's contract needs (the response
scores and the masked broadcast, which allocates only the output), the host work is O(bs) with
small constants: :func:`group_by_uid` (neighbour runs, one dict of uids, a radix placement when
the uids come shuffled) and a few gathers; uids that arrive grouped need no placement at all
(the scores are viewed as ``[B, G]``). Groups are numbered in order of first appearance. verl
makes a fresh ``uid`` per prompt per step (``uuid4`` in ``fit``), so uids
group responses but cannot key LZE's per-prompt state: the stable id is the dataset row,
``non_tensor_batch["index"]`` (from ``extra_info["index"]`` in verl's RLHF dataset). Pass it as
``prompt_index``, :meth:`LZEAdvantage.bind` it before verl calls the estimator, or let
:meth:`LZEAdvantage.bind_uids` map each step's uids to their rows and prompts (verl's registry
call forwards only the uids; :class:`~lze_kernels.integrations.verl.legacy.LZERayPPOTrainer`
binds them where ``fit`` makes them). Every LZE step refuses rows that cannot be right, before
the selector steps (:func:`~.rows.check_repeated_rows`): rows outside ``[0, num_prompts)``,
groups of one row with different prompts (their prompts given: ``bind_uids`` always has them),
and, where the prompts are not given, every group at one row.

In verl's legacy trainer, :class:`~lze_kernels.integrations.verl.legacy.LZERayPPOTrainer` runs
the selection (:meth:`LZEAdvantage.select`) where the rewards are first known, cuts the batch to
the kept groups before any log-prob pass, and announces them (:meth:`LZEAdvantage.expect_selected`):
the registry call then computes verl's GRPO advantages of those groups alone. Called directly on
a whole batch, the estimator selects and, with ``zero_dropped=True``, zeroes the advantages of the
groups it drops. A dataset row that comes in two groups of one batch is one observation of that
row (:mod:`.rows`).

Advantages follow verl's ``compute_grpo_outcome_advantage`` (volcengine/verl,
``verl/trainer/ppo/core_algos.py``): scores ``s = token_level_rewards.sum(-1)``; per uid group of
n >= 2 responses ``(s - mean) / (std + epsilon)`` with the unbiased std, or ``s - mean`` when
``norm_adv_by_std_in_grpo`` is false (Dr. GRPO); a group of one response has mean 0 and std 1,
so ``s / (1 + epsilon)`` (resp. ``s``); the scalar is broadcast as ``A * response_mask``, and
returns equal advantages. (The kernels give a one-response group A = 0, docs/spec.md §2; the
adapter follows verl here.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ... import ops
from ...config import LZEConfig
from ...selector import LZESelector
from ..selection import GroupSelection, ScoreFn, check_method
from .row_table import prompt_keys
from .rows import RowSelection, check_row_range, host_rows, select_on_rows


class UidGroups(NamedTuple):
    """Where each response sits in the ``[num_groups, width]`` group layout. Groups are numbered
    in order of first appearance; inside a group, responses keep their batch order."""

    row: torch.Tensor  # [bs] int64 group of each response
    slot: torch.Tensor  # [bs] int64 position inside its group
    first: torch.Tensor  # [num_groups] int64 first response of each group
    cell: torch.Tensor  # [bs] int64 row * width + slot: the response's place in the flat layout
    width: int  # largest group size
    full: bool  # every group has ``width`` responses (the layout has no padding)
    blocked: bool  # full, and the batch is the layout row by row (uids arrive grouped)
    host_row: np.ndarray  # ``row`` as built on the host: checks read it with no device copy
    host_first: np.ndarray  # ``first`` likewise


def group_by_uid(index, device) -> UidGroups:
    """Number verl's uid groups and place each response in its group, in O(bs) host work.

    One vectorised comparison of neighbours splits the uids into runs of equal uids, and one dict
    keyed by the runs' uids (hashing; ``dict.fromkeys`` and ``map`` iterate in C: no Python
    loop, no comparison sort of the uid strings) numbers them. When every run has a new uid, the
    uids arrived grouped (as verl's ``repeat(interleave=True)`` leaves them) and run r is group
    r. Otherwise (verl's ``balance_batch`` reorders responses) the slots come from a counting
    placement: a stable radix argsort of the group numbers (numpy sorts keys of 16 bits or less
    by radix, so up to 65,536 groups; beyond, a stable merge sort)."""
    keys = _host_keys(index)
    if keys.shape[0] == 0:
        raise ValueError("index: expected one uid per response, got none")
    row, slot, first, counts, grouped = _place(keys)
    width = int(counts.max())
    full = bool(counts.min() == width)
    tensors = (torch.as_tensor(a, device=device) for a in (row, slot, first, row * width + slot))
    return UidGroups(*tensors, width, full, full and grouped, row, first)


def _place(keys: np.ndarray):
    """``(row, slot, first, counts, grouped)`` of the responses with uids ``keys``."""
    new_run = np.empty(keys.shape[0], dtype=bool)
    new_run[0] = True
    np.not_equal(keys[1:], keys[:-1], out=new_run[1:])
    starts = new_run.nonzero()[0]
    if 2 * starts.shape[0] > keys.shape[0]:  # mostly runs of one (shuffled): number the uids
        row = _numbered(keys.tolist())
    else:
        row = _numbered(keys[starts].tolist())[new_run.cumsum() - 1]
    if np.all(row[1:] >= row[:-1]):  # grouped: run r is group r
        return row, np.arange(keys.shape[0]) - starts[row], starts, np.bincount(row), True
    counts = np.bincount(row)
    return (row, *_counting_placement(row, counts), counts, False)


def _numbered(uids: list) -> np.ndarray:
    """Each uid's group number, groups numbered in order of first appearance (one dict; its
    ``fromkeys`` and ``map`` iterate in C)."""
    numbers = dict(zip(dict.fromkeys(uids), itertools.count()))
    return np.fromiter(map(numbers.__getitem__, uids), np.int64, len(uids))


def _host_keys(index) -> np.ndarray:
    if isinstance(index, torch.Tensor):
        return index.detach().reshape(-1).cpu().numpy()
    return np.asarray(index).reshape(-1)


def _counting_placement(row: np.ndarray, counts: np.ndarray):
    """``(slot, first)``: a stable argsort of the group numbers (radix for 16-bit keys) lists the
    responses group by group; a response's slot is its place in that list minus its group's
    start."""
    keys = row.astype(np.uint16) if counts.shape[0] <= 1 << 16 else row
    order = np.argsort(keys, kind="stable")
    starts = np.cumsum(counts) - counts
    slot = np.empty_like(row)
    slot[order] = np.arange(row.shape[0]) - np.repeat(starts, counts)
    return slot, order[starts]


class UidRows:
    """One step's uid -> dataset row and prompt key (verl's ``non_tensor_batch`` ``"uid"``,
    ``"index"`` and ``"raw_prompt"``, one per prompt or per response; each uid's prompt is hashed
    once)."""

    def __init__(self, uids, prompt_index, prompts=None):
        rows = host_rows(prompt_index)
        uids = _host_keys(uids)
        if uids.shape != rows.shape:
            raise ValueError(f"prompt_index: expected one dataset row per uid ({uids.shape[0]}), "
                             f"got shape {rows.shape}")
        if prompts is not None and len(prompts) != uids.shape[0]:
            raise ValueError(f"prompts: expected one prompt per uid ({uids.shape[0]}), got "
                             f"{len(prompts)}")
        last = dict(zip(uids.tolist(), range(uids.shape[0])))  # each uid's last position
        at = list(last.values())
        self._number = dict(zip(last, range(len(at))))
        self.rows = rows[at]
        self.keys = None if prompts is None else prompt_keys([prompts[i] for i in at])

    def missing(self, uids: list) -> list:
        """The uids not bound."""
        return [uid for uid in uids if uid not in self._number]

    def lookup(self, uids: list) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """``(rows, keys)`` [n] of bound ``uids`` (keys None: no prompts were bound)."""
        numbers = np.fromiter(map(self._number.__getitem__, uids), np.int64, len(uids))
        return self.rows[numbers], None if self.keys is None else self.keys[numbers]


@dataclass
class Selected:
    """One step's groups and the method's pick among them, before any advantage is computed."""

    scores: torch.Tensor  # [bs] response scores, on the estimator's device
    groups: UidGroups
    raw: torch.Tensor  # [num_groups, width] scores in the group layout
    valid: Optional[torch.Tensor]  # [num_groups, width] or None (no group is short)
    rows: RowSelection  # keep per group, the selector's output, repeated rows

    @property
    def keep_mask(self) -> torch.Tensor:
        """[bs] bool: the response's group is kept."""
        return self.rows.keep.index_select(0, self.groups.row)


@dataclass
class StepSelection:
    """What one estimator call selected (``LZEAdvantage.last``; it holds no [bs, T] tensor from
    one step to the next)."""

    keep_mask: torch.Tensor  # [bs] bool: the response's group is kept
    groups: UidGroups
    selection: GroupSelection  # per distinct dataset row: keep, num_kept, selector output


@dataclass
class VerlStep(StepSelection):
    """One estimator call: the selection plus verl's outputs."""

    advantages: torch.Tensor  # [bs, T]
    returns: torch.Tensor  # [bs, T] (= advantages, as in verl's GRPO)

    def selected(self) -> StepSelection:
        return StepSelection(self.keep_mask, self.groups, self.selection)


class LZEAdvantage:
    """verl advantage estimator with LZE (or DAPO) group selection.

    Args:
        num_prompts: dataset size N (``method="lze"``; dataset rows index its state).
        config: the selector's :class:`~lze_kernels.LZEConfig`.
        method: the selection method, ``"lze"`` (the default) or ``"dapo"`` (keep groups whose
            scores are not all equal). Plain GRPO is verl's own ``grpo`` estimator.
        device: where the selector state lives and the kernels run; results come back on the
            device of ``token_level_rewards``.
        backend: the selector's kernel backend.
        score_fn: maps a 1-D tensor of response scores to [0, 1] for LZE's pass rate (default:
            as is); advantages always use the raw scores.
        zero_dropped: zero the advantages of the groups the method drops (for a trainer that
            trains on every response it gets); False: verl's GRPO advantages for every group.
    """

    def __init__(self, num_prompts: Optional[int] = None, config: Optional[LZEConfig] = None, *,
                 method: str = "lze", device="cpu", backend: str = "auto",
                 score_fn: Optional[ScoreFn] = None, zero_dropped: bool = False):
        self.method = check_method(method)
        self.device = torch.device(device)
        self.score_fn = score_fn
        self.zero_dropped = bool(zero_dropped)
        self.selector: Optional[LZESelector] = None
        if self.method == "lze":
            self.selector = LZESelector(num_prompts, config, self.device, backend)
        self.last: Optional[StepSelection] = None
        self._bound: Optional[tuple[np.ndarray, Optional[np.ndarray]]] = None
        self._by_uid: Optional[UidRows] = None
        self._preselected: Optional[tuple[set, GroupSelection]] = None

    def bind(self, prompt_index, prompts=None) -> None:
        """Dataset row of each response (e.g. ``batch.non_tensor_batch["index"]``) and, to have
        the rows checked by them, its prompt (``"raw_prompt"``), used by the next call that gets
        no ``prompt_index``."""
        rows = host_rows(prompt_index)
        self._bound = (rows, _keys_of(prompts, rows.shape[0]))

    def bind_uids(self, uids, prompt_index, prompts) -> None:
        """Remember the dataset row and the prompt of each of this step's uids (verl's
        ``non_tensor_batch`` ``"uid"``, ``"index"`` and ``"raw_prompt"``, one per prompt or per
        response, e.g. on the batch ``fit`` hands ``_get_gen_batch``); the next call that gets no
        ``prompt_index`` looks its responses' rows up by uid, and refuses groups of one row with
        different prompts. Replaces the previous binding."""
        self._by_uid = UidRows(uids, prompt_index, prompts)

    def expect_selected(self, uids, selected: Selected) -> None:
        """The step's selection is made (``selected``, from :meth:`select`) and the batch cut
        to the groups with ``uids``: the next call computes verl's GRPO advantages of those
        groups alone, with no second selection or state update
        (:class:`~.legacy.LZERayPPOTrainer` calls it where it drops the other groups)."""
        self._preselected = (set(_host_keys(uids).tolist()), selected.rows.selection)

    def __call__(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                 index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: Optional[bool] = None,
                 config: Any = None, prompt_index=None, prompts=None, **unused):
        """verl's estimator signature; returns ``(advantages, returns)``, sets :attr:`last`.
        ``prompt_index``: each response's dataset row (else the bound ones); ``prompts``: each
        response's prompt, to have LZE's rows checked by them (as :meth:`bind`)."""
        step = self.compute(token_level_rewards, response_mask, index, epsilon,
                            norm_adv_by_std_in_grpo, config, prompt_index, prompts)
        return step.advantages, step.returns

    def compute(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                epsilon: float = 1e-6, norm_adv_by_std_in_grpo: Optional[bool] = None,
                config: Any = None, prompt_index=None, prompts=None) -> VerlStep:
        """Like ``__call__`` but returns everything (:class:`VerlStep`)."""
        norm = _norm_by_std(norm_adv_by_std_in_grpo, config)
        if self._preselected is not None and prompt_index is None:
            return self._advantages_of_selected(token_level_rewards, response_mask, index,
                                                epsilon, norm)
        keys = (None if prompts is None or self.method == "dapo" else
                _keys_of(prompts, len(_host_keys(index))))
        selected = self.select(token_level_rewards, response_mask, index, prompt_index,
                               prompt_keys=keys)
        rows = selected.rows
        step, same = rows.selection.step, self._kernel_constants(epsilon, norm)
        raw, valid = selected.raw, selected.valid
        advantages = (_verl_singles(step.advantages, raw, valid, epsilon, norm)
                      if same and not rows.merged else _grpo_advantages(raw, valid, epsilon, norm))
        if self.zero_dropped:
            advantages = advantages * rows.keep.unsqueeze(1)
        result = VerlStep(selected.keep_mask.to(token_level_rewards.device), selected.groups,
                          rows.selection, *_per_response(advantages, selected.groups,
                                                         token_level_rewards, response_mask))
        self.last = result.selected()
        return result

    def select(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
               prompt_index=None, equal_groups: bool = False,
               prompt_keys: Optional[np.ndarray] = None) -> Selected:
        """Check the step's inputs, then run the method on its groups (the selector's state
        update); the bound rows are used up only when the step succeeds. A row that comes in
        two groups is one observation (:mod:`.rows`); LZE refuses rows that cannot be right
        first (module docstring). ``prompt_keys`` [bs]: the
        :func:`~.row_table.prompt_key` of each response's prompt, beside ``prompt_index``.
        ``equal_groups``: refuse uid groups of unequal size (a trainer that keeps whole
        mini-batches of groups)."""
        _check_token_tensors(token_level_rewards, response_mask)
        scores = token_level_rewards.sum(dim=-1).to(self.device)
        groups = group_by_uid(index, self.device)
        if groups.row.shape[0] != scores.shape[0]:
            raise ValueError(f"index: expected {scores.shape[0]} uids (one per response), "
                             f"got {groups.row.shape[0]}")
        if equal_groups and not groups.full:
            sizes = np.bincount(groups.host_row)
            raise ValueError(
                f"index: uid groups of {sizes.min()} to {sizes.max()} responses; verl's legacy "
                "trainer joins rollout.n responses to each prompt, and LZE keeps whole groups "
                "in whole mini-batches of ppo_mini_batch_size x rollout.n rows. An agent loop "
                "that drops or splits trajectories (actor_rollout_ref.rollout.agent."
                "default_agent_loop, agent_loop_config_path) needs the v1 trainer, whose "
                "LZEReplayBuffer counts the kept groups by rows")
        raw, valid = _layout(scores, groups)
        group_rows, group_keys = self._group_rows(*self._rows(prompt_index, prompt_keys, index),
                                                  groups)
        rows = select_on_rows(self.method, self.selector, raw, valid, group_rows, self.score_fn,
                              group_keys)
        self._bound, self._preselected = None, None
        if prompt_index is None:
            self._by_uid = None
        return Selected(scores, groups, raw, valid, rows)

    def register(self, name: str = "lze_grpo") -> None:
        """Make this estimator selectable as ``algorithm.adv_estimator=<name>`` in verl."""
        from verl.trainer.ppo.core_algos import register_adv_est

        register_adv_est(name)(self)

    def state_dict(self) -> dict:
        return {} if self.selector is None else {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.selector is not None:
            self.selector.load_state_dict(state["selector"])

    # ------------------------------------------------------------------------- internals

    def _kernel_constants(self, epsilon: float, norm: bool) -> bool:
        """The fused step computed verl's advantages (same rewards and constants)."""
        config = getattr(self.selector, "config", None)
        return (config is not None and self.score_fn is None and config.eps == epsilon
                and config.norm_by_std == norm)

    def _advantages_of_selected(self, token_level_rewards, response_mask, index, epsilon,
                                norm) -> VerlStep:
        """verl's GRPO advantages of the groups :meth:`expect_selected` announced."""
        _check_token_tensors(token_level_rewards, response_mask)
        uids, selection = self._preselected
        keys = _host_keys(index).tolist()
        stray = [uid for uid in keys if uid not in uids]
        if stray:
            raise ValueError(f"index: {len(stray)} responses belong to groups the step's "
                             f"selection dropped (e.g. {stray[0]!r}); expect_selected names the "
                             "groups the batch was cut to")
        scores = token_level_rewards.sum(dim=-1).to(self.device)
        groups = group_by_uid(index, self.device)
        raw, valid = _layout(scores, groups)
        advantages = _grpo_advantages(raw, valid, epsilon, norm)
        keep_mask = torch.ones(len(keys), dtype=torch.bool, device=token_level_rewards.device)
        self._preselected = None
        result = VerlStep(keep_mask, groups, selection,
                          *_per_response(advantages, groups, token_level_rewards, response_mask))
        self.last = result.selected()
        return result

    def _rows(self, prompt_index, prompt_keys, index):
        """``(rows, keys)`` [bs]: the rows passed (with ``prompt_keys``), else those bound by
        :meth:`bind_uids` looked up by uid, else those bound by :meth:`bind` (None: no rows;
        keys None: no prompts). Nothing is used up here."""
        if prompt_index is not None:
            return host_rows(prompt_index), prompt_keys
        if prompt_keys is not None:
            raise ValueError("prompts: given without prompt_index (the prompts of bound rows are "
                             "bound with them: bind(prompt_index, prompts))")
        if self._by_uid is None:
            return self._bound or (None, None)
        uids = _host_keys(index).tolist()
        missing = self._by_uid.missing(uids)
        if missing:
            raise ValueError(f"index: {len(missing)} uids were not bound by bind_uids (e.g. "
                             f"{missing[0]!r}); bind each step's uids before verl computes "
                             "advantages")
        return self._by_uid.lookup(uids)

    def _group_rows(self, ids: Optional[np.ndarray], keys: Optional[np.ndarray],
                    groups: UidGroups) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """``(rows, keys)`` [num_groups]: the first response's row and prompt key, checked for
        the whole group."""
        if ids is None:
            if self.method == "dapo":  # stateless: the rows are only reported
                return np.full(groups.host_first.shape[0], -1, np.int64), None
            raise ValueError("prompt_index: LZE needs each response's dataset row (verl: "
                             "non_tensor_batch['index']); pass it, or call bind() or bind_uids() "
                             "before each call")
        # Checked on the host, where verl keeps them (numpy calls cost less than torch ops).
        group_rows = _per_group(ids, groups, "prompt_index", "dataset rows")
        group_keys = None if keys is None else _per_group(keys, groups, "prompts", "prompts")
        if self.selector is not None:
            check_row_range(group_rows, self.selector.num_prompts)
        return group_rows, group_keys


def _keys_of(prompts, count: int) -> Optional[np.ndarray]:
    """[count] prompt keys of ``prompts`` (None: None)."""
    if prompts is None:
        return None
    if len(prompts) != count:
        raise ValueError(f"prompts: expected {count} prompts (one per response), got "
                         f"{len(prompts)}")
    return prompt_keys(prompts)


def _per_group(values: np.ndarray, groups: UidGroups, name: str, what: str) -> np.ndarray:
    """[num_groups] the first response's value, checked equal over each uid group."""
    if values.shape != tuple(groups.row.shape):
        raise ValueError(f"{name}: expected {groups.row.shape[0]} {what} (one per response), "
                         f"got shape {tuple(values.shape)}")
    first = values[groups.host_first]
    if (values != first[groups.host_row]).any():
        raise ValueError(f"{name}: responses of one uid carry different {what}")
    return first


def _grpo_advantages(raw: torch.Tensor, valid: Optional[torch.Tensor], epsilon: float,
                     norm: bool) -> torch.Tensor:
    """verl's GRPO advantages [num_groups, width] of the scores in the group layout. Without
    padding (``valid`` None, every group of ``width`` >= 2 responses: what verl's rollouts give)
    one ``torch.std_mean`` reduction (unbiased, as verl's ``torch.std``) and two elementwise ops,
    a few microseconds; otherwise the kernels' masked reference (:func:`lze_kernels.ops.
    grpo_advantages`) with verl's value for a group of one (:func:`_verl_singles`)."""
    if valid is None and raw.shape[1] > 1:
        scores = raw.float()
        std, mean = torch.std_mean(scores, dim=1, keepdim=True)
        centred = scores - mean
        return centred / (std + epsilon) if norm else centred
    return _verl_singles(ops.grpo_advantages(raw, valid, epsilon, norm), raw, valid, epsilon,
                         norm)


def _verl_singles(advantages: torch.Tensor, raw: torch.Tensor, valid: Optional[torch.Tensor],
                  epsilon: float, norm: bool) -> torch.Tensor:
    """verl gives a one-response group mean 0 and std 1 (the kernels give it A = 0)."""
    width = raw.shape[1]
    if valid is None and width > 1:  # no group of one
        return advantages
    alone = raw / (1.0 + epsilon) if norm else raw
    if valid is None:
        return alone
    single = valid.sum(dim=1, keepdim=True) == 1
    return torch.where(single & valid, alone, advantages)


def _per_response(advantages: torch.Tensor, groups: UidGroups, token_level_rewards, response_mask):
    """``(advantages, returns)`` [bs, T] from the [num_groups, width] layout, as verl returns
    them (equal tensors, on the rewards' device and dtype)."""
    flat = advantages.reshape(-1)
    per_response = flat if groups.blocked else flat.index_select(0, groups.cell)
    out = _broadcast(per_response.to(token_level_rewards.device, token_level_rewards.dtype),
                     response_mask)
    return out, out


def _layout(scores: torch.Tensor, groups: UidGroups):
    """[bs] scores -> ``(raw, valid)`` [num_groups, width], zero-padded; ``valid`` is None when
    no group is short, and ``raw`` a view of ``scores`` when the uids arrived grouped."""
    num_groups = groups.first.shape[0]
    if groups.blocked:
        return scores.view(num_groups, groups.width), None
    raw = scores.new_zeros(num_groups * groups.width).index_copy_(0, groups.cell, scores)
    if groups.full:
        return raw.view(num_groups, -1), None
    valid = torch.zeros_like(raw, dtype=torch.bool).index_fill_(0, groups.cell, True)
    return raw.view(num_groups, -1), valid.view(num_groups, -1)


def _broadcast(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``per_response.unsqueeze(-1) * response_mask``, bit for bit, with one [bs, T]
    allocation instead of two: an integer mask is cast to the result dtype once and multiplied
    in place (the expression would cast it into a temporary, then allocate the product)."""
    dtype = torch.result_type(per_response, response_mask)
    if response_mask.dtype == dtype:
        return per_response.unsqueeze(-1) * response_mask
    return response_mask.to(dtype).mul_(per_response.unsqueeze(-1))


def _check_token_tensors(token_level_rewards, response_mask) -> None:
    for name, value in (("token_level_rewards", token_level_rewards),
                        ("response_mask", response_mask)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise ValueError(f"{name}: expected a [bs, response_length] tensor, got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(f"response_mask: expected shape {tuple(token_level_rewards.shape)} like "
                         f"token_level_rewards, got {tuple(response_mask.shape)}")


def _norm_by_std(explicit: Optional[bool], config: Any) -> bool:
    """verl passes ``norm_adv_by_std_in_grpo`` directly (its GRPO branch) or inside the algorithm
    config (the registry branch); default True as in verl."""
    if explicit is not None:
        return bool(explicit)
    if config is None:
        return True
    if isinstance(config, dict):
        return bool(config.get("norm_adv_by_std_in_grpo", True))
    return bool(getattr(config, "norm_adv_by_std_in_grpo", True))

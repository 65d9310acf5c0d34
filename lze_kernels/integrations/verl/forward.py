"""Forward selection for verl: the sampler that chooses which prompts verl rolls out.

:class:`ForwardSampler` is a ``torch.utils.data.Sampler`` of dataset rows for verl's
``StatefulDataLoader`` (the legacy ``RayPPOTrainer``'s ``train_sampler``; in v1,
:class:`~.checkpoint.LZERLHFDataset` asks it for each row). After each training step
:meth:`ForwardSampler.observe` gets the rewards of the groups verl generated
(:class:`~.legacy.LZERayPPOTrainer` or :class:`~.replay_buffer.LZEReplayBuffer` calls it), so
the next batch is drawn from fresh state. Each dataloader epoch yields the whole batches of
``num_prompts`` rows. Methods:

* ``"pruner"``: rows in a seeded permutation per pass, skipping the prompts LZE's forward pruner
  has pruned unless drawn for replay (:meth:`LZESelector.rollout_mask`; a new pass draws the
  replays, :meth:`LZESelector.begin_epoch`). Its state is the estimator's selector
  (docs/spec.md §5).
* ``"greso"``: the same permutation, each candidate kept by GRESO's seeded skip draw
  (:class:`~lze_kernels.greso.GresoFilter`, Zheng et al. 2025, arXiv 2506.02177), which
  :meth:`observe` updates with each group's rewards.
* ``"dots"``: each batch drawn without replacement with probability ``∝ exp(-|p_hat - 1/2| /
  tau)`` (:func:`lze_kernels.dots.sample_near_half`, Sun et al. 2025), ``p_hat`` predicted from
  the pass rates observed so far by attention over fixed prompt embeddings
  (:func:`lze_kernels.dots.predict_pass_rates`); 1/2 for all until a prompt has been seen.

A pass that finds no eligible prompt in ``num_prompts`` candidates yields the next candidate
anyway (the batch must be full), as ``take_eligible`` pads. A batch may span two passes, and so
hold a row twice; :meth:`observe` takes such a row's groups as one observation. The state (pass,
position, step and the method's own) is :meth:`state_dict`: the legacy trainer saves it in
``lze_selection.pt`` beside verl's checkpoint, v1 in verl's ``data.pt`` (both through torchdata's
``StatefulDataLoader`` too), so a resume continues the same sequence.
The sampler draws a batch when the dataloader asks for it: with ``dataloader_num_workers > 0``
verl's dataloader draws batches ahead, before the previous step's rewards are observed, so
:class:`~.legacy.LZERayPPOTrainer` refuses that setting.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

from ... import dots
from ...greso import GresoFilter
from ...selector import LZESelector
from .rows import check_row_range, check_rows_differ, find_repeats, merge_groups

METHODS = ("pruner", "greso", "dots")
_FORMAT = "lze_kernels.verl.forward/1"


class ForwardSampler(Sampler[int]):
    """Dataset rows for verl's dataloader, chosen by ``method`` from the observed rewards."""

    def __init__(self, num_prompts: int, batch_size: int, method: str, *, seed: int = 0,
                 selector: Optional[LZESelector] = None, greso: Optional[GresoFilter] = None,
                 embeddings: Optional[torch.Tensor] = None, tau: float = 1e-3,
                 attention_tau: float = 1.0):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
        if not isinstance(batch_size, int) or not 1 <= batch_size <= num_prompts:
            raise ValueError(f"batch_size: expected an int in [1, {num_prompts}], got "
                             f"{batch_size!r}")
        needed = {"pruner": ("selector", selector), "greso": ("greso", greso),
                  "dots": ("embeddings", embeddings)}[method]
        if needed[1] is None:
            raise ValueError(f"{needed[0]}: method {method!r} needs it")
        _check_size(method, num_prompts, selector, greso, embeddings)
        self.num_prompts, self.batch_size, self.method, self.seed = (num_prompts, batch_size,
                                                                      method, seed)
        self.selector, self.greso = selector, greso
        self.tau, self.attention_tau = tau, attention_tau
        self.embeddings = None if embeddings is None else embeddings.float()
        self.labels = torch.full((num_prompts,), float("nan"))  # DOTS: observed pass rates
        self.passes, self.position, self.steps = 0, 0, 0
        self._order: Optional[torch.Tensor] = None  # the current pass's permutation
        self._window: list = []  # [row, eligible] of the candidates from _window_start on
        self._window_start = 0
        self._drawn: list[int] = []  # DOTS: rows of the current batch not yet yielded

    def __len__(self) -> int:
        """Whole batches only: verl's dataloader drops a last partial batch, and a DOTS draw
        must not outlive its step."""
        return self.num_prompts // self.batch_size * self.batch_size

    def __iter__(self) -> Iterator[int]:
        for _ in range(len(self)):
            yield self.next_row()

    def next_row(self) -> int:
        """The next dataset row to roll out (v1: :class:`~.checkpoint.LZERLHFDataset` asks for
        one per item verl's dataloader fetches)."""
        return self._next_dots_row() if self.method == "dots" else self._next_row()

    def observe(self, prompt_ids: torch.Tensor, rewards: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> None:
        """One training step's groups: ``prompt_ids`` [B] dataset rows, ``rewards`` [B, G] in
        [0, 1] (``valid`` [B, G]: the scored responses; None: all). A row that comes in two
        groups is one observation of all their rollouts (:mod:`.rows`). Everything is checked
        before any state changes."""
        self.check_observation(prompt_ids, rewards, valid)
        if valid is None:
            valid = torch.ones_like(rewards, dtype=torch.bool)
        repeats = find_repeats(prompt_ids.numpy())
        if repeats.any:
            rewards, valid = merge_groups(rewards, valid, repeats)
            prompt_ids = torch.from_numpy(repeats.rows)
        if self.method == "greso":
            self.greso.observe(prompt_ids, rewards, valid)
        elif self.method == "dots":
            counts = valid.sum(dim=1)
            rates = torch.where(valid, rewards, 0.0).sum(dim=1) / counts.clamp(min=1)
            self.labels[prompt_ids] = torch.where(counts > 0, rates.float(),
                                                  self.labels[prompt_ids])
        self.steps += 1
        self._window = []  # eligibility read before these rewards is stale
        self._drawn = []  # a DOTS draw made before these rewards is stale (v1 refills)

    def state_dict(self) -> dict:
        state = {"format": _FORMAT, "passes": self.passes, "position": self.position,
                 "steps": self.steps, "labels": self.labels.clone(), "drawn": list(self._drawn)}
        if self.greso is not None:
            state["greso"] = self.greso.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; everything is checked before anything is written."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"state: expected a ForwardSampler state ({_FORMAT!r})")
        labels = state.get("labels")
        if (not isinstance(labels, torch.Tensor) or labels.dtype != torch.float32
                or tuple(labels.shape) != (self.num_prompts,)):
            raise ValueError(f"state['labels']: expected a float32 tensor of shape "
                             f"({self.num_prompts},) (this sampler's prompts), got "
                             f"{getattr(labels, 'shape', type(labels).__name__)}")
        counters = [state.get(key) for key in ("passes", "position", "steps")]
        in_range = all(isinstance(c, int) and c >= 0 for c in counters)
        if not in_range or counters[1] > self.num_prompts:
            raise ValueError(f"state: expected passes, position (<= {self.num_prompts}) and "
                             f"steps as ints >= 0, got {counters}")
        drawn = state.get("drawn")
        if not isinstance(drawn, list) or not all(isinstance(r, int) and 0 <= r < self.num_prompts
                                                  for r in drawn):
            raise ValueError("state['drawn']: expected a list of dataset rows")
        if self.greso is not None:
            self.greso.load_state_dict(state.get("greso"))
        self.passes, self.position, self.steps = counters
        self.labels = labels.clone()
        self._drawn = list(drawn)
        self._order, self._window = None, []

    # ------------------------------------------------------------------------- internals

    def check_observation(self, prompt_ids: torch.Tensor, rewards: torch.Tensor,
                          valid: Optional[torch.Tensor] = None) -> None:
        """What :meth:`observe` checks before it changes anything (a caller that must not
        change other state on a bad observation checks first)."""
        if (not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 1
                or prompt_ids.dtype != torch.int64 or prompt_ids.device.type != "cpu"):
            raise ValueError(f"prompt_ids: expected a [B] int64 CPU tensor of dataset rows, got "
                             f"{getattr(prompt_ids, 'dtype', type(prompt_ids).__name__)}")
        if prompt_ids.numel() == 0:
            raise ValueError("prompt_ids: expected at least one row, got none")
        check_row_range(prompt_ids.numpy(), self.num_prompts, "prompt_ids")
        check_rows_differ(prompt_ids.numpy(), lambda: self.steps, "prompt_ids")
        if (not isinstance(rewards, torch.Tensor) or not torch.is_floating_point(rewards)
                or rewards.dim() != 2 or rewards.shape[0] != prompt_ids.shape[0]
                or rewards.device.type != "cpu"):
            raise ValueError(f"rewards: expected a [{prompt_ids.shape[0]}, G] float CPU tensor "
                             f"(one group per row), got "
                             f"{getattr(rewards, 'shape', type(rewards).__name__)}")
        if valid is not None and (valid.dtype != torch.bool or valid.shape != rewards.shape):
            raise ValueError(f"valid: expected a bool tensor of shape {tuple(rewards.shape)}, "
                             f"got {valid.dtype} {tuple(valid.shape)}")
        scored = rewards if valid is None else torch.where(valid, rewards, 0.5)
        if not bool(((scored >= 0) & (scored <= 1)).all()):  # NaN fails too
            raise ValueError("rewards: expected pass rates in [0, 1] on the scored responses")

    def _permutation(self) -> torch.Tensor:
        """The rows of the current pass: a permutation keyed by (seed, pass)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.passes)
        return torch.randperm(self.num_prompts, generator=generator)

    def _next_row(self) -> int:
        """Pruner / GRESO: the next eligible candidate of the permutation."""
        for _ in range(self.num_prompts):
            row, eligible = self._advance()
            if eligible:
                return row
        return row  # a whole pass of ineligible candidates: keep the batch full

    def _advance(self) -> tuple[int, bool]:
        if self.position == self.num_prompts:
            self.passes, self.position = self.passes + 1, 0
            self._order, self._window = None, []
            if self.method == "pruner":
                self.selector.begin_epoch()
        if self._order is None:
            self._order = self._permutation()
        offset = self.position - self._window_start
        if not 0 <= offset < len(self._window):
            self._window, self._window_start, offset = self._eligibility(), self.position, 0
        row, eligible = self._window[offset]
        self.position += 1
        return row, bool(eligible)

    def _eligibility(self) -> list:
        """``[row, eligible]`` of the next candidates of the pass from :attr:`position` on, as
        many as one batch takes at most twice over: O(batch) work a step, not O(N) (the pruner's
        and GRESO's masks are elementwise in the row, so a window reads as the whole pass would)."""
        end = min(self.num_prompts, self.position + max(2 * self.batch_size, 64))
        rows = self._order[self.position:end]
        mask = (self.selector.rollout_mask(rows) if self.method == "pruner"
                else self.greso.rollout_mask(rows, self.steps))
        return torch.stack([rows, mask.long()], dim=1).tolist()

    def _next_dots_row(self) -> int:
        if not self._drawn:
            step = torch.tensor([self.steps], dtype=torch.int64)
            self._drawn = dots.sample_near_half(self._predicted(), self.batch_size, self.tau,
                                                self.seed, step).tolist()
        return self._drawn.pop(0)

    def _predicted(self) -> torch.Tensor:
        """[N] predicted pass rates from the prompts observed so far (1/2 before any)."""
        seen = ~torch.isnan(self.labels)
        if not seen.any():
            return torch.full((self.num_prompts,), 0.5)
        return dots.predict_pass_rates(self.embeddings, self.embeddings[seen],
                                       self.labels[seen], self.attention_tau)


def _check_size(method, num_prompts, selector, greso, embeddings) -> None:
    size = {"pruner": lambda: selector.num_prompts, "greso": lambda: greso.num_prompts,
            "dots": lambda: embeddings.shape[0]}[method]()
    if size != num_prompts:
        raise ValueError(f"num_prompts: the {method} state holds {size} prompts, expected "
                         f"{num_prompts}")

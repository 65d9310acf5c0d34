"""The verl integration's glue against what verl runs in its place, on the same inputs (run in
.venv-verl: ``.venv-verl/bin/python -P -m pytest benchmarks/test_bench_verl_hook.py``; skips where
verl is not installed). Each records its cases in a JSON results file beside the Markdown table
rendered from it (docs/verl.md quotes both tables).

* **The estimator** (``test_verl_estimators``, verl_estimators.{json,md}): what a verl
  user chooses between, on token-level rewards ``[bs, T]`` (a binary outcome on the last response
  token), an int64 response mask and fresh uuid4 uid strings every round as verl's ``fit`` makes
  them, in a numpy object array, grouped or shuffled as ``balance_batch`` leaves them:

  - ``verl loop``: the installed verl's ``compute_grpo_outcome_advantage`` (``adv_estimator=grpo``;
    dict of uid lists, per-group torch mean/std, per-response writes);
  - ``verl vectorised``: the installed verl's ``compute_grpo_vectorized_outcome_advantage``
    (``adv_estimator=grpo_vectorized``);
  - ``LZEAdvantage`` with ``method="lze"`` and ``"dapo"``, and its kernels alone (the fused
    selector step, resp. the DAPO keep mask and GRPO advantages, on the ``[B, G]`` rewards);
  - ``floor``: the two ``[bs, T]`` passes any estimator with verl's contract makes,
    ``token_level_rewards.sum(-1)`` and the masked broadcast, the fastest way measured
    (:func:`floor`).

  Medians over rounds of fresh uids on the same tensors, the estimators in turn within each round,
  each round starting one estimator later (:func:`rotated`; verl's loop afterwards on its own,
  fewer rounds at large sizes), B x G from 128 x 8 to 4,096 x 16, T = 256 and 2,048. Goal: the
  adapter faster than ``grpo_vectorized`` and within 1.5x the floor + 0.5 ms in every case
  (``meets_goal``). The adapter's outputs are checked
  against both verl estimators on one batch of each case, and its selection against LZE's host
  loop (baselines.PythonLoopSelector, the public release's way).
* **The legacy hook** (``test_verl_hook_against_verls_own_step``, verl_hook.{json,md}):
  ``LZERayPPOTrainer``'s ``_balance_batch`` plus ``compute_advantage`` on the kept rows against
  what verl runs at the same two points on the whole batch.
* **The prompt keys** (``test_prompt_key_cost``, results/verl_prompt_keys.{json,md}): what
  checking a step's rows by their prompts adds at B = 1,024 (``LZERLHFDataset``'s check of a
  fetch; legacy also ``_get_gen_batch``'s of the bound prompts), against verl's own
  ``_balance_batch`` + ``compute_advantage`` on that step's B x n responses.

On a 2-core machine shared with other jobs, two OpenMP threads per op made small torch ops
10-100x slower (barrier waits): measure with ``OMP_NUM_THREADS=1``; each case records the load
average and torch's thread count. Whoever runs right after another decides whether a [bs, T]
output finds memory that call freed or faults in fresh pages (glibc trims the heap when a free
leaves enough at its top: at B x G x T = 128 x 8 x 2,048 verl's grpo_vectorized, which frees a
cast copy of the mask besides its output, made the next estimator fault in all 2,048 pages of its
output and take 2-3x as long), so no estimator keeps a fixed place in the rounds.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import types
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch
from baselines import PythonLoopSelector, _group_mean_std
from bench_common import merge_result, run_file
from omegaconf import OmegaConf

from lze_kernels import LZEConfig, LZESelector, ops
from lze_kernels.integrations.verl.estimator import UidRows
from lze_kernels.integrations.verl.row_table import RowTable, prompt_keys

ESTIMATOR_RESULTS, ESTIMATOR_TABLE = "verl_estimators.json", "verl_estimators.md"  # run_file names
VERL_CASES = ((128, 8), (512, 8), (1024, 16), (4096, 16))  # (prompts, responses per prompt)
RESPONSE_LENGTHS = (256, 2048)
ORDERS = ("grouped", "shuffled")
ROUNDS = 15
SMALL_CASE_ROUNDS, SMALL_CASE_ELEMENTS = 51, 1 << 21  # more rounds where bs * T is small
LOOP_ROUNDS = 3  # verl's loop where bs >= LOOP_FEW_ROUNDS_FROM (seconds per call)
LOOP_FEW_ROUNDS_FROM = 16384
ESTIMATORS = ("floor", "verl_vectorized", "lze", "dapo", "lze_kernels", "dapo_kernels",
              "verl_loop")  # the loop last, timed on its own


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def rotated(names, round_: int) -> list:
    """``names`` in the order round ``round_`` runs them: each round starts one later, so each
    one follows each other equally often (module docstring)."""
    shift = round_ % len(names)
    return list(names[shift:]) + list(names[:shift])


# ----------------------------------------------------------------------------- the estimator


class VerlBatches:
    """verl-shaped inputs: token-level outcome rewards and response mask (made once: only the
    host glue depends on the round), then per round fresh uuid4 uids and the dataset row of each
    response, grouped or shuffled (verl's balance_batch reorders responses)."""

    def __init__(self, num_prompts: int, group: int, length: int, order: str, seed: int = 0):
        self.num_prompts, self.group, self.order = num_prompts, group, order
        g, bs = torch.Generator().manual_seed(seed), num_prompts * group
        self.rng = np.random.default_rng(seed)
        p = torch.rand(num_prompts, 1, generator=g)
        scores = (torch.rand(num_prompts, group, generator=g) < p).float().reshape(-1)
        lengths = torch.randint(1, length + 1, (bs,), generator=g)
        self.mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
        self.token_rewards = torch.zeros(bs, length)
        self.token_rewards[torch.arange(bs), lengths - 1] = scores

    def __call__(self):
        """(token_rewards, mask, index, dataset rows); the rewards of response i belong to the
        i-th uid of ``index`` whatever the order."""
        uids = np.array([str(uuid.uuid4()) for _ in range(self.num_prompts)], dtype=object)
        rows = self.rng.permutation(4 * self.num_prompts)[: self.num_prompts]
        index, rows = np.repeat(uids, self.group), np.repeat(rows, self.group).astype(object)
        if self.order == "shuffled":
            order = self.rng.permutation(index.shape[0])
            index, rows = index[order], rows[order]
        return self.token_rewards, self.mask, index, rows


def verl_estimators():
    """The installed verl's ``grpo`` and ``grpo_vectorized`` estimators, as ``(token_rewards,
    mask, index) -> advantages``; the verl cases skip where verl is not installed."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos",
                                     reason="verl runs in .venv-verl (make test-verl)")
    return {"verl_loop": lambda r, m, i: core_algos.compute_grpo_outcome_advantage(r, m, i)[0],
            "verl_vectorized": lambda r, m, i:
            core_algos.compute_grpo_vectorized_outcome_advantage(r, m, i)[0]}


def floor(token_rewards, mask, *_):
    """The two [bs, T] passes any estimator with verl's contract makes, the fastest way measured:
    the response scores, then the mask cast to float and multiplied in place by a value per
    response (verl's own ``A.unsqueeze(-1) * mask`` on an int64 mask runs the same arithmetic
    in a mixed-dtype loop, up to 5x slower at T = 2048)."""
    scores = token_rewards.sum(dim=-1)
    return mask.to(token_rewards.dtype).mul_(scores.unsqueeze(-1))


def verl_lze_host_loop(selector: PythonLoopSelector, token_rewards, index, rows):
    """LZE's selection over verl's uid groups the way the public release runs it (``.item()``
    per prompt, Python state and sort); groups in order of first appearance, as the adapter
    numbers them, so both draw the same noise per group."""
    scores = token_rewards.sum(dim=-1)
    id2mean, _ = _group_mean_std(scores, index)
    row_of_uid = dict(zip(index, rows))
    uids = list(id2mean)
    energy = [selector._update_prompt(selector.state[row_of_uid[uid]], id2mean[uid].item())[0]
              for uid in uids]
    selector.steps_done += 1
    kept = {uids[i] for i in selector._top_k(energy)}
    return torch.tensor([uid in kept for uid in index])


def _check_like_for_like(batches: VerlBatches, adapters: dict, verl: dict) -> None:
    """One batch: the adapter's advantages against both verl estimators (the loop exactly up to
    float32 rounding, the vectorised one up to its sum-of-squares variance), its LZE selection
    against the release's host loop, its DAPO selection against unequal scores."""
    token_rewards, mask, index, rows = batches()
    loop_selector = PythonLoopSelector(adapters["lze"].selector.config)
    expected = verl["verl_loop"](token_rewards, mask, index)
    for adapter in adapters.values():
        advantages, _ = adapter(token_rewards, mask, index, prompt_index=rows)
        torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(advantages, verl["verl_vectorized"](token_rewards, mask, index),
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(adapters["lze"].last.keep_mask,
                       verl_lze_host_loop(loop_selector, token_rewards, index, rows))
    values = defaultdict(set)
    for uid, score in zip(index.tolist(), token_rewards.sum(dim=-1).tolist()):
        values[uid].add(score)
    assert adapters["dapo"].last.keep_mask.tolist() == [len(values[uid]) > 1 for uid in index]


def _kernel_inputs(batches: VerlBatches):
    """The kernels' inputs: [B, G] response scores and B distinct dataset rows."""
    scores = batches.token_rewards.sum(dim=-1).view(batches.num_prompts, batches.group)
    return scores, torch.from_numpy(batches.rng.permutation(4 * batches.num_prompts)
                                    [: batches.num_prompts])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("length", RESPONSE_LENGTHS)
@pytest.mark.parametrize("num_prompts, group", VERL_CASES)
def test_verl_estimators(num_prompts, group, length, order):
    from lze_kernels.integrations.verl import LZEAdvantage

    verl = verl_estimators()
    bs, config = num_prompts * group, LZEConfig()
    _check_like_for_like(VerlBatches(num_prompts, group, 32, order, seed=2),
                         {"lze": LZEAdvantage(4 * num_prompts, config),
                          "dapo": LZEAdvantage(method="dapo")}, verl)

    adapters = {"lze": LZEAdvantage(4 * num_prompts, config), "dapo": LZEAdvantage(method="dapo")}
    kernel_selector = LZESelector(4 * num_prompts, config)
    batches = VerlBatches(num_prompts, group, length, order, seed=1)
    scores, ids = _kernel_inputs(batches)
    timed = {
        **verl,
        "lze": lambda r, m, i, rows: adapters["lze"](r, m, i, prompt_index=rows),
        "dapo": lambda r, m, i, rows: adapters["dapo"](r, m, i, prompt_index=rows),
        "lze_kernels": lambda *_: kernel_selector.step(scores, ids),
        "dapo_kernels": lambda *_: (ops.dapo_keep_mask(scores), ops.grpo_advantages(scores)),
        "floor": floor,
    }
    medians = _interleaved_medians(timed, ESTIMATORS[:-1], batches, _rounds(bs, length))
    loop_rounds = LOOP_ROUNDS if bs >= LOOP_FEW_ROUNDS_FROM else ROUNDS
    medians.update(_interleaved_medians(timed, ("verl_loop",), batches, loop_rounds))
    budget = 1.5 * medians["floor_s"] + 0.5e-3
    goal = {method: medians[f"{method}_s"] < min(medians["verl_vectorized_s"], budget)
            for method in ("lze", "dapo")}
    key = f"verl B{num_prompts} G{group} T{length} {order}"
    result = {**medians, "budget_s": budget, "meets_goal": goal,
              "backend": adapters["lze"].selector.backend, "rounds": _rounds(bs, length),
              "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    merge_result(run_file(ESTIMATOR_RESULTS), key, result)
    print(key, json.dumps(result))
    _write_estimator_table()


def _rounds(bs: int, length: int) -> int:
    return SMALL_CASE_ROUNDS if bs * length <= SMALL_CASE_ELEMENTS else ROUNDS


def _interleaved_medians(timed: dict, names, batches: VerlBatches, rounds: int) -> dict:
    """Median seconds of each estimator over ``rounds`` rounds of fresh uids; in each round the
    estimators run in turn, so a burst of load on the shared machine hits all of them. The
    garbage collector is off while timing (as in ``timeit``): the loop's garbage would otherwise
    be collected inside whichever call comes next."""
    times = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for round_ in range(rounds + 1):  # round 0 warms up
            token_rewards, mask, index, rows = batches()
            for name in rotated(names, round_):
                args = (token_rewards, mask, index) + ((rows,) if name in ("lze", "dapo") else ())
                seconds = _seconds(timed[name], *args)
                if round_:
                    times[name].append(seconds)
    finally:
        gc.enable()
    return {f"{name}_s": statistics.median(values) for name, values in times.items()}


def _write_estimator_table() -> None:
    """verl_estimators.md from verl_estimators.json (the run folder)."""
    with open(run_file(ESTIMATOR_RESULTS)) as f:
        table = json.load(f)
    lines = ["| B x G | T | uids | verl loop | verl grpo_vectorized | LZEAdvantage lze "
             "(kernels) | LZEAdvantage dapo (kernels) | floor | goal: < vectorised and "
             "<= 1.5 floor + 0.5 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(table.items(), key=lambda kv: _case_order(kv[0])):
        b, g, t, order = key.split()[1:]
        ms = {name: 1e3 * r[f"{name}_s"] for name in ESTIMATORS}
        met = all(r["meets_goal"].values())
        lines.append(
            f"| {b[1:]} x {g[1:]} | {t[1:]} | {order} | {ms['verl_loop']:.3g} ms | "
            f"{ms['verl_vectorized']:.3g} ms | {ms['lze']:.3g} ms ({ms['lze_kernels']:.2g}) | "
            f"{ms['dapo']:.3g} ms ({ms['dapo_kernels']:.2g}) | {ms['floor']:.3g} ms | "
            f"{'met' if met else 'MISSED'} (load {r['load_average'][0]:.1f}) |")
    with open(run_file(ESTIMATOR_TABLE), "w") as f:
        f.write("\n".join(lines) + "\n")


def _case_order(key: str):
    b, g, t, order = key.split()[1:]
    return int(b[1:]) * int(g[1:]), int(t[1:]), order


# ----------------------------------------------------------------------------- the legacy hook
# Cost of the legacy verl hook per step against what verl itself runs there, on the same batch.
# verl 0.9.1's legacy ``fit`` runs ``_balance_batch`` (a Karmarkar-Karp partition of the
# responses over the data-parallel ranks, then a reorder of every field) and later
# ``compute_advantage`` (``adv_estimator=grpo``) on all ``B x n`` responses;
# ``LZERayPPOTrainer`` runs its selection in ``_balance_batch`` (the registered estimator's fused
# step on the rewards, the cut of every field to the kept groups' rows), then verl's own
# ``_balance_batch`` and ``compute_advantage`` on the cut batch. Timed per step on a batch of the
# fields a rollout leaves, fresh uuid4 uids each round, 8 data-parallel ranks, keep_ratio 0.5.
# Goal: the hook no slower than verl's own step.


HOOK_RESULTS, HOOK_TABLE = "verl_hook.json", "verl_hook.md"  # run_file names
HOOK_CASES = ((128, 8, 256), (128, 8, 1024), (512, 8, 256))  # (prompts, rollouts, length)
PROMPT_LENGTH, DP_SIZE, HOOK_ROUNDS = 128, 8, 15
ESTIMATOR = "lze_bench_hook"


def trainer(cls, num_prompts: int, group: int):
    """verl's legacy trainer object up to its Ray boundary (no worker groups; dp size given)."""
    trainer = object.__new__(cls)
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": ESTIMATOR},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": num_prompts // 4},
                              "rollout": {"n": group}},
        "data": {"train_batch_size": num_prompts}, "trainer": {"balance_batch": True}})
    trainer.train_dataloader = types.SimpleNamespace(sampler=None, num_workers=0)
    trainer._get_dp_size = lambda worker_group, role: DP_SIZE
    trainer.actor_rollout_wg, trainer.use_rm = None, False
    return trainer


class Batches:
    """Per round, a fresh step's batch as legacy ``fit`` holds it at ``_balance_batch``."""

    def __init__(self, num_prompts: int, group: int, length: int):
        from verl import DataProto

        self.DataProto, self.num_prompts, self.group = DataProto, num_prompts, group
        g = torch.Generator().manual_seed(num_prompts * group + length)
        bs = num_prompts * group
        lengths = torch.randint(1, length + 1, (bs,), generator=g)
        solved = (torch.rand(bs, generator=g) < torch.rand(num_prompts, generator=g)
                  .repeat_interleave(group)).float()
        response_mask = (torch.arange(length) < lengths[:, None]).long()
        attention = torch.cat([torch.ones(bs, PROMPT_LENGTH, dtype=torch.long), response_mask], 1)
        tokens = torch.randint(0, 32000, (bs, PROMPT_LENGTH + length), generator=g)
        self.tensors = {
            "input_ids": tokens, "attention_mask": attention,
            "position_ids": attention.cumsum(-1) - 1, "prompts": tokens[:, :PROMPT_LENGTH],
            "responses": tokens[:, PROMPT_LENGTH:], "response_mask": response_mask,
            "rollout_log_probs": -torch.rand(bs, length, generator=g),
            "rm_scores": torch.zeros(bs, length).scatter_(1, (lengths - 1)[:, None],
                                                          solved[:, None])}
        self.rows = np.random.default_rng(length).permutation(4 * num_prompts)[:num_prompts]
        self.prompts = gsm8k_like(self.rows)

    def __call__(self, hook):
        """``(batch, rows_by_uid)``: the step's uids bound to dataset rows (``_get_gen_batch``)."""
        uids = np.array([str(uuid.uuid4()) for _ in range(self.num_prompts)], dtype=object)
        batch = self.DataProto.from_dict({k: v.clone() for k, v in self.tensors.items()},
                                         non_tensors={"uid": np.repeat(uids, self.group)})
        hook._binding = UidRows(uids, self.rows, self.prompts)
        return batch


@pytest.mark.parametrize("num_prompts, group, length", HOOK_CASES)
def test_verl_hook_against_verls_own_step(num_prompts, group, length):
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

    from lze_kernels.integrations.verl import LZEAdvantage
    from lze_kernels.integrations.verl.legacy import LZERayPPOTrainer

    algo = AlgoConfig(norm_adv_by_std_in_grpo=True)
    ADV_ESTIMATOR_REGISTRY[ESTIMATOR] = LZEAdvantage(4 * num_prompts, LZEConfig(keep_ratio=0.5))
    plain, hook = trainer(RayPPOTrainer, num_prompts, group), trainer(LZERayPPOTrainer,
                                                                      num_prompts, group)
    batches = Batches(num_prompts, group, length)

    def step(runner, estimator):
        def run(batch):
            runner._balance_batch(batch, metrics={})
            batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
            compute_advantage(batch, adv_estimator=estimator, config=algo)
            return len(batch)
        return run

    timed = {"verl": step(plain, "grpo"), "hook": step(hook, ESTIMATOR)}
    times, rows = {name: [] for name in timed}, {}
    gc.collect()
    gc.disable()
    try:
        for round_ in range(HOOK_ROUNDS + 1):  # round 0 warms up
            for name in rotated(list(timed), round_):
                run = timed[name]
                batch = batches(hook)
                start = time.perf_counter()
                rows[name] = run(batch)
                if round_:
                    times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
        ADV_ESTIMATOR_REGISTRY.pop(ESTIMATOR, None)
    medians = {f"{name}_s": statistics.median(values) for name, values in times.items()}
    result = {**medians, "rows": rows, "rounds": HOOK_ROUNDS, "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg()}
    key = f"verl hook B{num_prompts} G{group} T{length}"
    merge_result(run_file(HOOK_RESULTS), key, result)
    print(key, json.dumps(result))
    _write_hook_table()
    assert rows == {"verl": num_prompts * group, "hook": num_prompts * group // 2}


def _write_hook_table() -> None:
    """verl_hook.md from verl_hook.json (the run folder)."""
    with open(run_file(HOOK_RESULTS)) as f:
        table = {k: v for k, v in json.load(f).items() if k.startswith("verl hook ")}
    lines = ["| B x n | T | verl: _balance_batch + grpo advantages | LZE hook: select, cut, "
             "verl's balance + advantages of the kept rows | rows after | hook / verl |",
             "|---|---|---|---|---|---|"]
    for key, r in sorted(table.items(), key=lambda kv: [int(p[1:]) for p in kv[0].split()[2:]]):
        b, g, t = (p[1:] for p in key.split()[2:])
        lines.append(f"| {b} x {g} | {t} | {1e3 * r['verl_s']:.3g} ms | {1e3 * r['hook_s']:.3g} "
                     f"ms | {r['rows']['verl']} -> {r['rows']['hook']} | "
                     f"{r['hook_s'] / r['verl_s']:.2f} (load {r['load_average'][0]:.1f}) |")
    with open(run_file(HOOK_TABLE), "w") as f:
        f.write("\n".join(lines) + "\n")


def gsm8k_like(rows) -> np.ndarray:
    """Chat prompts of GSM8K's length (verl's preprocessing: the question and its instruction,
    about 250 characters), one per dataset row, distinct; a numpy object array as verl's
    ``collate_fn`` holds ``raw_prompt``."""
    prompts = np.empty(len(rows), dtype=object)
    prompts[:] = [[{"role": "user", "content":
                    f"Natalia sold clips to {row} of her friends in April, and then she sold half "
                    "as many clips to her friends in May. How many clips did Natalia sell "
                    "altogether in April and May? Let's think step by step and output the final "
                    "answer after \"####\"."}] for row in rows]
    return prompts


# ----------------------------------------------------------------------------- the prompt keys
# What checking a step's rows by their prompts costs at B = 1,024 prompts of n = 8 responses,
# against verl's own _balance_batch + compute_advantage (grpo) on that step's B x n responses (a
# small part of verl's step, which also generates, scores and trains on them: the share of the
# step is smaller still). v1: LZERLHFDataset's check of the items of the step's fetch (hash each
# prompt, compare with its row's key); legacy with LZERLHFDataset: that, and _get_gen_batch's
# check of the bound prompts.

KEY_RESULTS, KEY_TABLE = "verl_prompt_keys.json", "verl_prompt_keys.md"  # run_file names
KEY_CASE = (1024, 8, 256)  # (prompts, rollouts, length)
KEY_ROUNDS = 15


def test_prompt_key_cost():
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

    num_prompts, group, length = KEY_CASE
    rows = np.random.default_rng(0).permutation(4 * num_prompts)[:num_prompts]
    table = RowTable(prompt_keys(gsm8k_like(range(4 * num_prompts))), np.arange(4 * num_prompts))
    prompts = gsm8k_like(rows)
    items = [{"index": int(row), "raw_prompt": prompt} for row, prompt in zip(rows, prompts)]
    plain, batches = trainer(RayPPOTrainer, num_prompts, group), Batches(num_prompts, group, length)
    algo = AlgoConfig(norm_adv_by_std_in_grpo=True)

    def verl_step():
        batch = batches(plain)
        start = time.perf_counter()
        plain._balance_batch(batch, metrics={})
        batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
        compute_advantage(batch, adv_estimator="grpo", config=algo)
        return time.perf_counter() - start

    def fetched_and_bound():
        table.check_items(items)
        table.check(rows, prompt_keys(prompts))

    timed = {"v1": lambda: _seconds(table.check_items, items),
             "legacy": lambda: _seconds(fetched_and_bound), "verl": verl_step}
    times = {name: [] for name in timed}
    gc.collect()
    gc.disable()
    try:
        for round_ in range(KEY_ROUNDS + 1):  # round 0 warms up
            for name in rotated(list(timed), round_):
                seconds = timed[name]()
                if round_:
                    times[name].append(seconds)
    finally:
        gc.enable()
    medians = {f"{name}_s": statistics.median(values) for name, values in times.items()}
    shares = {name: medians[f"{name}_s"] / medians["verl_s"] for name in ("v1", "legacy")}
    result = {**medians, **{f"{name}_share": share for name, share in shares.items()},
              "meets_goal": {name: share < 0.01 for name, share in shares.items()},
              "rounds": KEY_ROUNDS, "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg()}
    key = f"verl prompt keys B{num_prompts} G{group} T{length}"
    merge_result(run_file(KEY_RESULTS), key, result)
    print(key, json.dumps(result))
    _write_key_table()


def _write_key_table() -> None:
    """results/verl_prompt_keys.md from results/verl_prompt_keys.json."""
    with open(run_file(KEY_RESULTS)) as f:
        table = json.load(f)
    lines = ["| B x n | T | trainer: where the prompts are checked | the check | verl's "
             "_balance_batch + compute_advantage (grpo) | share |", "|---|---|---|---|---|---|"]
    for key, r in sorted(table.items()):
        b, g, t = (p[1:] for p in key.split()[3:])
        for name, what in (("v1", "v1: LZERLHFDataset's fetch"),
                           ("legacy", "legacy with LZERLHFDataset: its fetch and _get_gen_batch")):
            lines.append(f"| {b} x {g} | {t} | {what} | {1e3 * r[f'{name}_s']:.3g} ms | "
                         f"{1e3 * r['verl_s']:.3g} ms | {100 * r[f'{name}_share']:.2g} % "
                         f"(load {r['load_average'][0]:.1f}) |")
    with open(run_file(KEY_TABLE), "w") as f:
        f.write("\n".join(lines) + "\n")

"""Cost of LZE selection inside the trainers' loops (integrations), written to
results/integrations.json and printed; report.py (the kernel benchmark report) does not read it.

* verl: what a verl user chooses between, on the same inputs (token-level rewards ``[bs, T]``, an
  int64 response mask, fresh uuid4 uid strings every round as verl's ``fit`` makes them, in a
  numpy object array, uids grouped or shuffled as ``balance_batch`` leaves them):

  - ``verl loop``: the installed verl's ``compute_grpo_outcome_advantage``
    (``adv_estimator=grpo``; dict of uid lists, per-group torch mean/std, per-response writes);
  - ``verl vectorised``: the installed verl's ``compute_grpo_vectorized_outcome_advantage``
    (``adv_estimator=grpo_vectorized``);
  - ``LZEAdvantage`` with ``method="lze"`` and ``"dapo"``, and its kernels alone (the fused
    selector step, resp. the DAPO keep mask and GRPO advantages, on the ``[B, G]`` rewards);
  - ``floor``: the two ``[bs, T]`` passes any estimator with verl's contract makes,
    ``token_level_rewards.sum(-1)`` and the masked broadcast ``A.unsqueeze(-1) * mask``.

  Medians over rounds of fresh uids on the same tensors, the estimators in turn within each
  round (verl's loop afterwards on its own, fewer rounds at large sizes); the results table
  goes to results/verl_estimators.md. The verl cases need verl (they run in .venv-verl:
  ``.venv-verl/bin/python -m pytest benchmarks/test_bench_integrations.py -k verl``) and skip
  elsewhere. Goal: the adapter faster than ``grpo_vectorized`` and
  within 1.5x the floor + 0.5 ms. The adapter's outputs are checked against both verl
  estimators on one batch of each case, and its selection against LZE's host loop
  (baselines.PythonLoopSelector, the public release's way).
* TRL: seconds per training step of ``GRPOTrainer`` and of ``LZEGRPOTrainer`` (method "lze",
  keep_ratio 0.4) on a tiny Qwen2, and the time of the selection hook alone.

Each entry records the load average and torch's thread count: on a 2-core machine shared with
other jobs, two OpenMP threads per op made small torch ops 10-100x slower (barrier waits), so
measure there with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch
from baselines import PythonLoopSelector, _group_mean_std
from bench_common import merge_result

from lze_kernels import LZEConfig, LZESelector, ops

RESULTS = os.path.join(os.path.dirname(__file__), "results", "integrations.json")
VERL_TABLE = os.path.join(os.path.dirname(__file__), "results", "verl_estimators.md")
VERL_CASES = ((128, 8), (512, 8), (1024, 16), (4096, 16))  # (prompts, responses per prompt)
RESPONSE_LENGTHS = (256, 2048)
ORDERS = ("grouped", "shuffled")
ROUNDS = 15
SMALL_CASE_ROUNDS, SMALL_CASE_ELEMENTS = 51, 1 << 21  # more rounds where bs * T is small
LOOP_ROUNDS = 3  # verl's loop where bs >= LOOP_FEW_ROUNDS_FROM (seconds per call)
LOOP_FEW_ROUNDS_FROM = 16384
ESTIMATORS = ("floor", "verl_vectorized", "lze", "dapo", "lze_kernels", "dapo_kernels",
              "verl_loop")  # the loop last, timed on its own


def _record(key: str, value: dict) -> None:
    value = {**value, "load_average": os.getloadavg()}
    merge_result(RESULTS, key, value)
    print(key, json.dumps(value))


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- verl


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
    """The two [bs, T] passes: response scores, then a per-response value broadcast by mask."""
    return token_rewards.sum(dim=-1).unsqueeze(-1) * mask


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
    _record(f"verl B{num_prompts} G{group} T{length} {order}",
            {**medians, "budget_s": budget, "meets_goal": goal,
             "backend": adapters["lze"].selector.backend, "rounds": _rounds(bs, length),
             "torch_threads": torch.get_num_threads()})
    _write_verl_table()


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
            for name in names:
                args = (token_rewards, mask, index) + ((rows,) if name in ("lze", "dapo") else ())
                seconds = _seconds(timed[name], *args)
                if round_:
                    times[name].append(seconds)
    finally:
        gc.enable()
    return {f"{name}_s": statistics.median(values) for name, values in times.items()}


def _write_verl_table() -> None:
    """results/verl_estimators.md from the verl cases in results/integrations.json."""
    with open(RESULTS) as f:
        table = {key: value for key, value in json.load(f).items() if key.startswith("verl B")}
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
    with open(VERL_TABLE, "w") as f:
        f.write("\n".join(lines) + "\n")


def _case_order(key: str):
    b, g, t, order = key.split()[1:]
    return int(b[1:]) * int(g[1:]), int(t[1:]), order


# ----------------------------------------------------------------------------- TRL


TRL_PROMPTS = [f"What is {a} + {b}?" for a in range(8) for b in range(4)]
TRL_GROUP, TRL_PROMPTS_PER_STEP, TRL_STEPS, TRL_WARMUP = 8, 8, 5, 1


def _trl_trainer(tmp_path, model_dir, integration: bool):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lze_kernels.integrations.trl import LZEGRPOTrainer

    def reward(completions, **_):  # text-dependent: mixed and uniform groups both occur
        return [float(len(c) % 3 == 0) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=TRL_GROUP,
                      per_device_train_batch_size=TRL_GROUP * TRL_PROMPTS_PER_STEP,
                      max_completion_length=16, max_steps=TRL_WARMUP + TRL_STEPS,
                      logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                      disable_tqdm=True, seed=0)
    kwargs = dict(model=model_dir, reward_funcs=reward, args=args,
                  train_dataset=Dataset.from_dict({"prompt": TRL_PROMPTS}))
    if not integration:
        return GRPOTrainer(**kwargs)

    class TimedTrainer(LZEGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.selection_seconds = []

        def _select_groups(self, inputs, output):
            start = time.perf_counter()
            super()._select_groups(inputs, output)
            self.selection_seconds.append(time.perf_counter() - start)

    return TimedTrainer(**kwargs, lze_config=LZEConfig(keep_ratio=0.4))


def test_trl_step_time_with_and_without_integration(tmp_path):
    pytest.importorskip("trl")
    from lze_trainer import tiny_model

    model_dir = str(tiny_model.build("tiny:qwen2?hidden=128&layers=2&heads=4&kv_heads=2&vocab=400",
                                     tmp_path / "model", TRL_PROMPTS + [str(n) for n in range(20)]))
    seconds = {}
    for name, integration in (("grpo_trainer", False), ("lze_grpo_trainer", True)):
        trainer = _trl_trainer(tmp_path / name, model_dir, integration)
        trainer.train()
        steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
        seconds[name] = statistics.median(steps[TRL_WARMUP:])
        if integration:
            seconds["selection_hook"] = statistics.median(trainer.selection_seconds[TRL_WARMUP:])
            seconds["kept_ratio"] = statistics.mean(
                h["lze/kept_ratio"] for h in trainer.state.log_history if "lze/kept_ratio" in h)
    _record(f"trl tiny-qwen2 h128 B{TRL_PROMPTS_PER_STEP} G{TRL_GROUP} T16",
            {**seconds, "torch_threads": torch.get_num_threads()})

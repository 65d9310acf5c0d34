"""Cost of the legacy verl hook per step against what verl itself runs there, on the same batch.

verl 0.9.1's legacy ``fit`` runs ``_balance_batch`` (a Karmarkar-Karp partition of the responses
over the data-parallel ranks, then a reorder of every field) and later ``compute_advantage``
(``adv_estimator=grpo``) on all ``B x n`` responses. ``LZERayPPOTrainer`` runs its selection in
``_balance_batch`` (the registered estimator's fused step on the rewards, the cut of every field to
the kept groups' rows), then verl's own ``_balance_batch`` and ``compute_advantage`` on the cut
batch. Timed per step, on a batch of the fields a rollout leaves (``input_ids``,
``attention_mask``, ``position_ids``, ``prompts``, ``responses``, ``response_mask``,
``rollout_log_probs``, ``rm_scores``), fresh uuid4 uids each round, 8 data-parallel ranks:

- ``verl``: ``RayPPOTrainer._balance_batch`` + ``compute_advantage(grpo)`` on the whole batch;
- ``LZE hook``: ``LZERayPPOTrainer._balance_batch`` + ``compute_advantage`` with the registered
  ``LZEAdvantage`` (keep_ratio 0.5) on the kept rows.

Goal: the hook no slower than verl's own step. Medians over rounds, the two in turn within each
round; results/verl_hook.md. Needs verl (``.venv-verl/bin/python -m pytest
benchmarks/test_bench_verl_hook.py``); skips elsewhere.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import types
import uuid

import numpy as np
import pytest
import torch
from bench_common import merge_result
from omegaconf import OmegaConf

from lze_kernels import LZEConfig

RESULTS = os.path.join(os.path.dirname(__file__), "results", "integrations.json")
TABLE = os.path.join(os.path.dirname(__file__), "results", "verl_hook.md")
CASES = ((128, 8, 256), (128, 8, 1024), (512, 8, 256))  # (prompts, rollouts, response length)
PROMPT_LENGTH, DP_SIZE, ROUNDS = 128, 8, 15
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

    def __call__(self, hook):
        """``(batch, rows_by_uid)``: the step's uids bound to dataset rows (``_get_gen_batch``)."""
        uids = np.array([str(uuid.uuid4()) for _ in range(self.num_prompts)], dtype=object)
        batch = self.DataProto.from_dict({k: v.clone() for k, v in self.tensors.items()},
                                         non_tensors={"uid": np.repeat(uids, self.group)})
        hook._rows_by_uid = dict(zip(uids.tolist(), self.rows.tolist()))
        return batch


@pytest.mark.parametrize("num_prompts, group, length", CASES)
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
        for round_ in range(ROUNDS + 1):  # round 0 warms up
            for name, run in timed.items():
                batch = batches(hook)
                start = time.perf_counter()
                rows[name] = run(batch)
                if round_:
                    times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
        ADV_ESTIMATOR_REGISTRY.pop(ESTIMATOR, None)
    medians = {f"{name}_s": statistics.median(values) for name, values in times.items()}
    result = {**medians, "rows": rows, "rounds": ROUNDS, "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg()}
    key = f"verl hook B{num_prompts} G{group} T{length}"
    merge_result(RESULTS, key, result)
    print(key, json.dumps(result))
    _write_table()
    assert rows == {"verl": num_prompts * group, "hook": num_prompts * group // 2}


def _write_table() -> None:
    with open(RESULTS) as f:
        table = {k: v for k, v in json.load(f).items() if k.startswith("verl hook ")}
    lines = ["| B x n | T | verl: _balance_batch + grpo advantages | LZE hook: select, cut, "
             "verl's balance + advantages of the kept rows | rows after | hook / verl |",
             "|---|---|---|---|---|---|"]
    for key, r in sorted(table.items(), key=lambda kv: [int(p[1:]) for p in kv[0].split()[2:]]):
        b, g, t = (p[1:] for p in key.split()[2:])
        lines.append(f"| {b} x {g} | {t} | {1e3 * r['verl_s']:.3g} ms | {1e3 * r['hook_s']:.3g} "
                     f"ms | {r['rows']['verl']} -> {r['rows']['hook']} | "
                     f"{r['hook_s'] / r['verl_s']:.2f} (load {r['load_average'][0]:.1f}) |")
    with open(TABLE, "w") as f:
        f.write("\n".join(lines) + "\n")

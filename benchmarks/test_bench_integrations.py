"""Cost of LZE selection inside the trainers' loops (integrations), written to
results/integrations.json and printed; report.py (the kernel benchmark report) does not read it.

* verl: ``LZEAdvantage`` (one vectorised uid grouping, fused kernels) against verl's host loop on
  the same tensors: its ``compute_grpo_outcome_advantage`` (dict of uid lists, per-group torch
  mean/std, per-response writes; baselines.py) plus LZE's selection the way the public release
  runs it (``.item()`` per prompt, Python state and sort; baselines.PythonLoopSelector). Fresh
  uuid uids every round, as verl's ``fit`` makes them.
* TRL: seconds per training step of ``GRPOTrainer`` and of ``LZEGRPOTrainer`` (policy "lze",
  keep_ratio 0.4) on a tiny Qwen2, and the time of the selection hook alone.

Each entry records the load average and torch's thread count: on a 2-core machine shared with
other jobs, two OpenMP threads per op made small torch ops 10-100x slower (barrier waits), so
measure there with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

import numpy as np
import pytest
import torch
from baselines import PythonLoopSelector, _group_mean_std, _write_advantages
from bench_common import merge_result

from lze_kernels import LZEConfig

RESULTS = os.path.join(os.path.dirname(__file__), "results", "integrations.json")
VERL_CASES = ((128, 8), (512, 8), (1024, 16))  # (prompts, responses per prompt)
RESPONSE_LENGTH = 256
ROUNDS = 7


def _record(key: str, value: dict) -> None:
    value = {**value, "load_average": os.getloadavg()}
    merge_result(RESULTS, key, value)
    print(key, json.dumps(value))


def _median_seconds(fn, make_args, rounds=ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        args = make_args()
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------- verl


class VerlBatches:
    """verl-shaped inputs: token-level outcome rewards, response mask, fresh uids, dataset rows."""

    def __init__(self, num_prompts: int, group: int, seed: int = 0):
        self.num_prompts, self.group = num_prompts, group
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)

    def __call__(self):
        g, bs = self.generator, self.num_prompts * self.group
        uids = np.array([str(uuid.uuid4()) for _ in range(self.num_prompts)], dtype=object)
        rows = self.rng.permutation(4 * self.num_prompts)[: self.num_prompts]
        order = self.rng.permutation(bs)  # verl's balance_batch reorders responses
        p = torch.rand(self.num_prompts, 1, generator=g)
        scores = (torch.rand(self.num_prompts, self.group, generator=g) < p).float().reshape(-1)
        lengths = torch.randint(1, RESPONSE_LENGTH + 1, (bs,), generator=g)
        mask = (torch.arange(RESPONSE_LENGTH)[None, :] < lengths[:, None]).to(torch.int64)
        token_rewards = torch.zeros(bs, RESPONSE_LENGTH)
        token_rewards[torch.arange(bs), lengths - 1] = scores
        index = np.repeat(uids, self.group)[order]
        return (token_rewards[order], mask[order], index,
                np.repeat(rows, self.group)[order].astype(object))


def verl_host_loop(selector: PythonLoopSelector, token_rewards, mask, index, rows):
    """verl's GRPO advantage loop, then LZE's selection over the uid groups in Python."""
    scores = token_rewards.sum(dim=-1)
    id2mean, id2std = _group_mean_std(scores, index)
    row_of_uid = dict(zip(index, rows))
    uids = sorted(id2mean)  # the adapter's group order, so both draw the same noise per group
    energy = [selector._update_prompt(selector.state[row_of_uid[uid]], id2mean[uid].item())[0]
              for uid in uids]
    selector.steps_done += 1
    kept = {uids[i] for i in selector._top_k(energy)}
    keep_mask = torch.tensor([uid in kept for uid in index])
    _write_advantages(scores, index, id2mean, id2std, selector.config)
    return scores.unsqueeze(-1) * mask, keep_mask


@pytest.mark.parametrize("num_prompts, group", VERL_CASES)
def test_verl_adapter_vs_host_loop(num_prompts, group):
    from lze_kernels.integrations.verl import LZEAdvantage

    config = LZEConfig()
    adapter = LZEAdvantage(4 * num_prompts, config)
    loop = PythonLoopSelector(config)

    batch = VerlBatches(num_prompts, group)()  # like for like: same outputs on one batch
    advantages, _ = adapter(*batch[:3], prompt_index=batch[3])
    loop_advantages, loop_keep = verl_host_loop(loop, *batch)
    torch.testing.assert_close(advantages, loop_advantages, rtol=1e-6, atol=1e-6)
    assert torch.equal(adapter.last.keep_mask, loop_keep)

    def adapter_step(token_rewards, mask, index, rows):
        return adapter(token_rewards, mask, index, prompt_index=rows)

    fused = _median_seconds(adapter_step, VerlBatches(num_prompts, group, seed=1))
    host = _median_seconds(lambda *args: verl_host_loop(loop, *args),
                           VerlBatches(num_prompts, group, seed=1))
    _record(f"verl B{num_prompts} G{group} T{RESPONSE_LENGTH}",
            {"adapter_s": fused, "host_loop_s": host, "speedup": host / fused,
             "backend": adapter.selector.backend})


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

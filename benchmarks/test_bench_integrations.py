"""Cost of LZE selection inside the trainers' loops (integrations), written to
integrations.json in the run folder and printed; report.py (the kernel benchmark report) does not read it.
(verl's: benchmarks/test_bench_verl_hook.py, run in .venv-verl.)

* TRL: seconds per training step of ``GRPOTrainer`` and of ``LZEGRPOTrainer`` (method "lze",
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

import pytest
import torch
from bench_common import merge_result, run_file

from lze_kernels import LZEConfig



def _record(key: str, value: dict) -> None:
    value = {**value, "load_average": os.getloadavg()}
    merge_result(run_file("integrations.json"), key, value)
    print(key, json.dumps(value))


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

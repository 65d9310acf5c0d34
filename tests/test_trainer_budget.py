"""Equal-compute runs: the FLOPs budget that ends a run, held-out points at FLOPs, and the
held-out pass that samples greedy and sampled answers in one engine call."""

from types import SimpleNamespace

import pytest
import torch

from lze_trainer import config as C
from lze_trainer import tiny_model
from lze_trainer.compute import ComputeLedger
from lze_trainer.evaluate import evaluate
from lze_trainer.prompts import PromptSet
from lze_trainer.rollout.base import Completion, SamplingSpec, per_prompt
from lze_trainer.trainer import GRPOTrainer


def _trainer(step: int, spent: float, *overrides: str):
    """The run-loop state the trainer's budget checks read (no engine, no process group)."""
    ledger = ComputeLedger()
    ledger.totals["flops"] = spent
    t = SimpleNamespace(cfg=C.load("tiny", list(overrides)), step=step, ledger=ledger)
    t._due = lambda every: GRPOTrainer._due(t, every)
    return t


def test_the_budget_ends_the_run_at_the_first_step_that_reaches_it():
    finished = GRPOTrainer.finished.fget
    capped = ["trainer.total_steps=10"]
    assert not finished(_trainer(3, 299.0, *capped, "trainer.flops_budget=300"))
    assert finished(_trainer(3, 300.0, *capped, "trainer.flops_budget=300"))
    assert finished(_trainer(10, 10.0, *capped, "trainer.flops_budget=300"))  # the step cap
    assert not finished(_trainer(9, 1e30, *capped))  # no budget: steps only


def test_held_out_points_at_flops_are_taken_where_a_step_crosses_them():
    points = "trainer.eval_at_flops=[100,200,300]"
    due = GRPOTrainer._eval_due
    assert due(_trainer(2, 120.0, points), spent_before=90.0)
    assert not due(_trainer(3, 190.0, points), spent_before=120.0)
    assert due(_trainer(4, 200.0, points), spent_before=190.0)  # reaching a point crosses it
    assert due(_trainer(5, 450.0, points), spent_before=200.0)  # one step over two points
    # Without points, every eval_every steps as before.
    assert due(_trainer(4, 0.0, "trainer.eval_every=2"), spent_before=0.0)
    assert not due(_trainer(3, 0.0, "trainer.eval_every=2"), spent_before=0.0)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.flops_budget=0"], "trainer.flops_budget: expected null or a float > 0"),
    (["trainer.eval_at_flops=[3,1]"], "trainer.eval_at_flops: expected distinct positive"),
    (["trainer.eval_at_flops=[1,1]"], "trainer.eval_at_flops: expected distinct positive"),
    (["trainer.eval_at_flops=[-1]"], "trainer.eval_at_flops: expected distinct positive"),
])
def test_bad_budgets_are_named(overrides, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(")):
        C.load("tiny", overrides)


def test_one_spec_or_one_per_prompt():
    greedy, sampled = SamplingSpec(0.0, 1.0, 4), SamplingSpec(1.0, 1.0, 4)
    assert per_prompt(greedy, 3) == [greedy] * 3
    assert per_prompt([greedy, sampled], 2) == [greedy, sampled]
    with pytest.raises(ValueError, match="spec: expected one SamplingSpec or 3"):
        per_prompt([greedy, sampled], 3)


class _RecordingEngine:
    """Answers every prompt with its last token id, and records each call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, counts, spec, seed):
        self.calls.append((list(prompts), list(counts), per_prompt(spec, len(prompts))))
        return [[Completion([p[-1]], [0.0], False)] * n for p, n in zip(prompts, counts)]


def test_a_held_out_pass_is_one_engine_call_for_greedy_and_sampled(monkeypatch):
    cfg = C.load("tiny", ["rollout.eval_samples=3"])
    prompt_set = PromptSet("heldout", [{"answer": a} for a in ("1", "x", "3", "x")],
                           [[1], [2], [3], [4]])
    scorer = SimpleNamespace(score=lambda texts, rows: SimpleNamespace(
        rewards=[float(t == r["answer"]) for t, r in zip(texts, rows)]))
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids[0]))
    engine = _RecordingEngine()
    monkeypatch.setattr("lze_trainer.evaluate.D.all_reduce_many", lambda values: values)
    world = SimpleNamespace(size=1, rank=0)
    results = evaluate(engine, [prompt_set], scorer, tokenizer, cfg, world, shard=0, seed=0)
    (prompts, counts, specs), = engine.calls
    assert prompts == [[1], [2], [3], [4]] * 2 and counts == [1] * 4 + [3] * 4
    assert [s.temperature for s in specs] == [0.0] * 4 + [cfg.rollout.eval_temperature] * 4
    assert results["eval/heldout/pass@1"] == 0.5 and results["eval/heldout/sampled_acc"] == 0.5
    assert results["eval/heldout/n"] == 4.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = "tiny:qwen2?hidden=32&layers=1&heads=2&kv_heads=1&vocab=300"
    return str(tiny_model.build(spec, tmp_path_factory.mktemp("model"),
                                ["Calculate 1 + 2.", "3"] * 50))


def test_hf_engine_samples_each_prompt_with_its_own_spec(model_dir):
    """Greedy answers in a mixed call equal a greedy-only call's; sampled rows stay sampled."""
    from lze_trainer.rollout.hf_engine import HFEngine

    engine = HFEngine(C.load("tiny", ["model.dtype=float32"]), model_dir,
                      SimpleNamespace(device=torch.device("cpu")))
    prompts = [[5, 6, 7], [8, 9], [10]]
    greedy, sampled = SamplingSpec(0.0, 1.0, 6), SamplingSpec(1.0, 1.0, 6)
    alone = engine.generate(prompts, [1, 1, 1], greedy, seed=3)
    mixed = engine.generate(prompts * 2, [1, 1, 1, 4, 4, 4], [greedy] * 3 + [sampled] * 3, seed=3)
    assert [[c.token_ids for c in g] for g in mixed[:3]] == [[c.token_ids for c in g]
                                                            for g in alone]
    assert [len(g) for g in mixed] == [1, 1, 1, 4, 4, 4]
    assert any(len({tuple(c.token_ids) for c in g}) > 1 for g in mixed[3:])

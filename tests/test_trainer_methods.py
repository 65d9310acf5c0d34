"""The forward-selection methods of the trainer (lze_trainer.methods) on hand-made histories:
which prompts are screened, skipped, dropped or chosen, with known values; no engines (a fake
generation service whose prompts have fixed outcomes), one process."""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from lze_trainer import config as C
from lze_trainer import methods
from lze_trainer.batch import RolloutGroup
from lze_trainer.compute import ComputeLedger
from lze_trainer.data import PromptSampler
from lze_trainer.generation import GatheredGroups
from lze_trainer.methods.lze_schedule import release_keep_ratio
from lze_trainer.methods.speed import is_mixed
from lze_trainer.rollout import Completion
from lze_trainer.selection import GroupSelector

N = 30


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """The methods' collectives, on a world of one."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def outcome(prompt_id: int, count: int) -> list[float]:
    """Fixed rewards: ids = 0 mod 3 always right, 1 mod 3 always wrong, 2 mod 3 half right."""
    kind = prompt_id % 3
    return [1.0] * count if kind == 0 else [0.0] * count if kind == 1 else \
        [float(j % 2 == 0) for j in range(count)]


class FakeGeneration:
    """The generation service's interface (lze_trainer.generation.Generation) on one shard."""

    class World:
        rank, size, device, is_main = 0, 1, torch.device("cpu"), True

    class Train:
        token_ids = [[1, 2, 3 + i % 5] for i in range(N)]

    def __init__(self, outcome=outcome):
        self.world, self.train, self.ledger = self.World(), self.Train(), ComputeLedger()
        self.shard, self.num_shards, self.tp = 0, 1, 1
        self.outcome = outcome  # (prompt id, count, call number) -> rewards
        self.calls = []  # (purpose, prompt ids, counts): one per purpose of each engine call
        self.engine_calls = 0

    def local_rows(self, n):
        return range(n)

    def generate_and_score(self, prompt_ids, counts, purpose, rows=None, round=0):
        rows = list(range(len(prompt_ids))) if rows is None else list(rows)
        purposes = [purpose] * len(prompt_ids) if isinstance(purpose, str) else list(purpose)
        self.engine_calls += 1
        groups = []
        for row, pid, count in zip(rows, prompt_ids, counts):
            responses = [Completion([7, pid, j], [-0.5] * 3, False) for j in range(count)]
            groups.append(RolloutGroup(row, pid, self.train.token_ids[pid], responses,
                                       self.outcome(pid, count)))
        for kind in dict.fromkeys(purposes):
            mine = [(pid, c) for pid, c, p in zip(prompt_ids, counts, purposes) if p == kind]
            self.calls.append((kind, [pid for pid, _ in mine], [c for _, c in mine]))
            self.ledger.add_rollouts(kind, 0, sum(c * 3 for _, c in mine),
                                     sum(c for _, c in mine), len(mine))
        return groups

    def gather(self, groups, n, width):
        rewards, valid = torch.zeros(n, width), torch.zeros(n, width, dtype=torch.bool)
        for g in groups:
            rewards[g.row, :len(g.rewards)] = torch.tensor(g.rewards)
            valid[g.row, :len(g.rewards)] = True
        return GatheredGroups(rewards, valid, valid.to(torch.int32) * 3)


def build(policy, *overrides, generation=None):
    cfg = C.load("tiny", [f"selection.method={policy}", "selection.noise_scale=0",
                          "trainer.batch_size=6", "rollout.n=4",
                          "selection.speed.screen_rollouts=2", *overrides])
    device = torch.device("cpu")
    return methods.build(methods.MethodContext(
        cfg=cfg, num_prompts=N, device=device, selector=GroupSelector(cfg, N, device),
        sampler=PromptSampler(N, seed=0), generation=generation or FakeGeneration()))


def run_step(method, step):
    plan = method.plan(step)
    groups = method.collect(plan)
    width = method.ctx.cfg.rollout.n
    batch = methods.StepBatch(plan, groups, method.ctx.generation.gather(groups, len(plan.counts),
                                                                         width))
    selection = method.select(batch, step)
    method.observe(batch, selection)
    return plan, groups, selection


# ---------------------------------------------------------------- the LZE release's schedule

def test_release_schedule_known_values():
    ratios = [release_keep_ratio(e, target=0.7, floor=0.3, ramp_epochs=3) for e in range(5)]
    assert ratios == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.7])
    assert release_keep_ratio(5, target=0.2, floor=0.3, ramp_epochs=2) == pytest.approx(0.3)


def test_release_schedule_keeps_the_mixed_groups_in_the_first_epoch_then_top_k():
    method = build("lze", "selection.keep_ratio_schedule=release",
                   "selection.schedule.ramp_epochs=1", "selection.schedule.target=0.5",
                   "selection.schedule.floor=0.5")
    for step in range(N // 6):  # epoch 0: five steps of 6 prompts, exactly the mixed ones kept
        plan, _, selection = run_step(method, step)
        assert selection.keep_mask.tolist() == [pid % 3 == 2 for pid in plan.prompt_ids.tolist()]
    _, _, selection = run_step(method, N // 6)  # epoch 1: k = floor(6 x 0.5)
    assert int(selection.keep_mask.sum()) == 2  # only the 2 mixed prompts have E > 0 ...
    assert (selection.energy[selection.keep_mask] > 0).all()  # ... E = 0 never fills the quota


# ---------------------------------------------------------------- SPEED

def test_is_mixed():
    assert is_mixed([1.0, 0.0]) and not is_mixed([1.0, 1.0]) and not is_mixed([0.0])


def test_speed_screens_then_continues_only_mixed_prompts():
    # B = 6, a third of the prompts mixed, 6 screened per call: each call after the first
    # continues the previous call's 2 accepted prompts together with the next screening.
    method = build("speed", "selection.speed.screen_rollouts=2", "selection.fill.factor=1.0")
    plan, groups, selection = run_step(method, 0)
    generation = method.ctx.generation
    screened = [c for c in generation.calls if c[0] == "screening"]
    continued = [c for c in generation.calls if c[0] == "continuation"]
    assert generation.engine_calls == len(screened) == 4 and len(continued) == 3
    assert all(set(counts) == {2} for _, _, counts in screened + continued)  # n - screen = 2
    accepted = [pid for _, ids_, _ in continued for pid in ids_]
    assert all(pid % 3 == 2 for pid in accepted)
    for g in groups:  # full groups: the screening rollouts come first and are kept
        assert len(g.responses) == 4 and [c.token_ids[2] for c in g.responses] == [0, 1, 0, 1]
    ids = plan.prompt_ids.tolist()
    assert len(set(ids)) == 6 and set(ids) <= set(accepted)  # distinct, fixed shape B
    assert plan.counts == [4] * 6 and selection.keep_mask.all()
    screened_ids = [pid for _, ids_, _ in screened for pid in ids_]
    assert len(screened_ids) == len(set(screened_ids))  # each drawn once from the sampler
    # complete groups beyond B, and the last call's accepted prompts (waiting for their
    # continuation), are carried to the next step
    waiting = sum(pid % 3 == 2 for pid in screened[-1][1])
    assert method.step_metrics()["fill/carried_groups"] == len(accepted) - 6 + waiting


def test_speed_trains_once_the_batch_is_complete():
    method = build("speed", "selection.speed.screen_rollouts=2", "selection.fill.factor=3.0")
    plan, _, _ = run_step(method, 0)
    calls = method.ctx.generation.calls
    # 18 screened, 6 of them mixed; the next call completes them (and screens 18 more)
    assert [c[0] for c in calls] == ["screening", "continuation", "screening"]
    assert plan.counts == [4] * 6


def test_speed_prefilter_skips_prompts_whose_screening_had_no_variance():
    method = build("speed", "selection.speed.prefilter=greso", "selection.greso.initial=0.05",
                   "selection.greso.step=0", "selection.speed.screen_rollouts=2",
                   "selection.fill.max_rounds=1", "selection.fill.factor=5.0")
    run_step(method, 0)  # no history: the 30 candidates are all screened
    first = [pid for c in method.ctx.generation.calls if c[0] == "screening" for pid in c[1]]
    assert sorted(first) == list(range(N))
    streak = method.chooser.filter.streak  # the screening rewards fed the streaks
    assert streak.tolist() == [0 if i % 3 == 2 else 1 for i in range(N)]
    assert method.step_metrics()["fill/capped"] == 1  # one round: nothing complete yet
    method.ctx.generation.calls.clear()
    run_step(method, 1)
    calls = method.ctx.generation.calls
    second = [pid for c in calls if c[0] == "screening" for pid in c[1]]
    continued = [pid for c in calls if c[0] == "continuation" for pid in c[1]]
    # the 10 mixed prompts, carried, are continued; all-right / all-wrong ones are screened
    # again with p = 0.05 only
    assert sorted(continued) == [i for i in range(N) if i % 3 == 2]
    assert len(second) <= 5 and not set(second) & set(continued)
    assert method.step_metrics()["greso/streaking_prompts"] >= 15
    other = build("speed", "selection.speed.prefilter=greso", "selection.speed.screen_rollouts=2")
    other.load_state_dict(method.state_dict())
    assert torch.equal(other.chooser.filter.streak, method.chooser.filter.streak)


def test_speed_prefilter_draws_on_past_skipped_candidates():
    method = build("speed", "selection.speed.prefilter=greso", "selection.greso.initial=0.05")
    chooser = method.chooser
    hard = torch.tensor([i for i in range(N) if i % 3 != 2])
    chooser.filter.streak[hard] = 5  # kept with probability max(0.05 ** 5, 0.01) = 0.01
    chooser.filter.kind[hard] = 2
    drawn = chooser.draw(6, set())
    assert len(drawn) == 6 and len(set(drawn)) == 6
    assert sum(pid % 3 == 2 for pid in drawn) >= 5  # the sampler went on past the skipped
    excluded = set()
    for _ in range(4):  # drawing on crosses epochs: distinct within a step, at most one pass
        more = chooser.draw(8, excluded)
        assert len(more) <= 8 and not set(more) & (set(drawn) - set(more))
        drawn = drawn + more if len(excluded) < N else more
    assert len(excluded) == N


def test_speed_with_top_energy_trains_only_the_top_k_of_its_screened_batch():
    method = build("speed", "selection.speed.screen_rollouts=2", "selection.fill.factor=3.0",
                   "selection.keep_top_energy=true", "selection.keep_ratio=0.5")
    plan, _, selection = run_step(method, 0)
    assert plan.counts == [4] * 6  # the batch is full of mixed groups ...
    assert int(selection.keep_mask.sum()) == 3  # ... and floor(6 x 0.5) of them are trained
    assert (selection.energy[selection.keep_mask] > 0).all()


@pytest.mark.parametrize("method", ["grpo", "dapo", "lze"])
def test_keep_top_energy_only_with_a_forward_method(method):
    with pytest.raises(ValueError, match="selection.keep_top_energy"):
        C.load("tiny", [f"selection.method={method}", "selection.keep_top_energy=true"])


def test_speed_prefilter_only_with_speed():
    with pytest.raises(ValueError, match="selection.speed.prefilter"):
        C.load("tiny", ["selection.method=lze", "selection.speed.prefilter=greso"])


# ---------------------------------------------------------------- GRESO

def test_greso_skips_prompts_with_long_zero_variance_streaks():
    method = build("greso", "selection.greso.initial=0.05", "selection.greso.step=0",
                   "selection.fill.factor=1.0", "trainer.batch_size=30")
    plan, _, selection = run_step(method, 0)
    assert plan.counts == [4] * 30  # no history: everything is rolled out ...
    assert int(selection.keep_mask.sum()) == 10  # ... and only mixed groups are trained
    streak = method.chooser.filter.streak
    assert streak.tolist() == [0 if i % 3 == 2 else 1 for i in range(N)]
    plan, _, _ = run_step(method, 1)
    kept = {int(p) for p, c in zip(plan.prompt_ids, plan.counts) if c}
    # Mixed prompts are always kept; zero-variance ones with p = 0.05 only rarely.
    assert {i for i in range(N) if i % 3 == 2} <= kept
    assert len(kept) <= 10 + 5
    metrics = method.step_metrics()
    assert metrics["greso/p_easy"] == pytest.approx(0.05)


def test_greso_state_round_trips():
    method = build("greso")
    run_step(method, 0)
    other = build("greso")
    other.load_state_dict(method.state_dict())
    assert torch.equal(other.chooser.filter.streak, method.chooser.filter.streak)
    assert torch.equal(other.chooser.filter.p, method.chooser.filter.p)


# HIVE: tests/test_hive.py


# ---------------------------------------------------------------- DOTS

def test_dots_rolls_out_references_then_samples_prompts_near_half():
    method = build("dots", "selection.dots.reference_size=9", "selection.dots.every=2",
                   "selection.dots.calibrate=false", "selection.dots.attention_tau=0.1",
                   "selection.dots.predictor=false")  # the trained predictor: test_dots_predictor
    chooser = method.chooser
    # Fixed embeddings: one direction per outcome kind (id mod 3), as if the encoder knew it.
    chooser.embeddings = torch.nn.functional.one_hot(torch.arange(N) % 3, 3).float() * 5
    plan, _, _ = run_step(method, 0)
    calls = method.ctx.generation.calls
    assert [c[0] for c in calls] == ["reference", "train"]
    refs = calls[0][1]
    assert len(refs) == 9 and calls[0][2] == [4] * 9  # K references, n rollouts each
    predicted = chooser.predicted
    kinds = torch.arange(N) % 3
    torch.testing.assert_close(predicted[kinds == 0], torch.ones(10))  # predicted all right ...
    torch.testing.assert_close(predicted[kinds == 1], torch.zeros(10))  # ... and all wrong
    torch.testing.assert_close(predicted[kinds == 2], torch.full((10,), 0.5))
    assert all(pid % 3 == 2 for pid in plan.prompt_ids.tolist())  # the six nearest 1/2
    second, _, _ = run_step(method, 1)  # same round: the prompts not yet trained on
    assert [c[0] for c in calls[2:]] == ["train"]
    assert not set(second.prompt_ids.tolist()) & set(plan.prompt_ids.tolist())
    assert sum(pid % 3 == 2 for pid in second.prompt_ids.tolist()) == 4  # the 4 mixed left
    run_step(method, 2)
    assert calls[3][0] == "reference"  # every dots_every steps a new reference set
    other = build("dots")
    other.load_state_dict(method.state_dict())
    assert torch.equal(other.chooser.predicted, chooser.predicted)
    assert torch.equal(other.chooser.used, chooser.used)


def test_minilm_embeddings_are_unit_vectors_that_group_similar_prompts():
    from types import SimpleNamespace

    from lze_trainer.methods.minilm import minilm_embeddings

    texts = ["What is 12 + 35?", "What is 14 + 31?", "Name the capital city of France."]
    rows = [{"messages": [{"role": "system", "content": "Answer."},
                          {"role": "user", "content": t}]} for t in texts]
    ctx = SimpleNamespace(generation=SimpleNamespace(train=SimpleNamespace(rows=rows)))
    emb = minilm_embeddings(ctx)
    assert emb.shape == (3, 384)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    similarity = emb @ emb.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2  # two sums vs a sum and a geography question


def test_ledger_books_continued_groups_once():
    """SPEED's continuation adds rollouts to groups its screening booked already: tokens and
    rollouts count, groups and zero-variance groups do not count again."""
    from types import SimpleNamespace

    from lze_trainer.generation import Generation

    service = Generation.__new__(Generation)
    service.world, service.tp, service.ledger = SimpleNamespace(rank=0), 1, ComputeLedger()

    def groups(rewards):
        return [RolloutGroup(0, i, [1, 2], [Completion([5], [-0.1], False)] * len(r), r)
                for i, r in enumerate(rewards)]

    service._book(groups([[1.0, 0.0], [1.0, 1.0]]), "screening")
    service._book(groups([[1.0, 1.0], [0.0, 0.0]]), "continuation")
    booked = dict(service.ledger.step)
    assert booked[("groups", "screening")] == 2 and booked[("zero_variance", "screening")] == 1
    assert booked[("rollouts", "continuation")] == 4
    assert booked[("prefill", "continuation")] == 8
    assert booked.get(("groups", "continuation"), 0) == 0
    assert booked.get(("zero_variance", "continuation"), 0) == 0

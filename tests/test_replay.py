"""Rollout replay (``replay.ratio``, docs/spec.md §9; lze_trainer.methods.replay): the buffer's order,
eviction and de-duplication, which groups enter it and which are replayed, with known values; the
off-policy loss against plain GRPO; and a torchrun x2 run on the tiny preset that resumes exactly."""

import pytest
import torch

from lze_trainer import config as C
from lze_trainer import methods
from lze_trainer.batch import RolloutGroup, micro_batches
from lze_trainer.data import PromptSampler
from lze_trainer.generation import GatheredGroups
from lze_trainer.loss import behaviour_weights, clipped_surrogate
from lze_trainer.methods.replay import (BufferEntry, ReplayBuffer, RolloutReplay, fresh_size,
                                        owner_shard)
from lze_trainer.rollout import Completion
from lze_trainer.selection import GroupSelector

N, WIDTH = 40, 4


class FakeGeneration:
    """What the replay wrapper asks of the generation service: this rank's engine and their
    number."""

    def __init__(self, shard: int = 0, num_shards: int = 2):
        self.shard, self.num_shards = shard, num_shards


def build(*overrides, shard=0, num_shards=2) -> RolloutReplay:
    cfg = C.load("tiny", ["selection.method=grpo", "trainer.batch_size=4", "replay.ratio=0.5",
                          *overrides])
    device = torch.device("cpu")
    return methods.build(methods.MethodContext(
        cfg=cfg, num_prompts=N, device=device, selector=GroupSelector(cfg, N, device),
        sampler=PromptSampler(N, seed=0), generation=FakeGeneration(shard, num_shards)))


def step_batch(prompt_ids, rewards, local_rows) -> methods.StepBatch:
    """A step's batch as one rank sees it: every row's rewards, the groups of ``local_rows``."""
    n = len(prompt_ids)
    r, valid = torch.zeros(n, WIDTH), torch.zeros(n, WIDTH, dtype=torch.bool)
    for i, row in enumerate(rewards):
        r[i, :len(row)] = torch.tensor(row)
        valid[i, :len(row)] = True
    groups = [RolloutGroup(i, pid, [1, 2], [Completion([5, pid, j], [-0.5, -0.25, -1.0], False)
                                            for j in range(len(rewards[i]))], list(rewards[i]))
              for i, pid in enumerate(prompt_ids) if i in local_rows]
    plan = methods.PromptPlan(torch.tensor(prompt_ids), [len(row) for row in rewards])
    return methods.StepBatch(plan, groups, GatheredGroups(r, valid, valid.to(torch.int32) * 3))


def entry(prompt_id: int) -> BufferEntry:
    return BufferEntry(prompt_id, torch.tensor([1.0, 0.0]), torch.ones(2, dtype=torch.bool),
                       torch.full((2,), 3, dtype=torch.int32), 0)


MIXED, RIGHT, WRONG = [1.0, 0.0, 0.0, 0.0], [1.0] * 4, [0.0] * 4


# ---------------------------------------------------------------- the buffer

def ids(entries) -> list[int]:
    return [e.prompt_id for e in entries]


def test_buffer_fifo_eviction_and_newest_copy_per_prompt():
    buffer = ReplayBuffer(capacity=3)
    for pid in (10, 11, 12):
        buffer.add(entry(pid), None)
    assert list(buffer.entries) == [10, 11, 12]
    buffer.add(entry(13), None)  # full: the oldest (10) goes
    assert list(buffer.entries) == [11, 12, 13]
    buffer.add(entry(11), None)  # a newer copy of 11 replaces the older and is now the newest
    assert list(buffer.entries) == [12, 13, 11]
    buffer.keep_newest(2)  # the official truncation after a draw
    assert list(buffer.entries) == [13, 11]


def test_draw_is_uniform_without_replacement_seeded_and_skips_excluded_prompts():
    buffer = ReplayBuffer(capacity=10)
    for pid in range(10):
        buffer.add(entry(pid), None)
    draw = lambda seed, n=3, exclude=(): ids(buffer.draw(n, set(exclude),
                                                           torch.Generator().manual_seed(seed)))
    assert draw(0) == draw(0) and len(set(draw(0))) == 3  # seeded, distinct
    assert sorted(draw(1, n=20, exclude={4, 7})) == [0, 1, 2, 3, 5, 6, 8, 9]
    counts = torch.zeros(10)
    for seed in range(4000):  # each of 10 entries drawn with chance 3/10
        counts[draw(seed)] += 1
    assert (counts / 4000 - 0.3).abs().max() < 0.03  # 4.1 standard errors
    firsts = torch.bincount(torch.tensor([draw(seed)[0] for seed in range(4000)]), minlength=10)
    assert (firsts / 4000 - 0.1).abs().max() < 0.02  # not newest first: any entry leads


def test_buffer_drops_tokens_with_their_entry():
    buffer = ReplayBuffer(capacity=1)
    group = RolloutGroup(0, 10, [1], [], [])
    buffer.add(entry(10), group)
    assert buffer.tokens == {10: group}
    buffer.add(entry(11), None)  # another engine's group evicts 10
    assert buffer.tokens == {} and len(buffer) == 1


def test_fresh_size_rounds_to_engines():
    assert fresh_size(8, 0.5, 2) == 4
    assert fresh_size(8, 0.3, 2) == 2  # 2.4 -> 2
    assert fresh_size(8, 0.05, 2) == 2  # at least one prompt per engine
    assert fresh_size(8, 1.0, 2) == 8
    assert [owner_shard(row, 4, 2) for row in range(4)] == [0, 0, 1, 1]


# ---------------------------------------------------------------- the method

def test_only_mixed_groups_enter_and_tokens_stay_on_their_engine():
    method = build()  # rank of engine 0 of 2: rows 0-1 are its own
    assert method.fresh_batch_size() == 4  # empty buffer: a full batch
    batch = step_batch([3, 4, 5, 6], [MIXED, RIGHT, [0.0, 1.0], WRONG], local_rows={0, 1})
    method.observe(batch, method.select(batch, 0))
    assert [(e.prompt_id, e.shard) for e in method.buffer.entries.values()] == [(3, 0), (5, 1)]
    assert set(method.buffer.tokens) == {3}
    assert method.fresh_batch_size() == 2  # the buffer holds B - fresh = 2 groups


def test_replayed_groups_skip_the_fresh_plan_and_get_grpo_advantages():
    method = build()
    first = step_batch([3, 4, 5, 6], [MIXED, MIXED, MIXED, [0.0, 1.0, 1.0]], local_rows={0, 1})
    method.observe(first, method.select(first, 0))
    # Next step: 2 fresh prompts, one of them (6) in the buffer: replay 2 of the others, 3-5.
    fresh = step_batch([6, 7], [WRONG, RIGHT], local_rows={0})
    drawn = ids(method.buffer.draw(2, {6, 7}, method.generator(1)))  # the step's seeded draw
    assert len(drawn) == 2 and set(drawn) <= {3, 4, 5}
    selection = method.select(fresh, 1)
    assert fresh.plan.prompt_ids.tolist() == [6, 7, *drawn]
    assert fresh.plan.counts == [4, 4, 4, 4] and fresh.replayed == 2
    assert fresh.generated_rows().tolist() == [True, True, False, False]
    assert selection.keep_mask.tolist() == [True, True, True, True]  # grpo + replayed
    # r = [1, 0, 0, 0]: mean 1/4, unbiased std 1/2, A = (r - mean) / std.
    assert selection.advantages[2].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert selection.advantages[3].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # Engine 0 generated prompts 3 and 4 (rows 0-1 of the first step), engine 1 prompt 5: this
    # rank adds only its own drawn groups, at their new rows, flagged off-policy.
    replayed = [g for g in fresh.groups if g.off_policy]
    assert [(g.row, g.prompt_id) for g in replayed] == [
        (2 + i, pid) for i, pid in enumerate(drawn) if pid in (3, 4)]
    assert fresh.gathered.rewards[2:].tolist() == [MIXED, MIXED]
    assert method.step_metrics()["replay/groups"] == 2.0


def test_buffer_keeps_its_newest_size_minus_fresh_groups_after_each_draw():
    method = build("replay.buffer_size=4")  # the official buffer_size = B
    first = step_batch([3, 4, 5, 6], [MIXED] * 4, local_rows={0, 1})
    method.observe(first, method.select(first, 0))
    assert list(method.buffer.entries) == [3, 4, 5, 6]
    second = step_batch([7, 8], [MIXED] * 2, local_rows={0})  # fresh = 2 of B = 4
    method.select(second, 1)  # draws 2 of the 4, then keeps the newest 4 - 2 ...
    assert second.replayed == 2 and list(method.buffer.entries) == [5, 6]
    method.observe(second, None)  # ... and the fresh mixed groups enter
    assert list(method.buffer.entries) == [5, 6, 7, 8]


def test_replay_draws_resume_exactly():
    """Two wrappers with the same buffer (one restored from the other's state) draw the same."""
    method = build()
    first = step_batch(list(range(4)), [MIXED] * 4, local_rows={0, 1})
    method.observe(first, method.select(first, 0))
    second = step_batch(list(range(4, 8)), [MIXED] * 4, local_rows={0, 1})
    method.observe(second, method.select(second, 1))
    restored = build()
    restored.load_state_dict(method.state_dict())
    restored.buffer.tokens = dict(method.buffer.tokens)
    batches = [step_batch([20, 21], [WRONG, RIGHT], local_rows={0}) for _ in range(2)]
    method.select(batches[0], 2)
    restored.select(batches[1], 2)
    assert batches[0].plan.prompt_ids.tolist() == batches[1].plan.prompt_ids.tolist()
    assert len(batches[0].plan.prompt_ids) == 4


def test_replayed_advantages_equal_the_selectors():
    method = build()
    rewards = [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    first = step_batch([3, 4], rewards, local_rows={0, 1})
    selection = method.select(first, 0)
    stored = selection.advantages
    method.observe(first, selection)
    batch = step_batch([8, 9], [WRONG, WRONG], local_rows={0})
    replayed = method.select(batch, 1).advantages[2:]
    by_prompt = dict(zip(batch.plan.prompt_ids[2:].tolist(), replayed))
    torch.testing.assert_close(by_prompt[3], stored[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(by_prompt[4], stored[1], atol=1e-6, rtol=0)


def test_replayed_groups_leave_the_selector_history_alone():
    """The selector sees the fresh rows only: its state equals a run without replay."""
    method, plain = build(), build("replay.ratio=0")
    first = [3, 4, 5, 6], [MIXED, MIXED, MIXED, MIXED]
    for m in (method, plain):
        batch = step_batch(*first, local_rows={0, 1})
        m.observe(batch, m.select(batch, 0))
    for m in (method, plain):
        batch = step_batch([7, 8], [MIXED, RIGHT], local_rows={0})
        m.observe(batch, m.select(batch, 1))
    ours, theirs = method.ctx.selector.state_dict(), plain.ctx.selector.state_dict()
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(ours[key], value, rtol=0, atol=0)


def test_state_round_trip_and_rank_layout_check():
    method = build()
    batch = step_batch([3, 4, 5, 6], [MIXED] * 4, local_rows={0, 1})
    method.observe(batch, method.select(batch, 0))
    restored = build()
    restored.load_state_dict(method.state_dict())
    restored.load_rank_state_dict(method.rank_state_dict())
    assert list(restored.buffer.entries) == list(method.buffer.entries) == [3, 4, 5, 6]
    assert set(restored.buffer.tokens) == {3, 4}
    other_engine = build(shard=1)
    other_engine.load_state_dict(method.state_dict())
    with pytest.raises(RuntimeError, match="replay buffer: engine 1"):
        other_engine.load_rank_state_dict(method.rank_state_dict())


def test_replay_off_builds_the_plain_method():
    assert isinstance(build("replay.ratio=0"), methods.Method)


# ---------------------------------------------------------------- the off-policy loss

def test_off_policy_loss_is_plain_grpo_when_behaviour_is_the_old_policy():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    old = (logp + 0.1 * torch.randn(3, 6)).detach()
    adv = torch.tensor([1.0, -0.5, 2.0])
    pg, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    w = behaviour_weights(old, old.clone(), torch.tensor([True, False, True]))
    assert torch.equal(w, torch.ones_like(w))
    (grad_plain,) = torch.autograd.grad(pg.sum(), logits, retain_graph=True)
    (grad_off,) = torch.autograd.grad((pg * w).sum(), logits)
    torch.testing.assert_close(grad_off, grad_plain, rtol=0, atol=0)


def test_off_policy_loss_known_values():
    """docs/spec.md §9: loss = -w min(rho A, clip(rho) A), w = pi_old / mu on replayed rows only."""
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    mu = torch.log(torch.tensor([[0.25, 1.0], [0.25, 1.0]]))
    logp = torch.log(torch.tensor([[0.75, 0.5], [0.75, 0.5]]))  # rho = 1.5, 1
    adv = torch.tensor([1.0, 1.0])
    pg, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    w = behaviour_weights(old, mu, torch.tensor([True, False]))
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5], [1.0, 1.0]]))
    torch.testing.assert_close(pg * w, torch.tensor([[-2 * 1.28, -0.5], [-1.28, -1.0]]))


def test_replayed_groups_are_flagged_in_micro_batches():
    fresh = RolloutGroup(0, 1, [1, 2], [Completion([3], [-0.1], False)], [1.0], [0.5])
    old = RolloutGroup(1, 2, [1, 2], [Completion([4], [-0.2], False)], [0.0], [-0.5],
                       off_policy=True)
    (micro,) = micro_batches([fresh, old], 8, 1, pad_id=0)
    assert micro.off_policy.tolist() == [False, True]


# End to end (replay trains on half fresh rollouts, the engine samples from the actor, whole
# kept groups reach the loss, a resume repeats the run exactly): the "dots-replay" switch of
# tests/test_trainer_methods_e2e.py, DOTS with rollout replay under torchrun.

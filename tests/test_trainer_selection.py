"""The trainer's selection policies on fixed rewards (the selector itself is tested in
test_selector.py / test_backends.py)."""

import torch

from lze_kernels import ops
from lze_trainer import config as C
from lze_trainer import methods
from lze_trainer.data import PromptSampler
from lze_trainer.generation import GatheredGroups
from lze_trainer.selection import GroupSelector

# Rows: all right, all wrong, 1/4, 1/2, 3/4, 2/4 with a ragged group, and a row without rollouts.
REWARDS = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0],
                        [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
VALID = torch.ones_like(REWARDS, dtype=torch.bool)
VALID[5, 2:] = False
VALID[6] = False
IDS = torch.arange(7)


class _Method:
    """A selection method of the trainer on hand-made rewards (no engines)."""

    def __init__(self, name, *overrides):
        cfg = C.load("tiny", [f"selection.method={name}", "selection.noise_scale=0", *overrides])
        self.selector = GroupSelector(cfg, num_prompts=10, device=torch.device("cpu"))
        self.method = methods.build(methods.MethodContext(
            cfg=cfg, num_prompts=10, device=torch.device("cpu"), selector=self.selector,
            sampler=PromptSampler(10, seed=0), generation=None))

    def select(self, rewards, ids, valid, step):
        plan = methods.PromptPlan(ids, [int(n) for n in valid.sum(dim=1)])
        lengths = valid.to(torch.int32)
        batch = methods.StepBatch(plan, [], GatheredGroups(rewards, valid, lengths))
        return self.method.select(batch, step)

    def num_pruned(self):
        return self.selector.num_pruned()

    def choose_prompts(self, candidates, batch_size):
        return self.selector.choose_prompts(candidates, batch_size)


def selector(name, *overrides):
    return _Method(name, *overrides)


def test_grpo_keeps_every_group_with_rollouts():
    out = selector("grpo").select(REWARDS, IDS, VALID, step=0)
    assert out.keep_mask.tolist() == [True] * 6 + [False]


def test_dapo_keeps_exactly_the_groups_with_reward_variance():
    out = selector("dapo").select(REWARDS, IDS, VALID, step=0)
    assert out.keep_mask.tolist() == [False, False, True, True, True, True, False]
    assert torch.equal(out.keep_mask, ops.dapo_keep_mask(REWARDS, VALID))


def test_lze_keeps_the_top_k_by_energy():
    out = selector("lze").select(REWARDS, IDS, VALID, step=0)
    k = int(0.4 * 7)  # floor(0.4 B) = 2
    assert int(out.keep_mask.sum()) == k
    # First sight: E = (1 - p) 4p(1 - p): p = 1/4 and 1/2 (rows 2, 5: 1/2 over 2 valid) beat 3/4.
    energy = out.energy.tolist()
    kept = set(torch.nonzero(out.keep_mask).flatten().tolist())
    assert all(energy[i] >= max(energy[j] for j in range(7) if j not in kept) for i in kept)
    assert not out.keep_mask[[0, 1, 6]].any()  # E = 0 never fills the quota


def test_warmup_steps_keep_everything_then_select():
    sel = selector("lze", "selection.warmup_steps=1")
    assert sel.select(REWARDS, IDS, VALID, step=0).keep_mask.sum() == 6
    assert sel.select(REWARDS, IDS + 0, VALID, step=1).keep_mask.sum() == 2


def test_advantages_are_grpo_whatever_the_method():
    for name in ("grpo", "dapo", "lze"):
        out = selector(name).select(REWARDS, IDS, VALID, step=0)
        torch.testing.assert_close(out.advantages, ops.grpo_advantages(REWARDS, VALID))


def test_pruner_prefers_eligible_prompts():
    sel = selector("lze", "selection.prune=true", "selection.prune_after=1",
                   "selection.replay_ratio=0")
    solved = torch.ones(2, 4)
    sel.select(solved, torch.tensor([3, 4]), torch.ones(2, 4, dtype=torch.bool), step=0)
    assert sel.num_pruned() == 2
    ids, eligible = sel.choose_prompts(torch.tensor([3, 5, 4, 6]), 3)
    assert ids.tolist() == [5, 6, 3] and eligible.tolist() == [True, True, False]

"""Checks of the DeepSpeed actor that need a process group; run under torchrun by
tests/test_trainer_actor.py:

    torchrun --standalone --nproc_per_node=W tests/distributed/actor_checks.py MODE MODEL_DIR OUT

``nonfinite``: a NaN loss is never trained on (ZeRO 0, 2, 3): the step is skipped, the weights
stay, and the next finite step trains. ``update``: one GRPO update on the kept groups of a fixed
step, dispatched over W ranks the trainer's way; OUT gets the weights (compared across W by the
test), whether changing the dropped groups changed anything, and how much the update raised the
step's policy-gradient objective.
"""

import json
import os
import random
import sys

import torch

from lze_trainer import config as C
from lze_trainer import distributed as D
from lze_trainer.actor import Actor, Schedule
from lze_trainer.batch import RolloutGroup
from lze_trainer.dispatch import dispatch_kept_groups, update_batches
from lze_trainer.rollout import Completion

BATCH, GROUP = 8, 4
KEPT = [0, 2, 3, 5, 6]  # 5 kept groups: over 2 ranks one rank pads with a zero-weight group


def actor(world, model_dir, stage, *overrides):
    cfg = C.load("tiny", [f"actor.zero_stage={stage}", "actor.micro_batch_size=3",
                          "actor.lr=0.01", *overrides])
    return cfg, Actor(cfg, world, model_dir, Schedule(0.01, 10))


def weights(a):
    return {name: t.clone().cpu() for name, t in a.named_weights()}


def step_groups(seed, dropped_noise):
    """The step's B groups; with ``dropped_noise`` the groups that are not kept differ."""
    rng = random.Random(seed)
    groups = []
    for row in range(BATCH):
        noisy = dropped_noise and row not in KEPT
        r = random.Random(row + (1000 if noisy else 0))
        responses = [Completion([r.randrange(3, 250) for _ in range(r.randrange(1, 7))],
                                [-1.0] * 6, False) for _ in range(GROUP)]
        responses = [Completion(c.token_ids, c.logprobs[:len(c.token_ids)], False) for c in responses]
        groups.append(RolloutGroup(row=row, prompt_id=row,
                                   prompt=[rng.randrange(3, 250) for _ in range(5)],
                                   responses=responses, rewards=[float(r.random() > 0.5)
                                                                 for _ in range(GROUP)]))
    advantages = torch.randn(BATCH, GROUP, generator=torch.Generator().manual_seed(seed))
    return groups, advantages


def train_once(world, model_dir, dropped_noise, *overrides):
    cfg, a = actor(world, model_dir, 2, *overrides)
    groups, advantages = step_groups(0, dropped_noise)
    per_rank = BATCH // world.size
    local = groups[world.rank * per_rank:(world.rank + 1) * per_rank]
    mine = dispatch_kept_groups(local, advantages, KEPT, per_rank, world, tp=1)
    batches, norms = update_batches(mine, cfg.actor.mini_batches, cfg.actor.micro_batch_size, 16,
                                    a.pad_id)
    before = objective(a, batches)
    stats = a.update(batches, norms)
    tokens = D.all_reduce(float(stats.as_dict()["tokens"]))
    return weights(a), tokens, stats, objective(a, batches) - before


def objective(a, batches):
    """The policy-gradient objective of the step's kept tokens, sum of A * log-prob (all ranks):
    an update must raise it (the sign of the whole chain: advantages, mask, loss, optimizer)."""
    total = sum(float((a.log_probs(micro) * micro.loss_mask * micro.advantages[:, None]).sum())
                for mini in batches for micro in mini)
    return D.all_reduce(total)


def check_update(world, model_dir, out):
    trained, tokens, stats, gain = train_once(world, model_dir, dropped_noise=False)
    again, _, _, _ = train_once(world, model_dir, dropped_noise=True)
    # Two passes over two mini-batches: four optimizer steps against recomputed old log-probs.
    _, _, multi, _ = train_once(world, model_dir, False, "actor.ppo_epochs=2",
                                "actor.mini_batches=2")
    clipped = D.all_reduce(float(multi.as_dict()["clipped_tokens"]))
    if world.is_main:
        kept_tokens = sum(len(c.token_ids) for row in KEPT for c in step_groups(0, False)[0][row].responses)
        torch.save(trained, out)
        with open(out + ".json", "w") as f:
            json.dump({"dropped_groups_changed_weights": any(
                not torch.equal(trained[k], again[k]) for k in trained),
                "update_tokens": tokens, "kept_tokens": kept_tokens,
                "grad_norm": stats.grad_norms[0], "objective_gain": gain,
                "multi_updates": len(multi.grad_norms),
                "multi_clipped_tokens": clipped}, f)


def check_nonfinite(world, model_dir, out):
    results = {}
    for stage in (0, 2, 3):
        cfg, a = actor(world, model_dir, stage)
        groups, advantages = step_groups(0, False)
        before = weights(a)
        poisoned = advantages.clone()
        poisoned[KEPT[0], 0] = float("nan")
        mine = dispatch_kept_groups(groups, poisoned, KEPT, BATCH, world, tp=1)
        batches, norms = update_batches(mine, 1, cfg.actor.micro_batch_size, 16, a.pad_id)
        skipped = a.update(batches, norms).skipped_updates
        unchanged = all(torch.equal(before[k], v) for k, v in weights(a).items())
        mine = dispatch_kept_groups(groups, advantages, KEPT, BATCH, world, tp=1)
        batches, norms = update_batches(mine, 1, cfg.actor.micro_batch_size, 16, a.pad_id)
        finite_skipped = a.update(batches, norms).skipped_updates
        trained = any(not torch.equal(before[k], v) for k, v in weights(a).items())
        results[stage] = {"skipped": skipped, "unchanged": unchanged,
                          "finite_skipped": finite_skipped, "trained_after": trained}
    if world.is_main:
        with open(out, "w") as f:
            json.dump(results, f)


CHECKS = {"update": check_update, "nonfinite": check_nonfinite}

if __name__ == "__main__":
    # modes: comma-separated checks run in this one launch, each writing <out folder>/<mode>
    modes, model_dir, out = sys.argv[1:4]
    world = D.init("cpu", 1)
    for mode in modes.split(","):
        CHECKS[mode](world, model_dir, os.path.join(out, mode))
    D.shutdown()

"""HIVE (``selection.entropy_filter``, lze_trainer.methods.hive): stage 1 shortlists by reward
history, stage 2 keeps the top half of the shortlist by prompt entropy; known picks on a fake
generation service, the batch stays full."""

import torch

from lze_kernels import layout as L
from lze_trainer.data import PromptSampler
from lze_trainer.methods.hive import HistoryThenEntropy, shortlist_by_history, top_entropy

from test_trainer_methods import N, build, one_process_group, run_step  # noqa: F401


def test_shortlist_and_top_entropy_known_picks():
    prior = torch.tensor([0.0, 1.0, 0.64, 1.0, 0.36, 0.0])
    assert shortlist_by_history(prior, 3).tolist() == [1, 3, 2]  # ties in sampler order
    assert top_entropy(torch.tensor([0.1, 2.0, 0.5, 2.0]), 2).tolist() == [1, 3]


def test_history_prior_is_medium_difficulty_and_unseen_first():
    method = build("lze", "selection.entropy_filter=true")
    hive = method.chooser
    assert isinstance(hive, HistoryThenEntropy)
    state = method.ctx.selector.lze.state
    state.fstate[:4, L.EMA] = torch.tensor([0.0, 0.5, 0.9, 1.0])
    state.istate[:3, L.SEEN] = 1  # prompt 3 never rolled out
    torch.testing.assert_close(hive.history_prior(torch.arange(4)),
                               torch.tensor([0.0, 1.0, 0.36, 1.0]))


def test_two_stages_pick_known_prompts_and_fill_the_batch(monkeypatch):
    # B = 6, pool 4 x 6 = 24 candidates, shortlist 6 / 0.5 = 12, the 6 highest entropies roll out.
    entropy = {pid: float(pid % 7) for pid in range(N)}
    monkeypatch.setattr("lze_trainer.methods.hive.prompt_features",
                        lambda ctx, ids, feature, purpose: torch.tensor([entropy[i] for i in ids]))
    method = build("lze", "selection.entropy_filter=true")
    state = method.ctx.selector.lze.state
    state.istate[:N, L.SEEN] = 1
    state.fstate[:N, L.EMA] = torch.tensor([0.5 if pid % 2 else 1.0 for pid in range(N)])
    pool = PromptSampler(N, seed=0).next(24)  # the candidates the method will draw
    plan = method.plan(0)
    odd = [pid for pid in pool if pid % 2][:12]  # medium history: the shortlist
    want = sorted(odd, key=lambda pid: -entropy[pid])[:6]  # stable: ties in pool order
    assert plan.prompt_ids.tolist() == want
    assert plan.counts == [4] * 6  # a full batch
    logged = method.step_metrics()
    assert logged["hive/history_dropped"] == 12 and logged["hive/dropped"] == 6


def test_entropy_filter_only_over_the_sampler():
    import pytest

    for name in ("dots", "greso"):
        with pytest.raises(ValueError, match="selection.entropy_filter"):
            build(name, "selection.entropy_filter=true")


def test_a_step_runs_and_the_state_round_trips(monkeypatch):
    monkeypatch.setattr("lze_trainer.methods.hive.prompt_features",
                        lambda ctx, ids, feature, purpose: torch.arange(len(ids)).float())
    method = build("lze", "selection.entropy_filter=true")
    plan, _, _ = run_step(method, 0)
    assert len(plan.prompt_ids) == 6
    other = build("lze", "selection.entropy_filter=true")
    other.load_state_dict(method.state_dict())

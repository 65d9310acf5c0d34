"""LZEAdvantage against verl's GRPO advantage semantics, without verl installed (these run in both
venvs; the tests against the installed verl 0.9.1 are tests/test_verl_*.py, run by make test-verl).

``verl_grpo_reference`` re-implements, as a plain loop over a dict of uid groups, what
``compute_grpo_outcome_advantage`` in volcengine/verl ``verl/trainer/ppo/core_algos.py`` computes
(read at commit 012be9d9; the same body is registered as ``"grpo"`` through ``register_adv_est``):
per-response score = sum of token-level rewards; per uid group mean and unbiased std
(``torch.std``), a group of one response gets mean 0 and std 1; ``A = (s - mean) / (std + eps)``
or ``s - mean`` without std normalisation; ``A * response_mask`` returned as advantages and
returns.
"""

import math
import subprocess
import sys
import types
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import advantage_error_bound, assert_within

from lze_kernels import LZEConfig, LZESelector
from lze_kernels.config import num_keep
from lze_kernels.integrations.verl import LZEAdvantage, group_by_uid
from lze_kernels.integrations.verl.minibatch import (group_unit, groups_to_train, keep_count,
                                                   leading_groups_near, no_selection_warning)
from lze_kernels.layout import SEEN


def verl_grpo_reference(token_level_rewards, response_mask, index, epsilon=1e-6,
                        norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    by_uid = defaultdict(list)
    for i, uid in enumerate(index):
        by_uid[uid].append(scores[i])
    mean, std = {}, {}
    for uid, members in by_uid.items():
        if len(members) == 1:
            mean[uid], std[uid] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean[uid], std[uid] = torch.stack(members).mean(), torch.stack(members).std()
    advantages = torch.empty_like(scores)
    for i, uid in enumerate(index):
        centred = scores[i] - mean[uid]
        advantages[i] = centred / (std[uid] + epsilon) if norm_adv_by_std_in_grpo else centred
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def verl_tolerance(token_level_rewards, response_mask, index, epsilon=1e-6, norm=True):
    """[bs, T] bound on |adapter - verl|: both evaluate the same GRPO formula per uid group in
    fp32, so they differ by at most the sum of their error bounds (advantage_error_bound, for
    the two-pass std; verl's torch.std may update the variance by Welford's recurrence, whose
    error grows by up to 1 + |mean| / std, taken for both). Scores are exact (one nonzero reward
    per response); single-response groups and masked tokens are computed alike and equal."""
    scores = token_level_rewards.sum(dim=-1).double()
    row, slot, _, width = layout_reference(list(index))
    raw = torch.zeros(max(row) + 1, width, dtype=torch.float64)
    valid = torch.zeros_like(raw, dtype=torch.bool)
    raw[row, slot], valid[row, slot] = scores, True
    count = valid.sum(dim=1, keepdim=True).clamp_min(1)
    mean = raw.sum(dim=1, keepdim=True) / count
    std = (torch.where(valid, raw - mean, 0.0).square().sum(dim=1, keepdim=True)
           / (count - 1).clamp_min(1)).sqrt()
    welford = 1 + mean.abs() / std.clamp_min(torch.finfo(torch.float64).tiny)
    bound = 2 * welford * advantage_error_bound(raw, valid, epsilon, norm)
    return bound[row, slot].unsqueeze(-1) * response_mask.double().abs()


def verl_batch(num_prompts, group, length=12, seed=0, binary=True, singles=0, grouped=False):
    """A batch the way verl's fit builds it: fresh uuid4 uids repeated per rollout, responses
    shuffled (balance_batch reorders; ``grouped``: left in uid order), the outcome reward on the
    last response token, and the dataset row of each response (non_tensor_batch["index"])."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    uids = np.array([str(uuid.UUID(int=int(rng.integers(2**62)))) for _ in range(num_prompts)],
                    dtype=object)
    counts = [group] * (num_prompts - singles) + [1] * singles
    index = np.repeat(uids, counts)
    dataset_index = np.repeat(np.arange(num_prompts) * 3, counts).astype(object)
    bs = index.shape[0]
    p = torch.rand(bs, generator=g)
    scores = (torch.rand(bs, generator=g) < p).float() if binary else torch.rand(bs, generator=g)
    lengths = torch.randint(1, length + 1, (bs,), generator=g)
    response_mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    token_level_rewards = torch.zeros(bs, length)
    token_level_rewards[torch.arange(bs), lengths - 1] = scores
    order = np.arange(bs) if grouped else rng.permutation(bs)
    return (token_level_rewards[order], response_mask[order], index[order],
            dataset_index[order])


# ----------------------------------------------------------------------------- uid -> rows


def layout_reference(index):
    """(row, slot, first, width) by a plain loop: groups numbered in order of first appearance,
    each response's slot its place among its uid's responses in batch order."""
    row_of, members = {}, defaultdict(list)
    for i, uid in enumerate(index):
        row_of.setdefault(uid, len(row_of))
        members[uid].append(i)
    row = [row_of[uid] for uid in index]
    slot = [members[uid].index(i) for i, uid in enumerate(index)]
    return row, slot, [members[uid][0] for uid in row_of], max(map(len, members.values()))


def check_layout(index):
    groups = group_by_uid(index, "cpu")
    row, slot, first, width = layout_reference(index.tolist())
    assert groups.row.tolist() == row and groups.slot.tolist() == slot
    assert groups.first.tolist() == first and groups.width == width
    full = len(index) == len(first) * width
    assert groups.full == full
    assert groups.blocked == (full and row == [i // width for i in range(len(index))])


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12), order=st.sampled_from(
    ["grouped", "shuffled", "split"]), seed=st.integers(0, 2**16))
def test_group_by_uid_matches_a_plain_loop(sizes, order, seed):
    """Grouped (the fast path), shuffled (hash numbering + counting placement) and a uid that
    comes back after another one (grouped-looking runs that must not be taken as groups)."""
    rng = np.random.default_rng(seed)
    uids = np.array([str(uuid.UUID(int=int(rng.integers(2**62)))) for _ in sizes], dtype=object)
    index = np.repeat(uids, sizes)
    if order == "shuffled":
        index = index[rng.permutation(len(index))]
    elif order == "split":
        index = np.concatenate([index, index[:1]])
    check_layout(index)
    check_layout(torch.from_numpy(np.unique(index, return_inverse=True)[1] * 7))


def test_group_by_uid_past_65536_groups():
    """More groups than 16-bit radix keys hold: the placement sorts the int64 numbers."""
    uids = np.random.default_rng(0).permutation(70_000) * 3
    groups = group_by_uid(torch.from_numpy(np.concatenate([uids, uids])), "cpu")
    numbers = torch.arange(70_000)
    assert torch.equal(groups.row, torch.cat([numbers, numbers]))
    assert torch.equal(groups.slot, torch.repeat_interleave(torch.tensor([0, 1]), 70_000))
    assert torch.equal(groups.first, numbers) and groups.width == 2 and not groups.blocked


def test_group_by_uid_blocks_and_tensors():
    groups = group_by_uid(np.array(["b", "b", "a", "a", "c", "c"], dtype=object), "cpu")
    assert groups.row.tolist() == [0, 0, 1, 1, 2, 2] and groups.blocked
    groups = group_by_uid(torch.tensor([7, 3, 7, 3, 9]), "cpu")
    assert groups.row.tolist() == [0, 1, 0, 1, 2] and groups.slot.tolist() == [0, 0, 1, 1, 0]
    assert groups.first.tolist() == [0, 1, 4] and not groups.full
    with pytest.raises(ValueError, match="index"):
        group_by_uid(np.array([], dtype=object), "cpu")


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("uid_type", ["numpy", "tensor"])
@pytest.mark.parametrize("singles, grouped", [(2, False), (2, True), (0, False), (0, True)])
def test_binary_rewards_match_verl_exactly(norm, uid_type, singles, grouped):
    rewards, mask, index, rows = verl_batch(48, 8, singles=singles, grouped=grouped)
    expected, _ = verl_grpo_reference(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    if uid_type == "tensor":
        index = torch.from_numpy(np.unique(index, return_inverse=True)[1])
    adapter = LZEAdvantage(num_prompts=200)
    advantages, returns = adapter(rewards, mask, index, norm_adv_by_std_in_grpo=norm,
                                  prompt_index=rows)
    assert torch.equal(advantages, expected) and returns is advantages
    assert advantages.dtype == expected.dtype and advantages.shape == rewards.shape


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.bool, torch.float32,
                                        torch.float64])
def test_broadcast_is_verls_expression_bit_for_bit(mask_dtype):
    rewards, mask, index, rows = verl_batch(6, 4, seed=7, binary=False)
    mask = mask.to(mask_dtype)
    expected, _ = verl_grpo_reference(rewards, mask, index)
    advantages, _ = LZEAdvantage(20)(rewards, mask, index, prompt_index=rows)
    assert advantages.dtype == expected.dtype  # float64 masks promote, as in verl
    assert_within(advantages, expected, verl_tolerance(rewards, mask, index), "advantages")
    adapter = LZEAdvantage(method="dapo")
    per_response = adapter(rewards, mask.to(torch.float32), index)[0][:, 0]
    assert torch.equal(adapter(rewards, mask, index)[0], per_response.unsqueeze(-1) * mask)


def test_single_rollout_group_follows_verl_not_the_kernels():
    rewards = torch.tensor([[0.0, 0.7], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.ones_like(rewards, dtype=torch.int64)
    index = np.array(["solo", "pair", "pair"], dtype=object)
    advantages, _ = LZEAdvantage(10)(rewards, mask, index, prompt_index=[4, 5, 5])
    assert advantages[0].tolist() == pytest.approx([0.7 / (1 + 1e-6)] * 2, rel=1e-7)
    torch.testing.assert_close(advantages, verl_grpo_reference(rewards, mask, index)[0])


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 12), group=st.integers(1, 9), singles=st.integers(0, 3),
       binary=st.booleans(), norm=st.booleans(), epsilon=st.sampled_from([1e-6, 1e-4]),
       grouped=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_verl_on_any_batch(num_prompts, group, singles, binary, norm, epsilon, grouped,
                                   seed):
    singles = min(singles, num_prompts)
    rewards, mask, index, rows = verl_batch(num_prompts, group, seed=seed, binary=binary,
                                            singles=singles, grouped=grouped)
    expected, _ = verl_grpo_reference(rewards, mask, index, epsilon, norm)
    advantages, _ = LZEAdvantage(100)(rewards, mask, index, epsilon=epsilon,
                                      norm_adv_by_std_in_grpo=norm, prompt_index=rows)
    # verl takes torch.mean / torch.std, the kernels sum / count: equal up to float32 rounding.
    assert_within(advantages, expected, verl_tolerance(rewards, mask, index, epsilon, norm),
                  "advantages")


@pytest.mark.parametrize("config, norm", [({"norm_adv_by_std_in_grpo": False}, False),
                                          (types.SimpleNamespace(norm_adv_by_std_in_grpo=False),
                                           False),
                                          (None, True)])
def test_reads_the_std_switch_from_verls_algorithm_config(config, norm):
    rewards, mask, index, rows = verl_batch(6, 4, seed=3)
    expected, _ = verl_grpo_reference(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    advantages, _ = LZEAdvantage(20)(rewards, mask, index, config=config, prompt_index=rows)
    assert torch.equal(advantages, expected)


# ----------------------------------------------------------------------------- selection


def test_keep_mask_is_the_selectors_choice_of_whole_groups():
    config = LZEConfig(keep_ratio=0.3, noise_scale=0.05, seed=11)
    rewards, mask, index, rows = verl_batch(32, 8, seed=5)
    adapter = LZEAdvantage(100, config)
    adapter(rewards, mask, index, prompt_index=rows)

    # Independently: groups in order of first appearance (as the adapter numbers them), a fresh
    # selector.
    uids = list(dict.fromkeys(index))
    scores = rewards.sum(-1)
    by_uid = torch.stack([scores[torch.from_numpy(index == uid)] for uid in uids])
    ids = torch.tensor([rows[list(index).index(uid)] for uid in uids], dtype=torch.int64)
    expected = LZESelector(100, config).step(by_uid, ids)

    selection = adapter.last.selection
    assert torch.equal(selection.prompt_ids, ids)
    assert torch.equal(selection.keep, expected.keep_mask)
    assert torch.equal(selection.step.energy, expected.energy)
    kept = {uid for uid, keep in zip(uids, expected.keep_mask.tolist()) if keep}
    assert adapter.last.keep_mask.tolist() == [uid in kept for uid in index]
    assert len(kept) == int(expected.num_kept) == 9  # floor(32 * 0.3), whole groups


def test_fresh_uids_each_step_share_the_dataset_rows_state():
    adapter = LZEAdvantage(100, LZEConfig(noise_scale=0.0))
    for seed in (1, 2):  # new uuid4 uids, same dataset rows
        rewards, mask, index, rows = verl_batch(10, 4, seed=seed)
        adapter.bind(rows)  # what the registry call cannot pass
        adapter(rewards, mask, index)
    seen = adapter.selector.state.istate[:, SEEN]
    assert seen[np.arange(10) * 3].tolist() == [2] * 10 and int(seen.sum()) == 20


def test_dapo_method_keeps_exactly_the_groups_with_unequal_scores():
    rewards, mask, index, _ = verl_batch(40, 4, seed=9)
    adapter = LZEAdvantage(method="dapo")
    advantages, _ = adapter(rewards, mask, index)
    scores = rewards.sum(-1)
    by_uid = defaultdict(set)
    for uid, score in zip(index, scores.tolist()):
        by_uid[uid].add(score)
    expected = [len(by_uid[uid]) > 1 for uid in index]
    assert adapter.last.keep_mask.tolist() == expected and 0 < sum(expected) < len(expected)
    assert torch.equal(advantages, verl_grpo_reference(rewards, mask, index)[0])


def test_score_fn_maps_rewards_for_lze_but_not_the_advantages():
    rewards, mask, index, rows = verl_batch(8, 4, seed=4)
    signed = 2 * rewards  # rewards in {0, 2}
    with pytest.raises(ValueError, match="score_fn"):
        LZEAdvantage(50)(signed, mask, index, prompt_index=rows)
    adapter = LZEAdvantage(50, score_fn=lambda r: r / 2)
    advantages, _ = adapter(signed, mask, index, prompt_index=rows)
    assert torch.equal(advantages, verl_grpo_reference(signed, mask, index)[0])
    plain = LZEAdvantage(50)
    plain(rewards, mask, index, prompt_index=rows)
    assert torch.equal(adapter.last.keep_mask, plain.last.keep_mask)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method: expected one of"):
        LZEAdvantage(20, method="top")


def test_state_round_trips():
    rewards, mask, index, rows = verl_batch(8, 4, seed=6)
    adapter = LZEAdvantage(30)
    adapter(rewards, mask, index, prompt_index=rows)
    restored = LZEAdvantage(30)
    restored.load_state_dict(adapter.state_dict())
    assert torch.equal(restored.selector.state.fstate, adapter.selector.state.fstate)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_raise_naming_the_argument():
    rewards, mask, index, rows = verl_batch(4, 4)
    adapter = LZEAdvantage(20)
    with pytest.raises(ValueError, match="prompt_index"):
        adapter(rewards, mask, index)  # LZE needs the dataset rows
    mixed_rows = rows.copy()
    mixed_rows[np.flatnonzero(index == index[0])[1]] = 1
    with pytest.raises(ValueError, match="different dataset rows"):
        adapter(rewards, mask, index, prompt_index=mixed_rows)
    with pytest.raises(ValueError, match="prompt_index"):
        adapter(rewards, mask, index, prompt_index=rows[:-1])
    with pytest.raises(ValueError, match="index"):
        adapter(rewards, mask, index[:-1], prompt_index=rows)
    with pytest.raises(ValueError, match="response_mask"):
        adapter(rewards, mask[:, :-1], index, prompt_index=rows)
    with pytest.raises(ValueError, match="method: expected one of"):
        LZEAdvantage(20, method="top")
    for bad in (float("nan"), float("inf"), -0.5):  # one check before the unchecked kernels
        broken = rewards.clone()
        broken[3, 0] = bad
        with pytest.raises(ValueError, match="rewards"):
            adapter(broken, mask, index, prompt_index=rows)
    with pytest.raises(ValueError, match=r"prompt_index: expected dataset rows in \[0, 20\)"):
        adapter(rewards, mask, index, prompt_index=rows + 20)  # past num_prompts
    with pytest.raises(ValueError, match=r"prompt_index: .* in \[0, 20\)"):
        adapter(rewards, mask, index, prompt_index=rows - 20)
    with pytest.raises(ValueError, match="prompt_index: expected integer dataset rows, got 0.7"):
        adapter(rewards, mask, index, prompt_index=np.where(index == index[0], 0.7, rows))
    with pytest.raises(ValueError, match="prompt_index: expected integer dataset rows"):
        adapter(rewards, mask, index, prompt_index=np.array(["a"] * len(rows), dtype=object))
    prompts = [f"prompt {r}" for r in rows]
    with pytest.raises(ValueError, match=r"prompts: expected 16 prompts \(one per response\)"):
        adapter(rewards, mask, index, prompt_index=rows, prompts=prompts[:-1])
    with pytest.raises(ValueError, match="prompts: responses of one uid carry different prompts"):
        adapter(rewards, mask, index, prompt_index=rows,
                prompts=prompts[:-1] + ["another prompt"])
    with pytest.raises(ValueError, match="raw_prompt: expected chat messages"):
        adapter(rewards, mask, index, prompt_index=rows, prompts=[[1, 2]] * len(rows))
    with pytest.raises(ValueError, match="prompts: given without prompt_index"):
        adapter.select(rewards, mask, index, prompt_keys=np.zeros(len(rows), np.int64))
    assert int(adapter.selector.state.istate[:, SEEN].sum()) == 0  # no step ran


def test_a_rejected_call_leaves_state_and_binding_unchanged():
    """Bad rewards after bind_uids: ValueError, the selector state bit for bit as before and the
    binding still there, so the corrected retry runs (and equals a run that never failed)."""
    rewards, mask, index, rows = verl_batch(6, 4, seed=3)
    adapter, twin = LZEAdvantage(30), LZEAdvantage(30)
    for estimator in (adapter, twin):
        estimator(rewards, mask, index, prompt_index=rows)  # some history
    before = adapter.state_dict()["selector"]
    rewards, mask, index, rows = verl_batch(6, 4, seed=4)
    adapter.bind_uids(index, rows, [f"prompt {r}" for r in rows])
    broken = rewards.clone()
    broken[0, 0] = 3.0
    with pytest.raises(ValueError, match="rewards"):
        adapter(broken, mask, index)
    after = adapter.state_dict()["selector"]
    assert all(torch.equal(before[k], after[k]) for k in ("fstate", "istate", "step_counter"))
    got, _ = adapter(rewards, mask, index)  # the binding was not used up
    expected, _ = twin(rewards, mask, index, prompt_index=rows)
    assert torch.equal(got, expected)
    assert torch.equal(adapter.selector.state.fstate, twin.selector.state.fstate)


def merged_rewards(scores, index, rows):
    """[U, 2G] rewards of the distinct rows (first appearance), a row's groups side by side in
    batch order, and their validity: a plain loop."""
    uids = list(dict.fromkeys(index))
    row_of = {uid: rows[list(index).index(uid)] for uid in uids}
    distinct = list(dict.fromkeys(row_of[uid] for uid in uids))
    cells = {row: [] for row in distinct}
    for uid in uids:
        cells[row_of[uid]] += [scores[i] for i in range(len(index)) if index[i] == uid]
    width = max(len(v) for v in cells.values())
    merged = torch.zeros(len(distinct), width)
    valid = torch.zeros(len(distinct), width, dtype=torch.bool)
    for r, row in enumerate(distinct):
        merged[r, :len(cells[row])] = torch.stack(cells[row])
        valid[r, :len(cells[row])] = True
    return merged, valid, torch.tensor(distinct), row_of


@pytest.mark.parametrize("grouped", [True, False])
def test_a_repeated_row_is_one_observation_of_all_its_rollouts(grouped):
    """Two uid groups of one dataset row (a batch across two sampler passes): one selector step
    on the distinct rows, the repeated row's rollouts side by side (pass rate over all of them,
    one state update); each group keeps verl's GRPO advantages of its own uid; both groups of the
    row are kept or dropped together by its energy."""
    config = LZEConfig(keep_ratio=0.5, noise_scale=0.05, seed=2)
    rewards, mask, index, rows = verl_batch(8, 4, seed=7, grouped=grouped)
    uids = list(dict.fromkeys(index))
    first = {uid: rows[list(index).index(uid)] for uid in uids}
    rows = np.array([first[uids[1]] if uid in (uids[1], uids[5]) else first[uid]
                     for uid in index], dtype=object)  # groups 1 and 5 share a row
    adapter = LZEAdvantage(40, config)
    advantages, _ = adapter(rewards, mask, index, prompt_index=rows)
    merged, valid, distinct, row_of = merged_rewards(rewards.sum(-1), index, rows)
    oracle = LZESelector(40, config)
    expected = oracle.step(merged, distinct, valid)
    assert torch.equal(adapter.selector.state.fstate, oracle.state.fstate)
    assert torch.equal(adapter.last.selection.keep, expected.keep_mask)
    kept_rows = {int(r) for r, k in zip(distinct, expected.keep_mask) if k}
    assert adapter.last.keep_mask.tolist() == [row_of[uid] in kept_rows for uid in index]
    assert_within(advantages, verl_grpo_reference(rewards, mask, index)[0],
                  verl_tolerance(rewards, mask, index), "advantages")
    assert int(adapter.selector.state.istate[row_of[uids[1]], SEEN]) == 1


# ----------------------------------------------------------------------------- mini-batches


@pytest.mark.parametrize("data_parallel, rollout_n, prefix_grouper",
                         [(1, 8, False), (8, 8, False), (8, 4, False), (6, 2, False),
                          (8, 16, True), (4, 4, True)])
def test_keep_count_follows_keep_ratio_within_half_a_unit(data_parallel, rollout_n,
                                                          prefix_grouper):
    """Every set-up plain GRPO accepts (B a multiple of ppo_mini_batch_size, whose rows divide
    among the ranks; with the prefix grouper, B a multiple of the ranks): k is whole mini-batches
    verl can split, never refused, and the bound docs/verl.md states, exactly as keep_count
    computes it: within half a unit of k0 = floor(B x keep_ratio) where
    unit / 2 <= k0 < (units + 1/2) x unit, else one unit (below) or every whole unit (above);
    measured from B x keep_ratio, within half a unit plus one group."""
    checked = 0
    for batch in (8, 64, 96, 1024):
        for mini in (m for m in range(1, batch + 1) if batch % m == 0):
            if (mini * rollout_n) % data_parallel or (prefix_grouper and batch % data_parallel):
                continue
            unit = group_unit(math.lcm(mini * rollout_n, data_parallel), rollout_n,
                              data_parallel, prefix_grouper)
            for ratio in [i / 20 for i in range(1, 21)]:
                kept, target = keep_count(batch, ratio, unit), num_keep(batch, ratio)
                assert kept % mini == 0 and (kept * rollout_n) % data_parallel == 0
                assert not prefix_grouper or kept % data_parallel == 0
                assert unit <= kept <= batch and kept % unit == 0
                units = batch // unit
                if unit / 2 <= target < (units + 0.5) * unit:
                    assert abs(kept - target) <= unit / 2
                    assert abs(kept - batch * ratio) < unit / 2 + 1
                else:
                    assert kept == (unit if target < unit / 2 else units * unit)
                checked += 1
    assert checked > 100


def test_the_bound_from_b_times_keep_ratio_includes_the_floor():
    """B = 30, a unit of 3, keep_ratio 0.165: B x keep_ratio = 4.95, k0 = 4 rounds to 3, 1.95
    groups from B x keep_ratio (more than half a unit, less than half a unit plus one)."""
    kept = keep_count(30, 0.165, 3)
    assert kept == 3 and 1.5 < abs(kept - 30 * 0.165) < 1.5 + 1


@pytest.mark.parametrize("method, batch, unit, says", [
    ("lze", 8, 2, False), ("lze", 8, 8, True), ("lze", 2, 2, True), ("lze", 3, 4, True),
    ("dapo", 8, 2, False), ("dapo", 8, 8, True)])
def test_no_selection_is_said_where_k_is_every_group(method, batch, unit, says):
    message = no_selection_warning(method, batch, 0.5, unit)
    assert (message is not None) == says
    assert says == (groups_to_train(method, batch, 0.5, 0, unit) == batch)
    if says:
        assert "lze/keep_ratio_effective = 1.0" in message and "ppo_mini_batch_size" in message


def test_keep_count_at_b_1024_and_mini_batches_of_256():
    """k0 = floor(1,024 x 0.4) = 409 rounds to 2 mini-batches of 256: 512, ratio 0.5 (the
    largest multiple below k0 would keep 256, 0.25)."""
    for data_parallel, rollout_n in [(1, 1), (8, 8), (16, 4)]:
        unit = group_unit(math.lcm(256 * rollout_n, data_parallel), rollout_n, data_parallel)
        assert unit == 256 and keep_count(1024, 0.4, unit) == 512


def test_leading_groups_come_nearest_to_the_rows():
    assert leading_groups_near(np.array([4, 4, 4, 4]), 8) == 2
    assert leading_groups_near(np.array([7, 1, 4, 2]), 9) == 2  # 8 rows, not 12
    assert leading_groups_near(np.array([7, 1, 4, 2]), 1) == 1  # at least one group


# ----------------------------------------------------------------------------- registry


@pytest.fixture
def fake_verl(monkeypatch):
    """verl's estimator registry (core_algos.register_adv_est / get_adv_estimator_fn)."""
    registry = {}

    def register_adv_est(name):
        def decorator(fn):
            if name in registry and registry[name] is not fn:
                raise ValueError(f"Adv estimator {name} has already been registered")
            registry[name] = fn
            return fn
        return decorator

    core_algos = types.ModuleType("verl.trainer.ppo.core_algos")
    core_algos.register_adv_est = register_adv_est
    core_algos.get_adv_estimator_fn = registry.__getitem__
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core_algos)
    return core_algos


def test_registers_under_a_name_and_takes_verls_registry_call(fake_verl):
    adapter = LZEAdvantage(20)
    adapter.register("lze_grpo")
    estimator = fake_verl.get_adv_estimator_fn("lze_grpo")
    rewards, mask, index, rows = verl_batch(4, 4, seed=2)
    adapter.bind(rows)
    # verl's compute_advantage, registry branch: these keyword arguments only.
    advantages, returns = estimator(token_level_rewards=rewards, response_mask=mask,
                                    config={"norm_adv_by_std_in_grpo": True}, index=index)
    assert torch.equal(advantages, verl_grpo_reference(rewards, mask, index)[0])
    assert adapter.last.keep_mask.shape == (16,)


def test_register_without_verl_says_so(monkeypatch):
    # In .venv-verl other tests have imported verl: hide the modules register() imports, too.
    for name in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        LZEAdvantage(5).register()


def test_importing_the_adapter_imports_no_framework():
    code = ("import sys, lze_kernels.integrations.verl; print(sorted(m for m in ('verl', 'trl', "
            "'transformers', 'vllm', 'deepspeed', 'lze_trainer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

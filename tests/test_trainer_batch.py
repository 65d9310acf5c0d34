"""How kept groups are spread over ranks, and the tensors of a micro-batch."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lze_trainer.batch import RolloutGroup, micro_batches, num_micro_batches
from lze_trainer.dispatch import assign_kept_groups
from lze_trainer.rollout import Completion


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_assignment_is_balanced_complete_and_local(data):
    tp = data.draw(st.sampled_from([1, 2, 4]))
    engines = data.draw(st.integers(1, 4))
    world = engines * tp
    rows_per_shard = data.draw(st.integers(1, 6))
    batch = rows_per_shard * engines
    kept = sorted(data.draw(st.sets(st.integers(0, batch - 1))))
    plan = assign_kept_groups(kept, rows_per_shard, world, tp)

    per_rank = -(-len(kept) // world)
    assert all(len(rows) == per_rank for rows in plan)  # same micro-batch count everywhere
    assigned = [r for rows in plan for r in rows if r >= 0]
    assert sorted(assigned) == kept  # every kept group exactly once, nothing else
    # Locality: only the groups an engine's ranks have no room for move (the fewest possible).
    quota = [len(kept) // world + (r < len(kept) % world) for r in range(world)]
    moved = sum(1 for rank, rows in enumerate(plan) for row in rows
                if row >= 0 and row // rows_per_shard != rank // tp)
    overflow = sum(max(0, sum(1 for k in kept if k // rows_per_shard == e)
                       - sum(quota[e * tp:(e + 1) * tp])) for e in range(engines))
    assert moved == overflow


def test_assignment_example():
    # 2 engines of 4 rows; engine 0 kept 3 groups, engine 1 kept 0: one group moves.
    plan = assign_kept_groups([0, 1, 3], rows_per_shard=4, world_size=2, tp=1)
    assert plan == [[0, 1], [3, -1]]
    assert assign_kept_groups([], 4, 2, 1) == [[], []]


def _group(row, prompt, responses, weight=1.0):
    return RolloutGroup(row=row, prompt_id=row, prompt=prompt,
                        responses=[Completion(r, [-0.5] * len(r), False) for r in responses],
                        rewards=[1.0] * len(responses),
                        advantages=[0.5 * (j + 1) for j in range(len(responses))], weight=weight)


def test_micro_batch_tensors_are_aligned():
    """Sequences sorted by what follows their prefix (the prompt's last token and the response);
    each distinct prompt's prefix once per micro-batch; whole, they are prompt then response."""
    groups = [_group(0, [7, 8], [[1, 2, 3], [4]]), _group(1, [9], [[5, 6]])]
    assert num_micro_batches(groups, 2) == 2
    batches = micro_batches(groups, micro_batch_size=2, count=3, pad_id=0)
    assert len(batches) == 3
    first = batches[0]
    assert first.prefix_ids.tolist() == [[7], [0]] and first.prefix_mask.tolist() == [[1], [0]]
    assert first.prefix_index.tolist() == [0, 1]
    assert first.input_ids.tolist() == [[8, 1, 2, 3], [9, 5, 6, 0]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert first.loss_mask.tolist() == [[0, 1, 1, 1], [0, 1, 1, 0]]
    assert first.advantages.tolist() == [0.5, 0.5]
    assert first.engine_logprobs[0].tolist() == [0, -0.5, -0.5, -0.5]
    assert first.positions().tolist() == [[1, 2, 3, 4], [0, 1, 2, 3]]
    ids, mask, positions = first.whole_sequences()
    assert ids.tolist() == [[7, 8, 1, 2, 3], [0, 9, 5, 6, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    assert first.sequence_lengths().tolist() == [5, 3]
    assert batches[1].whole_sequences()[0].tolist() == [[7, 8, 4]]
    # The third micro-batch is padding: present (collectives stay in step) but weightless.
    assert batches[2].loss_mask.sum() == 0 and batches[2].advantages.tolist() == [0.0]


def test_sequences_of_one_prompt_share_its_prefix_row():
    groups = [_group(0, [7, 8, 9], [[1], [2, 3], [4]]), _group(1, [7, 8, 9], [[5]])]
    (batch,) = micro_batches(groups, None, 1, pad_id=0)
    assert batch.prefix_ids.tolist() == [[7, 8]] and batch.prefix_index.tolist() == [0, 0, 0, 0]
    one_token = micro_batches([_group(0, [7], [[1]])], None, 1, pad_id=0)[0]
    assert one_token.prefix_mask.tolist() == [[0]]  # an empty prefix: one masked column


def test_zero_weight_groups_have_no_loss_mask():
    batch = micro_batches([_group(0, [1], [[2, 3]], weight=0.0)], 4, 1, pad_id=0)[0]
    assert batch.loss_mask.sum() == 0
    assert torch.equal(batch.advantages, torch.zeros(1))


def test_padding_micro_batches_when_no_group_has_responses():
    """A rank whose engine's prompts were all skipped before rollout (count 0: pruner, GRESO,
    HIVE) still runs the micro-batches the other ranks run, on a weightless stand-in."""
    empty = _group(0, [7, 8], [], weight=0.0)
    batches = micro_batches([empty, empty], micro_batch_size=2, count=2, pad_id=0)
    assert len(batches) == 2
    for batch in batches:
        assert batch.whole_sequences()[0].tolist() == [[7, 8, 8]]
        assert batch.loss_mask.sum() == 0 and batch.advantages.tolist() == [0.0]
    # With one group that has responses, the padding copies its first sequence.
    batches = micro_batches([empty, _group(1, [9], [[5, 6]])], 2, count=2, pad_id=0)
    assert batches[1].input_ids.tolist() == [[9, 5, 6]] and batches[1].loss_mask.sum() == 0

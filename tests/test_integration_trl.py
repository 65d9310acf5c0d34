"""LZEGRPOTrainer on a tiny Qwen2 with TRL (pinned trl 1.16.0), no vLLM, on the CPU.

Rewards are controlled: a completion's reward depends only on its prompt's dataset row and its
position in the group (``PATTERNS``), never on the generated text, so solved, unsolved and mixed
groups all occur and every selection is known in advance, even across a resume.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

from lze_kernels import LZEConfig, LZESelector  # noqa: E402
from lze_kernels.integrations.trl import (EpochPlanner, LZEGRPOTrainer,  # noqa: E402
                                          PrunedRepeatSampler)
from lze_kernels.integrations.trl.sampler import chunk_prompts  # noqa: E402
from lze_kernels.integrations.trl.trainer import STATE_FILE  # noqa: E402
from lze_kernels.layout import FLAG_PRUNED, FLAGS  # noqa: E402

G = 4
# Rewards of the 4 completions of a prompt, by dataset row % 4: solved, unsolved, p = 1/2, 1/4.
PATTERNS = ((1, 1, 1, 1), (0, 0, 0, 0), (1, 0, 1, 0), (1, 0, 0, 0))
NUM_PROMPTS = 8
PROMPTS = [f"What is {row} + {row % 3}?" for row in range(NUM_PROMPTS)]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def pattern_reward(completions, lze_index, **_):
    """Completions arrive as consecutive groups of G per prompt (one process)."""
    return [float(PATTERNS[row % 4][position % G]) for position, row in enumerate(lze_index)]


def mixed(row: int) -> bool:
    return len(set(PATTERNS[row % 4])) > 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from lze_trainer import tiny_model

    corpus = PROMPTS + [str(n) for n in range(20)]
    spec = "tiny:qwen2?hidden=64&layers=1&heads=2&kv_heads=1&vocab=300&seed=0"
    return str(tiny_model.build(spec, tmp_path_factory.mktemp("tiny"), corpus))


def make_config(out_dir, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(out_dir), per_device_train_batch_size=2 * G, num_generations=G,
                  max_completion_length=6, learning_rate=1e-3, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    return GRPOConfig(**{**values, **overrides})


def make_trainer(model_dir, out_dir, num_prompts=NUM_PROMPTS, trainer_cls=LZEGRPOTrainer,
                 reward=pattern_reward, config=None, **kwargs):
    dataset = Dataset.from_dict({"prompt": PROMPTS[:num_prompts]})
    return trainer_cls(model=model_dir, reward_funcs=reward, args=config or make_config(out_dir),
                       train_dataset=dataset, **kwargs)


# ----------------------------------------------------------------------------- sampler


def selector_with_pruned(num_prompts, pruned, replay_ratio=0.0):
    sel = LZESelector(num_prompts, LZEConfig(replay_ratio=replay_ratio))
    sel.state.istate[pruned, FLAGS] = FLAG_PRUNED
    return sel


def test_sampler_without_pruning_is_trls_repeat_structure():
    planner = EpochPlanner(LZESelector(6), seed=3)
    sampler = PrunedRepeatSampler(planner, mini_repeat_count=2, batch_size=2, repeat_count=3)
    indices = list(sampler)
    order = planner.plan(0)[0].tolist()
    expected = [row for chunk in range(3) for _ in range(3)
                for row in order[2 * chunk: 2 * chunk + 2] for _ in range(2)]
    assert indices == expected and len(indices) == len(sampler) == 36
    assert sorted(order) == list(range(6))


def test_sampler_skips_pruned_prompts_and_keeps_its_length():
    sel = selector_with_pruned(8, pruned=[1, 4, 6])
    sampler = PrunedRepeatSampler(EpochPlanner(sel, seed=0), 1, batch_size=2, repeat_count=1)
    sampler.set_epoch(5)
    indices = list(sampler)
    assert len(indices) == len(sampler) == 8
    assert set(indices) == {0, 2, 3, 5, 7}  # every eligible prompt, no pruned one
    chunks = [indices[i: i + 2] for i in range(0, 8, 2)]
    assert all(len(set(chunk)) == 2 for chunk in chunks)  # distinct within a generation batch


def test_sampler_pads_with_ineligible_prompts_when_too_few_are_eligible():
    sel = selector_with_pruned(5, pruned=[0, 1, 2, 3])
    order, eligible = EpochPlanner(sel, seed=0).plan(0)
    assert eligible == 1 and order[0] == 4
    chunk = chunk_prompts(order, eligible, chunk=1, size=3)
    assert chunk[0] == 4 and len(set(chunk.tolist())) == 3


def test_sampler_replays_pruned_prompts_drawn_at_epoch_start():
    sel = selector_with_pruned(2000, pruned=torch.arange(1000), replay_ratio=0.25)
    order, eligible = EpochPlanner(sel, seed=0).plan(0)
    replayed = (order[:eligible] < 1000).sum().item()
    assert 200 < replayed < 300 and eligible == 1000 + replayed


def test_planner_keeps_its_plan_for_the_epoch_and_round_trips():
    sel = LZESelector(10)
    planner = EpochPlanner(sel, seed=1)
    first = planner.plan(0)[0].clone()
    sel.state.istate[:, FLAGS] = FLAG_PRUNED  # learnt mid-epoch: must not change the epoch's plan
    assert torch.equal(planner.plan(0)[0], first) and sel.epoch == 1
    restored = EpochPlanner(LZESelector(10), seed=1)
    restored.load_state_dict(planner.state_dict())
    assert torch.equal(restored.plan(0)[0], first)
    with pytest.raises(ValueError, match="order"):
        EpochPlanner(LZESelector(11), seed=1).load_state_dict(planner.state_dict())


# ----------------------------------------------------------------------------- vLLM weight sync


def test_engine_weights_walk_trls_parameters_copied_under_every_tied_name(model_dir):
    """What ``reload_weights`` receives (the engine itself: tests/test_trl_vllm_e2e.py)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from lze_kernels.integrations.trl.vllm_sync import engine_weights, tied_aliases

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the tiny Qwen2 ties lm_head
    assert tied_aliases(model) == {"model.embed_tokens.weight": ["lm_head.weight"]}
    walk = [(name, param.data) for name, param in model.named_parameters()]
    generation = SimpleNamespace(model=model, _fix_param_name_to_vllm=lambda name: name,
                                 _iter_named_params=lambda: iter(walk))  # TRL's walk, no engine
    pushed = list(engine_weights(generation))
    names = [name for name, _ in walk]
    at = names.index("model.embed_tokens.weight") + 1
    assert [name for name, _ in pushed] == names[:at] + ["lm_head.weight"] + names[at:]
    tensors = dict(walk)
    for name, tensor in pushed:
        source = tensors[name if name != "lm_head.weight" else "model.embed_tokens.weight"]
        assert torch.equal(tensor, source) and tensor.data_ptr() != source.data_ptr()


# ----------------------------------------------------------------------------- arguments


def test_bad_arguments_raise(model_dir, tmp_path):
    with pytest.raises(ValueError, match="method: expected one of"):
        make_trainer(model_dir, tmp_path, method="uniform")
    wrong_index = Dataset.from_dict({"prompt": PROMPTS[:2], "lze_index": [1, 0]})
    with pytest.raises(ValueError, match="lze_index"):
        LZEGRPOTrainer(model=model_dir, reward_funcs=pattern_reward,
                       args=make_config(tmp_path), train_dataset=wrong_index)
    with pytest.raises(ValueError, match="map-style"):
        LZEGRPOTrainer(model=model_dir, reward_funcs=pattern_reward,
                       args=make_config(tmp_path), train_dataset=wrong_index.to_iterable_dataset())


def test_unknown_method_is_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="method: expected one of"):
        make_trainer(model_dir, tmp_path, method="top")


def format_reward(completions, **_):
    """A reward every completion earns (as a format reward often is at first)."""
    return [1.0] * len(completions)


def test_a_format_and_an_accuracy_reward_need_score_fn(model_dir, tmp_path):
    """TRL sums its reward functions: a format and an accuracy reward in [0, 1] each sum to
    [0, 2], which LZE refuses at the first step, saying how to map them to [0, 1]."""
    config = make_config(tmp_path, max_steps=1)
    rewards = [format_reward, pattern_reward]
    with pytest.raises(ValueError, match=r"sum to \[0, 2\].*score_fn=lambda r: r / 2"):
        make_trainer(model_dir, tmp_path, reward=rewards, config=config).train()
    trainer = make_trainer(model_dir, tmp_path, reward=rewards, config=config,
                           score_fn=lambda r: r / 2)
    trainer.train()
    assert trainer.state.global_step == 1


# ----------------------------------------------------------------------------- the loss

# Dataset rows of one generation batch (6 groups, 2 micro-batches of 3 groups), keep_ratio 0.5,
# first sight: energies 0.5 (p = 1/2) and 0.5625 (p = 1/4), so k = 3 keeps
LAYOUTS = {
    "uneven": [2, 0, 1, 3, 6, 7],  # positions 0, 3, 5: 1 kept group, then 2
    "one_empty": [0, 1, 4, 2, 3, 7],  # positions 3, 4, 5: 0 kept groups, then 3
    "even": [2, 0, 1, 3, 4, 5],  # positions 0, 3 (two candidates): 1 and 1
}


class VariableLengthTrainer(LZEGRPOTrainer):
    """Cuts completion i to 1 + (5 i mod 6) tokens, as if it had ended early: the loss types'
    normalisers (sequence means, token means, max length) then differ."""

    def _generate(self, prompts):
        prompt_ids, completion_ids, *rest = super()._generate(prompts)
        lengths = [1 + (5 * i) % self.max_completion_length for i in range(len(completion_ids))]
        return (prompt_ids, [ids[:n] for ids, n in zip(completion_ids, lengths)], *rest)


@pytest.fixture(scope="module")
def loss_trainer(model_dir, tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("loss"), per_device_train_batch_size=3 * G,
                         steps_per_generation=2)
    trainer = make_trainer(model_dir, None, config=config, trainer_cls=VariableLengthTrainer,
                           lze_config=LZEConfig(keep_ratio=0.5, noise_scale=0.0))
    # float64: at initialisation every rollout's gradient is nearly the same, so a group's GRPO
    # gradient is a small difference of large terms, and fp32 rounding of differently batched
    # sums would show up at 1e-3 (TRL alone, regrouping the same rows).
    trainer.model.double().train()
    trainer.current_gradient_accumulation_steps = 2  # = steps_per_generation, as in training
    return trainer


@pytest.fixture(scope="module")
def generation_batches(loss_trainer):
    """One scored generation batch per layout, each from a fresh selector (first sight)."""
    fresh = loss_trainer.lze_selector.state_dict()
    batches = {}
    for name, rows in LAYOUTS.items():
        loss_trainer.lze_selector.load_state_dict(fresh)
        inputs = [{"prompt": PROMPTS[row], "lze_index": row} for row in rows for _ in range(G)]
        torch.manual_seed(0)
        batches[name] = loss_trainer._generate_and_score_completions(inputs)
    return batches


def gradient(trainer, loss_fn, micro_batches):
    trainer.model.zero_grad(set_to_none=True)
    for batch in micro_batches:
        loss_fn(trainer.model, batch).backward()
    return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def kept_only_micro_batches(batch):
    """TRL's view of a generation batch that held only the kept groups, split evenly."""
    keep = batch["lze_keep"]
    kept = {key: value[keep] for key, value in batch.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "lze_keep"}
    kept["num_items_in_batch"] = kept["completion_mask"].sum()
    return split_tensor_dict(kept, 2)


def test_layouts_keep_the_expected_groups(generation_batches):
    expected = {"uneven": [0, 3, 5], "one_empty": [3, 4, 5], "even": [0, 3]}
    for name, positions in expected.items():
        keep = generation_batches[name]["lze_keep"].view(-1, G)
        assert keep.all(dim=1).nonzero().squeeze(1).tolist() == positions
        assert (keep.all(dim=1) | ~keep.any(dim=1)).all()  # whole groups only


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_equals_trl_on_the_kept_groups_alone(loss_trainer, generation_batches,
                                                      loss_type, layout, monkeypatch):
    if loss_type == "bnpo" and layout != "even":
        pytest.skip("bnpo normalises per micro-batch: equal only for evenly spread kept rows")
    monkeypatch.setattr(loss_trainer, "loss_type", loss_type)
    batch = generation_batches[layout]
    ours = gradient(loss_trainer, loss_trainer._compute_loss, split_tensor_dict(batch, 2))
    reference = gradient(loss_trainer, lambda m, b: GRPOTrainer._compute_loss(loss_trainer, m, b),
                         kept_only_micro_batches(batch))
    assert len(ours) == len(reference) > 0
    for mine, theirs in zip(ours, reference):  # up to rounding of differently batched sums
        assert (mine - theirs).norm() <= 1e-6 * theirs.norm()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dropped_groups_leave_the_gradient_unchanged(loss_trainer, generation_batches,
                                                     loss_type, monkeypatch):
    monkeypatch.setattr(loss_trainer, "loss_type", loss_type)
    batch = generation_batches["uneven"]
    dropped = ~batch["lze_keep"]
    noise = torch.randint_like(batch["completion_ids"], 0, 200)
    perturbed = {**batch,
                 "completion_ids": torch.where(dropped[:, None], noise, batch["completion_ids"]),
                 "advantages": torch.where(dropped, -5.0 * batch["advantages"] + 1.0,
                                           batch["advantages"])}
    before = gradient(loss_trainer, loss_trainer._compute_loss, split_tensor_dict(batch, 2))
    after = gradient(loss_trainer, loss_trainer._compute_loss, split_tensor_dict(perturbed, 2))
    assert any(g.abs().sum() > 0 for g in before)
    for x, y in zip(before, after):
        assert torch.equal(x, y)


def two_process_gradients(out_path, model_dir):
    """Under torchrun (2 processes): one generation batch of LAYOUTS["uneven"], rank 0 holding
    groups 0-2 (1 kept) and rank 1 groups 3-5 (2 kept); per loss type the DDP-averaged gradient
    of one micro-step. Rank 0 saves them with the weights and every kept row."""
    import torch.distributed as dist

    trainer = make_trainer(model_dir, None, trainer_cls=VariableLengthTrainer,
                           config=make_config(os.path.dirname(out_path),
                                              per_device_train_batch_size=3 * G),
                           lze_config=LZEConfig(keep_ratio=0.5, noise_scale=0.0))
    trainer.model.double().train()
    trainer.current_gradient_accumulation_steps = 1
    rank = dist.get_rank()
    local = LAYOUTS["uneven"][3 * rank: 3 * rank + 3]
    batch = trainer._generate_and_score_completions(
        [{"prompt": PROMPTS[row], "lze_index": row} for row in local for _ in range(G)])
    gradients = {}
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        trainer.model.zero_grad(set_to_none=True)
        trainer._compute_loss(trainer.model, batch).backward()
        gradients[loss_type] = [p.grad / 2 for p in trainer.model.parameters()]
        for grad in gradients[loss_type]:
            dist.all_reduce(grad)  # what DDP does: the mean over processes
    kept = {key: value[batch["lze_keep"]] for key, value in batch.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "lze_keep"}
    every_kept = [None, None]
    dist.all_gather_object(every_kept, kept)
    if rank == 0:
        kept = {key: torch.cat([part[key] for part in every_kept]) for key in kept}
        torch.save({"weights": trainer.model.state_dict(), "gradients": gradients,
                    "kept": kept}, out_path)


@pytest.mark.slow  # two processes under torchrun: about 40 s
def test_two_processes_give_the_gradient_of_trl_on_the_kept_groups(model_dir, tmp_path):
    out_path = str(tmp_path / "two_processes.pt")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    __file__, out_path, model_dir], check=True, timeout=900,
                   stdout=subprocess.DEVNULL)
    result = torch.load(out_path, weights_only=True)
    batch = result["kept"]  # the 3 kept groups, on one process
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    trainer = make_trainer(model_dir, tmp_path, trainer_cls=GRPOTrainer)  # one process, GA 1
    trainer.model.double().train()
    trainer.model.load_state_dict(result["weights"])
    trainer.current_gradient_accumulation_steps = 1
    for loss_type in LOSS_TYPES:
        if loss_type == "bnpo":  # kept rows are uneven across the processes (see above)
            continue
        trainer.loss_type = loss_type
        reference = gradient(trainer, trainer._compute_loss, [batch])
        for mine, theirs in zip(result["gradients"][loss_type], reference):
            assert (mine - theirs).norm() <= 1e-6 * theirs.norm(), loss_type


def test_num_items_in_batch_counts_kept_tokens_only(generation_batches):
    batch = generation_batches["uneven"]
    assert len(set(batch["completion_mask"].sum(1).tolist())) == 6  # VariableLengthTrainer
    kept_tokens = batch["completion_mask"][batch["lze_keep"]].sum()
    assert batch["num_items_in_batch"] == kept_tokens < batch["completion_mask"].sum()
    assert batch["lze_kept_completions"] == 3 * G


# ----------------------------------------------------------------------------- training


class RecordingTrainer(LZEGRPOTrainer):
    """Keeps every step's group selection."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.selections = getattr(self, "selections", []) + [self.lze_last_selection]
        return output


def test_dapo_method_drops_exactly_the_zero_variance_groups(model_dir, tmp_path):
    config = make_config(tmp_path, max_steps=3, remove_unused_columns=True)  # keeps lze_index
    trainer = make_trainer(model_dir, tmp_path, trainer_cls=RecordingTrainer, method="dapo",
                           config=config)
    trainer.train()
    assert trainer.lze_selector is None and len(trainer.selections) == 3
    for selection in trainer.selections:
        expected = [mixed(row) for row in selection.prompt_ids.tolist()]
        assert selection.keep.tolist() == expected
    logs = [entry for entry in trainer.state.log_history if "lze/kept_ratio" in entry]
    for entry in logs:  # TRL's own metric says the same
        assert entry["lze/kept_ratio"] == pytest.approx(1.0 - entry["frac_reward_zero_std"])


def sampled_rows(log):
    """Wrap the reward to record each step's dataset rows (one per group)."""

    def reward(completions, lze_index, **kwargs):
        log.append(lze_index[::G])
        return pattern_reward(completions, lze_index, **kwargs)

    return reward


@pytest.mark.slow  # 14 TRL steps and two checkpoints: about 20 s
def test_training_checkpoint_and_resume_reproduce_the_selection(model_dir, tmp_path):
    # 6 prompts, 2 per step: 3 steps per epoch; checkpoint after step 4 (inside epoch 1).
    lze_config = LZEConfig(keep_ratio=0.5, replay_ratio=0.0, seed=7)
    config = make_config(tmp_path, max_steps=9, save_strategy="steps", save_steps=4)
    full_log, resumed_log = [], []
    full = make_trainer(model_dir, tmp_path, num_prompts=6, reward=sampled_rows(full_log),
                        config=config, lze_config=lze_config, prune=True)
    full.train()

    metrics = [entry for entry in full.state.log_history if "loss" in entry]
    assert len(metrics) == 9
    for key in ("lze/kept_ratio", "lze/energy_mean", "lze/pruned", "frac_reward_zero_std"):
        assert all(key in entry for entry in metrics)
    # Rows 0 and 4 are solved in epochs 0 and 1 (prune_after = 2): epoch 2 never samples them.
    assert sorted(sum(full_log[:3], [])) == sorted(sum(full_log[3:6], [])) == list(range(6))
    assert not {0, 4} & set(sum(full_log[6:], []))
    assert metrics[-1]["lze/pruned"] == pytest.approx(2 / 6)

    checkpoint = tmp_path / "checkpoint-4"
    assert (checkpoint / STATE_FILE).is_file()
    resumed = make_trainer(model_dir, tmp_path, num_prompts=6, reward=sampled_rows(resumed_log),
                           config=config, lze_config=lze_config, prune=True)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_log == full_log[4:]
    final, again = full.lze_state_dict(), resumed.lze_state_dict()
    for key in ("fstate", "istate", "step_counter"):
        assert torch.equal(final["selector"][key], again["selector"][key])
    assert final["selector"]["epoch"] == again["selector"]["epoch"] == 3
    assert torch.equal(final["planner"]["order"], again["planner"]["order"])


if __name__ == "__main__":  # the processes of test_two_processes_give_the_gradient_of_trl_...
    two_process_gradients(sys.argv[1], sys.argv[2])

"""verl's own training loops on the CPU, with what each stage receives recorded.

:func:`fit_legacy` builds verl's legacy ``RayPPOTrainer`` (or a subclass) the way verl's
``main_ppo_v0.TaskRunner`` does and runs its ``fit()``; :func:`fit_v1` builds the v1 trainer and
its TransferQueue agent-loop manager the way ``main_ppo.TaskRunnerV1`` does and runs its
``fit(manager)``. Everything in between is verl's: the Ray worker group with verl's
``ActorRolloutRefWorker`` (FSDP2 actor and reference on gloo), its agent loop, reward loop, load
balancer and weight sync, the advantage estimators, the replay buffer. The CPU pieces are the
platform (:mod:`.platform`) and the rollout server (:mod:`.hf_rollout`).

What is recorded (:class:`Run`), per step:

* each stage's input as verl's ``fit`` passes it to the worker group (a proxy around the group:
  ``compute_log_prob`` = old log-probs, ``compute_ref_log_prob``, ``update_actor``): rows, the
  synthetic padding rows v1 adds, tokens (prompt + response, what a forward pass runs over),
  and the token ids of the updated rows;
* the rollout: every response the rollout server generated (prompt ids, response ids, log-probs),
  and the rows ``fit`` handed the rollout manager;
* the weights the server received after each update (verl's weight sync): step 0 is the start.
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from . import hf_rollout, platform, task

TESTS_DIR = str(Path(__file__).resolve().parents[1])
STAGES = ("rollout", "old_log_prob", "ref_log_prob", "update")
FP32 = "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"


@dataclass(frozen=True)
class Shape:
    """A small run: ``batch`` prompts of ``n`` responses of at most ``response_length`` tokens,
    ``steps`` steps, on a dataset of ``prompts`` rows."""

    batch: int = 4
    n: int = 4
    steps: int = 3
    prompts: int = 16
    response_length: int = 8


@contextmanager
def cpu_platform():
    """This process (the trainer's driver) on the CPU platform and its environment, restored
    afterwards; Ray workers get the same environment through :func:`ray_session`."""
    from verl.plugin.platform import platform_manager

    environment = platform.environment(TESTS_DIR)
    saved = {key: os.environ.get(key) for key in environment}
    previous = platform_manager._current_platform
    os.environ.update(environment)
    platform.activate()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        platform_manager._current_platform = previous


def compose(model: Path, train_file: Path, work: Path, *, v1: bool, shape: Shape = Shape(),
            overrides: Iterable[str] = ()) -> DictConfig:
    """verl's ``ppo_trainer`` config, composed with hydra as ``main_ppo`` does, for one CPU
    worker: FSDP2 in fp32, micro-batches of one group (n rows), SGD (so an update is -lr x gradient), KL loss against the reference
    model, rollout ``hf`` with one agent-loop and one reward worker, no validation or saving."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    import verl.trainer.main_ppo as main_ppo

    b, n = shape.batch, shape.n
    base = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train_file}", f"data.val_files={train_file}",
        f"data.train_batch_size={b}", "data.max_prompt_length=32",
        f"data.max_response_length={shape.response_length}", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={b}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={n}",
        "actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=0.1",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.optim.clip_grad=1e9",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={n}",
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.full_determinism=True",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={Path(task.__file__)}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.use_v1={v1}", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", f"trainer.total_training_steps={shape.steps}",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work / 'checkpoints'}",
    ]
    if v1:
        base += ["transfer_queue.enable=True",
                 "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"]
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=base + list(overrides))
    OmegaConf.resolve(config)
    return config


@contextmanager
def ray_session(v1: bool):
    """A local Ray instance for one run (verl names its rollout servers by replica rank, so runs
    do not share one): one logical GPU for the worker, CPUs oversubscribed so that verl's
    placement groups resolve on two cores; for v1 also TransferQueue with one storage unit."""
    env = platform.environment(TESTS_DIR)
    if v1:
        env["TRANSFER_QUEUE_ENABLE"] = "1"
    ray.init(num_cpus=32, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        if v1:
            import transfer_queue as tq

            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {
                "num_data_storage_units": 1}}}))
            try:
                yield
            finally:
                tq.close()
        else:
            yield
    finally:
        ray.shutdown()


@dataclass
class StageInput:
    """One call of a stage: rows, v1's synthetic padding rows among them, tokens."""

    rows: int
    padding_rows: int
    tokens: int
    sequences: Optional[list[tuple[int, ...]]] = None  # update: the real rows' token ids


@dataclass
class Generation:
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    log_probs: tuple[float, ...]


@dataclass
class Run:
    """What one ``fit`` passed each stage, per step (1-based), and the synced weights."""

    stages: dict[int, dict[str, list[StageInput]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    generations: dict[int, list[Generation]] = field(default_factory=dict)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    parameters: int = 0

    def rows(self, step: int, stage: str) -> int:
        return sum(call.rows for call in self.stages[step][stage])

    def padding_rows(self, step: int, stage: str) -> int:
        return sum(call.padding_rows for call in self.stages[step][stage])

    def tokens(self, step: int, stage: str) -> int:
        if stage == "rollout":
            return sum(len(g.prompt) + len(g.response) for g in self.generations[step])
        return sum(call.tokens for call in self.stages[step][stage])

    @property
    def steps(self) -> list[int]:
        return sorted(self.generations)


class RecordingWorkerGroup:
    """verl's worker group as ``fit`` uses it, recording each stage's input before the call."""

    STAGE_OF = {"compute_log_prob": "old_log_prob", "compute_ref_log_prob": "ref_log_prob",
                "update_actor": "update"}

    def __init__(self, group, trainer, run: Run):
        self._group, self._trainer, self._run = group, trainer, run

    def __getattr__(self, name):
        attribute = getattr(self._group, name)
        if name not in self.STAGE_OF:
            return attribute

        def recorded(data, *args, **kwargs):
            stage = self.STAGE_OF[name]
            self._run.stages[self._trainer.global_steps][stage].append(
                _stage_input(data, keep_sequences=stage == "update"))
            return attribute(data, *args, **kwargs)

        return recorded


class RecordingRolloutManager:
    """The rollout manager as ``fit`` uses it, recording the rows each call hands it
    (legacy: prompts already repeated n times; v1: prompts, each rolled out n times)."""

    def __init__(self, manager, trainer, run: Run, repeat: int):
        self._manager, self._trainer, self._run, self._repeat = manager, trainer, run, repeat

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def generate_sequences(self, prompts):
        self._run.stages[self._trainer.global_steps]["rollout"].append(
            StageInput(rows=len(prompts) * self._repeat, padding_rows=0, tokens=0))
        return self._manager.generate_sequences(prompts)


def _stage_input(data, keep_sequences: bool) -> StageInput:
    """Rows and tokens of a stage's input: a no-padding TensorDict (legacy) or v1's
    ``KVBatchMeta`` (its tags carry each row's ``seq_len`` and padding flag; the rows' tokens
    are in TransferQueue, where the worker reads them)."""
    tags = getattr(data, "tags", None)
    if tags is None:
        input_ids = data["input_ids"]
    else:
        import transfer_queue as tq

        real = [key for key, tag in zip(data.keys, tags) if not tag.get("is_padding", False)]
        input_ids = tq.kv_batch_get(keys=real, partition_id=data.partition_id,
                                    select_fields=["input_ids"])["input_ids"]
    offsets = input_ids.offsets().tolist()
    sequences = None
    if keep_sequences:
        values = input_ids.values().tolist()
        sequences = [tuple(values[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    if tags is None:
        return StageInput(rows=len(offsets) - 1, padding_rows=0, tokens=offsets[-1],
                          sequences=sequences)
    return StageInput(rows=len(tags), padding_rows=len(tags) - (len(offsets) - 1),
                      tokens=sum(int(tag["seq_len"]) for tag in tags), sequences=sequences)


def flops(run: Run) -> float:
    """Mean FLOPs proxy per step (``trainer/compute.py``'s convention: 2P per prefill and
    generated token and per token of a log-prob pass, 6P per update token)."""
    per_token = _compute_convention()
    total = sum(sum(per_token["prefill"] * len(g.prompt) + per_token["generated"] * len(g.response)
                    for g in run.generations[step])
                + per_token["forward"] * (run.tokens(step, "old_log_prob")
                                          + run.tokens(step, "ref_log_prob"))
                + per_token["update"] * run.tokens(step, "update") for step in run.steps)
    return total * run.parameters / len(run.steps)


def _compute_convention() -> dict[str, float]:
    """FLOPs per parameter of each kind of token, from the trainer's compute ledger (loaded by
    path: the verl venv does not install the trainer)."""
    return task.load_trainer_module("compute").FLOPS_PER_PARAM


def _collect_server(run: Run) -> None:
    """The rollout server's record: every generation of each step, the weights after each."""
    server = ray.get_actor(hf_rollout.SERVER_NAME.format(0))
    history, weights, parameters = ray.get([server.history.remote(),
                                            server.weight_history.remote(),
                                            server.parameter_count.remote()])
    # Rollouts of step s run on the weights synced after step s - 1 (verl syncs step 0 first).
    run.generations = {synced + 1: [Generation(*g) for g in gens]
                       for synced, gens in history.items()}
    run.weights = weights
    run.parameters = parameters


def _legacy_trainer(config: DictConfig, trainer_cls):
    """verl's legacy trainer, assembled as ``main_ppo_v0.TaskRunner.run`` does."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.utils import (create_rl_dataset, create_rl_sampler, need_critic,
                                        need_reference_policy)
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.dataset.rl_dataset import collate_fn

    runner = BaseTaskRunner()
    _, worker_group_cls = runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    runner.add_reward_model_resource_pool(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    tokenizer = omega_conf_to_dataclass(config.actor_rollout_ref.model).tokenizer
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None,
                                is_train=True)
    return trainer_cls(config=config, tokenizer=tokenizer, processor=None,
                       role_worker_mapping=runner.role_worker_mapping,
                       resource_pool_manager=runner.init_resource_pool_mgr(config),
                       ray_worker_group_cls=worker_group_cls, train_dataset=dataset,
                       val_dataset=dataset, collate_fn=collate_fn,
                       train_sampler=create_rl_sampler(config.data, dataset))


def fit_legacy(config: DictConfig, trainer_cls=None, before_fit=None) -> Run:
    """Run verl's legacy ``RayPPOTrainer.fit()`` (or ``trainer_cls``'s) and record it.
    ``before_fit(trainer)`` runs after the workers are up (e.g. to make the server replay)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    run = Run()
    with ray_session(v1=False):
        trainer = _legacy_trainer(config, trainer_cls or RayPPOTrainer)
        trainer.init_workers()
        group = RecordingWorkerGroup(trainer.actor_rollout_wg, trainer, run)
        trainer.actor_rollout_wg = trainer.ref_policy_wg = group
        trainer.async_rollout_manager = RecordingRolloutManager(
            trainer.async_rollout_manager, trainer, run, repeat=1)
        if before_fit is not None:
            before_fit(trainer)
        trainer.fit()
        _collect_server(run)
    return run


def fit_v1(config: DictConfig, before_fit=None) -> Run:
    """Run verl's v1 trainer (``trainer.v1.trainer_mode``) with its TransferQueue agent loop,
    as ``main_ppo.TaskRunnerV1.run`` does, and record it."""
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ, get_trainer_cls

    run = Run()
    with ray_session(v1=True):
        trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
        trainer.init()
        manager = AgentLoopManagerTQ.create(config=config, llm_client=trainer.get_llm_client(),
                                            teacher_client=trainer.get_teacher_client(),
                                            reward_loop_worker_handles=trainer.get_reward_handles())
        group = RecordingWorkerGroup(trainer.actor_rollout_wg, trainer, run)
        trainer.actor_rollout_wg = trainer.ref_policy_wg = group
        if before_fit is not None:
            before_fit(trainer)
        trainer.fit(RecordingRolloutManager(manager, trainer, run,
                                            repeat=config.actor_rollout_ref.rollout.n))
        _collect_server(run)
    return run


def replay_on_server(generations: Iterable[Generation]):
    """A ``before_fit`` that makes the rollout server answer with ``generations``."""
    responses = defaultdict(list)
    for g in generations:
        responses[g.prompt].append((g.response, g.log_probs))

    def before_fit(trainer):
        server = ray.get_actor(hf_rollout.SERVER_NAME.format(0))
        ray.get(server.replay.remote(dict(responses)))

    return before_fit


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


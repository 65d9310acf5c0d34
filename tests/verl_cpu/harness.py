"""verl's own training loops on the CPU, with what each stage receives recorded.

:func:`fit_legacy` builds verl's legacy ``RayPPOTrainer`` (or a subclass) the way verl's
``main_ppo_v0.TaskRunner`` does and runs its ``fit()``; :func:`fit_v1` builds the v1 trainer and
its TransferQueue agent-loop manager the way ``main_ppo.TaskRunnerV1`` does and runs its
``fit(manager)``. Everything in between is verl's: the Ray worker group with verl's
``ActorRolloutRefWorker`` (FSDP2 actor and reference on gloo), its agent loop, reward loop, load
balancer and weight sync, the advantage estimators, the replay buffer. The CPU pieces are the
platform (:mod:`.platform`) and the rollout server (:mod:`.hf_rollout`).

What is recorded (:class:`Run`), per step:

* each stage's input as each data-parallel rank's worker receives it (``compute_log_prob`` =
  old log-probs, ``compute_ref_log_prob``, ``update_actor``; the arguments of verl's remote call
  to that rank, after its own dispatch split the batch): rows, the synthetic padding rows v1
  adds, tokens (prompt + response, what a forward pass runs over), and the token ids of the
  updated rows;
* the rollout: every response the rollout server generated (prompt ids, response ids, log-probs),
  and the rows ``fit`` handed the rollout manager;
* the weights the server received after each update (verl's weight sync): step 0 is the start;
* the metrics ``fit`` logged (verl's ``Tracking.log``).
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

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
    ``steps`` steps, on a dataset of ``prompts`` rows, ``ranks`` data-parallel actor workers."""

    batch: int = 4
    n: int = 4
    steps: int = 3
    prompts: int = 16
    response_length: int = 8
    ranks: int = 2


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
    """verl's ``ppo_trainer`` config, composed with hydra as ``main_ppo`` does, for
    ``shape.ranks`` CPU workers: FSDP2 in fp32, micro-batches of one group (n rows), SGD (so an
    update is -lr x gradient), KL loss against the reference model, rollout ``hf`` (one server
    across the ranks) with one agent-loop and one reward worker, no validation or saving."""
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
        # One rollout server across the ranks (its seeded draws do not depend on routing).
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={shape.ranks}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.full_determinism=True",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={Path(task.__file__)}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.use_v1={v1}", "trainer.device=cpu",
        f"trainer.n_gpus_per_node={shape.ranks}", "trainer.nnodes=1",
        f"trainer.total_training_steps={shape.steps}",
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
def ray_session(config: DictConfig):
    """A local Ray instance for one run (verl names its rollout servers by replica rank, so runs
    do not share one): one logical GPU per actor worker, CPUs oversubscribed so that verl's
    placement groups resolve on two cores; for v1 also TransferQueue with one storage unit."""
    v1 = config.trainer.use_v1
    env = platform.environment(TESTS_DIR)
    if v1:
        env["TRANSFER_QUEUE_ENABLE"] = "1"
    ray.init(num_cpus=32, num_gpus=config.trainer.n_gpus_per_node, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env})
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
    """One rank's share of a stage call (``rank`` None: the rollout manager's whole call): rows,
    v1's synthetic padding rows among them, tokens."""

    rows: int
    padding_rows: int
    tokens: int
    rank: Optional[int] = None
    sequences: Optional[list[tuple[int, ...]]] = None  # update: the real rows' token ids


@dataclass
class Generation:
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    log_probs: tuple[float, ...]


@dataclass
class Run:
    """What one ``fit`` passed each stage, per step (1-based), the synced weights, and the
    metrics ``fit`` logged."""

    stages: dict[int, dict[str, list[StageInput]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    generations: dict[int, list[Generation]] = field(default_factory=dict)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    metrics: dict[int, dict] = field(default_factory=dict)
    parameters: int = 0

    def rows(self, step: int, stage: str) -> int:
        return sum(call.rows for call in self.stages[step][stage])

    def rows_per_rank(self, step: int, stage: str) -> dict[int, int]:
        """Rows each data-parallel rank's worker received in ``stage`` of ``step``."""
        counts: dict[int, int] = defaultdict(int)
        for call in self.stages[step][stage]:
            counts[call.rank] += call.rows
        return dict(counts)

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
    """verl's worker group as ``fit`` uses it, recording each stage at the worker calls: what
    verl's dispatch hands each rank's worker (the arguments of its remote call)."""

    STAGE_OF = {"compute_log_prob": "old_log_prob", "compute_ref_log_prob": "ref_log_prob",
                "update_actor": "update"}

    def __init__(self, group, trainer, run: Run):
        self._group, self._trainer, self._run = group, trainer, run
        self._tags: dict = {}  # v1: key -> tag (seq_len, padding flag) of the call in flight
        remote = group._execute_remote_single_worker

        def recorded(worker, method_name, *args, **kwargs):
            stage = self._stage_of(method_name)
            if stage is not None:
                share = _stage_input(args[0], self._tags, keep_sequences=stage == "update")
                share.rank = group._workers.index(worker)
                run.stages[trainer.global_steps][stage].append(share)
            return remote(worker, method_name, *args, **kwargs)

        group._execute_remote_single_worker = recorded

    def _stage_of(self, method_name: str) -> Optional[str]:
        """The stage of a worker method (verl's colocated workers prefix it with the role,
        e.g. ``actor_rollout_ref_update_actor``)."""
        for name, stage in self.STAGE_OF.items():
            if method_name == name or method_name.endswith(f"_{name}"):
                return stage
        return None

    def __getattr__(self, name):
        attribute = getattr(self._group, name)
        if name not in self.STAGE_OF:
            return attribute

        def call(data, *args, **kwargs):
            self._tags = dict(zip(data.keys, data.tags)) if hasattr(data, "tags") else {}
            return attribute(data, *args, **kwargs)

        return call


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


def _stage_input(share, tags: dict, keep_sequences: bool) -> StageInput:
    """Rows and tokens of one rank's share: a no-padding TensorDict (legacy) or a
    TransferQueue ``BatchMeta`` (v1; ``tags`` of the whole call carry each row's ``seq_len`` and
    padding flag; the rows' tokens are in TransferQueue, where the worker reads them). A share
    verl put in Ray's object store is read from there."""
    if isinstance(share, ray.ObjectRef):
        share = ray.get(share)
    if tags:
        import transfer_queue as tq
        from verl.utils.transferqueue_utils import batch_meta2kv_batch_meta

        meta = batch_meta2kv_batch_meta(share)
        share_tags = [tags[key] for key in meta.keys]
        real = [key for key, tag in zip(meta.keys, share_tags) if not tag.get("is_padding", False)]
        input_ids = tq.kv_batch_get(keys=real, partition_id=meta.partition_id,
                                    select_fields=["input_ids"])["input_ids"]
    else:
        input_ids = share["input_ids"]
    offsets = input_ids.offsets().tolist()
    sequences = None
    if keep_sequences:
        values = input_ids.values().tolist()
        sequences = [tuple(values[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    if not tags:
        return StageInput(rows=len(offsets) - 1, padding_rows=0, tokens=offsets[-1],
                          sequences=sequences)
    return StageInput(rows=len(share_tags), padding_rows=len(share_tags) - (len(offsets) - 1),
                      tokens=sum(int(tag["seq_len"]) for tag in share_tags), sequences=sequences)


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


def _legacy_trainer(config: DictConfig, trainer_cls, train_sampler=None):
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
                       train_sampler=train_sampler or create_rl_sampler(config.data, dataset))


def fit_legacy(config: DictConfig, trainer_cls=None, before_fit=None,
               train_sampler=None) -> Run:
    """Run verl's legacy ``RayPPOTrainer.fit()`` (or ``trainer_cls``'s) and record it.
    ``before_fit(trainer)`` runs after the workers are up (e.g. to make the server replay);
    ``train_sampler`` replaces verl's ``create_rl_sampler`` as the trainer's ``train_sampler``."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    run = Run()
    with ray_session(config), _logged_metrics(run):
        trainer = _legacy_trainer(config, trainer_cls or RayPPOTrainer, train_sampler)
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
    with ray_session(config), _logged_metrics(run):
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


@contextmanager
def _logged_metrics(run: Run):
    """Every metrics dict ``fit`` logs (verl's ``Tracking.log``), by step, into ``run``."""
    from verl.utils.tracking import Tracking

    log = Tracking.log

    def record(self, data, step, *args, **kwargs):
        run.metrics.setdefault(step, {}).update(data)
        return log(self, data, step, *args, **kwargs)

    Tracking.log = record
    try:
        yield
    finally:
        Tracking.log = log


def replay_on_server(generations: Iterable[Generation]):
    """A ``before_fit`` that makes the rollout server answer with ``generations``."""
    responses = defaultdict(list)
    for g in generations:
        responses[g.prompt].append((g.response, g.log_probs))

    def before_fit(trainer):
        server = ray.get_actor(hf_rollout.SERVER_NAME.format(0))
        ray.get(server.replay.remote(dict(responses)))

    return before_fit


@contextmanager
def registered(estimator) -> Iterator[str]:
    """``estimator`` in verl's registry under a fresh name (``algorithm.adv_estimator``),
    removed afterwards."""
    from verl.trainer.ppo import core_algos

    name = f"lze_fit_{uuid.uuid4().hex[:8]}"
    estimator.register(name)
    try:
        yield name
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)


def v1_buffer(mode: str, num_prompts: int, lze: dict, forward: Optional[dict] = None) -> list[str]:
    """Overrides that make ``LZEReplayBuffer`` (``mode``, method lze, the ``LZEConfig`` fields
    ``lze``, the forward sampler options ``forward``) the v1 trainer's sampler, with
    ``LZERLHFDataset`` as its dataset class."""
    kwargs = "+trainer.v1.sampler.sampler_kwargs"
    return ["trainer.v1.sampler.custom_sampler.path="
            "pkg://lze_kernels.integrations.verl.replay_buffer",
            "trainer.v1.sampler.custom_sampler.name=LZEReplayBuffer",
            "data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint",
            "data.custom_cls.name=LZERLHFDataset",
            f"{kwargs}.mode={mode}", f"{kwargs}.method=lze", f"{kwargs}.num_prompts={num_prompts}",
            *(f"{kwargs}.lze.{key}={value}" for key, value in lze.items()),
            *(f"{kwargs}.forward.{key}={value}" for key, value in (forward or {}).items())]


def prompt_rows(run: Run, step: int, tokenizer) -> tuple[list[int], list[int]]:
    """``(rolled out, updated)``: the dataset rows of ``step``'s generations and of the rows
    its update received, sorted (a row per group: rows repeat when a batch repeats a prompt),
    read from the prompts' text."""
    def row(tokens) -> int:
        return task.row_of_text(tokenizer.decode(list(tokens)))

    rolled_out = [row(g.prompt) for g in run.generations[step]]
    updated = [row(seq) for call in run.stages[step]["update"] for seq in call.sequences]
    return sorted(rolled_out), sorted(updated)


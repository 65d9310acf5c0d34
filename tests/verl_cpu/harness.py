"""verl's own training loops on the CPU, with what each stage receives recorded.

A :class:`Cluster` is one local Ray instance with TransferQueue and one set of verl's workers
that every ``fit`` of a test module runs on, legacy and v1: the Ray worker group running verl's
``ActorRolloutRefWorker`` on ``ranks`` data-parallel ranks (FSDP2 actor and reference on gloo),
the LLM server manager with the HF rollout server (:mod:`.hf_rollout`), the reward loop workers,
the agent loop workers of each trainer, and the weight sync. They are built once, through verl's
own ``init_workers`` on the cluster's base config; the actor's weights, optimizer and RNG state
are then saved with verl's worker ``save_checkpoint``. A trainer is built as verl's
``TaskRunner`` / ``TaskRunnerV1`` builds it (its constructor, datasets, dataloaders, replay
buffer) and gets those parts where verl's ``init_workers`` / ``_setup`` would create them, after
verl's worker ``load_checkpoint`` has put the saved state back and the rollout server's record is
cleared: each run starts from the same weights as if it had its own workers. What the workers
were built with (model, micro-batch sizes, response length, reward function) is the base
config's; what a run may change is what verl's trainer passes with each call or holds itself:
batch and mini-batch sizes, the prefix grouper, the data, the estimator, the sampler, validation
and checkpoints.

:meth:`Cluster.fit_legacy` runs verl's legacy ``RayPPOTrainer.fit()`` (or a subclass's);
:meth:`Cluster.fit_v1` the v1 trainer's ``fit(manager)``. What is recorded (:class:`Run`), per
step:

* each stage's input as each data-parallel rank's worker receives it (``compute_log_prob`` =
  old log-probs, ``compute_ref_log_prob``, ``update_actor``; the arguments of verl's remote call
  to that rank, after its own dispatch split the batch): rows, the synthetic padding rows v1
  adds, tokens (prompt + response, what a forward pass runs over), and the token ids of the
  updated rows;
* the rollout: every response the rollout server generated (prompt ids, response ids, log-probs),
  and the rows ``fit`` handed the rollout manager; validation's responses apart;
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
# What the shared workers are built with and verl reads from their own config (not per call).
WORKER_SETTINGS = ("actor_rollout_ref.model.path", "actor_rollout_ref.rollout.n",
                   "actor_rollout_ref.rollout.response_length")


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
    afterwards; Ray workers get the same environment through the cluster's runtime env."""
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


def compose(model: Path, work: Path, *, v1: bool, shape: Shape = Shape(),
            train_files=None, val_files=None, overrides: Iterable[str] = ()) -> DictConfig:
    """verl's ``ppo_trainer`` config, composed with hydra as ``main_ppo`` does, for
    ``shape.ranks`` CPU workers: FSDP2 in fp32, micro-batches of one group (n rows), SGD (so an
    update is -lr x gradient), KL loss against the reference model, rollout ``hf`` (one server
    across the ranks) with one agent-loop and one reward worker, no validation or saving.
    ``train_files`` None: the data are in ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    import verl.trainer.main_ppo as main_ppo

    b, n = shape.batch, shape.n
    data = [] if train_files is None else [f"data.train_files={_files(train_files)}",
                                           f"data.val_files={_files(val_files or train_files)}"]
    base = data + [
        "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={b}", "data.max_prompt_length=128",
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


def _files(files) -> str:
    files = [files] if isinstance(files, (str, Path)) else list(files)
    return str(files[0]) if len(files) == 1 else "[" + ",".join(str(f) for f in files) + "]"


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
    """What one ``fit`` passed each stage, per step (1-based), the synced weights, the metrics
    ``fit`` logged, and the trainer it ran."""

    stages: dict[int, dict[str, list[StageInput]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    generations: dict[int, list[Generation]] = field(default_factory=dict)
    validations: dict[int, list[Generation]] = field(default_factory=dict)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    metrics: dict[int, dict] = field(default_factory=dict)
    parameters: int = 0
    trainer: object = None

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


class Recording:
    """Where the worker calls of the run in progress are recorded: verl's dispatch hands each
    rank's worker its share through the group's ``_execute_remote_single_worker``, wrapped once
    per cluster."""

    STAGE_OF = {"compute_log_prob": "old_log_prob", "compute_ref_log_prob": "ref_log_prob",
                "update_actor": "update"}

    def __init__(self, group):
        self.run: Optional[Run] = None
        self.trainer = None
        self.tags: dict = {}  # v1: key -> tag (seq_len, padding flag) of the call in flight
        remote = group._execute_remote_single_worker

        def recorded(worker, method_name, *args, **kwargs):
            stage = self.stage_of(method_name)
            if stage is not None and self.run is not None:
                share = _stage_input(args[0], self.tags, keep_sequences=stage == "update")
                share.rank = group._workers.index(worker)
                self.run.stages[self.trainer.global_steps][stage].append(share)
            return remote(worker, method_name, *args, **kwargs)

        group._execute_remote_single_worker = recorded

    @classmethod
    def stage_of(cls, method_name: str) -> Optional[str]:
        """The stage of a worker method (verl's colocated workers prefix it with the role,
        e.g. ``actor_rollout_ref_update_actor``)."""
        for name, stage in cls.STAGE_OF.items():
            if method_name == name or method_name.endswith(f"_{name}"):
                return stage
        return None


class RecordingWorkerGroup:
    """verl's worker group as ``fit`` uses it: the v1 stage calls leave their batch's tags
    with the recording (the rows' lengths and padding flags live there)."""

    def __init__(self, group, recording: Recording):
        self._group, self._recording = group, recording

    def __getattr__(self, name):
        attribute = getattr(self._group, name)
        if name not in Recording.STAGE_OF:
            return attribute

        def call(data, *args, **kwargs):
            self._recording.tags = dict(zip(data.keys, data.tags)) if hasattr(data, "tags") else {}
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
        if not _validating(prompts):
            self._run.stages[self._trainer.global_steps]["rollout"].append(
                StageInput(rows=len(prompts) * self._repeat, padding_rows=0, tokens=0))
        return self._manager.generate_sequences(prompts)


def _validating(prompts) -> bool:
    meta = getattr(prompts, "meta_info", None)
    if meta is not None:
        return bool(meta.get("validate", False))
    return "validate" in prompts.keys() and bool(prompts["validate"])


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


def flops(run: Run, every_stage: bool = False) -> float:
    """Mean FLOPs proxy per step (``trainer/compute.py``'s convention: 2P per prefill and
    generated token and per token of a log-prob pass, 6P per update token). ``every_stage``:
    had every response rolled out gone through every later stage, as in plain GRPO (whose
    log-prob passes run over exactly the rollout's tokens)."""
    per_token = task.load_trainer_module("compute").FLOPS_PER_PARAM

    def step_flops(step: int) -> float:
        rollout = sum(per_token["prefill"] * len(g.prompt) + per_token["generated"]
                      * len(g.response) for g in run.generations[step])
        tokens = {stage: run.tokens(step, "rollout" if every_stage else stage)
                  for stage in STAGES[1:]}
        return (rollout + per_token["forward"] * (tokens["old_log_prob"] + tokens["ref_log_prob"])
                + per_token["update"] * tokens["update"])

    return sum(step_flops(step) for step in run.steps) * run.parameters / len(run.steps)


# The worker-side parts a trainer gets instead of building them (verl's attribute names).
SHARED_PARTS = ("actor_rollout_wg", "ref_policy_wg", "reward_loop_manager", "llm_server_manager",
                "checkpoint_manager", "teacher_model_manager", "distillation_config",
                "ref_in_actor")


class Cluster:
    """One local Ray instance, TransferQueue and one set of verl's workers (module docstring)
    for the fits of a test module, on the CPU platform. Use as a context manager."""

    def __init__(self, work: Path, ranks: int = 2):
        from transformers import AutoTokenizer

        self.work, self.ranks = work, ranks
        self.model = task.build_model(work / "model")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.base = task.write_dataset(work / "base.parquet", 8)
        self.initial = str(work / "initial_actor")
        self.parts: dict = {}
        self.agent_loops: dict = {}  # "legacy" / "v1": each trainer's agent loop manager
        self.recording: Optional[Recording] = None
        self._contexts: list = []

    def __enter__(self) -> "Cluster":
        self._enter(cpu_platform())
        env = {**platform.environment(TESTS_DIR), "TRANSFER_QUEUE_ENABLE": "1"}
        ray.init(num_cpus=32, num_gpus=self.ranks, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
        import transfer_queue as tq

        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        self._build_workers()
        return self

    def __exit__(self, *exc) -> None:
        import transfer_queue as tq

        try:
            tq.close()
        finally:
            ray.shutdown()
            for context in reversed(self._contexts):
                context.__exit__(None, None, None)

    def _enter(self, context) -> None:
        context.__enter__()
        self._contexts.append(context)

    def compose(self, *, v1: bool, shape: Shape = Shape(), train_files=None, val_files=None,
                overrides: Iterable[str] = ()) -> DictConfig:
        """A run's config on this cluster (:func:`compose`); ``train_files`` default: the
        cluster's 8-prompt set."""
        config = compose(self.model, self.work, v1=v1, shape=shape,
                         train_files=self.base if train_files is None else train_files,
                         val_files=val_files, overrides=overrides)
        return config

    # ------------------------------------------------------------------------- runs

    def fit_legacy(self, config: DictConfig, trainer_cls=None, train_sampler=None,
                   before_fit=None, val_dataset=None) -> Run:
        """verl's legacy ``RayPPOTrainer.fit()`` (or ``trainer_cls``'s), built as
        ``main_ppo_v0.TaskRunner.run`` builds it; ``train_sampler`` replaces verl's
        ``create_rl_sampler``, ``val_dataset`` the dataset of ``data.val_files``;
        ``before_fit(trainer)`` runs after the workers are attached."""
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        run = Run()
        with _logged_metrics(run), self._session(run):
            trainer = self.legacy_trainer(config, trainer_cls or RayPPOTrainer, train_sampler,
                                          val_dataset)
            trainer.init_workers()
            self._record(trainer, run)
            trainer.async_rollout_manager = RecordingRolloutManager(
                trainer.async_rollout_manager, trainer, run, repeat=1)
            if before_fit is not None:
                before_fit(trainer)
            trainer.fit()
            self._collect_server(run)
        return run

    def fit_v1(self, config: DictConfig, before_fit=None) -> Run:
        """verl's v1 trainer (``trainer.v1.trainer_mode``) with its TransferQueue agent loop,
        as ``main_ppo.TaskRunnerV1.run`` builds them."""
        from verl.trainer.ppo.v1 import get_trainer_cls

        run = Run()
        with _logged_metrics(run), self._session(run):
            trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
            run.trainer = trainer
            trainer.init()
            trainer.replay_buffer.poll_interval = 0.05  # verl's 2 s waits for GPU rollouts
            self._record(trainer, run)
            if before_fit is not None:
                before_fit(trainer)
            trainer.fit(RecordingRolloutManager(self._agent_loop("v1", config), trainer, run,
                                                repeat=config.actor_rollout_ref.rollout.n))
            self._collect_server(run)
        return run

    def legacy_trainer(self, config: DictConfig, trainer_cls, train_sampler=None,
                       val_dataset=None):
        """verl's legacy trainer, assembled as ``main_ppo_v0.TaskRunner.run`` does (workers not
        yet attached)."""
        from verl.trainer.main_ppo_v0 import BaseTaskRunner
        from verl.trainer.ppo.utils import (create_rl_dataset, create_rl_sampler, need_critic,
                                            need_reference_policy)
        from verl.utils.config import validate_config
        from verl.utils.dataset.rl_dataset import collate_fn

        runner = BaseTaskRunner()
        _, worker_group_cls = runner.add_actor_rollout_worker(config)
        runner.add_critic_worker(config)
        runner.add_reward_model_resource_pool(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        dataset = create_rl_dataset(config.data.train_files, config.data, self.tokenizer, None,
                                    is_train=True)
        if val_dataset is None:
            val_dataset = create_rl_dataset(config.data.val_files, config.data, self.tokenizer,
                                            None, is_train=False)
        return trainer_cls(config=config, tokenizer=self.tokenizer, processor=None,
                           role_worker_mapping=runner.role_worker_mapping,
                           resource_pool_manager=runner.init_resource_pool_mgr(config),
                           ray_worker_group_cls=worker_group_cls, train_dataset=dataset,
                           val_dataset=val_dataset, collate_fn=collate_fn,
                           train_sampler=train_sampler or create_rl_sampler(config.data, dataset))

    # ------------------------------------------------------------------------- shared workers

    def _build_workers(self) -> None:
        """The workers, through verl's own ``init_workers`` on the base config, and the actor's
        initial state saved for every run to start from."""
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        config = self.compose(v1=False)
        trainer = self.legacy_trainer(config, RayPPOTrainer)
        trainer.init_workers()
        self.parts = {name: getattr(trainer, name) for name in SHARED_PARTS}
        self.agent_loops["legacy"] = trainer.async_rollout_manager
        self.worker_config = {key: OmegaConf.select(config, key) for key in WORKER_SETTINGS}
        trainer.actor_rollout_wg.save_checkpoint(self.initial, None, 0, max_ckpt_to_keep=None)
        self.recording = Recording(trainer.actor_rollout_wg)

    def _attach(self, trainer) -> None:
        """The shared parts where verl would build them, reset to the start."""
        for key, value in self.worker_config.items():
            if OmegaConf.select(trainer.config, key) != value:
                raise ValueError(f"{key}: the cluster's workers were built with {value!r}, the "
                                 f"run asks {OmegaConf.select(trainer.config, key)!r}")
        for name, value in self.parts.items():
            setattr(trainer, name, value)
        trainer.async_rollout_mode = True
        self.parts["actor_rollout_wg"].load_checkpoint(self.initial, del_local_after_load=False)
        ray.get(self._server().reset.remote())

    @contextmanager
    def _session(self, run: Run):
        """verl's worker-building steps attach the shared parts instead, for the run's
        duration; afterwards the process-wide selection registry and TransferQueue are
        cleared (the next run is a fresh start)."""
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        cluster = self

        def init_workers(trainer):
            cluster._attach(trainer)
            trainer.async_rollout_manager = cluster._agent_loop("legacy", trainer.config)
            run.trainer = trainer

        def setup(trainer):  # v1's _setup without its worker-building half
            trainer._init_tokenizer()
            trainer._init_dataloader()
            trainer._init_dump_executor()
            trainer._init_resource_pool_mgr()
            cluster._attach(trainer)
            trainer.checkpoint_manager.sleep_replicas()
            trainer._load_checkpoint()

        saved = RayPPOTrainer.init_workers, PPOTrainer._setup
        RayPPOTrainer.init_workers, PPOTrainer._setup = init_workers, setup
        try:
            yield
        finally:
            RayPPOTrainer.init_workers, PPOTrainer._setup = saved
            self.recording.run = self.recording.trainer = None
            _clear_selection_registry()
            _clear_transfer_queue()

    def _agent_loop(self, kind: str, config: DictConfig):
        """The trainer's agent loop manager, made once per kind (legacy: verl's
        ``AgentLoopManager``; v1: ``AgentLoopManagerTQ``)."""
        if kind not in self.agent_loops:
            from verl.trainer.ppo.v1 import AgentLoopManagerTQ

            self.agent_loops[kind] = AgentLoopManagerTQ.create(
                config=config, llm_client=self.parts["llm_server_manager"].get_client(),
                teacher_client=None,
                reward_loop_worker_handles=self.parts["reward_loop_manager"]
                .reward_loop_worker_handles)
        return self.agent_loops[kind]

    def _record(self, trainer, run: Run) -> None:
        self.recording.run, self.recording.trainer = run, trainer
        group = RecordingWorkerGroup(self.parts["actor_rollout_wg"], self.recording)
        trainer.actor_rollout_wg = trainer.ref_policy_wg = group

    def _server(self):
        return ray.get_actor(hf_rollout.SERVER_NAME.format(0))

    def _collect_server(self, run: Run) -> None:
        """The rollout server's record: every generation of each step, the weights after each."""
        server = self._server()
        history, validated, weights, parameters = ray.get([
            server.history.remote(), server.validation_history.remote(),
            server.weight_history.remote(), server.parameter_count.remote()])
        # Rollouts of step s run on the weights synced after step s - 1 (verl syncs step 0 first).
        run.generations = {synced + 1: [Generation(*g) for g in gens]
                           for synced, gens in history.items()}
        run.validations = {synced: [Generation(*g) for g in gens]
                           for synced, gens in validated.items()}
        run.weights = weights
        run.parameters = parameters


def _clear_selection_registry() -> None:
    from lze_kernels.integrations.verl import checkpoint

    for name in list(checkpoint._PARTS) + list(checkpoint._PENDING):
        checkpoint.unregister(name)


def _clear_transfer_queue() -> None:
    import transfer_queue as tq

    for partition, items in (tq.kv_list() or {}).items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)


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


def v1_buffer(mode: str, lze: dict, forward: Optional[dict] = None,
              method: str = "lze") -> list[str]:
    """Overrides that make ``LZEReplayBuffer`` (``mode``, ``method``, the ``LZEConfig`` fields
    ``lze``, the forward sampler options ``forward``) the v1 trainer's sampler, with
    ``LZERLHFDataset`` as its dataset class (``num_prompts`` left out: the train set's size)."""
    kwargs = "+trainer.v1.sampler.sampler_kwargs"
    return ["trainer.v1.sampler.custom_sampler.path="
            "pkg://lze_kernels.integrations.verl.replay_buffer",
            "trainer.v1.sampler.custom_sampler.name=LZEReplayBuffer",
            *LZE_DATASET, f"{kwargs}.mode={mode}", f"{kwargs}.method={method}",
            f"{kwargs}.poll_interval=0.05",
            *(f"{kwargs}.lze.{key}={value}" for key, value in lze.items()),
            *(f"{kwargs}.forward.{key}={value}" for key, value in (forward or {}).items())]


LZE_DATASET = ("data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint",
               "data.custom_cls.name=LZERLHFDataset")


def prompt_rows(run: Run, step: int, tokenizer) -> tuple[list[int], list[int]]:
    """``(rolled out, updated)``: the prompt numbers of ``step``'s generations and of the rows
    its update received, sorted (one per response: a number repeats per group member and when
    a batch repeats a prompt), read from the prompts' text."""
    def row(tokens) -> int:
        return task.row_of_text(tokenizer.decode(list(tokens)))

    rolled_out = [row(g.prompt) for g in run.generations[step]]
    updated = [row(seq) for call in run.stages[step]["update"] for seq in call.sequences]
    return sorted(rolled_out), sorted(updated)

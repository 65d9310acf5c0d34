"""The GPU check's peer stage: TRL's GRPOTrainer (Hugging Face generation) and lze_trainer (hf
engine, LZE keeping 0.4 of the groups) on the same model, prompts and sizes, one after the other
on the same GPU, at two sizes (:data:`PEER_SIZES`):

  tiny          the trainer stage's model (Qwen2, hidden 256, 2 layers, V = 151,936) at its
                16 prompts x 8 rollouts x 64 new tokens; lze_trainer's steps are that stage's
  qwen2.5-0.5b  random weights of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads on 2 KV
                heads, V = 151,936), 64 prompts x 8 rollouts x 256 new tokens

Every trainer run is its own process (a fresh CUDA context, so its peak memory is its own),
printing into peer.log. Step time: the median of the steps after the first; the first step (CUDA
start-up, lze_trainer's decode-graph captures) is reported apart, with the capture seconds. Peak
memory: lze_trainer's per phase (``gpu_workload.phase_memory``), TRL's over its run.

Without CUDA (the check's dry run on a CPU) both sizes run at a few tokens with a shrunken
shape (:meth:`PeerSize.on_cpu`): the same code, numbers that mean nothing.

    python tools/gpu_peer.py run lze|trl --size JSON --model DIR --data FILE --folder DIR --log FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_report  # noqa: E402  (standard library only)
import gpu_workload as W  # noqa: E402  (standard library at import)

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), for random weights.
QWEN_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=W.VOCAB,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)
# The dry run's shape on a CPU: the structure of a grouped-query Qwen2, a few parameters.
CPU_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)


@dataclass(frozen=True)
class PeerSize:
    """One size both trainers run at."""

    name: str
    prompts: int
    group: int
    tokens: int  # new tokens per rollout at most
    steps: int  # each trainer's; the first is reported apart
    trl_micro_batch: int  # TRL's per_device_train_batch_size: completions per forward/backward
    shape: dict | None = None  # random weights of this Qwen2 shape; None: the trainer stage's model

    def setting(self) -> str:
        return f"{self.prompts} prompts x {self.group} rollouts x {self.tokens} new tokens"

    def on_cpu(self) -> "PeerSize":
        """The dry run's: two prompts of two rollouts of four tokens, two steps, shrunken."""
        shape = None if self.shape is None else {**self.shape, **CPU_SHAPE}
        return replace(self, prompts=2, group=2, tokens=4, steps=2, trl_micro_batch=4, shape=shape)


TINY = PeerSize("tiny", W.TRAINER_PROMPTS, W.TRAINER_GROUP, W.TRAINER_TOKENS, W.TRAINER_STEPS,
                trl_micro_batch=W.TRAINER_PROMPTS * W.TRAINER_GROUP)
# TRL: 8 micro-batches of 64 completions (one of 512 would hold 512 x 280 x V bf16 logits, 44 GB).
QWEN_0_5B_SIZE = PeerSize("qwen2.5-0.5b", 64, 8, 256, 3, trl_micro_batch=64, shape=QWEN_0_5B)
PEER_SIZES = (TINY, QWEN_0_5B_SIZE)
assert tuple(s.name for s in PEER_SIZES) == gpu_report.PEER_SIZES


# ============================================================================ the stage


def stage_peer(work: Path, options: dict) -> dict:
    """Each size of ``options["peer_sizes"]`` (default: all) in turn; the result so far is
    written after each (a timeout keeps it)."""
    import torch

    on_gpu = torch.cuda.is_available()
    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_STAGE_S", 3600))
    trainer_file = work / "trainer.json"
    trainer = json.loads(trainer_file.read_text()) if trainer_file.exists() else {}
    result: dict = {"status": "passed", "sizes": []}
    chosen = options.get("peer_sizes") or [size.name for size in PEER_SIZES]
    for size in (size for size in PEER_SIZES if size.name in chosen):
        size = size if on_gpu else size.on_cpu()
        result["sizes"].append(compare(work, size, trainer, deadline))
        W.write_partial(work, "peer", result)
    if any(s["status"] != "passed" for s in result["sizes"]):
        result["status"] = "failed"
    return result


def compare(work: Path, size: PeerSize, trainer: dict, deadline: float) -> dict:
    """One size: its model and prompts, lze_trainer's run (the trainer stage's for its own size),
    TRL's run, and their step times side by side."""
    folder = work / "peer" / size.name
    folder.mkdir(parents=True, exist_ok=True)
    data, model = peer_inputs(work / "peer", size, trainer)
    lze = trainer if _ran_at(trainer, size) else run_child("lze", size, model, data, folder, work,
                                                            deadline)
    trl = run_child("trl", size, model, data, folder, work, deadline)
    return summary(size, lze, trl)


def _ran_at(trainer: dict, size: PeerSize) -> bool:
    """Whether the trainer stage ran lze_trainer at this size (the tiny size, on a GPU)."""
    return size.shape is None and len(trainer.get("steps", [])) == size.steps


def peer_inputs(folder: Path, size: PeerSize, trainer: dict) -> tuple[Path, Path]:
    """The training prompts and the model of ``size``: the trainer stage's where it ran, else
    built the same way; a shaped size gets random weights with the tiny model's tokenizer."""
    data = Path(trainer["data"]) if trainer.get("data") else (
        W.write_arithmetic_jsonl(folder / "train.jsonl", 256))
    tiny = Path(trainer["model"]) if trainer.get("model") else None
    if size.shape is None:
        return data, tiny or W.build_model(folder / "tiny-model", W.texts(data), W.VOCAB)
    tokenizer = tiny or W.tiny_base(folder / "tokenizer", W.texts(data))
    return data, shaped_model(folder / f"{size.name}-model", size.shape, tokenizer)


def shaped_model(out_dir: Path, shape: dict, tokenizer_dir: Path) -> Path:
    """Random bf16 weights of ``shape`` with the tokenizer (and its end and padding tokens) of
    ``tokenizer_dir``, saved for ``from_pretrained``; reused if there."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    W.random_model(out_dir, {**shape, **ids})
    torch.cuda.empty_cache()  # the children need the memory, not this process's cache
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(**ids).save_pretrained(out_dir)
    return out_dir


def run_child(kind: str, size: PeerSize, model: Path, data: Path, folder: Path, work: Path,
              deadline: float) -> dict:
    """``gpu_peer.py run KIND`` in a child process (its output appended to peer.log) within the
    stage's time left; its JSON, or the exit code."""
    out = folder / f"{kind}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "run", kind,
           "--size", json.dumps(asdict(size)), "--model", str(model), "--data", str(data),
           "--folder", str(folder), "--log", str(work / "peer.log")]
    with open(work / "peer.log", "ab") as log:
        log.write(f"== {size.name}: {kind}\n".encode())
        log.flush()
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, deadline - time.monotonic())).returncode
        except subprocess.TimeoutExpired:
            return {"exit_code": None, "error": f"{kind}: out of the stage's time"}
    if not out.exists():
        return {"exit_code": code, "error": f"{kind}: exit {code}, no result (peer.log)"}
    return json.loads(out.read_text())


def summary(size: PeerSize, lze: dict, trl: dict) -> dict:
    """The size's figures: medians of the steps after the first, the first steps apart, lze's
    decode-graph capture seconds in its first step, peak memory."""
    lze_steps = [s["timing_s/step"] for s in lze.get("steps", [])]
    trl_steps = trl.get("steps_s", [])
    ok = (lze.get("exit_code") == 0 and len(lze_steps) == size.steps
          and len(trl_steps) == size.steps)
    entry = {"name": size.name, "setting": size.setting(), "status": "passed" if ok else "failed",
             "lze_steps_s": lze_steps, "trl_steps_s": trl_steps,
             "lze_peak_memory_gib": lze.get("peak_memory_gib", {}),
             "trl_peak_memory_gib": trl.get("peak_memory_gib")}
    errors = [r["error"] for r in (lze, trl) if r.get("error")]
    if errors:
        entry["error"] = "; ".join(errors)
    if not ok:
        return entry
    lze_s, trl_s = statistics.median(lze_steps[1:]), statistics.median(trl_steps[1:])
    return {**entry, "lze_step_s": lze_s, "trl_step_s": trl_s, "ratio": lze_s / trl_s,
            "lze_first_step_s": lze_steps[0], "trl_first_step_s": trl_steps[0],
            "lze_first_step_compile_s": lze["steps"][0].get("rollout/compile_s")}


# ============================================================================ runs (children)


def trl_run(model: Path, data: Path, out: Path, size: PeerSize, use_cpu: bool) -> dict:
    """TRL's GRPOTrainer at ``size``: seconds of every step (its ``step_time``: generation and
    the micro-batches' forward and backward, not the optimizer step) and its peak memory.
    ``per_device_train_batch_size`` counts completions in TRL; one generation batch (all of a
    step's completions) per optimizer step."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [json.loads(line)["question"] for line in data.read_text().splitlines()]

    def reward(completions, **_):
        return [W.coin_flip("", "", "", {}) for _ in completions]

    args = GRPOConfig(output_dir=str(out), num_generations=size.group,
                      per_device_train_batch_size=size.trl_micro_batch,
                      gradient_accumulation_steps=size.prompts * size.group // size.trl_micro_batch,
                      max_completion_length=size.tokens, max_steps=size.steps, logging_steps=1,
                      report_to=[], save_strategy="no", bf16=not use_cpu, use_cpu=use_cpu,
                      disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"steps_s": steps, "peak_memory_gib": peak}


def run(kind: str, size: PeerSize, model: Path, data: Path, folder: Path, log: Path) -> dict:
    """One trainer at ``size`` in this process; lze_trainer prints to ``log``."""
    import torch

    on_gpu = torch.cuda.is_available()
    if kind == "trl":
        return trl_run(model, data, folder / "trl", size, use_cpu=not on_gpu)
    overrides = W.lze_overrides(size.steps, size.prompts, size.group, size.tokens, on_gpu)
    return W.run_lze(folder / "lze", model, data, overrides, log)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_peer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one trainer at one size (in the stage's child)")
    one.add_argument("kind", choices=("lze", "trl"))
    one.add_argument("--size", type=lambda text: PeerSize(**json.loads(text)), required=True)
    one.add_argument("--model", type=Path, required=True)
    one.add_argument("--data", type=Path, required=True)
    one.add_argument("--folder", type=Path, required=True)
    one.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)
    result = run(args.kind, args.size, args.model, args.data, args.folder, args.log)
    (args.folder / f"{args.kind}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

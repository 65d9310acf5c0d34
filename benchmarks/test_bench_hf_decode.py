"""Seconds per decoding call of the hf engine: its static-cache decoder (each token one step: a
CUDA graph replay on a GPU, the same step run eagerly on a CPU) against transformers ``generate``
with the per-step log-prob recorder, what ``rollout.hf_static_cache=false`` runs and what the
engine ran before.

The GPU check's trainer-stage shape (Qwen2, hidden 256, 2 layers, 4 query heads on 2 KV heads) at
a small vocabulary and at Qwen2.5's 151,936, 64 sampled rows of 64 new tokens (no end of
sequence: every call decodes all 64), fp32 on a CPU and bf16 on a GPU. The two decoders alternate
call by call after a first call each (steps built, caches warm); each is the median of its
calls, and the ratio is the static decoder's over ``generate``'s. Results:
``hf_decode.json`` and ``.md`` in the run folder (bench_common.run_file).
"""

import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from bench_common import merge_result, run_file  # noqa: E402

ROWS, TOKENS, CALLS = 64, 64, 3
VOCABS = (512, 151_936)


def _model_dir(folder: Path, vocab: int) -> str:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=vocab + 1)
    Qwen2ForCausalLM(config).save_pretrained(folder)  # eos outside the vocabulary: never ends
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    return str(folder)


def _engine(model_dir: str, device: torch.device, static: bool):
    from lze_trainer import config as C
    from lze_trainer.rollout.hf_engine import HFEngine

    cfg = C.load("tiny", [f"rollout.hf_static_cache={str(static).lower()}"])
    return HFEngine(cfg, model_dir, SimpleNamespace(device=device))


def _seconds(engine, prompts, spec) -> float:
    begin = time.perf_counter()
    engine._generate_rows(prompts, spec)  # returns host lists: the device has finished
    return time.perf_counter() - begin


@pytest.mark.parametrize("vocab", VOCABS)
def test_hf_decode_call(benchmark, tmp_path, device, vocab):
    from lze_trainer.rollout.base import SamplingSpec

    model_dir = _model_dir(tmp_path / "model", vocab)
    engines = {"static": _engine(model_dir, device, True),
               "generate": _engine(model_dir, device, False)}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, min(vocab, 500), (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 24, (ROWS,), generator=gen)]
    spec = SamplingSpec(1.0, 1.0, TOKENS)
    times = {name: [] for name in engines}

    def run():
        for engine in engines.values():
            _seconds(engine, prompts, spec)  # first call: steps built, caches warm
        for _ in range(CALLS):
            for name, engine in engines.items():
                times[name].append(_seconds(engine, prompts, spec))

    benchmark.pedantic(run, rounds=1, iterations=1)
    summary = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    summary["ratio"] = summary["static_s"] / summary["generate_s"]
    summary["compile_s"] = engines["static"].take_compile_seconds()
    benchmark.extra_info.update(summary)
    _record(f"V={vocab} {device.type}", summary)


def _record(case: str, summary: dict) -> None:
    table = merge_result(run_file("hf_decode.json"), case,
                         {**summary, "load_average": os.getloadavg()})
    lines = [f"Seconds per hf-engine call of {ROWS} sampled rows x {TOKENS} new tokens (Qwen2, "
             "hidden 256, 2 layers, 4 / 2 heads; median of alternating calls); ratio = the "
             "static-cache decoder's over transformers generate's", "",
             "| case | static cache | generate | ratio | steps built (s) | load average |",
             "|---|---:|---:|---:|---:|---|"]
    for name, row in table.items():
        load = ", ".join(f"{x:.1f}" for x in row["load_average"])
        lines.append(f"| {name} | {row['static_s']:.3f} | {row['generate_s']:.3f} | "
                     f"{row['ratio']:.2f}x | {row['compile_s']:.2f} | {load} |")
    run_file("hf_decode.md").write_text("\n".join(lines) + "\n")

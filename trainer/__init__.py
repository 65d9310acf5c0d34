"""lze_trainer: GRPO with on-device LZE selection (DeepSpeed actor, colocated vLLM rollouts)."""

"""Offline stand-in for ``reasoning_gym``, for the GPU check only: lze_trainer's reward workers
import it at start (trainer/reward.py, ``_PRELOAD``) even when no reasoning-gym task is configured,
and the real package needs matplotlib, pillow and a compiled pycosat at import (~34 MB of wheels,
over the check's 64 MiB budget beside cmake). The check trains on a local JSONL file, so nothing
here is ever called. tools/gpu_check.py puts this folder at the END of ``sys.path``: an installed
reasoning-gym always wins."""

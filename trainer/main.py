"""Entry point: ``torchrun --nproc_per_node=N -m lze_trainer --config <preset|file.yaml> a.b=c ...``.

Multi-node through torchrun's rendezvous, the same command on every node::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        -m lze_trainer --config qwen2.5-math-1.5b

A preempted job gets SIGTERM: the step in flight finishes, a checkpoint is written and the job
exits; ``trainer.resume=auto`` (the default) continues from it. Give torchrun time for that with
``--shutdown_timeout`` (seconds; its default of 30 would cut a long step short).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

from .config import ConfigError, load, validate_world


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lze_trainer", description="GRPO with on-device Learning-Zone Energy selection.")
    parser.add_argument("--config", help="a preset name (tiny, demo, smollm2-135m, "
                        "qwen2.5-math-1.5b) or a YAML file")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides of config keys")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        print(f"lze_trainer: {e}", file=sys.stderr)
        return 2
    from . import run_log

    run_log.setup(Path(cfg.trainer.run_dir), int(os.environ.get("RANK", "0")))
    _quiet_libraries()
    from . import distributed
    from .checkpoint import CheckpointError, check_shared_run_dir
    from .trainer import GRPOTrainer

    try:
        with run_log.libraries_to_log():  # start-up: op builds, engine set-up, C++ warnings
            world = distributed.init(cfg.trainer.device, cfg.trainer.threads_per_rank)
            validate_world(cfg, world.size)
            check_shared_run_dir(Path(cfg.trainer.run_dir), world)
            trainer = GRPOTrainer(cfg, world)  # data-dependent checks raise on every rank
    except (ConfigError, CheckpointError) as e:
        print(f"lze_trainer: {e}", file=sys.stderr)
        distributed.shutdown()
        return 2
    trainer.fit()
    distributed.shutdown()
    return 0


def _quiet_libraries() -> None:
    """Engines log warnings only (what they log goes to the run folder's log, run_log)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DeepSpeed's ZeRO-2 still calls the collective torch 2.13 renamed; the trainer's own calls
    # use the new name (distributed.all_gather_rows).
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is "
                            r"deprecated", category=FutureWarning)


if __name__ == "__main__":
    sys.exit(main())

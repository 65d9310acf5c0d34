"""Entry point: ``torchrun --nproc_per_node=N -m lze_trainer --config <preset|file.yaml> a.b=c ...``.

``python -m lze_trainer --help`` lists the presets; ``python -m lze_trainer --config <preset>
--print-config [a.b=c ...]`` prints the resolved config with each key's help and exits (plain
python, nothing started).

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
from typing import Optional

from .config import (Config, ConfigError, commented_yaml, load, preset_descriptions,
                     validate_world)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lze_trainer", description="GRPO with on-device Learning-Zone Energy selection.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog())
    parser.add_argument("--config", metavar="PRESET|FILE",
                        help="a bundled preset (below) or a YAML file (its keys override the "
                        "defaults)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML, each key with its help, and exit "
                        "(starts nothing: no torch.distributed, no model)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="overrides of config keys, applied after the preset")
    return parser.parse_args(argv)


def _epilog() -> str:
    presets = preset_descriptions()
    width = max(map(len, presets), default=0)
    lines = ["presets (--config NAME, trainer/configs/NAME.yaml):"]
    lines += [f"  {name:<{width}}  {text}" for name, text in presets.items()]
    lines += ["",
              "overrides: any key as section.key=value, after the preset, e.g.",
              "  selection.method=grpo rollout.n=16 'data.eval=[a.jsonl,b.jsonl]'",
              "  (null for none; lists in brackets).",
              "",
              "examples:",
              "  python -m lze_trainer --config demo --print-config selection.method=speed",
              "  torchrun --nproc_per_node=2 -m lze_trainer --config demo",
              "  torchrun --nproc_per_node=2 -m lze_trainer --config demo selection.method=grpo",
              "",
              "Every key, its groups and the derived defaults: docs/config.md."]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = _load_config(args)
    if cfg is None:
        return 2
    if args.print_config:
        given = " ".join([f"--config {args.config}" if args.config else "(the defaults)",
                          *args.overrides])
        print(commented_yaml(cfg, f"The resolved config of: {given}\nEach key's help is the "
                             "comment above it (docs/config.md). Run it as --config <this file>."),
              end="")
        return 0
    if not _engine_installed(cfg):
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
        distributed.shutdown(wait_for_peers=False)
        return 2
    trainer.fit()
    distributed.shutdown()
    return 0


def _load_config(args: argparse.Namespace) -> Optional[Config]:
    """The config, or None after saying why not."""
    try:
        return load(args.config, args.overrides)
    except ConfigError as e:
        print(f"lze_trainer: {e}", file=sys.stderr)
        return None


def _engine_installed(cfg: Config) -> bool:
    """Whether the rollout engine can be imported, checked before anything loads (data, models,
    the warm-up) so a missing vllm stops the job in its first second, saying what to do."""
    from .rollout import require_vllm

    if cfg.rollout.engine != "vllm":
        return True
    try:
        require_vllm()
    except ModuleNotFoundError as e:
        print(f"lze_trainer: {e}", file=sys.stderr)
        return False
    return True


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

"""A stand-in for ``torchrun`` while the README's trainer block runs (tests/test_readme.py).

While the block runs, ``torchrun`` is a shell function that records each launch's arguments, one
line each (``RECORD_TORCHRUN`` in tests/readme_blocks.py); ``python readme_torchrun.py LAUNCHES``
then checks them all in one
process: each is parsed with torch.distributed.run's own parser, the trainer's arguments with
``lze_trainer``'s parser, the config of the overrides loaded and validated for the world size
asked for, and the training data checked to hold the prompts of a step; it prints
``world=<n>`` per launch. Nothing is launched: the README's GPU lines cannot run on a CPU.
"""

import shlex
import sys

from torch.distributed.run import get_args_parser

from lze_trainer.config import load, validate_world
from lze_trainer import prompts
from lze_trainer.main import parse_args
from lze_trainer.trainer import _check_batch_fits


def main(argv: list[str]) -> int:
    launch = get_args_parser().parse_args(argv)
    if not (launch.module and launch.training_script == "lze_trainer"):
        raise SystemExit(f"expected -m lze_trainer, got {launch.training_script!r}")
    world = int(launch.nproc_per_node) * int(str(launch.nnodes).split(":")[-1])
    trainer_args = parse_args(launch.training_script_args)
    cfg = load(trainer_args.config, trainer_args.overrides)
    validate_world(cfg, world)
    _check_batch_fits(cfg, len(prompts.load(cfg.data.train, cfg.data, cfg.data.train_limit)))
    print(f"world={world}")
    return 0


def check_all(path: str) -> int:
    """Every recorded launch of ``path``, in order; the first failure ends it."""
    for line in open(path).read().splitlines():
        if line.strip():
            main(shlex.split(line))
    return 0


if __name__ == "__main__":
    sys.exit(check_all(sys.argv[1]))

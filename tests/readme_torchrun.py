"""A stand-in for ``torchrun`` while the README's trainer block runs (tests/test_readme.py).

``python readme_torchrun.py <torchrun arguments>``: parses them with torch.distributed.run's own
parser, reads the trainer's arguments with ``lze_trainer``'s parser, loads and validates the
config of the overrides for the world size they ask for, checks that the training data holds
the prompts of a step, and prints ``world=<n>``. Nothing is launched: the README's GPU lines
cannot run on a CPU.
"""

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

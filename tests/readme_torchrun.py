"""A stand-in for ``torchrun`` while the README's trainer block runs (tests/test_readme.py).

``python readme_torchrun.py <torchrun arguments>``: parses them with torch.distributed.run's own
parser, reads the trainer's arguments with ``lze_trainer``'s parser, loads and validates the
config of the overrides for the world size they ask for, and prints ``world=<n>``. With
``README_TORCHRUN_RUN=1`` in the environment (set for one call only) it then runs the same trainer
arguments under a real torchrun on one CPU rank, with ``README_TORCHRUN_EXTRA`` (overrides that
shrink the run) appended and the README's hub id replaced by ``README_TORCHRUN_MODEL``.
"""

import os
import subprocess
import sys

from torch.distributed.run import get_args_parser

from lze_trainer.config import load, validate_world
from lze_trainer.main import parse_args


def main(argv: list[str]) -> int:
    launch = get_args_parser().parse_args(argv)
    if not (launch.module and launch.training_script == "lze_trainer"):
        raise SystemExit(f"expected -m lze_trainer, got {launch.training_script!r}")
    world = int(launch.nproc_per_node) * int(str(launch.nnodes).split(":")[-1])
    trainer_args = parse_args(launch.training_script_args)
    validate_world(load(trainer_args.config, trainer_args.overrides), world)
    print(f"world={world}")
    if os.environ.pop("README_TORCHRUN_RUN", "") != "1":
        return 0
    from readme_blocks import HUB_MODEL

    model = os.environ["README_TORCHRUN_MODEL"]
    args = [a.replace(HUB_MODEL, model) for a in launch.training_script_args]
    extra = os.environ.get("README_TORCHRUN_EXTRA", "").split()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", "-m", "lze_trainer", *args, *extra]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

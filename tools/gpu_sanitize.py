"""The CUDA backend's kernels at every shape class, for compute-sanitizer's memcheck and racecheck
(tools/gpu_check.py, stage "sanitizer"): a few steps each with ragged validity, the step and the
top-k kernels, every output compared with the torch backend so that all of it is read. Exits 1 on
a mismatch; the sanitizer's own exit code reports what it found.

    compute-sanitizer --tool memcheck --error-exitcode 3 python -P tools/gpu_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 3 python -P tools/gpu_sanitize.py --racecheck

The top-k's launch plans (csrc/cuda/selection_plan.h): one block up to 16,384 rows (the scores in
dynamic shared memory), then three launches over tiles of at least 16,384 rows (16,385: two
tiles, the second of one row). ``--racecheck`` runs fewer, smaller shapes, as racecheck tracks
every shared-memory access: the one-block plan; the large plan's 128 KiB shared histograms per
block are past its time here, and the emulator under ThreadSanitizer checks that plan, scaled
down so that a few thousand rows cross every tile boundary (tools/emu_tsan.sh).
"""

import argparse
import sys

import torch

from lze_kernels import LZEConfig, LZESelector

# (B, G): a single row, B and G not multiples of a block or warp, each plan's edges, the largest.
SHAPES = ((1, 8), (300, 3), (1024, 16), (4097, 5), (8192, 4), (16384, 4), (16385, 4),
          (65536, 64), (65537, 4))
# racecheck's shapes, small (it tracks every shared-memory access: the shapes up to 16,384 rows
# ran past its 54 s on an H200).
RACECHECK_SHAPES = ((1, 8), (300, 3), (1024, 16), (12289, 4))
FIELDS = ("advantages", "pass_rate", "energy", "momentum", "keep_mask", "kept_indices", "num_kept")


def inputs(batch: int, group: int, num_prompts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_prompts, generator=gen)[:batch]
    rewards = (torch.rand(batch, group, generator=gen)
               < torch.rand(batch, 1, generator=gen)).float()
    valid = torch.arange(group)[None, :] < torch.randint(0, group + 1, (batch, 1), generator=gen)
    return rewards.cuda(), ids.cuda(), valid.cuda()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--racecheck", action="store_true",
                        help="run only the shapes of RACECHECK_SHAPES")
    shapes = RACECHECK_SHAPES if parser.parse_args(argv).racecheck else SHAPES
    mismatches = []
    for batch, group in shapes:
        config = LZEConfig(noise_scale=0.05, seed=1)
        sel = LZESelector(2 * batch, config, device="cuda", backend="cuda")
        ref = LZESelector(2 * batch, config, device="cuda", backend="torch")
        for step in range(2):
            args = inputs(batch, group, 2 * batch, step)
            got, want = sel.step(*args), ref.step(*args)
            mismatches += [f"B={batch} G={group} step {step}: {f}" for f in FIELDS
                           if not torch.allclose(getattr(got, f).float(), getattr(want, f).float(),
                                                 rtol=2e-5, atol=2e-5)]
    torch.cuda.synchronize()
    print("\n".join(mismatches) or f"gpu_sanitize: {len(shapes)} shapes x 2 steps match torch")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

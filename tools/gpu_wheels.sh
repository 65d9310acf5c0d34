#!/usr/bin/env bash
# The maintainers' offline path (tools/README.md), on a machine with PyPI: the wheels a GPU
# machine's fixed Python 3.12 image lacks for the GPU check (WHEELS in tools/gpu_offline.py), for
# CPython 3.12 manylinux x86_64, and this package's own cp312 wheel (tools/build_wheels.sh, with
# the tools of WHEEL_VENV), into DEST (default wheels/, ignored by git, copied to the machine with
# the tree). Prints each file's size and the size of the whole copy; fails if a size strays from
# the recorded one or the copy would be over its budget.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-wheels}
python tools/gpu_offline.py wheels --dest "$dest"
bash tools/build_wheels.sh build/gpu-dist 3.12
cp build/gpu-dist/lze_kernels-*-cp312-cp312-*.whl "$dest/"
exec python tools/gpu_offline.py travel

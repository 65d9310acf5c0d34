"""Exhaustive check of lze::standard_gumbel (csrc/lze_math.h) against the float64 torch
reference: uniform_from_bits takes 2^23 distinct values (the top 23 Philox bits), so every
Gumbel draw any backend can make is compared, bit for bit after the fp32 rounding."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lze_kernels import reference

CSRC = Path(__file__).resolve().parents[1] / "csrc"

# Writes standard_gumbel(uniform_from_bits(b << 9)) for b in [0, 2^23) as raw fp32 to stdout.
PROGRAM = r"""
#include <stdio.h>
#include <vector>
#include "lze_math.h"
int main() {
  std::vector<float> draws(1u << 23);
#pragma omp simd
  for (uint32_t b = 0; b < (1u << 23); ++b) {
    draws[b] = lze::standard_gumbel(lze::uniform_from_bits(b << 9));
  }
  return fwrite(draws.data(), sizeof(float), draws.size(), stdout) == draws.size() ? 0 : 1;
}
"""


def _cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                     if line.startswith("flags")), []))


# Scalar code, and the loop vectorised as the CPU top-k's clones are: every build must give the
# same bits (IEEE + - * / only, no FMA contraction).
ISA_FLAGS = [
    pytest.param(["-O2"], id="scalar"),
    pytest.param(["-O3", "-fopenmp-simd"], id="simd-baseline"),
    pytest.param(["-O3", "-fopenmp-simd", "-mavx2"], id="simd-avx2",
                 marks=pytest.mark.skipif("avx2" not in _cpu_flags(), reason="needs AVX2")),
    pytest.param(["-O3", "-fopenmp-simd", "-mavx512f"], id="simd-avx512",
                 marks=pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="needs AVX-512")),
]

# Draws near u = 1/e whose fp32 rounding depends on the last bit of the inner float64 log, where
# a 1-ulp log (ours, CUDA's) and torch's may differ; everywhere else the bits must agree.
MAX_MISMATCHES = 4


@pytest.fixture(scope="module")
def expected():
    bits = torch.arange(1 << 23, dtype=torch.int64) << 9
    return reference.standard_gumbel(reference.uniform_from_bits(bits)).numpy().view(np.uint32)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("flags", ISA_FLAGS)
def test_standard_gumbel_matches_reference_on_every_draw(tmp_path, flags, expected):
    source = tmp_path / "gumbel.cpp"
    source.write_text(PROGRAM)
    binary = tmp_path / "gumbel"
    # The flags of the kernels' build: no FMA contraction, so the expression tree is the CUDA one.
    subprocess.run(
        ["g++", *flags, "-ffp-contract=off", f"-I{CSRC}", str(source), "-o", str(binary)],
        check=True,
    )
    ours = np.frombuffer(subprocess.run([str(binary)], capture_output=True, check=True).stdout,
                         dtype=np.uint32)
    assert ours.shape == expected.shape
    mismatches = np.flatnonzero(ours != expected)
    assert len(mismatches) <= MAX_MISMATCHES, f"{len(mismatches)} draws differ: {mismatches[:20]}"
    # Each mismatch is one fp32 ulp, and never on the u = 1 draw (+inf in both).
    assert np.all(np.abs(ours[mismatches].astype(np.int64) - expected[mismatches]) == 1)


def test_reference_gumbel_is_the_exhaustive_formula():
    # The test above recomputes the reference formula; pin it to reference.gumbel_noise.
    draws = reference.gumbel_noise(0, torch.tensor(3), 1000, "cpu")
    u = reference.uniform_from_bits(reference.philox_4x32_10(0, torch.tensor(3),
                                                             torch.arange(1000))).double()
    assert torch.equal(draws, (-torch.log(-torch.log(u))).float())

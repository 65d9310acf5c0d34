"""layout.py mirrors csrc/lze_math.h: the enum values must agree field for field."""

import pathlib
import re

from lze_kernels import layout as L

HEADER = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "lze_math.h"

EXPECTED = {
    "kDInit": L.D_INIT, "kEma": L.EMA, "kLastPassRate": L.LAST_PASS_RATE,
    "kLastEnergy": L.LAST_ENERGY, "kNumFloatFields": L.NUM_FIELDS,
    "kSeen": L.SEEN, "kSolvedStreak": L.SOLVED_STREAK, "kFlags": L.FLAGS, "kClaim": L.CLAIM,
    "kNumIntFields": L.NUM_FIELDS, "kFlagPruned": L.FLAG_PRUNED, "kFlagReplay": L.FLAG_REPLAY,
    "kFaultIdOutOfRange": L.FAULT_ID_OUT_OF_RANGE, "kFaultDuplicateId": L.FAULT_DUPLICATE_ID,
    "kFaultNonFiniteReward": L.FAULT_NONFINITE_REWARD,
    "kFaultRewardOutOfRange": L.FAULT_REWARD_OUT_OF_RANGE,
}


def test_header_enums_match_layout():
    text = HEADER.read_text()
    # Enum entries: `kName = <decimal>` followed by `,` or `}`.
    found = {name: int(value) for name, value in re.findall(r"\b(k\w+) = (\d+)\s*[,}]", text)}
    for name, value in EXPECTED.items():
        assert found.get(name) == value, name
    codes = {name: found[name] for name in ("kF32", "kBF16", "kF16")}
    assert sorted(codes.values()) == sorted(L.REWARD_DTYPE_CODES.values())

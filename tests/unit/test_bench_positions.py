"""bench/positions.py end to end at a tiny size: both codings publish, decode and verify, and
the direct one is the one a region reads in O(changes) for more bytes on Adam-like updates."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_positions_bench_measures_both_codings_of_the_same_versions():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "positions.py"), "--hidden", "256",
                        "--layers", "2", "--repeat", "1", "--json"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    ranks, direct = out["rows"]
    assert (ranks["direct"], direct["direct"]) == (-1, 1000)
    assert ranks["changes"] == direct["changes"] > 0  # the same versions, decoded and verified
    assert direct["bytes_over_first"] > 1.0 == ranks["bytes_over_first"]

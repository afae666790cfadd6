"""The refusal enumerations of test_codec_refusal.py (every truncation, every single-bit flip, a
wrong base, a payload applied twice; positions as ranks, flagged ranks and direct; the forged
direct payloads built to reach the kernel's own bounds guards), and the encoder reading a
group's members in place (codec.Pieces), run once more on numba's JIT kernels with bounds
checking on: the compiled kernels check no bounds, so a
malformed payload that made them read or write outside an array would pass unseen where the
result hash then rejects the garbage. Here such an access raises IndexError instead of
BadDelta, and the test fails."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = """
import chain.codec.aot as aot
import tests.unit.chain.test_codec_refusal as t
for coding in sorted(t.CODINGS):
    t.test_every_truncation_is_refused(coding)
    t.test_every_single_bit_flip_is_refused(coding)
    t.test_payload_applied_to_the_wrong_base_is_refused(coding)
    t.test_payload_applied_twice_is_refused(coding)
    print("checked", coding, flush=True)
t.test_direct_positions_past_the_segment_are_refused()
t.test_direct_positions_beyond_their_contexts_counts_are_refused()
print("checked forged")
import tests.unit.chain.test_codec_pieces as pieces
pieces.test_pieces_code_what_the_elements_end_to_end_code()
pieces.test_pieces_across_segment_boundaries("bfloat16")
print("checked pieces")
print(aot.status()["kernels"])
"""


def test_malformed_payloads_never_index_out_of_bounds(tmp_path):
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "DELTASWARM_AOT": "0",
           "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.split()
    assert lines[-1] == "jit"  # the bounds-checked kernels, not the compiled ones
    assert p.stdout.count("checked") == 5

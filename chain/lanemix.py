"""The word mix of the additive tensor digest (chain/lanehash.py): word w of value x adds
_mix0(w, x) and _mix1(w, x) to the digest's two 64-bit lanes. On its own, importing nothing of
the project, so the codec's kernels (chain/codec/kernels.py) can fold a digest's move into the
scan that finds the changes, and lanehash can import the codec: either may load first."""

import numpy as np
from numba import njit

K0 = np.uint64(0x9E3779B97F4A7C15)
K1 = np.uint64(0xD6E8FEB86659FD93)
S0 = np.uint64(0x243F6A8885A308D3)
S1 = np.uint64(0x13198A2E03707344)


@njit(inline="always")
def _mix0(w, x):
    z = x ^ (w * K0 + S0)
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xFF51AFD7ED558CCD)
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xC4CEB9FE1A85EC53)
    return z ^ (z >> np.uint64(33))


@njit(inline="always")
def _mix1(w, x):
    z = x ^ (w * K1 + S1)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))

"""Compile the codec and digest kernels before the first real version needs them.

numba compiles a kernel on its first call for each argument type (or loads it from its on-disk
cache, `NUMBA_CACHE_DIR` or `__pycache__`); with an empty cache that took 42-60 s inside a fresh
region's first apply. `warm()` runs the path a node takes for real, on a few tiny tensors of
the usual dtypes: publish a snapshot and two deltas, apply all three into a weights directory
(the second delta brought forward in place), so every kernel and argument type an apply uses is
compiled once. numba's compiler lock makes a real apply that starts meanwhile wait for the
kernel being compiled instead of compiling it twice. Publishing compiles the encoder too, which
a region never runs: about half the cold warm-up, paid once per numba cache.

With the kernels compiled at install (chain/codec/aot.py, `make install`) this compiles nothing
and takes well under a second: it then only proves the compiled path round-trips, and the
returned `kernels` says which path ran ("aot" or "jit", with the reason).

    python -c "from chain.warmup import warm; print(warm())"
"""

import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from chain.codec import aot
from chain.errors import ChainError
from chain.sources import ArraySource
from chain.store import ChainStore
from chain.weights import WeightsDir
from chain.writer import write_artifact

DTYPES = {"bfloat16": np.uint16, "float32": np.uint32}
"""The kernels take the raw bits: float16 and bfloat16 share the uint16 signatures."""
NUMEL = 1 << 19
"""Past the codec's threading threshold (2^18), so the threaded path is compiled too."""


def warm(workdir: Path | None = None, dtypes: tuple[str, ...] = tuple(DTYPES)) -> dict:
    """Publish and apply v0 snapshot, v1 and v2 deltas of tiny tensors; returns the seconds
    taken. Raises ChainError if the round trip does not verify (it never should)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deltaswarm-warmup-", dir=workdir) as tmp:
        root = Path(tmp)
        key = Ed25519PrivateKey.generate()
        store = ChainStore(root / "chain", key.public_key())
        weights = WeightsDir(root / "weights", keep=2)
        rng = np.random.default_rng(0)
        cur = {f"t.{d}": (d, [NUMEL], rng.integers(0, 1 << 14, NUMEL).astype(DTYPES[d]))
               for d in dtypes}
        parent = None
        for v in range(3):
            if v == 0:
                m, _ = write_artifact(store.blocks, key, run="warmup", version=0,
                                      kind="snapshot", new=ArraySource(cur))
            else:
                new = {}
                for name, (d, shape, bits) in cur.items():
                    b = bits.copy()
                    b[rng.integers(0, NUMEL, NUMEL // 100)] += 1
                    new[name] = (d, shape, b)
                m, _ = write_artifact(store.blocks, key, run="warmup", version=v, kind="delta",
                                      new=ArraySource(new), parent=ArraySource(cur),
                                      parent_manifest=parent)
                cur = new
            store.add(m)
            got = weights.apply([m], lambda b: store.blocks.get(b.id, b.size))
            if got.state_digest != m.state_digest:
                raise ChainError(f"warm-up v{v} did not verify")
            parent = m
    return {"seconds": round(time.perf_counter() - t0, 3), **aot.status()}

"""A self-check that one tensor above 2^31 bytes round-trips bit-exactly through encode, blocks
and apply (a snapshot, a fresh delta build, and an in-place bring-forward), so no 32-bit offset
hides in the codec, the stream, the safetensors files or the digests. Too slow for the test
suite (minutes, about 3x the tensor in memory); bench/scale.py runs it:

    from chain.bigcheck import roundtrip_large
    report = roundtrip_large(Path(workdir), numel=1_100_000_000)  # 2.2 GB of bf16
"""

import time
from pathlib import Path

import numpy as np

from chain import keys
from chain.errors import ChainError
from chain.safetensors_io import TensorFiles
from chain.sources import ArraySource
from chain.store import ChainStore
from chain.weights import WeightsDir
from chain.writer import write_artifact

CHUNK = 1 << 26


def _fill_random(out: np.ndarray, rng: np.random.Generator) -> None:
    """Plausible bf16 weights (about N(0, 0.02)), written chunk by chunk."""
    for lo in range(0, out.size, CHUNK):
        hi = min(out.size, lo + CHUNK)
        f = rng.standard_normal(hi - lo, np.float32) * np.float32(0.02)
        out[lo:hi] = (f.view(np.uint32) >> 16).astype(np.uint16)


def _step(bits: np.ndarray, rng: np.random.Generator, density: float) -> int:
    """Move about `density` of the elements by one bf16 step in place, the last one always,
    so changes sit on both sides of every 2^31-byte boundary. Returns how many moved."""
    k = max(1, int(bits.size * density))
    pos = np.unique(np.concatenate([rng.integers(0, bits.size, k, dtype=np.int64),
                                    [bits.size - 1]]))
    bits[pos] += np.uint16(1)
    return int(pos.size)


def _equal(path: Path, name: str, want: np.ndarray) -> bool:
    got = TensorFiles(path).bits(name)
    return all(np.array_equal(got[lo:lo + CHUNK], want[lo:lo + CHUNK])
               for lo in range(0, want.size, CHUNK))


def roundtrip_large(workdir: Path, numel: int = 1_100_000_000, density: float = 0.01,
                    seed: int = 0) -> dict:
    """Publish a one-tensor bf16 model of `numel` elements as snapshot v0 and deltas v1, v2;
    apply them into a weights directory; check every version bit for bit. Returns sizes and
    seconds per stage; raises ChainError if anything differs."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    times: dict[str, float] = {}
    key = keys.generate(workdir / "trainer.key")
    store = ChainStore(workdir / "chain", key.public_key())
    weights = WeightsDir(workdir / "weights")
    shape = [numel]
    cur = np.empty(numel, np.uint16)
    _fill_random(cur, rng)
    parent = None
    changed = []
    for v in range(3):
        t0 = time.perf_counter()
        if v == 0:
            m, _ = write_artifact(store.blocks, key, run="big", version=0, kind="snapshot",
                                  new=ArraySource({"big": ("bfloat16", shape, cur)}))
        else:
            new = cur.copy()
            changed.append(_step(new, rng, density))
            m, _ = write_artifact(store.blocks, key, run="big", version=v, kind="delta",
                                  new=ArraySource({"big": ("bfloat16", shape, new)}),
                                  parent=ArraySource({"big": ("bfloat16", shape, cur)}),
                                  parent_manifest=parent)
            cur = new
            del new
        store.add(m)
        times[f"publish_v{v}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = weights.apply([m], lambda b: store.blocks.get(b.id, b.size))
        times[f"apply_v{v}_s"] = time.perf_counter() - t0
        if got.version != v or not _equal(got.path, "big", cur):
            raise ChainError(f"v{v} of the {numel * 2}-byte tensor did not round-trip")
        parent = m
    t0 = time.perf_counter()
    weights.verify()
    times["verify_s"] = time.perf_counter() - t0
    return {"numel": numel, "bytes": numel * 2, "changed": changed,
            "delta_bytes": parent.payload_bytes, "in_place": weights.versions() == [1, 2],
            **{k: round(t, 3) for k, t in times.items()}}

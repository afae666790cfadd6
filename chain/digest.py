"""Digests: xxh3-128 for block ids, the additive lane hash for tensors, the BitTorrent v2
pieces root.

The tensor digest (chain/lanehash.py) covers dtype, shape and raw bytes, so equal digests mean
bit-identical tensors, and it can be moved from the changed elements alone; the state digest
covers every (name, tensor digest) in name order. The pieces root (SHA-256 Merkle tree over
16 KiB leaves, BEP 52) lets a signed manifest pin each block's torrent file without this
package importing libtorrent.
"""

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from chain import lanehash

LEAF = 16 * 1024


def block_id(data: bytes | memoryview) -> str:
    """Content address of a block: xxh3-128, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def tensor_digest(dtype: str, shape: list[int] | tuple[int, ...], data: np.ndarray | bytes) -> str:
    """Digest of one tensor's bit patterns (`data`: flat array or raw bytes)."""
    return tensor_digests([(dtype, shape, data)])[0]


def tensor_digests(items: Sequence[tuple[str, Sequence[int], np.ndarray | bytes]],
                   threads: int = 2) -> list[str]:
    """Digests of several tensors, their chunks spread over `threads` (memory-bandwidth bound)."""
    from chain.codec.api import run_jobs

    parts: list[list] = [[] for _ in items]
    jobs = []
    for i, (_, _, data) in enumerate(items):
        arr = np.frombuffer(data, np.uint8) if isinstance(data, bytes | memoryview) else data
        jobs += lanehash.partial_jobs(arr, parts, i)
    run_jobs(jobs, threads)
    return [lanehash.finish(dtype, shape, parts[i]) for i, (dtype, shape, _) in enumerate(items)]


def state_digest(tensor_digests: dict[str, str]) -> str:
    return state_digest_of_sorted(sorted(tensor_digests.items()))


def state_digest_of_sorted(pairs: Iterable[tuple[str, str]]) -> str:
    """The state digest of (name, tensor digest) pairs already in name order: xxh3-128 over
    `name NUL digest LF` of each. One string hashed once (four hash updates a tensor were
    0.1 s of a 50,000-tensor publish, paid again by the manifest's check)."""
    return xxhash.xxh3_128_hexdigest("".join([f"{n}\0{d}\n" for n, d in pairs]).encode())


def pieces_root(data: bytes | memoryview) -> str:
    """BEP 52 `pieces root` of a file: Merkle root over SHA-256 of 16 KiB leaves, zero-padded
    to a power of two. Empty files have no root (empty string)."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return ""
    layer = [hashlib.sha256(view[i : i + LEAF]).digest() for i in range(0, len(view), LEAF)]
    width = 1
    while width < len(layer):
        width *= 2
    layer += [b"\0" * 32] * (width - len(layer))
    while len(layer) > 1:
        layer = [hashlib.sha256(layer[i] + layer[i + 1]).digest() for i in range(0, len(layer), 2)]
    return layer[0].hex()

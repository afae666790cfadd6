"""Writing an artifact: compare new weights with the parent's, encode, cut into blocks, sign.

This is the publisher's half of the format. A delta carries one record per changed or new tensor
(codec payload if dtype and shape are unchanged, raw bytes otherwise); a snapshot carries every
tensor raw. Either way the manifest lists every tensor's digest, so the receiver can verify
the result bit for bit.
"""

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from chain import codec
from chain.blocks import DEFAULT_BLOCK, BlockStore
from chain.digest import pieces_root, state_digest, tensor_digest
from chain.manifest import BlockEntry, FileEntry, Manifest, Parent, TensorEntry
from chain.sources import TensorSource
from chain.stream import BlockWriter, RecordHeader


@dataclass
class EncodeStats:
    tensors: int = 0
    changed_tensors: int = 0
    elements: int = 0
    changed_elements: int = 0
    dense_bytes: int = 0
    encoded_bytes: int = 0
    seconds: float = 0.0
    per_tensor: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | float]:
        return {k: v for k, v in self.__dict__.items() if k != "per_tensor"}


BATCH_ELEMENTS = 1 << 25
"""Tensors are encoded in batches of about this many elements, spread over the codec's threads,
so memory stays bounded while both cores work."""


def encode_stream(
    writer: BlockWriter, new: TensorSource, parent: TensorSource | None, kind: str,
    digests: Mapping[str, str] | None = None,
) -> tuple[list[TensorEntry], EncodeStats]:
    """Write the record stream for `new` against `parent` (None or kind=snapshot: all raw).

    Tensors whose dtype and shape are unchanged get a codec payload (no record at all when
    nothing changed); new, reshaped or retyped tensors get their raw bytes. `digests`: the
    tensor digests of this same `new`, when already computed (a snapshot written right after
    the delta of the same version), so a large model is not hashed twice."""
    stats = EncodeStats()
    t0 = time.perf_counter()
    entries = []
    parent_names = set(parent.names()) if parent is not None else set()
    pending: list[tuple[str, str, list[int], np.ndarray | None, np.ndarray]] = []

    def flush() -> None:
        deltas = [(old, bits, dtype) for _, dtype, _, old, bits in pending if old is not None]
        payloads = iter(codec.encode_many(deltas) if deltas else [])
        for name, dtype, shape, old, bits in pending:
            if old is not None:
                payload = next(payloads)
                changed = codec.payload_stats(payload)["changed"]
                if changed == 0:
                    continue
                op = "delta"
            else:
                payload = memoryview(np.ascontiguousarray(bits)).cast("B")
                op, changed = "full", bits.size
            writer.write_record(RecordHeader(name, op, dtype, shape, len(payload)), payload)
            stats.changed_tensors += 1
            stats.changed_elements += changed
            stats.encoded_bytes += len(payload)
            stats.per_tensor.append({"name": name, "op": op, "changed": int(changed),
                                     "numel": int(bits.size), "bytes": len(payload)})
        pending.clear()

    queued = 0
    for name in new.names():
        dtype, shape = new.meta(name)
        bits = new.bits(name)
        digest = digests[name] if digests is not None else tensor_digest(dtype, shape, bits)
        entries.append(TensorEntry(name=name, dtype=dtype, shape=shape, digest=digest))
        stats.tensors += 1
        stats.elements += bits.size
        stats.dense_bytes += bits.nbytes
        same_layout = (kind == "delta" and name in parent_names
                       and parent.meta(name) == (dtype, shape))
        old = parent.bits(name) if same_layout else None
        pending.append((name, dtype, shape, old, bits))
        queued += bits.size
        if queued >= BATCH_ELEMENTS:
            flush()
            queued = 0
    flush()
    stats.seconds = time.perf_counter() - t0
    return entries, stats


def write_artifact(
    blocks: BlockStore,
    key: Ed25519PrivateKey,
    *,
    run: str,
    version: int,
    kind: str,
    new: TensorSource,
    parent: TensorSource | None = None,
    parent_manifest: Manifest | None = None,
    files: Mapping[str, bytes] | None = None,
    block_size: int = DEFAULT_BLOCK,
    same_tensors_as: Manifest | None = None,
) -> tuple[Manifest, EncodeStats]:
    """Encode, store blocks, and return the signed manifest (not yet added to a chain).
    `same_tensors_as`: a manifest already written for this very `new` (the delta of the same
    version); its tensor digests are reused instead of hashing every tensor again."""
    if kind == "delta" and (parent is None or parent_manifest is None):
        raise ValueError("a delta needs the parent's tensors and manifest")
    digests = None
    if same_tensors_as is not None:
        names = [t.name for t in same_tensors_as.tensors]
        if same_tensors_as.version != version or names != list(new.names()):
            raise ValueError(f"same_tensors_as describes v{same_tensors_as.version} with "
                             f"{len(names)} tensors, but this is v{version} with "
                             f"{len(new.names())}: pass the manifest just written for these "
                             "same weights, or None to hash them")
        digests = {t.name: t.digest for t in same_tensors_as.tensors}
    writer = BlockWriter(blocks, block_size)
    tensors, stats = encode_stream(writer, new, parent if kind == "delta" else None, kind,
                                   digests)
    stream = writer.close()
    file_entries, file_blocks = [], []
    for fname, data in sorted((files or {}).items()):
        bid = blocks.put(data)
        file_entries.append(FileEntry(name=fname, block=bid, size=len(data)))
        if all(b.id != bid for b in stream + file_blocks):
            file_blocks.append(BlockEntry(id=bid, size=len(data), root=pieces_root(data)))
    digest = state_digest({t.name: t.digest for t in tensors})
    parent_ref = None
    if kind == "delta":
        parent_ref = Parent(version=parent_manifest.version,
                            state_digest=parent_manifest.state_digest)
    manifest = Manifest(
        format=1, run=run, version=version, kind=kind, parent=parent_ref, state_digest=digest,
        tensors=tensors, blocks=stream + file_blocks, files=file_entries,
        stats=stats.as_dict(), created=round(time.time(), 3),
    ).signed(key)
    return manifest, stats

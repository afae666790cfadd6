"""Decoding a delta once into a verified Patch: the engine-first path's first step.

A region whose version's blocks have verified decodes the delta here, against its newest
version on disk (read-only) overlaid with the patches of the versions verified since but not yet
written (the decoder needs the exact parent values: positions are ranks within exponent
contexts). Every tensor's new digest follows from its parent digest and the words the changes
touch (chain.lanehash, nothing written), and the state digest is checked, so the Patch handed to
the engines is as verified as a reconstructed directory. Full records become changes too (the
positions that differ from the parent), so a patch stays O(changes).

The same changes then bring the directory on disk forward later (chain.weights.WeightsDir
.apply_changes, merged over several versions by `merge`), never decoding twice.
"""

from collections.abc import Callable, Sequence

import numpy as np

from chain import codec, lanehash
from chain.codec.api import map_jobs, merge_changes, overlaid
from chain.digest import state_digest
from chain.dtypes import BY_NAME
from chain.errors import BadDelta, ChainError, DigestMismatch
from chain.fill import Fill, _Group, _Item, _nothing
from chain.gcpause import without_gc
from chain.manifest import Manifest, TensorEntry
from chain.patchfile import Patch, TensorPatch
from chain.safetensors_io import TensorFiles
from chain.stream import BlockReader
from chain.weights import GetBlock


class NotPatchable(ChainError):
    """This artifact cannot become a patch over the version on disk (a snapshot, or tensors
    added, dropped or reshaped): the region reconstructs the directory first instead."""


class _Buffers:
    """Where full records land: one buffer per tensor, held until its batch is done."""

    def __init__(self, manifest: Manifest) -> None:
        self.entries = {t.name: t for t in manifest.tensors}
        self.held: dict[str, np.ndarray] = {}

    def bits(self, name: str) -> np.ndarray:
        if name not in self.held:
            t = self.entries[name]
            self.held[name] = np.empty(t.numel, BY_NAME[t.dtype].uint)
        return self.held[name]

    def release(self, name: str) -> None:
        self.held.pop(name, None)

    def prefault(self, name: str) -> None:
        return None


class _Decode(Fill):
    """Fill's record reading and decoding, but nothing written: each tensor ends as a
    TensorPatch checked against its manifest digest."""

    moves = True

    def __init__(self, m: Manifest, base: TensorFiles, digests: dict[str, str],
                 overlay: dict[str, list[TensorPatch]]) -> None:
        super().__init__(_Buffers(m), m.tensors, m.artifact, base, digests)  # type: ignore
        self.overlay = overlay
        self.olds: dict[str, np.ndarray] = {}
        self.out_patches: list[TensorPatch] = []

    def _source(self, t: TensorEntry, at: int, count: int
                ) -> tuple[np.ndarray, codec.Layers]:
        """A whole-tensor record decodes against the version on disk with the patches since
        laid over it segment by segment in the decoder's threads; a part of a tensor against
        an overlaid copy (rare: only a sharded publisher's tensors come in parts)."""
        layers = self.overlay.get(t.name)
        if layers and (at, count) == (0, t.numel) and t.name not in self.olds:
            return self._base_of(t), [(p.indices, p.values) for p in layers]
        return self._old(t)[at:at + count], ()

    def _group_view(self, g: _Group) -> np.ndarray | None:
        """In place only where no member has patches to lay over it (else Fill's copy)."""
        if any(self.overlay.get(m.t.name) or m.t.name in self.olds for m in g.members):
            return None
        return super()._group_view(g)

    def _old(self, t: TensorEntry) -> np.ndarray:
        """Tensor `t` as the parent version holds it: the disk's, overlaid in a copy."""
        arr = self.olds.get(t.name)
        if arr is None:
            arr = self.olds[t.name] = overlaid(
                self._base_of(t), [(p.indices, p.values) for p in self.overlay.get(t.name, ())])
        return arr

    def _write(self, batch: list[_Item],  # type: ignore[override]
               reads: tuple[int, Callable[[], None]] = (0, _nothing)) -> None:
        """Each decoded tensor's changes checked against its digest and kept as a patch
        (nothing is written: the engines take the patch); `reads` run first."""
        reads[1]()
        found: list[codec.Changes | None] = []
        for it in batch:
            t = it.t
            if it.op == "full":
                new = self.out.bits(t.name)
                pos = np.flatnonzero(self._old(t) != new).astype(np.int64)
                found.append(codec.Changes(pos, new[pos]))
            else:
                found.append(it.changes)
        # the decoder moved most digests as it went; the rest (full records, a tensor in
        # several parts) are moved here, spread over the codec's threads
        moved = [None if ch is None else ch.digest for ch in found]
        rest = [i for i, ch in enumerate(found)
                if ch is not None and ch.pos.size and ch.digest is None]
        olds = {i: self._old(batch[i].t) for i in rest}

        def move(i: int) -> tuple[int, int]:
            return lanehash.moved_by_changes(olds[i], found[i].pos, found[i].val)

        for i, mv in zip(rest, map_jobs(move, rest, lambda i: found[i].pos.size), strict=True):
            moved[i] = mv
        for it, ch, mv in zip(batch, found, moved, strict=True):
            t = it.t
            parent = self.base_digests[t.name]
            digest = parent if mv is None or not ch.pos.size else lanehash.add(parent, mv)
            if digest != t.digest:
                raise DigestMismatch(f"tensor {t.name} of {self.what} does not match its digest "
                                     "after decoding; the artifact is bad and was not applied")
            if ch is not None and ch.pos.size:
                self.out_patches.append(TensorPatch(
                    t.name, t.dtype, list(t.shape), np.ascontiguousarray(ch.pos, np.int64),
                    np.ascontiguousarray(ch.val), parent, digest))

    def _check(self, batch: list[_Item]) -> None:  # type: ignore[override]
        """A checked batch's memory let go: its full records' buffers, its overlaid parents
        and its base pages."""
        for it in batch:
            self.out.release(it.t.name)
            self.olds.pop(it.t.name, None)
        # one madvise per run of adjacent tensors, not one per tensor
        self.base.release_many([it.t.name for it in batch], known_only=True)


@without_gc
def decode_patch(m: Manifest, base: TensorFiles, base_version: int, base_digests: dict[str, str],
                 overlay: Sequence[Patch], get_block: GetBlock) -> Patch:
    """The verified Patch that delta `m` makes over version `base_version` (in `base`, whose
    tensor digests are `base_digests`) followed by the `overlay` patches, in order.
    NotPatchable if `m` is no such delta; BadDelta/DigestMismatch if it does not verify."""
    parent = overlay[-1].version if overlay else base_version
    if m.kind != "delta" or m.version != parent + 1:
        raise NotPatchable(f"{m.artifact} is not a delta over v{parent}")
    if {n: (s.dtype, list(s.shape)) for n, s in base.slots.items()} != \
            {t.name: (t.dtype, list(t.shape)) for t in m.tensors}:
        raise NotPatchable(f"{m.artifact} adds, drops or reshapes tensors")
    digests = dict(base_digests)
    layers: dict[str, list[TensorPatch]] = {}
    for p in overlay:
        for t in p.tensors:
            if digests.get(t.name) != t.parent_digest:
                raise ChainError(f"patch v{p.version} does not follow the version before it "
                                 f"at {t.name}")
            digests[t.name] = t.digest
            layers.setdefault(t.name, []).append(t)
    parent_state = state_digest(digests)
    if parent_state != m.parent.state_digest:
        raise DigestMismatch(f"{m.artifact}'s parent digest differs from v{parent}'s")
    dec = _Decode(m, base, digests, layers)
    dec.run([BlockReader.of_blocks(b, get_block) for b in m.substreams])
    if state_digest(m.tensors.digest_map()) != m.state_digest:
        raise BadDelta(f"{m.artifact}: state digest mismatch")
    return Patch(m.version, parent, parent_state, m.state_digest, dec.out_patches)


def merge(patches: Sequence[Patch]) -> dict[str, codec.Changes]:
    """The changes of several consecutive patches as one set per tensor (the later wins)."""
    out: dict[str, codec.Changes] = {}
    for p in patches:
        for t in p.tensors:
            ch = codec.Changes(t.indices, t.values)
            out[t.name] = ch if t.name not in out else merge_changes(out[t.name], ch)
    return out

"""Patch a running model in place from a region's patch file, and prove it from the words touched.

The patch (chain/patchfile.py) gives, per changed checkpoint tensor, ascending flat positions,
the new values (bit patterns), and the tensor's digest before and after (chain/lanehash.py,
additive over 64-bit words). For each tensor this:
  1. maps the positions to the live parameters through the loader's own layout
     (rollout/vllm_patchmap.py: fused q/k/v and gate/up offsets, this rank's TP slice);
  2. reads the 64-bit words the patch touches back from the device (before writing);
  3. writes the new values with one index_copy_ per parameter block;
  4. reads the same words back again and moves the tensor's digest by
     sum(mix(w, new) - mix(w, old)): the new digest of what the device now holds, if it held the
     parent before. It must equal the patch's digest.
Cost: O(changes), never a pass over the model. A word corrupted on the device that the patch
touches, a write that missed, or a base that was not the parent all show as a digest mismatch;
corruption in words no patch touches is what the scheduled full read-back is for.

With tensor parallelism a rank holds part of each tensor, so the whole-tensor digest cannot be
moved from one rank's words; each rank then checks that every word it touched reads back as
intended (old word with the new values put in), which proves the write, not the base.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from chain import dtypes as chain_dtypes
from chain import lanehash
from chain.patchfile import TensorPatch
from rollout.vllm_patchmap import Box, probe, to_live


@dataclass
class Affine:
    """A box that is whole rows on both sides: ckpt flat [start, end) -> param flat p + shift."""

    param: str
    start: int
    end: int
    shift: int


def affine(boxes: list[Box], shape: tuple[int, ...],
           pshapes: dict[str, tuple[int, ...]]) -> list[Affine] | None:
    """The boxes as flat ranges, when each covers whole rows of both tensors (the usual
    case: unsharded, fused along rows, column-parallel shards); None otherwise."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    out = []
    for b in boxes:
        ps = tuple(pshapes[b.param])
        if tuple(b.extent[1:]) != tuple(shape[1:]) or ps[1:] != tuple(shape[1:]) \
                or any(b.src_lo[1:]) or any(b.dst_lo[1:]):
            return None
        out.append(Affine(b.param, b.src_lo[0] * row, (b.src_lo[0] + b.extent[0]) * row,
                          (b.dst_lo[0] - b.src_lo[0]) * row))
    return out


@dataclass
class TensorMap:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box]
    flat: list[Affine] | None
    whole: bool
    """Every element is held by exactly one box on this rank (TP=1): the digest can move."""


@dataclass
class TensorResult:
    name: str
    elements: int
    words: int
    digest: str | None
    """The digest the device's tensor has now, moved from the parent's (None under TP)."""
    ok: bool


@dataclass
class Maps:
    """Per checkpoint tensor, its TensorMap (or None: cannot be patched in place), learned once
    by probing the model's loader; reset when the model is reloaded."""

    model: torch.nn.Module
    cache: dict[str, TensorMap | None] = field(default_factory=dict)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorMap | None:
        key = f"{name}|{shape}|{dtype}"
        if key not in self.cache:
            self.cache[key] = self._build(name, shape, dtype)
        return self.cache[key]

    def _build(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorMap | None:
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not shape or numel <= 1:
            return None  # one-element loaders fill_ from .item(): never probe those
        boxes = probe(self.model, name, shape, dtype)
        if not boxes:
            return None
        params = dict(self.model.named_parameters())
        for b in boxes:
            p = params[b.param]
            if not p.data.is_contiguous() or p.dtype.is_floating_point != dtype.is_floating_point:
                return None
        pshapes = {b.param: tuple(params[b.param].shape) for b in boxes}
        whole = sum(int(np.prod(b.extent)) for b in boxes) == numel and \
            len({b.src_lo for b in boxes}) == len(boxes)
        return TensorMap(name, shape, dtype, boxes, affine(boxes, shape, pshapes), whole)


_SAME_WIDTH_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def _distinct(sorted_words: np.ndarray) -> np.ndarray:
    """The distinct values of an ascending array (np.unique without its sort)."""
    if sorted_words.size == 0:
        return sorted_words
    keep = np.empty(sorted_words.size, bool)
    keep[0] = True
    np.not_equal(sorted_words[1:], sorted_words[:-1], out=keep[1:])
    return sorted_words[keep]


def _bits(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Live values (any device, any float dtype) as the checkpoint dtype's bit patterns."""
    return chain_dtypes.bits_view(t.to(dtype=dtype, device="cpu"))


class Patcher:
    """Applies TensorPatches to `model` through `maps` (see the module doc)."""

    def __init__(self, model: torch.nn.Module, maps: Maps) -> None:
        self.model = model
        self.maps = maps
        self.params = {n: p.data for n, p in model.named_parameters()}

    def _word_bits(self, m: TensorMap, widx: np.ndarray, per: int) -> np.ndarray:
        """The checkpoint tensor's 64-bit words `widx` as the device holds them (zero past the
        end, and where this rank holds no element)."""
        numel = int(np.prod(m.shape, dtype=np.int64))
        uint = chain_dtypes.of_tensor(torch.empty(0, dtype=m.dtype)).uint
        if m.flat is not None:
            fast = self._word_bits_flat(m, widx, per, numel)
            if fast is not None:
                return fast
        pos = (widx[:, None] * per + np.arange(per, dtype=np.int64)).reshape(-1)
        bits = np.zeros(pos.size, uint)
        inside = np.flatnonzero(pos < numel)
        for pname, sel, live in to_live(pos[inside], m.shape, m.boxes,
                                        {b.param: tuple(self.params[b.param].shape)
                                         for b in m.boxes}):
            if sel.size:
                flat = self.params[pname].view(-1)
                got = flat[torch.from_numpy(live).to(flat.device)]
                bits[inside[sel]] = _bits(got, m.dtype)
        return bits.view(np.uint64)

    def _word_bits_flat(self, m: TensorMap, widx: np.ndarray, per: int, numel: int
                        ) -> np.ndarray | None:
        """Whole words straight from the parameters' own 64-bit view, when the parameter has
        the checkpoint's dtype and each range is word-aligned on both sides."""
        assert m.flat is not None
        if numel % per:
            return None
        out = np.zeros(widx.size, np.uint64)
        starts = widx * per
        for a in m.flat:
            p = self.params[a.param]
            if p.dtype != m.dtype or a.start % per or a.end % per or a.shift % per \
                    or p.numel() % per:
                return None
            lo, hi = np.searchsorted(starts, [a.start, a.end])
            if hi > lo:
                live_w = (starts[lo:hi] + a.shift) // per
                words = p.view(-1).view(torch.int64)
                got = words[torch.from_numpy(live_w).to(p.device)].cpu().numpy()
                out[lo:hi] = got.view(np.uint64)
        return out

    def _write(self, m: TensorMap, pos: np.ndarray, values: torch.Tensor) -> None:
        if m.flat is not None:
            for a in m.flat:
                lo, hi = np.searchsorted(pos, [a.start, a.end])
                if hi > lo:
                    self._put(a.param, pos[lo:hi] + a.shift, values[lo:hi])
            return
        pshapes = {b.param: tuple(self.params[b.param].shape) for b in m.boxes}
        for pname, sel, live in to_live(pos, m.shape, m.boxes, pshapes):
            if sel.size:
                self._put(pname, live, values[torch.from_numpy(sel)])

    def _put(self, pname: str, live: np.ndarray, values: torch.Tensor) -> None:
        flat = self.params[pname].view(-1)
        idx = torch.from_numpy(np.ascontiguousarray(live, np.int64)).to(flat.device)
        flat.index_copy_(0, idx, values.to(device=flat.device, dtype=flat.dtype))

    @torch.no_grad()
    def apply(self, m: TensorMap, tp: TensorPatch, check: bool = True) -> TensorResult:
        """Write `tp` into the live model; with `check`, move its digest from the words
        read back (see the module doc)."""
        dt = chain_dtypes.lookup(tp.dtype)
        pos = np.asarray(tp.indices, np.int64)
        per = 8 // dt.itemsize
        if check and m.whole and self._host_words(m, per):
            return self._apply_on_host(m, tp, pos, per)
        signed = np.ascontiguousarray(tp.values).view(f"i{dt.itemsize}")
        values = torch.from_numpy(signed).view(m.dtype)
        widx = _distinct(pos // per) if check else np.zeros(0, np.int64)
        old = self._word_bits(m, widx, per) if check else None
        self._write(m, pos, values)
        if not check:
            return TensorResult(tp.name, int(pos.size), 0, None, True)
        new = self._word_bits(m, widx, per)
        if m.whole:
            moved = lanehash.add(tp.parent_digest, lanehash.moved_by_words(widx, old, new))
            return TensorResult(tp.name, int(pos.size), int(widx.size), moved,
                                moved == tp.digest)
        # TP: this rank's touched words must read back as the old words with the values put in
        want = old.copy().view(dt.uint)
        flat_pos = np.searchsorted(widx, pos // per) * per + pos % per
        want[flat_pos] = tp.values
        held = self._held_mask(m, widx, per)
        same = np.array_equal(new.view(dt.uint)[held], want[held])
        return TensorResult(tp.name, int(pos.size), int(widx.size), None, bool(same))

    def _host_words(self, m: TensorMap, per: int) -> bool:
        """Whether the one-pass host kernel applies: the parameters are in host memory, in
        the checkpoint's dtype, and every range is word-aligned on both sides."""
        if m.flat is None:
            return False
        for a in m.flat:
            p = self.params[a.param]
            if p.device.type != "cpu" or p.dtype != m.dtype or a.start % per \
                    or a.end % per or (a.start + a.shift) % per:
                return False
        return True

    def _apply_on_host(self, m: TensorMap, tp: TensorPatch, pos: np.ndarray,
                       per: int) -> TensorResult:
        """Write and check in one walk over the touched words (chain.lanehash.put_at): host
        memory is the device here, each word read before and after its write."""
        dt = chain_dtypes.lookup(tp.dtype)
        values = np.ascontiguousarray(tp.values, dt.uint)
        da = db = 0
        words = 0
        assert m.flat is not None
        for a in m.flat:
            lo, hi = np.searchsorted(pos, [a.start, a.end])
            if hi <= lo:
                continue
            flat = self.params[a.param].view(-1).view(_SAME_WIDTH_INT[dt.bits])
            arr = flat.numpy().view(dt.uint)[a.start + a.shift : a.end + a.shift]
            ra, rb, n = lanehash.moved_by_put_at(arr, pos[lo:hi], values[lo:hi], a.start)
            da, db, words = da + int(ra), db + int(rb), words + int(n)
        moved = lanehash.add(tp.parent_digest, (da, db))
        return TensorResult(tp.name, int(pos.size), words, moved, moved == tp.digest)

    def _held_mask(self, m: TensorMap, widx: np.ndarray, per: int) -> np.ndarray:
        """Which elements of the words `widx` this rank holds."""
        pos = (widx[:, None] * per + np.arange(per, dtype=np.int64)).reshape(-1)
        held = np.zeros(pos.size, bool)
        for _, sel, _ in to_live(pos, m.shape, m.boxes,
                                 {b.param: tuple(self.params[b.param].shape) for b in m.boxes}):
            held[sel] = True
        return held

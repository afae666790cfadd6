"""A uniform read view of a model's tensors as bit patterns, whatever holds them.

The writer and the CLI read weights from a torch state dict, a safetensors file, or an HF
directory; all three look the same through `TensorSource`. A publisher's kept copy of the last
version is also written through its source (`StateDictSource.patch`), whose views it shares.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from chain import dtypes
from chain.digest import state_digest, tensor_digest
from chain.safetensors_io import ReadFiles, TensorFiles

if TYPE_CHECKING:
    import torch

    from chain import codec


class TensorSource(Protocol):
    """What the writer reads. A source may also offer `cat(names)`, `span(names)` and
    `pieces(names, sizes, itemsize)` (StateDictSource does): a group's elements end to end in
    one call, or where its tensors lie to be read in place, which the writer uses when
    present (chain.writer.encode_stream)."""

    def names(self) -> list[str]: ...
    def meta(self, name: str) -> tuple[str, list[int]]: ...
    def bits(self, name: str) -> np.ndarray: ...


class StateDictSource:
    """Tensors of a state dict (moved to CPU one at a time when read). `views`: bit views
    kept from an earlier source over tensors this one shares (a publisher's kept copy of the
    last version, mostly patched in place), so a 50,000-tensor model is not viewed again
    every version; a view is reused only for the very tensor object it was made from, and
    only while that object still views the same memory, unless `owned`: the state is a copy
    its holder never hands out (the publisher's kept copy), so nothing can have re-pointed its
    tensors and the check (five torch calls a tensor) is skipped, its dtype and shape are the
    ones noted with the view, and the views are taken as given (the holder keeps them to
    tensors it still holds, as the publisher does after each patch). `spans`: `span`'s
    answers from an earlier source over this same owned state, for a holder that knows every
    tensor is still the object they were found over (a publisher whose versions replaced
    none), so 50,000 tensors' addresses are not walked again every version."""

    def __init__(self, state: Mapping[str, "torch.Tensor"],
                 views: "dict[str, tuple[torch.Tensor, np.ndarray, tuple, tuple]] | None" = None,
                 owned: bool = False,
                 spans: "dict[tuple[str, ...], np.ndarray] | None" = None,
                 metas: "tuple[list[str], list[tuple[str, list[int]]]] | None" = None) -> None:
        self._state = state
        self._owned = owned
        self.views = views if views is None or owned else \
            {k: v for k, v in views.items() if state.get(k) is v[0]}
        self.spans: dict[tuple[str, ...], np.ndarray] = dict(spans or {}) if owned else {}
        """`span`'s answers, by the names asked for."""
        self.known_metas = metas if owned else None
        """A `metas` answer given (the names asked for, their metas), handed on as `spans`
        are by a holder that knows no tensor changed layout, so the next version's walk does
        not look 50,000 tensors' views up again (~25 ms a publish); `metas_found` is this
        source's own last answer, to hand on."""
        self.metas_found: tuple[list[str], list[tuple[str, list[int]]]] | None = None
        self._addresses: dict[str, tuple[torch.Tensor, int]] = {}
        """Tensors and their addresses noted by `metas` as it read their dtype and shape
        (-1: not on the CPU or not contiguous), for `pieces`."""

    def names(self) -> list[str]:
        known = self.known_metas
        if known is not None and len(known[0]) == len(self._state):  # vouched for: all of
            return list(known[0])  # them, sorted, as `names` answered when they were found
        return sorted(self._state)

    def meta(self, name: str) -> tuple[str, list[int]]:
        t = self._state[name]
        if self._owned and self.views is not None:  # kept with its view: nothing reshaped it
            kept = self.views.get(name)
            if kept is not None and kept[0] is t:
                return kept[3][0], list(kept[3][1])
        return _meta(t)

    def metas(self, names: list[str]) -> Iterable[tuple[str, list[int]]]:
        """`meta` of each of `names`: in one pass where the state is a plain dict (a call a
        tensor, twice a version for the new state and the kept copy, cost a 50,000-tensor
        publish's walk ~30 ms more); one at a time as iterated for any other mapping, which
        may make a tensor only when asked for it (a trainer handing over tensors as they
        are ready): the writer's walk then reads each as it reaches it, having written the
        blocks of the batches before the one being coded, as it did with `meta`."""
        state = self._state
        self._addresses = {}  # only this answer's, for `pieces`
        if type(state) is not dict:
            return (self.meta(n) for n in names)
        if self.known_metas is not None and self.known_metas[0] == names:
            self.metas_found = self.known_metas
            return self.known_metas[1]
        if not self._owned or self.views is None:
            by_torch = dtypes.torch_names()
            found, noted = [], []
            try:
                # each tensor's address noted in the same walk, for `pieces`: a walk of its
                # own, checking again the size and element size read here, cost a
                # 50,000-tensor publish ~35 ms more (two passes of five torch calls a tensor)
                for t in map(state.__getitem__, names):
                    found.append((by_torch[t.dtype], list(t.shape)))
                    noted.append((t, t.data_ptr() if t.is_cpu and t.is_contiguous() else -1))
            except KeyError:  # an unsupported dtype: `_meta` names it
                return [_meta(state[n]) for n in names]
            self._addresses = dict(zip(names, noted, strict=True))
            return found
        views = self.views
        out = []
        for name in names:
            t, kept = state[name], views.get(name)
            out.append((kept[3][0], list(kept[3][1])) if kept is not None and kept[0] is t
                       else _meta(t))
        self.metas_found = (list(names), out)
        return out

    def bits(self, name: str) -> np.ndarray:
        t = self._state[name]
        if self.views is None:
            return dtypes.bits_view(t)
        kept = self.views.get(name)
        # the same object over the same memory in the same layout: `t.data = ...` and `set_`
        # keep the object but change what it views, `t_()` and `as_strided_` its strides
        if kept is not None and kept[0] is t and (self._owned or kept[2] == _layout(t)):
            return kept[1]
        bits = dtypes.bits_view(t)
        # kept only where it is a view of the tensor's own memory: bits_view copies a tensor
        # off the CPU or not contiguous, and a copy would go stale at the next in-place write
        if t.device.type == "cpu" and t.is_contiguous():
            self.views[name] = (t, bits, _layout(t), _meta(t))
        return bits

    def cat(self, names: list[str]) -> np.ndarray:
        """These tensors' (one dtype) bit patterns end to end, in a new array: one call into
        torch for them all (1.2 us a tensor of 960 elements, copy included, where a bit view
        a tensor through Python costs 2.9 us; the writer's groups of small tensors need them
        end to end anyway). Sparse and quantized tensors never get here: no bit view or
        dtype exists for them (`bits_view`, `dtypes.of_tensor` refuse them)."""
        import torch

        # torch's own flatten (what its DDP buckets use) is one call; it is not public API,
        # so a torch without it takes a cat of flat views (~3 us a tensor, still correct)
        flatten = getattr(torch._utils, "_flatten_dense_tensors", None) or \
            (lambda ts: torch.cat([t.reshape(-1) for t in ts]))
        tensors = [self._state[n] for n in names]
        with torch.no_grad():
            flat = flatten(tensors)
        bits = dtypes.bits_view(flat)
        return bits if len(tensors) > 1 else bits.copy()  # one tensor's flatten is a view

    def pieces(self, names: list[str], sizes: list[int], itemsize: int
               ) -> "tuple[np.ndarray, list[torch.Tensor]] | None":
        """These tensors' addresses (int64), for an encoder reading them where they lie
        (codec.Pieces), and the tensors; None unless every one is on the CPU, contiguous,
        and still of the size (`sizes`, elements) and element size the writer's walk read
        (what the encoder will read at its address). A GPU tensor is copied over by `cat`.
        ~0.35 us a tensor, where `cat` copies it (1.2 us a tensor of 960 elements, and 2 GB
        moved for a 50,000-tensor model of 1e9 elements). The caller holds the state still
        while it encodes, as for any publish: a tensor re-pointed (`t.data = ...`, `set_`,
        `resize_`) by another thread meanwhile may free the memory being read. The very
        tensor objects whose addresses `metas` noted are not asked again: `sizes` and
        `itemsize` are then the ones its answer gave (as the writer's walk passes them)."""
        tensors = list(map(self._state.__getitem__, names))
        noted = list(map(self._addresses.get, names))
        if all(kept is not None and kept[0] is t for kept, t in zip(noted, tensors, strict=True)):
            # the very tensors `metas` read, with the dtypes and shapes it got: the same
            # sizes, for a state held still through the publish (as the encode needs anyway)
            ptrs = [kept[1] for kept in noted]
        else:  # one pass; -1 for a tensor the encoder cannot read in place (0: an empty one)
            ptrs = [t.data_ptr() if t.is_cpu and t.is_contiguous() and t.numel() == n and
                    t.element_size() == itemsize else -1
                    for t, n in zip(tensors, sizes, strict=True)]
        if -1 in ptrs:
            return None
        return np.array(ptrs, np.int64), tensors

    def span(self, names: list[str]) -> np.ndarray | None:
        """These tensors' bit views end to end as one read-only view, where they lie back to
        back (a publisher's kept copy: one allocation in name order), from the addresses
        noted with their views (a tensor not viewed yet, as in the first delta after a
        snapshot, is viewed now); None where any cannot be or they do not lie back to back (the
        caller then copies). Only for an `owned` state, whose views nothing can re-point: 0.47
        us a tensor, where asking numpy each view's address (`chain.writer.end_to_end`) costs
        1.29 us (timed over 50,000 kept tensors in groups of 1,000)."""
        if not self._owned or self.views is None or not names:
            return None
        known = self.spans.get(tuple(names))
        if known is not None:
            return known
        views = self.views
        bits, at, dtype, size = None, 0, None, 0
        for name in names:
            kept = views.get(name)
            if kept is None and name in self._state:
                self.bits(name)  # noted with its view where it has one of its own memory
                kept = views.get(name)
            if kept is None or kept[0] is not self._state.get(name):
                return None
            ptr, numel, kept_dtype = kept[2][:3]
            if bits is None:
                bits, at, dtype = kept[1], ptr, kept_dtype
            if ptr != at or kept_dtype != dtype:
                return None
            at += kept[1].nbytes
            size += numel
        whole = np.lib.stride_tricks.as_strided(bits, shape=(size,), strides=(bits.itemsize,),
                                                writeable=False)
        self.spans[tuple(names)] = whole
        return whole

    def patch(self, changes: "list[tuple[str, codec.Changes]]",
              groups: "list[tuple[list[str], np.ndarray, codec.Changes]]" = ()) -> None:
        """Write each tensor's changed positions through its bit view (how a publisher moves
        its kept copy to the version just published). `groups`: group records' members with
        their element offsets and the group's changes (chain.writer.OnGroup), written as one
        run where the members lie back to back (`span`), else member by member. The tensors
        lying in one allocation with the others (`_cpu_copy` lays the kept copy out as one; a
        tensor replaced since is held apart, at offset 0 of an allocation of its own) are
        written by scatters over it, one a record (a group's or a tensor's: never one a
        member), found from the addresses noted with their views, spread over the codec's
        threads; the rest one at a time. One scatter a tensor cost the publish 0.078 s more
        than its dense twin's at 50,000 tensors (py-spy), ~1.6 us each; with the groups'
        changes split into their members' and gathered back for one scatter per element size,
        this step was still 0.14 s over the twin's at 20,000 elements a tensor, 0.04 s taken
        whole (py-spy, per publish)."""
        import torch

        from chain import codec
        from chain.codec.api import run_scatters

        views = self.views or {}
        # the shared allocation: that of the first changed tensor not at its allocation's
        # start (a tensor held apart always is), else of the first
        noted = [views[n] for n in [n for n, _ in changes] + [g[0][0] for g in groups]
                 if n in views]
        shared = next((v for v in noted if v[2][4] > 0), None) or \
            (noted[0] if noted else None)
        lo = hi = 0
        if shared is not None:
            storage = shared[0].untyped_storage()
            lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        runs: dict[np.dtype, list[tuple[int, codec.Changes]]] = {}

        def in_shared(ptr: int, bits: np.ndarray) -> bool:
            return lo <= ptr and ptr + bits.nbytes <= hi and (ptr - lo) % bits.itemsize == 0

        for name, c in changes:
            bits = self.bits(name)
            view = views.get(name)
            ptr = view[2][0] if view is not None and view[1] is bits else -1
            if in_shared(ptr, bits):
                runs.setdefault(bits.dtype, []).append(((ptr - lo) // bits.itemsize, c))
            else:
                bits[c.pos] = c.val
        for names, offsets, c in groups:
            whole = self.span(names)  # the writer asked for it already: an answer kept
            ptr = -1 if whole is None else whole.__array_interface__["data"][0]
            if whole is not None and in_shared(ptr, whole):
                runs.setdefault(whole.dtype, []).append(((ptr - lo) // whole.itemsize, c))
                continue
            for name, own in zip(names, codec.split_changes(c, offsets), strict=True):
                self.bits(name)[own.pos] = own.val
        if not runs:
            return
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (hi - lo,)).numpy()
        writes = []
        for dtype, members in runs.items():
            whole = flat[:(hi - lo) // dtype.itemsize * dtype.itemsize].view(dtype)
            writes += [(whole[start:], c.pos, c.val) for start, c in members]
        # a scatter a record (a group's or a tensor's), spread over the codec's threads:
        # one scatter of every record's positions gathered first took ~0.1 s of a publish of
        # 1e9 elements at 1 % on one thread; this ~0.04 s
        run_scatters(writes)


def _meta(t: "torch.Tensor") -> tuple[str, list[int]]:
    return dtypes.of_tensor(t).name, list(t.shape)


def _layout(t: "torch.Tensor") -> tuple:
    """What a kept bit view of `t` depends on: its memory, length, type and strides."""
    return (t.data_ptr(), t.numel(), t.dtype, t.stride(), t.storage_offset())


class FileSource:
    """Tensors of a safetensors file or a directory of them. With `only`, exactly those files
    of the directory, read through `ReadFiles` (pread, no memory map): for files another
    process may rewrite or truncate meanwhile, where a map would die of SIGBUS."""

    def __init__(self, path: Path, only: list[str] | tuple[str, ...] | None = None) -> None:
        self.files: TensorFiles | ReadFiles = (TensorFiles(path) if only is None
                                               else ReadFiles(path, only))

    def close(self) -> None:
        """Close the files read with `only` (a memory-mapped source is closed when dropped)."""
        if isinstance(self.files, ReadFiles):
            self.files.close()

    def names(self) -> list[str]:
        return self.files.names()

    def meta(self, name: str) -> tuple[str, list[int]]:
        slot = self.files.slots[name]
        return slot.dtype, slot.shape

    def bits(self, name: str) -> np.ndarray:
        return self.files.bits(name)


def source_digest(src: TensorSource) -> str:
    """State digest of every tensor in `src` (equal digests mean bit-identical weights)."""
    return state_digest({n: tensor_digest(*src.meta(n), src.bits(n)) for n in src.names()})


class ArraySource:
    """Tensors given as flat numpy arrays of bit patterns: {name: (dtype, shape, bits)}."""

    def __init__(self, arrays: Mapping[str, tuple[str, list[int], np.ndarray]]) -> None:
        self._arrays = arrays

    def names(self) -> list[str]:
        return sorted(self._arrays)

    def meta(self, name: str) -> tuple[str, list[int]]:
        dtype, shape, _ = self._arrays[name]
        return dtype, list(shape)

    def bits(self, name: str) -> np.ndarray:
        return self._arrays[name][2]

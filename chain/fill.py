"""Filling a staging directory with one artifact's tensors, each verified by its digest.

Per tensor, in name order: a full record is read straight into its slot and hashed; otherwise
the slot is first made equal to the current version's tensor (by copying only the positions
that changed since the slot's own version, when it is an older directory brought forward, else
the whole tensor), then the delta's changes, decoded against the current version read-only, are
written. The digest follows from the slot's known digest and the words touched, so unchanged
data is never re-read. Work goes in batches of about BATCH elements, decoding and patching
spread over the codec's threads, a batch decoding while the one before is checked; finished
tensors go to the JOURNAL and their pages are dropped from this process (they stay in the page
cache), so memory stays near two batches.

A group record (many small tensors coded as one payload) is read, written and checked as one
unit where it can be (`_GroupUnit`): one kernel call writes its tensors, their digests are
lists, and the steps above are taken a group at a time instead of a tensor at a time.
"""

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chain import codec, lanehash
from chain.codec import header as hdr
from chain.codec.api import run_jobs
from chain.digest import tensor_digests
from chain.dtypes import BY_NAME
from chain.errors import BadDelta, DigestMismatch
from chain.gilswitch import quick_switches
from chain.manifest import TensorEntry
from chain.safetensors_io import TensorFiles, WritableFiles
from chain.stream import MAX_GROUP, BlockReader, RecordHeader
from chain.tensortable import TensorRow, TensorTable
from chain.versiondir import WHOLE, ChangedPositions, StoredChanges, VersionInfo

BATCH = 1 << 24
PART = 1 << 22
"""Elements one write job covers: a multiple of every dtype's elements per 64-bit word."""


def _nothing() -> None:
    """A batch with nothing to decode: its join (and a batch with no pages to map: its job)."""


@dataclass
class _Group:
    """A group record (chain/stream.py) being read: its payload and the items it covers."""

    payload: bytes
    dtype: str
    count: int
    offsets: np.ndarray
    """Where each member starts in the group's elements, and the end (from the table)."""
    names: list[str]
    """Its tensors' names, in table order."""
    first: int
    """Its first tensor's place in the table."""
    members: list["_Item"] = field(default_factory=list)
    changes: codec.Changes | None = None
    """Once decoded: the group's changes, in the group's positions."""


@dataclass
class _Item:
    index: int
    t: TensorEntry
    done: bool
    op: str | None = None  # None: no record (unchanged), else "full" or "delta"
    parts: list[tuple[int, int]] = field(default_factory=list)  # (at, count) of each record
    payloads: list[tuple[int, int, bytes]] = field(default_factory=list)
    changes: codec.Changes | None = None
    digest: str | None = None
    repaired: bool = False
    forward: bool = False
    """The slot is brought forward from its older version (else copied from the base)."""
    moves: list = field(default_factory=list)
    """Each write job's digest move (lane sums), summed into `digest` at the end."""
    group: _Group | None = None
    """On the first tensor of a group record: the group, decoded with the batch."""
    span: _Group | None = None
    """On every tensor of a decoded group: the group, written as one where it can be."""
    more: bool = False
    """A group record goes on past this tensor: the batch may not end here."""
    grouped: bool = False
    """A group record covers this tensor: no other record may."""
    member: int = 0
    """Its place in the group record that covers it."""

    @property
    def numel(self) -> int:
        return self.t.numel


@dataclass
class _GroupUnit:
    """A group record's tensors read, written and checked as one: no `_Item` a member, their
    names and digests kept as lists a group, their digest moves as one array. The fill's
    common case in a region (every member to write, all brought forward or all copied, back
    to back in both directories); anything else is handed back as members (`Fill._members`).
    At 50,000 tensors of 20,000 elements the per-member steps of `_Item`s were ~10 us a
    tensor, a quarter of an apply."""

    index: int
    """The first member's place in the table."""
    count: int
    group: _Group | None
    forward: bool = False
    target: np.ndarray | None = None
    source: np.ndarray | None = None
    moves: np.ndarray | None = None
    """(members, 2) lane sums, once written (lanehash.moved_by_group_writes)."""
    digests: list[str] = field(default_factory=list)
    repaired: int = 0
    more = False
    """Never splits a batch (see `_Item.more`)."""

    @property
    def numel(self) -> int:
        return int(self.group.offsets[-1])  # type: ignore[union-attr]


class Fill:
    """Fills `out` with `tensors` from a record stream against `base` (a read-only version
    whose tensor digests are `base_digests`), journaling finished tensors to `journal`."""

    moves = False
    """Whether decoding also moves each tensor's digest (chain/decode.py checks a patch from
    it; the fill here checks what it wrote instead)."""

    def __init__(self, out: WritableFiles, tensors: list[TensorEntry], what: str,
                 base: TensorFiles | None, base_digests: dict[str, str],
                 progress: Callable[[str, int, int], None] | None = None,
                 journal: Path | None = None) -> None:
        # a row object only for a tensor read alone or a group's first (a row a tensor was
        # 0.7 us, 35 ms at 50,000); a group read as one is read from the table's columns
        self.out, self.tensors, self.what = out, TensorTable.of(tensors), what
        self.names, self._metas = self.tensors.names(), self.tensors.metas()
        self._digests, self._numels = self.tensors.digests(), self.tensors.numels()
        # the record checks rest on it (a manifest's table is checked so; a delta file's is
        # not): a group's members are the tensors up to its last name, in a stream in order
        if not self.tensors.ascending():  # checked once a layout
            raise BadDelta(f"{what}: its tensor list is not in name order or names a tensor "
                           "twice")
        self.base, self.base_digests = base, base_digests
        self.progress, self.journal_path = progress, journal
        self.steps: list[StoredChanges | None] = []
        self.own: dict[str, str] | None = None
        self._pullable = np.zeros(len(self.names), bool)
        """By table row: whether `_can_pull` brings the tensor forward."""
        self._columns: dict[int, tuple[dict[str, str], list[str] | None]] = {}
        """`_in_table_order`'s answers, by the mapping's id (the mapping kept with it)."""
        self.changes = ChangedPositions()
        self.repaired = 0
        self.resumed = False
        self._starts: np.ndarray | None = None

    def in_place(self, steps: list[StoredChanges | None], own: VersionInfo | None) -> None:
        """The slots hold an older version (`own`, None if unknown) that `steps` (CHANGES per
        version since) bring up to the base."""
        self.steps, self.own = steps, own.tensors if own is not None else None
        # the tensors `_can_pull` brings forward, found once for the pass: a column over the
        # table where the steps list the table's tensors in its order (a region's always),
        # else with set operations (a generator over the steps a tensor was 4.6 % of a
        # 50,000-tensor apply; a set lookup a tensor of each group, ~15 ms more)
        self._pullable = np.zeros(len(self.names), bool)
        if self.own is None or not steps or any(s is None for s in steps):
            return
        if self._in_table_order(self.own) is not None and \
                all(s.names == self.names for s in steps):  # type: ignore[union-attr]
            self._pullable[:] = True
            for s in steps:
                self._pullable &= s.counts != WHOLE  # type: ignore[union-attr]
            return
        pullable = set(self.own)
        for s in steps:
            pullable.intersection_update(s.with_positions())  # type: ignore[union-attr]
        self._pullable = np.fromiter((n in pullable for n in self.names), bool,
                                     len(self.names))

    # --- the pass ---------------------------------------------------------------------------
    def run(self, reader: BlockReader | Sequence[BlockReader], resumed: bool = False) -> None:
        """Fill every tensor from `reader`: the artifact's record stream, or (format 3) its
        sub-streams, each in name order, whose records for one tensor may each cover a part."""
        readers = [reader] if isinstance(reader, BlockReader) else list(reader)
        what = self.what
        pending = [r.next_header() for r in readers]

        def items(done: set[str]) -> Iterator[_Item | _GroupUnit]:
            group: _Group | None = None
            item: _Item | None = None
            i, count = 0, len(self.tensors)
            try:
                while i < count:
                    t = self._row(i)
                    item = _Item(i, t, t.name in done)
                    if group is not None:
                        self._join(group, item)
                        item.more = len(group.members) < group.count
                    for s, r in enumerate(readers):
                        while pending[s] is not None and pending[s].name == t.name:
                            self._read(item, pending[s], r)
                            pending[s] = r.next_header()
                        if pending[s] is not None and pending[s].name < t.name:
                            raise BadDelta(f"record for {pending[s].name!r} is not a tensor of "
                                           f"{what} or is out of order")
                    self._check_parts(item)
                    if item.group is not None:
                        unit = self._unit(item, done, pending)
                        if unit is not None:
                            yield unit
                            i += unit.count
                            continue
                        group = item.group
                        item.more = group.count > 1
                    if group is not None and len(group.members) == group.count:
                        group = None
                    yield item
                    i += 1
            except BaseException:  # a group the item being read opened lists it: unlinked
                if item is not None:
                    item.group = None
                raise

        self._pass(items, resumed)
        if any(p is not None for p in pending) or not all(r.at_end() for r in readers):
            raise BadDelta(f"{what} has records after its last tensor")

    def run_changes(self, changes: dict[str, codec.Changes], resumed: bool = False) -> None:
        """Fill every tensor from changes already decoded and verified (the region's patches,
        chain/decode.py) instead of a record stream: the same journaled, digest-checked pass."""

        def items(done: set[str]) -> Iterator[_Item]:
            for i, t in enumerate(self.tensors):
                ch = changes.get(t.name)
                if ch is not None:
                    self._check_base(t)
                yield _Item(i, t, t.name in done, None if ch is None else "delta", changes=ch)

        self._pass(items, resumed)

    def _pass(self, items: Callable[[set[str]], Iterator[_Item | _GroupUnit]], resumed: bool
              ) -> None:
        """The journaled pass both sources share: tensors the journal lists are done; the rest
        go in batches of about BATCH elements, each decoded (`_start`), written (`_write`) and
        checked and journaled (`_check`). A batch decodes in the codec's workers while the
        main thread checks the batch before it and reads the one after: run one after the
        other, a worker sat idle through that Python (0.75 s of a 50,000-tensor apply at
        1e9 elements, against 0.39 s with 200 tensors). Errors surface in table order, as
        one batch at a time had them: a batch that cannot be read or begun leaves the one
        before written, checked and journaled first."""
        self.resumed = resumed
        jpath = self.journal_path
        done = set(jpath.read_text().split("\n")) if jpath and jpath.exists() else set()
        batches = _batches(items(done))
        # the worker takes the GIL between segments: handed over sooner while this thread
        # runs Python (chain.gilswitch)
        with open(jpath or os.devnull, "a") as self.journal, quick_switches():
            ahead: list[_Item | _GroupUnit] = []  # the batch decoding in the workers
            decoding = _nothing  # its join
            try:
                while True:
                    try:
                        batch = next(batches, None)
                    except BaseException:  # a record of the next batch refused
                        join, decoding = decoding, _nothing
                        self._complete(ahead, join)
                        raise
                    if batch is None:
                        break
                    join, decoding = decoding, _nothing
                    join()
                    del join  # it holds the batch's payloads and decode buffers
                    self._write(ahead, self._reads(batch))
                    written, ahead = ahead, batch
                    try:
                        decoding = self._start(ahead)
                    finally:  # begun or refused, the batch before is checked first
                        self._checked(written)
                    del written
                join, decoding = decoding, _nothing
                self._complete(ahead, join)
            except BaseException:
                # no worker may go on reading a batch's payloads after the pass: its decode
                # ends first (its own error, if it has one, was not this one's cause)
                with contextlib.suppress(Exception):
                    decoding()
                raise
            finally:
                _unlink(ahead)

    def _complete(self, batch: list[_Item | _GroupUnit], join: Callable[[], None]) -> None:
        """The last steps of `batch`, whose decode `join` ends: written, checked, journaled."""
        join()
        self._write(batch)
        self._checked(batch)

    def _checked(self, batch: list[_Item | _GroupUnit]) -> None:
        """`_check`, then the cycles the batch's groups make broken (`_unlink`)."""
        try:
            self._check(batch)
        finally:
            _unlink(batch)

    def _read(self, item: _Item, rec: RecordHeader, reader: BlockReader) -> None:
        t = item.t
        if rec.op == "group":
            self._open(item, rec, reader)
            return
        if rec.dtype != t.dtype or rec.shape != t.shape:
            raise BadDelta(f"record for {t.name} disagrees with the manifest's dtype/shape")
        at, count = (0, t.numel) if rec.at is None else (rec.at, rec.count)
        if at + count > t.numel:
            raise BadDelta(f"record for {t.name} covers elements {at}..{at + count}, past its "
                           f"{t.numel}")
        if item.op not in (None, rec.op):
            raise BadDelta(f"{t.name} has both full and delta records")
        if item.grouped:
            raise BadDelta(f"{t.name} has both a group record and another record")
        item.op = rec.op
        item.parts.append((at, count))
        itemsize = BY_NAME[t.dtype].itemsize
        if rec.op == "full":
            if rec.n != count * itemsize:
                raise BadDelta(f"full record for {t.name} has {rec.n} bytes, needs "
                               f"{count * itemsize}")
            if item.done:
                reader.skip(rec.n)
            else:
                reader.read_into(memoryview(self.out.bits(t.name)[at:at + count]).cast("B"))
            return
        if rec.n > 8 * count * itemsize + (1 << 20):
            raise BadDelta(f"delta record for {t.name} is implausibly large ({rec.n} bytes)")
        self._check_base(t)
        item.payloads.append((at, count, reader.read(rec.n)))

    def _open(self, item: _Item, rec: RecordHeader, reader: BlockReader) -> None:
        """A group record starting at `item`: its payload, read now and decoded with the
        batch its last tensor ends (a batch never ends inside a group)."""
        if self._starts is None:  # where each tensor starts, were the table's laid end to end
            self._starts = np.zeros(len(self.tensors) + 1, np.int64)
            np.cumsum(self.tensors.numels(), out=self._starts[1:])
        end = item.index + rec.count
        if end > len(self.tensors):
            raise BadDelta(f"group record for {item.t.name} covers {rec.count} tensors, past "
                           f"the last of {self.what}")
        offsets = self._starts[item.index:end + 1] - self._starts[item.index]
        elements = int(offsets[-1])
        if elements > MAX_GROUP:
            raise BadDelta(f"group record for {item.t.name} covers more than {MAX_GROUP} "
                           "elements")
        if rec.n > 8 * elements * BY_NAME[rec.dtype].itemsize + (1 << 20):
            raise BadDelta(f"group record for {item.t.name} is implausibly large ({rec.n} "
                           f"bytes for {elements} elements)")
        item.group = _Group(reader.read(rec.n), rec.dtype, rec.count, offsets,
                            self.names[item.index:end], item.index)
        self._join(item.group, item)

    def _row(self, i: int) -> TensorRow:
        """Tensor `i` of the table, from the columns made once."""
        dtype, shape = self._metas[i]
        return TensorRow(self.names[i], dtype, shape, self._digests[i], self._numels[i])

    def _unit(self, item: _Item, done: set[str], pending: list[RecordHeader | None]
               ) -> _GroupUnit | None:
        """The group record just opened at `item` as one `_GroupUnit`, where nothing asks for its
        members one by one: none journaled yet, every member a tensor of the group's dtype
        with a parent of its dtype and shape, no other record naming one (the streams' next
        records lie past the last member). Else None: the members are read as `_Item`s,
        whose steps refuse what is wrong, each naming its tensor."""
        g = item.group
        if self.moves or item.done or (done and not done.isdisjoint(g.names)):
            return None
        last = g.names[-1]
        if any(p is not None and p.name <= last for p in pending):
            return None
        metas = self._metas[item.index:item.index + g.count]
        if any(kind != g.dtype for kind, _ in metas) or not self.base.holds(g.names, metas):
            return None
        item.group, g.members = None, []  # `item` is not kept: no cycle through it
        return _GroupUnit(item.index, g.count, g)

    def _members(self, w: _GroupUnit) -> list[_Item]:
        """`w`'s tensors as the `_Item`s `_join` makes, its decoded group on each (`span`)."""
        g = w.group
        g.members = [_Item(w.index + k, t, False, "delta", [(0, t.numel)], grouped=True,
                           member=k, span=g)
                     for k, t in enumerate(map(self._row, range(w.index, w.index + w.count)))]
        return g.members

    def _join(self, group: _Group, item: _Item) -> None:
        """`item`, the next tensor in table order, is covered by `group`."""
        t = item.t
        if t.dtype != group.dtype:
            raise BadDelta(f"group record covers {t.name}, a {t.dtype} tensor, as {group.dtype}")
        if item.op is not None:
            raise BadDelta(f"{t.name} has both a group record and another record")
        item.grouped = True
        self._check_base(t)
        item.op = "delta"
        item.parts.append((0, t.numel))
        item.member = len(group.members)
        group.members.append(item)

    def _check_parts(self, item: _Item) -> None:
        """A tensor's records may not overlap; full records must cover it exactly."""
        if len(item.parts) < 2 and item.op != "full":  # nothing to overlap (most tensors)
            return
        end = 0
        for at, count in sorted(item.parts):
            if at < end:
                raise BadDelta(f"records for {item.t.name} overlap at element {at}")
            if item.op == "full" and at != end:
                raise BadDelta(f"full records for {item.t.name} leave elements {end}..{at} out")
            end = at + count
        if item.op == "full" and end != item.t.numel:
            raise BadDelta(f"full records for {item.t.name} end at element {end} of "
                           f"{item.t.numel}")

    def _base_of(self, t: TensorEntry) -> np.ndarray:
        self._check_base(t)
        return self.base.bits(t.name)

    def _check_base(self, t: TensorEntry) -> None:
        b = self.base
        slot = None if b is None else b.slots.get(t.name)
        if slot is None or (slot.dtype, slot.shape) != (t.dtype, t.shape):
            raise BadDelta(f"{self.what}: tensor {t.name} needs a full record (no parent "
                           "tensor)")

    def _group_view(self, g: _Group) -> np.ndarray | None:
        """Group `g`'s parent elements as one view of the base, where its tensors lie back to
        back there (always, in a directory a region wrote) and nothing is laid over them: the
        group decodes in place instead of from a copy (a memory pass over the group saved).
        Every member's parent was checked when the group took it (`_join`)."""
        span = getattr(self.base, "span", None)
        return None if span is None else span(g.names)

    def _source(self, t: TensorEntry, at: int, count: int
                ) -> tuple[np.ndarray, codec.Layers]:
        """What a delta record for elements at..at+count of `t` decodes against: the base's
        elements, and changes the decoder lays over them first (none here)."""
        return self._base_of(t)[at:at + count], ()

    def _reads(self, batch: list[_Item | _GroupUnit]) -> tuple[int, Callable[[], None]]:
        """A job mapping the base's pages that decoding `batch` reads, weighed by their
        elements: it runs with the batch before's writes (`_write`), on whichever thread is
        free, so the workers find them mapped (faulted in one by one as the decoder reads,
        or mapped on the main thread first, as the workers waited, they cost more)."""
        names: list[str] = []  # in table order, so adjacent tensors share a call
        size = 0
        for it in batch:
            if type(it) is _GroupUnit:
                names += it.group.names
                size += it.numel
            elif it.payloads or it.grouped:
                names.append(it.t.name)
                size += it.numel
        return size, functools.partial(self.base.prefault_many, names) if names else _nothing

    def _start(self, batch: list[_Item | _GroupUnit]) -> Callable[[], None]:
        """Decoding the batch's delta payloads against the base begun on the codec's worker
        threads: calling the result joins in and sets each item's changes (or raises the
        payloads' BadDelta)."""
        coded = [it for it in batch if type(it) is _Item and it.payloads]
        groups = [it.group for it in batch if it.group is not None]
        if not coded and not groups:
            return _nothing
        records = [(it.t, at, count, payload) for it in coded
                   for at, count, payload in it.payloads]
        sources = [self._source(t, at, count) for t, at, count, _ in records]
        cats = [self._group_base(g) for g in groups]
        started = codec.start_decode(
            [(base, payload, t.dtype) for (t, _, _, payload), (base, _) in
             zip(records, sources, strict=True)] +
            [(cat, g.payload, g.dtype) for g, (cat, _) in zip(groups, cats, strict=True)],
            moves=self.moves, overlays=[layers for _, layers in sources] + [()] * len(groups))

        def join() -> None:
            decoded = iter(started())
            for it in coded:
                parts = sorted(((at, next(decoded)) for at, _, _ in it.payloads),
                               key=lambda p: p[0])
                whole = len(parts) == 1 and it.payloads[0][:2] == (0, it.t.numel)
                # a digest move decoded against a part is not the tensor's (its last word
                # may hold the next part's elements): only a whole-tensor record keeps one
                it.changes = parts[0][1] if whole else \
                    codec.Changes(np.concatenate([c.pos + np.int64(at) for at, c in parts]),
                                  np.concatenate([c.val for _, c in parts]))
                it.payloads = []
            for g, (cat, offsets) in zip(groups, cats, strict=True):
                self._split(g, cat, offsets, next(decoded))
        return join

    def _group_base(self, g: _Group) -> tuple[np.ndarray, np.ndarray]:
        """What group `g` decodes against: its tensors' parent elements end to end (each as
        `_source` has it, overlaid), and where each tensor starts."""
        offsets = g.offsets
        claimed = hdr.claimed_elements(g.payload)
        if claimed != offsets[-1]:
            raise BadDelta(f"group record for {g.names[0]} and {len(g.names) - 1} "
                           f"tensors after it is coded over {claimed} elements; they hold "
                           f"{offsets[-1]}")
        view = self._group_view(g)
        if view is not None and view.size == offsets[-1]:
            return view, offsets
        cat = np.empty(int(offsets[-1]), BY_NAME[g.dtype].uint)
        # by place in the table: a `_GroupUnit`'s group has no members
        for k, (lo, hi) in enumerate(itertools.pairwise(offsets.tolist())):
            t = self._row(g.first + k)
            base, layers = self._source(t, 0, t.numel)
            cat[lo:hi] = base
            for pos, val in layers:
                cat[lo + pos] = val
        return cat, offsets

    def _split(self, g: _Group, cat: np.ndarray, offsets: np.ndarray,
               changes: codec.Changes) -> None:
        """A decoded group: kept whole on each member (`span`), where a group written as one
        needs no member's own changes (`_span_job`); when this pass checks digests by moves,
        each tensor's share in its own positions with its digest move, in one kernel call.
        Else a member's share is cut where it is written alone (`_cut`), and its positions
        alone for CHANGES (`_check`): 50,000 members' Changes made every version were 4.6 %
        of a region's apply (its main thread's py-spy samples at 960 elements a tensor)."""
        for m in g.members:
            m.span = g
        if g.members:  # none on a `_GroupUnit`'s
            g.members[0].group = None
        g.payload, g.changes = b"", changes
        if self.moves:
            moves = lanehash.moved_by_groups(cat, changes.pos, changes.val, offsets)
            self._cut(g, moves)

    @staticmethod
    def _cut(g: _Group, moves: np.ndarray | None = None) -> None:
        """Each member's share of group `g`'s changes, in its own positions."""
        for m, mine in zip(g.members, codec.split_changes(g.changes, g.offsets, moves),
                           strict=True):
            m.changes = mine

    def _write(self, batch: list[_Item | _GroupUnit],
               reads: tuple[int, Callable[[], None]] = (0, _nothing)) -> None:
        """Write decoded `batch` and find each tensor's digest (its `_GroupUnit`s that cannot be
        written as one are replaced by their members, in place: the caller unlinks what the
        list holds); `reads` (`_reads`) runs among the writes."""
        batch[:] = [m for it in batch for m in
                    ((it,) if type(it) is _Item or self._settle_unit(it) else self._members(it))]
        units = [it for it in batch if type(it) is _GroupUnit]
        work = [it for it in batch if type(it) is _Item and not it.done and it.op != "full"]
        for it in work:
            it.forward = self._can_pull(it)
        run_jobs([(w.numel, self._unit_job(w)) for w in units] + self._jobs(work) + [reads])
        # a tensor brought forward whose older version was not what VERSION.json says:
        # copied whole from the base instead, then patched (a `_GroupUnit`: all its tensors)
        redo = [it for it, ok in zip(work, self._finish(work), strict=True) if not ok]
        for it in redo:
            it.forward, it.repaired = False, True
        again = [w for w in units if not self._finish_unit(w)]
        for w in again:
            w.forward = False
        run_jobs([(w.numel, self._unit_job(w)) for w in again] + self._jobs(redo))
        self._finish(redo)
        for w in again:
            self._finish_unit(w)
        full = [it for it in batch if type(it) is _Item and not it.done and it.op == "full"]
        for it, d in zip(full, tensor_digests([(it.t.dtype, it.t.shape,
                                                self.out.bits(it.t.name)) for it in full]),
                         strict=True):
            it.digest = d

    def _check(self, batch: list[_Item | _GroupUnit]) -> None:
        """A written batch's bookkeeping: each tensor's changed positions for CHANGES, its
        digest checked, progress told; the tensors verified, up to a mismatch or a stop, are
        journaled and their pages dropped (`_done`)."""
        finished: list[str] = []
        owns: dict[int, list[np.ndarray]] = {}  # uncut groups' members' positions, by group
        try:
            for it in batch:
                if type(it) is _GroupUnit:
                    self._check_unit(it, finished)
                    continue
                name = it.t.name
                if it.op == "full":
                    self.changes.tensor(name, None)
                elif it.changes is not None:
                    self.changes.tensor(name, it.changes.pos)
                elif it.span is not None:  # a group written as one: never cut
                    g = it.span
                    own = owns.get(id(g))
                    if own is None:
                        own = owns[id(g)] = codec.split_positions(g.changes.pos, g.offsets)
                    self.changes.tensor(name, own[it.member])
                else:
                    self.changes.tensor(name, np.empty(0, np.int64))
                if it.done:
                    continue
                if it.digest != it.t.digest:
                    raise DigestMismatch(f"tensor {name} of {self.what} does not match its "
                                         "digest after apply; the artifact is bad and was not "
                                         "applied")
                self.repaired += it.repaired
                finished.append(name)
                if self.progress:  # may raise to stop the pass between two tensors
                    self.progress(self.what, it.index + 1, len(self.tensors))
        finally:  # the tensors verified before a mismatch or a stop stay done
            self._done(finished)

    def _done(self, names: list[str]) -> None:
        """Journal verified tensors (one write per batch) and drop their pages from this
        process (one madvise per run of adjacent tensors)."""
        if not names:
            return
        self.journal.write("".join(n + "\n" for n in names))
        self.journal.flush()
        self.out.release_many(names)
        if self.base is not None:
            self.base.release_many(names, known_only=True)

    def _can_pull(self, it: _Item) -> bool:
        """Whether the slot holds an older version that the recorded steps bring forward (only
        the positions changed since are written), rather than being copied whole."""
        return not self.resumed and bool(self._pullable[it.index])

    def _jobs(self, work: list[_Item]) -> list[tuple[int, Callable[[], None]]]:
        """Write jobs for `work`: a group's tensors as one where they lie back to back in both
        directories, a tensor larger than PART in parts of its own, smaller ones together in
        jobs of about PART elements (a job and its page faults per 1,000-element tensor cost
        more than writing it)."""
        spans, work = self._spans(work)
        jobs = [(int(g.offsets[-1]), self._span_job(g, [it.t.name for it in items],
                                                    items[0].forward, target, source,
                                                    _moves_to(items)))
                for g, items, target, source in spans]
        # a group's members written one by one: each with its own share of the changes
        for g in {id(it.span): it.span for it in work
                  if it.span is not None and it.changes is None}.values():
            self._cut(g)
        jobs += [job for it in work if it.t.numel > PART for job in self._parts(it)]
        group: list[_Item] = []
        size = 0
        for it in work:
            if it.t.numel <= PART:
                group.append(it)
                size += it.t.numel
                if size >= PART:
                    jobs.append((size, self._whole_job(group)))
                    group, size = [], 0
        if group:
            jobs.append((size, self._whole_job(group)))
        return jobs

    def _spans(self, work: list[_Item]) -> tuple[list, list[_Item]]:
        """The decoded groups of `work` that can be written as one (every tensor of the group
        to write, all brought forward or all copied, back to back in this directory and in
        the base), with their views; and the rest of `work`."""
        by_group: dict[int, list[_Item]] = {}
        for it in work:
            if it.span is not None:
                by_group.setdefault(id(it.span), []).append(it)
        spans, taken = [], set()
        out_span, base_span = getattr(self.out, "span", None), getattr(self.base, "span", None)
        for items in by_group.values():
            g = items[0].span
            if out_span is None or base_span is None or len(items) != len(g.members) or \
                    len({it.forward for it in items}) != 1:
                continue
            names = [it.t.name for it in items]
            target, source = out_span(names), base_span(names)
            if target is None or source is None or target.dtype != source.dtype:
                continue
            spans.append((g, items, target, source))
            taken.update(id(it) for it in items)
        return spans, [it for it in work if id(it) not in taken]

    def _span_job(self, g: _Group, names: list[str], forward: bool, target: np.ndarray,
                  source: np.ndarray, put: Callable[[np.ndarray], None]) -> Callable[[], None]:
        """One kernel call writing a group's tensors (lanehash.pull_put_groups): brought
        forward by the positions changed since (each tensor's own, cut to it, in the group's
        positions), or copied whole from the base; then the group's changes. Each tensor's
        digest move, in order, goes to `put` as one (members, 2) array (a unit's moves stay
        one array up to lanehash.add_many: as a list, converting it back cost ~20 ms an apply
        at 50,000 tensors)."""
        def job() -> None:
            if forward:
                steps = [_group_positions(s, names, g.offsets) for s in self.steps]
                ppos = steps[0] if len(steps) == 1 else np.unique(np.concatenate(steps))
                if ppos.size or g.changes.pos.size:
                    self.out.prefault_view(target)
            else:
                self.out.prefault_view(target)
                target[:] = source
                ppos = np.empty(0, np.int64)
            put(lanehash.moved_by_group_writes(target, source, g.offsets, ppos,
                                               g.changes.pos, g.changes.val))
        return job

    # --- a group as one (`_GroupUnit`) ----------------------------------------------------------
    def _settle_unit(self, w: _GroupUnit) -> bool:
        """Whether `w` is written as one: its tensors all brought forward or all copied, and
        back to back in this directory and in the base (then its two views are kept)."""
        names = w.group.names
        rows = self._pullable[w.index:w.index + w.count]
        pull = not self.resumed and bool(rows.all())
        if not pull and not self.resumed and rows.any():
            return False
        span = getattr(self.out, "span", None)
        target = None if span is None else span(names)
        source = self._group_view(w.group)
        if target is None or source is None or target.dtype != source.dtype or \
                target.size != w.numel or source.size != w.numel:
            return False
        w.forward, w.target, w.source = pull, target, source
        return True

    def _unit_job(self, w: _GroupUnit) -> Callable[[], None]:
        def put(moves: np.ndarray) -> None:
            w.moves = moves
        return self._span_job(w.group, w.group.names, w.forward, w.target, w.source, put)

    def _finish_unit(self, w: _GroupUnit) -> bool:
        """`_finish` for a `_GroupUnit`: its tensors' digests from their moves; False where it was
        brought forward and any tensor misses its digest (the caller copies all of them)."""
        names = w.group.names
        given = self.own if w.forward else self.base_digests
        column = self._in_table_order(given)  # type: ignore[arg-type]
        starts = column[w.index:w.index + w.count] if column is not None else \
            [given[n] for n in names]  # type: ignore[index]
        w.digests = lanehash.add_many(starts, w.moves)
        if not w.forward:
            return True
        want = self._digests[w.index:w.index + w.count]
        if w.digests == want:
            return True
        w.repaired = sum(d != e for d, e in zip(w.digests, want, strict=True))
        return False

    def _in_table_order(self, digests: dict[str, str]) -> list[str] | None:
        """`digests`' values as a column of the table, where it names the table's tensors in
        its order (a VERSION.json of the same model: always, in a region), so a group takes
        a slice instead of a lookup a tensor (~0.3 us each, out of cache); else None. Found
        once per mapping."""
        key = id(digests)
        if key not in self._columns:
            self._columns[key] = (digests, list(digests.values())
                                  if list(digests) == self.names else None)
        return self._columns[key][1]

    def _check_unit(self, w: _GroupUnit, finished: list[str]) -> None:
        """The bookkeeping `_check` does a tensor, for a `_GroupUnit`'s: CHANGES positions, the
        digest check (the tensors before a mismatch stay done), progress once a group."""
        g, names = w.group, w.group.names
        self.changes.members(names, *codec.own_positions(g.changes.pos, g.offsets))
        want = self._digests[w.index:w.index + w.count]
        if w.digests != want:
            bad = next(k for k, (d, e) in enumerate(zip(w.digests, want, strict=True))
                       if d != e)
            finished += names[:bad]
            raise DigestMismatch(f"tensor {names[bad]} of {self.what} does not match its "
                                 "digest after apply; the artifact is bad and was not applied")
        self.repaired += w.repaired
        finished += names
        if self.progress:  # may raise to stop the pass between two groups
            self.progress(self.what, w.index + len(names), len(self.tensors))

    def _whole_job(self, group: list[_Item]) -> Callable[[], None]:
        def job() -> None:
            writes = [it.t.name for it in group if self._writes(it)]
            if writes:
                self.out.prefault_many(writes)
            for it in group:
                self._write_whole(it)
        return job

    def _writes(self, it: _Item) -> bool:
        """Whether writing `it` touches its slot (a slot brought forward with nothing changed
        since is left alone, so its pages are neither faulted in nor dirtied)."""
        name = it.t.name
        return not it.forward or (it.changes is not None and it.changes.pos.size > 0) or \
            any(s[name].size for s in self.steps)

    def _write_whole(self, it: _Item) -> None:
        """What one job of `_parts` does, for a tensor of at most PART elements."""
        name, n = it.t.name, it.t.numel
        src = self._base_of(it.t)  # refuses a tensor with no parent, even an empty one
        if not n:
            it.moves = []
            return
        slot = self.out.bits(name)
        ch = it.changes if it.changes is not None else codec.Changes.none(slot.dtype)
        # positions past the tensor (the caller's changes, a CHANGES file's) are dropped, as
        # `_parts` cuts them: the compiled kernels check no bounds, and a stray position
        # would land in the next tensor of the file; the digest then misses instead
        pos, val = _inside_changes(ch, n)
        if not it.forward:
            slot[:] = src
            it.moves = [lanehash.moved_by_put(slot, pos, val)]
            return
        steps = [_inside(s[name], n) for s in self.steps]
        da = db = 0
        for p in steps[:-1]:
            ma, mb = lanehash.moved_by_pull(slot, src, p)
            da, db = da + int(ma), db + int(mb)
        ma, mb = lanehash.moved_by_pull_put(slot, src, steps[-1], pos, val)
        it.moves = [(da + int(ma), db + int(mb))]

    def _parts(self, it: _Item) -> list[tuple[int, Callable[[], None]]]:
        """Jobs writing tensor `it` in ranges of PART elements (whole 64-bit words, so their
        digest moves add up), each filling its share of `it.moves`: a large tensor no longer
        keeps one thread busy while the other waits (a 1B model's embedding is 65 M elements,
        four batches' worth)."""
        name, n = it.t.name, it.t.numel
        slot, src = self.out.bits(name), self._base_of(it.t)
        # no changes: still typed as the tensor, or the kernels below miss their compiled
        # variant and JIT-compile in the middle of a region's disk pass
        ch = it.changes if it.changes is not None else codec.Changes.none(slot.dtype)
        steps = [s[name] for s in self.steps] if it.forward else []
        spans = [(lo, min(n, lo + PART)) for lo in range(0, n, PART)]
        it.moves = [(0, 0)] * len(spans)

        def part(k: int, lo: int, hi: int) -> Callable[[], None]:
            def job() -> None:
                a, b = np.searchsorted(ch.pos, (lo, hi))
                pos, val = ch.pos[a:b], ch.val[a:b]
                cut = [np.searchsorted(p, (lo, hi)) for p in steps]
                if not steps:  # a copy of the base's range, then the changes
                    self.out.prefault(name, lo, hi)
                    slot[lo:hi] = src[lo:hi]
                    it.moves[k] = lanehash.moved_by_put(slot, pos, val)
                    return
                if b > a or any(y > x for x, y in cut):
                    self.out.prefault(name, lo, hi)
                da = db = 0
                for p, (x, y) in zip(steps[:-1], cut[:-1], strict=True):
                    ma, mb = lanehash.moved_by_pull(slot, src, p[x:y])
                    da, db = da + int(ma), db + int(mb)
                x, y = cut[-1]
                ma, mb = lanehash.moved_by_pull_put(slot, src, steps[-1][x:y], pos, val)
                it.moves[k] = (da + int(ma), db + int(mb))
            return job

        return [(hi - lo, part(k, lo, hi)) for k, (lo, hi) in enumerate(spans)]

    def _finish(self, items: list[_Item]) -> list[bool]:
        """Sum each item's parts' digest moves into its `digest`; False for a tensor brought
        forward that does not reach its digest (the caller copies it whole instead)."""
        starts = [self.own[it.t.name] if it.forward else  # type: ignore[index]
                  self.base_digests[it.t.name] for it in items]
        moves = [it.moves[0] if len(it.moves) == 1 else
                 (sum(int(m[0]) for m in it.moves), sum(int(m[1]) for m in it.moves))
                 for it in items]
        for it, digest in zip(items, lanehash.add_many(starts, moves), strict=True):
            it.digest = digest
        return [not it.forward or it.digest == it.t.digest for it in items]


def _batches(items: Iterator[_Item | _GroupUnit]) -> Iterator[list[_Item | _GroupUnit]]:
    """`items` in batches of about BATCH elements, the last perhaps empty; a batch never ends
    inside a group record (`more`)."""
    batch: list[_Item | _GroupUnit] = []
    size = 0
    try:
        for item in items:
            batch.append(item)
            size += item.numel
            if size >= BATCH and not item.more:
                yield batch
                batch, size = [], 0
    except BaseException:  # a stream refused part way: its groups read so far
        _unlink(batch)
        raise
    yield batch


def _unlink(batch: list[_Item | _GroupUnit]) -> None:
    """Break the cycles a batch's groups make (a group lists its members, and its first
    member, once decoded each member, points back at it), so reference counting frees the
    batch as it ends: left to the cyclic collector, a 50,000-tensor apply left ~450,000
    objects behind that one collection took 0.2 s to free, every version."""
    for it in batch:
        it.group = None
        if type(it) is _Item:
            it.span = None


def _moves_to(items: list[_Item]) -> Callable[[np.ndarray], None]:
    """Where a group job's digest moves go: each item's own, in order."""
    def put(moves: np.ndarray) -> None:
        for it, m in zip(items, moves.tolist(), strict=True):
            it.moves = [m]
    return put


def _group_positions(step: StoredChanges, names: list[str], offsets: np.ndarray
                     ) -> np.ndarray:
    """A group's members' positions in one CHANGES `step` (each member's own, sorted) in the
    group's positions (`offsets`: where each member starts, and the end), those past their
    member dropped as `_inside` drops them: array operations over the group, not four a
    member. The members' positions are one slice of the step where they are consecutive
    tensors there (always, between versions of one table)."""
    run = step.run(names)
    if run is None:
        parts = [step[n] for n in names]
        counts = np.array([p.size for p in parts], np.int64)
        local = np.concatenate(parts).astype(np.int64, copy=False)
    else:
        local, counts = run
    moved = local + np.repeat(offsets[:-1], counts)
    # each member's positions are sorted: its first and last say whether all lie inside it
    # (a check a member, not three array passes over every position)
    ends = np.cumsum(counts)
    some = counts > 0
    if (local[(ends - counts)[some]] >= 0).all() and \
            (local[ends[some] - 1] < np.diff(offsets)[some]).all():
        return moved
    return moved[(local >= 0) & (local < np.repeat(np.diff(offsets), counts))]


def _inside(pos: np.ndarray, n: int) -> np.ndarray:
    """The sorted positions `pos` that fall in 0..n-1."""
    if not pos.size or (pos[0] >= 0 and pos[-1] < n):
        return pos
    a, b = np.searchsorted(pos, (0, n))
    return pos[a:b]


def _inside_changes(ch: codec.Changes, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions and values of `ch` that fall in 0..n-1."""
    pos = _inside(ch.pos, n)
    if pos is ch.pos:
        return ch.pos, ch.val
    a = int(np.searchsorted(ch.pos, 0))
    return pos, ch.val[a:a + pos.size]

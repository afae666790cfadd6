"""Writing an artifact: compare new weights with the parent's, encode, cut into blocks, sign.

This is the publisher's half of the format. A delta carries one record per changed or new tensor
(codec payload if dtype and shape are unchanged, raw bytes otherwise); a snapshot carries every
tensor raw. Either way the manifest lists every tensor's digest, so the receiver can verify
the result bit for bit.
"""

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from chain import codec, lanehash
from chain.blocks import DEFAULT_BLOCK, BlockStore
from chain.codec import header as hdr
from chain.codec.api import LOG2_SEG, moved_alone, run_jobs, start_encode
from chain.digest import pieces_root, tensor_digests
from chain.dtypes import BY_NAME
from chain.gcpause import without_gc
from chain.gilswitch import quick_switches
from chain.manifest import FORMAT, BasePin, BlockEntry, FileEntry, Manifest, Parent
from chain.sources import TensorSource
from chain.stream import MAX_GROUP, BlockWriter, RecordHeader
from chain.tensortable import DTYPE_CODE, TensorTable


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


GROUP_BELOW = 1 << 16
"""Tensors of fewer elements than this, changed in place (the parent's dtype and shape), are
coded in groups of consecutive ones: one record, one codec segment and one payload header a
group instead of one each. A tensor costs ~70-100 us of Python in its own record whatever its
size, about what coding 100,000 elements costs, so models of 50,000 small expert tensors paid
mostly that (docs/MEASURED.md, "Tensor count"). 0: every tensor its own record, the only kind
daemons before group records read."""
GROUP_ELEMENTS = MAX_GROUP - GROUP_BELOW
"""A group ends once it holds this many elements: as many as a reader takes (MAX_GROUP, its
last tensor, under GROUP_BELOW, included), since a group's Python costs the same whatever its
size: groups of 2^20 elements (~1,000 in a 50,000-tensor model of 1e9 elements) against
groups of ~4 M (~250) took 636 against 557 py-spy samples (250 Hz) of the main thread outside
the codec over four publishes, ~0.08 s a publish under the profiler. `_units` caps a group
at MAX_GROUP whatever `group_below` is."""


PIPELINE = True
"""A batch is coded on the codec's worker thread while this thread writes the one before and
walks to the next (`encode_stream`'s flush); False: one batch at a time, all threads on it."""


OnChanges = Callable[[str, "codec.Changes | None"], None]
OnGroup = Callable[[list[str], np.ndarray, "codec.Changes"], None]
"""A group record's members at once: their names, element offsets (member j from offsets[j]
to offsets[j + 1], int64) and the group's changes, positions in their elements end to end."""

IN_PARENT = np.empty(0, np.uint8)
"""A pending tensor's parent bits not read yet: the parent holds it in the same layout, and a
group reads its members' parent elements together (StateDictSource.span) or one at a time."""


def _units(pending: list, below: int) -> list[tuple[int, int]]:
    """`pending` cut into ranges [lo, hi): one tensor, or a group of consecutive small
    tensors of one dtype that each have a parent of the same layout, of at most MAX_GROUP
    elements whatever `below` is (a reader refuses more)."""
    units: list[tuple[int, int]] = []
    lo = 0
    while lo < len(pending):
        hi, size = lo + 1, pending[lo][5]
        _, dtype, _, old, _, _ = pending[lo]
        if old is not None and size < below:
            while hi < len(pending) and size < GROUP_ELEMENTS:
                _, d, _, o, _, n = pending[hi]
                if o is None or d != dtype or n >= below or size + n > MAX_GROUP:
                    break
                size += n
                hi += 1
        units.append((lo, hi))
        lo = hi
    return units


def encode_stream(
    writer: BlockWriter, new: TensorSource, parent: TensorSource | None, kind: str,
    digests: Mapping[str, str] | None = None,
    parent_digests: Mapping[str, str] | None = None,
    on_changes: OnChanges | None = None,
    direct_positions: int = codec.DIRECT,
    group_below: int = GROUP_BELOW,
    on_group: OnGroup | None = None,
    parent_table: TensorTable | None = None,
) -> tuple[TensorTable, EncodeStats]:
    """Write the record stream for `new` against `parent` (None or kind=snapshot: all raw).

    Tensors whose dtype and shape are unchanged get a codec payload (no record at all when
    nothing changed); new, reshaped or retyped tensors get their raw bytes. `digests`: the
    tensor digests of this same `new`, when already computed (a snapshot written right after
    the delta of the same version), so a large model is not hashed twice. `parent_digests`:
    the digests of `parent`'s tensors, when the caller knows they are right; a delta's
    digests are then moved by its changes instead of hashing `new`. `on_changes(name,
    changes)`: called per tensor with what the delta changes (None: a full record).
    `direct_positions`: how the codec codes positions (chain.codec.api.DIRECT).
    `group_below`: tensors under this many elements go in group records (GROUP_BELOW).
    `on_group(names, offsets, changes)`: a group record's members reported at once (OnGroup)
    instead of one `on_changes` call each, so neither side splits the group's changes into
    50,000 tensors' when the receiver can take them whole (a publisher's kept copy).
    `parent_table`: the parent manifest's table, whose digests are `parent_digests`: where
    the new state has its layout (a trainer's usual version), the new table is that one with
    every digest moved at once (`TensorTable.moved`), not built again a tensor at a time."""
    stats = EncodeStats()
    t0 = time.perf_counter()
    names: list[str] = []
    dtypes = bytearray()
    shapes: list[int] = []
    ranks: list[int] = []
    digest_list: list[str] = []
    # (name, dtype, shape, parent bits (IN_PARENT until read; None: no parent of this
    # layout), bits (None until read), elements)
    pending: list[tuple[str, str, list[int], np.ndarray | None, np.ndarray | None, int]] = []
    # two batches in flight at once (`flush`): each its own scratch, taken in turn
    scratches = (_Scratch(), _Scratch())
    batches = 0
    in_flight: Callable[[bool], None] | None = None
    cat = getattr(new, "cat", None)  # the source's own tensors end to end, in one call
    pieces = getattr(new, "pieces", None)  # where the source's tensors lie, to read in place
    span = getattr(parent, "span", None)  # the parent's own view of tensors end to end
    move_digests = digests is None and parent_digests is not None
    split_groups = on_changes is not None and on_group is None

    def hashed_names(batch: list) -> set[str]:
        """The pending tensors whose digests are hashed from their bits: none where they are
        given; else those with no parent of their layout or no parent digest to move (all,
        without parent digests); none where every tensor has both (`covered`). One pass over
        the batch, then a set lookup a tensor where a call a tensor cost ~20 ms of a
        50,000-tensor publish."""
        if digests is not None or covered:
            return set()
        if parent_digests is None:
            return {p[0] for p in batch}
        # one pass over the batch (a set less the digests' keys view made a set of all 50,000
        # keys every batch: ~40 ms a publish under cProfile)
        return {p[0] for p in batch if p[3] is None or p[0] not in parent_digests}

    def flush() -> None:
        """Start coding the pending tensors on the codec's worker thread, then finish the
        batch before (its records written in order) while it codes: this thread's Python
        for one batch (records, table entries, the next batch's walk and reads, ~4 us a
        tensor) runs beside the coding of another instead of before it, where the worker
        thread had waited idle (a 50,000-tensor model; a dense one has little of it)."""
        nonlocal flushed, in_flight, batches
        batch = pending[:]
        pending.clear()
        started = start_batch(batch, flushed, scratches[batches % 2])
        batches += 1
        flushed += len(batch)
        # the new batch in flight before the one before is finished: an error there (a
        # record's write, a callback) still waits for the new batch's coding (the walk's
        # handler joins what is in flight)
        before, in_flight = in_flight, started
        if before is not None:
            before(True)
        if not PIPELINE:
            finish_in_flight()

    def finish_in_flight(write: bool = True) -> None:
        """Wait for the batch in flight, and write it (`write`) or not (an error)."""
        nonlocal in_flight
        if in_flight is not None:
            finish, in_flight = in_flight, None
            finish(write)

    def start_batch(batch: list, first: int, scratch: "_Scratch") -> Callable[[bool], None]:
        """Ready `batch` (the tensors of table rows `first`...) and start its coding;
        the result waits for the coding and writes the batch's records and entries."""
        units = _units(batch, group_below)
        to_hash = hashed_names(batch)
        # each group's member element offsets (member j from offsets[j] to offsets[j + 1])
        offsets = {lo: np.cumsum([0] + [p[5] for p in batch[lo:hi]], dtype=np.int64)
                   for lo, hi in units if hi - lo > 1}
        cats = read_deferred(batch, units, to_hash, offsets)
        # a group: its tensors' elements end to end, coded as one
        news = iter(scratch.end_to_end([[p[4] for p in batch[lo:hi]] for lo, hi in units
                                        if hi - lo > 1 and lo not in cats]))
        pairs = []
        groups: list[tuple[int, int, int]] = []  # (first, end) in batch, its pair's index
        for lo, hi in units:
            _, dtype, _, old, bits, _ = batch[lo]
            if hi - lo > 1:
                members = batch[lo:hi]
                olds = None if span is None else span([p[0] for p in members])
                if olds is None:
                    olds = end_to_end([parent.bits(p[0]) if p[3] is IN_PARENT else p[3]
                                       for p in members])
                groups.append((lo, hi, len(pairs)))
                pairs.append((olds, cats[lo] if lo in cats else next(news), dtype))
            elif old is not None:
                pairs.append((old, bits, dtype))
        moves = _GroupMoves({k: offsets[lo] for lo, _, k in groups} if move_digests else {})
        coding = start_encode(pairs, changes=parent_digests is not None
                              or on_changes is not None or on_group is not None,
                              moved=moves, direct=direct_positions) if pairs else list

        def finish(write: bool = True) -> None:
            # each pair with what it was coded as: (old, new, dtype), (payload, changes)
            coded = list(zip(pairs, coding(), strict=True))
            if write:
                write_batch(batch, first, units, to_hash, offsets, groups, moves, coded)
        return finish

    def write_batch(batch: list, first: int, units: list[tuple[int, int]], to_hash: set[str],
                    offsets: dict[int, np.ndarray], groups: list[tuple[int, int, int]],
                    moves: "_GroupMoves", coded: list) -> None:
        """A coded batch's records and table entries, in order (`start_batch`)."""
        members_changes = _members_changes(
            [(lo, coded[k][1][1], offsets[lo], moves.of(k)) for lo, hi, k in groups],
            split=split_groups)
        encoded = iter(coded)
        fresh = iter(tensor_digests([(dtype, shape, bits) for name, dtype, shape, _, bits, _
                                     in batch if name in to_hash]) if to_hash else ())
        for lo, hi in units:
            if hi - lo > 1:
                group(batch[lo:hi], next(encoded)[1], fresh, to_hash, offsets[lo],
                      members_changes.get(lo), first + lo)
                continue
            name, dtype, shape, old, bits, _ = batch[lo]
            changes = None
            if old is not None:
                _, (payload, changes) = next(encoded)
            if table_moves is not None:  # the parent's layout: only the digest's move kept
                table_moves[first + lo] = changes.digest
                if on_changes is not None:
                    on_changes(name, changes)
            else:
                entry(name, dtype, shape, next(fresh) if name in to_hash
                      else digests[name] if digests is not None
                      else lanehash.add(parent_digests[name], changes.digest), changes)
            if old is not None:
                changed = hdr.claimed_changes(payload)
                if changed == 0:
                    continue
                op = "delta"
            else:
                payload = memoryview(np.ascontiguousarray(bits)).cast("B")
                op, changed = "full", bits.size
            record(RecordHeader(name, op, dtype, shape, len(payload)), payload, changed,
                   bits.size)

    def read_deferred(batch: list, units: list[tuple[int, int]], to_hash: set[str],
                      offsets: dict[int, np.ndarray]) -> dict[int, "np.ndarray | codec.Pieces"]:
        """The batch's deferred bits, keyed by each group's first batch index: a group none
        of whose members is hashed, where its members lie (`pieces`, codec.Pieces: the
        encoder reads them in place, no copy); any other group, its new elements end to end
        from the source in one call (`cat`, on the codec's threads: torch copies without the
        GIL), its members' own views cut from them only where they are hashed; a tensor coded
        alone, its own view and its parent's. Reading a torch tensor's bits costs ~3 us a
        tensor through Python, most of a 50,000-tensor publish's per-tensor cost, where the
        source's one call copies them end to end at ~1 us a tensor and `pieces` finds their
        addresses at ~0.35 us. `to_hash`: `hashed_names`'; `offsets`: each group's member
        offsets (`flush`)."""
        cats: dict[int, np.ndarray | codec.Pieces] = {}
        jobs = []
        for lo, hi in units:
            if batch[lo][4] is not None:
                continue
            if hi - lo == 1:
                name, dtype, shape, old, _, numel = batch[lo]
                batch[lo] = (name, dtype, shape, parent.bits(name) if old is IN_PARENT
                               else old, new.bits(name), numel)
                continue
            names = [p[0] for p in batch[lo:hi]]
            hashed = bool(to_hash) and any(n in to_hash for n in names)
            found = None if hashed or pieces is None else \
                pieces(names, [p[5] for p in batch[lo:hi]], BY_NAME[batch[lo][1]].itemsize)
            if found is not None:
                cats[lo] = codec.Pieces(found[0], offsets[lo], lambda names=names: cat(names),
                                        found[1])
                continue
            jobs.append((int(offsets[lo][-1]),
                         lambda lo=lo, names=names: cats.__setitem__(lo, cat(names))))
        run_jobs(jobs)
        if not to_hash:
            return cats  # no member hashed: no member's own view needed
        for lo, hi in units:
            if lo in cats and any(p[0] in to_hash for p in batch[lo:hi]):
                at = 0
                for j in range(lo, hi):
                    n = batch[j][5]
                    batch[j] = (*batch[j][:4], cats[lo][at:at + n], n)
                    at += n
        return cats

    def entry(name: str, dtype: str, shape: list[int], digest: str,
              changes: "codec.Changes | None") -> None:
        names.append(name)
        dtypes.append(DTYPE_CODE[dtype])
        shapes.extend(shape)
        ranks.append(len(shape))
        digest_list.append(digest)
        if on_changes is not None:
            on_changes(name, changes)

    def record(h: RecordHeader, payload: bytes | memoryview, changed: int, numel: int,
               tensors: int = 1) -> None:
        writer.write_record(h, payload)
        stats.changed_tensors += tensors
        stats.changed_elements += changed
        stats.encoded_bytes += len(payload)
        stats.per_tensor.append({"name": h.name, "op": h.op, "changed": int(changed),
                                 "numel": int(numel), "bytes": len(payload)})

    def group(members: list, encoded: tuple, fresh: Iterator[str], to_hash: set[str],
              offsets: np.ndarray,
              mine: "tuple[np.ndarray | None, list[codec.Changes] | None, int] | None",
              at: int) -> None:
        """One group's entries and its one record, column by column: each member's digest
        given, hashed (`to_hash`), or the parent's moved by its share of the changes (`mine`:
        `_members_changes`'s moves, splits and touched members; None when the coding kept no
        changes), reported through `on_group` at once or `on_changes` a member. `at`: the
        first member's index in the table."""
        payload, changes = encoded
        dtype = members[0][1]
        moves, split, touched = mine if mine is not None else (None, None, len(members))
        member_names = [m[0] for m in members]
        if table_moves is not None:  # the parent's layout: the members' moves in one slice
            if moves is not None:  # None: no segment (members all empty), no move
                table_moves[at:at + len(members)] = moves
        else:
            group_entries(members, member_names, dtype, moves, fresh, to_hash)
        if on_group is not None and changes is not None:
            on_group(member_names, offsets, changes)
        elif on_changes is not None:
            for name, c in zip(member_names, split or [None] * len(members), strict=True):
                on_changes(name, c)
        changed = hdr.claimed_changes(payload)
        if changed:
            record(RecordHeader(members[0][0], "group", dtype, [], len(payload), None,
                                len(members)), payload, changed, int(offsets[-1]), touched)

    def group_entries(members: list, member_names: list[str], dtype: str,
                      moves: np.ndarray | None, fresh: Iterator[str], to_hash: set[str]
                      ) -> None:
        """A group's members' table entries: `group`'s digests, column by column."""
        if moves is None:  # no segment coded: every member is empty, and nothing moved
            moves = np.zeros((len(members), 2), np.uint64)
        # a steady delta hashes nothing: no lookup a member
        hashed = [n in to_hash for n in member_names] if to_hash else None
        if digests is not None:
            member_digests = [digests[n] for n in member_names]
        elif hashed is None or not any(hashed):  # the parents' digests moved by the changes
            member_digests = lanehash.add_many([parent_digests[n] for n in member_names], moves)
        elif all(hashed):
            member_digests = [next(fresh) for _ in members]
        else:  # moved where the parent digest is known, hashed where not
            moved = iter(lanehash.add_many(
                [parent_digests[n] for n, h in zip(member_names, hashed, strict=True) if not h],
                moves[[not h for h in hashed]]))
            member_digests = [next(fresh) if h else next(moved) for h in hashed]
        names.extend(member_names)
        dtypes.extend(bytes([DTYPE_CODE[dtype]]) * len(members))
        for m in members:
            shapes.extend(m[2])
        ranks.extend([len(m[2]) for m in members])
        digest_list.extend(member_digests)

    # the walk over every tensor, with what it reads each time held in locals (a 50,000-tensor
    # publish spent ~2 us a tensor here in attribute and property lookups)
    queued = elements = dense_bytes = 0
    itemsize = {name: d.itemsize for name, d in BY_NAME.items()}
    delta = kind == "delta"
    deferred = cat is not None
    all_names = new.names()
    parent_names = parent.names() if parent is not None else []
    new_metas = _metas(new, all_names)
    parent_metas = _metas(parent, parent_names) if delta else []
    # every tensor in the parent's layout: two list comparisons (a trainer's usual version),
    # else the parent's (dtype, shape) by name
    all_same = delta and type(new_metas) is list and type(parent_metas) is list and \
        parent_names == all_names and parent_metas == new_metas
    parent_meta = dict(zip(parent_names, parent_metas, strict=True)) \
        if delta and not all_same else {}
    # ... and a digest to move for every one (`hashed_names`): a list comparison, not a
    # lookup a tensor a batch
    covered = all_same and parent_digests is not None and \
        len(parent_digests) == len(all_names) and list(parent_digests) == all_names
    # ... and the parent table's layout (its digests are parent_digests, in its order): the
    # new table is it with each digest moved, noted here a tensor in table order (a trainer's
    # 50,000-tensor version spent ~0.1 s making its entries, columns and checks again)
    table_moves = np.zeros((len(all_names), 2), np.uint64) \
        if covered and move_digests and parent_table is not None and \
        parent_table.names() == all_names and parent_table.metas() == new_metas \
        and parent_table.digests() == list(parent_digests.values()) \
        else None
    flushed = 0  # tensors flushed before this batch: its first one's index in the table
    # the worker codes while this thread runs Python: the GIL handed over sooner (gilswitch)
    with quick_switches() if PIPELINE else contextlib.nullcontext():
        try:
            for name, (dtype, shape) in zip(all_names, new_metas, strict=True):
                numel = math.prod(shape)
                elements += numel
                dense_bytes += numel * itemsize[dtype]
                same_layout = all_same or (delta and parent_meta.get(name) == (dtype, shape))
                # a tensor a group may take: its bits and its parent's are read with the group's
                # (`read_deferred`, `flush`)
                if same_layout and deferred and numel < group_below:
                    pending.append((name, dtype, shape, IN_PARENT, None, numel))
                else:
                    pending.append((name, dtype, shape, parent.bits(name) if same_layout else None,
                                    new.bits(name), numel))
                queued += numel
                if queued >= BATCH_ELEMENTS:
                    flush()
                    queued = 0
            stats.tensors, stats.elements, stats.dense_bytes = len(all_names), elements, dense_bytes
            flush()
            finish_in_flight()
        except BaseException:
            # the batch in flight is still read by the codec's threads: waited for, not written
            with contextlib.suppress(BaseException):
                finish_in_flight(write=False)
            raise
    stats.seconds = time.perf_counter() - t0
    if table_moves is not None:
        return parent_table.moved(table_moves), stats
    return TensorTable.from_columns(names, bytes(dtypes), shapes, ranks, digest_list), stats


def _metas(source: TensorSource, names: list[str]) -> Iterable[tuple[str, list[int]]]:
    """Each of `names`' (dtype, shape), as the source answers for many (`metas`), else one
    at a time as iterated (the walk reads each tensor as it reaches it)."""
    many = getattr(source, "metas", None)
    return many(names) if many is not None else (source.meta(n) for n in names)


class _GroupMoves:
    """The encoder's `moved` hook (codec.Moved) for a batch: a tensor coded alone gets its
    digest move as the codec's default does; a group (pair index in `offsets`, its members'
    offsets) gets each member's move from every segment, summed by `of`. The encoder finds
    them in its own scan where it reads the members in place (`pieces`: the changed words are
    in registers already); else lanehash.moved_by_groups computes them on the thread that
    coded the segment, while its old elements are still in cache. Computed after the encode
    instead, reading 2 GB of parent elements again, the members' moves cost a 50,000-tensor
    publish of 1e9 elements ~0.1 s; in a pass of their own, ~0.15 s of CPU (py-spy samples).
    A group's own digest move is meaningless and left 0.

    A member word that crosses a segment's edge (a member starting mid-word, after one of a
    size no whole number of words) moves by all its changes at once, not by the sum of each
    side's: its changes are kept aside and moved together in `of`. (The scan never offers a
    segment with a change in such a word: the member's words are not the scan's.)"""

    def __init__(self, offsets: dict[int, np.ndarray]) -> None:
        self.offsets = offsets
        # each group's (first member, (members, 2) lane sums) from its segments
        self.found: dict[int, list[tuple[int, np.ndarray]]] = {k: [] for k in offsets}
        # each group's changes in words that cross a segment edge: (old, pos, val)
        self.edges: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = \
            {k: [] for k in offsets}

    def __call__(self, pair: int, lo: int, old: np.ndarray, new: np.ndarray, pos: np.ndarray,
                 val: np.ndarray) -> tuple[int, int]:
        offsets = self.offsets.get(pair)
        if offsets is None:
            return moved_alone(pair, lo, old, new, pos, val)
        edge = _at_segment_edges(pos, lo, offsets, lanehash.word_layout(old)[0])
        if edge is not None:
            self.edges[pair].append((old, pos[edge], val[edge]))
            pos, val = pos[~edge], val[~edge]
        self.found[pair].append((0, lanehash.moved_by_groups(old, pos, val, offsets)))
        return 0, 0

    def pieces(self, pair: int, first: int, moves: np.ndarray) -> bool:
        """Take a segment's members' moves as the encoder found them (codec.Moved); False
        for a pair that is not a group, whose own move the encoder then asks for."""
        if pair not in self.offsets:
            return False
        self.found[pair].append((first, moves))
        return True

    def of(self, pair: int) -> np.ndarray | None:
        """Pair `pair`'s members' moves, (members, 2) lane sums; None if not a group's."""
        found, edges = self.found.get(pair), self.edges.get(pair)
        if not found and not edges:
            return None
        total = np.zeros((self.offsets[pair].size - 1, 2), np.uint64)
        for first, moves in found:
            total[first:first + len(moves)] += moves  # uint64: wraps modulo 2^64, as it must
        if edges:
            pos = np.concatenate([e[1] for e in edges])
            order = np.argsort(pos, kind="stable")
            total += lanehash.moved_by_groups(edges[0][0], pos[order],
                                              np.concatenate([e[2] for e in edges])[order],
                                              self.offsets[pair])
        return total


def _at_segment_edges(pos: np.ndarray, lo: int, offsets: np.ndarray, sh: int
                      ) -> np.ndarray | None:
    """Which of a segment's changes (sorted group positions from `lo`) lie in a member word
    that crosses the segment's start or end (codec segments of 2^LOG2_SEG elements; words of
    2^sh elements counted from each member's start); None if none do."""
    if not pos.size:
        return None
    step = 1 << sh
    hi = min(lo + (1 << LOG2_SEG), int(offsets[-1]))
    mask = None
    for e in (lo, hi):
        m = int(np.searchsorted(offsets, e, side="right")) - 1
        if not (0 < e < offsets[-1]) or offsets[m] == e:
            continue  # the group's own ends, or a member starts here: no word crosses
        start = e - (e - int(offsets[m])) % step
        if start == e:
            continue
        inside = (pos >= start) & (pos < start + step)
        if inside.any():
            mask = inside if mask is None else mask | inside
    return mask


def _members_changes(groups: list[tuple[int, "codec.Changes | None", np.ndarray,
                                        np.ndarray | None]],
                     split: bool
                     ) -> "dict[int, tuple[np.ndarray | None, list[codec.Changes] | None, int]]":
    """What each group's changes mean for its members, keyed by the group's first pending
    index: their digest moves (as `_GroupMoves` found them), their own changes
    (codec.split_changes, with `split`) and how many members changed; `groups`: (that index,
    the group's changes or None, member offsets, the members' moves or None)."""
    out: dict[int, tuple[np.ndarray | None, list[codec.Changes] | None, int]] = {}
    for lo, changes, offsets, moved in groups:
        if changes is None:
            continue
        cuts = np.searchsorted(changes.pos, offsets)
        out[lo] = (moved, codec.split_changes(changes, offsets, moved) if split else None,
                   int(np.count_nonzero(np.diff(cuts))))
    return out


def end_to_end(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays' elements end to end, read-only: a view where they already lie back to
    back in memory (a publisher's kept copy, a file's tensors), else a copy. The view is
    valid while every array is (the writer holds them until their group is encoded)."""
    view = _back_to_back(arrays)
    return np.concatenate(arrays) if view is None else view


def _back_to_back(arrays: list[np.ndarray]) -> np.ndarray | None:
    """`end_to_end`'s view, or None where the arrays do not lie back to back."""
    first = arrays[0]
    at = first.__array_interface__["data"][0]
    for a in arrays:
        if a.__array_interface__["data"][0] != at or not a.flags.c_contiguous or \
                a.dtype != first.dtype:
            return None
        at += a.nbytes
    return np.lib.stride_tricks.as_strided(first, shape=(sum(a.size for a in arrays),),
                                           strides=(first.itemsize,), writeable=False)


class _Scratch:
    """Where a batch's groups of new elements are laid end to end: one buffer kept from batch
    to batch (a fresh one each batch paid its page faults again, a third of the copy), filled
    on the codec's threads (the copy is the writer's largest serial step at 50,000 tensors of
    20,000 elements). Each batch's arrays are views of it, valid until the next batch."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)

    def end_to_end(self, groups: list[list[np.ndarray]]) -> list[np.ndarray]:
        """`end_to_end` of each group, copies made into the buffer in parallel."""
        out: list[np.ndarray | None] = [_back_to_back(g) for g in groups]
        copies = [j for j, view in enumerate(out) if view is None]
        sizes = [-(-sum(a.nbytes for a in groups[j]) // 8) * 8 for j in copies]
        if sum(sizes) > self.buf.size:
            self.buf = np.empty(sum(sizes), np.uint8)
        jobs, at = [], 0
        for j, size in zip(copies, sizes, strict=True):
            dest = self.buf[at:at + size].view(groups[j][0].dtype)[:sum(a.size for a in
                                                                         groups[j])]
            out[j] = dest
            jobs.append((size, lambda g=groups[j], d=dest: np.concatenate(g, out=d)))
            at += size
        run_jobs(jobs)
        return out  # type: ignore[return-value]


@without_gc
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
    trust_parent: bool = False,
    on_changes: OnChanges | None = None,
    base: BasePin | None = None,
    direct_positions: int = codec.DIRECT,
    group_below: int = GROUP_BELOW,
    on_group: OnGroup | None = None,
) -> tuple[Manifest, EncodeStats]:
    """Encode, store blocks, and return the signed manifest (not yet added to a chain).
    `same_tensors_as`: a manifest already written for this very `new` (the delta of the same
    version); its tensor digests are reused instead of hashing every tensor again.
    `trust_parent`: `parent` is known to hold exactly `parent_manifest`'s weights (the
    publisher keeps it so), so a delta's digests are the parent's moved by the changes: no
    tensor is hashed. `on_changes`: see encode_stream. `base`: the base model an adapter
    version applies to (chain/adapters.py), signed with the rest. `direct_positions`,
    `group_below`, `on_group`: see encode_stream."""
    if kind == "delta" and (parent is None or parent_manifest is None):
        raise ValueError("a delta needs the parent's tensors and manifest")
    digests = None
    if same_tensors_as is not None:
        names = same_tensors_as.tensors.names()
        if same_tensors_as.version != version or names != list(new.names()):
            raise ValueError(f"same_tensors_as describes v{same_tensors_as.version} with "
                             f"{len(names)} tensors, but this is v{version} with "
                             f"{len(new.names())}: pass the manifest just written for these "
                             "same weights, or None to hash them")
        digests = same_tensors_as.tensors.digest_map()
    writer = BlockWriter(blocks, block_size)
    parent_digests = None
    if kind == "delta" and trust_parent:
        parent_digests = parent_manifest.tensors.digest_map()
    tensors, stats = encode_stream(writer, new, parent if kind == "delta" else None, kind,
                                   digests, parent_digests, on_changes, direct_positions,
                                   group_below, on_group,
                                   parent_manifest.tensors if parent_digests else None)
    stream = writer.close()
    file_entries, file_blocks = [], []
    for fname, data in sorted((files or {}).items()):
        bid = blocks.put(data)
        file_entries.append(FileEntry(name=fname, block=bid, size=len(data)))
        if all(b.id != bid for b in stream + file_blocks):
            file_blocks.append(BlockEntry(id=bid, size=len(data), root=pieces_root(data)))
    digest = tensors.state_digest()
    parent_ref = None
    if kind == "delta":
        parent_ref = Parent(version=parent_manifest.version,
                            state_digest=parent_manifest.state_digest)
    manifest = Manifest(
        format=FORMAT, run=run, version=version, kind=kind, parent=parent_ref, state_digest=digest,
        tensors=tensors, blocks=stream + file_blocks, files=file_entries,
        stats=stats.as_dict(), created=round(time.time(), 3), base=base,
    ).signed(key)
    return manifest, stats

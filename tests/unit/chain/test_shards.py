"""Sharded versions in chain/: digest parts of arbitrary element ranges join into the tensor
digest (also after a delta moved them), slices that do not tile a tensor are refused by name,
format-3 manifests need their sub-streams, and a region refuses part records that overlap or
leave a gap."""

import itertools

import numpy as np
import pytest

from chain import keys, shards
from chain.blocks import BlockStore
from chain.digest import tensor_digest
from chain.errors import BadDelta, BadManifest, ChainError
from chain.manifest import FORMAT, Manifest
from chain.stream import BlockReader, BlockWriter, RecordHeader

DTYPES = [("bfloat16", np.uint16), ("float32", np.uint32), ("int64", np.uint64),
          ("uint8", np.uint8)]


def _parts(name, dtype, full, bounds, sums_of=None, op="full"):
    out = []
    for lo, hi in itertools.pairwise(bounds):
        sl = full[lo:hi]
        sums = shards.interior_sum(sl, lo) if sums_of is None else sums_of(lo, hi)
        edges = sl[shards.edge_positions(lo, sl.size, sl.itemsize)]
        out.append(shards.slice_part(name, dtype, [full.size], lo, sl.size, sums, op, edges))
    return out


@pytest.mark.parametrize(("dtype", "uint"), DTYPES)
def test_digest_parts_of_any_cut_join_into_the_tensor_digest(dtype, uint):
    rng = np.random.default_rng(hash(dtype) % 1000)
    for _ in range(40):
        n = int(rng.integers(0, 300))
        full = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
        bounds = [0, *sorted(rng.integers(0, n + 1, int(rng.integers(0, 5))).tolist()), n]
        parts = _parts("t", dtype, full, bounds)
        assert shards.combine_digest(dtype, [n], parts) == tensor_digest(dtype, [n], full), bounds


@pytest.mark.parametrize(("dtype", "uint"), DTYPES)
def test_a_delta_moves_each_part_by_its_changed_words_alone(dtype, uint):
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 300))
        old = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
        pos = np.sort(rng.choice(n, int(rng.integers(0, n + 1)), replace=False)).astype(np.int64)
        new = old.copy()
        new[pos] = rng.integers(0, np.iinfo(uint).max, pos.size, dtype=uint, endpoint=True)
        bounds = [0, *sorted(rng.integers(0, n + 1, 3).tolist()), n]

        def moved(lo, hi, old=old, new=new, pos=pos):
            local = pos[(pos >= lo) & (pos < hi)] - lo
            move = shards.interior_move(old[lo:hi], lo, local, new[lo:hi][local])
            return shards.add_sums(shards.interior_sum(old[lo:hi], lo), move)

        parts = _parts("t", dtype, new, bounds, moved, "delta")
        assert shards.combine_digest(dtype, [n], parts) == tensor_digest(dtype, [n], new)


def _rank(rank, *slices):
    return shards.RankPart(rank=rank, version=1, parent_digest=None, slices=list(slices))


def test_slices_that_overlap_leave_a_gap_or_disagree_are_refused_by_name():
    full = np.arange(10, dtype=np.uint16)
    a, b = _parts("w", "bfloat16", full, [0, 6, 10])
    over = _parts("w", "bfloat16", full, [0, 7, 10])[1]
    with pytest.raises(ChainError, match="slices of w overlap at element 5"):
        shards.tensor_entries([_rank(0, a), _rank(1, over.model_copy(update={"lo": 5}))])
    with pytest.raises(ChainError, match="cover 6 of 10 elements"):
        shards.tensor_entries([_rank(0, a)])
    with pytest.raises(ChainError, match="leave a gap at element 6"):
        shards.tensor_entries([_rank(0, a), _rank(1, over)])
    with pytest.raises(ChainError, match=r"new \(full\) or changed"):
        shards.tensor_entries([_rank(0, a), _rank(1, b.model_copy(update={"op": "delta"}))])
    (entry,) = shards.tensor_entries([_rank(1, b), _rank(0, a)])
    assert entry.digest == tensor_digest("bfloat16", [10], full)
    # uneven dim-0 shards: a last rank with no rows reports an empty slice at offset 0
    (whole,) = _parts("w", "bfloat16", full, [0, 10])
    (empty,) = _parts("w", "bfloat16", full[:0], [0, 0])
    empty = empty.model_copy(update={"shape": [10], "op": "delta"})
    (entry,) = shards.tensor_entries([_rank(0, whole), _rank(1, empty)])
    assert entry.digest == tensor_digest("bfloat16", [10], full)


def test_format_3_needs_streams_adding_up_and_format_2_bytes_carry_none(tmp_path):
    key = keys.generate(tmp_path / "k")
    store = BlockStore(tmp_path / "blocks")
    full = np.arange(64, dtype=np.uint16)
    parts = []
    for r, (lo, hi) in enumerate([(0, 40), (40, 64)]):
        w = BlockWriter(store, 64)
        (p,) = _parts("w", "bfloat16", full, [lo, hi])
        shards.write_full(w, p, full[lo:hi])
        parts.append(shards.RankPart(rank=r, version=0, parent_digest=None, slices=[p],
                                     snapshot_blocks=w.close()))
    tensors = shards.tensor_entries(parts)
    m = shards.assemble(parts, run="r", version=0, kind="snapshot", tensors=tensors,
                        parent=None).signed(key)
    assert m.streams == [len(parts[0].snapshot_blocks), len(parts[1].snapshot_blocks)]
    assert Manifest.parse(m.to_bytes(), key.public_key()) == m
    doc = m.model_dump(mode="json")
    with pytest.raises(ValueError, match="adding up to its stream blocks"):
        Manifest.model_validate({**doc, "streams": [1]})
    with pytest.raises(ValueError, match="needs format 3"):
        Manifest.model_validate({**doc, "format": FORMAT})
    plain = Manifest.model_validate({**doc, "format": FORMAT, "streams": None,
                                     "signature": None})
    assert b"streams" not in plain.canonical() and b"streams" not in plain.to_bytes()
    with pytest.raises(BadManifest, match="format 4 is not supported"):
        Manifest.parse(m.to_bytes().replace(b'"format":3', b'"format":4'), None)


def _fill_records(tmp_path, records):
    """Fill one bf16 tensor of 8 elements from `records` (op, at, count) over a zero base."""
    from chain.fill import Fill
    from chain.manifest import TensorEntry
    from chain.safetensors_io import TensorFiles, WritableFiles, allocate

    tmp_path.mkdir()
    w = BlockWriter(BlockStore(tmp_path / "b"), 1 << 16)
    val = np.arange(1, 9, dtype=np.uint16)
    for op, at, count in records:
        w.write_record(RecordHeader("w", op, "bfloat16", [8], 2 * count, at=at, count=count),
                       val[at:at + count].tobytes())
    blocks = w.close()
    allocate(tmp_path / "o.safetensors", [("w", "bfloat16", [8], 16)])
    t = TensorEntry(name="w", dtype="bfloat16", shape=[8],
                    digest=tensor_digest("bfloat16", [8], val))
    out = WritableFiles(tmp_path, ["o.safetensors"])
    store = BlockStore(tmp_path / "b")
    Fill(out, [t], "v1", None, {}).run(
        [BlockReader.of_blocks(blocks, lambda b: store.get(b.id, b.size))])
    return TensorFiles(tmp_path / "o.safetensors").bits("w")


def test_full_part_records_fill_a_tensor_and_gaps_or_overlaps_are_refused(tmp_path):
    got = _fill_records(tmp_path / "ok", [("full", 0, 3), ("full", 3, 5)])
    assert got.tolist() == list(range(1, 9))
    with pytest.raises(BadDelta, match=r"leave elements 3\.\.4 out"):
        _fill_records(tmp_path / "gap", [("full", 0, 3), ("full", 4, 4)])
    with pytest.raises(BadDelta, match="overlap at element 2"):
        _fill_records(tmp_path / "over", [("full", 0, 3), ("full", 2, 6)])
    with pytest.raises(BadDelta, match="past its 8"):
        _fill_records(tmp_path / "past", [("full", 0, 3), ("full", 3, 6)])

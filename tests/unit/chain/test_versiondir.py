"""VERSION.json is written byte for byte as `json.dumps(..., indent=1)` would write it (older
readers and the digests of carried files see the same file), by a faster path."""

import json

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import chain.versiondir as vd
from chain.codec import own_positions, split_positions
from chain.versiondir import (
    _HEAD,
    _MAGIC,
    CHANGES_FILE,
    FORMAT,
    BadVersionDir,
    ChangedPositions,
    VersionInfo,
    read_changes,
    read_info,
    write_changes,
    write_info,
)

names = st.text(min_size=0, max_size=12)


@given(tensors=st.dictionaries(names, names, max_size=8), run=names, digest=names,
       version=st.integers(0, 2**40))
def test_version_file_is_indented_json(tensors: dict, run: str, digest: str,
                                       version: int) -> None:
    info = VersionInfo(version, digest, run, tensors)
    want = json.dumps({"format": FORMAT, "version": version, "state_digest": digest,
                       "run": run, "tensors": tensors}, indent=1).encode()
    assert info.to_bytes() == want


def test_version_files_of_one_run_reuse_its_quoted_names_and_no_stale_ones() -> None:
    """The rows' quoted names are kept from one VERSION.json to the next of the same tensor
    list: each file still equals json's own, after new digests, a renamed tensor (same
    count) and a name json must escape."""
    def want(info: VersionInfo) -> bytes:
        return json.dumps({"format": FORMAT, "version": info.version, "state_digest":
                           info.state_digest, "run": info.run, "tensors": info.tensors},
                          indent=1).encode()

    first = {f"layer.{i}.w": f"{i:032x}" for i in range(5)}
    later = {k: f"{int(v, 16) + 7:032x}" for k, v in first.items()}
    renamed = {("layer.3.w\"\u00e9" if k == "layer.3.w" else k): v for k, v in later.items()}
    for version, tensors in enumerate([first, later, renamed, first]):
        info = VersionInfo(version, "d" * 32, "run", tensors)
        assert info.to_bytes() == want(info), version


def test_version_file_round_trips(tmp_path) -> None:
    tensors = {f"model.layers.{i}.mlp.experts.{j}.w1": f"{i:016x}{j:016x}"
               for i in range(3) for j in range(4)}
    tensors['odd "name"\n\u00e9\u2028'] = "0" * 32
    info = VersionInfo(7, "ab" * 16, "run-{}", tensors)
    write_info(tmp_path, info, None)
    assert read_info(tmp_path) == info


def test_a_version_file_whose_digests_are_not_strings_is_refused(tmp_path) -> None:
    """A damaged VERSION.json is rebuilt, never read as digests it does not hold (a digest
    that is no 32 hex digits stopped a bring-forward with a ValueError)."""
    write_info(tmp_path, VersionInfo(3, "ab" * 16, "r", {"a": "0" * 32}), None)
    doc = json.loads((tmp_path / "VERSION.json").read_bytes())
    for bad in ({"a": 5}, {"a": None}, ["a"], {"a": ["0" * 32]}, {"a": "0" * 31},
                {"a": "g" + "0" * 31}, {"a": "0" * 32, "b": "A" * 32},
                {"a": "0" * 31, "b": "0" * 33}):
        (tmp_path / "VERSION.json").write_text(json.dumps({**doc, "tensors": bad}))
        with pytest.raises(BadVersionDir, match="garbles field"):
            read_info(tmp_path)


def test_a_version_file_is_parsed_again_only_when_its_bytes_changed(tmp_path,
                                                                      monkeypatch) -> None:
    """A region reads its current VERSION.json several times an apply: bytes this process
    wrote or read are not parsed again; a file changed in one digest, at the same size (the
    same inode, perhaps the same coarse timestamps), is."""
    info = VersionInfo(3, "ab" * 16, "r", {"a": "0" * 32, "b": "1" * 32})
    write_info(tmp_path, info, None)
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda raw: parsed.append(1) or real(raw))
    assert read_info(tmp_path) == info and read_info(tmp_path) == info and parsed == []
    path = tmp_path / "VERSION.json"
    raw = path.read_bytes()
    flipped = raw.replace(b"1" * 32, b"1" * 31 + b"2")
    assert len(flipped) == len(raw) and flipped != raw
    with open(path, "r+b") as f:  # in place
        f.write(flipped)
    assert read_info(tmp_path).tensors["b"] == "1" * 31 + "2" and parsed == [1]
    assert read_info(tmp_path).tensors["b"] == "1" * 31 + "2" and parsed == [1]


@given(sizes=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), max_size=6),
       whole=st.lists(st.booleans(), max_size=6), seed=st.integers(0, 2**16))
def test_changes_round_trip_whatever_arrays_hold_the_positions(tmp_path_factory, sizes, whole,
                                                               seed) -> None:
    """CHANGES holds each tensor's positions as given, whether they are views cut from one
    array (a group's members, codec.split_positions), arrays of their own, another integer
    type, or None (whole): read back equal, in name order, with the header (made once, the
    check added last) that `json.dumps` of the four fields writes."""
    rng = np.random.default_rng(seed)
    changes: dict[str, np.ndarray | None] = {}
    for g, members in enumerate(sizes):
        offsets = np.cumsum([0, *[8 * (m + 1) for m in members]], dtype=np.int64)
        pos = np.sort(rng.choice(int(offsets[-1]), sum(members), replace=False)).astype(
            np.int64)
        for j, own in enumerate(split_positions(pos, offsets)):
            # interleaved with other groups' names: runs break wherever names do
            changes[f"t{(j * 7 + g) % 10}.{g}.{j}"] = own if j % 3 else own.astype(np.int32)
    for k, w in enumerate(whole):
        changes[f"w{k}"] = None if w else np.arange(k, dtype=np.int64)
    d = tmp_path_factory.mktemp("changes")
    write_changes(d, 9, changes)
    back = read_changes(d, 9)
    assert back is not None and list(back) == sorted(changes)
    for name, pos in changes.items():
        assert (back[name] is None) if pos is None else np.array_equal(back[name], pos)
    raw = (d / CHANGES_FILE).read_bytes()
    head = json.loads(raw[raw.index(b'{"version"'):raw.index(b'"}') + 2])
    assert list(head) == ["version", "tensors", "counts", "check"] and head["version"] == 9



@given(runs=st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(0, 5000), min_size=1,
                                                          max_size=4)), max_size=8),
       alone=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=6),
       seed=st.integers(0, 2**16))
def test_changes_collected_as_runs_read_back_per_tensor(tmp_path_factory, runs, alone,
                                                         seed) -> None:
    """An apply's ChangedPositions (groups' members as one array, tensors alone, in any order,
    a tensor given again after its group: the last counts) is written as the same CHANGES a
    mapping of each tensor's positions writes. Sizes reach past the length at which a run is
    written without being joined (4,096), so both ways of writing are taken."""
    rng = np.random.default_rng(seed)
    got, want = ChangedPositions(), {}
    for g, members in runs:
        offsets = np.cumsum([0, *[m + 1 for m in members]], dtype=np.int64)
        pos = np.sort(rng.choice(int(offsets[-1]), sum(members), replace=False)).astype(
            np.int64)
        names = [f"g{g}.{j}" for j in range(len(members))]
        own, cuts = own_positions(pos, offsets)
        got.members(names, own, cuts)
        want.update(zip(names, split_positions(pos, offsets), strict=True))
    for k, whole in alone:
        name = f"g{k % 10}.{k // 10}" if k % 2 else f"t{k}"  # odd: may repeat a member
        pos = None if whole else np.sort(rng.choice(50, k, replace=False)).astype(np.int64)
        got.tensor(name, pos)
        want[name] = pos
    d = tmp_path_factory.mktemp("runs")
    write_changes(d, 3, got)
    back = read_changes(d, 3)
    assert back is not None and list(back) == sorted(want)
    for name, pos in want.items():
        assert (back[name] is None) if pos is None else np.array_equal(back[name], pos), name
    e = tmp_path_factory.mktemp("mapping")
    write_changes(e, 3, want)
    assert (e / CHANGES_FILE).read_bytes() == (d / CHANGES_FILE).read_bytes()


def test_changed_members_need_one_cut_more_than_names() -> None:
    with pytest.raises(ValueError, match="2 tensors need 3 cuts, not 2"):
        ChangedPositions().members(["a", "b"], np.arange(4), [0, 4])


def test_changed_members_refuse_an_empty_run() -> None:
    """A run of no tensors has no first name to order it by: refused where it is given."""
    with pytest.raises(ValueError, match="a run needs a tensor"):
        ChangedPositions().members([], np.arange(0), [0])


def test_stored_changes_give_a_run_of_tensors_as_one_slice(tmp_path) -> None:
    """read_changes' StoredChanges: consecutive tensors' positions are one slice of the file's
    array with their counts; a run with a tensor changed whole, or names not consecutive
    there, has none (the caller asks tensor by tensor)."""
    changes = {"a": np.array([1, 4]), "b": np.array([], np.int64), "c": np.array([0, 2, 3]),
               "d": None, "e": np.array([7])}
    write_changes(tmp_path, 5, changes)
    back = read_changes(tmp_path, 5)
    assert back is not None and back.with_positions() == ["a", "b", "c", "e"]
    pos, counts = back.run(["a", "b", "c"])
    assert pos.tolist() == [1, 4, 0, 2, 3] and counts.tolist() == [2, 0, 3]
    assert np.shares_memory(pos, back.pos)
    assert back.run(["c", "d", "e"]) is None  # d changed whole
    assert back.run(["a", "c"]) is None and back.run(["zz"]) is None
    assert back["d"] is None and back["e"].tolist() == [7]


def test_stored_changes_whose_counts_miss_their_positions_are_not_read(tmp_path) -> None:
    write_changes(tmp_path, 2, {"a": np.array([1, 2]), "b": np.array([3])})
    raw = bytearray((tmp_path / CHANGES_FILE).read_bytes())
    at = raw.index(b'"counts": [2, 1]')
    raw[at:at + 16] = b'"counts": [2, 2]'
    (tmp_path / CHANGES_FILE).write_bytes(bytes(raw))
    assert read_changes(tmp_path, 2) is None


@pytest.mark.parametrize("damage", ["unsorted", "repeated_position", "negative", "name_twice",
                                    "names_out_of_order", "count_not_whole", "count_huge"])
def test_a_changes_header_or_body_the_apply_cannot_trust_is_not_read(tmp_path, damage) -> None:
    """CHANGES as a region reads it is checked: names strictly in order, whole counts, each
    tensor's positions strictly increasing from 0. The header is outside the checksum, so the
    file is rewritten here with a valid checksum over the body: it must still read as absent
    (the apply then copies whole tensors) rather than bring a stray position forward."""
    names, counts, pos = ["a", "b", "c"], [2, 1, 3], [1, 4, 0, 2, 5, 9]
    if damage == "unsorted":
        pos = [1, 4, 0, 5, 2, 9]
    elif damage == "repeated_position":
        pos = [1, 1, 0, 2, 5, 9]
    elif damage == "negative":
        pos = [1, 4, -2, 2, 5, 9]
    elif damage == "name_twice":
        names = ["a", "b", "b"]
    elif damage == "names_out_of_order":
        names = ["a", "c", "b"]
    elif damage == "count_not_whole":
        counts = [2, 1.0, 3]
    else:
        counts = [2, 2**63, 3]
    def stored(names: list, counts: list, pos: list) -> None:
        body = np.array(pos, np.int64).tobytes()
        head = json.dumps({"version": 4, "tensors": names, "counts": counts,
                           "check": xxhash.xxh3_64_hexdigest(body)}).encode()
        (tmp_path / CHANGES_FILE).write_bytes(_HEAD.pack(_MAGIC, len(head)) + head + body)

    stored(names, counts, pos)
    assert read_changes(tmp_path, 4) is None
    stored(["a", "b", "c"], [2, 1, 3], [1, 4, 0, 2, 5, 9])  # the same file, nothing wrong
    back = read_changes(tmp_path, 4)
    assert back is not None and back["c"].tolist() == [2, 5, 9]


def test_changes_written_over_a_larger_file_in_place_keep_none_of_its_tail(tmp_path) -> None:
    """CHANGES is written over the file already there (its pages reused, not replaced): the
    same inode, cut to the new length, and reading back only the new version's positions."""
    big = {f"t{k}": np.arange(k, 5000, 3, dtype=np.int64) for k in range(20)}
    write_changes(tmp_path, 3, big)
    inode = (tmp_path / CHANGES_FILE).stat().st_ino
    small = {"a": np.array([2, 7]), "b": None}
    write_changes(tmp_path, 4, small, mode=0o640)
    path = tmp_path / CHANGES_FILE
    assert path.stat().st_ino == inode and path.stat().st_mode & 0o777 == 0o640
    back = read_changes(tmp_path, 4)
    assert back is not None and list(back) == ["a", "b"] and back["b"] is None
    assert back["a"].tolist() == [2, 7] and read_changes(tmp_path, 3) is None
    assert path.stat().st_size == len(path.read_bytes()) < 200


def test_changes_are_not_written_through_a_symlink(tmp_path) -> None:
    """CHANGES written over in place replaces a symlink in its place with a file of its own
    instead of overwriting the file it names (another directory's CHANGES, say)."""
    other = tmp_path / "other"
    other.mkdir()
    write_changes(other, 3, {"a": np.arange(4)})
    before = (other / CHANGES_FILE).read_bytes()
    d = tmp_path / "d"
    d.mkdir()
    (d / CHANGES_FILE).symlink_to(other / CHANGES_FILE)
    write_changes(d, 4, {"a": np.arange(2)})
    assert (other / CHANGES_FILE).read_bytes() == before
    assert not (d / CHANGES_FILE).is_symlink()
    back = read_changes(d, 4)
    assert back is not None and back["a"].tolist() == [0, 1]


@pytest.mark.parametrize("written", [0, 10])
def test_changes_cut_short_while_written_over_are_not_read(tmp_path, monkeypatch,
                                                           written) -> None:
    """A write stopped part way (killed, a full disk), before any position of the body or
    after some, leaves the blank check at the head of the file written over: read as absent
    (whole tensors copied next), never the old version's positions or a mix."""
    write_changes(tmp_path, 3, {"a": np.arange(0, 9000, 2), "b": np.arange(5)})

    def cut(parts, **_kw):
        if written:
            yield np.ascontiguousarray(parts[0][:written], dtype=np.int64)
        raise OSError("no space left on device")

    monkeypatch.setattr(vd, "_chunks", cut)
    with pytest.raises(OSError, match="no space"):
        write_changes(tmp_path, 4, {"a": np.arange(0, 9000, 3), "b": np.arange(7)})
    assert read_changes(tmp_path, 4) is None and read_changes(tmp_path, 3) is None


@given(values=st.sets(st.integers(0, 60), max_size=20), these=st.sets(st.integers(0, 70),
                                                                     max_size=8))
def test_steps_down_are_checked_among_the_firsts_as_isin_would(values, these) -> None:
    """The check that each step down in CHANGES' positions starts a tensor (a binary search
    over the sorted firsts) answers as np.isin does, empty sides included."""
    big, small = np.array(sorted(values), np.int64), np.array(sorted(these), np.int64)
    assert vd._all_among(small, big) == bool(np.isin(small, big).all())

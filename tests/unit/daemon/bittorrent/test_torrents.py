"""daemon.bittorrent.torrents: our v2 torrents equal libtorrent's, are deterministic, and are
checked
against what a signed manifest pins (ids, sizes, pieces roots, piece layers)."""

import os
import warnings
from pathlib import Path

import libtorrent as lt
import pytest

from chain.digest import block_id, pieces_root
from daemon.bittorrent import torrents
from daemon.bittorrent.torrents import BadTorrent

ART = "v00000007.delta"
# edge sizes: 1 byte, one leaf, one leaf + 1, a partial piece, exactly a piece, many pieces + tail
SIZES = [1, 16384, 16385, 5 * 16384 + 7, 1 << 18, 3 * (1 << 18) + 12345, 0]


def _blocks(tmp_path: Path, sizes=SIZES, seed: int = 0) -> list[tuple[str, Path, int, str]]:
    out = []
    for i, n in enumerate(sizes):
        data = (os.urandom(n) if seed is None else bytes((i * 7 + j + seed) % 251
                                                          for j in range(n)))
        b = block_id(data)
        p = tmp_path / "store" / b
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out.append((b, p, n, pieces_root(data)))
    return out


def _libtorrent_torrent(tmp_path: Path, blocks, piece_size: int) -> bytes:
    torrents.link_blocks(ART, [(b, p) for b, p, _, _ in blocks], tmp_path / "lt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fs = lt.file_storage()
        lt.add_files(fs, str(tmp_path / "lt" / ART))
        ct = lt.create_torrent(fs, piece_size, flags=lt.create_torrent.v2_only)
        lt.set_piece_hashes(ct, str(tmp_path / "lt"))
        entry = ct.generate()
    entry.pop(b"creation date", None)
    return lt.bencode(entry)


@pytest.mark.parametrize("piece_size", [16384, 1 << 18])
def test_torrent_matches_libtorrent_and_pieces_roots(tmp_path, piece_size):
    blocks = _blocks(tmp_path, seed=None)
    ours = torrents.make_torrent(ART, [(b, p) for b, p, _, _ in blocks], piece_size)
    theirs = _libtorrent_torrent(tmp_path, blocks, piece_size)
    assert ours == theirs
    ti = lt.torrent_info(lt.bdecode(ours))
    assert str(ti.info_hashes().v2) == torrents.info_hash(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        files = ti.files()
    roots = {}
    for i in range(files.num_files()):
        if not files.file_flags(i) & lt.file_storage.flag_pad_file:
            root = str(files.root(i))
            roots[Path(files.file_path(i)).name] = "" if set(root) == {"0"} else root
    assert roots == {b: r for b, _, _, r in blocks}


def test_torrent_is_deterministic_and_matches_manifest_info_hash(tmp_path):
    blocks = _blocks(tmp_path)
    pairs = [(b, p) for b, p, _, _ in blocks]
    a = torrents.make_torrent(ART, pairs, 1 << 18)
    b = torrents.make_torrent(ART, list(reversed(pairs)) + pairs[:1], 1 << 18)
    assert a == b
    pinned = [(b, n, r) for b, _, n, r in blocks]
    assert torrents.info_hash(a) == torrents.expected_info_hash(ART, pinned, 1 << 18)
    assert torrents.info_hash(torrents.make_torrent(ART, pairs, 1 << 16)) != torrents.info_hash(a)


def test_torrent_layout_puts_blocks_at_block_path(tmp_path):
    blocks = _blocks(tmp_path, sizes=[100, 40000])
    tb = torrents.make_torrent(ART, [(b, p) for b, p, _, _ in blocks], 1 << 18)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        files = lt.torrent_info(lt.bdecode(tb)).files()
    paths = {tmp_path / files.file_path(i) for i in range(files.num_files())
             if not files.file_flags(i) & lt.file_storage.flag_pad_file}
    assert paths == {torrents.block_path(tmp_path, ART, b) for b, _, _, _ in blocks}


def test_check_accepts_the_pinned_torrent(tmp_path):
    blocks = _blocks(tmp_path)
    tb = torrents.make_torrent(ART, [(b, p) for b, p, _, _ in blocks], 1 << 16)
    torrents.check_torrent_against(tb, [(b, n, r) for b, _, n, r in blocks], ART)


def test_check_refuses_wrong_size_root_extra_and_missing_files(tmp_path):
    blocks = _blocks(tmp_path, sizes=[5000, 70000, 300000])
    tb = torrents.make_torrent(ART, [(b, p) for b, p, _, _ in blocks], 1 << 16)
    pinned = [(b, n, r) for b, _, n, r in blocks]
    b0, n0, r0 = pinned[0]
    with pytest.raises(BadTorrent, match="bytes in the torrent"):
        torrents.check_torrent_against(tb, [(b0, n0 + 1, r0), *pinned[1:]])
    with pytest.raises(BadTorrent, match="pieces root"):
        torrents.check_torrent_against(tb, [(b0, n0, pinned[1][2]), *pinned[1:]])
    with pytest.raises(BadTorrent, match="extra"):
        torrents.check_torrent_against(tb, pinned[1:])
    with pytest.raises(BadTorrent, match="missing"):
        torrents.check_torrent_against(tb, [*pinned, ("f" * 32, 10, "0" * 64)])
    with pytest.raises(BadTorrent, match="named"):
        torrents.check_torrent_against(tb, pinned, "v00000008.delta")


def test_check_refuses_forged_piece_layer_and_garbage(tmp_path):
    blocks = _blocks(tmp_path, sizes=[300000])
    tb = torrents.make_torrent(ART, [(b, p) for b, p, _, _ in blocks], 1 << 16)
    top = torrents.bdecode(tb)
    (root, layer), = top[b"piece layers"].items()
    top[b"piece layers"][root] = bytes(32) + layer[32:]
    pinned = [(b, n, r) for b, _, n, r in blocks]
    with pytest.raises(BadTorrent, match="piece layer"):
        torrents.check_torrent_against(torrents.bencode(top), pinned)
    for junk in (b"", b"d4:infoi1ee", b"l" * 5000, tb[:-1], b"d1:zi1e" + tb[1:]):
        with pytest.raises(BadTorrent):
            torrents.check_torrent_against(junk, pinned)


def test_make_torrent_refuses_bad_input(tmp_path):
    blocks = _blocks(tmp_path, sizes=[10])
    pairs = [(b, p) for b, p, _, _ in blocks]
    with pytest.raises(BadTorrent, match="piece size"):
        torrents.make_torrent(ART, pairs, 3 * 16384)
    with pytest.raises(BadTorrent, match="block id"):
        torrents.make_torrent(ART, [("../etc/passwd", blocks[0][1])], 1 << 16)
    with pytest.raises(BadTorrent, match="artifact name"):
        torrents.make_torrent("../x", pairs, 1 << 16)
    with pytest.raises(BadTorrent, match="no blocks"):
        torrents.make_torrent(ART, [], 1 << 16)


def test_a_given_manifest_root_gives_the_same_torrent_as_computing_it(tmp_path):
    datas = [os.urandom(n) for n in (1, 16384, 70_000, 300_000)]
    paths = []
    for i, d in enumerate(datas):
        p = tmp_path / f"b{i}"
        p.write_bytes(d)
        paths.append((block_id(d), p, pieces_root(d)))
    assert torrents.make_torrent(ART, paths, 1 << 16) == \
        torrents.make_torrent(ART, [(b, p) for b, p, _ in paths], 1 << 16)
    wrong = [(b, p, "00" * 32) for b, p, _ in paths]
    pins = [(b, len(d), r) for (b, _, r), d in zip(paths, datas, strict=True)]
    with pytest.raises(torrents.BadTorrent):
        torrents.check_torrent_against(torrents.make_torrent(ART, wrong, 1 << 16), pins, ART)
